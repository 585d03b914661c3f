"""The compute-bound anchor and the regime sweep: FP16 matmul through cuBLAS.

    lab run phase1.matmul_fp16          # N = 8192, the compute-bound anchor
    lab run phase1.regime_sweep         # N = 64 ... 8192: watch the regime change

For C = A @ B with N x N fp16 matrices: FLOPs = 2 N^3; the fewest bytes are 3 N^2 x 2 (read A and
B, write C once), so intensity = 2N^3 / 6N^2 = N/3 FLOP/byte. It grows with N, so small products
sit left of the ridge point (memory-bound) and large ones right of it (compute-bound); the
roofline puts the crossover at N = 3 x ridge. Tiny products are neither: they finish in less time
than a kernel takes to start, and measured/predicted says how far from both roofs they land.
"""
import torch

from common.checks import TORCH_DTYPES, compare, poison
from common.exercise import Exercise, measure, measure_copy_gbps
from common.roofline import ridge_point


def matmul_row(ctx, n: int, dtype: str) -> dict:
    g = torch.Generator(device=ctx.device).manual_seed(n)
    t = TORCH_DTYPES[dtype]
    a = torch.randn(n, n, device=ctx.device, generator=g).to(t)
    b = torch.randn(n, n, device=ctx.device, generator=g).to(t)
    c = torch.empty(n, n, device=ctx.device, dtype=t)

    def fn():
        torch.matmul(a, b, out=c)

    def check():
        poison(c); fn(); ctx.synchronize()
        return compare(c, a.double() @ b.double(), dtype, "float64 matmul of the same inputs")

    return measure(ctx, dtype, {"n": n, "dtype": dtype}, fn=fn, check=check, flops=2 * n**3,
                   bytes_moved=3 * n * n * t.itemsize, dtype=dtype)


def run_anchor(ctx, params):
    return [matmul_row(ctx, params["n"], params["dtype"])]


def run_sweep(ctx, params):
    dtype = params["dtype"]
    rows = [matmul_row(ctx, n, dtype) for n in ctx.track(params["sizes"], f"{dtype} matmul sweep")]
    roofs = ctx.roofs(dtype)
    ok = [r for r in rows if r["status"] == "ok"]
    summary = {"dtype": dtype, "roofs_source": roofs.source}
    if roofs.peak(dtype):
        ridge = ridge_point(roofs.peak(dtype), roofs.bandwidth_gbps)
        summary.update({"spec_ridge_flop_per_byte": ridge, "spec_crossover_n": 3 * ridge})
    if ok:
        # The measured roofs of this run: the best matmul rate seen, over the copy bandwidth.
        best = max(r["metrics"]["tflops"] for r in ok)
        copy_gbps = measure_copy_gbps(ctx, params["copy_bytes"])
        summary.update({"measured_peak_tflops": best, "measured_copy_gbps": copy_gbps,
                        "measured_ridge_flop_per_byte": ridge_point(best, copy_gbps),
                        "measured_crossover_n": 3 * ridge_point(best, copy_gbps)})
        half = [r["params"]["n"] for r in ok if r["metrics"]["tflops"] >= best / 2]
        summary["smallest_n_at_half_of_best"] = min(half)
    return rows, summary


ANCHOR = Exercise(id="phase1.matmul_fp16", title="Compute-bound anchor: FP16 matmul at N=8192",
                  run=run_anchor, params={"n": 8192, "dtype": "fp16"}, cpu_params={"n": 1024, "dtype": "fp32"},
                  quick_params={"n": 80})
SWEEP = Exercise(id="phase1.regime_sweep", title="Roofline regime sweep: FP16 matmul, N = 64 to 8192",
                 run=run_sweep, params={"sizes": [64, 128, 256, 512, 1024, 2048, 4096, 8192], "dtype": "fp16",
                                        "copy_bytes": 2**31},
                 cpu_params={"sizes": [64, 128, 256, 512, 1024], "dtype": "fp32", "copy_bytes": 2**28},
                 quick_params={"sizes": [16, 48], "copy_bytes": 2**20})
