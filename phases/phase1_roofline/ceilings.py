"""phase1.ceilings: what this machine sustains, measured, for the calibrated roofline.

    lab run phase1.ceilings

Each timed by the same harness as every exercise: copy bandwidth far beyond L2 (the HBM roof), copy
bandwidth of a working set that stays in L2 (caches warm; on a CPU its last-level cache), the best
sustained matmul rate per dtype (median over samples, best over sizes), the latency floor: what the
harness shows for an empty kernel, launched alone as a PyTorch op, as a Triton kernel and replayed
in a CUDA graph, and a synchronize; a GEMV's sustained bandwidth (a skinny matmul, a decode step's
regime), at two sizes for its fixed part and its slope; the host's time per op of an eager autograd step; and the special-function rate
(exponentials per second: what attention's softmax spends between its two products;
special_function.py). The Triton floor and the last three are what the summed workload model
(common/workload.py) needs beside the roofline's.
The summary holds them as `ceilings`; every later timed row's `prediction.calibrated` names this
record. Ceilings come only from here, never fitted to the rows they predict.
"""
import time

import torch

from common.checks import TORCH_DTYPES
from common.cpu_cache import last_level_cache
from common.exercise import Exercise, Result, measure, reference_check, row
from common.params import Choice, Float, Int
from common.standalone import run_alone
from common.timing import summarize

from .cache_sweep import graph_reps
from . import special_function
from .matmul_fp16 import matmul_row

EXCLUDED = "calibration: this row measures a ceiling, so it cannot test the model built from it"


