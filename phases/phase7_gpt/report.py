"""Phase 7's README blocks, declared (rendered by common/render.py): the data, the model's
parameters, overfitting and throughput, the scaling law, the failures, their plots, the findings.
Notes and findings are templates over stored values; verdicts and ratios come from the records or
from analysis.py. The seed write-up's figures appear only where labelled as the seed's."""
from common import roofline
from common.calibration import ceilings_for
from common.formats import bullets, num, num4, pct, ratio, si
from common.frame import by_hardware, find, value
from common.spec import Goal, Goals, Phase, Plot, Table, Text, col, ident

from . import analysis, plots
from .cost import GPTConfig, step_cost
from .findings import findings


def variants(*names):
    return lambda df: df[df["variant"].isin(names)]


def pair(a: str, b: str, fmt=num):
    return lambda r: f"{fmt(value(r, a))} / {fmt(value(r, b))}"


def part(d: str, k: str):
    return lambda r: (value(r, d) or {}).get(k)


def yes(x) -> str:
    return "-" if x is None else ("yes" if x else "no")


def signed(x) -> str:
    """A signed percentage difference: +34.3%."""
    return "-" if x is None or x != x else f"{float(x):+.1f}%"


def shape(r) -> str:
    m = value(r, "params.model") or {}
    return f"{m['n_layer']}L x {m['n_embd']}d x {m['n_head']}h" if m else "-"


def per_record(rows):
    """(path, that record's rows) for each record among `rows`."""
    return [(p, rows[rows["path"] == p]) for p in dict.fromkeys(rows["path"])]


def seed_note(view, rows) -> str:
    cite = value(rows.iloc[0], "summary.seed_citation") if len(rows) else None
    return f"_Seed figures: quoted from the {cite}; not measured by this lab._" if cite else ""


def best(r) -> str:
    return f"{num4(value(r, 'metrics.best_val_loss'))} @ {num(value(r, 'metrics.best_val_step'))}"


BEST = col("best val loss @ step", best)


# ------------------------------------------------------------------------------ 7.1, 7.2
def data_note(view, rows) -> str:
    r = rows.iloc[0]
    every = view.latest(r["exercise"])
    s, st = value(r, "summary.seed") or {}, find(every[every["path"] == r["path"]], "storage")
    out = (f"The seed write-up counted {num(s.get('chars'))} characters, {num(s.get('tokens'))} tokens ("
           f"{num(s.get('chars_per_token'))} per token) and a {num(s.get('train_tokens'))} / {num(s.get('val_tokens'))} "
           "split; the row's check requires the same token count.")
    if st is not None:
        out += (f" All ids take {num(st['metrics.bytes_uint16'])} bytes as uint16, {num(st['metrics.bytes_int32'])} "
                f"as int32, {num(st['metrics.bytes_int64'])} as int64.")
    return out + "\n\n" + seed_note(view, rows)


DATA = Table("phase7.data_prep", "phase7.data_prep", where=variants("tokenize"), prediction=False, note=data_note, columns=(
    col("characters", "metrics.chars", num), col("distinct characters", "metrics.distinct_chars", num),
    col("GPT-2 tokens", "metrics.tokens", num),
    col("vocabulary (used)", lambda r: f"{num(r['metrics.vocab_size'])} ({num(r['metrics.distinct_tokens_used'])})"),
    col("characters / token", "metrics.chars_per_token", num),
    col("attention cost, characters / tokens", "metrics.attention_cost_ratio_chars_over_tokens", ratio),
    col("train / val tokens (token split)", pair("metrics.train_tokens", "metrics.val_tokens")),
    col("train / val tokens (character split, nanoGPT)",
        pair("metrics.char_split_train_tokens", "metrics.char_split_val_tokens")),
    col("decode(encode(text)) == text", "metrics.roundtrip_exact", yes),
    col("stored split == fresh", "metrics.stored_split_matches", yes)),
    more=(col("largest id", "metrics.max_token_id", num),
          col("tokenizer tokens/s (1 CPU thread)", "metrics.tokenizer_tokens_per_s", num)))


def params_note(view, rows) -> str:
    big = find(rows, "params_30m")
    if big is None:
        return ""
    m, s = big["params.model"], value(big, "metrics.seed") or {}
    return (f"Closed forms (V = {num(m['vocab_size'])}, T = {m['block_size']}, d = width, L = layers): wte V d, wpe T d, "
            "blocks L (12 d² + 4 d), final LayerNorm 2 d, lm head V d when untied; a row fails unless the module's count "
            f"equals them. The seed write-up's 30M table: wte {s.get('wte')}, wpe {s.get('wpe')}, blocks {s.get('blocks')}, "
            f"total {s.get('total')} (head tied).")


