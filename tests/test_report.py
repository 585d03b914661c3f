"""common/report.py, render.py, frame.py: README blocks regenerated from records, and --check."""
import copy
import json
import os
import re
import subprocess

import pytest

from common import formats, render, report
from common.frame import Frame
from common.errors import LabError
from common.records import load_records, write_record
from conftest import as_full_run, assert_one_line_error, by_exercise

README = """# A lab

Intro prose that the report must leave alone.

<!-- lab:begin phases -->
old phase table
<!-- lab:end phases -->

## Phase 0

<!-- lab:begin phase0.matmul_baseline -->
old
<!-- lab:end phase0.matmul_baseline -->

<!-- lab:begin phase0.findings -->
old
<!-- lab:end phase0.findings -->

## Phase 1

<!-- lab:begin phase1.elementwise -->
old
<!-- lab:end phase1.elementwise -->

<!-- lab:begin phase1.cache_sweep -->
old
<!-- lab:end phase1.cache_sweep -->

<!-- lab:begin phase1.findings -->
old
<!-- lab:end phase1.findings -->

Closing prose.
"""


def block(text: str, block_id: str) -> str:
    m = re.search(rf"<!-- lab:begin {re.escape(block_id)} -->\n(.*?)<!-- lab:end {re.escape(block_id)} -->", text, re.S)
    assert m, block_id
    return m.group(1)


@pytest.fixture
def fake_repo(tmp_path, monkeypatch):
    """A repo-like folder: README.md with generated blocks; report pointed at it."""
    root = tmp_path / "repo"
    root.mkdir()
    readme = root / "README.md"
    readme.write_text(README)
    monkeypatch.setattr(report, "REPO_ROOT", root)
    monkeypatch.setattr(report, "readmes", lambda: [readme])
    return readme


def quiet(*a, **k):
    pass


