"""Phase 2 on a real GPU (marked gpu: `pytest -m gpu tests/test_phase2_gpu.py`): every CUDA kernel
built for this GPU and checked at irregular sizes with the exercises' own checker; a deliberately
wrong kernel must fail that checker; then `lab run 2 --quick` end to end."""
import shutil

import pytest
import torch

from common.checks import compare
from common.errors import LabError

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")]

if torch.cuda.is_available():
    from phases.phase2_cuda import matmul as mm
    from phases.phase2_cuda import vector_add as va

DEV = "cuda"


@pytest.mark.parametrize("variant", ["cuda", "cuda_vec4"])
@pytest.mark.parametrize("n", [1, 3, 255, 257, 1_000_003, 4096 * 256])
def test_vector_add(n, variant):
    a, b = va.inputs(n, DEV)
    out = torch.full_like(a, float("nan"))
    va.add(a, b, out, variant=variant)
    torch.cuda.synchronize()
    assert torch.equal(out, a + b)
    assert out[0] == a[0] + b[0] and out[-1] == a[-1] + b[-1]        # both ends


@pytest.mark.parametrize("variant", mm.VARIANTS if torch.cuda.is_available() else [])
@pytest.mark.parametrize("shape", [(1000, 777, 555), (1, 1, 1), (17, 33, 9), (64, 64, 64), (128, 96, 200),
                                   (65, 130, 31)])
def test_matmul_variants(variant, shape):
    m, n, k = shape
    if mm.runnable(variant, DEV):
        pytest.skip(f"{variant} {mm.runnable(variant, DEV)}")
    k_multiple = mm.RUNGS[variant].k_multiple       # the TMA rungs: K a multiple of 8, so trim K
    k = max(k_multiple, k - k % k_multiple)
    a, b = mm.operands(m, n, k, DEV, seed=m + n + k)
    verdict = mm.check_variant(variant, a, b)
    assert verdict["passed"], verdict


# Shapes nobody tuned for: large with no dimension a tile multiple (N odd: the scalar-store epilogues),
# tall-skinny (8 <= M <= 64, where wgmma_tma_ws splits K), one row, and a few-tile long-K product.
IRREGULAR_AND_SKINNY = [(4001, 5003, 4104), (8, 4097, 14336), (13, 14335, 4096), (32, 5003, 8192),
                        (64, 8191, 4104), (1, 4096, 4096), (333, 65, 20000)]
TENSOR_CORE_RUNGS = [v for v in (mm.VARIANTS if torch.cuda.is_available() else []) if mm.RUNGS[v].precision == "bf16"]


@pytest.mark.parametrize("variant", TENSOR_CORE_RUNGS)
@pytest.mark.parametrize("shape", IRREGULAR_AND_SKINNY, ids=lambda s: "x".join(map(str, s)))
def test_tensor_core_rungs_on_irregular_and_skinny_shapes(variant, shape):
    """Every bf16 rung against float64 at each shape, with the exercise's checker (poisoned output);
    the rungs that split K twice: their split-K sum is deterministic."""
    m, n, k = shape
    if mm.runnable(variant, DEV):
        pytest.skip(f"{variant} {mm.runnable(variant, DEV)}")
    a, b = mm.operands(m, n, k, DEV, seed=m + n + k)
    verdict = mm.check_variant(variant, a, b)
    assert verdict["passed"], verdict
    if variant in ("mma_bf16_pipelined", "wgmma_tma", "wgmma_tma_ws"):
        a16, b16 = a.bfloat16(), b.bfloat16()
        b16 = mm.column_major(b16) if mm.RUNGS[variant].b_layout == "col" else b16
        assert torch.equal(mm.matmul(a16, b16, variant), mm.matmul(a16, b16, variant))


@pytest.mark.parametrize("shape", [*IRREGULAR_AND_SKINNY, (8192, 8192, 8192), (1024, 1024, 1024), (128, 256, 64)])
def test_wgmma_split_rule_is_the_one_python_counts_launches_with(shape):
    import ctypes
    from phases.phase2_cuda import build
    from phases.phase2_cuda.rungs import tma_split_k, ws_split_k
    if mm.runnable("wgmma_tma_ws", DEV):
        pytest.skip(mm.runnable("wgmma_tma_ws", DEV))
    lib, _ = build.load("matmul_wgmma.cu", mm.signatures("matmul_wgmma.cu"))
    lib.lab_wgmma_ws_split_k.argtypes = lib.lab_wgmma_tma_split_k.argtypes = [ctypes.c_int] * 4
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    assert lib.lab_wgmma_ws_split_k(*shape, sms) == ws_split_k(*shape, sms)
    assert lib.lab_wgmma_tma_split_k(*shape, sms) == tma_split_k(*shape, sms)


