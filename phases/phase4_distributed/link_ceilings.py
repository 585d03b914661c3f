"""phase4.link_ceilings: the two constants of the alpha-beta model, measured per collective and GPU count.

    lab run phase4.link_ceilings                   # NCCL on [2, all] GPUs
    python -m phases.phase4_distributed.link_ceilings          # alone: 2 CPU ranks (gloo), small sizes

A collective's time is modelled as alpha + size x busbw_factor / beta (calibration.py). This
exercise measures, for each collective the interconnect sweep covers (all_reduce, all_gather,
reduce_scatter, sendrecv) and each world size, with the sweep's own worker (interconnect.py: the
#wrong check first, then warm-up and timed calls back to back, the slowest rank's median):
    alpha (µs)  the median time of the smallest messages (by default the sweep's three smallest sizes),
    beta (GB/s) the best bus bandwidth of the largest (by default the sweep's three largest).
The summary holds them as `link_ceilings`; phase4.interconnect and phase4.ring_allreduce rows are
predicted from the newest such record of their machine (at run time when it exists, else at report
time). Its own rows measure the ceilings, so they are excluded from the accuracy figures: ceilings
come only from here, never fitted to the rows they predict.
"""
from common.errors import LabError
from common.exercise import Exercise, Result
from common.params import Choice, Int
from common.standalone import run_alone

from . import calibration
from . import collectives as col
from .interconnect import BUFFERS, too_small
from .launch import (
    alone,
    launch,
    launch_params,
    link_roofs,
    plan,
    ranks_sharing_memory,
    whole_run_skipped,
    work_world_sizes,
)


def sizes_of(params: dict) -> tuple[list[int], list[int]]:
    """(small sizes, large sizes), each sorted; refused in one line when they overlap."""
    small, large = sorted(set(params["small_sizes_bytes"])), sorted(set(params["large_sizes_bytes"]))
    if small[-1] >= large[0]:
        raise LabError(f"--param small_sizes_bytes must all be below large_sizes_bytes: {small[-1]} bytes is not "
                       f"below {large[0]} bytes")
    return small, large


def rows_from(result: dict, n: int, backend: str, roofs, small: list[int], large: list[int],
              ops: list[str]) -> list[dict]:
    """One row per (size, collective), in the worker's order, with role 'alpha' (a small size) or
    'beta' (a large one) in its params; every timed row excluded from the accuracy (it is a ceiling)."""
    asked = [(size, op) for size in small + large for op in ops]
    if len(asked) != len(result["rows"]):
        raise LabError(f"phase4.link_ceilings on {n} ranks: {len(result['rows'])} measurements for {len(asked)} "
                       "sizes x collectives")
    method = col.timing_method(backend)
    rows = []
    for (size, op), m in zip(asked, result["rows"]):
        p = {"world_size": n, "backend": backend, "size_bytes": m["size_bytes"], "op": op, "dtype": "fp32",
             "role": calibration.ALPHA if size in small else calibration.BETA, "asked_size_bytes": size}
        r = col.collective_row(op, op, p, n, m, roofs, method)
        if r.get("prediction"):
            r["prediction"]["excluded"] = calibration.EXCLUDED
        rows.append(r)
    return rows


def run(ctx, params):
    small, large = sizes_of(params)
    pl = plan(ctx, params)
    why = too_small({"ops": params["ops"], "sizes_bytes": small + large}, pl.world_sizes)
    if why:                                    # before any rank starts
        raise LabError(why.replace("--param sizes_bytes", "--param small_sizes_bytes"))
    rows = pl.skip_rows()
    if not pl.world_sizes:
        return Result(rows, {"backend": pl.backend})
    roofs = link_roofs(ctx, pl.backend)
    ops = list(params["ops"])
    launches = {}
    for n in ctx.track(pl.world_sizes, "link ceilings world sizes"):
        # the sweep's worker, NCCL's collectives only: every size and collective checked, then timed
        job = {**params, "sizes_bytes": small + large, "ops": ops, "ours": False}
        res = launch("sweep", n, pl.backend, job, params["timeout_s"], f"phase4.link_ceilings on {n} ranks")
        launches[str(n)] = res["_launch_s"]
        rows += rows_from(res, n, pl.backend, roofs, small, large, ops)
    return Result(rows, {
        "backend": pl.backend, "world_sizes": pl.world_sizes, "launch_s": launches,
        "link_ceilings": calibration.ceilings_of(rows),
        "model": "time = alpha + size x busbw_factor / beta (common.roofline.alpha_beta_ms); alpha: median time "
                 "of the smallest sizes; beta: best busbw of the largest sizes (each size: the slowest rank's median)",
        "link_roof": {"gbps": roofs.bandwidth_gbps, "source": roofs.source}})


def work(params: dict) -> list:
    """Every row it times: each small and large size x collective x world size (ceilings, not tests)."""
    small, large = sizes_of(params)
    return [col.collective_work(op, size, n, f"{op} {col.measured_size(op, size, n)} B on {n} ranks "
                                             f"({'alpha' if size in small else 'beta'}: a ceiling)")
            for n in work_world_sizes(params) for size in small + large for op in params["ops"]]


def footprint_bytes(p: dict) -> float:
    """Per rank: the largest message's buffers (up to 2x for sendrecv) plus the #wrong check's scratch."""
    size = max(p["small_sizes_bytes"] + p["large_sizes_bytes"])
    return (max(BUFFERS[op] for op in p["ops"]) * size + col.check_scratch_bytes(size)) * ranks_sharing_memory(p)


EXERCISE = Exercise(
    id="phase4.link_ceilings", title="Link ceilings: alpha (smallest messages) and beta (busbw of the largest) "
                                     "per collective and GPU count, for the alpha-beta model",
    run=run,
    params={**launch_params(timeout_s=300),
            "ops": Choice(list(calibration.OPS), col.OPS, many=True),
            "small_sizes_bytes": Int([2**15, 2**16, 2**17], min=4, unit="bytes", many=True,
                                     help="alpha: the median time of these (the sweep's smallest sizes)"),
            "large_sizes_bytes": Int([2**30, 2**31, 2**32], min=4, unit="bytes", many=True,
                                     help="beta: the best busbw of these (the sweep's largest sizes)"),
            **col.timing_params(5, 20, 200, 8 * 2**30)},
    cpu_params={"small_sizes_bytes": [2**15, 2**16, 2**17], "large_sizes_bytes": [2**19, 2**20, 2**21],
                "warmup_iters": 2, "min_iters": 5, "max_iters": 20, "iter_bytes": 2**24,
                "timeout_s": 180, "pg_timeout_s": 60},
    quick_params={"small_sizes_bytes": [2**15, 2**16], "large_sizes_bytes": [2**19, 2**20],
                  "warmup_iters": 1, "min_iters": 3, "max_iters": 3},
    footprint_bytes=footprint_bytes, work=work, skips=whole_run_skipped,
)


if __name__ == "__main__":
    run_alone(EXERCISE, alone({"small_sizes_bytes": [2**15 + 12, 2**16], "large_sizes_bytes": [4 * 100_003]}))
