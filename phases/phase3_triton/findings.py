"""Phase 3's findings: sentences whose every number comes from the records (a thin template)."""
from common.formats import bullets, elements, num, pct, size_bytes
from common.frame import by_hardware, find, value

from . import analysis
from .rows import ADD, BWD, FWD, MATMUL, SOFTMAX, attn_top, group, largest, lib, matmul_best, square, triton_rows


def _vector_add(rows) -> list[str]:
    big = triton_rows(rows).sort_values("params.n")
    if not len(big):
        return []
    big, seed = big.iloc[-1], find(rows, "triton", n=98432)
    cp = find(rows, "copy", n=big["params.n"])
    out = ["The seed's 98,432-element case matched torch bit for bit (the mask kept the half-empty last block inside "
           "the arrays)." if seed is not None else "",
           f"At {elements(big['params.n'])} elements ({size_bytes(big['params.working_set_bytes'])} per call) the Triton "
           f"kernel moved {num(big['metrics.gbps'])} GB/s, {pct(big['metrics.pct_of_copy_bandwidth'])} of the "
           f"{num(cp['metrics.gbps'] if cp is not None else None)} GB/s a copy reached at the same size and "
           f"{pct(big['metrics.pct_of_library'])} of torch.add's rate.",
           f"The roofline predicted {num(big['prediction.predicted_ms'])} ms for it from bandwidth alone and it took "
           f"{num(big['metrics.ms'])} ms."]
    out = [x for x in out if x]
    return ["**Vector add.** " + out[0], *out[1:]]


def _softmax(rows) -> list[str]:
    seed, sweep = group("seed")(rows), triton_rows(rows, group="sweep")
    tr, un, th = (find(seed, v) for v in ("triton", "unfused", "torch"))
    out = []
    if tr is not None and un is not None:
        cost = analysis.fusion_cost(analysis.own(un, "bytes"), un["metrics.ms"], analysis.own(tr, "bytes"), tr["metrics.ms"])
        out.append(f"**Why fusion wins.** On the seed's {num(tr['params.rows'])} x {num(tr['params.cols'])} softmax the "
                   f"five-kernel chain moved {size_bytes(analysis.own(un, 'bytes'))} against the fused kernel's "
                   f"{size_bytes(analysis.own(tr, 'bytes'))} ({num(cost['bytes_over_fused'])}x) and took "
                   f"{num(cost['time_over_fused'])}x as long: the chain itself ran at {num(analysis.own(un, 'gbps'))} GB/s of its "
                   f"own traffic, so it is not slow arithmetic but {num(cost['bytes_over_fused'], 2)}x the bytes.")
        if th is not None:
            out.append(f"torch.softmax, one fused kernel too, took {num(th['metrics.ms'] * 1000)} µs on the seed's shape "
                       f"against Triton's {num(tr['metrics.ms'] * 1000)} µs.")
    if len(sweep):
        lo, ln = sweep.loc[sweep["metrics.pct_of_library"].idxmin()], sweep.sort_values("params.cols").iloc[-1]
        out.append(f"Across the row-length sweep the fused kernel's worst showing against torch.softmax was "
                   f"{pct(lo['metrics.pct_of_library'])} of its speed (rows of {num(lo['params.cols'])}); at the longest rows "
                   f"({num(ln['params.cols'])} elements) the tuner picked `{ln['metrics.kernel']}` and it ran at "
                   f"{num(ln['metrics.gbps'])} GB/s, {pct(ln['metrics.pct_of_copy_bandwidth'])} of copy, "
                   f"{pct(ln['metrics.pct_of_library'])} of torch.softmax.")
    return out


def _matmul(view, rows) -> list[str]:
    m = matmul_best(rows)
    if m is None:
        return []
    cb = find(square(rows), "cublas", n=m["params.n"], dtype="bf16")
    c = (view.record(m["path"]).get("conditions") or {}).get("gpu_after_run") or {}
    reasons = [r for r in (c.get("clock_event_reasons") or []) if r != "gpu_idle"]
    return [f"**Why tiling wins, and the gap.** The bf16 product at N = {num(m['params.n'])} has an intensity of "
            f"{num(m['prediction.intensity_flop_per_byte'])} FLOP/byte overall, but every K step of a tile only reuses what "
            f"it loads a bounded number of times, so the tile shape and the L2 decide whether the tensor cores wait.",
            f"The best Triton kernel ({m['variant']}, `{m['metrics.config']}`) reached {num(m['metrics.tflops'])} TFLOP/s, "
            f"{pct(m['metrics.pct_of_library'])} of cuBLAS ({num(cb['metrics.tflops'] if cb is not None else None)} TFLOP/s "
            f"in the same run) and {pct(m['metrics.pct_of_peak_tflops'])} of the spec-sheet peak; measured/predicted "
            f"{num(m['prediction.measured_over_predicted'])}.",
            f"Right after the run the SM clock read {num(c.get('sm_clock_mhz'))} MHz at {num(c.get('power_draw_w'))} W, "
            f"held back by `{'`, `'.join(reasons)}`: both Triton and cuBLAS run under the same power cap." if reasons else ""]


def _attention(fwd, bwd) -> list[str]:
    out, top = [], attn_top(fwd) if fwd is not None else []
    if len(top):
        t = top.iloc[-1]
        out.append(f"**Flash attention.** bf16, head dim 128, non-causal, N = {num(t['params.n'])}: {num(t['metrics.tflops'])} "
                   f"TFLOP/s, {pct(t['metrics.pct_of_library'])} of the fastest library path ({lib(t['metrics.library'])}, "
                   f"{num(t['metrics.library_ms'])} ms against Triton's {num(t['metrics.ms'])} ms), "
                   f"{pct(t['metrics.pct_of_peak_tflops'])} of the dense bf16 peak; config `{t['metrics.config']}`.")
    seed = triton_rows(fwd, group="seed").sort_values("params.n") if fwd is not None else []
    if len(seed):
        s = seed.iloc[-1]
        out.append(f"In the seed's fp32 case at N = {num(s['params.n'])}, naive attention materialized "
                   f"{size_bytes(s['metrics.attn_matrix_bytes'])} per N x N matrix, and the fused kernel ran "
                   f"{num(value(s, 'metrics.speedup_vs_naive'))}x as fast as it.")
    back = largest(triton_rows(bwd, dtype="bf16", head_dim=128, causal=False)) if bwd is not None else []
    if len(back):
        b = back.iloc[-1]
        out.append(f"**Backward.** At the same shape the backward ran at {num(b['metrics.tflops'])} TFLOP/s (conventional "
                   f"FLOPs), {pct(b['metrics.pct_of_library'])} of {lib(b['metrics.library'])}'s backward.")
    return out


def findings(view) -> str:
    paras = []
    for _, got in sorted(by_hardware(view.frame, [ADD, SOFTMAX, MATMUL, FWD, BWD]).items()):
        s = [*(_vector_add(got[ADD]) if ADD in got else []), *(_softmax(got[SOFTMAX]) if SOFTMAX in got else []),
             *(_matmul(view, got[MATMUL]) if MATMUL in got else []), *_attention(got.get(FWD), got.get(BWD))]
        if any(s):
            paras.append(bullets(s, f"On the {next(iter(got.values())).iloc[0]['hardware_name']}:"))
    return "\n\n".join(paras)
