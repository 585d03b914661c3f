"""Phase 6's report from records: a JAX attention record made on the CPU gives the generated answer
to "did XLA fuse attention" (from its HLO), the headline and the goals; goals nobody has measured
are listed as not measured; the report stays torch-free."""
import subprocess
import sys

import pytest

from common import render, report
from common.records import load_records, write_record
from common.registry import select
from common.runner import run_one
from conftest import REPO, as_full_run, clean_env
from phases.phase6_hardware import findings
from phases.phase6_hardware.report import GOALS, PHASE, headline


@pytest.fixture(scope="module")
def attention_view(tmp_path_factory):
    """One record of the attention exercise on the CPU, at the seed's S and d, under the H200's spec."""
    pytest.importorskip("jax")
    import torch
    from common.exercise import Context
    from common.hardware import load_hardware
    from common.runner import static_blocks
    ctx = Context(torch.device("cpu"), load_hardware()["h200_sxm"], "h200_sxm",
                  ("jax_jit_math", "jax_dpa_cudnn", "sdpa_math"), True)
    [ex] = select(["phase6.jax_attention"])
    params = ex.resolve_params(True, True, {"shapes": [[1, 2, 2048, 64]]})
    folder = tmp_path_factory.mktemp("phase6-results")
    write_record(as_full_run(run_one(ex, ctx, params, static_blocks(ctx, ["lab", "run", "test"]), None, None)), folder)
    return render.View(report.frame_of(load_records(folder)), folder / "README.md", folder)


def test_the_fusion_answer_is_generated_from_the_hlo(attention_view):
    text = findings.fusion(attention_view)
    rows = attention_view.latest("phase6.jax_attention")
    plain = rows[rows["variant"] == "jax_jit_math"].iloc[0]
    assert text.startswith("**NVIDIA H200 SXM:**\n\n- At B=1, H=2, S=2048, d=64, jax.jit of the plain math compiled to "
                           f"{int(plain['metrics.hlo_kernels'])} kernels")
    answer = "XLA did not fuse attention" if plain["metrics.score_materialized"] else "XLA fused attention"
    assert answer in text and findings.verdict(plain) in text and "SDPA's best backend (sdpa_math)" in text
    assert "Refused at B=1, H=2, S=2048, d=64: jax_dpa_cudnn (" in text and "TPU v5e" in text           # the seed's claim, labelled
    [line] = [ln for ln in render.goals(attention_view, GOALS).splitlines() if "S x S scores" in ln]
    assert "| NVIDIA H200 SXM |" in line
    assert ("| 1 (in memory) | **not met** |" if plain["metrics.score_materialized"] else "| 0 (fused) | met |") in line
    assert headline(attention_view) == [f"NVIDIA H200 SXM: {answer[:-10]} attention ({int(plain['metrics.hlo_kernels'])} kernels)"]


def test_goals_nobody_measured_are_listed_as_not_measured(attention_view):
    lines = render.goals(attention_view, GOALS).splitlines()[2:]
    unmeasured = [ln for ln in lines if ln.startswith("| - |")]
    assert len(unmeasured) == 1 and "JAX bf16 matmul" in unmeasured[0] and "| not measured |" in unmeasured[0]


def test_phase6_report_is_torch_free():
    code = ("import sys\nfrom phases.phase6_hardware import report\nfrom common.report import blocks\n"
            "assert 'phase6.rooflines' in blocks()\nprint('torch' in sys.modules, 'jax' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=clean_env(),
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["False", "False"], proc.stdout + proc.stderr
    assert PHASE.folder == "phase6_hardware" and PHASE.number == 6