@pytest.mark.parametrize("variant", ["coalesced_regblock", "warptiled_1stage", "warptiled", "mma_bf16",
                                     "mma_bf16_pipelined"])
def test_matmul_unaligned_views_take_the_scalar_path(variant):
    # Offsets by one element: contiguous, but not 16-byte aligned, so the vector loads must be off.
    dt = mm.dtypes(variant)[0]
    m, n, k = 64, 64, 64
    a = torch.randn(m * k + 1, device=DEV).to(dt)[1:].view(m, k)
    b = torch.randn(k * n + 1, device=DEV).to(dt)[1:].view(k, n)
    out = mm.matmul(a, b, variant)
    torch.cuda.synchronize()
    assert compare(out, a.double() @ b.double(), mm.RUNGS[variant].precision, "float64")["passed"]


@pytest.mark.parametrize("variant", ["warptiled_1stage", "warptiled"])
@pytest.mark.parametrize("shape", [(1000, 776, 556), (130, 264, 200), (1, 4, 4), (300, 4, 1036)])
def test_warptiled_float4_path_tails(variant, shape):
    # K and N multiples of 4: the float4 kernel, over several 128x128 tiles with M, N, K tails (the
    # standard shapes reach it only inside one tile); then C one element off 16 bytes, which must
    # switch to the scalar kernel.
    m, n, k = shape
    a, b = mm.operands(m, n, k, DEV, seed=m + n + k)
    verdict = mm.check_variant(variant, a, b)
    assert verdict["passed"], verdict
    out = torch.full((m * n + 1,), float("nan"), device=DEV)[1:].view(m, n)
    mm.matmul(a, b, variant, out)
    torch.cuda.synchronize()
    assert compare(out, a.double() @ b.double(), "fp32", "float64")["passed"]


@pytest.mark.parametrize("shape", [(1000, 776, 555), (130, 264, 201), (257, 132, 44)])
def test_warptiled_cp_async_any_k_any_a(shape):
    # warptiled copies A 4 bytes at a time, so its float4 kernel (16-byte B copies, float4 C stores)
    # runs whenever N % 4 == 0 and B and C are 16-byte aligned, whatever K and A's alignment: K odd
    # or not a multiple of the 8-deep tile here, then A a view one element off 16 bytes.
    m, n, k = shape
    a, b = mm.operands(m, n, k, DEV, seed=m + n + k)
    verdict = mm.check_variant("warptiled", a, b)
    assert verdict["passed"], verdict
    a_off = torch.empty(m * k + 1, device=DEV)[1:].view(m, k)
    a_off.copy_(a)
    out = mm.matmul(a_off, b, "warptiled")
    torch.cuda.synchronize()
    assert compare(out, a.double() @ b.double(), "fp32", "float64")["passed"]


@pytest.mark.parametrize("shape", [(1000, 776, 552), (130, 264, 200), (1, 8, 8), (300, 8, 1032)])
def test_mma_pipelined_cp_async_tails(shape):
    # K and N multiples of 8 (16-byte rows): the cp.async path, with M, N, K tails zero-filled
    # (the standard shapes reach it only at 64x64x64 and 128x96x200); then C offset by one element,
    # which turns off the packed bf16x2 stores.
    m, n, k = shape
    a, b = mm.operands(m, n, k, DEV, seed=m + n + k)
    verdict = mm.check_variant("mma_bf16_pipelined", a, b)
    assert verdict["passed"], verdict
    a16, b16 = a.bfloat16(), b.bfloat16()
    out = torch.full((m * n + 1,), float("nan"), device=DEV, dtype=torch.bfloat16)[1:].view(m, n)
    mm.matmul(a16, b16, "mma_bf16_pipelined", out)
    torch.cuda.synchronize()
    assert compare(out, a16.double() @ b16.double(), "bf16", "float64")["passed"]


WGMMA_RUNGS = [v for v in mm.VARIANTS if mm.RUNGS[v].source == "matmul_wgmma.cu"] if torch.cuda.is_available() else []


