"""Exercise 4.2: a ring all-reduce from scratch, out of point-to-point sends and receives only.

    lab run phase4.ring_allreduce                          # NCCL, world sizes [2, all GPUs]
    lab run phase4.ring_allreduce --device cpu --param backend=gloo      # the CPU version

The algorithm. Split the buffer into n chunks (n = ranks on the ring; sizes need not divide).
Rank r sends to r+1 and receives from r-1.
- reduce-scatter, n-1 steps: at step s rank r sends chunk (r-s) and receives chunk (r-s-1), which
  it adds into its own copy. After n-1 steps rank r holds the full sum of chunk (r+1).
- all-gather, n-1 steps: at step s rank r sends chunk (r+1-s), finished, and receives chunk (r-s)
  straight into place.
Each rank sends 2(n-1) chunks of S/n bytes: 2(n-1)/n x S, the least any all-reduce on a ring can
send, which is why busbw = algbw x 2(n-1)/n measures the link and not the algorithm.

Pipelining. Each chunk is cut into `depth` sub-chunks, and transfer k+1 is issued before
sub-chunk k is added, so the add (a memory-bound kernel: read 2, write 1) runs while the link
carries the next piece. With NCCL the transfers run on NCCL's stream and the adds on ours:
issuing a transfer makes NCCL's stream wait for everything already queued on ours, which is
exactly the dependency the ring needs (sub-chunk k of step s+1 must be the sum made at step s)
provided that add was queued first. One transfer of lookahead keeps that true for depth >= 2, and
two scratch buffers alternate so a receive never lands on data an add is still reading. Small
buffers are not cut below `min_subchunk_bytes`: every transfer costs a launch and a handshake.

Why the naive version can deadlock. Written the obvious way, every rank calls the blocking
dist.send(right) and then dist.recv(left). Where a send of any real size completes only once the
receiver has posted the matching receive (gloo waits for the peer's "ready"), every rank sits in
its send and none reaches its receive: a cycle of waits, forever. batch_isend_irecv posts the send
and the receive of a step together, so each rank's receive is already waiting for its left
neighbour's send, whatever the transport does. The exercise runs the naive order in its own job,
watched, and kills it after `deadlock_wait_s` seconds if every rank is still inside dist.send;
on GPUs it runs over NCCL and over gloo and records what each did (on two NVLink-connected
H200s, NCCL 2.28 let the 256 MiB naive exchange complete: it is the ordering, not the transport,
that makes the code correct, and a transport that happens to buffer hides the bug).

Correctness gates timing: before any timing, the ring is checked against dist.all_reduce on
irregular sizes (not multiples of n) at every depth: integer-valued data must match exactly (and
match the sum computed locally), random floats within fp32 tolerance (the summation order
differs). Then each timed configuration is checked once more at its own size.
"""
import subprocess
import time

import torch
import torch.distributed as dist

from common.checks import compare, exact
from common.errors import LabError
from common.exercise import Exercise, row

from . import collectives as col
from .launch import Job, launch, link_roofs, plan


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


