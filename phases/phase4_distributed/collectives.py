"""The arithmetic of collectives, nccl-tests' way, and the helpers every rank uses to check and time them.

Sizes are nccl-tests' `size`: the buffer each rank holds (all_reduce, send/recv), the gathered
output (all_gather), the input (reduce_scatter). algbw = size / time; busbw = algbw x factor, with
factor 2(n-1)/n for all_reduce, (n-1)/n for all_gather and reduce_scatter, 1 for send/recv: a ring
all-reduce puts 2(n-1)/n x S bytes on every rank's link, so busbw is the link's rate, comparable
across n, and the roofline's time is wire bytes / link bandwidth.
Correctness is nccl-tests' #wrong: inputs are small integers stored as fp32 (pattern()), so every
sum of up to 8 ranks is exact in any order, the expected output is computed locally, and
count_wrong() counts the elements that differ (outputs are poisoned first: NaN counts as wrong).
"""
import statistics
import time

import torch

from common.params import Int

# one formula, torch-free: the report's alpha-beta model (calibration.py) uses it too
from .calibration import busbw_factor

OPS = ("all_reduce", "all_gather", "reduce_scatter", "sendrecv")
CHUNK_ELEMENTS = 1 << 26            # checks walk big tensors 64 Mi elements (256 MiB of fp32) at a time
# pattern() and pattern_sum() hold ~40 bytes of int64 and fp32 temporaries per element of one chunk:
# about 10 bytes of scratch per byte checked, up to one chunk (2.5 GiB at 256 MiB and above)
CHECK_SCRATCH_PER_BYTE = 10


def check_scratch_bytes(size_bytes: int) -> int:
    """Device memory fill_pattern / count_wrong hold at once while checking a buffer of size_bytes."""
    return CHECK_SCRATCH_PER_BYTE * min(int(size_bytes), CHUNK_ELEMENTS * 4)


def timing_params(warmup: int, min_iters: int, max_iters: int, iter_bytes: int) -> dict:
    """The declared parameters of iterations(): warm-up calls, then iter_bytes / size timed calls
    clamped to [min_iters, max_iters]."""
    return {"warmup_iters": Int(warmup, min=0, unit="calls"),
            "min_iters": Int(min_iters, min=1, unit="calls"),
            "max_iters": Int(max_iters, min=1, unit="calls"),
            "iter_bytes": Int(iter_bytes, min=1, unit="bytes", help="timed calls = iter_bytes / size, clamped")}


# ------------------------------------------------------------------------------ bandwidth arithmetic
def algbw_gbps(size_bytes: float, ms: float) -> float:
    return size_bytes / (ms * 1e6)


def busbw_gbps(op: str, size_bytes: float, ms: float, n: int) -> float:
    return algbw_gbps(size_bytes, ms) * busbw_factor(op, n)


def wire_bytes(op: str, size_bytes: float, n: int) -> float:
    """Bytes each rank must send over its link (and receive): factor x size. The roofline's byte count."""
    return busbw_factor(op, n) * size_bytes


def elements_for(op: str, size_bytes: int, n: int, itemsize: int = 4) -> tuple[int, int]:
    """(elements in the size_bytes buffer, elements per rank's share): sizes round down to a multiple
    of n elements for all_gather / reduce_scatter, so every rank's share is equal."""
    numel = size_bytes // itemsize
    if op in ("all_gather", "reduce_scatter"):
        per_rank = numel // n
        return per_rank * n, per_rank
    return numel, numel


def measured_size(op: str, size_bytes: int, n: int) -> int:
    """The size a row records for nccl-tests size `size_bytes`: whole fp32 elements, a multiple of n
    of them for all_gather / reduce_scatter."""
    return elements_for(op, size_bytes, n)[0] * 4


def collective_work(op: str, size_bytes: int, n: int, label: str | None = None):
    """A timed collective row's roofline inputs: no FLOPs counted (the adds of a reduction are
    never the limit), bytes = the bytes each rank's link carries (wire_bytes of the measured size).
    The bandwidth that bounds them is the link's, not HBM's (launch.link_roofs)."""
    from common.exercise import Work
    size = measured_size(op, size_bytes, n)
    return Work(label or f"{op} {size} B on {n} ranks (bytes on each rank's link)", 0, wire_bytes(op, size, n), None)


