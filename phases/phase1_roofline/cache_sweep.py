"""Bandwidth against working-set size: the L2 cliff.

    lab run phase1.cache_sweep

A copy of S/2 bytes into another S/2 bytes touches a working set of S bytes. Repeated with warm
caches (no flush between calls), a working set that fits in L2 is served from on-chip SRAM and
beats the HBM roofline (measured/predicted < 1); past the L2 size every byte comes from HBM and the
bandwidth falls to the HBM plateau: the cliff. Each point is timed as a CUDA-graph replay of many
back-to-back copies, so launch overhead does not swamp the small sizes; at the smallest sizes the
per-kernel start-up cost still dominates, which is why the left end of the curve rises. From
1 GiB up one copy is long enough to time directly (see graph_reps).
"""
import torch

from common.exercise import Exercise, Result, Work, measure, reference_check
from common.params import Int
from common.standalone import run_alone


def graph_reps(working_set: int, target_bytes: int = 2**30) -> int | None:
    """Copies per graph replay, so that a replay moves about 1 GiB (at most 512 copies).

    None (plain event timing) once one copy is that large: launch overhead no longer matters there,
    and a graph-captured large memcpy runs on a copy engine, well below an SM copy's bandwidth."""
    reps = target_bytes // working_set
    return min(512, reps) if reps >= 2 else None


def run(ctx, params):
    rows = []
    for ws in ctx.track(params["working_sets"], "working-set sizes"):
        n = ws // 8                                    # two fp32 buffers of n elements = ws bytes
        src = torch.rand(n, device=ctx.device) + 0.5
        dst = torch.empty_like(src)

        def copy(src=src, dst=dst):
            dst.copy_(src)

        reps = graph_reps(ws) if ctx.is_cuda else None
        check = reference_check(ctx, dst, copy, src, "the source tensor")
        rows.append(measure(ctx, "copy", {"working_set_bytes": ws, "dtype": "fp32"}, fn=copy, check=check,
                            flops=0, bytes_moved=ws, dtype=None,
                            timing={"flush_l2": False, "graph_reps": reps}))
    ok = [r for r in rows if r["status"] == "ok"]
    summary = {}
    if ok:
        l2 = None
        if ctx.is_cuda:
            l2 = getattr(torch.cuda.get_device_properties(ctx.device), "L2_cache_size", None)
        beyond = [r["metrics"]["gbps"] for r in ok if l2 and r["params"]["working_set_bytes"] >= 8 * l2]
        peak = max(ok, key=lambda r: r["metrics"]["gbps"])
        summary = {"l2_bytes": l2, "peak_gbps": peak["metrics"]["gbps"],
                   "peak_working_set_bytes": peak["params"]["working_set_bytes"],
                   "hbm_plateau_gbps": sorted(beyond)[len(beyond) // 2] if beyond else None}
        if summary["hbm_plateau_gbps"]:
            summary["peak_over_plateau"] = summary["peak_gbps"] / summary["hbm_plateau_gbps"]
    return Result(rows, summary)


MiB = 2**20
EXERCISE = Exercise(id="phase1.cache_sweep", title="Copy bandwidth vs working set: the L2 cliff",
                    run=run, params={"working_sets": Int([2**k * MiB for k in range(0, 13)], min=64, many=True,
                                                         unit="bytes, source plus destination")},   # 1 MiB .. 4 GiB
                    cpu_params={"working_sets": [int(2**k * MiB) for k in range(-2, 10)]},     # 256 KiB .. 512 MiB
                    quick_params={"working_sets": [64 * 1024, 256 * 1024]},
                    footprint_bytes=lambda p: max(p["working_sets"]),
                    work=lambda p: [Work(f"copy {ws} B", 0, ws, None, working_set_bytes=ws, warm=True,
                                         graph_reps=graph_reps(ws)) for ws in p["working_sets"]])


if __name__ == "__main__":
    run_alone(EXERCISE, {"working_sets": [96 * 1024, 3 * 2**20 + 8]})
