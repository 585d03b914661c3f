"""Phase 7's README blocks and plots, written from records only.

Blocks (in phases/phase7_gpt/README.md): phase7.data_prep, phase7.model, phase7.overfit,
phase7.throughput, phase7.scaling, phase7.failures, phase7.findings.
Plots (results/plots/): phase7_overfit_<hw>.png, phase7_scaling_<hw>.png, phase7_failures_<hw>.png.
The seed's figures appear only in columns labelled as the seed's (seed.CITATION).
"""
from pathlib import Path

from common.report import NO_RECORDS, View, latest, markdown, num, pct

from . import seed

EXS = ("phase7.data_prep", "phase7.model", "phase7.overfit", "phase7.scaling", "phase7.failures")
SEED_NOTE = f"_Seed columns: quoted from the {seed.CITATION}; not measured by this lab._"


# ------------------------------------------------------------------------------ helpers
def _measured(v: View, ex: str):
    sub = latest(v.df, ex)
    return sub[sub["source"] == "measured"] if len(sub) else sub


def _groups(v: View, ex: str):
    """[(hardware name, rows of its newest record, that record)] for each hardware."""
    sub = _measured(v, ex)
    out = []
    for _, rows in (sub.groupby("hardware", sort=True) if len(sub) else []):
        out.append((rows.iloc[0]["hardware_name"], rows, v.record(rows.iloc[0]["path"])))
    return out


def _rows(rec: dict) -> dict:
    return {r["variant"]: r for r in rec["rows"]}


def _ok(rec: dict, variant: str):
    r = _rows(rec).get(variant)
    return r if r is not None and r["status"] == "ok" else None


def _m(r, *keys, default=None):
    x = (r or {}).get("metrics", {})
    for k in keys:
        if not isinstance(x, dict) or x.get(k) is None:
            return default
        x = x[k]
    return x


def _label(v: View, rec: dict) -> str:
    return f"[{rec['provenance']['started_utc'][:10]} {(rec['provenance'].get('commit') or '')[:7]}]({v.link(rec['_path'])})"


def _shape(r) -> str:
    m = r["params"]["model"]
    return f"{m['n_layer']}L x {m['n_embd']}d x {m['n_head']}h"


def _count(x) -> str:
    if x is None:
        return "-"
    x = float(x)
    return f"{x / 1e6:.2f}M" if x >= 1e6 else (f"{x / 1e3:.1f}K" if x >= 1e4 else f"{x:,.0f}")


def _rate(x) -> str:
    if x is None:
        return "-"
    x = float(x)
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.0f}K" if x >= 1e3 else f"{x:.0f}"


def _loss(x) -> str:
    return "-" if x is None else f"{float(x):.3f}"


def _signed_pct(x) -> str:
    return "-" if x is None else f"{float(x):+.1f}%"


def _plot(v: View, rec: dict, kind: str, title: str) -> str:
    """The image line for a plot that draw() makes from this record (only if it has ok rows)."""
    if not any(r["status"] == "ok" for r in rec["rows"]):
        return ""
    path = f"plots/phase7_{kind}_{rec['hardware']['key']}.png"
    return f"\n![{title}]({v.link(path)})"


def _none(ex: str) -> str:
    return NO_RECORDS.format(ex=ex)


def _status_cells(r, width: int) -> list[str]:
    return [f"{r['status']}: {r['reason']}"] + ["-"] * (width - 1)


# ------------------------------------------------------------------------------ 7.1 data
def t_data_prep(v: View) -> str:
    groups = _groups(v, "phase7.data_prep")
    if not groups:
        return _none("phase7.data_prep")
    _, _, rec = groups[-1]                      # the data do not depend on the GPU: the newest record
    tok, st = _ok(rec, "tokenize"), _ok(rec, "storage")
    if tok is None:
        r = _rows(rec).get("tokenize")
        return f"Tokenization {r['status'] if r else 'missing'}: {(r or {}).get('reason')} ({_label(v, rec)})"
    m, s = tok["metrics"], seed.DATA
    rows = [["characters", f"{m['chars']:,}", f"{s['chars']:,}"],
            ["distinct characters", f"{m['distinct_chars']:,}", "-"],
            ["GPT-2 BPE tokens", f"{m['tokens']:,}", f"{s['tokens']:,}"],
            ["vocabulary", f"{m['vocab_size']:,} ({m['distinct_tokens_used']:,} used)", f"{s['vocab']:,}"],
            ["characters per token", f"{m['chars_per_token']:.2f}", f"{s['chars_per_token']:.2f}"],
            ["attention cost, characters / tokens (ratio^2)", f"{m['attention_cost_ratio_chars_over_tokens']:.1f}x", "-"],
            ["train / val, 90/10 on the token stream", f"{m['train_tokens']:,} / {m['val_tokens']:,}",
             f"{s['train_tokens']:,} / {s['val_tokens']:,}"],
            ["train / val, 90/10 on characters (nanoGPT)", f"{m['char_split_train_tokens']:,} / {m['char_split_val_tokens']:,}", "-"],
            ["largest token id", f"{m['max_token_id']:,} (< 65,536)", "-"],
            ["decode(encode(text)) == text", "yes" if m["roundtrip_exact"] else "NO", "-"],
            ["stored .u16 split == fresh tokenization", "yes" if m["stored_split_matches"] else "NO", "-"],
            ["tokenizer speed (one CPU thread)", f"{_rate(m['tokenizer_tokens_per_s'])} tokens/s", "-"]]
    if st is not None:
        sm = st["metrics"]
        rows.append(["bytes for all token ids: uint16 / int32 / int64",
                     f"{sm['bytes_uint16']:,} / {sm['bytes_int32']:,} / {sm['bytes_int64']:,}", "-"])
    return (markdown(rows, ["quantity", f"this lab ({_label(v, rec)})", "seed"]) + "\n\n" + SEED_NOTE)


