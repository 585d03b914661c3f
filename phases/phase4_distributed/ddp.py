"""Exercise 4.1: data-parallel training with DistributedDataParallel, and what its all-reduce costs.

    lab run phase4.ddp                             # NCCL on [2, all] GPUs; --device cpu --param backend=gloo
    python -m phases.phase4_distributed.ddp                    # alone: 2 CPU ranks (gloo), a tiny model

The model: residual MLP blocks (LayerNorm, Linear d->4d, GELU, Linear 4d->d), 8 d^2 matmul weights
per block, 6 model FLOPs per weight per token (MFU's numerator); bf16 autocast on GPUs. Checked:
parameter checksums (float64 sums, gathered from every rank) differ before DDP, are identical after
its broadcast and after `steps` steps on different data per rank. Timed, per bucket size x comm hook
x launch settings, taken in turn from an idle GPU with the ranks lined up: compute (no_sync), nocomm
(the DDP step over a one-rank group: DDP's own work, no communication), comm (DDP's buckets
all-reduced alone) and the DDP step. hidden = (nocomm + comm - ddp) / comm, clipped to [0, 1]: the
share of the communication that ran under backward (the goal's measure, judged at the fastest
step); against no_sync it also charges DDP's bucket copies to the communication. contention.py
times backward's kernels under the transfer; a straggler rank shows the all-reduce's barrier.
"""
import copy
import gc
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from common import roofline
from common.errors import LabError
from common.exercise import Exercise, Result, row
from common.params import Bool, Choice, Float, Int
from common.standalone import run_alone
from common.timing import summarize

from . import analysis, calibration, contention, copy_engine
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


# ------------------------------------------------------------------------------ the model
class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def make_model(d_model: int, n_layers: int) -> nn.Module:
    return nn.Sequential(*[Block(d_model) for _ in range(n_layers)])


def matmul_params(d_model: int, n_layers: int) -> int:
    return n_layers * 8 * d_model * d_model


def param_count(d_model: int, n_layers: int) -> int:
    """Every parameter of make_model: per block a LayerNorm (weight and bias, d each), Linear d->4d
    (4d^2 + 4d) and Linear 4d->d (4d^2 + d): 8d^2 + 7d. DDP all-reduces 4 bytes (fp32) of gradient each."""
    return n_layers * (8 * d_model * d_model + 7 * d_model)


def step_flops(d_model: int, n_layers: int, tokens: int) -> int:
    """Matmul FLOPs of one training step on `tokens` tokens: 6 per weight per token."""
    return 6 * tokens * matmul_params(d_model, n_layers)


