"""Phase 2 on a CPU-only machine: every .cu compiles with nvcc (sm_80 and sm_90, compile-only),
ptxas reports no spills, build failures and a missing nvcc are one-line LabErrors, and the Python
wrappers refuse bad arguments before any launch."""
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import cpu_only

from common.errors import LabError
from common.registry import select
from phases.phase2_cuda import build
from phases.phase2_cuda import matmul as mm
from phases.phase2_cuda import vector_add as va

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc on PATH")
ARCHS = ("sm_80", "sm_90")
KERNELS = {"vector_add.cu": ["vector_add", "vector_add_vec4"]}
for _rung in mm.RUNGS.values():
    KERNELS.setdefault(_rung.source, [])
    if _rung.kernel not in KERNELS[_rung.source]:
        KERNELS[_rung.source].append(_rung.kernel)
# Kernels a launcher picks besides the rung's own: the warptiled rungs' scalar-load fallbacks.
KERNELS["matmul.cu"] += ["matmul_warptiled_scalar", "matmul_warptiled_1stage_scalar"]
KERNELS["matmul_wgmma.cu"] += ["matmul_sum_splits"]          # the wgmma rungs' split-K reduction
KERNELS["matmul_mma.cu"] += ["matmul_mma_sum_splits"]         # mma_bf16_pipelined's


