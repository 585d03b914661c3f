"""Exercise 4.3: the interconnect measured the way nccl-tests measures it.

    lab run phase4.interconnect                    # NCCL on [2, all] GPUs, 32 KiB .. 4 GiB
    python -m phases.phase4_distributed.interconnect           # alone: 2 CPU ranks (gloo), small sizes

For each size (nccl-tests' `size` convention, see collectives.py) and operation (all-reduce,
all-gather, reduce-scatter, a send/recv ring shift, and our ring all-reduce from ring_allreduce.py)
every rank fills its inputs with the integer pattern, runs once and counts #wrong against exact
expected values (a row with #wrong > 0 is failed, not timed), then times warm-up + timed calls back
to back; a row's time is the slowest rank's median. Rows carry algbw, busbw, % of the one-way link
(hardware.yaml) and the link roofline's prediction, and the alpha-beta one (calibration.py) when
phase4.link_ceilings has run on this machine (else the report adds it). NCCL's chosen algorithm is read from its own
TUNING log in a separate untimed probe job (logging would slow the timed calls); nothing here
overrides NCCL's choice. Our ring runs in a job of its own when its sends use their own
NCCL_P2P_NVL_CHUNKSIZE, so the NCCL rows keep every default.
"""
import os

import torch
import torch.distributed as dist

from common.errors import LabError
from common.exercise import Exercise, Result
from common.params import Bool, Choice, Int
from common.standalone import run_alone

from . import analysis, calibration
from . import collectives as col
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
from .ring_allreduce import Config, lane_groups, p2p_env

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ------------------------------------------------------------------------------ on every rank
def ring_config(params: dict, device_type: str) -> Config:
    """The one configuration of our ring the sweep runs (a CUDA graph on GPUs only)."""
    return Config(params["ring_lanes"], params["ring_directions"], params["ring_depth"],
                  bool(params["ring_graph"]) and device_type == "cuda")