def ring_all_reduce(t: torch.Tensor, depth: int = 4, min_subchunk_bytes: int = 0, group=None) -> torch.Tensor:
    """Sum `t` over every rank, in place, with isend/irecv only. Returns t."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if n == 1 or t.numel() == 0:
        return t
    flat = t.view(-1)
    chunks = bounds(flat.numel(), n)
    d = pipeline_depth(chunks[0][1] - chunks[0][0], flat.element_size(), depth, min_subchunk_bytes)
    subs = [[(c0 + a, c0 + b) for a, b in bounds(c1 - c0, d)] for c0, c1 in chunks]

    def piece(c: int, k: int) -> torch.Tensor:
        a, b = subs[c][k]
        return flat[a:b]

    # The schedule: (phase, chunk sent, chunk received, sub-chunk), reduce-scatter then all-gather.
    items = [("rs", (r - s) % n, (r - s - 1) % n, k) for s in range(n - 1) for k in range(d)]
    items += [("ag", (r + 1 - s) % n, (r - s) % n, k) for s in range(n - 1) for k in range(d)]
    lookahead = 1 if d >= 2 else 0            # depth 1: each add must be queued before the next send
    biggest = max(b - a for row_ in subs for a, b in row_)
    scratch = [torch.empty(biggest, dtype=t.dtype, device=t.device) for _ in range(lookahead + 1)]
    right, left = (r + 1) % n, (r - 1) % n
    works: dict[int, list] = {}

    def target(i: int) -> torch.Tensor:
        phase, _, recv_c, k = items[i]
        dst = piece(recv_c, k)
        return scratch[i % len(scratch)][: dst.numel()] if phase == "rs" else dst

    def issue(i: int) -> None:
        _, send_c, _, k = items[i]
        src, dst = piece(send_c, k), target(i)
        ops = []
        if src.numel():                        # the peer posts the matching receive: same chunk, same size
            ops.append(dist.P2POp(dist.isend, src, right, group))
        if dst.numel():
            ops.append(dist.P2POp(dist.irecv, dst, left, group))
        works[i] = dist.batch_isend_irecv(ops) if ops else []

    issued = 0
    for i, (phase, _, recv_c, k) in enumerate(items):
        while issued <= min(i + lookahead, len(items) - 1):
            issue(issued)                      # transfer i+1 goes out before add i
            issued += 1
        for w in works.pop(i):
            w.wait()                           # NCCL: our stream waits; gloo: the host waits
        if phase == "rs" and piece(recv_c, k).numel():
            piece(recv_c, k).add_(target(i))
    return t


# ------------------------------------------------------------------------------ on every rank
def _random(numel: int, rank: int, device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    return torch.randn(numel, generator=g, device=device) + 0.5


def _check_depth(me, numel: int, depth: int, min_sub: int) -> dict:
    """One rank's checks of the ring at one size and depth: integers exactly, random floats within tolerance."""
    dev = me.device
    x = col.fill_pattern(torch.empty(numel, device=dev), me.rank)
    ours, ref = x.clone(), x.clone()
    ring_all_reduce(ours, depth, min_sub)
    dist.all_reduce(ref)
    me.sync()
    wrong = col.count_wrong(ours, lambda s, e: col.pattern_sum(s, e, me.world, dev))
    ints = exact(ours, ref, "dist.all_reduce of the same integer-valued inputs")
    y = _random(numel, me.rank, dev)
    ours_f, ref_f = y.clone(), y.clone()
    ring_all_reduce(ours_f, depth, min_sub)
    dist.all_reduce(ref_f)
    me.sync()
    floats = compare(ours_f, ref_f, "fp32", "dist.all_reduce of the same random fp32 inputs")
    return {"wrong_vs_local_sum": wrong, "ints": ints, "floats": floats}


def _timed_size(me, size: int, params: dict, checks_ok: bool) -> list[dict]:
    """dist.all_reduce and the ring at every depth on one buffer: each checked at this size (exact
    on integer data), then timed if every rank found it right (and the ring passed its checks)."""
    n, dev, min_sub = me.world, me.device, params["min_subchunk_bytes"]
    numel = size // 4
    buf = torch.empty(numel, device=dev)
    out = []
    for variant, depth in [("nccl", None)] + [(f"ring_d{d}", d) for d in params["depths"]]:
        me.stage(f"{variant} {size} bytes")

        def call(depth=depth):
            if depth is None:
                dist.all_reduce(buf)
            else:
                ring_all_reduce(buf, depth, min_sub)

        col.fill_pattern(buf, me.rank)
        call()
        me.sync()
        wrong = sum(me.gather(col.count_wrong(buf, lambda s, e: col.pattern_sum(s, e, n, dev))))
        entry = {"variant": variant, "depth": depth, "size_bytes": numel * 4, "wrong": wrong,
                 "elements": numel * n, "effective_depth": None if depth is None else
                 pipeline_depth(bounds(numel, n)[0][1], 4, depth, min_sub)}
        if wrong == 0 and (depth is None or checks_ok):       # the same verdict on every rank
            warmup, iters = col.iterations(size, params)
            entry.update(warmup=warmup, per_rank_samples_ms=me.gather(col.time_calls(call, warmup, iters, dev)))
        out.append(entry)
    return out


def worker_task(me, params: dict) -> dict:
    checks = []
    for depth in params["depths"]:
        for numel in params["check_numels"]:
            me.stage(f"check depth {depth} numel {numel}")
            got = me.gather(_check_depth(me, numel, depth, 0))   # min 0: the depth asked is the depth run
            checks.append({"depth": depth, "numel": numel, "per_rank": got})
    checks_ok = all(c["wrong_vs_local_sum"] == 0 and c["ints"]["passed"] and c["floats"]["passed"]
                    for ch in checks for c in ch["per_rank"])
    timed = []
    for size in params["sizes_bytes"]:
        timed += _timed_size(me, size, params, checks_ok)
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
    return row(f"check_d{ch['depth']}", {"world_size": n, "backend": backend, "numel": ch["numel"],
                                         "depth": ch["depth"]},
               "ok" if check["passed"] else "failed", reason, check=check,
               metrics={"max_abs_diff_vs_nccl": max_abs, "integers_exact": ints_ok})


