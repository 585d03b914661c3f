"""Exercise 4.2: a ring all-reduce from scratch, out of point-to-point sends and receives only.

    lab run phase4.ring_allreduce                  # NCCL on [2, all] GPUs; --device cpu --param backend=gloo
    python -m phases.phase4_distributed.ring_allreduce         # alone: 2 CPU ranks (gloo), small sizes

The buffer is cut into n chunks (n ranks; sizes need not divide). Reduce-scatter: n-1 steps, at
step s rank r sends chunk r-s right and adds chunk r-s-1 from its left; all-gather: n-1 more steps
passing the finished chunks on. Each rank sends 2(n-1)/n x S, the least a ring can, so busbw
measures the link, not the algorithm. `depth` pipelines the reduce-scatter (the add of piece k
runs while piece k+1 travels); `directions`, `lanes` (process groups side by side), `graph` (the
ring replayed as one CUDA graph) and `p2p_chunk_bytes` (NCCL_P2P_NVL_CHUNKSIZE: how many channels
a send gets) are the answers to one NCCL send being slower than the link; all are crossed.
Correctness gates timing: every configuration is checked against dist.all_reduce on irregular
sizes (integer data exactly, random fp32 within tolerance) before any is timed. The naive blocking
order (send, then receive) is run in its own job and killed once every rank is stuck in its send:
a lesson, never timed. Timed rows are predicted by the link roofline and, from a phase4.link_ceilings
record of this machine, by NCCL all-reduce's alpha and beta (calibration.py).
"""
import subprocess
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from common.checks import CHECK_CHUNK, compare, exact
from common.errors import LabError
from common.exercise import Exercise, Result, row
from common.params import Bool, Float, Int
from common.standalone import run_alone

from . import analysis, calibration
from . import collectives as col
from .launch import (
    Job,
    alone,
    launch,
    launch_params,
    link_roofs,
    plan,
    ranks_sharing_memory,
    whole_run_skipped,
    work_world_sizes,
)