# ------------------------------------------------------------------------------ 7.2 model
def t_model(v: View) -> str:
    groups = _groups(v, "phase7.model")
    if not groups:
        return _none("phase7.model")
    out = []
    _, _, rec = groups[-1]
    big, small, untied = _ok(rec, "params_30m"), _ok(rec, "params_7m"), _ok(rec, "params_30m_untied")
    if big is not None:
        c = big["metrics"]["counted"]
        cs = (small or {}).get("metrics", {}).get("counted", {})
        cu = (untied or {}).get("metrics", {}).get("counted", {})
        sd = seed.MODEL_30M
        d = big["params"]["model"]
        form = {"wte": "V x d", "wpe": "T x d", "blocks": "L x (12 d² + 4 d)", "ln_f": "2 d", "lm_head": "V x d if untied, else 0"}
        rows = []
        for k, name in (("wte", "token embedding (wte)"), ("wpe", "position embedding (wpe)"),
                        ("blocks", f"{d['n_layer']} transformer blocks"), ("ln_f", "final LayerNorm"),
                        ("lm_head", "lm head"), ("total", "total"), ("non_embedding", "non-embedding (blocks + ln_f)")):
            rows.append([name, form.get(k, "-"), f"{c[k]:,}", pct(100 * c[k] / c["total"]),
                         f"{cs[k]:,}" if k in cs else "-", f"{cu[k]:,}" if k in cu else "-",
                         sd.get(k) or ("tied (not counted)" if k == "lm_head" else "-")])
        out.append(markdown(rows, ["component", "formula", f"30M shape, tied ({_shape(big)})", "share",
                                   f"7.25M shape ({_shape(small) if small else '-'})", "30M shape, untied head",
                                   "seed's 30M table"]))
        out.append(f"\nModule counts equal the closed-form counts: "
                   f"{'yes' if all(r and r['check']['passed'] for r in (big, small, untied)) else 'NO'} "
                   f"(V = 50,257, T = 256, d = n_embd, L = n_layer; Linear layers without bias, LayerNorms with). "
                   f"{_label(v, rec)}")
    for hw, rows_, rec in groups:
        init = _ok(rec, "init_loss")
        if init is not None:
            m = init["metrics"]
            out.append(f"\n{hw}: initial loss {m['initial_loss']:.3f} against ln(50,257) = {m['ln_vocab']:.3f} "
                       f"(gap {m['gap']:+.3f}; the seed's was {seed.MODEL_30M['initial_loss']} on its model), logits "
                       f"{tuple(m['logits_shape'])} for a {tuple(init['params']['batch'])} batch, with a "
                       f"{_count(m['params_total'])}-parameter model ({_shape(init)}).")
        sd = [r for r in rec["rows"] if r["variant"].startswith("sdpa_")]
        if sd:
            table = []
            for r in sd:
                if r["status"] != "ok":
                    table.append([r["variant"], *_status_cells(r, 7)])
                    continue
                p = r["prediction"]
                table.append([r["params"]["backend"], f"{tuple(r['params']['batch'])}", num(_m(r, "ms")),
                              _rate(_m(r, "tokens_per_s")), num(_m(r, "tflops")), pct(_m(r, "pct_of_peak_tflops")),
                              num(p["predicted_ms"]), num(p["measured_over_predicted"], 3)])
            out.append(f"\nForward + backward of that model on {hw}, attention forced onto one SDPA backend "
                       f"(each checked against float64 attention first):\n")
            out.append(markdown(table, ["SDPA backend", "batch (B, T)", "ms", "tokens/s", "TFLOP/s", "% of spec peak",
                                        "predicted ms", "measured/predicted"]))
    return "\n".join(out)


