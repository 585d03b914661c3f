"""Records that are not results: `--quick` smoke runs are never reported, and a CPU or smoke run
writes to the git-ignored local-results/ unless told otherwise (issue 33, items 1, 4 and 6)."""
import json
import subprocess

import pytest

from common import paths, render, report
from common.errors import LabError
from common.records import load_records, write_record
from conftest import REPO, json_files


def _elementwise(make_record, *, gbps: float, quick: bool, started: str) -> dict:
    rec = make_record()
    rec["rows"][0]["metrics"].update(gbps=gbps, pct_of_peak_bandwidth=gbps / 0.3)
    rec["provenance"].update(quick=quick, started_utc=started)
    return rec


@pytest.fixture
def full_then_smoke(make_record, tmp_path):
    """A full run, then a newer smoke run of the same exercise on the same hardware."""
    res = tmp_path / "results"
    full = write_record(_elementwise(make_record, gbps=24.0, quick=False, started="2026-11-21T12:00:00Z"), res)
    smoke = write_record(_elementwise(make_record, gbps=99.0, quick=True, started="2026-11-22T12:00:00Z"), res)
    return res, full.relative_to(res).as_posix(), smoke.relative_to(res).as_posix()


def test_a_newer_smoke_record_never_reaches_a_table_headline_or_goal(full_then_smoke, tmp_path):
    res, full, smoke = full_then_smoke
    frame = report.frame_of(load_records(res))
    # every block (tables, headlines, goals, findings, plots) reads the frame: the smoke record is not in it
    assert set(frame.df["path"]) == {full}
    assert [r["_path"] for r in frame.records] == [full]
    view = render.View(frame, tmp_path / "README.md", res)
    headline = report.phase_table(view)
    assert "multiply 24 GB/s" in headline and "99" not in headline
    from phases.phase1_roofline.report import ELEMENTWISE
    table = render.table(view, ELEMENTWISE)
    assert "24" in table and "99" not in table


def test_only_smoke_records_are_nothing_to_report(make_record, tmp_path):
    res = tmp_path / "results"
    write_record(_elementwise(make_record, gbps=99.0, quick=True, started="2026-11-22T12:00:00Z"), res)
    with pytest.raises(LabError, match="other than `--quick` smoke runs"):
        report.regenerate(results=str(res), echo=lambda *a: None)


def test_a_smoke_ceilings_record_calibrates_only_smoke_runs(make_record, tmp_path):
    from common.exercise import Context
    import torch
    res = tmp_path / "results"
    rec = make_record(exercise={"id": "phase1.ceilings", "phase": 1, "name": "ceilings", "title": "t", "bench_version": 1},
                      summary={"ceilings": {"hbm_gbps": 10.0, "l2_gbps": None, "l2_bytes": None, "l2_fit_bytes": 0,
                                            "matmul_tflops": {"fp32": 0.1}, "launch_us": 2.0}})
    rec["provenance"]["quick"] = True
    write_record(rec, res)
    assert Context(torch.device("cpu"), None, "cpu", quick=False, results=res).ceilings() is None
    assert Context(torch.device("cpu"), None, "cpu", quick=True, results=res).ceilings()["hbm_gbps"] == 10.0


# ------------------------------------------------------------------------------ where a run writes
def test_cpu_and_quick_runs_default_to_local_results(monkeypatch, tmp_path):
    monkeypatch.delenv("LAB_RESULTS_DIR", raising=False)
    assert paths.run_results_dir(None, local=True) == paths.REPO_ROOT / "local-results"
    assert paths.run_results_dir(None, local=False) == paths.REPO_ROOT / "results"
    assert paths.run_results_dir("elsewhere", local=True).name == "elsewhere"        # --results wins
    monkeypatch.setenv("LAB_RESULTS_DIR", str(tmp_path))
    assert paths.run_results_dir(None, local=True) == tmp_path                        # and so does the variable


def test_local_results_is_ignored_by_git_and_by_the_report(monkeypatch):
    ignored = subprocess.run(["git", "check-ignore", "-q", "local-results/phase1/x/cpu/a.json"], cwd=REPO,
                             capture_output=True, timeout=60)
    if ignored.returncode == 128:
        pytest.skip("no git checkout here (a copy without .git)")
    assert ignored.returncode == 0
    monkeypatch.delenv("LAB_RESULTS_DIR", raising=False)
    assert paths.results_dir(None) == paths.REPO_ROOT / "results"      # what `lab report` reads by default


def test_a_quick_run_writes_to_local_results_and_says_so(lab, monkeypatch, tmp_path):
    """In process, with the repo's local-results/ pointed at a temp folder (nothing lands in the checkout)."""
    monkeypatch.delenv("LAB_RESULTS_DIR", raising=False)
    monkeypatch.setattr(paths, "LOCAL_RESULTS", str(tmp_path / "local-results"))     # absolute: replaces the repo's
    rc, out, err = lab("run", "phase0.synchronize", "--quick")
    assert rc == 0, out + err
    assert "[quick]" in out                                  # the label prints (rich no longer eats it)
    assert "records go to local-results/" in out
    files = json_files(tmp_path / "local-results")
    assert len(files) == 1 and json.loads(files[0].read_text())["provenance"]["quick"] is True
    assert "local-results/phase0/synchronize/cpu/" in out


def test_summary_names_each_record_by_its_folder_outside_the_repo(lab, tmp_path):
    res = tmp_path / "elsewhere"
    rc, out, err = lab("run", "phase0.synchronize", "phase0.gates", "--quick", "--results", res)
    assert rc == 0, out + err
    assert "elsewhere/phase0/synchronize/cpu/" in out and "elsewhere/phase0/gates/cpu/" in out
    assert "records go to" not in out                        # told where: nothing to announce
