"""Exercise 2.1: vector add in CUDA C, the seed's first kernel, against a plain copy in the same run.

    lab run phase2.vector_add [--param sizes=[1048576,268435456]]
    python -m phases.phase2_cuda.vector_add      # alone: an irregular n, a small timing table

`vector_add.cu`: c[i] = a[i] + b[i], one thread per element with the seed's launch for 1M elements
(4096 blocks x 256 threads) and a tail guard `i < n`, checked at an n whose last block is partly
empty before anything is timed. An fp32 add has one right answer, so the check is bit-for-bit.
12 bytes per FLOP: the roofline says time = 12 n / bandwidth. The `copy` row (torch copy of the same
n) is the practical ceiling; each kernel's `pct_of_copy_bandwidth` is its GB/s over the copy's.
`cuda_vec4` moves the same bytes as one float4 per thread: a quarter of the memory instructions and
more bytes in flight per thread, what a memory-bound kernel needs far beyond L2. It needs 16-byte
aligned tensors (refused otherwise) and handles the n % 4 tail with scalars.
"""
import ctypes

import torch

from common.checks import exact, poison
from common.exercise import (
    Exercise,
    Needs,
    Result,
    Work,
    against_baseline,
    measure,
    reference_check,
)
from common.params import Int
from common.standalone import run_alone

from . import build
from ._args import need_contiguous, need_dtype

SOURCE = "vector_add.cu"
_SIG = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
LAUNCHERS = {"cuda": "launch_vector_add",             # the seed's kernel: one float per thread
             "cuda_vec4": "launch_vector_add_vec4"}   # one float4 per thread (16-byte accesses)
SIGNATURES = {name: _SIG for name in LAUNCHERS.values()}
THREADS = 256                    # the seed's block size: 1M elements -> 4096 blocks
GRAPH_REPS = 20                  # calls per CUDA-graph replay for sizes that fit in L2
IRREGULAR_N = 1_000_003          # not a multiple of 256: the last block is partly empty


def add(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, threads: int = THREADS,
        variant: str = "cuda") -> torch.Tensor:
    """out = a + b for contiguous fp32 vectors of one shape, on one CUDA device."""
    if variant not in LAUNCHERS:
        raise ValueError(f"unknown vector add variant '{variant}'; choose from {', '.join(LAUNCHERS)}")
    for name, t in (("a", a), ("b", b)) + ((("out", out),) if out is not None else ()):
        need_dtype(name, t, torch.float32)
        need_contiguous(name, t)
    if a.shape != b.shape or (out is not None and out.shape != a.shape):
        raise ValueError(f"shapes differ: a {tuple(a.shape)}, b {tuple(b.shape)}"
                         + (f", out {tuple(out.shape)}" if out is not None else ""))
    if threads not in (32, 64, 128, 256, 512, 1024):
        raise ValueError(f"threads per block must be a power of two from 32 to 1024, got {threads}")
    out = torch.empty_like(a) if out is None else out
    if variant == "cuda_vec4" and any(t.data_ptr() % 16 for t in (a, b, out)):
        raise ValueError("cuda_vec4 loads 16 bytes at a time: a, b and out must start 16-byte aligned")
    build.require_gpu(a, b, out)
    n = a.numel()
    if (n + threads - 1) // threads > build.INT32_MAX_GRID:
        raise ValueError(f"n = {n} needs more than 2^31-1 blocks of {threads}")
    lib, _ = build.load(SOURCE, SIGNATURES)
    with torch.cuda.device(a.device):
        code = getattr(lib, LAUNCHERS[variant])(build.ptr(a), build.ptr(b), build.ptr(out), n, threads,
                                                 build.stream(a.device))
    build.check(lib, code, f"vector_add {variant} launch")
    return out


def check_add(a, b, out, variant: str = "cuda") -> dict:
    poison(out)
    add(a, b, out, variant=variant)
    torch.cuda.synchronize(out.device)
    return exact(out, a + b, "torch a + b of the same inputs")