COUNTS = (("wte", "token embedding"), ("wpe", "position embedding"), ("blocks", "blocks"), ("ln_f", "final LayerNorm"),
          ("lm_head", "lm head"), ("total", "total"), ("non_embedding", "non-embedding"))
PARAMS = Table("phase7.model", "phase7.model", where=variants("params_30m", "params_7m", "params_30m_untied"),
               prediction=False, note=params_note, columns=(
                   ident("model", "variant"), ident("shape", shape),
                   *(col(h, part("metrics.counted", k), num) for k, h in COUNTS),
                   col("token embedding share", "metrics.wte_pct_of_total", pct)))


INIT = Table("phase7.init_loss", "phase7.model", where=variants("init_loss"), prediction=False, columns=(
    ident("model", shape), ident("batch (B x T)", lambda r: " x ".join(map(str, value(r, "params.batch") or []))),
    col("initial loss", "metrics.initial_loss", num4), col("ln(V)", "metrics.ln_vocab", num4),
    col("gap", "metrics.gap", num),
    col("logits", lambda r: " x ".join(map(str, r["metrics.logits_shape"]))),
    col("seed's initial loss", "metrics.seed_initial_loss", num4)))

ATTENTION = Table("phase7.attention", "phase7.model", where=variants("sdpa_flash", "sdpa_math"), columns=(
    ident("SDPA backend", "params.backend"), ident("model", shape),
    ident("batch (B x T)", lambda r: " x ".join(map(str, value(r, "params.batch") or []))),
    col("ms", "metrics.ms", num), col("tokens/s", "metrics.tokens_per_s", num), col("TFLOP/s", "metrics.tflops", num),
    col("% of spec peak", "metrics.pct_of_peak_tflops", pct)))


# ------------------------------------------------------------------------------ 7.3
OVERFIT = Table("phase7.overfit", "phase7.overfit", where=variants("large", "small"), prediction=False, columns=(
    ident("model", lambda r: f"{r['variant']} ({shape(r)})"), col("params", "metrics.params_total", num),
    col("unique tokens / param", "metrics.unique_tokens_per_param", num), col("steps", "metrics.steps", num),
    col("epochs", "metrics.epochs", num), BEST, col("final train loss", "metrics.final_train_loss", num4),
    col("final val loss", "metrics.final_val_loss", num4),
    col("longest verbatim run in sample (characters)", part("metrics.sample", "longest_verbatim_chars"), num),
    col("sample 8-grams found in train", lambda r: pct(100 * (r["metrics.sample"]["train_8gram_fraction"] or 0)))))


def sample_text(r) -> str:
    text = r["metrics.sample"]["text"].strip("\n")
    for a, b in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ("|", "\\|"), ("\n", "<br>")):
        text = text.replace(a, b)
    return text


SAMPLES = Table("phase7.samples", "phase7.overfit", where=variants("large", "small"), prediction=False, columns=(
    ident("model", "variant"), col("temperature", part("metrics.sample", "temperature"), num),
    col("top-k", part("metrics.sample", "top_k"), num),
    col("sample after the last step (first 300 characters)", sample_text)))


def throughput_note(view, rows) -> str:
    out = []
    for path, mine in per_record(rows):
        th, rp = find(mine, "throughput"), mine[mine["variant"] == "reproducibility"]
        claims = []
        if th is not None:
            claims.append(f"MFU against the {num(th['metrics.mfu_spec_peak_tflops'])} TFLOP/s {th['params.dtype']} peak "
                          f"({th['metrics.mfu_spec_source']}).")
            claims.append(f"MFU against the {num(th['metrics.phase1_ceiling_tflops'])} TFLOP/s phase 1 measured ([its record]("
                          f"{view.link(th['metrics.phase1_ceiling_source'].removeprefix('results/'))}))."
                          if value(th, "metrics.phase1_ceiling_tflops") else "No phase 1 ceiling was recorded.")
            claims.append(f"FLOPs per token: {th['metrics.flops_convention']}.")
        if len(rp) and value(rp.iloc[0], "metrics.loss_difference") is not None:
            r, tol = rp.iloc[0], view.record(path)["params"].get("repro_tolerance")
            claims.append(f"Reproducibility: two fresh runs with seed {r['params.train']['seed']} gave train loss "
                          f"{num4(r['metrics.loss_run_a'])} and {num4(r['metrics.loss_run_b'])} at step "
                          f"{num(r['metrics.repro_step'])}: a difference of {num(r['metrics.loss_difference'])}, "
                          f"{'within' if r['status'] == 'ok' else '**outside**'} the {num(tol)} tolerance.")
        out.append(bullets(claims, f"{mine.iloc[0]['hardware_name']}:"))
    return "\n\n".join(x for x in out if x)


