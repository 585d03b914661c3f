"""`lab run 7 --quick` end to end on a CPU: five valid records, and the phase 7 README blocks and
plots written from them; the report renders every block of the committed records without torch."""
import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

from common import render, report
from common.frame import Frame
from common.records import load_records, problems
from phases.phase7_gpt import analysis
from phases.phase7_gpt.report import PHASE
from conftest import as_full_run, json_files

REPO = Path(__file__).resolve().parent.parent
EXS = ["phase7.data_prep", "phase7.model", "phase7.overfit", "phase7.scaling", "phase7.failures"]
HAS_TIKTOKEN = importlib.util.find_spec("tiktoken") is not None


@pytest.fixture(scope="module")
def quick7(tmp_path_factory):
    from common.cli import main
    results = tmp_path_factory.mktemp("p7") / "results"
    rc = main(["run", "7", "--quick", "--results", str(results)])
    return rc, results, load_records(results)


@pytest.fixture(scope="module")
def full7(quick7, tmp_path_factory):
    """The quick run's records passed off as a full run's (the report never reads smoke records),
    in a copy of its results folder: (results, records)."""
    _, results, _ = quick7
    folder = tmp_path_factory.mktemp("p7-full") / "results"
    shutil.copytree(results, folder)
    for path in json_files(folder):
        path.write_text(json.dumps(as_full_run(json.loads(path.read_text())), indent=2))
    return folder, load_records(folder)


def _rec(records, ex):
    [r] = [r for r in records if r["exercise"]["id"] == ex]
    return r


def test_quick_run_writes_a_valid_record_per_exercise(quick7):
    rc, _, records = quick7
    assert rc == 0
    assert sorted(r["exercise"]["id"] for r in records) == sorted(EXS)
    for rec in records:
        rec = dict(rec)
        path = rec.pop("_path")
        assert problems(rec) == [], path
        assert rec["status"] == ("skipped" if rec["exercise"]["id"] == "phase7.data_prep" and not HAS_TIKTOKEN else "ok"), \
            (path, rec["reason"])


def test_training_rows_carry_curves_timing_and_predictions(quick7):
    _, _, records = quick7
    for ex in EXS[2:]:
        for r in _rec(records, ex)["rows"]:
            assert r["status"] == "ok", (ex, r["variant"], r["reason"])
            m = r["metrics"]
            assert r["timing"]["method"].endswith("per training step") and r["prediction"]["flops"] > 0
            assert r["check"]["passed"]
            assert m["tokens_per_s"] > 0 and m["mfu_pct_of_spec"] > 0
            assert m["curve"][0][0] == 0 and len(m["train_loss_per_step"]) == m["steps"]
            assert len(m["grad_norm_per_step"]) == m["steps"] and m["grad_norm_max"] is not None
    ov = {r["variant"]: r for r in _rec(records, "phase7.overfit")["rows"]}
    assert set(ov) == {"throughput", "throughput_eager", "large", "small", "reproducibility"}
    assert ov["large"]["metrics"]["sample"]["text"].startswith("\n")
    assert set(ov["throughput"]["metrics"]["step_breakdown"]) >= {"data_ms", "forward_ms", "backward_ms", "optimizer_ms"}
    assert ov["reproducibility"]["metrics"]["loss_difference"] == 0.0          # CPU: bit for bit
    sc = _rec(records, "phase7.scaling")["summary"]
    assert sc["fit_total"]["points"] == sc["fit_non_embedding"]["points"] == 4
    fa = {r["variant"]: r["metrics"] for r in _rec(records, "phase7.failures")["rows"]}
    assert fa["no_residual_no_layernorm"]["switches"] == {"residual": False, "layernorm": False, "warmup_iters": 4,
                                                          "lr": 1e-3, "grad_clip": 1.0}
    assert fa["lr_x100"]["switches"]["lr"] == pytest.approx(0.1) and fa["no_clip"]["switches"]["grad_clip"] == 0.0
    assert fa["warmup_none"]["switches"]["warmup_iters"] == 0
    assert all(m["outcome"] for m in fa.values())


def test_model_record_matches_the_seeds_counts(quick7):
    _, _, records = quick7
    rows = {r["variant"]: r for r in _rec(records, "phase7.model")["rows"]}
    assert rows["params_30m"]["metrics"]["total"] == 30_023_808
    assert rows["params_30m_untied"]["metrics"]["total"] == 30_023_808 + 50257 * 384
    assert rows["init_loss"]["status"] == "ok"
    assert {rows["sdpa_flash"]["status"], rows["sdpa_math"]["status"]} <= {"ok", "skipped"}


