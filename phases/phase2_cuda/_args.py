"""Argument validation shared by the phase-2 wrappers: everything a launcher cannot check for
itself (dtype, layout, shapes, sizes) is refused here, with a clear message, before any launch."""
import torch

INT32_MAX = 2**31 - 1


def need_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")


def need_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major); call .contiguous() first")
