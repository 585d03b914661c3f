"""Phase 5's quantization report with records of more than one model: a run with
`--param model=...` adds its rows to the tables (a model column), while the "8B" goals, the findings
and the briefs keep reading the 8B's rows, whichever record is newer."""
import copy
import json

import pytest

from common import render
from common.formats import ratio
from common.frame import Frame
from common.records import load_records, write_record
from common.paths import REPO_ROOT
from phases.phase5_inference import report as p5
from phases.phase5_inference.reporting import findings

GOAL = "8B batch-1 decode, int4 (the CUDA kernel) against bf16 (same run)"


def newest_8b_record() -> dict:
    paths = sorted((REPO_ROOT / "results" / "phase5" / "quant_engine").glob("*/*.json"))
    for path in reversed(paths):
        rec = json.loads(path.read_text())
        if rec["params"].get("model") == "llama-3.1-8b" and rec["status"] == "ok" and not rec["provenance"]["quick"]:
            return rec
    pytest.skip("no full 8B phase5.quant_engine record in results/")


def as_model(rec: dict, model: str, factor: float, started: str) -> dict:
    """A copy of `rec` that claims to have measured `model`, its speedups scaled by `factor`."""
    other = copy.deepcopy(rec)
    other["params"]["model"] = model
    other["provenance"]["started_utc"] = started
    for row in other["rows"]:
        row["params"]["model"] = model
        if "speedup_vs_bf16" in row["metrics"]:
            row["metrics"]["speedup_vs_bf16"] *= factor
    return other


def test_a_newer_record_of_another_model_leaves_the_8b_goals_and_findings(tmp_path):
    base = newest_8b_record()
    eight_b = as_model(base, "llama-3.1-8b", 1.0, "2030-01-01T00:00:00Z")
    small = as_model(base, "llama-3.2-1b", 4.0, "2030-01-02T00:00:00Z")        # newer, and far faster
    for rec in (eight_b, small):
        write_record(rec, tmp_path)
    view = render.View(Frame.of(load_records(tmp_path)), tmp_path / "README.md", tmp_path)

    cuda_b1 = next(r for r in eight_b["rows"] if r["variant"] == "int4_cuda" and r["params"]["batch"] == 1)
    [line] = [ln for ln in render.goals(view, p5.GOALS).splitlines() if GOAL in ln]
    assert f"| {ratio(cuda_b1['metrics']['speedup_vs_bf16'])} |" in line
    assert f"| {ratio(4.0 * cuda_b1['metrics']['speedup_vs_bf16'])} |" not in line

    text = findings.findings(view)
    assert f"{ratio(cuda_b1['metrics']['speedup_vs_bf16'])} bf16 at batch 1" in text

    table = render.table(view, p5.QUANT_ENGINE_TABLE)                 # both models, told apart
    assert "| model |" in table and "| llama-3.2-1b |" in table and "| llama-3.1-8b |" in table