def checksum(model: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def hidden_fraction(compute_ms: float, comm_ms: float, ddp_ms: float) -> tuple[float, float]:
    """(clipped to [0, 1], raw): the share of comm_ms that did not add to the step."""
    raw = (compute_ms + comm_ms - ddp_ms) / comm_ms if comm_ms > 0 else float("nan")
    return min(1.0, max(0.0, raw)), raw


# ------------------------------------------------------------------------------ on every rank
def _bucket_bytes(ddp) -> list[int]:
    data = ddp._get_ddp_logging_data()
    text = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return [int(x) for x in str(text).replace(",", " ").split()]


class Trainer:
    """One rank's side: the model, its data, and one training step (forward, backward, SGD update)."""

    def __init__(self, me, params: dict):
        self.me, self.params = me, params
        self.amp = me.device.type == "cuda" and params["dtype"] == "bf16"   # bf16 matmuls, fp32 weights and grads
        self.wrap = {"device_ids": [me.local_rank]} if me.device.type == "cuda" else {}
        if me.device.type == "cuda" and params.get("sm_carveout"):
            # cuBLAS matmuls leave this many SMs alone, so NCCL's all-reduce CTAs find them free
            # instead of waiting for (or slowing) a matmul that wanted every SM.
            if not hasattr(torch._C, "_set_sm_carveout_experimental"):
                raise RuntimeError(f"sm_carveout needs a PyTorch with an SM carve-out for cuBLAS (2.6 or newer); "
                                   f"this is {torch.__version__}")
            torch._C._set_sm_carveout_experimental(params["sm_carveout"])
        torch.manual_seed(1234 + me.rank)                # a different init on every rank, on purpose
        self.model = make_model(params["d_model"], params["n_layers"]).to(me.device)
        self.data = torch.Generator(device=me.device).manual_seed(5000 + me.rank)   # different data per rank

    def batch(self):
        shape = (self.params["tokens_per_rank"], self.params["d_model"])
        return (torch.randn(shape, device=self.me.device, generator=self.data),
                torch.randn(shape, device=self.me.device, generator=self.data))

    def wrapped(self, model=None, **kwargs):
        """DDP around `model` (default: a fresh copy, so no earlier wrapper's gradient hooks are on it)."""
        ddp = nn.parallel.DistributedDataParallel(model if model is not None else copy.deepcopy(self.model),
                                                  gradient_as_bucket_view=self.params["gradient_as_bucket_view"],
                                                  **self.wrap, **kwargs)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=self.params["lr"])

    def backward(self, net, x, y):
        if self.amp:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.mse_loss(net(x), y)
        else:
            loss = F.mse_loss(net(x), y)
        loss.backward()
        return loss

    def step(self, net, opt, x, y):
        loss = self.backward(net, x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss


def _checksums(tr: Trainer) -> dict:
    """Checksums before DDP, after its broadcast, and after `steps` steps on per-rank data."""
    me = tr.me
    out = {"checksum_before_ddp": me.gather(checksum(tr.model))}
    ddp, opt = tr.wrapped(tr.model)                      # the constructor broadcasts rank 0's weights
    out["checksum_after_broadcast"] = me.gather(checksum(tr.model))
    losses = [float(tr.step(ddp, opt, *tr.batch())) for _ in range(tr.params["steps"])]
    out["checksum_after_steps"] = me.gather(checksum(tr.model))
    out["first_loss"] = me.gather(losses[0])
    out["steps"] = tr.params["steps"]
    return out


def avg_hook(state, bucket):
    """A DDP comm hook: all-reduce the bucket with ReduceOp.AVG. Without a hook DDP divides every
    gradient by the world size itself, a separate read-and-write pass over all of them on the
    compute stream during backward; with AVG, NCCL scales inside its own
    all-reduce kernel (a premultiplied sum). gloo has no AVG: there the hook sums, then divides."""
    t = bucket.buffer()
    if dist.get_backend() == "nccl":
        return dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True).get_future().then(lambda f: f.value()[0])
    n = dist.get_world_size()
    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0].div_(n))


# builtin: DDP's own sum + div_; avg: avg_hook; copy_engine: copy_engine.CopyEngineAllReduce (GPUs only)
COMM_HOOKS = ("builtin", "avg", "copy_engine")


