"""Phase 2's report and analysis on a CPU machine: every declared block renders from the committed
records without torch, the ladder arithmetic, the standalone modules, the CPU emulation of matmul.cu."""
import shutil
import subprocess
import sys

import pytest
from conftest import clean_env, cpu_only

from common.paths import REPO_ROOT
from phases.phase2_cuda import analysis
from phases.phase2_cuda.rungs import FP32_RUNGS, MMA_RUNGS, RUNGS, VARIANTS, WGMMA_RUNGS

def test_rung_families():
    assert FP32_RUNGS == ("naive", "tiled", "regblock_1d", "coalesced_regblock", "warptiled_1stage", "warptiled")
    assert MMA_RUNGS == ("mma_bf16", "mma_bf16_pipelined") and all(v.startswith("wgmma_") for v in WGMMA_RUNGS)
    assert "broken_skip_k_tail" in RUNGS and "broken_skip_k_tail" not in VARIANTS


def test_ladder_steps():
    points = [("naive", 64, 1.0), ("tiled", 64, 2.0), ("regblock_1d", 64, 3.0), ("mma_bf16", 64, 10.0),
              ("wgmma_tma_ws", 64, 40.0), ("wgmma_tma_ws_tma_store", 64, 44.0), ("wgmma_tma_ws_cluster", 64, 30.0),
              ("cublas_fp32", 64, 5.0), ("tiled", 128, 4.0)]
    steps = analysis.ladder_steps(points)
    assert steps[("naive", 64)] == (None, None) and steps[("mma_bf16", 64)] == (None, None)   # first of a dtype
    assert steps[("tiled", 64)] == ("naive", 2.0) and steps[("regblock_1d", 64)] == ("tiled", 1.5)
    assert steps[("wgmma_tma_ws", 64)] == ("mma_bf16", 4.0)          # wgmma_tma did not run: the last bf16 rung
    assert steps[("wgmma_tma_ws_tma_store", 64)] == ("wgmma_tma_ws", 1.1)
    assert steps[("wgmma_tma_ws_cluster", 64)] == ("wgmma_tma_ws", 0.75)   # a side branch: its named base
    assert steps[("tiled", 128)] == (None, None) and ("cublas_fp32", 64) not in steps
    assert analysis.ladder_sizes(points) == [64]
    assert analysis.ladder_sizes([("naive", n, 1.0) for n in (8, 16, 32)]) == [16, 32]


def test_tiling_reduction():
    naive = {"predicted_global_load_bytes": 8, "global_load_bytes": 16, "l2_read_bytes": 4, "dram_bytes": 2}
    tiled = {"predicted_global_load_bytes": 1, "global_load_bytes": 2, "l2_read_bytes": 4, "dram_bytes": 4}
    assert analysis.tiling_reduction(naive, tiled) == {
        "predicted_global_load_reduction": 8, "tiling_global_load_reduction": 8, "tiling_l2_read_reduction": 1,
        "tiling_dram_reduction": 0.5}


@cpu_only
@pytest.mark.parametrize("module", ["vector_add", "matmul", "softmax", "traffic"])
def test_each_exercise_runs_alone(module):
    proc = subprocess.run([sys.executable, "-m", f"phases.phase2_cuda.{module}"], capture_output=True, text=True,
                          cwd=REPO_ROOT, env=clean_env(), timeout=120)
    assert proc.returncode == 3 and "skipped: needs a CUDA GPU" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_matmul_on_cpu_bank_patterns():
    proc = subprocess.run([sys.executable, "-m", "phases.phase2_cuda.matmul_on_cpu", "--banks-only"],
                          capture_output=True, text=True, cwd=REPO_ROOT, env=clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "worst LDS.128 2 wavefronts" in proc.stdout
