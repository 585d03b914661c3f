"""common/env.py and common/paths.py: what a record says it was measured on."""
import os
import stat

import pytest

from common import env, paths
from common.errors import LabError
from common.records import write_record


def test_command_line_hides_absolute_paths():
    cmd = env.command_line(["/usr/local/bin/lab", "run", "1", "--results", "/home/me/lab/results", "--quick"])
    assert cmd == "lab run 1 --results <path>/results --quick"
    assert env.command_line([]) == "lab"


def test_host_and_software_info_have_no_empty_strings():
    for block in (env.host_info(), env.software_info()):
        for key, value in block.items():
            assert value != "", key


def test_git_info_shape():
    info = env.git_info()
    assert set(info) == {"commit", "dirty", "source"}
    if info["commit"]:
        assert len(info["commit"]) == 40 and isinstance(info["dirty"], bool)


def _git(root, *args):
    import subprocess
    ident = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True,
                          env={**os.environ, **ident}).stdout.strip()


@pytest.fixture
def lab_checkout(tmp_path):
    """A git checkout standing in for the lab's: one tracked file and a results/ folder."""
    root = tmp_path / "lab"
    (root / "results").mkdir(parents=True)
    (root / "code.py").write_text("x = 1\n")
    (root / "results" / "r.json").write_text("{}\n")
    _git(tmp_path, "init", "-q", str(root))
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "first")
    return root


def test_commit_is_full_and_dirty_is_computed(lab_checkout):
    info = env.git_info(lab_checkout)
    assert info == {"commit": _git(lab_checkout, "rev-parse", "HEAD"), "dirty": False, "source": "git"}
    (lab_checkout / "results" / "r.json").write_text('{"new": 1}\n')     # a run writes results/: not dirty
    assert env.git_info(lab_checkout)["dirty"] is False
    (lab_checkout / "code.py").write_text("x = 2\n")
    assert env.git_info(lab_checkout)["dirty"] is True


def test_an_enclosing_repository_is_not_the_labs(tmp_path):
    """A copy of the tree inside another project must not record that project's commit."""
    outer = tmp_path / "other-project"
    inner = outer / "vendor" / "lab"
    inner.mkdir(parents=True)
    (outer / "f.txt").write_text("x")
    _git(tmp_path, "init", "-q", str(outer))
    _git(outer, "add", "-A")
    _git(outer, "commit", "-qm", "other")
    assert env.git_info(inner) == {"commit": None, "dirty": None, "source": None}


def test_a_given_commit_is_verified_and_expanded_where_history_exists(lab_checkout, monkeypatch):
    full = _git(lab_checkout, "rev-parse", "HEAD")
    monkeypatch.setenv("LAB_GIT_COMMIT", full[:7])
    info = env.git_info(lab_checkout)
    assert info["commit"] == full and info["dirty"] is False and "verified" in info["source"]
    (lab_checkout / "code.py").write_text("x = 3\n")
    assert env.git_info(lab_checkout)["dirty"] is True                  # computed, never assumed
    monkeypatch.setenv("LAB_GIT_COMMIT", "0" * 40)
    with pytest.raises(LabError, match="not a commit of this checkout"):
        env.git_info(lab_checkout)


def test_a_given_commit_without_history(tmp_path, monkeypatch):
    bare = tmp_path / "copy"                                          # a copy with no .git at all
    bare.mkdir()
    monkeypatch.setenv("LAB_GIT_COMMIT", "90f68da")
    with pytest.raises(LabError, match="not a full 40-character commit id"):
        env.git_info(bare)
    monkeypatch.setenv("LAB_GIT_COMMIT", "a" * 40)
    info = env.git_info(bare)
    assert info["commit"] == "a" * 40 and info["dirty"] is None and "not verified" in info["source"]


def test_new_records_carry_full_commit_ids(make_record):
    from common.records import problems
    rec = make_record()
    rec["provenance"]["commit"] = "ccbffb6f"
    assert any("40-character" in p for p in problems(rec))
    rec["schema_version"] = 1                                        # older records keep older rules
    assert problems(rec) == []


def test_clock_event_reasons():
    assert env.clock_event_reasons("0x0000000000000004") == ["sw_power_cap"]
    assert env.clock_event_reasons("0x0000000000000000") == []
    assert env.clock_event_reasons("0x41") == ["gpu_idle", "hw_thermal_slowdown"]
    assert env.clock_event_reasons(None) is None and env.clock_event_reasons("[N/A]") is None


def test_run_quiet_on_missing_or_failing_commands():
    assert env.run_quiet(["definitely-not-a-command-xyz"]) is None
    assert env.run_quiet(["false"]) is None
    assert env.run_quiet(["echo", " hi "]) == "hi"


def test_results_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("LAB_RESULTS_DIR", raising=False)
    assert paths.results_dir() == paths.REPO_ROOT / "results"
    monkeypatch.setenv("LAB_RESULTS_DIR", str(tmp_path / "env"))
    assert paths.results_dir() == tmp_path / "env"
    assert paths.results_dir(str(tmp_path / "flag")) == tmp_path / "flag"


def test_relative_to_repo():
    assert paths.relative_to_repo(paths.REPO_ROOT / "results" / "x.json") == "results/x.json"
    assert paths.relative_to_repo("/somewhere/else/y.json") == "y.json"


# ------------------------------------------------------------------------------ regressions (bugs found and fixed)
def test_command_line_hides_absolute_paths_in_option_equals_form():
    cmd = env.command_line(["lab", "run", "1", "--results=/home/me/lab/results"])
    assert "/home/me" not in cmd


def test_records_are_readable_like_ordinary_files(make_record, tmp_path):
    umask = os.umask(0o022)
    try:
        path = write_record(make_record(), tmp_path)
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) & 0o044 == 0o044