# ------------------------------------------------------------------------------ 7.3 overfit
def t_overfit(v: View) -> str:
    groups = _groups(v, "phase7.overfit")
    if not groups:
        return _none("phase7.overfit")
    out = []
    for hw, _, rec in groups:
        table = []
        for variant in ("large", "small"):
            r = _rows(rec).get(variant)
            if r is None:
                continue
            if r["status"] != "ok":
                table.append([variant, *_status_cells(r, 10)])
                continue
            m = r["metrics"]
            table.append([f"{variant} ({_shape(r)})", _count(m["params_total"]), f"{m['unique_tokens_per_param']:.3f}",
                          f"{m['steps']:,} ({num(m['epochs'], 2)} epochs)", f"{_loss(m['best_val_loss'])} @ {m['best_val_step']}",
                          _loss(m["final_train_loss"]), _loss(m["final_val_loss"]),
                          _rate(m["tokens_per_s"]), pct(m["mfu_pct_of_spec"]),
                          f"{m['sample']['longest_verbatim_chars']} chars", pct(100 * (m["sample"]["train_8gram_fraction"] or 0))])
        out.append(f"**{hw}** ({_label(v, rec)})\n")
        out.append(markdown(table, ["model", "params", "unique tokens / param", "steps", "best val loss @ step",
                                    "final train loss", "final val loss", "tokens/s", "MFU (spec)",
                                    "longest verbatim run in sample", "sample 8-grams found in train"]))
        large = _ok(rec, "large")
        if large is not None:
            curve = large["metrics"]["curve"]
            want = sorted({0, 250, 500, 1000, 1500, 2000, curve[-1][0], large["metrics"]["best_val_step"] or 0})
            seed_at = {s: (t, va) for s, t, va in seed.OVERFIT_30M}
            picked = []
            for s in want:
                near = min(curve, key=lambda c: abs(c[0] - s))
                if near not in picked:
                    picked.append(near)
            rows = [[f"{s:,}" + (" (best val)" if s == large["metrics"]["best_val_step"] else ""), _loss(t), _loss(va),
                     " / ".join(_loss(x) for x in seed_at[s]) if s in seed_at else "-"] for s, t, va in picked]
            rows += [[f"{s:,} (seed only)", "-", "-", f"{t} / {va}"] for s, t, va in seed.OVERFIT_30M
                     if s not in {p[0] for p in picked}]
            out.append("\nThe large model's curve (train loss on fixed train windows, val loss on the whole validation split):\n")
            out.append(markdown(rows, ["step", "train loss", "val loss", "seed's 30M: train / val"]))
        out.append(_plot(v, rec, "overfit", f"Training and validation loss on {hw}"))
        for variant in ("large", "small"):
            r = _ok(rec, variant)
            if r is not None:
                smp = r["metrics"]["sample"]
                text = smp["text"].strip("\n").replace("```", "'''")
                out.append(f"\nSample from the {variant} model after its last step (temperature {smp['temperature']}, "
                           f"top-k {smp['top_k']}; first 300 characters):\n\n```text\n{text}\n```")
    out.append("\n" + SEED_NOTE)
    return "\n".join(out)


