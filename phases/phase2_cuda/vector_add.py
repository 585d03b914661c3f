"""Exercise 2.1: vector add in CUDA C, the seed's first kernel, against a plain copy in the same run.

    lab run phase2.vector_add [--param sizes=[1048576,268435456]]

`vector_add.cu`: one thread per element, `c[i] = a[i] + b[i]`, with the seed's launch for 1M elements
(4096 blocks x 256 threads) and a tail guard `i < n` so any n works (checked at n = 1,000,003, where
the last block is partly empty, before anything is timed). An fp32 add has one right answer, so the
check is bit-for-bit equality with torch, over the whole output, both ends included.

Per element: read a, read b, write c (12 bytes) for 1 FLOP, intensity 1/12 FLOP/byte: the roofline
says time = 12 n / bandwidth. At 1M elements (12 MiB moved) the working set fits in the H200's L2
and launch overhead is a large part of the time; at 2^28 elements (3 GiB moved) every byte comes
from HBM. The `copy` row (torch copy, 8 bytes per element) at the same size is the practical
ceiling; the CUDA rows report their bandwidth as a percentage of it.

Two kernels: `cuda` is the seed's (one float per thread); `cuda_vec4` loads and stores one float4
(16 bytes) per thread, a quarter of the memory instructions for the same bytes and more bytes in
flight per thread, which is what a memory-bound kernel needs far beyond L2. It needs 16-byte
aligned tensors (refused with a ValueError otherwise) and handles the n % 4 tail with scalars.
"""
import ctypes

import torch

from common.checks import exact, poison
from common.exercise import Exercise, Needs, measure
from common.params import Int

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


def run(ctx, params):
    # The irregular size first: the tail guard is checked before any size is timed.
    a, b = inputs(params["irregular_n"], ctx.device)
    irregular = {v: check_add(a, b, torch.empty_like(a), v) for v in LAUNCHERS if ctx.wants(v)}
    del a, b
    rows = []
    for n in ctx.track(params["sizes"], "vector add sizes"):
        a, b = inputs(n, ctx.device)
        out = torch.empty_like(a)
        size = {"n": n, "dtype": "fp32", "working_set_bytes": 3 * n * 4, "threads": THREADS}
        # In L2 a call is a few microseconds of GPU work, less than the Python wrapper's own time:
        # timed call by call the GPU would idle between the events. Such sizes (every row, the
        # copy too) are timed as a CUDA-graph replay of GRAPH_REPS calls: device time only.
        timing = {"graph_reps": GRAPH_REPS} if n <= params["graph_below_n"] else None
        here = []

        def check_copy():
            poison(out); out.copy_(a); ctx.synchronize()
            return exact(out, a, "the source tensor")

        if ctx.wants("copy"):
            here.append(measure(ctx, "copy", size, fn=lambda: out.copy_(a), check=check_copy,
                                flops=0, bytes_moved=2 * n * 4, dtype=None, timing=timing))
        for v in LAUNCHERS:
            if not ctx.wants(v):
                continue

            def check(v=v):
                if not irregular[v]["passed"]:
                    return {**irregular[v], "reason": f"at n = {params['irregular_n']}: {irregular[v]['reason']}"}
                return check_add(a, b, out, v)

            here.append(measure(ctx, v, size, fn=lambda v=v: add(a, b, out, variant=v), check=check,
                                flops=n, bytes_moved=3 * n * 4, dtype="fp32", timing=timing))
        copy_row = next((r for r in here if r["variant"] == "copy" and r["status"] == "ok"), None)
        for r in here:
            if r["variant"] != "copy" and r["status"] == "ok" and copy_row:
                r["metrics"]["copy_gbps_same_run"] = copy_row["metrics"]["gbps"]
                r["metrics"]["pct_of_copy_bandwidth"] = 100 * r["metrics"]["gbps"] / copy_row["metrics"]["gbps"]
        rows += here
        del a, b, out
    _, b_ = build.load(SOURCE, SIGNATURES)
    summary = {"irregular_n": params["irregular_n"], "irregular_checks": irregular,
               "build": {"arch": b_.arch, "flags": list(b_.flags), "resources": b_.resources}}
    if ctx.is_cuda:
        summary["l2_bytes"] = getattr(torch.cuda.get_device_properties(ctx.device), "L2_cache_size", None)
    return rows, summary


EXERCISE = Exercise(
    id="phase2.vector_add", title="CUDA vector add: the seed's 1M elements (4096 x 256) and 2^28, vs copy",
    run=run, needs=Needs(cuda=True, tools=("nvcc",)),
    params={"sizes": Int([2**20, 2**28], min=1, unit="fp32 elements", many=True),
            "irregular_n": Int(IRREGULAR_N, min=1, unit="fp32 elements (checked, not timed)"),
            "graph_below_n": Int(2**22, min=0, unit="elements; sizes up to this are timed as CUDA-graph replays")},
    cpu_params={}, quick_params={"sizes": [2**20], "irregular_n": 100_003},
    variants=("copy", *LAUNCHERS), footprint_bytes=footprint_bytes)