def test_timed_rows_record_the_cost_models_counts(quick7):
    """Every timed row's FLOPs, bytes and launches are cost.step_cost's for the row's parameters (a CPU:
    fp32 activations, eager), and its prediction carries the launches."""
    from phases.phase7_gpt.cost import GPTConfig, step_cost
    _, _, records = quick7
    timed = 0
    for ex in EXS[1:]:
        for r in _rec(records, ex)["rows"]:
            if r["status"] != "ok" or not r["timing"]:
                continue
            cfg, p = GPTConfig(**r["params"]["model"]), r["prediction"]
            if ex == "phase7.model":
                c = step_cost(cfg, r["params"]["batch"][0], "fp32", optimizer=False, data=False,
                              attention="flash" if r["variant"] == "sdpa_flash" else "math")
            else:
                tc = r["params"]["train"]
                c = step_cost(cfg, tc["batch_size"], "fp32", compiled=False, clip=tc["grad_clip"] > 0)
                assert r["metrics"]["bytes_per_step_parts"]["total"] == c["bytes"]
            assert (p["flops"], p["bytes"], p["launches"], p["dtype"]) == (c["flops"], c["bytes"], c["launches"], "fp32")
            timed += 1
    assert timed >= 5 + 4 + 9


BLOCKS = [b.id for b in PHASE.blocks]
README = "# Phase 7\n\n" + "\n\n".join(f"<!-- lab:begin {b} -->\nold\n<!-- lab:end {b} -->" for b in BLOCKS) + "\n"


def test_quick_records_carry_the_analysis(quick7):
    _, _, records = quick7
    ov = _rec(records, "phase7.overfit")
    rows = {r["variant"]: r["metrics"] for r in ov["rows"]}
    assert ov["summary"]["goal_tokens_per_s"] == analysis.GOAL_TOKENS_PER_S
    assert ov["summary"]["goal_met"] == (rows["throughput"]["tokens_per_s"] >= analysis.GOAL_TOKENS_PER_S)
    assert rows["large"]["val_rose"] is not None and rows["throughput_eager"]["compiled"] is False
    sc = _rec(records, "phase7.scaling")["summary"]
    assert sc["smallest"] == "nano" and sc["largest"] == "small" and sc["n_ratio"] > 1


def test_report_blocks_and_plots_from_the_records(full7, tmp_path, monkeypatch):
    results, records = full7
    readme = tmp_path / "README.md"
    readme.write_text(README)
    monkeypatch.setattr(report, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(report, "readmes", lambda: [readme])
    monkeypatch.setattr(report, "phases", lambda: [PHASE])        # REPO_ROOT moved: name the phase
    quiet = lambda *a, **k: None                                                  # noqa: E731
    assert report.regenerate(check=True, results=str(results), echo=quiet) == 1
    assert report.regenerate(check=False, results=str(results), echo=quiet) == 0
    text = readme.read_text()
    for block in BLOCKS:
        body = re.search(rf"<!-- lab:begin {re.escape(block)} -->\n(.*?)<!-- lab:end", text, re.S).group(1)
        assert body.strip() != "old" and "No records" not in body and "No phase 7" not in body or \
            (block == "phase7.data_prep" and not HAS_TIKTOKEN), block
    assert "30,023,808" in text and "Fit over non-embedding parameters" in text
    if HAS_TIKTOKEN:
        assert "338,025" in text
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert len(images) == 3 and all((readme.parent / link).resolve().is_file() for link in images)
    plots = sorted(p.name for p in (results / "plots").iterdir())
    assert plots == ["phase7_failures_cpu.png", "phase7_overfit_cpu.png", "phase7_scaling_cpu.png"]
    assert report.regenerate(check=True, results=str(results), echo=quiet) == 0      # in sync, plots present


def test_headline(full7):
    results, records = full7
    [line] = PHASE.headline(render.View(Frame.of(records), REPO / "README.md", results))
    assert "tokens/s" in line and "scaling exponent" in line


def test_blocks_render_without_records():
    view = render.View(Frame.of([]), REPO / "phases" / "phase7_gpt" / "README.md", REPO / "results")
    for block in PHASE.blocks:
        assert render.block(view, block).startswith("_No"), block.id
