"""Exercise 3.1: vector add, the smallest whole Triton kernel, and a bandwidth sweep against PyTorch.

    lab run phase3.vector_add [--param sizes=[98432,268435456]]

A Triton kernel is written for one *program*: a block of BLOCK elements, not one thread. The
compiler spreads the block over the program's warps and vectorizes the loads; we only say which
elements the program owns (`pid * BLOCK + arange(BLOCK)`) and mask the ones past the end.

Per element: read x, read y, write out (12 bytes in fp32) for 1 FLOP, 1/12 FLOP/byte, far left of
any GPU's ridge. The roofline says time = 12 n / bandwidth, so the question is how close a kernel
gets to a plain copy (8 bytes per element) of the same size in the same run. Sizes: the seed's
98,432 elements (not a multiple of any block, so the mask matters), then powers of two from
768 KiB per call (inside L2) to 3 GiB (dozens of L2s).
"""
import torch

from common.exercise import (
    Exercise,
    Needs,
    Result,
    Work,
    against_baseline,
    measure,
    measure_copy_gbps,
    reference_check,
)
from common.params import Int
from common.standalone import run_alone
from common.triton_shim import interpreting, require, tl, triton
from common.triton_tuner import label, launch_options, tune, tuning_summary
from common.variant_rows import attempt, compare_to_library

from . import analysis, counts


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
REFERENCE = "torch x + y of the same inputs"          # an fp32 add has one right answer: checked bit for bit


def bytes_moved(n: int) -> int:
    """The add's bytes, which is also each size's working set: read x, read y, write out."""
    return counts.add_count(n).bytes


def work(params) -> list[Work]:
    """Every row run() times: per size the copy, torch.add and the Triton kernel (counts.py)."""
    out = []
    for n in params["sizes"]:
        for variant in ("copy", "torch", "triton"):
            c = counts.copy_count(n) if variant == "copy" else counts.add_count(n)
            out.append(Work(f"{variant} n={n}", c.flops, c.bytes, c.dtype, working_set_bytes=bytes_moved(n),
                            launches=c.launches))
    return out


# ------------------------------------------------------------------------------ the exercise
def footprint_bytes(p: dict) -> int:
    """x, y, out and the check's x + y (fp32) at the largest size; or the last size's three with the large copy."""
    copy = 2 * p["copy_bytes"] if p["copy_bytes"] else 0           # its source and destination
    return max(4 * 4 * max(p["sizes"]), 3 * 4 * p["sizes"][-1] + copy)


def run(ctx, params):
    rows, tuning = [], {}
    l2_bytes = getattr(torch.cuda.get_device_properties(ctx.device), "L2_cache_size", None) if ctx.is_cuda else None
    for n in ctx.track(params["sizes"], "vector add sizes"):
        g = torch.Generator(device=ctx.device).manual_seed(n)
        x = torch.randn(n, device=ctx.device, generator=g)
        y = torch.randn(n, device=ctx.device, generator=g)
        out = torch.empty_like(x)
        ref = x + y
        size = {"n": n, "dtype": "fp32", "working_set_bytes": bytes_moved(n)}
        here = []

        def check(fill):
            return reference_check(ctx, out, fill, ref, REFERENCE)

        copy_cost, add_cost = counts.copy_count(n), counts.add_count(n)
        cost = {"flops": add_cost.flops, "bytes_moved": add_cost.bytes, "dtype": add_cost.dtype,
                "launches": add_cost.launches}
        if ctx.wants("copy"):                     # the ceiling: 8 bytes per element, no FLOPs
            here.append(measure(ctx, "copy", size, fn=lambda: out.copy_(x),
                                check=reference_check(ctx, out, lambda: out.copy_(x), x, "the source tensor"),
                                flops=copy_cost.flops, bytes_moved=copy_cost.bytes, dtype=copy_cost.dtype,
                                launches=copy_cost.launches))
        if ctx.wants("torch"):
            here.append(measure(ctx, "torch", size, fn=lambda: torch.add(x, y, out=out),
                                check=check(lambda: torch.add(x, y, out=out)), **cost))

        def triton_row():
            candidates = [INTERPRETER_CONFIG] if interpreting() else CONFIGS
            cfg, trials = tune(ctx, ("add", n, ctx.device.type), candidates,
                               launch=lambda c: add(x, y, out, c), check=lambda c: check(lambda: add(x, y, out, c))())
            tuning[str(n)] = tuning_summary(trials)
            r = measure(ctx, "triton", size, fn=lambda: add(x, y, out, cfg), check=check(lambda: add(x, y, out, cfg)),
                        **cost)
            r["metrics"]["config"] = label(cfg)
            return r

        if ctx.wants("triton"):
            here.append(attempt("triton", size, triton_row))
        for r in here:
            r["metrics"]["bytes_formula"] = ("2·n·4 (read x, write out)" if r["variant"] == "copy"
                                             else "3·n·4 (read x, read y, write out)")
            r["metrics"]["far_beyond_l2"] = analysis.far_beyond_l2(size["working_set_bytes"], l2_bytes)
        copy_row = next((r for r in here if r["variant"] == "copy"), None)
        against_baseline(here, copy_row, "gbps", "pct_of_copy_bandwidth")
        compare_to_library(here, "triton", ("torch",), "gbps")
        rows += here
    summary = {"tuning": tuning, "l2_bytes": l2_bytes}
    if ctx.is_cuda and params.get("copy_bytes"):
        summary["copy_gbps_large"] = measure_copy_gbps(ctx, params["copy_bytes"])
        summary["copy_bytes_large"] = params["copy_bytes"]
    return Result(rows, summary)


EXERCISE = Exercise(
    id="phase3.vector_add", title="Triton vector add: the seed's 98,432-element case and a bandwidth sweep",
    run=run, needs=Needs(cuda=True, modules=("triton",)),
    params={"sizes": Int([98432, 2**16, 2**18, 2**20, 2**22, 2**24, 2**26, 2**28], min=1, unit="fp32 elements",
                         many=True),
            "copy_bytes": Int(2**31, min=2**20, nullable=True,
                              unit="bytes per buffer of the summary's large copy (null: none; GPU only)")},
    cpu_params={"sizes": [98432, 2**20], "copy_bytes": None},
    quick_params={"sizes": [98432, 100003], "copy_bytes": None},
    variants=("copy", "torch", "triton"), footprint_bytes=footprint_bytes, work=work)


if __name__ == "__main__":
    run_alone(EXERCISE, {"sizes": [98432, 100003]})