@pytest.mark.parametrize("variant", WGMMA_RUNGS)
@pytest.mark.parametrize("shape", [(2500, 4000, 136), (1500, 3001, 200)])
def test_wgmma_many_tiles_per_cta(variant, shape):
    # More tiles than SMs, so each persistent CTA of wgmma_tma_ws walks several tiles and its ring of
    # 4 stages wraps in the middle of a tile (3 or 4 k-tiles per tile); N = 3001 is odd (scalar stores).
    if mm.runnable(variant, DEV):
        pytest.skip(f"{variant} {mm.runnable(variant, DEV)}")
    m, n, k = shape
    a, b = mm.operands(m, n, k, DEV, seed=m + n + k)
    verdict = mm.check_variant(variant, a, b)
    assert verdict["passed"], verdict


@pytest.mark.parametrize("variant", WGMMA_RUNGS)
def test_wgmma_refuses_misaligned_pointers(variant):
    # TMA needs 16-byte aligned A and B: a view one element in is refused before any launch (a clear
    # LabError, not garbage), and the rung still works afterwards.
    if mm.runnable(variant, DEV):
        pytest.skip(f"{variant} {mm.runnable(variant, DEV)}")
    m, n, k = 64, 64, 64
    a = torch.randn(m * k + 1, device=DEV).bfloat16()
    b = torch.randn(n * k + 1, device=DEV).bfloat16()
    a_ok, b_ok = a[:-1].view(m, k), b[:-1].view(n, k).t()          # b column-major (K contiguous)
    a_off, b_off = a[1:].view(m, k), b[1:].view(n, k).t()
    for x, y in ((a_off, b_ok), (a_ok, b_off)):
        with pytest.raises(LabError, match="invalid argument"):
            mm.matmul(x, y, variant)
    out = mm.matmul(a_ok, b_ok, variant)
    torch.cuda.synchronize()
    assert compare(out, a_ok.double() @ b_ok.double(), "bf16", "float64")["passed"]


def test_a_wrong_kernel_fails_the_checker():
    a, b = mm.operands(1000, 777, 555, DEV, seed=3)            # 555 % 16 = 11 terms skipped
    verdict = mm.check_variant("broken_skip_k_tail", a, b, torch.empty(1000, 777, device=DEV))
    assert not verdict["passed"] and "relative error" in verdict["reason"]


def test_a_split_k_sum_that_drops_a_run_fails_the_checker():
    if mm.runnable("wgmma_tma_ws", DEV):
        pytest.skip(mm.runnable("wgmma_tma_ws", DEV))
    a, b = mm.operands(13, 4097, 14336, DEV, seed=5)          # tall-skinny: wgmma_tma_ws splits K
    assert mm.check_variant("wgmma_tma_ws", a, b)["passed"]
    verdict = mm.check_variant("broken_wgmma_drop_last_run", a, b)
    assert not verdict["passed"] and "relative error" in verdict["reason"], verdict


def test_fp32_rungs_are_not_tf32():
    a, b = mm.operands(512, 512, 512, DEV, seed=4)
    for v in ("naive", "tiled", "regblock_1d", "coalesced_regblock", "warptiled_1stage", "warptiled"):
        v_ = mm.check_variant(v, a, b, torch.empty(512, 512, device=DEV))
        assert v_["rel_l2_error"] < 1e-5, (v, v_)


def test_lab_run_2_quick(tmp_path):
    from conftest import run_lab

    from common.records import load_records
    proc = run_lab("run", "2", "--quick", "--results", tmp_path / "r")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = load_records(tmp_path / "r")
    assert {r["exercise"]["id"] for r in records} == {"phase2.vector_add", "phase2.matmul", "phase2.softmax",
                                                      "phase2.traffic"}
    for r in records:
        assert all(row["status"] == "ok" for row in r["rows"]), r["rows"]
    [m] = [r for r in records if r["exercise"]["id"] == "phase2.matmul"]
    assert all("pct_of_library" in row["metrics"] for row in m["rows"] if row["variant"] in mm.VARIANTS)
    assert m["summary"]["irregular_checks"] and "why_mma_sync_caps" not in m["summary"]
    steps = {row["variant"]: row["metrics"].get("base_rung") for row in m["rows"]}
    assert steps["tiled"] == "naive" and steps["wgmma_tma_ws_cluster"] in (None, "wgmma_tma_ws")
    for res in m["summary"]["build"]["resources"].values():
        assert res["spill_stores_bytes"] == 0
