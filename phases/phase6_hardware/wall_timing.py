"""Timing JAX: host wall clock around back-to-back calls, the same method for torch beside it.

JAX offers no device-side events a Python caller can bracket its kernels with (its streams are not
torch's, so torch's CUDA events would time the wrong stream). So a sample is `reps` calls
dispatched back to back (asynchronously, as a program would) and ended by one wait for the last
result, divided by `reps`: the device stays busy, and the one synchronization is spread over
`reps` calls. Warmup (compilation, autotuning) is excluded; median and spread of many samples are
kept, as common/timing.py does. No L2 flush between calls: consecutive calls meet warm caches.

torch's rows are timed by the lab's harness (CUDA events, L2 flushed) and ALSO by this function,
so every JAX-against-torch ratio compares two numbers taken the same way.
"""
import math
import time

from common.timing import Timing, summarize

SAMPLE_MS = 5.0          # at least this much work per sample, so the final wait is a small part of it


def benchmark(call, wait, *, quick: bool = False, target_ms: float = 200.0, min_samples: int = 10,
              max_samples: int = 200, warmup_ms: float = 25.0) -> Timing:
    """Per-call time of `call()` (which dispatches and returns its result); `wait(result)` blocks
    until the device has finished it (jax.block_until_ready, or torch.cuda.synchronize)."""
    if quick:
        target_ms, min_samples, warmup_ms = 5.0, 3, 1.0
    wait(call())                                        # compile, autotune, allocate
    t0 = time.perf_counter()
    wait(call())
    estimate_ms = max((time.perf_counter() - t0) * 1e3, 1e-3)
    reps = max(1, math.ceil(SAMPLE_MS / estimate_ms)) if not quick else 1
    warmup = max(1, int(warmup_ms / estimate_ms))
    out = None
    for _ in range(warmup):
        out = call()
    wait(out)
    n = int(min(max_samples, max(min_samples, target_ms / (estimate_ms * reps))))
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = call()
        wait(out)
        samples.append((time.perf_counter() - t0) * 1e3 / reps)
    method = (f"host wall clock (perf_counter) over {reps} back-to-back calls ended by one wait for the last "
              "result, per call")
    return summarize(samples, method, warmup + 2, flush_l2=False)


def jax_wait(result):
    import jax
    jax.block_until_ready(result)


def torch_wait(ctx):
    return lambda _result: ctx.synchronize()