# ------------------------------------------------------------------------------ data and #wrong
def pattern(start: int, stop: int, rank: int, device) -> torch.Tensor:
    """Rank `rank`'s input at flat positions [start, stop): integers in [-30, 30] as fp32."""
    i = torch.arange(start, stop, device=device, dtype=torch.int64)
    return (((i % 31) * 7 + (i % 29) * 3 + 13 * rank) % 61 - 30).to(torch.float32)


def fill_pattern(t: torch.Tensor, rank: int, offset: int = 0) -> torch.Tensor:
    flat = t.view(-1)
    for s in range(0, flat.numel(), CHUNK_ELEMENTS):
        e = min(s + CHUNK_ELEMENTS, flat.numel())
        flat[s:e] = pattern(offset + s, offset + e, rank, t.device)
    return t


def pattern_sum(start: int, stop: int, n: int, device) -> torch.Tensor:
    """The all-reduce (sum over n ranks) of pattern() at [start, stop): exact in fp32."""
    out = pattern(start, stop, 0, device)
    for r in range(1, n):
        out += pattern(start, stop, r, device)
    return out


def count_wrong(out: torch.Tensor, expected, offset: int = 0) -> int:
    """Elements of `out` that differ from expected(start, stop) (positions offset+start ...); NaN is wrong."""
    flat = out.reshape(-1)
    wrong = torch.zeros((), dtype=torch.int64, device=out.device)
    for s in range(0, flat.numel(), CHUNK_ELEMENTS):
        e = min(s + CHUNK_ELEMENTS, flat.numel())
        wrong += (flat[s:e] != expected(offset + s, offset + e)).sum()
    return int(wrong)


