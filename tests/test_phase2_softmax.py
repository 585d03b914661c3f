"""Phase 2.3, softmax. On a CPU-only machine: softmax.cu compiles for sm_80 and sm_90 with no spills,
its host-side dispatch and argument refusals answer through ctypes (no GPU needed for those), the
wrapper refuses bad arguments with clear errors, a missing GPU or nvcc is a one-line LabError.
On a GPU (marked gpu: `pytest -m gpu tests/test_phase2_softmax.py`): every variant against float64
torch.softmax at irregular shapes, both dtypes, aligned and misaligned; the seed's rows sum to 1;
the deliberately wrong kernel fails the checker; `lab run phase2.softmax --quick` end to end."""
import ctypes
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import cpu_only

from common.errors import LabError
from phases.phase2_cuda import build
from phases.phase2_cuda import softmax as sm

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc on PATH")


def on_gpu(test):
    """Marked gpu (deselected by default) and skipped without a GPU or nvcc."""
    for mark in (pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc"),
                 pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.gpu):
        test = mark(test)
    return test

ARCHS = ("sm_80", "sm_90")
DEV = "cuda"

# Every kernel in softmax.cu (all of them matter: each is some row length's only kernel). None may
# spill or use a stack frame: the values a thread holds (at most 32 floats) must stay in registers.
SEED_C = (32, 64, 128, 256, 512, 1024)
PACKED_C = {"f32": (1, 2, 4, 8, 16, 32, 64, 128), "bf16": (1, 2, 4, 8, 16, 32, 64, 128, 256)}
BLOCK_C = (2048, 4096, 8192, 16384, 32768)
CLUSTER_C = (16384, 32768, 65536, 131072)
SMEM_BLOCK = ("f32_s8192", "f32_s16384", "bf16_s16384")                       # shared-memory kernels
SMEM_CLUSTER = ("f32_s8192", "f32_s16384", "bf16_s16384", "bf16_s32768")
KERNELS = sorted(
    [f"softmax_warp_row_{dt}_c{c}" for dt in ("f32", "bf16") for c in SEED_C]
    + [f"softmax_warp_packed_{dt}_c{c}" for dt in ("f32", "bf16") for c in PACKED_C[dt]]
    + [f"softmax_block_row_{dt}_c{c}" for dt in ("f32", "bf16") for c in BLOCK_C]
    + [f"softmax_cluster_row_{dt}_c{c}" for dt in ("f32", "bf16") for c in CLUSTER_C]
    + [f"softmax_block_row_smem_{k}" for k in SMEM_BLOCK]
    + [f"softmax_cluster_row_smem_{k}" for k in SMEM_CLUSTER]
    + [f"softmax_stream_row_{dt}" for dt in ("f32", "bf16")]
    + ["softmax_online_f32", "softmax_online_bf16"])
STREAM = [f"softmax_stream_row_{dt}" for dt in ("f32", "bf16")]


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    cache = tmp_path_factory.mktemp("softmax-cache")
    with ThreadPoolExecutor(max_workers=len(ARCHS)) as pool:
        done = pool.map(lambda a: build.build(sm.SOURCE, a, cache_dir=cache), ARCHS)
    return dict(zip(ARCHS, done))


# ------------------------------------------------------------------------------ the build, on CPU
@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_compiles_without_spills(builds, arch):
    b = builds[arch]
    assert b.path.exists() and b.arch == arch and f"-arch={arch}" in b.flags
    assert sorted(k for k in b.resources if k.startswith("softmax_")) == KERNELS
    for kernel in KERNELS:
        res = b.resources[kernel]
        assert res["registers"] and res["registers"] <= 255, (kernel, res)
        assert res["spill_stores_bytes"] == 0 and res["spill_loads_bytes"] == 0, (kernel, res)
        assert res["stack_bytes"] == 0, (kernel, res)
    # 1024-thread blocks leave 64 registers per thread; launch_bounds must have held the kernel to it.
    assert b.resources["softmax_block_row_f32_c32768"]["registers"] <= 64
    assert b.resources["softmax_block_row_bf16_c32768"]["registers"] <= 64
    # Shared-memory kernels: 1536 threads per SM (6 x 256 or 3 x 512) leave 40 registers per thread.
    for k in [f"softmax_block_row_smem_{k}" for k in SMEM_BLOCK] + [f"softmax_cluster_row_smem_{k}" for k in SMEM_CLUSTER]:
        assert b.resources[k]["registers"] <= 40, (k, b.resources[k])
    # Stream kernels: 17 warps per SM leave 96 registers (5 warps on one sub-partition).
    for k in STREAM:
        assert b.resources[k]["registers"] <= 96, (k, b.resources[k])