def archs_for(source: str) -> tuple[str, ...]:
    """Arch-specific sources (wgmma, setmaxnreg) exist for sm_90a only; the rest build for both."""
    return ("sm_90",) if build.ARCH_SPECIFIC_MARK in (build.HERE / source).read_text() else ARCHS


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Every source for every arch, built in parallel into a private cache folder."""
    cache = tmp_path_factory.mktemp("cuda-cache")
    jobs = [(src, arch) for src in KERNELS for arch in archs_for(src)]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        done = pool.map(lambda j: build.build(j[0], j[1], cache_dir=cache), jobs)
    return cache, dict(zip(jobs, done))


# Sources whose compile-and-spill checks live in their own test module (softmax.cu: 49 kernels).
CHECKED_ELSEWHERE = {"softmax.cu": "tests/test_phase2_softmax.py"}


def test_every_source_is_listed():
    assert set(build.SOURCES) == set(KERNELS) | set(CHECKED_ELSEWHERE)


@needs_nvcc
def test_the_split_rules_in_c_are_the_ones_python_counts_with(builds):
    """lab_wgmma_ws_split_k / lab_wgmma_tma_split_k / lab_mma_pipelined_split_k are host code: the
    built libraries load and run them without a GPU. They must agree with rungs.ws_split_k /
    tma_split_k / mma_split_k (what work() and the records count launches with) on random shapes
    and SM counts."""
    import ctypes
    import random
    from phases.phase2_cuda.rungs import mma_split_k, tma_split_k, ws_split_k
    _, done = builds
    try:
        lib = ctypes.CDLL(str(done[("matmul_wgmma.cu", "sm_90")].path))
        mma = ctypes.CDLL(str(done[("matmul_mma.cu", "sm_90")].path))
    except OSError as e:                             # no libcudart to load it against
        pytest.skip(f"cannot load the library here: {e}")
    lib.lab_wgmma_ws_split_k.argtypes = lib.lab_wgmma_tma_split_k.argtypes = [ctypes.c_int] * 4
    mma.lab_mma_pipelined_split_k.argtypes = [ctypes.c_int] * 4
    rng, seen_split = random.Random(37), 0
    for _ in range(5000):
        m, n, k, sms = rng.choice([rng.randint(1, 64), rng.randint(1, 9000)]), rng.randint(1, 20000), \
            rng.randint(1, 70000), rng.choice([78, 108, 114, 132])
        if max(m * k, k * n, m * n) >= 2**31:
            continue
        assert lib.lab_wgmma_ws_split_k(m, n, k, sms) == ws_split_k(m, n, k, sms), (m, n, k, sms)
        assert lib.lab_wgmma_tma_split_k(m, n, k, sms) == tma_split_k(m, n, k, sms), (m, n, k, sms)
        assert mma.lab_mma_pipelined_split_k(m, n, k, sms) == mma_split_k(m, n, k, sms), (m, n, k, sms)
        seen_split += ws_split_k(m, n, k, sms) > 1
    assert seen_split > 100                          # the comparison covered split shapes, not only 1s


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", sorted(KERNELS))
def test_source_compiles_without_spills(builds, source, arch):
    if arch not in archs_for(source):
        pytest.skip(f"{source} is built for sm_90a only")
    _, done = builds
    b = done[(source, arch)]
    if build.ARCH_SPECIFIC_MARK in (build.HERE / source).read_text():
        assert b.arch == arch + "a" and f"-gencode=arch=compute_{arch[3:]}a,code=sm_{arch[3:]}a" in b.flags
    else:
        assert b.arch == arch and f"-arch={arch}" in b.flags
    assert b.path.exists()
    assert "-O3" in b.flags and "-v" in b.flags
    for kernel in KERNELS[source]:
        res = b.resources[kernel]
        assert res["registers"] and res["registers"] <= 255, (kernel, res)
        assert res["spill_stores_bytes"] == 0 and res["spill_loads_bytes"] == 0, (kernel, res)
        assert res["stack_bytes"] == 0, (kernel, res)
    if source == "matmul.cu":
        assert b.resources["matmul_tiled"]["smem_bytes"] == 16 * 16 * 4 + 16 * 17 * 4
        assert b.resources["matmul_regblock"]["smem_bytes"] == 2 * 64 * 16 * 4
        assert b.resources["matmul_regblock_1d"]["smem_bytes"] == 64 * 8 * 4 + 8 * 64 * 4
        # The warptiled rungs: stages of BK = 8 rows of A transposed (128 + 4 padding floats) and of
        # B (128). warptiled_1stage: one stage, 256 threads, __launch_bounds__(256, 2), so <= 128
        # registers for 2 blocks per SM. warptiled: a 3-stage cp.async ring, 128 threads of 8x16
        # outputs, __launch_bounds__(128, 2): two blocks of 128 threads must fit the 64K registers.
        stage = 8 * (128 + 4 + 128) * 4
        for kernel in ("matmul_warptiled_1stage", "matmul_warptiled_1stage_scalar"):
            res = b.resources[kernel]
            assert res["smem_bytes"] == stage == 8_320, (kernel, res)
            assert res["registers"] <= 128, (kernel, res)
        for kernel in ("matmul_warptiled", "matmul_warptiled_scalar"):
            res = b.resources[kernel]
            assert res["smem_bytes"] == 3 * stage == 24_960, (kernel, res)
            assert res["registers"] <= 255 and 2 * 128 * res["registers"] <= 65536, (kernel, res)
    if source == "matmul_mma.cu":
        assert b.resources["matmul_mma_bf16"]["smem_bytes"] == 2 * 64 * 40 * 2
        # mma_bf16_pipelined takes its 3-4 x 48 KB ring as dynamic shared memory (set at launch, so
        # no static smem here); its scalar-load fallback for unaligned operands must not spill either.
        for kernel in ("matmul_mma_bf16_pipelined", "matmul_mma_bf16_pipelined_scalar"):
            res = b.resources[kernel]
            assert res["smem_bytes"] == 0 and res["stack_bytes"] == 0, (kernel, res)
            assert res["spill_stores_bytes"] == 0 and res["spill_loads_bytes"] == 0, (kernel, res)


@needs_nvcc
def test_second_build_is_cached(builds):
    cache, done = builds
    again = build.build("vector_add.cu", "sm_90", cache_dir=cache)
    assert again.cached and again.path == done[("vector_add.cu", "sm_90")].path
    assert again.resources == done[("vector_add.cu", "sm_90")].resources


@needs_nvcc
def test_compile_error_is_one_line(tmp_path):
    src = tmp_path / "broken.cu"
    src.write_text('extern "C" __global__ void k(float* x) { x[0] = undefined_name; }\n')
    with pytest.raises(LabError) as e:
        build.build(src, "sm_90", cache_dir=tmp_path / "cache")
    msg = str(e.value)
    assert "\n" not in msg and "broken.cu" in msg and "error" in msg and "undefined_name" in msg
    assert str(tmp_path) not in msg                     # no absolute paths in the one line


def test_missing_nvcc_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(LabError) as e:
        build.build("vector_add.cu", "sm_90", cache_dir=tmp_path)
    assert "\n" not in str(e.value) and "nvcc" in str(e.value)


def test_arch_flags():
    assert build.arch_flags("sm_90") == ["-arch=sm_90"]
    assert build.arch_flags("sm_90a") == ["-gencode=arch=compute_90a,code=sm_90a"]
    assert build.target_arch(build.ARCH_SPECIFIC_MARK + "\n", "sm_90") == "sm_90a"
    assert build.target_arch("plain", "sm_90") == "sm_90"
    with pytest.raises(LabError):
        build.arch_flags("compute_90")


def test_parse_ptxas():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k1' for 'sm_90'
ptxas info    : Function properties for k1
    8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 4096 bytes smem
ptxas info    : Compiling entry function 'k2' for 'sm_90'
ptxas info    : Function properties for k2
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers, 384 bytes cmem[0]
"""
    assert build.parse_ptxas(log) == {
        "k1": {"registers": 255, "spill_stores_bytes": 12, "spill_loads_bytes": 16, "smem_bytes": 4096,
               "stack_bytes": 8},
        "k2": {"registers": 10, "spill_stores_bytes": 0, "spill_loads_bytes": 0, "smem_bytes": 0,
               "stack_bytes": 0}}


