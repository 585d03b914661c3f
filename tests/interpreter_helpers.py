"""What the Triton-interpreter test files share (imported only inside their interpreted child, where
TRITON_INTERPRET=1 is set before triton loads)."""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from common.exercise import Context, reference_check

CTX = Context(torch.device("cpu"), None, "cpu")


def interpreter_unusable() -> str | None:
    """Why the interpreter cannot run here, or None: Triton <= 3.6's interpreter cannot index with
    numpy >= 2.3 scalars (fixed in 3.7)."""
    @triton.jit
    def probe(x_ptr, n):
        for i in range(0, n):
            tl.store(x_ptr + i, i)
    try:
        probe[(1,)](torch.zeros(4), 4)
        return None
    except Exception as exc:  # noqa: BLE001
        return (f"triton interpreter unusable here (triton {triton.__version__}, numpy {np.__version__}): "
                f"{type(exc).__name__}")


def check(out, fill, ref, reference, precision=None) -> dict:
    """The exercises' own gate: poison `out`, run `fill`, compare with `ref` (bit-exact without a precision)."""
    return reference_check(CTX, out, fill, ref, reference, precision)()


UNUSABLE = interpreter_unusable()


@pytest.fixture(autouse=True)
def interpreter_seed():
    """Autouse where imported: skip when this interpreter cannot run, else seed torch."""
    if UNUSABLE:
        pytest.skip(UNUSABLE)
    torch.manual_seed(0)