@needs_nvcc
def test_cluster_kernels_are_sm90_only(builds):
    # sm_80: the cluster body is compiled out (a stub that touches no memory); sm_90: the real kernel,
    # with its shared (max, sum) pair and the two block-reduction arrays.
    for dt in ("f32", "bf16"):
        for c in CLUSTER_C:
            name = f"softmax_cluster_row_{dt}_c{c}"
            assert builds["sm_80"].resources[name]["smem_bytes"] == 0
            # 2 x 32 floats + the pair, rounded up to 16 (the dynamic shared memory's alignment in this module)
            assert builds["sm_90"].resources[name]["smem_bytes"] == (2 * 32 * 4 + 8 + 15) // 16 * 16
    assert builds["sm_90"].resources["softmax_block_row_f32_c2048"]["smem_bytes"] == 2 * 32 * 4
    for k in SMEM_CLUSTER:
        assert builds["sm_80"].resources[f"softmax_cluster_row_smem_{k}"]["smem_bytes"] == 0
        assert builds["sm_90"].resources[f"softmax_cluster_row_smem_{k}"]["smem_bytes"] > 2 * 32 * 4
    for k in STREAM:                              # bulk copies: sm_90 only, a stub on sm_80
        assert builds["sm_80"].resources[k]["smem_bytes"] == 0
        assert builds["sm_90"].resources[k]["smem_bytes"] >= 2 * 13 * 8   # the ring's mbarriers
    for k in SMEM_BLOCK:                        # the sm_80 path (cp.async) is real code, not a stub
        assert builds["sm_80"].resources[f"softmax_block_row_smem_{k}"]["smem_bytes"] == 2 * 32 * 4


@needs_nvcc
def test_host_dispatch_and_refusals_without_a_gpu(builds):
    """The launchers' host code, called directly: it answers before touching a device."""
    lib = ctypes.CDLL(str(builds["sm_90"].path))
    lib.softmax_choose.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.lab_error_string.argtypes = [ctypes.c_int]
    lib.lab_error_string.restype = ctypes.c_char_p
    # The DISPATCH table in softmax.cu as written (edit both together).
    kernel = {c: sm.KERNELS[lib.softmax_choose(c, 0)] for c in (1, 32, 128, 129, 256, 257, 1024, 1025, 16384)}
    assert kernel == {1: "warp_packed", 32: "warp_packed", 128: "warp_packed", 129: "warp_row", 256: "warp_row",
                      257: "warp_row", 1024: "warp_row", 1025: "block_row", 16384: "block_row"}
    assert sm.KERNELS[lib.softmax_choose(16384, 1)] == "block_row_smem"
    assert sm.KERNELS[lib.softmax_choose(256, 1)] == "warp_packed"      # bf16: 16 values per lane
    assert sm.KERNELS[lib.softmax_choose(257, 1)] == "warp_row"
    if not torch.cuda.is_available():       # no clusters without a GPU: block_row up to 32768, then online
        assert sm.KERNELS[lib.softmax_choose(32768, 0)] == "block_row"
        assert sm.KERNELS[lib.softmax_choose(65536, 0)] == "online"
        assert sm.KERNELS[lib.softmax_choose(32768, 1)] == "block_row"
        assert sm.KERNELS[lib.softmax_choose(65536, 1)] == "online"
    assert lib.softmax_choose(0, 0) == -1 and lib.softmax_choose(32, 2) == -1
    invalid = 1                                                       # cudaErrorInvalidValue
    for name, too_long in (("launch_softmax_warp_row", 1025), ("launch_softmax_warp_packed", 1025),
                           ("launch_softmax_block_row", 32769), ("launch_softmax_cluster_row", 131073),
                           ("launch_softmax_block_row_smem", 16385), ("launch_softmax_cluster_row_smem", 131073),
                           ("launch_softmax_cluster_row_smem64", 131073), ("launch_softmax_stream_row", 131073)):
        fn = getattr(lib, name)
        fn.argtypes = sm._SIG
        assert fn(None, None, 4, too_long, 0, None) == invalid, name
        assert fn(None, None, 4, 32, 2, None) == invalid, name        # unknown dtype code
        assert fn(None, None, 4, 0, 0, None) == invalid, name         # no columns
        assert fn(None, None, 0, 32, 0, None) == 0, name              # no rows: nothing to launch
    assert lib.lab_error_string(invalid).decode() == "invalid argument"


