"""Correctness gates timing: an output is compared with a reference before any number is kept.

The comparison is the relative Frobenius error ||out - ref|| / ||ref||, computed in float64, with
a tolerance set by the precision the kernel is allowed to use. NaN anywhere fails (outputs are
poisoned with NaN before a run, so an element the kernel never wrote shows up as NaN).
"""
import math

import torch

# Relative-error budgets per compute precision. fp32 is set below what TF32 produces (~3e-4 on
# random data) so a silent low-precision shortcut fails the fp32 check.
REL_TOLERANCE = {
    "fp64": 1e-12,
    "fp32": 5e-5,
    "tf32": 3e-3,
    "fp16": 5e-3,
    "bf16": 2e-2,
    "fp8": 1e-1,
}

TORCH_DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "tf32": torch.float32,
                "fp16": torch.float16, "bf16": torch.bfloat16}
BYTES_PER_ELEMENT = {"fp64": 8, "fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}
CHECK_CHUNK = 1 << 26              # elements compared at a time (float64 copies of this many live at once)
EMPTY = "the output holds no elements: nothing was checked"


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output with NaN (floats) or a sentinel (ints) so unwritten elements are caught."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(-123456789 if t.dtype in (torch.int32, torch.int64) else -1)


def compare(out: torch.Tensor, ref, precision: str, reference: str, chunk: int = CHECK_CHUNK,
            expected_shape: tuple | None = None) -> dict:
    """Check block for a record.

    `ref` is the reference tensor, or a function (start, stop) -> the float64 reference of the
    flattened output's elements [start, stop): then a 4 GiB output is checked in chunks without
    ever materializing an 8 GiB float64 reference, and `expected_shape` must say what the output
    should be (a callable cannot tell an empty or truncated output from a right one).
    An output with no elements never passes: an empty check proves nothing.
    """
    tol = REL_TOLERANCE[precision]
    if callable(ref) and not isinstance(ref, torch.Tensor):
        if expected_shape is None:
            raise ValueError("compare() with a callable reference needs expected_shape")
        want = tuple(expected_shape)
    else:
        want = tuple(ref.shape)
    if tuple(out.shape) != want:
        return _block(reference, precision, tol, None, None, False,
                      f"shape {tuple(out.shape)} != reference {want}")
    if out.numel() == 0:
        return _block(reference, precision, tol, None, None, False, EMPTY)
    o = out.reshape(-1)
    ref_slice = ref if callable(ref) else (lambda a, b, r=ref.reshape(-1): r[a:b])
    err_sq, ref_sq, max_abs, nan_count = 0.0, 0.0, 0.0, 0
    for s in range(0, o.numel(), chunk):
        oc, rc = o[s:s + chunk].double(), ref_slice(s, min(s + chunk, o.numel())).double()
        nan_count += int(torch.isnan(oc).sum())
        diff = (oc - rc)
        err_sq += float(torch.nan_to_num(diff, nan=0.0).pow(2).sum())
        ref_sq += float(rc.pow(2).sum())
        finite = torch.nan_to_num(diff.abs(), nan=0.0)
        max_abs = max(max_abs, float(finite.max()) if finite.numel() else 0.0)
    rel = (err_sq ** 0.5) / (ref_sq ** 0.5) if ref_sq > 0 else (0.0 if err_sq == 0 else float("inf"))
    if not math.isfinite(ref_sq):
        return _block(reference, precision, tol, None, None, False, "the reference is not finite")
    if nan_count:
        return _block(reference, precision, tol, rel, max_abs, False,
                      f"{nan_count} NaN elements (unwritten or invalid output)")
    if not math.isfinite(rel) or rel > tol:
        return _block(reference, precision, tol, rel, max_abs, False,
                      f"relative error {rel:.2e} > tolerance {tol:.0e}")
    return _block(reference, precision, tol, rel, max_abs, True, None)


def _block(reference, precision, tol, rel, max_abs, passed, reason) -> dict:
    return {"reference": reference, "metric": "rel_l2", "precision": precision, "tolerance": tol,
            "rel_l2_error": rel if rel is None or math.isfinite(rel) else None,
            "max_abs_error": max_abs, "passed": passed, "reason": reason}


def exact(out: torch.Tensor, ref: torch.Tensor, reference: str) -> dict:
    """For operations with one right answer (copies, integer sums): bit-for-bit equality.
    An output with no elements never passes."""
    ok = out.shape == ref.shape and out.numel() > 0 and bool(torch.equal(out, ref))
    reason = None if ok else (EMPTY if out.numel() == 0 else "output differs from the reference")
    return {"reference": reference, "metric": "exact", "precision": None, "tolerance": 0.0,
            "rel_l2_error": None, "max_abs_error": None, "passed": ok, "reason": reason}
