"""Phase 0 and 1 exercises: the arithmetic each module documents, on tiny sizes."""
import importlib
import subprocess

import pytest
import torch

from common import ncu
from common.errors import LabError
from conftest import by_exercise, cpu_only

nsight = importlib.import_module("phases.phase1_roofline.nsight")
cache_sweep = importlib.import_module("phases.phase1_roofline.cache_sweep")
matmul = importlib.import_module("phases.phase1_roofline.matmul_fp16")
elementwise = importlib.import_module("phases.phase1_roofline.elementwise")
gates = importlib.import_module("phases.phase0_environment.gates")


def ok_rows(rec):
    return [r for r in rec["rows"] if r["status"] == "ok"]


# ------------------------------------------------------------------------------ elementwise
def test_elementwise_arithmetic(spec_ctx):
    n = 10_007
    rows = elementwise.run(spec_ctx(), {"sizes": [n]}).rows
    by = {r["variant"]: r for r in rows}
    assert set(by) == {"copy", "mul"} and all(r["status"] == "ok" for r in rows)
    mul, cp = by["mul"]["prediction"], by["copy"]["prediction"]
    assert (mul["flops"], mul["bytes"]) == (n, 12 * n)
    assert mul["intensity_flop_per_byte"] == pytest.approx(1 / 12)
    assert mul["bound"] == "memory"
    assert (cp["flops"], cp["bytes"]) == (0, 8 * n)
    assert by["mul"]["params"]["working_set_bytes"] == 12 * n
    assert by["mul"]["metrics"]["pct_of_copy_bandwidth"] == pytest.approx(
        100 * by["mul"]["metrics"]["gbps"] / by["copy"]["metrics"]["gbps"])
    assert by["mul"]["check"]["metric"] == "rel_l2" and by["copy"]["check"]["metric"] == "exact"


def test_elementwise_quick_record(quick_records):
    rec = by_exercise(quick_records, "phase1.elementwise")
    [n] = rec["params"]["sizes"]
    assert n % 2 and n % 1024                          # an irregular size, not a power of two
    for r in ok_rows(rec):
        want = (n, 12 * n) if r["variant"] == "mul" else (0, 8 * n)
        assert (r["prediction"]["flops"], r["prediction"]["bytes"]) == want


