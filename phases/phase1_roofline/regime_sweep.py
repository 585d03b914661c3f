"""phase1.regime_sweep: FP16 matmul from N = 64 to 8192, where the regime changes.

    lab run phase1.regime_sweep

Intensity N/3 FLOP/byte grows with N, so small products sit left of the ridge point and large ones
right of it; the roofline puts the crossover at N = 3 x ridge. Tiny products finish in less time
than a kernel takes to start: measured/predicted says how far from both roofs they land. The
summary stores this run's own ceilings (best matmul rate, copy bandwidth) and the ridge they give.
"""
from common.exercise import Exercise, Result, measure_copy_gbps
from common.params import Choice, Int
from common.roofline import ridge_point
from common.standalone import run_alone

from .matmul_fp16 import footprint_bytes, matmul_row, matmul_work


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
    return Result(rows, summary)


EXERCISE = Exercise(id="phase1.regime_sweep", title="Roofline regime sweep: FP16 matmul, N = 64 to 8192",
                   run=run_sweep, params={"sizes": Int([64, 128, 256, 512, 1024, 2048, 4096, 8192], min=1, max=65536,
                                                       unit="N of an N x N x N product", many=True),
                                          "dtype": Choice("fp16", ("fp16", "bf16", "fp32")),
                                          "copy_bytes": Int(2**31, min=2**20, unit="bytes per copy buffer")},
                   cpu_params={"sizes": [64, 128, 256, 512, 1024], "dtype": "fp32", "copy_bytes": 2**28},
                   quick_params={"sizes": [16, 48], "copy_bytes": 2**20},
                   footprint_bytes=lambda p: max(footprint_bytes(max(p["sizes"]), p["dtype"]), 2 * p["copy_bytes"]),
                   work=lambda p: [matmul_work(n, p["dtype"]) for n in p["sizes"]])


if __name__ == "__main__":
    run_alone(EXERCISE, {"sizes": [33, 130, 257]})
