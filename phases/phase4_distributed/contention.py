"""What an all-reduce in flight costs the compute beside it (part of phase4.ddp).

"Hidden" communication assumes backward and the all-reduce do not slow each other. This probe
times the kernels backward is made of, at the DDP run's own shapes (T tokens, width d): a bf16
matmul [T, d] @ [d, 4d] (compute-bound), LayerNorm's fp32 backward, GELU's bf16 backward and a
bias-gradient sum (memory-bound). Each runs alone, then while the gradients move on another stream,
two ways: NCCL's all-reduce as DDP issues it (SMs run the transfer), and the same bytes per rank
copied to the next GPU by the copy engines (no SM takes part). If the copy engines slow a kernel
as much as NCCL does, the cost comes with the bytes (HBM, L2, power), not with the SMs NCCL holds.
Every rank runs the same sequence; the table shows the slowest rank's slowdown.
"""
import statistics

import torch
import torch.distributed as dist

PIECE_BYTES = 32 << 20
# the transfers a kernel is timed under (copy_engine only where the GPUs reach each other's memory)
BACKGROUNDS = ("nccl_all_reduce", "copy_engine")


def kernel_counts(tokens: int, d: int) -> dict:
    """name -> (FLOPs, bytes, dtype, kernels per call) of each probed kernel at T tokens, width d
    (h = 4d). Bytes: each input read once, each output written once.
      matmul [T, d] @ [d, h] bf16: 2Tdh FLOPs; reads both operands, writes [T, h].
      layer_norm_backward fp32 (dx, dgamma, dbeta): reads dy and x [T, d], mean and rstd [T]
        and gamma [d]; writes dx [T, d], dgamma and dbeta [d]. 8 FLOPs per element (a convention:
        normalise, scale, two row sums, combine). Two kernels: dx, then dgamma and dbeta
        together (PyTorch's CUDA path up to 64K rows).
      gelu_backward bf16: reads dy and x [T, h], writes dx [T, h]; 10 FLOPs per element (erf and
        exp of the exact GELU's derivative, by convention).
      bias_grad bf16 (dy.sum(0)): reads [T, h], writes [h]; one add per element read."""
    t, h = tokens, 4 * d
    return {
        "matmul": (2 * t * d * h, 2 * (t * d + h * d + t * h), "bf16", 1),
        "layer_norm_backward": (8 * t * d, 4 * (3 * t * d + 2 * t + 3 * d), "fp32", 2),
        "gelu_backward": (10 * t * h, 2 * 3 * t * h, "bf16", 1),
        "bias_grad": (t * h, 2 * (t * h + h), "bf16", 1),
    }


def kernels(tokens: int, d: int, device) -> dict:
    """name -> (fn, flops, bytes, dtype, launches): the probed kernels, inputs made once."""
    t, h = tokens, 4 * d
    x32, g32 = torch.randn(t, d, device=device), torch.randn(t, d, device=device)
    w, b = torch.ones(d, device=device), torch.zeros(d, device=device)
    mean, rstd = x32.mean(1, keepdim=True), x32.var(1, keepdim=True).add(1e-5).rsqrt()
    a16 = torch.randn(t, d, device=device, dtype=torch.bfloat16)
    w16 = torch.randn(h, d, device=device, dtype=torch.bfloat16)
    x16, g16 = (torch.randn(t, h, device=device, dtype=torch.bfloat16) for _ in range(2))
    fns = {
        "matmul": lambda: a16 @ w16.t(),
        "layer_norm_backward": lambda: torch.ops.aten.native_layer_norm_backward(
            g32, x32, [d], mean, rstd, w, b, [True, True, True])[0],
        "gelu_backward": lambda: torch.ops.aten.gelu_backward(g16, x16),
        "bias_grad": lambda: g16.sum(0),
    }
    return {name: (fns[name], *counts) for name, counts in kernel_counts(tokens, d).items()}


class _SideStream:
    """A background job on its own stream; wait() makes the current stream wait for it."""

    def __init__(self, stream):
        self.stream = stream

    def wait(self):
        torch.cuda.current_stream().wait_stream(self.stream)