def _setup(me, op: str, size: int, params: dict, lanes: list):
    """(call, check) for `op` at nccl-tests size `size`: call() runs it once; check() fills the
    inputs, poisons the outputs, runs once and returns this rank's #wrong."""
    n, r, dev = me.world, me.rank, me.device
    numel, share = col.elements_for(op, size, n)
    nan = float("nan")
    if op in ("all_reduce", "ring_allreduce"):
        buf = torch.empty(numel, device=dev)
        if op == "all_reduce":
            def call():
                dist.all_reduce(buf)
        else:
            call = ring_config(params, dev.type).bind(buf, params["ring_min_subchunk_bytes"], lanes)

        def check():
            col.fill_pattern(buf, r); call(); me.sync()
            return col.count_wrong(buf, lambda s, e: col.pattern_sum(s, e, n, dev))
    elif op == "all_gather":
        inp, out = torch.empty(share, device=dev), torch.empty(numel, device=dev)

        def call():
            _all_gather(out, inp)

        def check():
            col.fill_pattern(inp, r); out.fill_(nan); call(); me.sync()
            return sum(col.count_wrong(out[j * share:(j + 1) * share], lambda s, e, j=j: col.pattern(s, e, j, dev))
                       for j in range(n))
    elif op == "reduce_scatter":
        inp, out = torch.empty(numel, device=dev), torch.empty(share, device=dev)

        def call():
            _reduce_scatter(out, inp)

        def check():
            col.fill_pattern(inp, r); out.fill_(nan); call(); me.sync()
            return col.count_wrong(out, lambda s, e: col.pattern_sum(s, e, n, dev), offset=r * share)
    elif op == "sendrecv":
        send, recv = torch.empty(numel, device=dev), torch.empty(numel, device=dev)

        def call():
            ops = [dist.P2POp(dist.isend, send, me.right), dist.P2POp(dist.irecv, recv, me.left)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        def check():
            col.fill_pattern(send, r); recv.fill_(nan); call(); me.sync()
            return col.count_wrong(recv, lambda s, e: col.pattern(s, e, me.left, dev))
    else:
        raise ValueError(f"unknown operation '{op}'")
    return call, check, numel


def worker_task(me, params: dict) -> dict:
    ops = list(params["ops"]) + (["ring_allreduce"] if params["ours"] else [])
    lanes = lane_groups(params["ring_lanes"]) if params["ours"] else [None]
    out = []
    for size in params["sizes_bytes"]:
        for op in ops:
            me.stage(f"{op} {size} bytes")
            call, check, numel = _setup(me, op, size, params, lanes)
            wrong = sum(me.gather(check()))
            entry = {"op": op, "size_bytes": col.measured_size(op, size, me.world), "wrong": wrong,
                     "elements": numel * (1 if op in ("all_gather", "reduce_scatter") else me.world)}
            if wrong == 0:                      # the same total on every rank: all time, or none
                warmup, iters = col.iterations(size, params)
                entry.update(warmup=warmup, per_rank_samples_ms=me.gather(col.time_calls(call, warmup, iters, me.device)))
            out.append(entry)
            del call, check
        if me.device.type == "cuda":
            torch.cuda.empty_cache()
    if not params["ours"]:                   # (phase4.link_ceilings runs NCCL's collectives only)
        return {"rows": out}
    cfg = ring_config(params, me.device.type)
    return {"rows": out, "ring": {"lanes": cfg.lanes, "directions": cfg.directions, "depth": cfg.depth,
                                  "graph": cfg.graph, "min_subchunk_bytes": params["ring_min_subchunk_bytes"],
                                  "p2p_chunk_bytes": params["ring_p2p_chunk_bytes"]}}


def probe_task(me, params: dict) -> dict:
    """Each NCCL collective once per size, so NCCL logs the algorithm it picks (see the docstring)."""
    for size in params["sizes_bytes"]:
        for op in params["ops"]:
            if op in col.NCCL_FUNC:
                me.stage(f"probe {op} {size} bytes")
                call, _, _ = _setup(me, op, size, params, [None])
                call()
                me.sync()
                del call
        torch.cuda.empty_cache()
    return {"probed": True}


# ------------------------------------------------------------------------------ in the lab process
ALGO_SOURCE = ("NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING lines of rank 0, from a separate untimed probe job "
               "running the same collectives and sizes")


def rows_from(result: dict, n: int, backend: str, roofs, algos: dict | None) -> list[dict]:
    method = col.timing_method(backend)
    rows, nccl = [], {}
    for m in result["rows"]:
        op, size = m["op"], m["size_bytes"]
        p = {"world_size": n, "backend": backend, "size_bytes": size, "op": op, "dtype": "fp32"}
        r = col.collective_row(op, "all_reduce" if op == "ring_allreduce" else op, p, n, m, roofs, method)
        if backend == "nccl" and op in col.NCCL_FUNC:
            seen = (algos or {}).get(col.nccl_log_key(op, size, n))
            r["metrics"].update(algo=seen["algo"] if seen else None, proto=seen["proto"] if seen else None,
                                channels=seen["channels"] if seen else None,
                                algo_source=ALGO_SOURCE if seen else "not observed: no NCCL TUNING line for this "
                                                                      "collective and size")
        elif op == "sendrecv":
            r["metrics"].update(algo="P2P", algo_source="point-to-point: no collective algorithm")
        elif op == "ring_allreduce":
            cfg = result.get("ring") or {}
            r["metrics"].update(algo="ours: ring", algo_source="ring_allreduce.py",
                                **{f"ring_{k}": v for k, v in cfg.items()})
        else:
            r["metrics"].update(algo=None, algo_source="gloo does not report its algorithm")
        if r["status"] == "ok" and op == "all_reduce":
            nccl[size] = r["metrics"]["busbw_gbps"]
        if r["status"] == "ok" and op == "ring_allreduce" and nccl.get(size):
            r["metrics"]["ours_over_nccl_busbw"] = r["metrics"]["busbw_gbps"] / nccl[size]
        rows.append(r)
    worst = analysis.worst_over_nccl(rows)       # our ring's goal measure: its worst size from 256 MiB
    for r in rows:
        if r["variant"] in worst:
            r["metrics"]["worst_ours_over_nccl"] = worst[r["variant"]]
    return rows


def verdict(rows: list[dict], n: int) -> dict:
    """The goals on n ranks: NCCL's best all-reduce busbw from 1 GiB up against its target, and our
    ring's worst ours/NCCL from 256 MiB up against the ring's."""
    big = [r["metrics"]["busbw_gbps"] for r in rows if r["variant"] == "all_reduce" and r["status"] == "ok"
           and r["params"]["world_size"] == n and r["params"]["size_bytes"] >= analysis.NCCL_GOAL_MIN_SIZE]
    best, target = (max(big) if big else None), analysis.NCCL_BUSBW_GOAL_GBPS.get(n)
    ring = analysis.worst_over_nccl([r for r in rows if r["params"].get("world_size") == n]).get("ring_allreduce")
    return {"world_size": n, "best_busbw_gbps_from_1gib": best,
            "met": (best >= target) if (best is not None and target) else None,
            "ring_worst_ours_over_nccl": ring, "ring_met": None if ring is None else ring >= analysis.RING_GOAL_RATIO}


def too_small(params: dict, world_sizes: list[int]) -> str | None:
    """Why a size cannot run, or None. all_gather and reduce_scatter give every rank an equal share
    of whole fp32 elements, so their sizes need 4 bytes per rank (a range cannot say that: it
    depends on the world size)."""
    split = [op for op in params["ops"] if op in ("all_gather", "reduce_scatter")]
    if not split or not world_sizes:
        return None
    n = max(world_sizes)
    small = [size for size in params["sizes_bytes"] if size < 4 * n]
    if small:
        return (f"--param sizes_bytes: {small[0]} bytes is too small for {split[0]} on {n} ranks: each rank's "
                f"share must hold one fp32 element (at least {4 * n} bytes)")
    return None


def run(ctx, params):
    pl = plan(ctx, params)
    why = too_small(params, pl.world_sizes)
    if why:                                    # before any rank starts
        raise LabError(why)
    rows = pl.skip_rows()
    if not pl.world_sizes:
        return Result(rows, {"backend": pl.backend})
    roofs = link_roofs(ctx, pl.backend)
    summary = {"backend": pl.backend, "world_sizes": pl.world_sizes, "launch_s": {}, "goals": [],
               "link_roof": {"gbps": roofs.bandwidth_gbps, "source": roofs.source,
                             "bandwidth_source": roofs.bandwidth_source},
               "size_convention": "nccl-tests: all_reduce/sendrecv = per-rank buffer; all_gather = gathered "
                                  "output; reduce_scatter = input (each rank holds size/n of the result)",
               "nccl_env": {k: os.environ.get(k) for k in ("NCCL_ALGO", "NCCL_PROTO", "NCCL_NVLS_ENABLE",
                                                           "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
               "algo_probe": {}, "analysis": {}}
    found = calibration.run_time_index(ctx)      # the alpha-beta constants, if phase4.link_ceilings ran here
    for n in ctx.track(pl.world_sizes, "interconnect world sizes"):
        label = f"phase4.interconnect on {n} ranks"
        algos = None
        if pl.backend == "nccl" and params["probe_algorithms"]:
            probe = launch("probe", n, pl.backend, params, params["timeout_s"], label + " (algorithm probe)",
                           nccl_debug=True)
            algos = col.parse_nccl_tuning(line for log in probe["_nccl_logs"] for line in log.splitlines())
            summary["algo_probe"][str(n)] = {"tuning_lines_parsed": len(algos), "launch_s": probe["_launch_s"]}
        # Our ring runs in a job of its own when its sends get their own NCCL chunk size
        # (ring_allreduce.p2p_env): the NCCL rows, send/recv included, keep NCCL's defaults, as nccl-tests has them.
        env = p2p_env(params["ring_p2p_chunk_bytes"], pl.backend)
        res = launch("sweep", n, pl.backend, {**params, "ours": params["ours"] and env is None}, params["timeout_s"], label)
        summary["launch_s"][str(n)] = res["_launch_s"]
        if params["ours"] and env is not None:
            ours = launch("sweep", n, pl.backend, {**params, "ops": [], "ours": True}, params["timeout_s"],
                          label + " (our ring, " + ", ".join(f"{k}={v}" for k, v in env.items()) + ")", extra_env=env)
            summary["launch_s"][f"{n}_ours"] = ours["_launch_s"]
            res = {"rows": res["rows"] + ours["rows"], "ring": ours["ring"]}
        new = calibration.attach(EXERCISE.id, rows_from(res, n, pl.backend, roofs, algos), found, ctx.hardware_key)
        summary["goals"].append(verdict(new, n))
        summary["analysis"][str(n)] = analysis.sweep_facts(new)
        rows += new
    return Result(rows, summary)


# Buffers per rank, in units of the message: all_reduce 1; all_gather and reduce_scatter 1 + 1/n
# (the gathered output or the input, plus one share); sendrecv 2 (send and receive); our ring
# 1 + 1/n (the buffer plus its reduce-scatter scratch). n >= 2.
BUFFERS = {"all_reduce": 1.0, "all_gather": 1.5, "reduce_scatter": 1.5, "sendrecv": 2.0, "ring_allreduce": 1.5}


def footprint_bytes(p: dict) -> float:
    """Per rank: the largest message's buffers (up to 2x for sendrecv) plus the #wrong check's scratch."""
    size = max(p["sizes_bytes"])
    ops = list(p["ops"]) + (["ring_allreduce"] if p["ours"] else [])
    per_rank = max(BUFFERS[op] for op in ops) * size + col.check_scratch_bytes(size)
    return per_rank * ranks_sharing_memory(p)


def work(params: dict) -> list:
    """Every row the sweep times: each size x collective (and our ring) x world size, with the
    bytes each rank's link carries (the link, not HBM, bounds them: `lab predict` shows the spec
    sheet's HBM figure beside them; the rows' own prediction uses the link)."""
    ops = list(params["ops"]) + (["ring_allreduce"] if params["ours"] else [])
    return [col.collective_work(op, size, n) for n in work_world_sizes(params)
            for size in params["sizes_bytes"] for op in ops]


SIZES_GPU = [2**k for k in range(15, 33)]            # 32 KiB ... 4 GiB
EXERCISE = Exercise(
    id="phase4.interconnect", title="Interconnect sweep, nccl-tests style: all-reduce, all-gather, "
                                    "reduce-scatter, send/recv, and our ring, 32 KiB to 4 GiB",
    run=run,
    params={**launch_params(timeout_s=300),
            "sizes_bytes": Int(SIZES_GPU, min=4, unit="bytes", many=True,
                               help="nccl-tests' size: per-rank buffer; all_gather output; reduce_scatter input"),
            "ops": Choice(["all_reduce", "all_gather", "reduce_scatter", "sendrecv"], col.OPS, many=True),
            "ours": Bool(True, help="also our ring all-reduce (ring_allreduce.py) at every size"),
            "ring_lanes": Int(1, min=1, max=4, unit="process groups"),
            "ring_directions": Int(1, choices=(1, 2)),
            "ring_depth": Int(1, min=1, unit="sub-chunks"),
            "ring_graph": Bool(True, help="replay our ring as one CUDA graph (GPUs only)"),
            "ring_min_subchunk_bytes": Int(32 * 2**20, min=0, unit="bytes"),
            "ring_p2p_chunk_bytes": Int(65536, min=1, unit="bytes", nullable=True,
                                        help="NCCL_P2P_NVL_CHUNKSIZE for our ring's job; null: NCCL's default"),
            "probe_algorithms": Bool(True, help="an untimed NCCL_DEBUG job to learn NCCL's algorithm per size"),
            **col.timing_params(5, 20, 200, 8 * 2**30)},
    cpu_params={"sizes_bytes": [2**k for k in range(15, 23, 2)], "ring_min_subchunk_bytes": 64 * 2**10,
                "warmup_iters": 2, "min_iters": 5, "max_iters": 20, "iter_bytes": 2**24,
                "timeout_s": 180, "pg_timeout_s": 60},
    quick_params={"sizes_bytes": [2**15 + 12, 2**17], "warmup_iters": 1, "min_iters": 3, "max_iters": 3},
    footprint_bytes=footprint_bytes, work=work, skips=whole_run_skipped,
)


if __name__ == "__main__":
    run_alone(EXERCISE, alone({"sizes_bytes": [2**15 + 12, 4 * 100_003], "probe_algorithms": False}))