# ------------------------------------------------------------------------------ timing on every rank
def iterations(size_bytes: int, params: dict) -> tuple[int, int]:
    """(warmup, timed) iteration counts: the same on every rank (a rank that ran one call more than
    its peers would wait forever), fewer for big buffers: timed = clamp(iter_bytes / size)."""
    timed = int(min(params["max_iters"], max(params["min_iters"], params["iter_bytes"] // max(size_bytes, 1))))
    return params["warmup_iters"], timed


def time_calls(fn, warmup: int, iters: int, device: torch.device) -> list[float]:
    """Per-call milliseconds of `fn` on this rank: CUDA events around each call on a GPU (calls run
    back to back, so a collective's time includes waiting for the slowest peer, as it should),
    perf_counter around each blocking call on a CPU."""
    return time_interleaved({"call": fn}, warmup, iters, device)["call"]


def time_interleaved(fns: dict, warmup: int, iters: int, device: torch.device,
                     idle_start: bool = False, host: dict | None = None, line_up=None) -> dict[str, list[float]]:
    """Per-call milliseconds of each of `fns`, timed as time_calls times one function but taken in
    turn (a, b, c, a, b, c, ...): a slow spell of the machine (a clock dip, a neighbour) then lands
    on all of them alike, where timing each in its own block lets it bias whichever block it hit,
    and a ratio of two such blocks with it.
    idle_start: wait for the GPU to drain before each call, so every call starts from the same
    state. Without it a call that leaves the CPU behind the GPU (many small launches) hands the
    next one a GPU that idles while the CPU catches up, and that time lands on the wrong function.
    host: if given, filled with each function's host milliseconds per call on GPUs (the time the
    CPU took to enqueue it, as the function returns before its kernels finish): a call whose host
    time approaches its GPU time is bound by the CPU, not by the GPU.
    line_up: called before each timed call (after the idle wait), to start every rank's call at
    the same moment: a collective step is timed on each rank from its own start to the common
    end, so a rank that starts early is billed the others' lateness."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = {k: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(iters)] for k in fns}
        for i in range(iters):
            for k, fn in fns.items():
                if idle_start:
                    torch.cuda.synchronize(device)
                if line_up is not None:
                    line_up()
                events[k][i][0].record()
                t0 = time.perf_counter()
                fn()
                if host is not None:
                    host.setdefault(k, []).append((time.perf_counter() - t0) * 1e3)
                events[k][i][1].record()
        torch.cuda.synchronize(device)
        return {k: [s.elapsed_time(e) for s, e in events[k]] for k in fns}
    out: dict = {k: [] for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            if line_up is not None:
                line_up()
            t0 = time.perf_counter()
            fn()
            out[k].append((time.perf_counter() - t0) * 1e3)
    return out


def slowest_rank(per_rank_samples: list[list[float]]) -> dict:
    """A collective is as slow as its slowest rank: the rank with the largest median, its samples,
    and every rank's median."""
    medians = [statistics.median(s) for s in per_rank_samples]
    k = max(range(len(medians)), key=medians.__getitem__)
    return {"slowest_rank": k, "samples_ms": per_rank_samples[k], "per_rank_median_ms": medians}


# ------------------------------------------------------------------------------ NCCL's algorithm choice
def parse_nccl_tuning(lines) -> dict:
    """NCCL_DEBUG=INFO with NCCL_DEBUG_SUBSYS=TUNING makes rank 0 log one line per collective, e.g.
    'NCCL INFO AllReduce: 1048576 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..31}'.
    Returns {(func, bytes): {"algo", "proto", "channels"}}; the last line for a key wins."""
    import re
    pat = re.compile(r"NCCL INFO (AllReduce|AllGather|ReduceScatter|Broadcast|Reduce)\w*: (\d+) Bytes -> "
                     r"Algo (\w+) proto (\w+)(?: channel\{Lo\.\.Hi\}=\{(\d+)\.\.(\d+)\})?")
    found = {}
    for line in lines:
        m = pat.search(line)
        if m:
            lo, hi = m.group(5), m.group(6)
            found[(m.group(1), int(m.group(2)))] = {
                "algo": m.group(3).upper(), "proto": m.group(4).upper(),
                "channels": int(hi) - int(lo) + 1 if lo is not None else None}
    return found


NCCL_FUNC = {"all_reduce": "AllReduce", "all_gather": "AllGather", "reduce_scatter": "ReduceScatter"}


def nccl_log_key(op: str, size_bytes: int, n: int) -> tuple[str, int] | None:
    """The (func, bytes) under which NCCL logs `op` at nccl-tests size `size_bytes`: NCCL counts the
    per-rank count for all_gather (send count) and reduce_scatter (receive count)."""
    if op not in NCCL_FUNC:
        return None
    numel, per_rank = elements_for(op, size_bytes, n)
    return NCCL_FUNC[op], (numel if op == "all_reduce" else per_rank) * 4


# ------------------------------------------------------------------------------ rows (in the lab process)
def timing_method(backend: str) -> str:
    per_call = ("CUDA events around each call, calls back to back" if backend == "nccl"
                else "perf_counter around each blocking call")
    return f"{per_call}; the slowest rank's samples (max over ranks of each rank's median)"


def wrong_check(wrong: int, elements: int) -> dict:
    """nccl-tests' #wrong as a check block: every element compared with its exact expected value."""
    return {"reference": "expected values computed locally from the integer-valued inputs (nccl-tests' #wrong)",
            "metric": "exact", "precision": "fp32", "tolerance": 0.0, "rel_l2_error": None,
            "max_abs_error": None, "wrong_elements": wrong, "checked_elements": elements,
            "passed": wrong == 0, "reason": None if wrong == 0 else f"#wrong = {wrong} of {elements} elements"}


def collective_row(variant: str, op: str, params: dict, n: int, meas: dict, roofs, method: str) -> dict:
    """One row from one rank-0 measurement: #wrong gates the timing; then time, algbw, busbw, % of
    the link, and the link roofline's prediction (bytes on the wire per rank / link bandwidth).
    meas: size_bytes, wrong, elements, and (when timed) warmup and per_rank_samples_ms."""
    from common import roofline
    from common.exercise import row
    from common.timing import summarize

    check = wrong_check(meas["wrong"], meas["elements"])
    if not check["passed"]:
        return row(variant, params, "failed", check["reason"], check=check, metrics={"wrong": meas["wrong"]})
    size = meas["size_bytes"]
    slow = slowest_rank(meas["per_rank_samples_ms"])
    t = summarize(slow["samples_ms"], method, meas["warmup"], flush_l2=False)
    ms, wire = t.median_ms, wire_bytes(op, size, n)
    busbw = busbw_gbps(op, size, ms, n)
    metrics = {"ms": ms, "algbw_gbps": algbw_gbps(size, ms), "busbw_gbps": busbw,
               "busbw_factor": busbw_factor(op, n), "wire_bytes_per_rank": wire,
               "link_gbps": roofs.bandwidth_gbps, "link_source": roofs.bandwidth_source or roofs.source,
               "pct_of_link": 100 * busbw / roofs.bandwidth_gbps,
               "best_ms": t.min_ms, "best_busbw_gbps": busbw_gbps(op, size, t.min_ms, n),
               "wrong": 0, "slowest_rank": slow["slowest_rank"], "per_rank_median_ms": slow["per_rank_median_ms"]}
    return row(variant, params, "ok", None, check=check, timing=t, metrics=metrics,
               prediction=roofline.predict(0, wire, roofs, None, ms))