def inputs(n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(n)
    return (torch.randn(n, device=device, generator=g), torch.randn(n, device=device, generator=g))


def footprint_bytes(p: dict) -> int:
    """a, b, out and the check's torch a + b reference (fp32) at the largest of the sizes and irregular_n."""
    return 4 * 4 * max(*p["sizes"], p["irregular_n"])


# ------------------------------------------------------------------------------ the counts
def graph_reps(n: int, params: dict) -> int | None:
    """In L2 a call is a few microseconds of GPU work, less than the Python wrapper's own time: timed
    call by call the GPU would idle between the events. Sizes up to `graph_below_n` (every row, the
    copy too) are timed as a CUDA-graph replay of GRAPH_REPS calls: device time only."""
    return GRAPH_REPS if n <= params["graph_below_n"] else None


def copy_work(n: int, reps: int | None = None) -> Work:
    """out = a (torch copy, one kernel): no FLOPs; read a, write out: 2 fp32 arrays, 8 n bytes."""
    return Work(f"copy n={n}", 0, 2 * 4 * n, None, working_set_bytes=2 * 4 * n, graph_reps=reps, launches=1)


def add_work(variant: str, n: int, reps: int | None = None) -> Work:
    """c = a + b (one kernel, either launcher): 1 FLOP per element; read a and b, write c: 3 fp32
    arrays, 12 n bytes."""
    return Work(f"{variant} n={n}", n, 3 * 4 * n, "fp32", working_set_bytes=3 * 4 * n, graph_reps=reps, launches=1)


def work(params) -> list[Work]:
    """Every row run() times with these parameters, in its order: per size the copy, then each kernel."""
    return [w for n in params["sizes"] for w in (copy_work(n, graph_reps(n, params)),
                                                *(add_work(v, n, graph_reps(n, params)) for v in LAUNCHERS))]


def _measure(ctx, variant: str, w: Work, n: int, fn, check, timing) -> dict:
    """measure() with the row's counts taken from its Work (the one formula work() lists)."""
    return measure(ctx, variant, {"n": n, "dtype": "fp32", "working_set_bytes": w.working_set_bytes, "threads": THREADS},
                   fn=fn, check=check, flops=w.flops, bytes_moved=w.bytes, dtype=w.dtype, timing=timing,
                   launches=w.launches)


# ------------------------------------------------------------------------------ the exercise
def one_size(ctx, n: int, irregular: dict, params: dict) -> list[dict]:
    """The copy, then each kernel, at n elements; every kernel's GB/s against the copy's."""
    a, b = inputs(n, ctx.device)
    out, expected = torch.empty_like(a), a + b
    reps = graph_reps(n, params)
    timing = {"graph_reps": reps} if reps else None
    here = []
    if ctx.wants("copy"):
        def copy():
            out.copy_(a)

        here.append(_measure(ctx, "copy", copy_work(n, reps), n, copy,
                             reference_check(ctx, out, copy, a, "the source tensor"), timing))
    for v in LAUNCHERS:
        if not ctx.wants(v):
            continue

        def fn(v=v):
            add(a, b, out, variant=v)

        check = reference_check(ctx, out, fn, expected, "torch a + b of the same inputs")
        if not irregular[v]["passed"]:                 # failed at the irregular n: that failure, not a timing
            check = _failed(irregular[v], f"n = {params['irregular_n']}")
        here.append(_measure(ctx, v, add_work(v, n, reps), n, fn, check, timing))
    copy_row = next((r for r in here if r["variant"] == "copy"), None)
    return against_baseline(here, copy_row, "gbps", "pct_of_copy_bandwidth")


def _failed(verdict: dict, where: str):
    return lambda: {**verdict, "reason": f"at {where}: {verdict['reason']}"}


def run(ctx, params):
    # The irregular size first: the tail guard is checked before any size is timed.
    a, b = inputs(params["irregular_n"], ctx.device)
    irregular = {v: check_add(a, b, torch.empty_like(a), v) for v in LAUNCHERS if ctx.wants(v)}
    del a, b
    rows = []
    for n in ctx.track(params["sizes"], "vector add sizes"):
        rows += one_size(ctx, n, irregular, params)
    _, b_ = build.load(SOURCE, SIGNATURES)
    summary = {"irregular_n": params["irregular_n"], "irregular_checks": irregular,
               "build": {"arch": b_.arch, "flags": list(b_.flags), "resources": b_.resources}}
    if ctx.is_cuda:
        summary["l2_bytes"] = getattr(torch.cuda.get_device_properties(ctx.device), "L2_cache_size", None)
    return Result(rows, summary)


EXERCISE = Exercise(
    id="phase2.vector_add", title="CUDA vector add: the seed's 1M elements (4096 x 256) and 2^28, vs copy",
    run=run, needs=Needs(cuda=True, nvidia=True, tools=("nvcc",)),
    params={"sizes": Int([2**20, 2**28], min=1, unit="fp32 elements", many=True),
            "irregular_n": Int(IRREGULAR_N, min=1, unit="fp32 elements (checked, not timed)"),
            "graph_below_n": Int(2**22, min=0, unit="elements; sizes up to this are timed as CUDA-graph replays")},
    cpu_params={}, quick_params={"sizes": [2**20], "irregular_n": 100_003},
    variants=("copy", *LAUNCHERS), footprint_bytes=footprint_bytes, work=work)


if __name__ == "__main__":
    run_alone(EXERCISE, {"sizes": [1_000_003], "irregular_n": 100_003})
