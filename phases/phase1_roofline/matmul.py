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
from common.params import Choice, Int
from common.roofline import ridge_point


def footprint_bytes(n: int, dtype: str) -> int:
    """A, B, C in `dtype`, their fp32 draws, and the float64 reference with its upcast inputs."""
    return 3 * n * n * TORCH_DTYPES[dtype].itemsize + n * n * 4 + 3 * n * n * 8


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
                  run=run_anchor, params={"n": Int(8192, min=1, max=65536, unit="rows = columns"),
                                          "dtype": Choice("fp16", ("fp16", "bf16", "fp32"))},
                  cpu_params={"n": 1024, "dtype": "fp32"}, quick_params={"n": 80},
                  footprint_bytes=lambda p: footprint_bytes(p["n"], p["dtype"]))
SWEEP = Exercise(id="phase1.regime_sweep", title="Roofline regime sweep: FP16 matmul, N = 64 to 8192",
                 run=run_sweep, params={"sizes": Int([64, 128, 256, 512, 1024, 2048, 4096, 8192], min=1, max=65536,
                                                     unit="N of an N x N x N product", many=True),
                                        "dtype": Choice("fp16", ("fp16", "bf16", "fp32")),
                                        "copy_bytes": Int(2**31, min=2**20, unit="bytes per copy buffer")},
                 cpu_params={"sizes": [64, 128, 256, 512, 1024], "dtype": "fp32", "copy_bytes": 2**28},
                 quick_params={"sizes": [16, 48], "copy_bytes": 2**20},
                 footprint_bytes=lambda p: max(footprint_bytes(max(p["sizes"]), p["dtype"]), 2 * p["copy_bytes"]))
