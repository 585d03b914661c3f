"""One timing harness for every phase.

GPU work is asynchronous: a Python timer around a kernel launch measures the launch, not the work.
So on a GPU each sample is bracketed by two CUDA events recorded on the stream, and we read them
only after a synchronize. The recipe, the same for every exercise:

1. run once (compilation, cuBLAS handle creation, allocator warm-up stay out of the numbers);
2. estimate the per-call time, then warm up for `warmup_ms`;
3. take `samples` timed calls, sized to fill `target_ms` (at least `min_samples`), each preceded,
   outside the timed region, by an L2 flush (writing a buffer larger than L2) so every sample
   starts cold, the way a real workload meets a kernel; `flush_l2=False` measures warm caches;
4. report the median and the spread (p10, p90, min, max, std); never the mean of a skewed tail.

Optional CUDA-graph replay (`graph_reps=K`) captures K calls into one graph and times its replay,
divided by K: the CPU launch overhead disappears, which is what tiny kernels need.
On a CPU the same recipe runs with time.perf_counter.
"""
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch


@dataclass
class Timing:
    method: str
    warmup_calls: int
    samples: int
    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    max_ms: float
    mean_ms: float
    std_ms: float
    flush_l2: bool
    graph_reps: int | None = None

    @property
    def spread_pct(self) -> float:
        """(p90 - p10) / median, in percent: how noisy the sample was."""
        return 100.0 * (self.p90_ms - self.p10_ms) / self.median_ms if self.median_ms else math.nan

    def as_dict(self) -> dict:
        d = asdict(self)
        d["spread_pct"] = self.spread_pct
        return d


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted list (q in [0, 1])."""
    if not sorted_values:
        raise ValueError("no samples")
    pos = q * (len(sorted_values) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples_ms: list[float], method: str, warmup_calls: int, flush_l2: bool,
              graph_reps: int | None = None) -> Timing:
    s = sorted(samples_ms)
    return Timing(method=method, warmup_calls=warmup_calls, samples=len(s),
                  median_ms=statistics.median(s), p10_ms=quantile(s, 0.10), p90_ms=quantile(s, 0.90),
                  min_ms=s[0], max_ms=s[-1], mean_ms=statistics.fmean(s),
                  std_ms=statistics.pstdev(s) if len(s) > 1 else 0.0,
                  flush_l2=flush_l2, graph_reps=graph_reps)


def _sample_count(estimate_ms: float, target_ms: float, min_samples: int, max_samples: int) -> int:
    if estimate_ms <= 0:
        return max_samples
    return int(min(max_samples, max(min_samples, target_ms / estimate_ms)))


class L2Flusher:
    """Evicts the L2 by writing a buffer several times its size (outside the timed region)."""

    def __init__(self, device: torch.device):
        l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
        nbytes = max(4 * l2_bytes, 256 * 2**20)      # 4x L2, and never less than 256 MiB
        self.buffer = torch.empty(nbytes // 4, dtype=torch.int32, device=device)

    def __call__(self):
        self.buffer.zero_()


def benchmark(fn: Callable[[], object], device: torch.device | str = "cpu", *,
              warmup_ms: float = 25.0, target_ms: float = 200.0, min_samples: int = 10,
              max_samples: int = 1000, flush_l2: bool = True, graph_reps: int | None = None) -> Timing:
    """Time `fn()` on `device`; return the sample statistics (per call, in ms)."""
    device = torch.device(device)
    if device.type == "cuda":
        return _benchmark_cuda(fn, device, warmup_ms, target_ms, min_samples, max_samples,
                               flush_l2, graph_reps)
    return _benchmark_cpu(fn, warmup_ms, target_ms, min_samples, max_samples)


def _benchmark_cpu(fn, warmup_ms, target_ms, min_samples, max_samples) -> Timing:
    fn()                                                   # first call: allocation, dispatch caches
    t0 = time.perf_counter()
    fn()
    estimate_ms = (time.perf_counter() - t0) * 1e3
    warmup_calls = int(min(max_samples, warmup_ms / estimate_ms)) if estimate_ms > 0 else 1
    for _ in range(warmup_calls):
        fn()
    samples = []
    for _ in range(_sample_count(estimate_ms, target_ms, min_samples, max_samples)):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return summarize(samples, "cpu perf_counter", warmup_calls + 2, flush_l2=False)


def _benchmark_cuda(fn, device, warmup_ms, target_ms, min_samples, max_samples, flush_l2,
                    graph_reps) -> Timing:
    with torch.cuda.device(device):
        flusher = L2Flusher(device) if flush_l2 else None
        call = fn
        if graph_reps:
            call = _capture_graph(fn, graph_reps)
        call()
        torch.cuda.synchronize()

        # Estimate one call's time from five calls (with the flush, as in the timed loop).
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            if flusher:
                flusher()
            call()
        end.record()
        torch.cuda.synchronize()
        estimate_ms = start.elapsed_time(end) / 5

        warmup_calls = max(1, int(warmup_ms / max(estimate_ms, 1e-3)))
        for _ in range(min(warmup_calls, max_samples)):
            call()

        n = _sample_count(estimate_ms, target_ms, min_samples, max_samples)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            if flusher:
                flusher()                       # outside the events: not timed
            starts[i].record()
            call()
            ends[i].record()
        torch.cuda.synchronize()
        per_call = graph_reps or 1
        samples = [s.elapsed_time(e) / per_call for s, e in zip(starts, ends)]
    method = "cuda events" + (f", graph replay of {graph_reps} calls" if graph_reps else "")
    return summarize(samples, method, min(warmup_calls, max_samples) + 6, flush_l2=flush_l2,
                     graph_reps=graph_reps)


def _capture_graph(fn, reps: int) -> Callable[[], None]:
    """Capture `reps` back-to-back calls of fn into one CUDA graph; return its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                 # warm up on a side stream, as capture requires
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return graph.replay


def count_kernels(fn: Callable[[], object], device: torch.device) -> int | None:
    """GPU kernels one call of `fn` launches, counted by torch.profiler after a warm-up call (so
    compilation and one-time work stay out); None where the profiler cannot see the device: the
    count is optional, a missing profiler must not stop the work it describes."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
        fn()
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA) or None
    except Exception:
        return None