THROUGHPUT = Table("phase7.throughput", "phase7.overfit", note=throughput_note, columns=(
    ident("run", "variant"), col("params", "metrics.params_total", num),
    col("torch.compile", lambda r: analysis.compiled(r["params.train"], value(r, "metrics.compile_error")), yes),
    col("batch (B x T)", lambda r: f"{r['params.train']['batch_size']} x {r['params.model']['block_size']}"),
    col("ms/step (median)", "metrics.ms", num), col("tokens/s", "metrics.tokens_per_s", num),
    col("model TFLOP/s", "metrics.model_tflops", num), col("MFU (spec)", "metrics.mfu_pct_of_spec", pct),
    col("MFU (phase 1 ceiling)", "metrics.mfu_pct_of_phase1", pct)))

STAGES = ("data", "forward", "backward", "optimizer")
BREAKDOWN = Table("phase7.step_breakdown", "phase7.overfit", where=variants("throughput", "throughput_eager"),
                  prediction=False, columns=(
                      ident("run", "variant"),
                      *(col(f"{k} ms (share)", lambda r, k=k: f"{num(r['metrics.step_breakdown'][f'{k}_ms'])} "
                            f"({pct(r['metrics.step_breakdown'][f'{k}_pct'])})") for k in STAGES),
                      col("total ms", part("metrics.step_breakdown", "total_ms"), num),
                      col("host ms: data / fwd / bwd / opt", lambda r: " / ".join(
                          num(r["metrics.step_breakdown"][f"{k}_host_ms"]) for k in STAGES))))

GOALS = Goals("phase7.goals", (
    Goal("30M model's training throughput", "phase7.overfit", "metrics.tokens_per_s", analysis.GOAL_TOKENS_PER_S,
         "the lab's bar for one GPU (analysis.GOAL_TOKENS_PER_S), about 5x the seed write-up's A100 rate",
         where=variants("throughput"), fmt=lambda x: f"{num(x)} tokens/s",
         detail=lambda r: f"{ratio(value(r, 'summary.throughput_over_seed_30m'))} the seed's A100"),))


# ------------------------------------------------------------------------------ 7.4, 7.5
def scaling_note(view, rows) -> str:
    out = []
    for path, _ in per_record(rows):
        s = view.record(path)["summary"]
        for key, name in (("fit_non_embedding", "non-embedding parameters"), ("fit_total", "all parameters")):
            f = s.get(key)
            if f:
                bs = f["bootstrap"]
                out.append(f"Fit over {name} ({f['points']} points): L = {num4(f['a'])} N^-{num(f['alpha'])}; 95% "
                           f"bootstrap interval of the exponent [{num(bs['low'])}, {num(bs['high'])}] ({bs['used']} of "
                           f"{bs['resamples']} resamples); R² {num(f['r2'])}; largest point error "
                           f"{pct(f['max_abs_error_pct'])}.")
        sf = (s.get("seed") or {}).get("fit") or {}
        out.append(f"For comparison: the seed fitted L = {sf.get('a')} N^-{sf.get('alpha')} on its {sf.get('points')} "
                   f"models (non-embedding N); Kaplan et al. (2020) report alpha_N = {s.get('kaplan_alpha_n')}.")
    return "\n\n".join(out + [seed_note(view, rows)])


def seed_point(r) -> str:
    p = value(r, "metrics.seed_point")
    return f"{num(p[0])}: {num4(p[1])} @ {num(p[2])}" if p else "-"


SCALING = Table("phase7.scaling", "phase7.scaling", prediction=False, note=scaling_note, columns=(
    ident("size", "variant"), ident("shape", shape), col("params", "metrics.n_total", num),
    col("non-embedding params", "metrics.n_non_embedding", num), BEST, col("steps run", "metrics.steps", num),
    col("tokens seen / param at best", "metrics.tokens_seen_per_param_at_best", num),
    col("Chinchilla: 20 N_ne / unique tokens", "metrics.chinchilla_underfed_factor_non_embedding", ratio),
    col("fit error (N_ne)", "metrics.fit_error_pct_non_embedding", signed),
    col("seed: N_ne: best val @ iter", seed_point)),
    more=(col("fit error (N total)", "metrics.fit_error_pct_total", signed),))


def switch(k: str, fmt):
    return lambda r: fmt(part("metrics.switches", k)(r))


SWITCHES = (col("residual", switch("residual", lambda x: "on" if x else "OFF")),
            col("LayerNorm", switch("layernorm", lambda x: "on" if x else "OFF")),
            col("warmup steps", switch("warmup_iters", num)), col("lr", switch("lr", num)),
            col("clip", switch("grad_clip", lambda x: num(x) if x else "off")))


def switches(r) -> str:
    """A run's five switches in one cell, in SWITCHES' order (the CSV has a column each)."""
    return " / ".join(_cell(c, r) for c in SWITCHES)