# ------------------------------------------------------------------------------ wrappers, before launch
def test_vector_add_validation():
    a = torch.rand(10)
    with pytest.raises(TypeError, match="float32"):
        va.add(a.double(), a)
    with pytest.raises(ValueError, match="contiguous"):
        va.add(torch.rand(10, 2).t(), torch.rand(2, 10))
    with pytest.raises(ValueError, match="shapes differ"):
        va.add(a, torch.rand(11))
    with pytest.raises(ValueError, match="shapes differ"):
        va.add(a, a, torch.empty(9))
    with pytest.raises(ValueError, match="unknown vector add variant"):
        va.add(a, a, variant="fastest")
    unaligned = torch.rand(11)[1:]
    with pytest.raises(ValueError, match="16-byte aligned"):
        va.add(unaligned, unaligned, variant="cuda_vec4")


@pytest.mark.parametrize("variant", mm.VARIANTS)
def test_matmul_validation(variant):
    dt, out_dt = mm.dtypes(variant)
    other = torch.float64 if dt == torch.float32 else torch.float32
    a, b = torch.rand(5, 3).to(dt), torch.rand(3, 4).to(dt)
    with pytest.raises(TypeError, match=str(dt)):
        mm.matmul(a.to(other), b, variant)
    with pytest.raises(ValueError, match="inner dimensions"):
        mm.matmul(a, torch.rand(4, 4).to(dt), variant)
    with pytest.raises(ValueError, match="2-D"):
        mm.matmul(a.reshape(-1), b, variant)
    with pytest.raises(ValueError, match="contiguous"):
        mm.matmul(torch.rand(3, 5).to(dt).t(), b, variant)
    with pytest.raises(ValueError, match=r"out must be \(5, 4\)"):
        mm.matmul(a, b, variant, torch.empty(4, 5, dtype=out_dt))
    with pytest.raises(TypeError, match=f"out must be {out_dt}"):
        mm.matmul(a, b, variant, torch.empty(5, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown matmul variant"):
        mm.matmul(a, b, "fastest")


@cpu_only
def test_valid_arguments_without_a_gpu_are_one_line():
    with pytest.raises(LabError, match="needs a CUDA GPU"):
        va.add(torch.rand(10), torch.rand(10))
    with pytest.raises(LabError, match="needs a CUDA GPU"):
        mm.matmul(torch.rand(5, 3), torch.rand(3, 4), "tiled")


def test_exercises_declare_their_needs():
    EXERCISES = select(["2"])
    assert [e.id for e in EXERCISES] == ["phase2.vector_add", "phase2.matmul", "phase2.softmax", "phase2.traffic"]
    for e in EXERCISES:
        assert e.needs.cuda and "nvcc" in e.needs.tools
    m = EXERCISES[1]
    assert m.params["sizes"] == [1024, 2048, 4096, 8192] and m.params["naive_max_n"] == 8192
    assert set(mm.VARIANTS) <= set(m.variants) and "broken_skip_k_tail" not in m.variants
    assert EXERCISES[0].params["sizes"][0] == 4096 * 256


@cpu_only
def test_lab_run_2_skips_on_cpu(lab, tmp_path):
    rc, out, err = lab("run", "2", "--quick", "--results", tmp_path / "r")
    assert rc != 0 and "skipped" in out and "needs a CUDA GPU" in out