# ------------------------------------------------------------------------------ the algorithm
def bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of `parts` near-equal pieces: the first numel % parts get one element more."""
    q, extra = divmod(numel, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + q + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def pipeline_depth(chunk_numel: int, itemsize: int, depth: int, min_subchunk_bytes: int) -> int:
    """Sub-chunks per chunk: `depth`, fewer when sub-chunks would fall below min_subchunk_bytes."""
    if min_subchunk_bytes <= 0:
        return max(1, depth)
    return max(1, min(depth, (chunk_numel * itemsize) // min_subchunk_bytes))


class _Ring:
    """One ring over one slice of the buffer: its schedule and its pieces. direction +1 sends to
    rank r+1 and receives from r-1; direction -1 runs the same ring the other way round."""

    def __init__(self, flat: torch.Tensor, d: int, n: int, r: int, direction: int):
        p = r if direction == 1 else (-r) % n   # this rank's position on the ring; chunk ids follow positions
        self.flat = flat
        self.chunks = bounds(flat.numel(), n)
        self.subs = [[(c0 + a, c0 + b) for a, b in bounds(c1 - c0, d)] for c0, c1 in self.chunks]
        # The schedule: (phase, chunk sent, chunk received, sub-chunk). The reduce-scatter is cut
        # into d sub-chunks per step so each add hides under the next transfer; the all-gather has
        # no add to hide, so it moves whole chunks (sub-chunk None): cutting it would only add launches.
        self.items = [("rs", (p - s) % n, (p - s - 1) % n, k) for s in range(n - 1) for k in range(d)]
        self.items += [("ag", (p + 1 - s) % n, (p - s) % n, None) for s in range(n - 1)]
        self.right, self.left = (r + direction) % n, (r - direction) % n
        self.scratch: list[torch.Tensor] = []

    def piece(self, c: int, k: int | None) -> torch.Tensor:
        a, b = self.chunks[c] if k is None else self.subs[c][k]
        return self.flat[a:b]

    def target(self, i: int) -> torch.Tensor:
        phase, _, recv_c, k = self.items[i]
        dst = self.piece(recv_c, k)
        return self.scratch[i % len(self.scratch)][: dst.numel()] if phase == "rs" else dst

    def ops(self, i: int, group) -> list:
        _, send_c, _, k = self.items[i]
        src, dst = self.piece(send_c, k), self.target(i)
        out = []
        if src.numel():                        # the peer posts the matching receive: same chunk, same size
            out.append(dist.P2POp(dist.isend, src, self.right, group))
        if dst.numel():
            out.append(dist.P2POp(dist.irecv, dst, self.left, group))
        return out

    def add(self, i: int) -> None:
        phase, _, recv_c, k = self.items[i]
        if phase == "rs" and self.piece(recv_c, k).numel():
            self.piece(recv_c, k).add_(self.target(i))


class _Lane:
    """The rings that share one process group (one ring, or two running opposite ways): item i of
    every ring goes out in one batch_isend_irecv, so NCCL runs them in one kernel, each direction
    on its own channels."""

    def __init__(self, flat: torch.Tensor, depth: int, min_subchunk_bytes: int, group, directions: int):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        halves = bounds(flat.numel(), directions)
        d = pipeline_depth((halves[0][1] - halves[0][0]) // n, flat.element_size(), depth, min_subchunk_bytes)
        self.rings = [_Ring(flat[a:b], d, n, r, +1 if j == 0 else -1) for j, (a, b) in enumerate(halves)]
        self.first_ag = d * (n - 1)
        self.lookahead = 1 if d >= 2 else 0    # depth 1: each add must be queued before the next send
        for ring in self.rings:
            biggest = max(b - a for row_ in ring.subs for a, b in row_)
            ring.scratch = [torch.empty(biggest, dtype=flat.dtype, device=flat.device)
                            for _ in range(self.lookahead + 1)]
        self.count = len(self.rings[0].items)
        self.stream_ordered = dist.get_backend(group) == "nccl"
        self.works: dict[int, list] = {}
        self.next = 0                          # the next item to issue

    def issue_until(self, last: int) -> None:
        while self.next <= min(last, self.count - 1):
            ops = [op for ring in self.rings for op in ring.ops(self.next, self.group)]
            self.works[self.next] = dist.batch_isend_irecv(ops) if ops else []
            self.next += 1

    def start(self) -> None:
        self.issue_until(min(self.lookahead, self.first_ag - 1))

    def finish(self, i: int) -> None:
        """Wait for transfer i, add it in (reduce-scatter), then issue what may go next.

        What may go next: in the reduce-scatter, up to `lookahead` transfers ahead, but the first
        all-gather transfer (which sends a chunk whole) only once the last add into that chunk is
        queued; in the all-gather, the next transfer only after this one is waited for, since it
        sends the chunk this one received (gloo: the host waits), or, with NCCL, all of them at once,
        since NCCL's stream already runs them one after the other. Issuing after the add is what
        orders NCCL's stream after it."""
        if i >= self.count:
            return
        for w in self.works.pop(i):
            w.wait()                           # NCCL: our stream waits; gloo: the host waits
        for ring in self.rings:
            ring.add(i)
        if i < self.first_ag - 1:
            self.issue_until(min(i + 1 + self.lookahead, self.first_ag - 1))
        elif self.stream_ordered:
            self.issue_until(self.count - 1)  # NCCL runs one communicator's transfers in issue order on one
        else:                                  # stream: the all-gather needs no round trip through ours
            self.issue_until(i + 1)