@needs_nvcc
def test_work_knows_where_the_dispatcher_packs(builds):
    """work() lists warp_packed where DISPATCH picks it without asking the GPU (PACKED_MAX_COLS):
    the two must agree at every row length a warp kernel takes."""
    lib = ctypes.CDLL(str(builds["sm_90"].path))
    lib.softmax_choose.argtypes = [ctypes.c_int, ctypes.c_int]
    for dtype, code in (("fp32", 0), ("bf16", 1)):
        packed = [c for c in range(1, 1025) if sm.KERNELS[lib.softmax_choose(c, code)] == "warp_packed"]
        assert packed == list(range(1, sm.PACKED_MAX_COLS[dtype] + 1)), dtype


def test_the_sm90_code_is_guarded():
    text = (build.HERE / sm.SOURCE).read_text()
    assert "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900" in text
    assert "cudaLaunchKernelEx" in text and "cudaFuncAttributeNonPortableClusterSizeAllowed" in text


def test_missing_nvcc_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(LabError) as e:
        build.build(sm.SOURCE, "sm_90", cache_dir=tmp_path)
    assert "\n" not in str(e.value) and "nvcc" in str(e.value)


# ------------------------------------------------------------------------------ the wrapper, before launch
@pytest.mark.parametrize("variant", sm.VARIANTS)
def test_validation(variant):
    x = torch.rand(5, 7)
    with pytest.raises(TypeError, match="float32 or torch.bfloat16, got torch.float64"):
        sm.softmax(x.double(), variant)
    with pytest.raises(TypeError, match="float32 or torch.bfloat16, got torch.float16"):
        sm.softmax(x.half(), variant)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        sm.softmax([[1.0, 2.0]], variant)
    with pytest.raises(ValueError, match="2-D"):
        sm.softmax(torch.rand(2, 3, 4), variant)
    with pytest.raises(ValueError, match="2-D"):
        sm.softmax(torch.rand(7), variant)
    with pytest.raises(ValueError, match="contiguous"):
        sm.softmax(torch.rand(7, 5).t(), variant)
    with pytest.raises(ValueError, match="at least one column"):
        sm.softmax(torch.rand(5, 0), variant)
    with pytest.raises(ValueError, match="fewer than 2"):
        sm.softmax(torch.empty(2**16, 2**15 + 1, device="meta"), variant)
    with pytest.raises(TypeError, match="out must be torch.float32 like x"):
        sm.softmax(x, variant, torch.empty(5, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out must be \(5, 7\) like x"):
        sm.softmax(x, variant, torch.empty(7, 5))
    with pytest.raises(ValueError, match="out must be contiguous"):
        sm.softmax(x, variant, torch.empty(7, 5).t())
    with pytest.raises(ValueError, match="must not share memory"):
        sm.softmax(x, variant, x)
    buf = torch.rand(5 * 7 + 3)
    with pytest.raises(ValueError, match="must not share memory"):
        sm.softmax(buf[:35].view(5, 7), variant, buf[3:].view(5, 7))


def test_unknown_variant_and_row_limits():
    with pytest.raises(ValueError, match="unknown softmax variant 'fastest'; choose from cuda, warp_row"):
        sm.softmax(torch.rand(2, 3), "fastest")
    for variant, limit in (("warp_row", 1024), ("warp_packed", 1024), ("block_row", 32768), ("cluster_row", 131072),
                           ("block_row_smem", 16384), ("cluster_row_smem", 131072),
                           ("cluster_row_smem64", 131072), ("stream_row", 131072)):
        with pytest.raises(ValueError, match=f"'{variant}' handles rows of at most {limit} columns, got {limit + 1}"):
            sm.softmax(torch.empty(1, limit + 1), variant)


@cpu_only
@pytest.mark.parametrize("variant", sm.VARIANTS)
def test_valid_arguments_without_a_gpu_are_one_line(variant):
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(LabError, match="needs a CUDA GPU") as e:
            sm.softmax(torch.rand(4, 33).to(dtype), variant)
        assert "\n" not in str(e.value)


@cpu_only
def test_lab_run_softmax_skips_on_cpu(lab, tmp_path):
    rc, out, err = lab("run", "phase2.softmax", "--quick", "--results", tmp_path / "r")
    assert rc != 0 and "skipped" in out and "needs a CUDA GPU" in out


# ------------------------------------------------------------------------------ the exercise's arithmetic
def test_exercise_declaration():
    e = sm.EXERCISE
    assert e.id == "phase2.softmax" and e.needs.cuda and "nvcc" in e.needs.tools and e.cpu_params == {}
    assert e.params["cols"] == [32, 128, 512, 1024, 4096, 16384, 65536] and e.params["dtypes"] == ["fp32", "bf16"]
    assert e.params["seed_shape"] == [4096, 32]
    assert 2**28 * 2 > 60 * 2**20 * 8                   # even bf16 tensors are far beyond a 60 MiB L2
    assert [1000, 1000] in e.params["irregular_shapes"] and [3, 65537] in e.params["irregular_shapes"]
    assert set(e.quick_params) <= set(e.params)
    assert set(e.variants) == {"copy", "torch", *sm.VARIANTS} and "broken_half_row_sum" not in e.variants
    assert "broken_half_row_sum" in sm.LAUNCHERS


def test_shapes():
    got = sm.shapes({"seed_shape": [4096, 32], "cols": [32, 65536], "total_elements": 2**28,
                     "dtypes": ["fp32", "bf16"]})
    assert got == [(4096, 32, "fp32", "seed"), (2**23, 32, "fp32", "sweep"), (4096, 65536, "fp32", "sweep"),
                   (2**23, 32, "bf16", "sweep"), (4096, 65536, "bf16", "sweep")]


def test_row_sums_check():
    x = torch.randn(64, 32) * 4
    y = torch.softmax(x, dim=1)
    assert sm.row_sums(y, 1e-5)["passed"]
    bad = y.clone()
    bad[7, 3] += 1e-3
    v = sm.row_sums(bad, 1e-5)
    assert not v["passed"] and "row sums to 1" in v["reason"]
    assert v["max_row_sum_error"] == pytest.approx(1e-3, rel=1e-3)
    bad[7, 3] = float("nan")
    assert not sm.row_sums(bad, 1e-5)["passed"]
    ok = {"passed": True, "reason": None}
    assert sm.with_row_sums(ok, y, "fp32")["passed"]
    assert not sm.with_row_sums(ok, y * 1.01, "fp32")["passed"]
    assert sm.with_row_sums({"passed": False, "reason": "x"}, y, "fp32")["reason"] == "x"


def test_reference_and_misaligned_inputs():
    x = sm.inputs(3, 5, torch.bfloat16, "cpu", seed=1, offset=1)
    assert x.shape == (3, 5) and x.is_contiguous() and x.dtype == torch.bfloat16
    assert x.storage_offset() == 1 and x.data_ptr() % 16 != 0
    ref = sm.reference(x)
    assert ref.dtype == torch.float64 and torch.allclose(ref.sum(dim=1), torch.ones(3, dtype=torch.float64))
    out = sm.output_like(x, 1)
    assert out.shape == x.shape and out.storage_offset() == 1 and out.dtype == x.dtype


def test_relate_copy_and_torch():
    def r(variant, ms, gbps, status="ok"):
        return {"variant": variant, "status": status, "metrics": {"ms": ms, "gbps": gbps}}

    rows = [r("copy", 1.0, 4000.0), r("torch", 2.0, 2000.0), r("cuda", 1.25, 3200.0), r("online", 9.0, 1.0, "failed")]
    sm._relate(rows)
    copy, torch_row, cuda, online = rows
    assert "pct_of_copy_bandwidth" not in copy["metrics"]
    assert torch_row["metrics"]["pct_of_copy_bandwidth"] == pytest.approx(50.0)
    assert "speedup_vs_torch" not in torch_row["metrics"]
    assert cuda["metrics"]["pct_of_copy_bandwidth"] == pytest.approx(80.0)
    assert cuda["metrics"]["speedup_vs_torch"] == pytest.approx(1.6)
    assert "speedup_vs_torch" not in online["metrics"]


def test_first_irregular_failure_names_the_shape():
    checks = {"77x33 fp32": {"passed": True, "reason": None},
              "3x65537 bf16 misaligned": {"passed": False, "reason": "12 NaN elements"}}
    assert sm.first_failure(checks)["reason"] == "at 3x65537 bf16 misaligned: 12 NaN elements"
    assert sm.first_failure({"77x33 fp32": {"passed": True, "reason": None}}) is None


# ------------------------------------------------------------------------------ on a GPU
IRREGULAR = [(1000, 1000), (77, 33), (3, 65537), (5, 100000), (1, 1), (33, 7), (2, 1024), (3, 1025),
             (9, 32769), (2, 131072), (1, 131073), (513, 96), (6, 4097),
             (700, 40008)]   # stream_row: many rows per CTA (the ring wraps), a cluster of 2 (fp32), a partial chunk


def _gpu_variants():
    return sm.VARIANTS if torch.cuda.is_available() else ()


@on_gpu
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", _gpu_variants())
@pytest.mark.parametrize("shape", IRREGULAR, ids=lambda s: f"{s[0]}x{s[1]}")
def test_variants_at_irregular_shapes(variant, shape, dtype, offset):
    rows, cols = shape
    if not sm.applies(variant, cols, DEV):
        pytest.skip(f"{variant} does not handle {cols} columns here")
    x = sm.inputs(rows, cols, dtype, DEV, seed=rows * 31 + cols, offset=offset)
    out = sm.output_like(x, offset)
    verdict = sm.check_variant(variant, x, out)
    assert verdict["passed"], verdict
    assert out.dtype == dtype



@on_gpu
@pytest.mark.parametrize("variant", ["warp_row", "warp_packed", "cuda"])
def test_seed_case_rows_sum_to_one(variant):
    x = sm.inputs(4096, 32, torch.float32, DEV, seed=1)
    out = sm.softmax(x, variant)
    torch.cuda.synchronize()
    assert sm.row_sums(out, sm.ROW_SUM_TOLERANCE["fp32"])["passed"]
    assert sm.check_variant(variant, x, torch.empty_like(x))["passed"]


@on_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_wrong_kernel_fails_the_checker(dtype):
    x = sm.inputs(1000, 1000, dtype, DEV, seed=3)
    verdict = sm.check_variant("broken_half_row_sum", x, torch.empty_like(x))
    assert not verdict["passed"] and "relative error" in verdict["reason"]
    y = sm.softmax(x, "broken_half_row_sum")
    assert not sm.row_sums(y, sm.ROW_SUM_TOLERANCE[sm.DTYPES[dtype][1]])["passed"]


@on_gpu
def test_dispatch_choices():
    clusters = sm.has_clusters(DEV)              # the DISPATCH table in softmax.cu as written
    want = {32: "warp_packed", 128: "warp_packed", 512: "warp_row", 1024: "warp_row", 4096: "block_row",
            16384: "block_row", 32768: "cluster_row_smem" if clusters else "block_row",
            32769: "stream_row" if clusters else "online",
            65536: "stream_row" if clusters else "online", 131073: "online"}
    assert {c: sm.chosen_kernel(c, torch.float32, DEV) for c in want} == want
    want_bf16 = {256: "warp_packed", 512: "warp_row", 1024: "warp_row", 4096: "block_row",
                 16384: "block_row_smem", 32768: "cluster_row_smem64" if clusters else "block_row",
                 32769: "stream_row" if clusters else "online",
                 65536: "stream_row" if clusters else "online",
                 131072: "stream_row" if clusters else "online", 131073: "online"}
    assert {c: sm.chosen_kernel(c, torch.bfloat16, DEV) for c in want_bf16} == want_bf16


@on_gpu
@pytest.mark.parametrize("variant", _gpu_variants())
def test_extreme_values(variant):
    # Large magnitudes (the max must be subtracted before exp) and -inf entries (exp = 0, not NaN).
    cols = 1000 if sm.applies(variant, 1000, DEV) else 33
    x = sm.inputs(64, cols, torch.float32, DEV, seed=5) * 30
    x[::3, ::7] = float("-inf")
    out = torch.empty_like(x)
    verdict = sm.check_variant(variant, x, out)
    assert verdict["passed"], verdict
    assert torch.isfinite(out).all() and (out[::3, ::7] == 0).all()


@on_gpu
def test_many_short_rows_and_no_rows():
    x = sm.inputs(2**20 + 3, 3, torch.float32, DEV, seed=6)        # grids of many blocks, 3-wide rows
    for v in ("cuda", "warp_row", "warp_packed"):
        assert sm.check_variant(v, x, torch.empty_like(x))["passed"], v
    empty = torch.empty(0, 5, device=DEV)
    assert sm.softmax(empty).shape == (0, 5)
    ones = sm.softmax(sm.inputs(7, 1, torch.bfloat16, DEV, seed=7))
    torch.cuda.synchronize()
    assert (ones == 1).all()


@on_gpu
def test_cluster_row_is_refused_cleanly_before_sm90():
    if sm.has_clusters(DEV):
        pytest.skip("this GPU has thread-block clusters")
    with pytest.raises(LabError, match="needs thread-block clusters"):
        sm.softmax(torch.rand(4, 100, device=DEV), "cluster_row")


@on_gpu
def test_lab_run_softmax_quick(tmp_path):
    from conftest import run_lab

    from common.records import load_records
    proc = run_lab("run", "phase2.softmax", "--quick", "--results", tmp_path / "r", timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [rec] = load_records(tmp_path / "r")
    assert all(row["status"] == "ok" for row in rec["rows"]), [r for r in rec["rows"] if r["status"] != "ok"]
    ours = [row for row in rec["rows"] if row["variant"] in sm.VARIANTS]
    assert ours and all("pct_of_copy_bandwidth" in r["metrics"] and "speedup_vs_torch" in r["metrics"] for r in ours)
    assert all(r["metrics"]["kernel"] in sm.KERNELS for r in ours if r["variant"] == "cuda")
    assert all(v["passed"] for checks in rec["summary"]["irregular_checks"].values() for v in checks.values())
    assert rec["summary"]["seed_row_sum_checks"]["cuda"]["max_row_sum_error"] < 1e-5
    for res in rec["summary"]["build"]["resources"].values():
        assert res["spill_stores_bytes"] == 0