def t_throughput(v: View) -> str:
    groups = _groups(v, "phase7.overfit")
    if not groups:
        return _none("phase7.overfit")
    out = []
    for hw, _, rec in groups:
        table, parts = [], []
        for variant in ("throughput", "throughput_eager", "large", "small", "reproducibility"):
            r = _rows(rec).get(variant)
            if r is None:
                continue
            if r["status"] != "ok":
                table.append([variant, *_status_cells(r, 10)])
                continue
            m, p = r["metrics"], r["prediction"]
            compiled = r["params"]["train"]["compile"] and not m.get("compile_error")
            table.append([f"{variant} ({_count(m['params_total'])})", "yes" if compiled else "no",
                          f"{r['params']['train']['batch_size']} x {r['params']['model']['block_size']}",
                          num(m["ms"]), _rate(m["tokens_per_s"]), num(m["model_tflops"]),
                          pct(m["mfu_pct_of_spec"]), pct(m.get("mfu_pct_of_phase1")),
                          num(p["predicted_ms"]), p["bound"], num(p["measured_over_predicted"], 3)])
            b = m.get("step_breakdown")
            if b and variant in ("throughput", "throughput_eager"):
                parts.append([variant] + [f"{b[f'{k}_ms']:.2f} ({b[f'{k}_pct']:.0f}%)" for k in ("data", "forward", "backward", "optimizer")]
                             + [f"{b['total_ms']:.2f}", " / ".join(f"{b[f'{k}_host_ms']:.2f}" for k in ("data", "forward", "backward", "optimizer"))])
        out.append(f"**{hw}** ({_label(v, rec)})\n")
        out.append(markdown(table, ["run", "torch.compile", "batch (B x T)", "ms/step (median)", "tokens/s",
                                    "model TFLOP/s", "MFU (spec)", "MFU (phase 1 ceiling)", "predicted ms/step",
                                    "bound", "measured/predicted"]))
        if parts:
            out.append("\nWhere a step's time goes (GPU time between CUDA events on dedicated, synchronized steps; "
                       "last column: host time to issue each phase):\n")
            out.append(markdown(parts, ["run", "data ms", "forward ms", "backward ms", "optimizer ms", "total ms",
                                        "host ms: data / fwd / bwd / opt"]))
        s = rec.get("summary", {})
        th = _ok(rec, "throughput")
        if th is not None:
            m = th["metrics"]
            out.append(f"\nGoal: at least {_rate(s.get('goal_tokens_per_s'))} tokens/s for the 30M model: "
                       f"{'met' if s.get('goal_met') else 'NOT met'} ({_rate(m['tokens_per_s'])} tokens/s, "
                       f"{num(s.get('throughput_over_seed_30m'), 3)}x the seed's {_rate(seed.TOKENS_PER_S['30M'])} on an A100). "
                       f"MFU against the {num(m['mfu_spec_peak_tflops'])} TFLOP/s {th['params']['dtype']} peak "
                       f"({m['mfu_spec_source']})"
                       + (f" and against the {num(m['phase1_ceiling_tflops'])} TFLOP/s phase 1 measured "
                          f"([its record](../../results/{m['phase1_ceiling_source'][len('results/'):]}))"
                          if m.get("phase1_ceiling_tflops") else "; no phase 1 ceiling was recorded for this GPU")
                       + f". FLOPs per token: {m['flops_convention']}.")
        rp = _rows(rec).get("reproducibility")
        if rp is not None:
            rm = rp["metrics"]
            a, b = rm.get("loss_run_a"), rm.get("loss_run_b")
            out.append(f"\nReproducibility: two fresh runs with seed {rp['params']['train']['seed']} gave train loss "
                       f"{'-' if a is None else format(a, '.5f')} and {'-' if b is None else format(b, '.5f')} "
                       f"at step {rm.get('repro_step')} "
                       f"(difference {num(rm.get('loss_difference'), 3)}, tolerance {rp['check']['tolerance']}): "
                       f"{'pass' if rp['status'] == 'ok' else 'FAIL'}"
                       + (", bit for bit equal." if rm.get("bitwise_equal") else "."))
    return "\n".join(out)


# ------------------------------------------------------------------------------ 7.4 scaling
def t_scaling(v: View) -> str:
    groups = _groups(v, "phase7.scaling")
    if not groups:
        return _none("phase7.scaling")
    out = []
    for hw, _, rec in groups:
        table = []
        for r in rec["rows"]:
            if r["status"] != "ok":
                table.append([r["variant"], *_status_cells(r, 10)])
                continue
            m = r["metrics"]
            sp = m.get("seed_point")
            table.append([r["variant"], _shape(r), f"{m['n_total']:,}", f"{m['n_non_embedding']:,}",
                          f"{_loss(m['best_val_loss'])} @ {m['best_val_step']}", f"{m['steps']:,}",
                          f"{m['tokens_seen_per_param_at_best']:.2f}", f"{m['chinchilla_underfed_factor_non_embedding']:.1f}x",
                          _signed_pct(m.get("fit_error_pct_non_embedding")), _signed_pct(m.get("fit_error_pct_total")),
                          f"{sp[0]:,}: {sp[1]} @ {sp[2]}" if sp else "-"])
        out.append(f"**{hw}** ({_label(v, rec)})\n")
        out.append(markdown(table, ["size", "shape", "params", "non-embedding params", "best val loss @ step",
                                    "steps run", "tokens seen / param at best", "Chinchilla: 20 N_ne / unique tokens",
                                    "fit error (N_ne)", "fit error (N total)", "seed: N_ne: best val @ iter"]))
        s = rec.get("summary", {})
        for key, name in (("fit_non_embedding", "non-embedding parameters"), ("fit_total", "all parameters")):
            f = s.get(key)
            if not f:
                continue
            bs = f["bootstrap"]
            ci = f"[{bs['low']:.4f}, {bs['high']:.4f}]" if bs.get("low") is not None else "-"
            out.append(f"\nFit over {name} ({f['points']} points): L = {f['a']:.3f} N^-{f['alpha']:.4f}; "
                       f"95% bootstrap interval of the exponent {ci} ({bs['used']} of {bs['resamples']} resamples); "
                       f"R² {num(f['r2'], 3)}; largest point error {f['max_abs_error_pct']:.1f}%.")
        sf = seed.SCALING_FIT
        out.append(f"\nFor comparison: the seed fitted L = {sf['a']} N^-{sf['alpha']} on its {sf['points']} models "
                   f"(non-embedding N); Kaplan et al. (2020) report alpha_N = {s.get('kaplan_alpha_n')}.")
        if s.get("non_monotonic"):
            out.append(f"\nLarger but worse than the next smaller size: {', '.join(s['non_monotonic'])}.")
        out.append(_plot(v, rec, "scaling", f"Best validation loss against parameters on {hw}, with the fitted power laws"))
    out.append("\n" + SEED_NOTE)
    return "\n".join(out)