def rows_from(result: dict, n: int, backend: str, roofs, params: dict) -> list[dict]:
    rows = [_check_row(ch, n, backend) for ch in result["checks"]]
    method = col.timing_method(backend)
    nccl_busbw = {}
    for t in result["timed"]:
        p = {"world_size": n, "backend": backend, "size_bytes": t["size_bytes"], "depth": t["depth"],
             "effective_depth": t["effective_depth"], "min_subchunk_bytes": params["min_subchunk_bytes"]}
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
    return rows


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
            job.kill()
            return row("naive_blocking", p, "ok", None, metrics={
                "outcome": f"deadlocked as predicted after {waited:.1f} s",
                "deadlocked": True, "waited_s": waited, "ranks_returned": returned, "killed": True})
        return row("naive_blocking", p, "ok", None, metrics={
            "outcome": "completed: this transport let every send finish before its receive was posted",
            "deadlocked": False, "waited_s": time.monotonic() - t0,
            "ranks_returned": len(job.markers("returned")), "killed": False})
    finally:
        if job.proc.poll() is None:
            job.kill()
        job.close()


def run(ctx, params):
    pl = plan(ctx, params)
    rows = pl.skip_rows()
    if not pl.world_sizes:
        return rows, {"backend": pl.backend}
    roofs = link_roofs(ctx, pl.backend)
    launches = {}
    for n in ctx.track(pl.world_sizes, "ring all-reduce world sizes"):
        res = launch("ring", n, pl.backend, params, params["timeout_s"], f"phase4.ring_allreduce on {n} ranks")
        launches[str(n)] = res["_launch_s"]
        rows += rows_from(res, n, pl.backend, roofs, params)
    if params["deadlock_demo"]:
        # On GPUs the demo runs over NCCL and over gloo: whether the naive order hangs depends on
        # whether a send can finish before its receive is posted, and the two transports differ.
        for backend in ([pl.backend, "gloo"] if pl.backend == "nccl" else [pl.backend]):
            rows.append(deadlock_demo(min(pl.world_sizes), backend, params))
    return rows, {"backend": pl.backend, "world_sizes": pl.world_sizes, "launch_s": launches,
                  "link_roof": {"gbps": roofs.bandwidth_gbps, "source": roofs.source},
                  "goal_ours_over_nccl_busbw": GOAL_RATIO, "goal_min_size_bytes": GOAL_MIN_SIZE}


GOAL_RATIO, GOAL_MIN_SIZE = 0.85, 256 * 2**20      # the issue's goal: >= 85% of NCCL's busbw from 256 MiB up

COMMON = {"backend": "auto", "world_sizes": "auto", "pg_timeout_s": 120, "timeout_s": 240,
          "warmup_iters": 5, "min_iters": 20, "max_iters": 200, "iter_bytes": 8 * 2**30}
EXERCISE = Exercise(
    id="phase4.ring_allreduce", title="Ring all-reduce from scratch (isend/irecv only), pipelined, vs NCCL",
    run=run,
    params={**COMMON, "depths": [1, 2, 4, 8], "min_subchunk_bytes": 4 * 2**20,
            "check_numels": [1, 3, 1031, 1_000_003, 2**24 + 7],
            "sizes_bytes": [64 * 2**20, 256 * 2**20, 2**30],
            "deadlock_demo": True, "deadlock_bytes": 256 * 2**20, "deadlock_wait_s": 5.0},
    cpu_params={"depths": [1, 4], "min_subchunk_bytes": 64 * 2**10, "check_numels": [1, 3, 1031, 100_003],
                "sizes_bytes": [2**20, 4 * 2**20], "min_iters": 5, "max_iters": 20, "iter_bytes": 2**24,
                "warmup_iters": 2, "timeout_s": 180, "pg_timeout_s": 60,
                "deadlock_bytes": 2**20, "deadlock_wait_s": 2.0},
    quick_params={"depths": [1, 3], "check_numels": [1, 5, 1031], "sizes_bytes": [2**18],
                  "min_iters": 3, "max_iters": 3, "warmup_iters": 1, "deadlock_wait_s": 1.5},
)