def _bucket(tr: Trainer, cap_mb: float, hook: str, x, y, engine: copy_engine.CopyEngineAllReduce | None = None) -> dict:
    """compute (no_sync), comm (DDP's own buckets, all-reduced alone, by what the hook uses),
    nocomm (the DDP step over a one-rank group) and the DDP step, per rank."""
    me, warm, iters = tr.me, tr.params["warmup_iters"], tr.params["iters"]
    ddp, opt = tr.wrapped(bucket_cap_mb=cap_mb)
    # the same DDP step over a group of this rank alone: DDP's builtin reduction, every bucket copy
    # and division it makes, and all-reduces that reach no other GPU
    quiet, quiet_opt = tr.wrapped(bucket_cap_mb=cap_mb, process_group=tr.solo)
    if hook == "avg":
        ddp.register_comm_hook(None, avg_hook)
    elif hook == "copy_engine":
        ddp.register_comm_hook(None, engine.hook)
    op = dist.ReduceOp.AVG if hook == "avg" and dist.get_backend() == "nccl" else dist.ReduceOp.SUM
    for _ in range(3):                     # DDP rebuilds its buckets in step 2's backward; logged from step 3
        tr.step(ddp, opt, x, y)
        tr.step(quiet, quiet_opt, x, y)
    me.sync()
    sizes = _bucket_bytes(ddp)
    bufs = [torch.randn(b // 4, device=me.device) for b in sizes]      # fp32 gradients: 4 bytes each

    def compute():
        with ddp.no_sync():
            tr.step(ddp, opt, x, y)

    def comm():
        if hook == "copy_engine":
            for b in bufs:
                engine.all_reduce_(b)
            engine.wait()
            return
        for w in [dist.all_reduce(b, op=op, async_op=True) for b in bufs]:
            w.wait()

    def nocomm():
        tr.step(quiet, quiet_opt, x, y)

    def step():
        tr.step(ddp, opt, x, y)

    entry = {"bucket_cap_mb": cap_mb, "comm_hook": hook, "bucket_bytes": sizes, "warmup": warm}
    host: dict = {}
    # in turn, not in blocks: the hidden share is a difference of these times, and a slow spell
    # that hit one block alone would move it by more than the effect being measured. Every rank
    # lined up before each call: otherwise the local steps before the DDP step (whose length
    # differs per GPU) leave the ranks apart, and the rank that starts the DDP step first waits
    # out the gap in its first all-reduce, timed as communication.
    samples = col.time_interleaved({"compute": compute, "comm": comm, "nocomm": nocomm, "ddp": step},
                                   warm, iters, me.device, idle_start=True, host=host, line_up=me.line_up)
    for name, ms in samples.items():
        entry[name] = me.gather(ms)
    # the CPU's time to enqueue each call (GPUs only): a step whose host time nears its GPU time
    # is waiting on Python, which is where a comm hook's per-bucket cost lands
    entry["host_ms"] = {name: me.gather(statistics.median(ms)) for name, ms in host.items()}
    # the hook's average must be the same on every rank. (The weights differ by now: the no_sync
    # steps updated each rank from its own gradients. The averaged gradient does not.)
    tr.backward(ddp, x, y)
    grads = sum(float(p.grad.double().sum()) for p in ddp.parameters())
    entry["grads_identical"] = len(set(me.gather(grads))) == 1
    opt.zero_grad(set_to_none=True)
    return entry


def _wall(tr: Trainer, x, y) -> dict:
    """Per-rank wall-clock step medians, local work (no_sync) and DDP steps, without and with a
    straggler (the last rank sleeps before each step)."""
    me = tr.me
    ddp, opt = tr.wrapped()
    tr.step(ddp, opt, x, y)

    def median_ms(sync: bool, straggle_s: float) -> float:
        times = []
        for _ in range(tr.params["wall_steps"]):
            me.sync()
            t0 = time.perf_counter()
            if straggle_s and me.rank == me.world - 1:
                time.sleep(straggle_s)
            if sync:
                tr.step(ddp, opt, x, y)
            else:
                with ddp.no_sync():
                    tr.step(ddp, opt, x, y)
            me.sync()
            times.append((time.perf_counter() - t0) * 1e3)
        dist.barrier()
        return sorted(times)[len(times) // 2]

    s = tr.params["straggler_ms"] / 1e3
    return {"local": me.gather(median_ms(False, 0.0)), "ddp": me.gather(median_ms(True, 0.0)),
            "local_straggler": me.gather(median_ms(False, s)), "ddp_straggler": me.gather(median_ms(True, s))}


def worker_task(me, params: dict) -> dict:
    tr = Trainer(me, params)
    out = {"params": sum(p.numel() for p in tr.model.parameters()),
           "grad_bytes": sum(p.numel() * p.element_size() for p in tr.model.parameters())}
    me.stage("ddp checksums")
    out.update(_checksums(tr))
    tr.solo, _ = dist.new_subgroups(group_size=1)        # one group per rank, for the no-communication step
    gc.collect()
    x, y = tr.batch()
    out["buckets"] = []
    # one workspace for every bucket size: room for the largest possible bucket, all the gradients
    engine = (copy_engine.CopyEngineAllReduce(out["params"], high_priority=params.get("high_priority_stream", False),
                                              graphs=params["copy_engine_graphs"])
              if "copy_engine" in params["comm_hooks"] else None)
    if engine is not None:
        out["copy_engine_check"] = me.gather(copy_engine.check(engine))
    for hook in params["comm_hooks"]:
        for cap in params["bucket_caps_mb"]:
            me.stage(f"ddp bucket_cap_mb={cap} comm hook {hook}")
            out["buckets"].append(_bucket(tr, cap, hook, x, y, engine))
            gc.collect()
    if me.device.type == "cuda" and params["contention"]:
        me.stage("ddp: kernels under an all-reduce")
        out["contention"] = me.gather(contention.probe(me, params["tokens_per_rank"], params["d_model"],
                                                       out["grad_bytes"]))
        gc.collect()
        torch.cuda.empty_cache()
    me.stage("ddp per-rank steps")
    out["wall"] = _wall(tr, x, y)
    return out


# ------------------------------------------------------------------------------ in the lab process
def _hook_check(res: dict, hook: str, chk: dict) -> dict:
    """The check that gates a bucket row: the checksums' (every hook), and for the copy-engine hook
    also its all-reduce against NCCL's on random data, within tolerance and identical on every rank."""
    if hook != "copy_engine" or not chk["passed"]:
        return chk
    per_rank = res.get("copy_engine_check") or []
    err = max((c["max_abs_error"] for c in per_rank), default=None)
    same = len({tuple(c["checksums"]) for c in per_rank}) == 1
    tol = copy_engine.CHECK_TOLERANCE
    reason = ("no copy-engine check ran" if err is None else
              f"the copy-engine all-reduce is {err:.2g} from NCCL's (tolerance {tol:g})" if err > tol else
              "the copy-engine all-reduce left the ranks with different results" if not same else None)
    return {"reference": "NCCL all-reduce (sum) / n on the same random data, sizes "
                         + ", ".join(map(str, copy_engine.CHECK_SIZES)),
            "metric": "max_abs", "precision": "fp32", "tolerance": tol,
            "rel_l2_error": None, "max_abs_error": err, "passed": reason is None, "reason": reason}


def _contention_row(c: dict, base: dict, hbm_roofs, ctx=None) -> dict:
    """One probed kernel under one background transfer: timed (slowest rank's slowdown), predicted
    alone from the HBM roofline (with ctx: ctx.predict, so the calibrated model comes with it), and
    checked (its output under the transfer equals its output alone)."""
    k = c["slowest_rank"]
    check = {"reference": "the same kernel's output computed with no transfer in flight", "metric": "exact",
             "precision": c["dtype"], "tolerance": 0.0, "rel_l2_error": None, "max_abs_error": None,
             "passed": c["matches"], "reason": None if c["matches"] else "output under the transfer differs"}
    p = {**base, "kernel": c["kernel"], "background": c["background"]}
    variant = f"contention_{c['background']}_{c['kernel']}"
    if not c["matches"]:
        return row(variant, p, "failed", "output under the transfer differs from the output alone", check=check)
    metrics = {"ms": c["under_ms"][k], "alone_ms": c["alone_ms"][k], "under_ms": c["under_ms"][k],
               "slowdown": c["max_slowdown"], "slowest_rank": k, "per_rank_alone_ms": c["alone_ms"],
               "per_rank_under_ms": c["under_ms"], "per_rank_slowdown": c["slowdown"],
               "background_ms": c["background_ms"], "calls_per_repeat": c["reps"]}
    alone, launches = c["alone_ms"][k], c.get("launches", 1)
    if ctx is not None:            # back-to-back calls, caches warm: timed as the harness times a warm kernel
        t = summarize([alone], "CUDA events around back-to-back calls; median of repeats", 0, flush_l2=False)
        prediction = ctx.predict(c["flops"], c["bytes"], c["dtype"], t, launches=launches, measured_ms=alone)
    else:
        prediction = {**roofline.predict(c["flops"], c["bytes"], hbm_roofs, c["dtype"], alone), "launches": launches}
    return row(variant, p, "ok", None, check=check, metrics=metrics, prediction=prediction)


def _bucket_variant(cap_mb, hook: str) -> str:
    return f"bucket_{cap_mb}mb" + ("" if hook == "builtin" else f"_{hook}")


def rows_from(res: dict, n: int, backend: str, params: dict, roofs, ceiling: dict | None,
              hbm_roofs=None, ctx=None) -> list[dict]:
    base = {"world_size": n, "backend": backend, "d_model": params["d_model"], "n_layers": params["n_layers"],
            "tokens_per_rank": params["tokens_per_rank"], "dtype": params["dtype"]}
    rows = []
    before, bcast, after = res["checksum_before_ddp"], res["checksum_after_broadcast"], res["checksum_after_steps"]
    same_init, same_after = len(set(bcast)) == 1, len(set(after)) == 1
    chk = {"reference": "rank 0's checksum (float64 sum of all parameters), gathered from every rank",
           "metric": "exact", "precision": None, "tolerance": 0.0, "rel_l2_error": None, "max_abs_error": None,
           "passed": same_init and same_after,
           "reason": None if (same_init and same_after) else "parameter checksums differ across ranks"}
    rows.append(row("checksum_broadcast", base, "ok" if same_init else "failed",
                    None if same_init else "checksums differ after DDP's initial broadcast",
                    check={**chk, "passed": same_init},
                    metrics={"checksum_before_ddp": before, "checksum_after_broadcast": bcast,
                             "distinct_before": len(set(before)), "identical": same_init}))
    rows.append(row("checksum_after_steps", {**base, "steps": res["steps"]}, "ok" if same_after else "failed",
                    None if same_after else f"checksums differ after {res['steps']} steps",
                    check={**chk, "passed": same_after},
                    metrics={"checksum_after_steps": after, "identical": same_after,
                             "first_loss_per_rank": res["first_loss"],
                             "distinct_first_losses": len(set(res["first_loss"]))}))
    flops = step_flops(params["d_model"], params["n_layers"], params["tokens_per_rank"])
    grad_bytes = res["grad_bytes"]
    method = col.timing_method(backend)
    peak = roofs.peak(params["dtype"])
    for b in res["buckets"]:
        hook = b.get("comm_hook", "builtin")
        p = {**base, "bucket_cap_mb": b["bucket_cap_mb"], "comm_hook": hook,
             **({"copy_engine_graphs": params["copy_engine_graphs"]} if hook == "copy_engine" else {})}
        name = _bucket_variant(b["bucket_cap_mb"], hook)
        hook_chk = _hook_check(res, hook, chk)
        if not hook_chk["passed"]:
            rows.append(row(name, p, "failed", f"not timed: {hook_chk['reason']}", check=hook_chk))
            continue
        if b.get("grads_identical") is False:
            why = "the averaged gradients differ across ranks after the timed steps"
            rows.append(row(name, p, "failed", why, check={**hook_chk, "passed": False, "reason": why}))
            continue
        slow = {k: col.slowest_rank(b[k]) for k in ("compute", "comm", "nocomm", "ddp")}
        med = {k: summarize(slow[k]["samples_ms"], method, b["warmup"], flush_l2=False) for k in slow}
        c_ms, m_ms, d_ms = med["compute"].median_ms, med["comm"].median_ms, med["ddp"].median_ms
        q_ms = med["nocomm"].median_ms
        hidden, raw = hidden_fraction(c_ms, m_ms, d_ms)
        comm_hidden, comm_raw = hidden_fraction(q_ms, m_ms, d_ms)
        tflops = flops / (d_ms * 1e9)
        metrics = {"ms": d_ms, "compute_ms": c_ms, "comm_ms": m_ms, "ddp_ms": d_ms, "nocomm_ms": q_ms,
                   "bookkeeping_ms": q_ms - c_ms, "exposed_vs_nocomm_ms": max(0.0, d_ms - q_ms),
                   "hidden_fraction_vs_nocomm": comm_hidden, "hidden_fraction_vs_nocomm_raw": comm_raw,
                   "exposed_comm_ms": max(0.0, d_ms - c_ms), "hidden_fraction": hidden, "hidden_fraction_raw": raw,
                   "buckets": len(b["bucket_bytes"]), "bucket_bytes": b["bucket_bytes"], "grad_bytes": grad_bytes,
                   "comm_busbw_gbps": col.busbw_gbps("all_reduce", sum(b["bucket_bytes"]), m_ms, n),
                   **{f"{k}_host_ms": max(v) for k, v in (b.get("host_ms") or {}).items()},
                   "per_rank_ddp_ms": slow["ddp"]["per_rank_median_ms"],
                   "per_rank_compute_ms": slow["compute"]["per_rank_median_ms"],
                   "model_flops_per_step": flops, "tflops": tflops,
                   "peak_tflops": peak, "peak_tflops_source": (roofs.peak_sources or {}).get(params["dtype"]) or roofs.source,
                   "mfu_vs_peak": tflops / peak if peak else None,
                   "phase1_ceiling_tflops": ceiling["tflops"] if ceiling else None,
                   "phase1_ceiling_dtype": ceiling["dtype"] if ceiling else None,
                   "phase1_ceiling_record": ceiling["source"] if ceiling else None,
                   "mfu_vs_phase1_ceiling": tflops / ceiling["tflops"] if ceiling else None}
        # perfect overlap: the step takes max(FLOPs / peak, gradient wire bytes / link)
        wire = col.wire_bytes("all_reduce", grad_bytes, n)
        rows.append(row(name, p, "ok", None, check=hook_chk, timing=med["ddp"], metrics=metrics,
                        prediction={**roofline.predict(flops, wire, roofs, params["dtype"], d_ms),
                                    "excluded": calibration.STEP_EXCLUDED}))
    for c in contention.slowdowns(res["contention"]) if res.get("contention") else []:
        rows.append(_contention_row(c, base, hbm_roofs, ctx))
    w = res["wall"]
    for variant, local, ddp_ms, straggle in (("per_rank_steps", w["local"], w["ddp"], 0.0),
                                             ("per_rank_steps_straggler", w["local_straggler"], w["ddp_straggler"],
                                              params["straggler_ms"])):
        rows.append(row(variant, {**base, "straggler_ms": straggle, "straggler_rank": n - 1 if straggle else None},
                        "ok", None, metrics={"per_rank_local_ms": local, "per_rank_ddp_ms": ddp_ms,
                                             "local_spread_ms": max(local) - min(local),
                                             "ddp_spread_ms": max(ddp_ms) - min(ddp_ms)}))
    return rows


def run(ctx, params):
    unknown = sorted(set(params["comm_hooks"]) - set(COMM_HOOKS))
    if unknown:
        raise LabError(f"unknown comm hook {', '.join(unknown)}: choose from {', '.join(COMM_HOOKS)}")
    pl = plan(ctx, params)
    rows = pl.skip_rows()
    if not pl.world_sizes:
        return Result(rows, {"backend": pl.backend})
    roofs = link_roofs(ctx, pl.backend, params["dtype"])
    hbm_roofs = ctx.roofs(params["dtype"])
    ceiling = ctx.phase1_ceiling()
    summary = {"backend": pl.backend, "world_sizes": pl.world_sizes, "launch_s": {},
               "params_count": None, "phase1_ceiling": ceiling, "roofs_source": roofs.source, "best": [],
               "nocomm_baseline": "over a group of this rank alone", "analysis": {}}
    # NCCL's all-reduce kernels run on SMs the backward's matmuls also want. Three process-wide
    # settings change how that contest goes, one launch per combination: capping NCCL's channels
    # (NCCL_MAX_NCHANNELS: each all-reduce slower, fewer SMs taken from compute; None = NCCL's own
    # choice), putting NCCL's stream at high priority (its CTAs are scheduled before queued
    # compute CTAs, so a bucket's all-reduce starts as soon as it is ready instead of after the
    # matmul in flight), and an SM carve-out (cuBLAS leaves that many SMs out of every matmul).
    settings = launch_settings(params, pl.backend)
    for n in ctx.track(pl.world_sizes, "DDP world sizes"):
        timed = []
        hooks, why_not = _hooks_for(params["comm_hooks"], pl.backend, n)
        rows += [row(_bucket_variant(cap, "copy_engine"), {"world_size": n, "backend": pl.backend,
                                                            "bucket_cap_mb": cap, "comm_hook": "copy_engine"},
                     "skipped", why_not) for cap in params["bucket_caps_mb"] if why_not]
        for ch, hp, sm in settings:
            launch_hooks = hooks_in_launch(hooks, ch, settings)
            env = {"NCCL_MAX_NCHANNELS": str(ch)} if ch else None
            tag = setting_tag(ch, hp, sm)
            what = ", ".join(([f"NCCL_MAX_NCHANNELS={ch}"] if ch else []) + (["high-priority NCCL stream"] if hp else [])
                             + ([f"matmuls leave {sm} SMs free"] if sm else []))
            res = launch("ddp", n, pl.backend, {**params, "high_priority_stream": hp, "sm_carveout": sm,
                                                 "comm_hooks": launch_hooks},
                         params["timeout_s"],
                         f"phase4.ddp on {n} ranks" + (f" ({what})" if what else ""), extra_env=env)
            summary["launch_s"][f"{n}{tag}"] = res["_launch_s"]
            summary["params_count"] = res["params"]
            new = rows_from(res, n, pl.backend, params, roofs, ceiling, hbm_roofs, ctx)
            per_setting = [r for r in new if r["variant"].startswith(("bucket_", "contention_"))]
            for r in new:
                r["params"]["nccl_max_channels"] = ch
                r["params"]["nccl_high_priority"] = hp
                r["params"]["sm_carveout"] = sm
            for r in per_setting:
                r["variant"] += tag
            timed += [r for r in new if r["variant"].startswith("bucket_") and r["status"] == "ok"]
            rows += new if (ch, hp, sm) == settings[0] else per_setting
        mine = [r for r in rows if r["params"].get("world_size") == n]
        for variant, fastest in analysis.fastest_flags(mine).items():     # the row the goal is judged on
            next(r for r in mine if r["variant"] == variant and r["status"] == "ok")["metrics"]["fastest_step"] = fastest
        if timed:
            summary["best"].append(analysis.judge(n, timed))
        summary["analysis"][str(n)] = analysis.ddp_facts(mine)
    return Result(rows, summary)


def launch_settings(params: dict, backend: str) -> list[tuple]:
    """(NCCL_MAX_NCHANNELS, high-priority stream, SM carve-out) of each launch: every combination on
    NCCL, one plain launch on gloo."""
    return [(ch, hp, sm) for ch in params["nccl_max_channels"] for hp in params["nccl_high_priority"]
            for sm in params["sm_carveouts"]] if backend == "nccl" else [(None, False, None)]


def hooks_in_launch(hooks: list[str], ch, settings: list[tuple]) -> list[str]:
    """The copy-engine hook sends no gradient through NCCL, so NCCL's channel cap cannot change it:
    it runs in the launches of the first cap only (a repeat would only be a second sample)."""
    return hooks if ch == settings[0][0] else [h for h in hooks if h != "copy_engine"]


def setting_tag(ch, hp, sm) -> str:
    return "".join([f"_ch{ch}" if ch else "", "_hp" if hp else "", f"_sm{sm}" if sm else ""])


def work(params: dict) -> list:
    """Every row phase4.ddp times, per world size and launch setting (as on GPUs with NCCL unless
    --param backend=gloo): a DDP step per comm hook x bucket cap (model FLOPs; bytes = the gradient
    bytes each rank's link carries; excluded from the accuracy: a whole step, see calibration.STEP_EXCLUDED) and
    each contention kernel per background (its FLOPs and HBM bytes, timed alone; GPUs only)."""
    from common.exercise import Work
    backend = "gloo" if params.get("backend") == "gloo" else "nccl"
    d, layers, tokens = params["d_model"], params["n_layers"], params["tokens_per_rank"]
    flops = step_flops(d, layers, tokens)
    grads = 4 * param_count(d, layers)
    kernels = contention.kernel_counts(tokens, d)
    settings = launch_settings(params, backend)
    out = []
    for n in work_world_sizes(params):
        hooks = [h for h in params["comm_hooks"] if backend == "nccl" or h != "copy_engine"]
        for ch, hp, sm in settings:
            tag = setting_tag(ch, hp, sm)
            for hook in hooks_in_launch(hooks, ch, settings):
                for cap in params["bucket_caps_mb"]:
                    out.append(Work(f"{_bucket_variant(cap, hook)}{tag} on {n} ranks (a whole step: not counted)",
                                    flops, col.wire_bytes("all_reduce", grads, n), params["dtype"]))
            if backend == "nccl" and params["contention"]:
                out += [Work(f"contention_{bg}_{name}{tag} on {n} ranks (the kernel alone)", f, b, dt, launches=k)
                        for bg in contention.BACKGROUNDS for name, (f, b, dt, k) in kernels.items()]
    return out


def _hooks_for(hooks: list[str], backend: str, n: int) -> tuple[list[str], str | None]:
    """The comm hooks this world size runs, and why the copy-engine hook is left out (None if it is not)."""
    if "copy_engine" not in hooks:
        return hooks, None
    gpus = torch.cuda.device_count() if backend == "nccl" else 0
    why = copy_engine.unavailable(backend, n, gpus)
    return ([h for h in hooks if h != "copy_engine"] if why else hooks), why


def footprint_bytes(p: dict) -> float:
    """Per rank: fp32 weights x ~7-8.5 (copies, grad buckets, comm buffers, copy-engine workspace) + one step's activations."""
    d, layers, tokens = p["d_model"], p["n_layers"], p["tokens_per_rank"]
    weights = 4 * param_count(d, layers)                  # fp32: two Linears with biases and a LayerNorm per block
    grads = 1 if p["gradient_as_bucket_view"] else 2      # the buckets, and .grad unless it is a view into them
    # at a bucket step: tr.model and a second copy that stays from the checksum step's DDP; ddp and
    # quiet, each weights + buckets; the comm buffers
    copies = 2 + 2 * (1 + grads) + 1
    if "copy_engine" in p["comm_hooks"]:
        copies += 1.5                                     # (n + 1) chunks of weights / n, n >= 2
    if p["dtype"] == "bf16" and p["backend"] != "gloo":   # (autocast runs on GPUs only) saved per block: x fp32, LN out bf16, fc1 and GELU outputs bf16 (4d), ...
        acts = 22 * tokens * d * layers + weights / 2     # ... and autocast's bf16 copies of the weights
    else:                       # fp32: x, LN out, fc1 and GELU outputs
        acts = 40 * tokens * d * layers
    batch = 2 * 4 * tokens * d                            # x, y
    return (copies * weights + acts + batch) * ranks_sharing_memory(p)


EXERCISE = Exercise(
    id="phase4.ddp", title="DDP: broadcast and sync checked by checksums; communication hidden under backward",
    run=run, bench_version=2,
    params={**launch_params(timeout_s=240),
            # 201M parameters as 24 blocks of d=1024 (not 6 of 2048): the gradients computed last
            # (block 0's) are what no bucket can hide, so narrower blocks leave less exposed.
            "d_model": Int(1024, min=1), "n_layers": Int(24, min=1, unit="blocks"),
            "tokens_per_rank": Int(8192, min=1, unit="tokens"),
            "dtype": Choice("bf16", ("bf16", "fp32"), help="bf16: autocast matmuls on GPUs (fp32 on CPUs)"),
            "lr": Float(1e-4, min=0), "steps": Int(20, min=1),
            "bucket_caps_mb": Float([5, 25, 50, 100, 400], unit="MiB", min=0.001, many=True),
            "gradient_as_bucket_view": Bool(True),
            "nccl_max_channels": Int([None, 16], min=1, max=64, many=True, nullable=True,
                                     help="NCCL_MAX_NCHANNELS, one launch each; null: NCCL's own choice"),
            "nccl_high_priority": Bool([False, True], many=True),
            "sm_carveouts": Int([None], min=0, max=256, unit="SMs", many=True, nullable=True,
                                help="SMs every cuBLAS matmul leaves free, one launch each; null: none"),
            "comm_hooks": Choice(["builtin", "avg", "copy_engine"], COMM_HOOKS, many=True),
            "copy_engine_graphs": Bool(True), "contention": Bool(True),
            "warmup_iters": Int(3, min=0, unit="steps"), "iters": Int(21, min=1, unit="steps"),
            "wall_steps": Int(8, min=1, unit="steps"), "straggler_ms": Float(20.0, min=0, unit="ms")},
    cpu_params={"d_model": 64, "n_layers": 2, "tokens_per_rank": 32, "dtype": "fp32", "comm_hooks": ["builtin", "avg"],
                "bucket_caps_mb": [0.01, 1], "warmup_iters": 1, "iters": 5, "wall_steps": 4,
                "straggler_ms": 20.0, "timeout_s": 180, "pg_timeout_s": 60},
    quick_params={"n_layers": 2, "bucket_caps_mb": [0.01, 1], "iters": 3, "warmup_iters": 1, "wall_steps": 3},
    footprint_bytes=footprint_bytes, work=work, skips=whole_run_skipped,
)


if __name__ == "__main__":
    run_alone(EXERCISE, alone({"d_model": 24, "n_layers": 2, "tokens_per_rank": 13, "bucket_caps_mb": [0.003],
                               "comm_hooks": ["builtin"], "steps": 3, "wall_steps": 2}))