# ------------------------------------------------------------------------------ 7.5 failures
def t_failures(v: View) -> str:
    groups = _groups(v, "phase7.failures")
    if not groups:
        return _none("phase7.failures")
    out = []
    for hw, _, rec in groups:
        table = []
        for r in rec["rows"]:
            if r["status"] != "ok":
                table.append([r["variant"], *_status_cells(r, 11)])
                continue
            m = r["metrics"]
            sw = m["switches"]
            table.append([r["variant"], "on" if sw["residual"] else "OFF", "on" if sw["layernorm"] else "OFF",
                          str(sw["warmup_iters"]), f"{sw['lr']:g}", f"{sw['grad_clip']:g}" if sw["grad_clip"] else "off",
                          m["outcome"], f"{_loss(m['best_val_loss'])} @ {m['best_val_step']}", _loss(m["final_val_loss"]),
                          _signed_pct(m.get("final_val_vs_control_pct")),
                          f"{num(m['grad_norm_min'])} / {num(m['grad_norm_max'])}",
                          f"{num(m['activation_rms_last_over_first'], 3)}", m.get("seed_result") or "-"])
        out.append(f"**{hw}** ({_label(v, rec)}; model {_shape(rec['rows'][0])}, "
                   f"{rec['rows'][0]['params']['train']['max_iters']} steps, seed {rec['rows'][0]['params']['train']['seed']})\n")
        out.append(markdown(table, ["run", "residual", "LayerNorm", "warmup steps", "lr", "clip", "outcome",
                                    "best val @ step", "final val", "final val vs control", "grad norm min / max",
                                    "activation RMS last block / embedding (init)", "seed's result"]))
        out.append(_plot(v, rec, "failures", f"Loss and gradient norm of every step on {hw}"))
    out.append("\n" + SEED_NOTE)
    return "\n".join(out)


