"""The synchronize lesson, measured: the same work timed without and with a synchronize.

    lab run phase0.synchronize

A CUDA launch returns as soon as the work is queued. Timing `reps` matmuls with a host clock and
no synchronize measures how fast Python can enqueue them, not how fast the GPU runs them. Both
timings are recorded against the same roofline prediction: the unsynchronized one comes out far
*faster than the roofline allows*, which is the tell that it measured the wrong thing.
On a CPU the work is synchronous and the two agree.
"""
import time

from common.exercise import Exercise, Result, row, throughput_metrics
from common.params import Int
from common.standalone import run_alone
from common.timing import summarize

from .matmul_baseline import footprint_bytes, fp32_matmul_rows, matmul_precision, matmul_work

import torch


def host_timed(ctx, fn, reps: int, samples: int, sync: bool) -> list[float]:
    """Per-call ms from time.perf_counter around `reps` calls, with or without a final synchronize."""
    out = []
    for _ in range(samples):
        ctx.synchronize()                     # start from an idle GPU either way
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if sync:
            ctx.synchronize()
        out.append((time.perf_counter() - t0) * 1e3 / reps)
        ctx.synchronize()                     # drain before the next sample
    return out


LESSON = "lesson: timed by a host clock without a synchronize, so the number is wrong on purpose"


def prediction(ctx, flops, nbytes, t, sync: bool) -> dict:
    """The row's prediction; the unsynchronized row says it is a lesson, not a test of the model."""
    p = ctx.predict(flops, nbytes, "fp32", t)
    if not sync:
        p["excluded"] = LESSON
    return p


def run(ctx, params):
    n, reps, samples = params["n"], params["reps"], params["samples"]
    if not (ctx.wants("no_sync") or ctx.wants("sync")):
        return Result([])
    # Correctness first: the same fp32 matmul as the baseline, checked against float64.
    [checked] = fp32_matmul_rows(ctx, n, ["fp32"], timing={"target_ms": 20, "min_samples": 3})
    if checked["status"] != "ok":
        return Result([checked])
    a = torch.randn(n, n, device=ctx.device)
    b = torch.randn(n, n, device=ctx.device)
    c = torch.empty(n, n, device=ctx.device)
    w = matmul_work(n, "fp32")
    flops, nbytes = w.flops, w.bytes
    roofs = ctx.roofs("fp32")
    rows = []
    with matmul_precision("highest"):
        fn = lambda: torch.matmul(a, b, out=c)  # noqa: E731
        for _ in range(3):
            fn()
        for variant, sync in (("no_sync", False), ("sync", True)):
            if not ctx.wants(variant):
                continue
            t = summarize(host_timed(ctx, fn, reps, samples, sync),
                          f"perf_counter around {reps} calls, {'with' if sync else 'without'} synchronize",
                          warmup_calls=3, flush_l2=False)
            rows.append(row(variant, {"n": n, "dtype": "fp32", "reps": reps, "synchronize": sync},
                            check=checked["check"], timing=t,
                            metrics=throughput_metrics(t.median_ms, flops, nbytes, roofs, "fp32"),
                            prediction=prediction(ctx, flops, nbytes, t, sync)))
    by = {r["variant"]: r["metrics"]["ms"] for r in rows}
    summary = {}
    if len(by) == 2:
        summary = {"illusory_speedup": by["sync"] / by["no_sync"],
                   "no_sync_faster_than_roofline": rows[0]["prediction"]["measured_over_predicted"] < 1}
    return Result(rows, summary)


EXERCISE = Exercise(id="phase0.synchronize", title="Timing without and with torch.cuda.synchronize()",
                    run=run, params={"n": Int(4096, min=1, max=65536, unit="rows = columns"),
                                    "reps": Int(20, min=1, max=10_000, unit="matmuls per sample"),
                                    "samples": Int(10, min=1, max=10_000, unit="samples")},
                    cpu_params={"n": 512, "reps": 5, "samples": 5}, quick_params={"n": 64, "reps": 2, "samples": 2},
                    variants=("no_sync", "sync"),
                    footprint_bytes=lambda p: footprint_bytes(p["n"]) + 3 * p["n"] ** 2 * 4,
                    work=lambda p: [matmul_work(p["n"], "fp32")])


if __name__ == "__main__":
    run_alone(EXERCISE, {"n": 333})
