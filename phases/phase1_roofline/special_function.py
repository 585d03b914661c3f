"""Two ceilings the summed workload model (common/workload.py) needs, measured by phase1.ceilings:

* the special-function rate: exponentials per second. Attention's softmax spends one exponential
  per score on the SFUs (16 per SM per clock on sm_80 / sm_90, beside thousands of tensor-core
  FLOPs), so attention is two roofs, not one. Measured by a Triton kernel whose every thread runs a
  chain of x = 2^-x on 8 independent elements in registers: REPS exponentials per element loaded,
  so memory plays no part (2^-x maps [0, 1] into itself, contracting: the chain neither overflows
  nor amplifies rounding, and a float64 reference of the same chain checks it).
* the launch floor of a Triton kernel: an empty-ish Triton kernel (one element incremented) timed
  like the PyTorch op of the `launch` row. Triton's Python launcher costs more host time than
  PyTorch's C++ dispatch, and a workload of Triton kernels pays that floor for each.

Triton is imported here only; without it (or on a CPU) both rows are skipped, saying why.
"""
import importlib.util

import torch

from common.exercise import measure, reference_check, row

REPS = 256                     # exponentials per element: the kernel is ~all SFU work
BLOCK = 1024
HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def exp_chain_kernel(x_ptr, out_ptr, n, REPS: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        for _ in range(REPS):
            x = tl.exp2(-x)
        tl.store(out_ptr + offs, x, mask=mask)

    @triton.jit
    def increment_kernel(x_ptr):
        tl.store(x_ptr, tl.load(x_ptr) + 1.0)


def exp_chain(x: torch.Tensor, out: torch.Tensor, reps: int = REPS) -> None:
    n = x.numel()
    exp_chain_kernel[(triton.cdiv(n, BLOCK),)](x, out, n, REPS=reps, BLOCK=BLOCK)


def exp_chain_reference(x: torch.Tensor, reps: int = REPS) -> torch.Tensor:
    y = x.double()
    for _ in range(reps):
        y = torch.exp2(-y)
    return y


def unavailable(ctx) -> str | None:
    if not HAS_TRITON:
        return "needs the Python package `triton` (the exp-rate and Triton-launch rows are Triton kernels)"
    if not ctx.is_cuda:
        return "Triton kernels run on a GPU; these ceilings are a GPU's"
    return None


def rows(ctx, elements: int) -> list[dict]:
    """The `exp` row (metrics.exp_per_s) and the `triton_launch` row, or both skipped with the reason."""
    why = unavailable(ctx)
    if why:
        return [row(v, {}, "skipped", why) for v in ("exp", "triton_launch")]
    x = torch.rand(elements, device=ctx.device, dtype=torch.float32)
    out = torch.empty_like(x)
    exps = REPS * elements
    r = measure(ctx, "exp", {"elements": elements, "exps_per_element": REPS, "dtype": "fp32"},
                fn=lambda: exp_chain(x, out), flops=0, bytes_moved=8 * elements, dtype=None,
                check=reference_check(ctx, out, lambda: exp_chain(x, out), exp_chain_reference(x),
                                      f"float64 chain of {REPS} x = 2^-x", precision="fp32"))
    if r["status"] == "ok":
        r["metrics"]["exp_per_s"] = exps / (r["metrics"]["ms"] / 1e3)
        r["metrics"]["exps"] = exps
    one = torch.zeros(1, device=ctx.device)
    launch = measure(ctx, "triton_launch", {"kernel": "Triton: one element incremented"},
                     fn=lambda: increment_kernel[(1,)](one), flops=1, bytes_moved=8, dtype="fp32",
                     check=lambda: {"passed": True, "reason": None, "reference": "none: the floor is the result"})
    return [r, launch]