# ------------------------------------------------------------------------------ findings
def findings(v: View) -> str:
    paras = []
    hws = {}
    for ex in EXS:
        for hw, _, rec in _groups(v, ex):
            hws.setdefault(hw, {})[ex] = rec
    for hw, got in sorted(hws.items()):
        s = []
        dp = got.get("phase7.data_prep")
        tok = _ok(dp, "tokenize") if dp else None
        if tok:
            m = tok["metrics"]
            s.append(f"**Data.** GPT-2's tokenizer turned {m['chars']:,} characters into {m['tokens']:,} tokens "
                     f"({m['chars_per_token']:.2f} characters per token), "
                     + ("exactly the seed's count" if m["tokens"] == seed.DATA["tokens"] else "NOT the seed's count")
                     + f"; the 90/10 token split is {m['train_tokens']:,} / {m['val_tokens']:,}. Every id is at most "
                     f"{m['max_token_id']:,}, so two bytes hold it.")
        mo = got.get("phase7.model")
        big = _ok(mo, "params_30m") if mo else None
        if big:
            c = big["metrics"]["counted"]
            s.append(f"**Model.** The 30M shape has {c['total']:,} parameters with a tied head; "
                     f"{pct(100 * c['wte'] / c['total'])} of them are the token embedding and only "
                     f"{c['non_embedding']:,} do the computing between embedding and head.")
            fl, ma = _ok(mo, "sdpa_flash"), _ok(mo, "sdpa_math")
            if fl and ma:
                s.append(f"A forward + backward with attention on the flash kernel took {num(_m(fl, 'ms'))} ms, "
                         f"against {num(_m(ma, 'ms'))} ms on the math path that writes the T x T scores to memory "
                         f"(math / flash = {num(_m(ma, 'ms') / _m(fl, 'ms'), 3)}).")
        ov = got.get("phase7.overfit")
        if ov:
            lg, sm = _ok(ov, "large"), _ok(ov, "small")
            if lg:
                m = lg["metrics"]
                rose = (m["final_val_loss"] or 0) > (m["best_val_loss"] or 0) + 0.01
                s.append(f"**Overfitting.** The {_count(m['params_total'])}-parameter model reached its best validation "
                         f"loss, {_loss(m['best_val_loss'])}, at step {m['best_val_step']}; by step {m['final_step']:,} "
                         f"training loss was {_loss(m['final_train_loss'])} and validation loss "
                         + (f"had climbed back to {_loss(m['final_val_loss'])}" if rose else
                            f"was still at its best ({_loss(m['final_val_loss'])}): this run did not reach the overfitting regime")
                         + f". Its sample repeated {m['sample']['longest_verbatim_chars']} "
                         f"characters of the training text verbatim, and {pct(100 * (m['sample']['train_8gram_fraction'] or 0))} "
                         f"of its 8-token runs occur in the training split.")
            if sm:
                m = sm["metrics"]
                s.append(f"The {_count(m['params_total'])}-parameter model's best validation loss was "
                         f"{_loss(m['best_val_loss'])} (step {m['best_val_step']}), final "
                         f"{_loss(m['final_val_loss'])}; its sample's longest verbatim run was "
                         f"{m['sample']['longest_verbatim_chars']} characters "
                         f"({pct(100 * (m['sample']['train_8gram_fraction'] or 0))} of 8-grams found in training).")
            th = _ok(ov, "throughput")
            if th:
                m = th["metrics"]
                b = m.get("step_breakdown") or {}
                summ = ov.get("summary", {})
                compiled = th["params"]["train"]["compile"] and not m.get("compile_error")
                how = ", ".join(["torch.compile" if compiled else "no torch.compile",
                                 "bf16 autocast" if th["params"]["dtype"] == "bf16" else "fp32"])
                s.append(f"**Throughput.** The {_count(m['params_total'])}-parameter model ({how}, batch "
                         f"{th['params']['train']['batch_size']} x {th['params']['model']['block_size']}) trained at "
                         f"{_rate(m['tokens_per_s'])} tokens/s, {num(summ.get('throughput_over_seed_30m'), 3)}x the seed's "
                         f"A100 figure for its 30M model (goal {_rate(summ.get('goal_tokens_per_s'))} tokens/s: "
                         f"{'met' if summ.get('goal_met') else 'not met'}). That is {num(m['model_tflops'])} model TFLOP/s, "
                         f"MFU {pct(m['mfu_pct_of_spec'])} of the {num(m['mfu_spec_peak_tflops'])} TFLOP/s "
                         f"{th['params']['dtype']} peak ({m['mfu_spec_source']})"
                         + (f" and {pct(m['mfu_pct_of_phase1'])} of the {num(m['phase1_ceiling_tflops'])} TFLOP/s matmul "
                            f"rate phase 1 measured on this GPU" if m.get("mfu_pct_of_phase1") is not None else "") + "."
                         + (f" Of a profiled step's {b['total_ms']:.2f} ms, the forward took {b['forward_pct']:.0f}%, "
                            f"the backward {b['backward_pct']:.0f}%, the optimizer {b['optimizer_pct']:.0f}% and the "
                            f"data {b['data_pct']:.0f}%." if b else "")
                         + f" The roofline's floor for a step (its FLOPs at that peak; the parameter and optimizer bytes "
                         f"are far smaller) was {num(th['prediction']['predicted_ms'])} ms; the median step took "
                         f"{num(th['prediction']['measured_over_predicted'], 3)}x that.")
                eager = _ok(ov, "throughput_eager")
                if compiled and eager is not None:
                    s.append(f"Without torch.compile the same run reached {_rate(_m(eager, 'tokens_per_s'))} tokens/s: "
                             f"compiling changed throughput by a factor of {num(summ.get('compile_speedup'), 3)}.")
            rp = _rows(ov).get("reproducibility")
            if rp is not None and rp["metrics"].get("loss_difference") is not None:
                s.append(f"Two runs with the same seed differed by {num(rp['metrics']['loss_difference'], 3)} in loss at step "
                         f"{rp['metrics']['repro_step']} ({'within' if rp['status'] == 'ok' else 'OUTSIDE'} the "
                         f"{rp['check']['tolerance']} tolerance).")
        sc = got.get("phase7.scaling")
        if sc and sc.get("summary", {}).get("fit_non_embedding"):
            f, ft = sc["summary"]["fit_non_embedding"], sc["summary"]["fit_total"]
            ok = [r for r in sc["rows"] if r["status"] == "ok"]
            lo, hi = min(ok, key=lambda r: r["metrics"]["n_non_embedding"]), max(ok, key=lambda r: r["metrics"]["n_non_embedding"])
            bs = f["bootstrap"]
            s.append(f"**Scaling.** From {lo['metrics']['n_non_embedding']:,} to {hi['metrics']['n_non_embedding']:,} "
                     f"non-embedding parameters ({num(hi['metrics']['n_non_embedding'] / lo['metrics']['n_non_embedding'])}x), "
                     f"the best validation loss went from {_loss(lo['metrics']['best_val_loss'])} to "
                     f"{_loss(hi['metrics']['best_val_loss'])}. The fitted exponent is {f['alpha']:.4f} "
                     + (f"(95% bootstrap interval {bs['low']:.4f} to {bs['high']:.4f}) " if bs.get("low") is not None else "")
                     + f"over non-embedding parameters and {ft['alpha']:.4f} over all parameters, with points up to "
                     f"{f['max_abs_error_pct']:.1f}% off the line; Kaplan et al. report {sc['summary']['kaplan_alpha_n']}. "
                     f"Chinchilla's 20 tokens per (non-embedding) parameter would take "
                     f"{num(lo['metrics']['chinchilla_underfed_factor_non_embedding'])}x the unique training tokens there are "
                     f"for the smallest model and {num(hi['metrics']['chinchilla_underfed_factor_non_embedding'])}x for the largest."
                     + (f" Larger but worse than the next smaller size: {', '.join(sc['summary']['non_monotonic'])}."
                        if sc["summary"].get("non_monotonic") else ""))
        fa = got.get("phase7.failures")
        if fa:
            ctl = _ok(fa, "control")
            parts = []
            for variant, what in (("no_residual_no_layernorm", "without residuals and LayerNorm"),
                                  ("no_residual", "without residuals"), ("no_layernorm", "without LayerNorm"),
                                  ("warmup_none", "without warmup"), ("warmup_short", "with a short warmup"),
                                  ("lr_x100", "at 100x the learning rate"),
                                  ("lr_x100_no_clip", "at 100x the learning rate without clipping"),
                                  ("no_clip", "without clipping")):
                r = _ok(fa, variant)
                if r is None:
                    continue
                m = r["metrics"]
                parts.append(f"{what}: {m['outcome']}, best val {_loss(m['best_val_loss'])}"
                             + (f" ({_signed_pct(m.get('best_val_vs_control_pct'))} vs control)" if m.get("best_val_vs_control_pct") is not None else "")
                             + f", gradient norm up to {num(m['grad_norm_max'])}"
                             + (f", activations after the last block {num(m['activation_rms_last_over_first'], 3)}x the embedding's RMS at init"
                                if variant.startswith("no_") and "clip" not in variant else ""))
            if ctl:
                s.append(f"**Failures.** The control reached a best validation loss of {_loss(_m(ctl, 'best_val_loss'))} "
                         f"with gradient norms between {num(_m(ctl, 'grad_norm_min'))} and {num(_m(ctl, 'grad_norm_max'))}; "
                         f"against it, with the same seed:\n\n" + "\n".join(f"- {p[0].upper() + p[1:]}." for p in parts))
        if s:
            paras.append(f"On the {hw}:\n\n" + "\n\n".join(s))
    return "\n\n".join(paras) or "_No phase 7 records yet: run `lab run 7` on a GPU, then `lab report`._"


