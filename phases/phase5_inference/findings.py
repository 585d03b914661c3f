"""Phase 5's findings: sentences whose every number comes from the newest records per GPU."""
from common.formats import num, pct, ratio
from common.frame import by_hardware, find, value

from . import seed


def findings(view) -> str:
    out = []
    for _, got in sorted(by_hardware(view.frame, ["phase5.startup", "phase5.ttft_decode", "phase5.batching",
                                                  "phase5.offline", "phase5.quant_engine", "phase5.quant_kernels",
                                                  "phase5.quant_quality"]).items()):
        parts = []
        d = got.get("phase5.ttft_decode")
        mine = find(d, "lab-engine", model="llama-3.1-8b")
        comp = find(d, "pytorch-compile", model="llama-3.1-8b")
        eager = find(d, "pytorch-eager", model="llama-3.1-8b")
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
            out.append(f"**{name}.** " + " ".join(parts))
    return "\n\n".join(out)


def quantization(got: dict) -> list[str]:
    """What the quantization records say: the bytes each format promises, what the engine got of
    them, where the kernel stands, and what it cost in perplexity."""
    parts = []
    e = got.get("phase5.quant_engine")
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
        if naive is not None:
            parts.append(f"The same int4 weights through the naive path run at {ratio(naive['metrics.speedup_vs_bf16'])} "
                         f"bf16 (the seed's naive AWQ: {seed.QUANT_8B['AWQ int4, naive kernel'][2]}x): each projection is "
                         "dequantized to a bf16 copy in memory before cuBLAS reads it, so a step moves more bytes than "
                         "bf16 itself, not fewer.")
    k = got.get("phase5.quant_kernels")
    if k is not None:
        fused = find(k[k["status"] == "ok"], "w4_fused", matrix="gate_up", batch=1)
        if fused is not None:
            parts.append(f"At the kernel, W4A16 on gate_up at batch 1 takes {num(1000 * fused['metrics.ms'])} µs, "
                         f"{pct(fused['metrics.pct_of_roofline'])} of its roofline and "
                         f"{ratio(fused['metrics.speedup_vs_bf16_cublas'])} bf16 cuBLAS.")
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