def ring_all_reduce(t: torch.Tensor, depth: int = 1, min_subchunk_bytes: int = 0, groups=(None,),
                    directions: int = 1) -> torch.Tensor:
    """Sum `t` over every rank, in place, with isend/irecv only. Returns t.

    `groups`: one process group per lane; each lane all-reduces its own contiguous slice of t
    through its own communicator. `directions`: 2 splits each lane's slice in halves that go round
    the ring in opposite directions, in the same batched calls."""
    n = dist.get_world_size(groups[0])
    if n == 1 or t.numel() == 0:
        return t
    flat = t.view(-1)
    lanes = [_Lane(flat[a:b], depth, min_subchunk_bytes, g, directions)
             for (a, b), g in zip(bounds(flat.numel(), len(groups)), groups) if b > a]
    for lane in lanes:
        lane.start()
    for i in range(max(lane.count for lane in lanes)):
        for lane in lanes:                     # lane by lane: lane 0's next send leaves before lane 1's add
            lane.finish(i)
    return t


def p2p_env(chunk_bytes: int | None, backend: str) -> dict | None:
    """The environment of a job whose NCCL sends use `chunk_bytes` chunks (NCCL_P2P_NVL_CHUNKSIZE;
    None: NCCL's default, 512 KiB). NCCL doubles a send's channels while a channel's part exceeds 32
    chunks, so smaller chunks spread a send of a given size over more channels. The setting is read
    only by point-to-point operations: NCCL's collectives size their steps from NCCL_BUFFSIZE."""
    return {"NCCL_P2P_NVL_CHUNKSIZE": str(int(chunk_bytes))} if chunk_bytes and backend == "nccl" else None


def lane_groups(lanes: int) -> list:
    """The default group plus lanes - 1 new ones over the same ranks: one NCCL communicator each, so
    one set of NCCL channels (and CTAs) each. Every rank must call this, in the same order."""
    return [None] + [dist.new_group(list(range(dist.get_world_size()))) for _ in range(lanes - 1)]