def key_result(v: View) -> list[str]:
    """One line per GPU for the main README's phase table (for common/findings.phase_table)."""
    out = []
    for hw, _, rec in _groups(v, "phase7.overfit"):
        th = _ok(rec, "throughput")
        if th is None:
            continue
        line = (f"{hw}: {_count(_m(th, 'params_total'))}-parameter GPT at {_rate(_m(th, 'tokens_per_s'))} tokens/s "
                f"(MFU {pct(_m(th, 'mfu_pct_of_spec'))})")
        sc = [r for h, _, r in _groups(v, "phase7.scaling") if h == hw]
        f = (sc[0].get("summary", {}).get("fit_non_embedding") if sc else None)
        if f:
            line += f", scaling exponent {f['alpha']:.3f}"
        out.append(line)
    return out


TABLES = {"phase7.data_prep": t_data_prep, "phase7.model": t_model, "phase7.overfit": t_overfit,
          "phase7.throughput": t_throughput, "phase7.scaling": t_scaling, "phase7.failures": t_failures,
          "phase7.findings": findings}


# ------------------------------------------------------------------------------ plots
def _latest_records(records) -> dict:
    """(exercise, hardware) -> newest measured, non-skipped record."""
    out = {}
    for rec in records:
        if rec["exercise"]["id"] in EXS[2:] and rec["status"] != "skipped" and \
                rec.get("source", {}).get("kind", "measured") == "measured":
            out[(rec["exercise"]["id"], rec["hardware"]["key"])] = rec       # records come oldest first
    return out


