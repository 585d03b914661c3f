"""The Triton softmax's machine code for an H200 (sm_90), compiled on this CPU (no GPU: the
wrappers run inside `common.triton_shim.compile_only`, ptxas is Triton's own), checked for what
its speed rests on: 16-byte loads and stores wherever the rows are 16-byte aligned, and short
unaligned rows reduced inside one warp (no block barrier). Each property is also shown absent
from a config or launch without the fix, so the checks can fail.
"""
import importlib.util
import os
import re

import pytest
import torch

HAS_PTXAS = importlib.util.find_spec("triton") is not None and \
    importlib.util.find_spec("triton.backends.nvidia") is not None
pytestmark = [pytest.mark.skipif(not HAS_PTXAS, reason="needs triton with its NVIDIA backend (ptxas)"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles; the interpreter does not")]

H200_SMS = 132


def _compile(launch) -> list[tuple[str, object]]:
    from common.triton_shim import compile_only
    with compile_only(90) as built:
        launch()
    return built.built


def _ptx(launch, kernel: str) -> tuple[str, object]:
    compiled = next(c for name, c in _compile(launch) if name == kernel)
    return compiled.asm["ptx"], compiled


def _plan_ptx(n: int, rows: int | None = None, kernel: str = "softmax_kernel"):
    from phases.phase3_triton import softmax as sm
    m = rows or 2**27 // n
    cfg = sm.plan(m, n, H200_SMS)
    x, y = torch.empty(m, n), torch.empty(m, n)
    return cfg, *_ptx(lambda: sm.softmax(x, y, cfg), kernel)


def test_rows_of_100_columns_load_and_store_16_byte_vectors():
    """100 fp32 columns are 400 bytes: every row starts on a 16-byte boundary, but 100 is not the
    multiple of 16 that Triton's own argument specialization looks for. Passed divided by the
    vector width, the kernel's loads are 16-byte vectors; launched with VEC=1 they are not."""
    from phases.phase3_triton import softmax as sm
    cfg, ptx, _ = _plan_ptx(100)
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx and "ld.global.b32" not in ptx
    n, m = 100, 4096
    x, y = torch.empty(m, n), torch.empty(m, n)
    scalar, _ = _ptx(lambda: sm.softmax_kernel[(1,)](x, y, m, n, n, n, 1, ROWS=cfg["ROWS"], BLOCK_N=cfg["BLOCK_N"],
                                                    STAGES=1, VEC=1, WIDE=False, num_warps=cfg["num_warps"]),
                     "softmax_kernel")
    assert "ld.global.v4.b32" not in scalar and "ld.global.b32" in scalar


def test_unaligned_short_rows_reduce_within_one_warp():
    """101 columns: one element a lane. The rule's one-warp program reduces each row with warp
    shuffles alone; the 8-warp tile the rule used before cuts each row across 4 warps, which needs
    block barriers (bar.sync) in every reduction."""
    from phases.phase3_triton import softmax as sm
    from phases.phase3_triton.compile_check import ptxas_report
    cfg, ptx, compiled = _plan_ptx(101)
    assert cfg["num_warps"] == 1 and "bar.sync" not in ptx
    report = ptxas_report(compiled, 90)
    assert report["spill_bytes"] == 0 and report["registers"] <= 64, report
    n, m = 101, 4096
    x, y = torch.empty(m, n), torch.empty(m, n)
    old = {"kind": "rows", "ROWS": 32, "BLOCK_N": 128, "num_warps": 8, "num_stages": 1}
    wide_ptx, _ = _ptx(lambda: sm.softmax(x, y, old), "softmax_kernel")
    assert "bar.sync" in wide_ptx
