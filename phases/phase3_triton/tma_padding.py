"""Operands a TMA descriptor can read: any 2-D tensor, copied once into rows padded to 16 bytes
when its own layout is not one.

A TMA descriptor needs a unit last stride, a row stride that is a multiple of 16 bytes and a
16-byte aligned base. A bf16 matrix with N = 5003 columns (10,006-byte rows) has none of the
first two, so Triton cannot vectorize its loads either; one copy into a buffer whose row pitch is
the column count rounded up to 16 bytes costs a read and a write of the operand and lets the
persistent TMA kernel run its full-speed loop. The descriptor is built with the logical shape and
the padded pitch, so TMA's bounds check zero-fills reads past the last column: the pad is never
read and is left unwritten (zeroing it would be a second kernel for nothing).
"""
import torch

TMA_ROW_BYTES = 16       # a TMA descriptor's row stride and base address are multiples of this


def tma_readable(t: torch.Tensor) -> bool:
    """A 2-D tensor a descriptor can take as it is: row-major, 16-byte rows and base."""
    return (t.ndim == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % TMA_ROW_BYTES == 0
            and t.data_ptr() % TMA_ROW_BYTES == 0)


def padded_pitch(cols: int, itemsize: int) -> int:
    """Row pitch in elements: `cols` rounded up to a multiple of 16 bytes."""
    per_row = max(1, TMA_ROW_BYTES // itemsize)
    return -(-cols // per_row) * per_row


def padding_bytes(rows: int, cols: int, itemsize: int) -> int:
    """What the copy moves through device memory: the operand read once, written once."""
    return 2 * rows * cols * itemsize


def padded_for_tma(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when a descriptor can read it, else a copy of it (same shape and values) whose
    rows start every padded_pitch() elements of one buffer."""
    if tma_readable(t):
        return t
    rows, cols = t.shape
    buf = torch.empty((rows, padded_pitch(cols, t.element_size())), device=t.device, dtype=t.dtype)
    view = buf[:, :cols]
    view.copy_(t)
    return view
