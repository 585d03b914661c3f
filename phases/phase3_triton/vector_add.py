"""Exercise 3.1: vector add, the smallest whole Triton kernel, and a bandwidth sweep against PyTorch.

    lab run phase3.vector_add [--param sizes=[98432,268435456]]

A Triton kernel is written for one *program*: a block of BLOCK elements, not one thread. The
compiler spreads the block over the program's warps and vectorizes the loads; we only say which
elements the program owns (`pid * BLOCK + arange(BLOCK)`) and mask the ones past the end.

Bytes and FLOPs, per element: read x, read y, write out (3 x 4 bytes in fp32) for 1 FLOP, an
intensity of 1/12 FLOP/byte, hundreds of times left of any GPU's ridge point. So the roofline says
time = 12 n / bandwidth and the add is free; the only question is how close a kernel gets to the
bandwidth a plain copy (8 bytes per element, no FLOPs) reaches in the same run.

Sizes: the seed's 98,432 elements first (not a multiple of any block size, so the last program is
partly empty and the mask is what keeps it inside the arrays), then powers of two from 64 Ki
elements (768 KiB, inside L2) to 256 Mi elements (3 GiB moved per call, dozens of L2s).
"""
import torch

from common.checks import exact, poison
from common.exercise import Exercise, Needs, measure, measure_copy_gbps
from common.params import Int

from ._support import (attempt, compare_to_copy, compare_to_library, interpreting, label, launch_options,
                       require, tl, triton, tune, tuning_summary)


# ------------------------------------------------------------------------------ the kernel
@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)           # int64: 2^31 elements and more stay addressable
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n                               # the last program may run past the end
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)


CONFIGS = [{"BLOCK": 1024, "num_warps": 4}, {"BLOCK": 2048, "num_warps": 8},
           {"BLOCK": 4096, "num_warps": 8}]
INTERPRETER_CONFIG = {"BLOCK": 1024, "num_warps": 4}


def add(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None = None, config: dict | None = None):
    """out = x + y for contiguous vectors of the same shape and dtype."""
    require(x, y)
    assert x.shape == y.shape and x.dtype == y.dtype and x.is_contiguous() and y.is_contiguous()
    out = torch.empty_like(x) if out is None else out
    cfg = config or (INTERPRETER_CONFIG if interpreting() else CONFIGS[-1])
    n = x.numel()
    grid = (triton.cdiv(n, cfg["BLOCK"]),)
    add_kernel[grid](x, y, out, n, BLOCK=cfg["BLOCK"], **launch_options(cfg))
    return out


# ------------------------------------------------------------------------------ reference and check
def check_add(impl, x, y, out) -> dict:
    """Poison the output, run `impl(x, y, out)`, and demand bit-for-bit equality with torch:
    an fp32 add has one right answer."""
    poison(out)
    impl(x, y, out)
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    return exact(out, x + y, "torch x + y of the same inputs")


def bytes_moved(n: int, itemsize: int = 4) -> int:
    return 3 * n * itemsize                       # read x, read y, write out


# ------------------------------------------------------------------------------ the exercise
def footprint_bytes(p: dict) -> int:
    """x, y, out and the check's x + y (fp32) at the largest size; or the last size's three with the large copy."""
    copy = 2 * p["copy_bytes"] if p["copy_bytes"] else 0           # its source and destination
    return max(4 * 4 * max(p["sizes"]), 3 * 4 * p["sizes"][-1] + copy)


def run(ctx, params):
    rows, tuning = [], {}
    for n in ctx.track(params["sizes"], "vector add sizes"):
        g = torch.Generator(device=ctx.device).manual_seed(n)
        x = torch.randn(n, device=ctx.device, generator=g)
        y = torch.randn(n, device=ctx.device, generator=g)
        out = torch.empty_like(x)
        size = {"n": n, "dtype": "fp32", "working_set_bytes": bytes_moved(n)}
        here = []

        def check_copy():
            poison(out); out.copy_(x); ctx.synchronize()
            return exact(out, x, "the source tensor")

        if ctx.wants("copy"):                     # the ceiling: 8 bytes per element, no FLOPs
            here.append(measure(ctx, "copy", size, fn=lambda: out.copy_(x), check=check_copy,
                                flops=0, bytes_moved=2 * n * 4, dtype=None))
        if ctx.wants("torch"):
            here.append(measure(ctx, "torch", size, fn=lambda: torch.add(x, y, out=out),
                                check=lambda: check_add(lambda a, b, o: torch.add(a, b, out=o), x, y, out),
                                flops=n, bytes_moved=bytes_moved(n), dtype="fp32"))
        def triton_row():
            candidates = [INTERPRETER_CONFIG] if interpreting() else CONFIGS
            cfg, trials = tune(ctx, ("add", n, ctx.device.type), candidates,
                               launch=lambda c: add(x, y, out, c),
                               check=lambda c: check_add(lambda a, b, o: add(a, b, o, c), x, y, out))
            tuning[str(n)] = tuning_summary(trials)
            r = measure(ctx, "triton", size, fn=lambda: add(x, y, out, cfg),
                        check=lambda: check_add(lambda a, b, o: add(a, b, o, cfg), x, y, out),
                        flops=n, bytes_moved=bytes_moved(n), dtype="fp32")
            r["metrics"]["config"] = label(cfg)
            return r

        if ctx.wants("triton"):
            here.append(attempt("triton", size, triton_row))

        copy_row = next((r for r in here if r["variant"] == "copy" and r["status"] == "ok"), None)
        for r in here:
            r["metrics"]["bytes_formula"] = ("2·n·4 (read x, write out)" if r["variant"] == "copy"
                                             else "3·n·4 (read x, read y, write out)")
        compare_to_copy([r for r in here if r["variant"] != "copy"],
                        copy_row["metrics"]["gbps"] if copy_row else None)
        compare_to_library(here, "triton", ("torch",))
        rows += here
    summary = {"tuning": tuning}
    if ctx.is_cuda and params.get("copy_bytes"):
        summary["copy_gbps_large"] = measure_copy_gbps(ctx, params["copy_bytes"])
        summary["copy_bytes_large"] = params["copy_bytes"]
    if ctx.is_cuda:
        summary["l2_bytes"] = getattr(torch.cuda.get_device_properties(ctx.device), "L2_cache_size", None)
    return rows, summary


EXERCISE = Exercise(
    id="phase3.vector_add", title="Triton vector add: the seed's 98,432-element case and a bandwidth sweep",
    run=run, needs=Needs(cuda=True, modules=("triton",)),
    params={"sizes": Int([98432, 2**16, 2**18, 2**20, 2**22, 2**24, 2**26, 2**28], min=1, unit="fp32 elements",
                         many=True),
            "copy_bytes": Int(2**31, min=2**20, nullable=True,
                              unit="bytes per buffer of the summary's large copy (null: none; GPU only)")},
    cpu_params={"sizes": [98432, 2**20], "copy_bytes": None},
    quick_params={"sizes": [98432, 100003], "copy_bytes": None},
    variants=("copy", "torch", "triton"), footprint_bytes=footprint_bytes)