def _plot_paths(records, results: Path) -> dict:
    names = {"phase7.overfit": "overfit", "phase7.scaling": "scaling", "phase7.failures": "failures"}
    return {(ex, hw): Path(results) / "plots" / f"phase7_{names[ex]}_{hw}.png"
            for (ex, hw), rec in _latest_records(records).items() if any(r["status"] == "ok" for r in rec["rows"])}


def expected(records, results: Path) -> list[Path]:
    return sorted(_plot_paths(records, results).values())


def draw(records, results: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common.plots import PLOT_META
    made = []
    latest_ = _latest_records(records)
    for (ex, hw), path in _plot_paths(records, results).items():
        rec = latest_[(ex, hw)]
        path.parent.mkdir(parents=True, exist_ok=True)
        name = (rec["hardware"].get("spec") or {}).get("name") or rec["hardware"]["key"]
        fn = {"phase7.overfit": _plot_overfit, "phase7.scaling": _plot_scaling, "phase7.failures": _plot_failures}[ex]
        fig = fn(plt, rec, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110, metadata=PLOT_META)
        plt.close(fig)
        made.append(path)
    return made


def _plot_overfit(plt, rec, name):
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for variant, color in (("large", "tab:red"), ("small", "tab:blue")):
        r = _ok(rec, variant)
        if r is None:
            continue
        c = [p for p in r["metrics"]["curve"] if p[1] is not None and p[2] is not None]
        label = f"{_count(r['metrics']['params_total'])} params"
        ax.plot([p[0] for p in c], [p[1] for p in c], "--", color=color, label=f"{label}: train")
        ax.plot([p[0] for p in c], [p[2] for p in c], "-", color=color, label=f"{label}: validation")
        if r["metrics"]["best_val_step"] is not None:
            ax.scatter([r["metrics"]["best_val_step"]], [r["metrics"]["best_val_loss"]], color=color, zorder=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats)")
    ax.set_title(f"Overfitting TinyShakespeare: {name}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _plot_scaling(plt, rec, name):
    fig, ax = plt.subplots(figsize=(7.5, 5))
    ok = [r for r in rec["rows"] if r["status"] == "ok" and r["metrics"].get("best_val_loss") is not None]
    s = rec.get("summary", {})
    for key, fitkey, color, label in (("n_non_embedding", "fit_non_embedding", "tab:blue", "non-embedding N"),
                                      ("n_total", "fit_total", "tab:orange", "total N")):
        xs = [r["metrics"][key] for r in ok]
        ys = [r["metrics"]["best_val_loss"] for r in ok]
        ax.scatter(xs, ys, color=color, zorder=3, label=f"best val loss vs {label}")
        for r, x, y in zip(ok, xs, ys):
            ax.annotate(r["variant"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        f = s.get(fitkey)
        if f and xs:
            lo, hi = min(xs) / 1.5, max(xs) * 1.5
            grid = [lo * (hi / lo) ** (i / 50) for i in range(51)]
            bs = f["bootstrap"]
            ci = f" [{bs['low']:.3f}, {bs['high']:.3f}]" if bs.get("low") is not None else ""
            ax.plot(grid, [f["a"] * x ** -f["alpha"] for x in grid], "-", color=color, alpha=0.6,
                    label=f"fit: {f['a']:.2f} N^-{f['alpha']:.4f}{ci}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import FormatStrFormatter
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.1f"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.1f"))
    ax.set_xlabel("parameters N")
    ax.set_ylabel("best validation loss")
    ax.set_title(f"Scaling on a fixed 304K-token dataset: {name}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def _plot_failures(plt, rec, name):
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for r in rec["rows"]:
        if r["status"] != "ok":
            continue
        style = "-" if r["variant"] == "control" else "--" if r["variant"].startswith("no_") else ":"
        loss = [p for p in r["metrics"]["train_loss_per_step"] if p[1] is not None]
        gn = [p for p in r["metrics"]["grad_norm_per_step"] if p[1] is not None and p[1] > 0]
        a1.plot([p[0] for p in loss], [p[1] for p in loss], style, lw=1, label=r["variant"])
        if gn:
            a2.plot([p[0] for p in gn], [p[1] for p in gn], style, lw=1, label=r["variant"])
    a1.set_xlabel("step")
    a1.set_ylabel("training loss (batch)")
    a1.set_title(f"Engineered failures: loss ({name})")
    a2.set_yscale("log")
    a2.set_xlabel("step")
    a2.set_ylabel("gradient norm (before clipping; zeros not drawn)")
    a2.set_title("gradient norm, every step")
    for a in (a1, a2):
        a.grid(True, which="both", alpha=0.3)
    a1.legend(fontsize=7)
    return fig