def test_check_then_regenerate_then_check(fake_repo, quick_results_copy):
    res = str(quick_results_copy)
    messages = []
    assert report.regenerate(check=True, results=res, echo=messages.append) == 1      # stale
    assert fake_repo.read_text() == README                                             # --check changes nothing
    assert "stale" in messages[-1] and "README.md" in messages[-1]

    assert report.regenerate(check=False, results=res, echo=quiet) == 0
    text = fake_repo.read_text()
    assert text.startswith("# A lab\n\nIntro prose that the report must leave alone.")
    assert text.rstrip().endswith("Closing prose.")
    for block_id in ("phases", "phase0.matmul_baseline", "phase0.findings", "phase1.elementwise",
                     "phase1.cache_sweep", "phase1.findings"):
        body = block(text, block_id)
        assert "old" not in body.split("\n")[0] and body.strip() not in ("old", "old phase table"), block_id
        assert not body.startswith("_No records yet"), block_id

    ew = block(text, "phase1.elementwise").splitlines()
    rec = by_exercise(load_records(quick_results_copy), "phase1.elementwise")
    link = os.path.relpath(quick_results_copy / rec["_path"], fake_repo.parent)
    assert ew[0].startswith(f"**{rec['hardware']['name']}** · run [") and ew[0].endswith(f"]({link})")  # the caption
    assert not link.startswith("/") and ew[1] == ""
    assert ew[2].startswith("| ") and "hardware" not in ew[2] and re.fullmatch(r"\|(---\|)+", ew[3])
    assert ew[2].endswith(f"| {render.PREDICTION_HEADER} |")
    table = [ln for ln in ew if ln.startswith("|")]
    assert len(table) == 2 + 2                            # copy and mul at one quick size
    assert all(ln.count("|") == ew[2].count("|") for ln in table)
    csv_file = quick_results_copy / "tables" / "phase1.elementwise.csv"
    assert ew[-1] == f"Every column, the spec-sheet prediction included: [{csv_file.name}]" \
                     f"({os.path.relpath(csv_file, fake_repo.parent)})."
    header = csv_file.read_text().splitlines()[0].split(",")
    assert header[0] == "hardware" and header[-1] == "record" and "predicted ms (spec)" in header
    assert re.search(r"^\| 1 \|.*\| measured \|", block(text, "phases"), re.M)     # phase 1 has records

    plots = sorted(p.name for p in (quick_results_copy / "plots").iterdir())
    assert plots == ["phase1_cache_cpu.png", "phase1_roofline_cpu.png"]
    assert all((quick_results_copy / "plots" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in plots)

    assert report.regenerate(check=True, results=res, echo=messages.append) == 0       # up to date
    assert "match" in messages[-1]
    assert report.regenerate(check=False, results=res, echo=quiet) == 0               # idempotent
    assert fake_repo.read_text() == text


def test_editing_a_generated_cell_fails_the_check(fake_repo, quick_results_copy):
    res = str(quick_results_copy)
    report.regenerate(check=False, results=res, echo=quiet)
    text = fake_repo.read_text()
    row = block(text, "phase1.elementwise").splitlines()[4]
    cells = row.split(" | ")
    cells[4] = "999999"                                    # somebody "fixes" a number by hand
    fake_repo.write_text(text.replace(row, " | ".join(cells)))
    assert report.regenerate(check=True, results=res, echo=quiet) == 1
    report.regenerate(check=False, results=res, echo=quiet)
    assert fake_repo.read_text() == text                   # and `lab report` puts it back


def test_a_missing_plot_fails_the_check(fake_repo, quick_results_copy):
    res = str(quick_results_copy)
    report.regenerate(check=False, results=res, echo=quiet)
    (quick_results_copy / "plots" / "phase1_roofline_cpu.png").unlink()
    messages = []
    assert report.regenerate(check=True, results=res, echo=messages.append) == 1
    assert "phase1_roofline_cpu.png" in messages[-1]


def test_a_plot_or_table_no_block_makes_is_stale_and_removed(fake_repo, quick_results_copy):
    """A renamed plot or a removed table leaves its old file behind: --check names it, lab report deletes it."""
    res = str(quick_results_copy)
    report.regenerate(check=False, results=res, echo=quiet)
    old_plot, old_table = quick_results_copy / "plots" / "roofline_old_cpu.png", quick_results_copy / "tables" / "gone.csv"
    old_plot.write_bytes(b"\x89PNG old")
    old_table.write_text("a,b\n")
    messages = []
    assert report.regenerate(check=True, results=res, echo=messages.append) == 1
    assert "results/plots/roofline_old_cpu.png" in messages[-1] and "results/tables/gone.csv" in messages[-1]
    assert old_plot.exists() and old_table.exists()                                   # --check changes nothing
    assert report.regenerate(check=False, results=res, echo=messages.append) == 0
    assert "removed 2 file(s)" in messages[-1] and not old_plot.exists() and not old_table.exists()
    assert report.regenerate(check=True, results=res, echo=quiet) == 0


def test_edits_outside_blocks_are_not_the_reports_business(fake_repo, quick_results_copy):
    res = str(quick_results_copy)
    report.regenerate(check=False, results=res, echo=quiet)
    fake_repo.write_text(fake_repo.read_text().replace("Closing prose.", "Edited closing prose."))
    assert report.regenerate(check=True, results=res, echo=quiet) == 0


def test_unknown_block_id_is_an_error(fake_repo, quick_results_copy, lab):
    fake_repo.write_text(README + "\n<!-- lab:begin phase1.nope -->\nx\n<!-- lab:end phase1.nope -->\n")
    with pytest.raises(LabError, match="unknown generated block 'phase1.nope'"):
        report.regenerate(check=True, results=str(quick_results_copy), echo=quiet)
    rc, out, err = lab("report", "--check", "--results", quick_results_copy)
    assert_one_line_error(rc, err)
    assert "phase1.nope" in err


def test_zero_records_never_rewrite_the_tables(fake_repo, tmp_path, lab):
    """An empty results folder (a typo in --results, a fresh folder) must not wipe every table."""
    empty = tmp_path / "empty-results"
    empty.mkdir()
    for check in (False, True):
        with pytest.raises(LabError, match="no records"):
            report.regenerate(check=check, results=str(empty), echo=quiet)
    assert fake_repo.read_text() == README
    rc, out, err = lab("report", "--results", empty)
    assert_one_line_error(rc, err) and rc == 2


@pytest.mark.parametrize("make", ["missing", "a-file"])
def test_a_results_folder_that_is_not_one_is_refused(fake_repo, tmp_path, lab, make):
    target = tmp_path / make
    if make == "a-file":
        target.write_text("x")
    rc, out, err = lab("report", "--results", target)
    assert rc == 2
    assert_one_line_error(rc, err)
    assert ("does not exist" if make == "missing" else "is not a folder") in err
    assert fake_repo.read_text() == README


def _first_record(results):
    return sorted(results.glob("phase*/*/*/*.json"))[0]


@pytest.mark.parametrize("damage, words", [
    (lambda text: text[: len(text) // 2], "not valid JSON"),                        # truncated
    (lambda text: "{ this is not json", "not valid JSON"),                           # corrupt
    (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "hardware"}),
     "missing 'hardware'"),                                                          # a block missing
    (lambda text: text.replace('"status": "ok"', '"status": "fine"', 1), "status 'fine'"),   # invalid
    (lambda text: json.dumps({**json.loads(text), "reason": "see /home/someone/log"}), "absolute path"),
])
def test_a_bad_record_is_named_and_nothing_is_rewritten(fake_repo, quick_results_copy, lab, damage, words):
    bad = _first_record(quick_results_copy)
    bad.write_text(damage(bad.read_text()))
    for args in (("report",), ("report", "--check")):
        rc, out, err = lab(*args, "--results", quick_results_copy)
        assert rc == 2
        assert_one_line_error(rc, err)
        assert bad.relative_to(quick_results_copy.parent).as_posix() in err and words in err, err
        assert "internal error" not in err
    assert fake_repo.read_text() == README


def test_check_fails_when_a_generated_block_is_removed(tmp_path, monkeypatch):
    """Deleting a generated block by hand (with its markers) is caught, in the lab's own READMEs."""
    copies = []
    for path in report.readmes():
        dst = tmp_path / path.relative_to(report.REPO_ROOT)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(path.read_text())
        copies.append(dst)
    for readme in copies:
        readme.write_text(re.sub(r"<!-- lab:begin phase1\.cache_sweep -->.*?<!-- lab:end phase1\.cache_sweep -->\n",
                                 "", readme.read_text(), flags=re.S))
    monkeypatch.setattr(report, "readmes", lambda: copies)
    assert report.blocks_missing() == ["phase1.cache_sweep"]
    messages = []
    assert report.regenerate(check=True, results=str(report.REPO_ROOT / "results"), echo=messages.append) == 1
    assert "phase1.cache_sweep" in messages[-1] and "in no README" in messages[-1]


def _git(root, *args):
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"})


def test_append_only_is_enforced_against_the_records_git_tracks(tmp_path):
    root = tmp_path / "lab"
    rec = root / "results" / "phase1" / "elementwise" / "cpu" / "20261121T000000Z_abcdef0.json"
    rec.parent.mkdir(parents=True)
    rec.write_text("{}\n")
    _git(root.parent, "init", "-q", str(root))
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "a record")
    assert report.records_rewritten(root) == []
    rec.write_text('{"changed": true}\n')
    assert report.records_rewritten(root) == [f"{rec.relative_to(root).as_posix()} changed in the working tree"]
    rec.unlink()
    assert report.records_rewritten(root) == [f"{rec.relative_to(root).as_posix()} deleted in the working tree"]
    _git(root, "commit", "-qam", "drop a record")
    [gone] = report.records_rewritten(root)
    assert gone.startswith(f"{rec.relative_to(root).as_posix()} deleted by commit ")


