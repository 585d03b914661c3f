"""Phase 2 on a real GPU (marked gpu: `pytest -m gpu tests/test_phase2_gpu.py`): every CUDA kernel
built for this GPU and checked at irregular sizes with the exercises' own checker; a deliberately
wrong kernel must fail that checker; then `lab run 2 --quick` end to end."""
import shutil

import pytest
import torch

from common.checks import compare

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")]

if torch.cuda.is_available():
    from phases.phase2_cuda import matmul as mm
    from phases.phase2_cuda import vector_add as va

DEV = "cuda"


@pytest.mark.parametrize("n", [1, 255, 257, 1_000_003, 4096 * 256])
def test_vector_add(n):
    a, b = va.inputs(n, DEV)
    out = torch.full_like(a, float("nan"))
    va.add(a, b, out)
    torch.cuda.synchronize()
    assert torch.equal(out, a + b)
    assert out[0] == a[0] + b[0] and out[-1] == a[-1] + b[-1]        # both ends


@pytest.mark.parametrize("variant", mm.VARIANTS if torch.cuda.is_available() else [])
@pytest.mark.parametrize("shape", [(1000, 777, 555), (1, 1, 1), (17, 33, 9), (64, 64, 64), (128, 96, 200),
                                   (65, 130, 31)])
def test_matmul_variants(variant, shape):
    m, n, k = shape
    a, b = mm.operands(m, n, k, DEV, seed=m + n + k)
    verdict = mm.check_variant(variant, a, b)
    assert verdict["passed"], verdict


@pytest.mark.parametrize("variant", ["coalesced_regblock", "mma_bf16"])
def test_matmul_unaligned_views_take_the_scalar_path(variant):
    # Offsets by one element: contiguous, but not 16-byte aligned, so the vector loads must be off.
    dt = mm.RUNGS[variant].dtype
    m, n, k = 64, 64, 64
    a = torch.randn(m * k + 1, device=DEV).to(dt)[1:].view(m, k)
    b = torch.randn(k * n + 1, device=DEV).to(dt)[1:].view(k, n)
    out = mm.matmul(a, b, variant)
    torch.cuda.synchronize()
    assert compare(out, a.double() @ b.double(), mm.RUNGS[variant].precision, "float64")["passed"]


def test_a_wrong_kernel_fails_the_checker():
    a, b = mm.operands(1000, 777, 555, DEV, seed=3)            # 555 % 16 = 11 terms skipped
    verdict = mm.check_variant("broken_skip_k_tail", a, b, torch.empty(1000, 777, device=DEV))
    assert not verdict["passed"] and "relative error" in verdict["reason"]


def test_fp32_rungs_are_not_tf32():
    a, b = mm.operands(512, 512, 512, DEV, seed=4)
    for v in ("naive", "tiled", "coalesced_regblock"):
        v_ = mm.check_variant(v, a, b, torch.empty(512, 512, device=DEV))
        assert v_["rel_l2_error"] < 1e-5, (v, v_)


def test_lab_run_2_quick(tmp_path):
    from conftest import run_lab
    from common.records import load_records
    proc = run_lab("run", "2", "--quick", "--results", tmp_path / "r")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = load_records(tmp_path / "r")
    assert {r["exercise"]["id"] for r in records} == {"phase2.vector_add", "phase2.matmul"}
    for r in records:
        assert all(row["status"] == "ok" for row in r["rows"]), r["rows"]
    [m] = [r for r in records if r["exercise"]["id"] == "phase2.matmul"]
    assert all("pct_of_library" in row["metrics"] for row in m["rows"] if row["variant"] in mm.VARIANTS)
    for res in m["summary"]["build"]["resources"].values():
        assert res["spill_stores_bytes"] == 0
