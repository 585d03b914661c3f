"""Phase 5's findings: sentences whose every number comes from the newest records per GPU."""
from common.formats import bullets, num, pct, ratio
from common.frame import by_hardware, find, value

from . import seed
from .goal_model import GOAL_MODEL, of_8b


def findings(view) -> str:
    out = []
    for _, got in sorted(by_hardware(view.frame, ["phase5.startup", "phase5.ttft_decode", "phase5.batching",
                                                  "phase5.offline", "phase5.quant_engine", "phase5.quant_kernels",
                                                  "phase5.quant_quality"]).items()):
        parts = []
        d = got.get("phase5.ttft_decode")
        mine = find(d, "lab-engine", model=GOAL_MODEL)
        comp = find(d, "pytorch-compile", model=GOAL_MODEL)
        eager = find(d, "pytorch-eager", model=GOAL_MODEL)
        name = next(iter(got.values())).iloc[0]["hardware_name"]
        if mine is not None:
            parts.append(f"Batch-1 decode of the 8B shape reads {num(mine['metrics.bytes_per_token'] / 1e9)} GB a token; "
                         f"the engine streams it at {num(mine['metrics.gbps'])} GB/s, "
                         f"{pct(mine['metrics.pct_of_copy_roofline'])} of the {num(mine['metrics.copy_gbps'])} GB/s copy "
                         f"bandwidth of the same run ({num(mine['metrics.decode_tok_s'])} tok/s)"
                         + (f"; plain PyTorch reaches {pct(value(eager, 'metrics.pct_of_copy_roofline'))} eager"
                            if eager is not None else "")
                         + (f" and {pct(value(comp, 'metrics.pct_of_copy_roofline'))} under torch.compile"
                            if comp is not None else "") + ".")
        big = d[(d["variant"] == "lab-engine") & (d["params.model"] == "llama-3.3-70b")] if d is not None else []
        if len(big):
            big = big.iloc[0]
            if big["status"] == "ok":
                parts.append(f"The 70B shape fits one GPU with {num(value(big, 'metrics.kv_pool_gib'))} GiB left for KV "
                             f"({value(big, 'metrics.kv_capacity_tokens'):,.0f} tokens) and decodes at "
                             f"{num(big['metrics.decode_tok_s'])} tok/s, {pct(big['metrics.pct_of_copy_roofline'])} of its "
                             f"roofline (the seed needed two A100s and kept {seed.KV_LEFT_70B_TP2_GIB} GiB, {seed.CITATION}).")
            else:
                parts.append(f"The 70B shape: {big['reason']}.")
        b = got.get("phase5.batching")
        if b is not None:
            ok = b[b["status"] == "ok"]
            eight, one = find(ok, concurrency=8), find(ok, concurrency=1)
            if eight is not None and one is not None:
                parts.append(f"Eight concurrent requests give {ratio(value(eight, 'metrics.x_output_tok_s_vs_1'))} the "
                             f"output of one at {ratio(value(eight, 'metrics.tpot_vs_1'))} its TPOT: decode reads the "
                             "weights once per step, whoever shares it.")
            if len(ok):
                best = ok.loc[ok["metrics.output_tok_s"].idxmax()]
                parts.append(f"The sweep peaks at concurrency {int(best['params.concurrency'])} with "
                             f"{num(best['metrics.output_tok_s'])} tok/s, {pct(best['metrics.pct_of_predicted_tok_s'])} of "
                             f"its prediction; the spec-sheet ridge is at a batch of about "
                             f"{num(value(best, 'summary.ridge_batch_spec'))}.")
        parts += quantization(got)
        if parts:
            out.append(bullets(parts, f"{name}:"))
    return "\n\n".join(out)