def test_lab_report_cli(fake_repo, quick_results_copy, lab):
    rc, out, err = lab("report", "--check", "--results", quick_results_copy)
    assert rc == 1 and "stale" in out
    rc, out, err = lab("report", "--results", quick_results_copy)
    assert rc == 0 and "Traceback" not in err
    assert "old" not in block(fake_repo.read_text(), "phase1.elementwise")
    rc, out, err = lab("report", "--check", "--results", quick_results_copy)
    assert rc == 0 and err == ""


# ------------------------------------------------------------------------------ records by hand
def _view(records, tmp_path):
    return render.View(Frame.of(records), tmp_path / "README.md", tmp_path)


def test_external_figures_are_labelled(quick_records, tmp_path):
    rec = as_full_run(by_exercise(quick_records, "phase1.elementwise"))
    rec.pop("_path")
    rec["source"] = {"kind": "external", "citation": "seed write-up, Phase 1"}
    rec["hardware"]["key"] = "rtx_4090"
    write_record(rec, tmp_path)
    from phases.phase1_roofline.report import ELEMENTWISE
    table = render.table(_view(load_records(tmp_path), tmp_path), ELEMENTWISE)
    caption = table.splitlines()[0]
    assert caption.startswith("**") and "seed write-up" in caption.split("**")[1]   # never shown as if we measured it
    assert "** · record [" in caption                                                 # nor as a run of ours


def test_phase0_findings_with_only_a_tf32_row(quick_records, tmp_path):
    """A GPU run with --variant tf32 has no fp32 row to compare with; findings must still render."""
    rec = as_full_run(by_exercise(quick_records, "phase0.matmul_baseline"))
    rec.pop("_path")
    fp32 = next(r for r in rec["rows"] if r["variant"] == "fp32")
    tf32 = copy.deepcopy(fp32)
    tf32["variant"], tf32["params"]["tf32_allowed"] = "tf32", True
    rec["rows"] = [tf32]
    write_record(rec, tmp_path)
    from phases.phase0_environment.report import findings
    text = findings(_view(load_records(tmp_path), tmp_path))
    assert "TF32" in text


def test_formatting_helpers():
    assert formats.num(None) == "-" and formats.num(float("nan")) == "-"
    assert formats.num(0) == "0" and formats.num(4369.2) == "4,369" and formats.num(0.08333) == "0.0833"
    assert formats.pct(91.04) == "91.0%" and formats.pct(None) == "-"
    assert formats.size_bytes(1024) == "1 KiB" and formats.size_bytes(12 * 2**30) == "12 GiB"
    assert formats.size_bytes(1536) == "1.5 KiB" and formats.size_bytes(None) == "-"   # external records lack bytes
    assert formats.elements(2**30) == "1 Gi" and formats.elements(33554432) == "32 Mi"
    assert formats.elements(100003) == "100,003"
    assert formats.markdown([["a", 1]], ["x", "y"]) == "| x | y |\n|---|---|\n| a | 1 |"


# ------------------------------------------------------------------------------ regressions (bugs found and fixed)
def test_a_block_without_its_end_marker_is_not_silently_skipped(fake_repo, tmp_path):
    fake_repo.write_text("<!-- lab:begin phase1.elementwise -->\nold hand-typed table\n"
                         "<!-- lab:end phase1.elementwse -->\n")
    try:
        rc = report.regenerate(check=True, results=str(tmp_path / "empty"), echo=quiet)
    except LabError:
        return                                             # a clear error is fine
    assert rc != 0