def _copy_row(ctx, variant: str, working_set: int, warm: bool) -> dict:
    n = max(1, working_set // 8)                         # two fp32 buffers of n elements
    src = torch.rand(n, device=ctx.device) + 0.5
    dst = torch.empty_like(src)

    def copy(src=src, dst=dst):
        dst.copy_(src)

    reps = graph_reps(working_set) if (warm and ctx.is_cuda) else None
    r = measure(ctx, variant, {"working_set_bytes": 8 * n, "dtype": "fp32"}, fn=copy, flops=0, bytes_moved=8 * n,
                dtype=None, check=reference_check(ctx, dst, copy, src, "the source tensor"),
                timing={"flush_l2": not warm, "graph_reps": reps})
    del src, dst
    return r


def _matmul_row(ctx, dtype: str, n: int) -> dict:
    """fp32 with TF32 off (CUDA cores), tf32 with it on (tensor cores), fp16 and bf16."""
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        return matmul_row(ctx, n, dtype)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed


def _gemv_row(ctx, k: int, n: int, variant: str = "gemv") -> dict:
    """A skinny matmul's sustained bandwidth: one row times an n x k weight (a batch-1 decode
    projection's shape), bf16 on a GPU (fp32 on a CPU), the weight far larger than L2. A GEMV reads
    its weight once and does 1 FLOP per byte, so it is memory-bound; whether it reaches the copy
    rate is what this row measures (the summed model reads weights of decode steps at it).
    `gemv_small` is the same product with fewer outputs (a decode step's smaller projections):
    with the large one it gives a GEMV's time as a fixed part plus bytes over a slope (gemv_fit)."""
    dtype = "bf16" if ctx.is_cuda else "fp32"
    t = TORCH_DTYPES[dtype]
    g = torch.Generator(device=ctx.device).manual_seed(k + n)
    x = torch.randn(1, k, device=ctx.device, generator=g).to(t)
    w = torch.randn(n, k, device=ctx.device, generator=g).to(t)
    y = torch.empty(1, n, device=ctx.device, dtype=t)

    def gemv(x=x, w=w, y=y):
        torch.matmul(x, w.t(), out=y)

    check = reference_check(ctx, y, gemv, x.double() @ w.double().t(), "float64 product of the same inputs", dtype)
    nbytes = (k * n + k + n) * t.itemsize
    r = measure(ctx, variant, {"k": k, "n": n, "dtype": dtype, "working_set_bytes": nbytes}, fn=gemv, check=check,
                flops=2 * k * n, bytes_moved=nbytes, dtype=dtype)
    del x, w, y
    return r


AUTOGRAD_CHAINS = (16, 80)       # multiplies in the short and the long chain: the slope is per op


def _autograd_row(ctx) -> dict:
    """The host's time per op of an eager training step: a chain of n tiny multiplies under
    autograd, forward and backward (2 n ops: each multiply and its MulBackward), timed for two
    lengths; the slope between them is one op's cost, the fixed part (the sum, the seed, the
    engine's start) cancelled. Its kernels are ~empty, so the GPU waits on the host throughout."""
    x = torch.rand(256, device=ctx.device, requires_grad=True)

    def chain(n):
        def fn(x=x):
            x.grad = None
            y = x
            for _ in range(n):
                y = y * 1.0001
            y.sum().backward()
        return fn

    short, long = AUTOGRAD_CHAINS
    chain(long)()
    ctx.synchronize()
    want = 1.0001 ** long
    err = float((x.grad - want).abs().max() / want)
    check = {"passed": err < 1e-5, "reason": None if err < 1e-5 else f"gradient off by {err:.2e} (relative)",
             "reference": f"d/dx of x * 1.0001^{long} summed: 1.0001^{long} everywhere", "max_rel_error": err}
    params = {"kernel": f"x * 1.0001, {short} and {long} times, then sum().backward()", "chains": list(AUTOGRAD_CHAINS)}
    if not check["passed"]:
        return row("autograd_op", params, "failed", check["reason"], check=check)
    t_short, t_long = ctx.time(chain(short), flush_l2=False), ctx.time(chain(long), flush_l2=False)
    op_ms = (t_long.median_ms - t_short.median_ms) / (2 * (long - short))
    return row("autograd_op", params, check=check, timing=t_long,
               metrics={"ms": op_ms, "op_us": 1e3 * op_ms, "short_chain_ms": t_short.median_ms,
                        "long_chain_ms": t_long.median_ms},
               prediction={"excluded": EXCLUDED, "predicted_ms": None, "bound": None, "measured_over_predicted": None,
                           "model": "none: a floor, not a prediction"})


def _launch_rows(ctx) -> list[dict]:
    x = torch.zeros(1, device=ctx.device)

    def tiny(x=x):
        x.add_(1.0)

    rows = [measure(ctx, "launch", {"kernel": "add_ on 1 element"}, fn=tiny, flops=1, bytes_moved=8, dtype="fp32",
                    check=lambda: {"passed": True, "reason": None, "reference": "none: the floor is the result"})]
    if ctx.is_cuda:
        rows.append(measure(ctx, "graph_launch", {"kernel": "add_ on 1 element", "graph_reps": 100}, fn=tiny, flops=1,
                            bytes_moved=8, dtype="fp32", timing={"graph_reps": 100},
                            check=lambda: {"passed": True, "reason": None, "reference": "none: the floor is the result"}))
        samples = []
        for _ in range(200):
            t0 = time.perf_counter()
            torch.cuda.synchronize(ctx.device)
            samples.append((time.perf_counter() - t0) * 1e3)
        t = summarize(sorted(samples), "perf_counter around torch.cuda.synchronize()", 0, False)
        rows.append(row("synchronize", {"kernel": "none: an idle stream"}, timing=t, metrics={"ms": t.median_ms},
                        prediction={"excluded": EXCLUDED, "predicted_ms": None, "bound": None,
                                    "measured_over_predicted": None, "model": "none: a floor, not a prediction"}))
    return rows


def cache_of(ctx) -> tuple[str, int | None]:
    """(the copy row's variant, the cache's bytes): a GPU's L2, or a CPU's last-level cache (a CPU
    is timed warm, so a working set that fits there is served from it; see common/cpu_cache.py)."""
    if ctx.is_cuda:
        return "l2_copy", getattr(torch.cuda.get_device_properties(ctx.device), "L2_cache_size", None)
    llc = last_level_cache()
    return "llc_copy", llc[1] if llc else None


def run(ctx, params) -> Result:
    cache_variant, l2 = cache_of(ctx)
    rows = [_copy_row(ctx, "hbm_copy", params["hbm_bytes"], warm=False)]
    if l2:
        rows.append(_copy_row(ctx, cache_variant, int(l2 * params["l2_fraction"]), warm=True))
    dtypes = [d for d in params["dtypes"] if ctx.is_cuda or d in ("fp32",)]
    for dtype in ctx.track(dtypes, "matmul ceilings"):
        rows += [_matmul_row(ctx, dtype, n) for n in params["matmul_sizes"]]
    rows.append(_gemv_row(ctx, params["gemv_k"], params["gemv_n"]))
    rows.append(_gemv_row(ctx, params["gemv_k"], params["gemv_small_n"], "gemv_small"))
    rows += _launch_rows(ctx)
    if ctx.is_cuda:                      # a floor, like the synchronize row: what a GPU step waits on
        rows.append(_autograd_row(ctx))
    rows += special_function.rows(ctx, params["exp_elements"])
    for r in rows:
        if r.get("prediction"):
            r["prediction"]["excluded"] = EXCLUDED
    return Result(rows, {"ceilings": ceilings_of(rows, l2, params["l2_fraction"])})


def ceilings_of(rows: list[dict], l2_bytes: int | None, l2_fraction: float) -> dict:
    """The summary the calibrated model reads (units in the names). `l2_*` is the cache level a
    warm working set is served from: a GPU's L2, a CPU's last-level cache (row `llc_copy`)."""
    ok = {r["variant"]: r for r in rows if r["status"] == "ok"}
    fit = int(l2_bytes * l2_fraction) if l2_bytes else 0
    if "llc_copy" in ok:                # a CPU: always warm, so the whole cache serves (as Context.roofs)
        ok["l2_copy"], fit = ok["llc_copy"], l2_bytes
    matmul: dict = {}
    for r in rows:
        dtype = r["params"].get("dtype")
        if r["status"] == "ok" and r["variant"] in TORCH_DTYPES and dtype and r["metrics"].get("tflops"):
            matmul[dtype] = max(matmul.get(dtype, 0.0), r["metrics"]["tflops"])
    return {
        "hbm_gbps": ok["hbm_copy"]["metrics"]["gbps"] if "hbm_copy" in ok else None,
        "l2_gbps": ok["l2_copy"]["metrics"]["gbps"] if "l2_copy" in ok else None,
        "l2_bytes": l2_bytes, "l2_fit_bytes": fit,
        "matmul_tflops": matmul,
        "launch_us": 1e3 * ok["launch"]["metrics"]["ms"] if "launch" in ok else None,
        "graph_launch_us": 1e3 * ok["graph_launch"]["metrics"]["ms"] if "graph_launch" in ok else None,
        "sync_us": 1e3 * ok["synchronize"]["metrics"]["ms"] if "synchronize" in ok else None,
        "triton_launch_us": 1e3 * ok["triton_launch"]["metrics"]["ms"] if "triton_launch" in ok else None,
        "exp_per_s": ok["exp"]["metrics"]["exp_per_s"] if "exp" in ok else None,
        "gemv_gbps": ok["gemv"]["metrics"]["gbps"] if "gemv" in ok else None,
        "autograd_op_us": ok["autograd_op"]["metrics"]["op_us"] if "autograd_op" in ok else None,
        **gemv_fit(ok),
    }


def gemv_fit(ok: dict) -> dict:
    """A GEMV's time as fixed + bytes / slope, from the two GEMV rows of this record (a line through
    two points of the same kernel, never through the rows it predicts): `gemv_slope_gbps`, and
    `gemv_fixed_us`, the fixed part beyond the PyTorch op's launch floor (the first bytes' latency,
    the last wave's tail: what makes a 30 MB projection slower per byte than a 200 MB one). None
    for both when a row is missing or the two do not give a positive slope and fixed part."""
    none = {"gemv_slope_gbps": None, "gemv_fixed_us": None}
    if not all(v in ok for v in ("gemv", "gemv_small", "launch")):
        return none
    (t_big, b_big), (t_small, b_small) = [(ok[v]["metrics"]["ms"], ok[v]["params"]["working_set_bytes"])
                                          for v in ("gemv", "gemv_small")]
    if b_big <= b_small or t_big <= t_small:
        return none
    slope_gbps = (b_big - b_small) / ((t_big - t_small) * 1e6)
    fixed_us = 1e3 * (t_small - b_small / (slope_gbps * 1e6) - ok["launch"]["metrics"]["ms"])
    return {"gemv_slope_gbps": slope_gbps, "gemv_fixed_us": max(0.0, fixed_us)}


EXERCISE = Exercise(
    id="phase1.ceilings", title="Ceilings measured on this machine: HBM and L2 copy, matmul per dtype, latency floors, exp rate",
    run=run, params={"hbm_bytes": Int(2 * 2**30, min=2**20, unit="bytes, source plus destination"),
                     "l2_fraction": Float(0.5, min=0.05, max=1.0, unit="of the L2 size (working set of the L2 copy)"),
                     "matmul_sizes": Int([4096, 8192], min=16, max=65536, many=True, unit="N of an N x N x N product"),
                     "dtypes": Choice(["fp32", "tf32", "fp16", "bf16"], ("fp32", "tf32", "fp16", "bf16"), many=True),
                     "gemv_k": Int(4096, min=1, unit="inputs of the GEMV row (Llama 3.1 8B's hidden size)"),
                     "gemv_n": Int(28672, min=1, unit="outputs of the GEMV row (Llama 3.1 8B's gate_up)"),
                     "gemv_small_n": Int(4096, min=1, unit="outputs of the small GEMV row (Llama 3.1 8B's o)"),
                     "exp_elements": Int(2**24, min=1, unit=f"elements of the exp-rate kernel, "
                                                             f"{special_function.REPS} exponentials each")},
    cpu_params={"hbm_bytes": 2**28, "matmul_sizes": [512, 1024], "dtypes": ["fp32"], "gemv_k": 1024, "gemv_n": 8192,
                "gemv_small_n": 1024},
    quick_params={"hbm_bytes": 2**22, "matmul_sizes": [96], "dtypes": ["fp32", "bf16"], "exp_elements": 2**16,
                  "gemv_k": 256, "gemv_n": 1000, "gemv_small_n": 100},
    footprint_bytes=lambda p: max(p["hbm_bytes"], 3 * 4 * max(p["matmul_sizes"]) ** 2 + 3 * 8 * max(p["matmul_sizes"]) ** 2,
                                  (4 + 8) * p["gemv_k"] * p["gemv_n"]))     # the GEMV weight, its float64 copy


if __name__ == "__main__":
    run_alone(EXERCISE, {"hbm_bytes": 3 * 2**20 + 8, "matmul_sizes": [130]})