# ------------------------------------------------------------------------------ on every rank
def _random(numel: int, rank: int, device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    return torch.randn(numel, generator=g, device=device) + 0.5


def captured(fn):
    """fn as a CUDA graph: the replay re-issues every kernel fn queued (NCCL's sends and receives,
    our adds, the waits between streams) with one launch from the host, instead of one Python call
    per step. Capturing records and runs nothing, so fn runs once first, on a side stream (the
    allocations and NCCL's lazy connections happen outside the graph): every rank must call this
    at the same time, since that run is a collective."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


@dataclass(frozen=True)
class Config:
    """One way to run the ring: lanes (process groups side by side), directions (1, or 2 opposite
    rings per lane), depth (reduce-scatter sub-chunks) and graph (the whole ring replayed as one
    CUDA graph; NCCL on GPUs only)."""
    lanes: int
    directions: int
    depth: int
    graph: bool = False

    @property
    def name(self) -> str:
        return f"ring_l{self.lanes}_dir{self.directions}_d{self.depth}" + ("_graph" if self.graph else "")

    def bind(self, t: torch.Tensor, min_subchunk_bytes: int, lanes: list):
        """A call that all-reduces t in place. With graph, binding captures it (and so all-reduces
        t once: refill t after binding)."""
        def ring():
            ring_all_reduce(t, self.depth, min_subchunk_bytes, lanes[:self.lanes], self.directions)
        return captured(ring) if self.graph else ring


def configs(params: dict, device_type: str = "cuda") -> list[Config]:
    """Every combination of the params lanes x directions x depths x graphs (graphs on GPUs only):
    each is checked, then timed."""
    return [Config(L, D, d, g) for g in params["graphs"] if not (g and device_type != "cuda")
            for L in params["lanes"] for D in params["directions"] for d in params["depths"]]


def _check(me, numel: int, cfg: Config, lanes: list) -> dict:
    """One rank's checks of one ring configuration at one size: integers exactly, random floats
    within tolerance. min_subchunk_bytes 0: the depth asked is the depth run, even on tiny buffers."""
    dev = me.device
    x = col.fill_pattern(torch.empty(numel, device=dev), me.rank)
    ours, ref = x.clone(), x.clone()
    call = cfg.bind(ours, 0, lanes)
    ours.copy_(x)
    call()
    dist.all_reduce(ref)
    me.sync()
    wrong = col.count_wrong(ours, lambda s, e: col.pattern_sum(s, e, me.world, dev))
    ints = exact(ours, ref, "dist.all_reduce of the same integer-valued inputs")
    y = _random(numel, me.rank, dev)
    ours_f, ref_f = y.clone(), y.clone()
    call = cfg.bind(ours_f, 0, lanes)
    ours_f.copy_(y)
    call()
    dist.all_reduce(ref_f)
    me.sync()
    floats = compare(ours_f, ref_f, "fp32", "dist.all_reduce of the same random fp32 inputs")
    return {"wrong_vs_local_sum": wrong, "ints": ints, "floats": floats}


def _timed_size(me, size: int, params: dict, lanes: list, checks_ok: bool) -> list[dict]:
    """dist.all_reduce and the ring in every configuration on one buffer: each checked at this size
    (exact on integer data), then timed if every rank found it right (and the ring passed its checks)."""
    n, dev, min_sub = me.world, me.device, params["min_subchunk_bytes"]
    numel = size // 4
    buf = torch.empty(numel, device=dev)
    out = []
    for cfg in [None] + configs(params, dev.type):
        variant = "nccl" if cfg is None else cfg.name
        me.stage(f"{variant} {size} bytes")
        call = (lambda: dist.all_reduce(buf)) if cfg is None else cfg.bind(buf, min_sub, lanes)
        col.fill_pattern(buf, me.rank)
        call()
        me.sync()
        wrong = sum(me.gather(col.count_wrong(buf, lambda s, e: col.pattern_sum(s, e, n, dev))))
        entry = {"variant": variant, "config": None if cfg is None else asdict(cfg),
                 "size_bytes": numel * 4, "wrong": wrong, "elements": numel * n,
                 "effective_depth": None if cfg is None else   # sub-chunks of one direction's chunk in lane 0
                 pipeline_depth(numel // (cfg.lanes * cfg.directions * n), 4, cfg.depth, min_sub)}
        if wrong == 0 and (cfg is None or checks_ok):        # the same verdict on every rank
            warmup, iters = col.iterations(size, params)
            entry.update(warmup=warmup, per_rank_samples_ms=me.gather(col.time_calls(call, warmup, iters, dev)))
        out.append(entry)
        del call                               # a graph holds its memory until it goes
    return out


def worker_task(me, params: dict) -> dict:
    lanes = lane_groups(max(params["lanes"]))
    checks = []
    for cfg in configs(params, me.device.type):
        for numel in params["check_numels"]:
            me.stage(f"check {cfg.name} numel {numel}")
            got = me.gather(_check(me, numel, cfg, lanes))
            checks.append({"config": asdict(cfg), "numel": numel, "per_rank": got})
    checks_ok = all(c["wrong_vs_local_sum"] == 0 and c["ints"]["passed"] and c["floats"]["passed"]
                    for ch in checks for c in ch["per_rank"])
    timed = []
    for size in params["sizes_bytes"]:
        timed += _timed_size(me, size, params, lanes, checks_ok)
    return {"checks": checks, "checks_ok": checks_ok, "timed": timed}


def naive_task(me, params: dict) -> dict:
    """The order that deadlocks: every rank sends (blocking) before it receives."""
    numel = params["deadlock_bytes"] // 4
    x = torch.full((numel,), float(me.rank + 1), device=me.device)
    y = torch.empty_like(x)
    me.sync()
    dist.barrier()
    me.mark("entered", f"{time.time():.3f}")
    dist.send(x, me.right)                     # never returns (gloo); never completes on the GPU (NCCL)
    dist.recv(y, me.left)
    me.sync()
    me.mark("returned", f"{time.time():.3f}")
    return {"completed": True}


# ------------------------------------------------------------------------------ in the lab process
def _check_row(ch: dict, n: int, backend: str) -> dict:
    per = ch["per_rank"]
    wrong = sum(c["wrong_vs_local_sum"] for c in per)
    rel = max((c["floats"]["rel_l2_error"] or 0.0) for c in per)
    max_abs = max((c["floats"]["max_abs_error"] or 0.0) for c in per)
    ints_ok = all(c["ints"]["passed"] for c in per) and wrong == 0
    floats_ok = all(c["floats"]["passed"] for c in per)
    reason = None
    if not ints_ok:
        reason = f"integer-valued data: {wrong} elements differ from the exact sum, or from dist.all_reduce"
    elif not floats_ok:
        reason = next(c["floats"]["reason"] for c in per if not c["floats"]["passed"])
    check = {"reference": "dist.all_reduce of the same inputs (integer-valued: exact, and equal to the sum "
                          "computed locally; random fp32: relative error)",
             "metric": "exact + rel_l2", "precision": "fp32", "tolerance": per[0]["floats"]["tolerance"],
             "rel_l2_error": rel, "max_abs_error": max_abs, "wrong_elements": wrong,
             "passed": ints_ok and floats_ok, "reason": reason}
    return row("check_" + Config(**ch["config"]).name[len("ring_"):],
               {"world_size": n, "backend": backend, "numel": ch["numel"], **ch["config"]},
               "ok" if check["passed"] else "failed", reason, check=check,
               metrics={"max_abs_diff_vs_nccl": max_abs, "integers_exact": ints_ok})


def rows_from(result: dict, n: int, backend: str, roofs, params: dict) -> list[dict]:
    rows = [_check_row(ch, n, backend) for ch in result["checks"]]
    method = col.timing_method(backend)
    nccl_busbw = {}
    for t in result["timed"]:
        p = {"world_size": n, "backend": backend, "size_bytes": t["size_bytes"],
             **(t["config"] or {"lanes": None, "directions": None, "depth": None, "graph": None}),
             "effective_depth": t["effective_depth"], "min_subchunk_bytes": params["min_subchunk_bytes"],
             "p2p_chunk_bytes": params.get("p2p_chunk_bytes") if t["variant"] != "nccl" else None}
        op = "all_reduce" if t["variant"] == "nccl" else "ring_allreduce"
        if t["wrong"] == 0 and "per_rank_samples_ms" not in t:
            rows.append(row(t["variant"], p, "failed", "the ring failed its correctness checks on irregular "
                                                       "sizes, so it was not timed"))
            continue
        r = col.collective_row(t["variant"], op, p, n, t, roofs, method)
        if r["status"] == "ok" and t["variant"] == "nccl":
            nccl_busbw[t["size_bytes"]] = r["metrics"]["busbw_gbps"]
        if r["status"] == "ok" and t["variant"] != "nccl" and nccl_busbw.get(t["size_bytes"]):
            r["metrics"]["ours_over_nccl_busbw"] = r["metrics"]["busbw_gbps"] / nccl_busbw[t["size_bytes"]]
        rows.append(r)
    worst = analysis.worst_over_nccl(rows)       # the goal's measure, per configuration: its worst size
    for r in rows:
        if r["variant"] in worst:
            r["metrics"]["worst_ours_over_nccl"] = worst[r["variant"]]
    return rows


def verdict(rows: list[dict], n: int) -> dict:
    """The ring goal on n ranks: the configuration whose worst size from the goal's size up is best."""
    worst = analysis.worst_over_nccl([r for r in rows if r["params"].get("world_size") == n])
    best = max(worst, key=worst.get, default=None)
    return {"world_size": n, "configuration": best, "worst_ours_over_nccl": worst.get(best),
            "met": None if best is None else worst[best] >= analysis.RING_GOAL_RATIO}


def deadlock_demo(n: int, backend: str, params: dict) -> dict:
    """Run the naive order in its own job; once every rank is inside dist.send, wait
    deadlock_wait_s; if no rank has come back, kill the job: deadlocked, as predicted."""
    size = params["deadlock_bytes"]
    p = {"world_size": n, "backend": backend, "size_bytes": size,
         "order": "every rank: dist.send(to rank+1), then dist.recv(from rank-1)"}
    label = f"phase4.ring_allreduce naive demo on {n} ranks"
    job = Job("naive", n, backend, params, label)
    try:
        t_start = time.monotonic()
        while time.monotonic() - t_start < params["timeout_s"]:
            if job.proc.poll() is not None or len(job.markers("entered")) == n:
                break
            time.sleep(0.05)
        if job.proc.poll() is not None and job.proc.returncode != 0:
            raise LabError(job.diagnose(job.proc.returncode))
        if len(job.markers("entered")) < n:
            return row("naive_blocking", p, "failed", f"the ranks did not reach dist.send within "
                                                      f"{params['timeout_s']} s; {job.stages()}")
        t0 = time.monotonic()
        try:
            job.proc.wait(timeout=params["deadlock_wait_s"])
        except subprocess.TimeoutExpired:      # the expected outcome
            waited = time.monotonic() - t0
            returned = len(job.markers("returned"))
            job.stop()                          # deadlocked ranks have nothing to finish
            return row("naive_blocking", p, "ok", None, prediction={"excluded": calibration.NAIVE_LESSON}, metrics={
                "outcome": f"deadlocked as predicted after {waited:.1f} s",
                "deadlocked": True, "waited_s": waited, "ranks_returned": returned, "killed": True})
        return row("naive_blocking", p, "ok", None, prediction={"excluded": calibration.NAIVE_LESSON}, metrics={
            "outcome": "completed: this transport let every send finish before its receive was posted",
            "deadlocked": False, "waited_s": time.monotonic() - t0,
            "ranks_returned": len(job.markers("returned")), "killed": False})
    finally:
        job.finish()                           # interrupted: stopped at once, the folder removed


def run(ctx, params):
    pl = plan(ctx, params)
    rows = pl.skip_rows()
    if not pl.world_sizes:
        return Result(rows, {"backend": pl.backend})
    roofs = link_roofs(ctx, pl.backend)
    found = calibration.run_time_index(ctx)      # the alpha-beta constants, if phase4.link_ceilings ran here
    launches = {}
    for n in ctx.track(pl.world_sizes, "ring all-reduce world sizes"):
        res = launch("ring", n, pl.backend, params, params["timeout_s"], f"phase4.ring_allreduce on {n} ranks",
                     extra_env=p2p_env(params["p2p_chunk_bytes"], pl.backend))
        launches[str(n)] = res["_launch_s"]
        rows += calibration.attach(EXERCISE.id, rows_from(res, n, pl.backend, roofs, params), found, ctx.hardware_key)
    if params["deadlock_demo"]:
        # On GPUs the demo runs over NCCL and over gloo: whether the naive order hangs depends on
        # whether a send can finish before its receive is posted, and the two transports differ.
        for backend in ([pl.backend, "gloo"] if pl.backend == "nccl" else [pl.backend]):
            rows.append(deadlock_demo(min(pl.world_sizes), backend, params))
    return Result(rows, {"backend": pl.backend, "world_sizes": pl.world_sizes, "launch_s": launches,
                         "link_roof": {"gbps": roofs.bandwidth_gbps, "source": roofs.source},
                         "goal": [verdict(rows, n) for n in pl.world_sizes],
                         "p2p_env": p2p_env(params["p2p_chunk_bytes"], pl.backend)})


def work(params: dict) -> list:
    """Every timed row: NCCL's all-reduce and each ring configuration (as on GPUs: graphs included)
    at each size and world size. Both move the same bytes on each rank's link: 2(n-1)/n x size."""
    names = ["nccl"] + [cfg.name for cfg in configs(params, "cuda")]
    return [col.collective_work("all_reduce", size, n, f"{name} {size} B on {n} ranks (bytes on each rank's link)")
            for n in work_world_sizes(params) for size in params["sizes_bytes"] for name in names]


def footprint_bytes(p: dict) -> float:
    """Per rank, the largest of its three jobs: timed (buffer + scratch + #wrong check), checks, deadlock demo."""
    size = max(p["sizes_bytes"])
    timed = 1.5 * size + col.check_scratch_bytes(size)          # buffer, reduce-scatter scratch <= size / n
    numel = max(p["check_numels"])
    checks = 6 * 4 * numel + col.check_scratch_bytes(4 * numel) + 3 * 8 * min(numel, CHECK_CHUNK)
    naive = 2 * p["deadlock_bytes"] if p["deadlock_demo"] else 0  # x and y
    return max(timed, checks, naive) * ranks_sharing_memory(p)


# the launch and the timing, shared with nothing else: the sweep declares its own (other defaults)
COMMON = {**launch_params(timeout_s=240), **col.timing_params(5, 20, 200, 8 * 2**30)}
EXERCISE = Exercise(
    id="phase4.ring_allreduce", title="Ring all-reduce from scratch (isend/irecv only), pipelined, vs NCCL",
    run=run,
    params={**COMMON,
            # lanes: each an NCCL communicator whose channels (one SM each, up to 32) must all fit on
            # the GPU beside the others' (a kernel waiting for an unscheduled peer waits forever)
            "lanes": Int([1, 2], min=1, max=4, unit="process groups", many=True),
            "directions": Int([1, 2], choices=(1, 2), many=True),
            "depths": Int([1, 2], min=1, unit="sub-chunks", many=True),
            "graphs": Bool([False, True], many=True, help="true: the ring replayed as one CUDA graph (GPUs only)"),
            "min_subchunk_bytes": Int(4 * 2**20, min=0, unit="bytes"),
            "p2p_chunk_bytes": Int(65536, min=1, unit="bytes", nullable=True,
                                   help="NCCL_P2P_NVL_CHUNKSIZE for the ring's job; null: NCCL's default"),
            "check_numels": Int([1, 3, 1031, 1_000_003, 2**24 + 7], min=1, unit="fp32 elements", many=True),
            "sizes_bytes": Int([64 * 2**20, 256 * 2**20, 2**30], min=4, unit="bytes", many=True),
            "deadlock_demo": Bool(True),
            "deadlock_bytes": Int(256 * 2**20, min=4, unit="bytes"),
            "deadlock_wait_s": Float(5.0, min=0.1, unit="s")},
    cpu_params={"lanes": [1, 2], "directions": [1, 2], "depths": [1, 4], "graphs": [False],
                "min_subchunk_bytes": 64 * 2**10,
                "check_numels": [1, 3, 1031, 100_003],
                "sizes_bytes": [2**20, 4 * 2**20], "min_iters": 5, "max_iters": 20, "iter_bytes": 2**24,
                "warmup_iters": 2, "timeout_s": 180, "pg_timeout_s": 60,
                "deadlock_bytes": 2**20, "deadlock_wait_s": 2.0},
    quick_params={"lanes": [1, 2], "directions": [2], "depths": [1, 3], "check_numels": [1, 5, 1031],
                  "sizes_bytes": [2**18],
                  "min_iters": 3, "max_iters": 3, "warmup_iters": 1, "deadlock_wait_s": 1.5},
    footprint_bytes=footprint_bytes, work=work, skips=whole_run_skipped,
)


if __name__ == "__main__":
    run_alone(EXERCISE, alone({"lanes": [1], "directions": [1, 2], "depths": [1, 3], "check_numels": [1, 5, 1031],
                               "sizes_bytes": [4 * 100_003], "deadlock_wait_s": 1.0}))