def quantization(got: dict) -> list[str]:
    """What the quantization records say: the bytes each format promises, what the engine got of
    them, where the kernel stands, and what it cost in perplexity."""
    parts = []
    e, k = (of_8b(got[ex]) if ex in got else None for ex in ("phase5.quant_engine", "phase5.quant_kernels"))
    if e is not None:
        ok = e[(e["status"] == "ok") & (e["params.batch"] == 1)]
        bf16, int4, naive = (find(ok, v) for v in ("bf16", "int4_fused", "int4_naive"))
        library = find(ok, "int4_library")
        if bf16 is not None and int4 is not None:
            promised = bf16["metrics.bytes_per_token"] / int4["metrics.bytes_per_token"]
            parts.append(f"Int4 weights cut the bytes a batch-1 token reads from {num(bf16['metrics.bytes_per_token'] / 1e9)} "
                         f"to {num(int4['metrics.bytes_per_token'] / 1e9)} GB ({ratio(promised)} fewer), so the roofline "
                         f"promises {ratio(promised)} the tok/s; the engine's fused int4 path delivers "
                         f"{ratio(int4['metrics.speedup_vs_bf16'])} ({pct(int4['metrics.pct_of_copy_roofline'])} of its "
                         f"roofline against bf16's {pct(bf16['metrics.pct_of_copy_roofline'])})"
                         + (f", tinygemm {ratio(library['metrics.speedup_vs_bf16'])}" if library is not None else "")
                         + ": the kernels, not the bytes, set the speed.")
        cuda = find(ok, "int4_cuda")
        cuda8 = find(e[(e["status"] == "ok") & (e["params.batch"] == 8)], "int4_cuda")
        if cuda is not None:
            parts.append(f"The CUDA int4 kernel in the engine: {ratio(cuda['metrics.speedup_vs_bf16'])} bf16 at batch 1 "
                         f"({pct(cuda['metrics.pct_of_copy_roofline'])} of its roofline)"
                         + (f", {ratio(cuda8['metrics.speedup_vs_bf16'])} at 8 requests" if cuda8 is not None else "")
                         + ".")
        if naive is not None:
            parts.append(f"The same int4 weights through the naive path run at {ratio(naive['metrics.speedup_vs_bf16'])} "
                         f"bf16 (the seed's naive AWQ: {seed.QUANT_8B['AWQ int4, naive kernel'][2]}x): each projection is "
                         "dequantized to a bf16 copy in memory before cuBLAS reads it, so a step moves more bytes than "
                         "bf16 itself, not fewer.")
    if k is not None:
        fused = find(k[k["status"] == "ok"], "w4_fused", matrix="gate_up", batch=1)
        if fused is not None:
            parts.append(f"At the kernel, W4A16 on gate_up at batch 1 takes {num(1000 * fused['metrics.ms'])} µs, "
                         f"{pct(fused['metrics.pct_of_roofline'])} of its roofline and "
                         f"{ratio(fused['metrics.speedup_vs_bf16_cublas'])} bf16 cuBLAS.")
        ladder = {v: find(k[k["status"] == "ok"], v, matrix="gate_up", batch=16)
                  for v in ("w4_fused", "w4_cuda_bulk", "w4_cuda", "w4_library")}
        if all(r is not None for r in ladder.values()):
            fastest = min(ladder, key=lambda v: ladder[v]["metrics.ms"])
            parts.append("At batch 16 on gate_up the int4 ladder reads " + ", ".join(
                f"{v} {num(1000 * r['metrics.ms'])} µs" for v, r in ladder.items()) + f": {fastest} is the fastest.")
    q = got.get("phase5.quant_quality")
    if q is not None:
        ok = q[q["status"] == "ok"]
        ref, int8 = find(ok, "reference"), find(ok, "int8")
        rtn = find(ok, "int4_rtn", group_size=128)
        awq = find(ok, "int4_awq", group_size=128)
        if ref is not None and int8 is not None and rtn is not None:
            parts.append(f"On the phase 7 GPT (validation perplexity {ref['metrics.perplexity']:.2f}), int8 weights give "
                         f"{int8['metrics.perplexity']:.2f} and int4 round-to-nearest (groups of 128) "
                         f"{rtn['metrics.perplexity']:.2f}"
                         + (f", with AWQ's scales {awq['metrics.perplexity']:.2f}" if awq is not None else "")
                         + f"; the top token stays the same {pct(100 * rtn['metrics.top1_agreement'])} of the time at int4.")
    return parts


