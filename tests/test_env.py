"""common/env.py and common/paths.py: what a record says it was measured on."""
import os
import stat

import pytest

from common import env, paths
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
        assert len(info["commit"]) >= 7 and isinstance(info["dirty"], bool)


def test_an_explicit_commit_wins_over_the_copy_s_git(monkeypatch):
    # A lent machine's copy of the tree carried a stale .git: the commit named by whoever made the
    # copy must be the one recorded.
    monkeypatch.setenv("LAB_GIT_COMMIT", "90f68da")
    monkeypatch.setenv("LAB_GIT_DIRTY", "0")
    info = env.git_info()
    assert info["commit"] == "90f68da" and info["dirty"] is False and info["source"].startswith("LAB_GIT_COMMIT")
    monkeypatch.setenv("LAB_GIT_DIRTY", "1")
    assert env.git_info()["dirty"] is True


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