def _cell(c, r) -> str:
    return c.fmt(c.key(r))


FAILURES = Table("phase7.failures", "phase7.failures", prediction=False, note=seed_note, columns=(
    ident("run", "variant"), ident("model", shape), col(" / ".join(c.header for c in SWITCHES), switches),
    col("outcome", "metrics.outcome"), BEST, col("final val vs control", "metrics.final_val_vs_control_pct", signed),
    col("grad norm min / max", pair("metrics.grad_norm_min", "metrics.grad_norm_max")),
    col("activation RMS last block / embedding (init)", "metrics.activation_rms_last_over_first", num),
    col("seed's result", "metrics.seed_result")),
    more=(*SWITCHES, col("final val", "metrics.final_val_loss", num4)))


def with_ok(exercise: str):
    def hardware(view) -> list[str]:
        rows = view.latest(exercise, measured_only=True)
        return sorted(set(rows[rows["status"] == "ok"]["hardware"])) if len(rows) else []
    return hardware


def plot(name: str, draw, caption: str) -> Plot:
    ex = f"phase7.{name}"
    return Plot(f"{ex}_plot", f"phase7_{name}", (ex,), draw, caption, hardware=with_ok(ex))


def headline(view) -> list[str]:
    out = []
    for _, got in sorted(by_hardware(view.frame, ["phase7.overfit", "phase7.scaling"]).items()):
        th = find(got.get("phase7.overfit"), "throughput")
        if th is not None:
            sc = got.get("phase7.scaling")
            fit = value(sc.iloc[0], "summary.fit_non_embedding") if sc is not None else None
            out.append(f"{th['hardware_name']}: {si(th['metrics.params_total'])}-parameter GPT at "
                       f"{si(th['metrics.tokens_per_s'])} tokens/s (MFU {pct(th['metrics.mfu_pct_of_spec'])})"
                       + (f", scaling exponent {num(fit['alpha'])}" if fit else ""))
    return out


# ------------------------------------------------------------------------------ predictions of older rows
def row_cost(r) -> dict | None:
    """FLOPs, bytes and kernels of a timed phase 7 row, recounted from its parameters with cost.py:
    the step_cost call its exercise makes (model.sdpa_cost, train.train_cost). None for untimed rows."""
    model, dtype = value(r, "params.model"), value(r, "params.dtype")
    if not isinstance(model, dict) or dtype is None or value(r, "timing.median_ms") is None:
        return None
    cfg = GPTConfig(**model)
    if r["exercise"] == "phase7.model":
        if r["variant"] not in ("sdpa_flash", "sdpa_math"):
            return None
        return step_cost(cfg, value(r, "params.batch")[0], dtype, optimizer=False, data=False,
                         attention="flash" if r["variant"] == "sdpa_flash" else "math")
    tc = value(r, "params.train") or {}
    return step_cost(cfg, tc["batch_size"], dtype, compiled=analysis.compiled(tc, value(r, "metrics.compile_error")),
                     clip=bool(tc.get("grad_clip")))




def recount(r, records) -> dict | None:
    """The calibrated prediction of a phase 7 row without one stored: recounted with cost.py, since
    records written before it stored FLOPs without launches and bytes without the gradient norm's
    read and the activations (the records stay as written; this is what the report predicts)."""
    ceilings = ceilings_for(records, r["hardware"], value(r, "started"))
    measured = value(r, "prediction.measured_ms") or value(r, "metrics.ms")
    if ceilings is None or not measured or r["source"] != "measured":
        return None
    cost = row_cost(r)
    if cost is None:
        return None
    out = roofline.calibrated(cost["flops"], cost["bytes"], value(r, "params.dtype"), ceilings, measured,
                              working_set_bytes=cost["bytes"], warm=not value(r, "timing.flush_l2", True),
                              graph_reps=value(r, "timing.graph_reps"), launches=cost["launches"])
    return {**out, "computed": "at report time, recounted from the row's parameters (phase7_gpt/cost.py)"}


PHASE = Phase(7, "A GPT from scratch", "phase7_gpt", headline=headline, blocks=(
    DATA, PARAMS, INIT, ATTENTION, OVERFIT, plot("overfit", plots.overfit, "Training and validation loss on the {name}"),
    SAMPLES, THROUGHPUT, BREAKDOWN, GOALS, SCALING,
    plot("scaling", plots.scaling, "Best validation loss against parameters on the {name}, with the fitted power laws"),
    FAILURES, plot("failures", plots.failures, "Loss and gradient norm of every step on the {name}"),
    Text("phase7.findings", findings, "_No phase 7 records yet._")),
    calibrators={ex: recount for ex in ("phase7.model", "phase7.overfit", "phase7.scaling", "phase7.failures")})