def backgrounds(me, grad_bytes: int) -> dict:
    """name -> a function that starts the transfer and returns handles to wait on."""
    pieces = [torch.randn(PIECE_BYTES // 4, device=me.device) for _ in range(max(1, grad_bytes // PIECE_BYTES))]
    out = {"nccl_all_reduce": lambda: [dist.all_reduce(p, op=dist.ReduceOp.AVG, async_op=True) for p in pieces]}
    local_world = torch.cuda.device_count()
    peer = (me.local_rank + 1) % local_world
    if me.world > 1 and local_world > 1 and torch.cuda.can_device_access_peer(me.local_rank, peer):
        wire = torch.randn(int(2 * (me.world - 1) / me.world * sum(p.numel() for p in pieces)), device=me.device)
        remote = torch.empty_like(wire, device=torch.device("cuda", peer))   # on the next GPU, allocated by this process
        side = torch.cuda.Stream(me.device)

        def copy_engine():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):                # a peer copy of contiguous memory: cudaMemcpyAsync, the copy engines
                for dst, src in zip(remote.split(PIECE_BYTES // 4), wire.split(PIECE_BYTES // 4)):
                    dst.copy_(src, non_blocking=True)
            return [_SideStream(side)]
        out["copy_engine"] = copy_engine
    return out


def _with_transfer(me, start, body):
    """body()'s result, run with `start`'s transfer (if any) in flight, every rank lined up first
    (so the transfer starts on all of them together) and everything drained after."""
    me.line_up()
    handles = start() if start else []
    out = body()
    for h in handles:
        h.wait()
    torch.cuda.synchronize(me.device)
    return out


def _timed(me, fn, reps: int, start=None) -> float:
    """ms per call of `fn` over `reps` back-to-back calls, with `start`'s transfer (if any) in flight."""
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def calls():
        t0.record()
        for _ in range(reps):
            fn()
        t1.record()
    _with_transfer(me, start, calls)
    return t0.elapsed_time(t1) / reps


def _background_ms(me, start) -> float:
    me.line_up()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for h in start():
        h.wait()
    t1.record()
    torch.cuda.synchronize(me.device)
    return t0.elapsed_time(t1)


def probe(me, tokens: int, d: int, grad_bytes: int, repeats: int = 5) -> dict:
    """This rank's side: {"background_ms": {bg: ms}, "kernels": {name: {...}}}. Each kernel runs
    enough calls to span ~80% of the transfer, `repeats` times alone and under each background
    (medians); its output under the transfer must equal its output alone."""
    bgs = backgrounds(me, grad_bytes)
    bg_ms = {}
    for name, start in bgs.items():
        _background_ms(me, start)                            # warm: NCCL's first call, the peer mapping
        bg_ms[name] = statistics.median([_background_ms(me, start) for _ in range(repeats)])
    out = {"background_ms": bg_ms, "kernels": {}}
    for name, (fn, flops, nbytes, dtype, launches) in kernels(tokens, d, me.device).items():
        reference = fn().clone()
        one = _timed(me, fn, 10)
        entry = {"flops": flops, "bytes": nbytes, "dtype": dtype, "launches": launches,
                 "under_ms": {}, "matches": {}, "reps": {}}
        entry["alone_ms"] = statistics.median([_timed(me, fn, 10) for _ in range(repeats)])
        for bg, start in bgs.items():
            reps = max(1, int(0.8 * bg_ms[bg] / one))
            entry["reps"][bg] = reps
            entry["under_ms"][bg] = statistics.median([_timed(me, fn, reps, start) for _ in range(repeats)])
            entry["matches"][bg] = bool(torch.equal(_with_transfer(me, start, fn), reference))
        out["kernels"][name] = entry
    return out


def slowdowns(per_rank: list[dict]) -> list[dict]:
    """In the lab process: one entry per (background, kernel) with every rank's times and the
    slowest rank's slowdown (under / alone - 1), and whether every rank's output matched."""
    out = []
    first = per_rank[0]
    for bg in first["background_ms"]:
        for name, k in first["kernels"].items():
            alone = [r["kernels"][name]["alone_ms"] for r in per_rank]
            under = [r["kernels"][name]["under_ms"][bg] for r in per_rank]
            slow = [u / a - 1 for u, a in zip(under, alone)]
            worst = max(range(len(slow)), key=slow.__getitem__)
            out.append({"background": bg, "kernel": name, "flops": k["flops"], "bytes": k["bytes"], "dtype": k["dtype"],
                        "launches": k.get("launches", 1),
                        "background_ms": [r["background_ms"][bg] for r in per_rank],
                        "alone_ms": alone, "under_ms": under, "slowdown": slow,
                        "slowest_rank": worst, "max_slowdown": slow[worst],
                        "reps": [r["kernels"][name]["reps"][bg] for r in per_rank],
                        "matches": all(r["kernels"][name]["matches"][bg] for r in per_rank)})
    return out