def speculative(view) -> str:
    """What the speculative-decoding records say, per GPU: is the target memory-bound, what each draft
    buys at batch 1 and why (its agreement with the target), how the gain shrinks with concurrency,
    and how well the speedup formula predicted it."""
    out = []
    for _, got in sorted(by_hardware(view.frame, ["phase5.speculative"]).items()):
        d = got["phase5.speculative"]
        ok = d[d["status"] == "ok"]
        if not len(ok):
            continue
        first = ok.iloc[0]
        agreement = value(first, "summary.agreement_with_target") or {}
        greedy1 = ok[(ok["params.temperature"] == 0) & (ok["params.concurrency"] == 1)]
        parts = [f"At batch 1 the {value(first, 'summary.target_params', 0) / 1e6:.0f}M-parameter target takes "
                 f"{num(value(first, 'summary.target_step_ms'))} ms a token, "
                 f"{pct(value(first, 'summary.target_pct_of_copy_roofline'))} of its copy roofline "
                 f"({num(value(first, 'summary.target_copy_roofline_ms'))} ms) and "
                 f"{ratio(value(first, 'summary.target_over_draft_step'))} a draft step."]
        best = {}
        for variant in ("matched", "distilled", "mismatched", "ngram"):
            rows = greedy1[greedy1["variant"] == variant]
            if len(rows):
                best[variant] = rows.loc[rows["metrics.speedup_vs_target"].idxmax()]
        said = []
        for variant, label in (("matched", "the matched draft"), ("distilled", "the distilled draft"),
                               ("ngram", "prompt lookup")):
            r = best.get(variant)
            if r is not None:
                said.append(f"{label} {ratio(r['metrics.speedup_vs_target'])} at k = {int(r['params.k'])} "
                            f"(acceptance {100 * r['metrics.acceptance_rate']:.0f}%, "
                            f"{r['metrics.tokens_per_verify']:.2f} tokens per verify pass)")
        if said:
            parts.append("Greedy, one request at a time, the best k gives " + "; ".join(said) + ".")
        if agreement:
            parts.append("On TinyShakespeare's validation split the drafts' top token is the target's "
                         + ", ".join(f"{100 * a['val_top1_agreement']:.0f}% of the time ({role})"
                                     for role, a in agreement.items()) + ".")
        mis = best.get("mismatched")
        if mis is not None:
            worst = greedy1[greedy1["variant"] == "mismatched"]
            worst = worst.loc[worst["metrics.speedup_vs_target"].idxmin()]
            parts.append(f"The Python draft shares only the vocabulary: it keeps "
                         f"{100 * mis['metrics.acceptance_rate']:.0f}% of its proposals at its best k "
                         f"(k = {int(mis['params.k'])}), so a step emits {mis['metrics.tokens_per_verify']:.2f} tokens "
                         f"while paying k draft steps and a wider verify pass: {ratio(mis['metrics.speedup_vs_target'])} "
                         f"the target alone at best, {ratio(worst['metrics.speedup_vs_target'])} at k = "
                         f"{int(worst['params.k'])} (the seed's TinyLlama draft: "
                         f"{ratio(seed.SPECULATIVE[0][3] / seed.SPECULATIVE[0][4])}).")
        shrink = []
        for c in sorted(set(ok["params.concurrency"])):
            rows = ok[(ok["params.temperature"] == 0) & (ok["params.concurrency"] == c) & (ok["variant"] != "target")]
            if len(rows):
                r = rows.loc[rows["metrics.speedup_vs_target"].idxmax()]
                shrink.append(f"{ratio(r['metrics.speedup_vs_target'])} at {int(c)} at once ({r['variant']}, "
                              f"k = {int(r['params.k'])})")
        if len(shrink) > 1:
            parts.append("The best greedy speedup falls as requests share the step: " + ", ".join(shrink)
                         + "; a verify pass of k + 1 rows per request stops being nearly free once the batch's rows "
                           "approach the ridge, and the target alone already reads its weights once for all of them.")
        spec = ok[ok["variant"] != "target"]
        if len(spec):
            error = (spec["metrics.speedup_measured_over_predicted"] - 1).abs()
            worst = spec.loc[error.idxmax()]
            error1 = (greedy1[greedy1["variant"] != "target"]["metrics.speedup_measured_over_predicted"] - 1).abs()
            parts.append(f"The formula E[tokens per verify] x t_target / (k t_draft + t_verify(k + 1)) holds within "
                         f"{100 * error1.max():.0f}% on every greedy batch-1 row.")
            parts.append(f"The formula's worst row over the whole sweep "
                         f"({worst['variant']}, k = {int(worst['params.k'])}, T = {worst['params.temperature']:g}, "
                         f"{int(worst['params.concurrency'])} at once) measured {ratio(worst['metrics.speedup_measured_over_predicted'])} "
                         f"its prediction: the engine spent {num(worst['metrics.propose_ms_per_step'])} + "
                         f"{num(worst['metrics.verify_ms_per_step'])} ms per step proposing and verifying where the "
                         f"formula's step times add to {num(worst['metrics.t_propose_ms'])} + "
                         f"{num(worst['metrics.t_verify_ms'])} ms; the rest is what they leave out (acceptance, "
                         "rejection sampling, rollback and the host's bookkeeping).")
        out.append(bullets(parts, f"{first['hardware_name']}:"))
    return "\n\n".join(out)