def test_elementwise_catches_a_broken_multiply(spec_ctx, monkeypatch):
    real_mul = torch.mul

    def half_written(a, b, out):                       # a kernel that skips the tail
        out[: out.numel() // 2] = real_mul(a, b)[: out.numel() // 2]

    monkeypatch.setattr(elementwise.torch, "mul", half_written)
    rows = elementwise.run(spec_ctx(variants=("mul",)), {"sizes": [1000]}).rows
    [r] = rows
    assert r["status"] == "failed" and "NaN" in r["reason"] and r["timing"] is None


# ------------------------------------------------------------------------------ matmul
@pytest.mark.parametrize("dtype, itemsize", [("fp32", 4), ("bf16", 2)])
def test_matmul_arithmetic(spec_ctx, dtype, itemsize):
    n = 40
    r = matmul.matmul_row(spec_ctx(), n, dtype)
    assert r["status"] == "ok", r["reason"]
    p = r["prediction"]
    assert (p["flops"], p["bytes"]) == (2 * n**3, 3 * n * n * itemsize)
    assert p["intensity_flop_per_byte"] == pytest.approx(2 * n**3 / (3 * n * n * itemsize))
    assert r["check"]["precision"] == dtype


def test_matmul_quick_records(quick_records):
    for ex_id in ("phase1.matmul_fp16", "phase1.regime_sweep", "phase0.matmul_baseline"):
        rec = by_exercise(quick_records, ex_id)
        rows = ok_rows(rec)
        assert rows, ex_id
        for r in rows:
            n = r["params"]["n"]
            itemsize = {"fp32": 4, "fp16": 2, "bf16": 2}[r["params"]["dtype"]]
            assert r["prediction"]["flops"] == 2 * n**3
            assert r["prediction"]["bytes"] == 3 * n * n * itemsize


def test_regime_sweep_summary(quick_records):
    rec = by_exercise(quick_records, "phase1.regime_sweep")
    s = rec["summary"]
    assert [r["params"]["n"] for r in rec["rows"]] == rec["params"]["sizes"]
    best = max(r["metrics"]["tflops"] for r in ok_rows(rec))
    assert s["measured_peak_tflops"] == pytest.approx(best)
    assert s["measured_ridge_flop_per_byte"] == pytest.approx(best * 1e3 / s["measured_copy_gbps"])
    assert s["measured_crossover_n"] == pytest.approx(3 * s["measured_ridge_flop_per_byte"])
    assert s["smallest_n_at_half_of_best"] in rec["params"]["sizes"]


@cpu_only
def test_matmul_baseline_quick_record(quick_records):
    rec = by_exercise(quick_records, "phase0.matmul_baseline")
    by = {r["variant"]: r for r in rec["rows"]}
    assert by["fp32"]["status"] == "ok" and by["fp32"]["params"]["tf32_allowed"] is False
    assert by["fp32"]["check"]["tolerance"] == 5e-5
    assert by["tf32"]["status"] == "skipped" and "tensor-core" in by["tf32"]["reason"]


def test_synchronize_quick_record(quick_records):
    rec = by_exercise(quick_records, "phase0.synchronize")
    by = {r["variant"]: r for r in rec["rows"]}
    assert set(by) == {"no_sync", "sync"}
    assert by["no_sync"]["params"]["synchronize"] is False and by["sync"]["params"]["synchronize"] is True
    assert all(r["check"]["passed"] for r in rec["rows"])     # checked before timed
    assert rec["summary"]["illusory_speedup"] == pytest.approx(
        by["sync"]["metrics"]["ms"] / by["no_sync"]["metrics"]["ms"])


@cpu_only
def test_gates_on_a_cpu_machine(quick_records):
    rec = by_exercise(quick_records, "phase0.gates")
    by = {r["variant"]: r for r in rec["rows"]}
    assert set(by) == {"driver", "nvcc", "torch_cuda", "torch_version"}
    assert by["torch_version"]["status"] == "ok"
    assert torch.__version__ in by["torch_version"]["metrics"]["observed"]
    assert by["torch_cuda"]["status"] == "skipped" and by["torch_cuda"]["reason"]
    for r in rec["rows"]:
        assert r["status"] == "ok" or r["reason"], r


def test_gate_catches_a_cpu_only_torch_on_a_gpu_machine(spec_ctx, monkeypatch):
    monkeypatch.setattr(gates.env, "run_quiet", lambda cmd, timeout=20.0: "550.54.15, NVIDIA H200")
    monkeypatch.setattr(gates.torch.cuda, "is_available", lambda: False)
    by = {r["variant"]: r for r in gates.run(spec_ctx(), {}).rows}
    assert by["driver"]["status"] == "ok"
    assert by["torch_cuda"]["status"] == "failed" and "CPU-only torch" in by["torch_cuda"]["reason"]


# ------------------------------------------------------------------------------ cache sweep
@pytest.mark.parametrize("ws, reps", [(1, 512), (2**20, 512), (2**21, 512), (2**22, 256),
                                      (2**26, 16), (3 * 2**20, 341), (2**29, 2),
                                      (2**30, None), (2**32, None)])
def test_graph_reps(ws, reps):
    """About 1 GiB per replay, at most 512 copies; None (direct timing) once one copy is ~1 GiB."""
    assert cache_sweep.graph_reps(ws) == reps


def test_graph_reps_bounds():
    for ws in [2**k for k in range(0, 36)] + [12345, 3 * 2**20 + 7, 2**29 + 1]:
        reps = cache_sweep.graph_reps(ws)
        if reps is None:
            assert 2 * ws > 2**30                       # one copy is already about 1 GiB
            continue
        assert 2 <= reps <= 512
        if reps < 512:                                  # inside the bounds a replay moves ~1 GiB
            assert 2**30 - ws < reps * ws <= 2**30


def test_cache_sweep_quick_record(quick_records):
    rec = by_exercise(quick_records, "phase1.cache_sweep")
    rows = ok_rows(rec)
    assert [r["params"]["working_set_bytes"] for r in rows] == rec["params"]["working_sets"]
    for r in rows:
        assert r["prediction"]["flops"] == 0 and r["prediction"]["bytes"] == r["params"]["working_set_bytes"]
        assert r["timing"]["flush_l2"] is False
    assert rec["summary"]["peak_gbps"] == pytest.approx(max(r["metrics"]["gbps"] for r in rows))


# ------------------------------------------------------------------------------ nsight
NCU_CSV = '''==PROF== Connected to process 48213 (/usr/bin/python3.11)
==PROF== Profiling "vectorized_elementwise_kernel" - 0: 0%....50%....100% - 9 passes
==PROF== Profiling "sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x256x64" - 1: 0%....50%....100% - 9 passes
==PROF== Disconnected from process 48213
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","48213","python3.11","127.0.0.1","void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float>>, std::array<char *, 3>>(int, T2, T3)","1","7","(128, 1, 1)","(262144, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","268,451,840"
"0","48213","python3.11","127.0.0.1","void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float>>, std::array<char *, 3>>(int, T2, T3)","1","7","(128, 1, 1)","(262144, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","134,225,920"
"0","48213","python3.11","127.0.0.1","void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float>>, std::array<char *, 3>>(int, T2, T3)","1","7","(128, 1, 1)","(262144, 1, 1)","0","9.0","Command line profiler metrics","dram__throughput.avg.pct_of_peak_sustained_elapsed","%","91.87"
"0","48213","python3.11","127.0.0.1","void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float>>, std::array<char *, 3>>(int, T2, T3)","1","7","(128, 1, 1)","(262144, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","96,672"
"0","48213","python3.11","127.0.0.1","void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float>>, std::array<char *, 3>>(int, T2, T3)","1","7","(128, 1, 1)","(262144, 1, 1)","0","9.0","Command line profiler metrics","sm__throughput.avg.pct_of_peak_sustained_elapsed","%","12.40"
"1","48213","python3.11","127.0.0.1","sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x256x64","1","7","(384, 1, 1)","(66, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","1,073,741,824"
"1","48213","python3.11","127.0.0.1","sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x256x64","1","7","(384, 1, 1)","(66, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","134,217,728"
"1","48213","python3.11","127.0.0.1","sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x256x64","1","7","(384, 1, 1)","(66, 1, 1)","0","9.0","Command line profiler metrics","dram__throughput.avg.pct_of_peak_sustained_elapsed","%","4.21"
"1","48213","python3.11","127.0.0.1","sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x256x64","1","7","(384, 1, 1)","(66, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","1,512,160"
"1","48213","python3.11","127.0.0.1","sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x256x64","1","7","(384, 1, 1)","(66, 1, 1)","0","9.0","Command line profiler metrics","sm__throughput.avg.pct_of_peak_sustained_elapsed","%","n/a"
==PROF== Report: none
'''


def test_parse_ncu_csv():
    kernels = ncu.parse_csv(NCU_CSV)
    assert len(kernels) == 2
    ew, mm = kernels
    assert ew["kernel"].startswith("void at::native::vectorized_elementwise_kernel<4, ")   # commas kept
    assert ew["dram__bytes_read.sum"] == 268_451_840.0
    assert ew["dram__bytes_write.sum"] == 134_225_920.0
    assert ew["dram__throughput.avg.pct_of_peak_sustained_elapsed"] == pytest.approx(91.87)
    assert ew["gpu__time_duration.sum"] == 96_672.0
    assert mm["kernel"] == "sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x256x64"
    assert mm["dram__bytes_read.sum"] == 1_073_741_824.0
    assert mm["sm__throughput.avg.pct_of_peak_sustained_elapsed"] is None      # "n/a"
    for k in kernels:
        assert all(isinstance(v, float) or v is None for key, v in k.items() if key != "kernel")


def test_parse_ncu_csv_without_a_table():
    assert ncu.parse_csv("==PROF== Disconnected from process 1\n==ERROR== no kernels were profiled\n") == []
    assert ncu.parse_csv("") == []


def test_ncu_command_leaves_the_clocks_alone():
    cmd = ncu.command("phases.phase1_roofline.nsight_target", ["elementwise", "1024"], nsight.METRICS)
    assert cmd[0] == "ncu" and "--csv" in cmd
    assert cmd[cmd.index("--clock-control") + 1] == "none"
    assert cmd[cmd.index("--metrics") + 1].split(",") == list(nsight.METRICS)
    assert cmd[-3:] == ["phases.phase1_roofline.nsight_target", "elementwise", "1024"]


def test_nsight_run_arithmetic(spec_ctx, monkeypatch):
    kernels = ncu.parse_csv(NCU_CSV)
    monkeypatch.setattr(nsight, "profile", lambda kind, n, timeout_s: [kernels[0] if kind == "elementwise" else kernels[1]])
    n_ew, n_mm = 33_554_432, 8192
    rows = nsight.run(spec_ctx(), {"elementwise_n": n_ew, "matmul_n": n_mm, "timeout_s": 1}).rows
    by = {r["variant"]: r["metrics"] for r in rows}
    ew, mm = by["elementwise"], by["matmul_fp16"]
    assert ew["ideal_bytes"] == 3 * n_ew * 4 and mm["ideal_bytes"] == 3 * n_mm**2 * 2
    assert ew["dram_bytes"] == 268_451_840 + 134_225_920
    assert ew["dram_bytes_over_ideal"] == pytest.approx(ew["dram_bytes"] / (12 * n_ew))
    assert ew["flops"] == n_ew and mm["flops"] == 2 * n_mm**3
    assert mm["intensity_ideal_flop_per_byte"] == pytest.approx(n_mm / 3)
    assert ew["ncu_kernel_ms"] == pytest.approx(0.096672)
    assert ew["dram_throughput_pct"] == pytest.approx(91.87) and mm["sm_throughput_pct"] is None


def test_nsight_profile_failure_is_one_line(monkeypatch):
    def fake_run(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, stdout="==PROF== Connected\n",
                                           stderr="==ERROR== ERR_NVGPUCTRPERM - The user does not have "
                                                  "permission to access NVIDIA GPU Performance Counters\n")

    monkeypatch.setattr(ncu.subprocess, "run", fake_run)
    with pytest.raises(LabError) as info:
        nsight.profile("elementwise", 1024, 10)
    assert "ERR_NVGPUCTRPERM" in str(info.value) and "\n" not in str(info.value)


@cpu_only
def test_nsight_and_timer_check_skip_on_cpu(quick_records):
    for ex_id in ("phase1.nsight", "phase0.timer_check"):
        rec = by_exercise(quick_records, ex_id)
        assert rec["status"] == "skipped" and rec["rows"] == []
        assert "needs a CUDA GPU" in rec["reason"] and "\n" not in rec["reason"]


def test_phase1_ceiling_is_read_from_the_runs_own_results_folder(tmp_path):
    # Phases 4 and 7 report MFU against the matmul rate phase 1 measured; the lookup must follow
    # --results, not the repo's default folder.
    import torch

    from common.cli import main
    from common.exercise import Context
    assert main(["run", "phase1.regime_sweep", "--quick", "--results", str(tmp_path / "with")]) == 0
    found = Context(torch.device("cpu"), None, "cpu", quick=True, results=tmp_path / "with").phase1_ceiling()
    assert found["tflops"] > 0 and found["source"].startswith("results/phase1/regime_sweep/cpu/")
    assert Context(torch.device("cpu"), None, "cpu", quick=True, results=tmp_path / "empty").phase1_ceiling() is None
    # a smoke run's ceiling is read only by smoke runs
    assert Context(torch.device("cpu"), None, "cpu", results=tmp_path / "with").phase1_ceiling() is None
