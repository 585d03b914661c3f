"""The repository as a whole: README and CI agree, committed tables match committed results."""
import os
import re
import subprocess
import sys

import pytest

from common.records import load_records, problems
from conftest import REPO, clean_env

README = REPO / "README.md"
CI = REPO / ".ci" / "run"


def fenced_lines(text: str) -> list[str]:
    lines, inside = [], False
    for ln in text.splitlines():
        if ln.strip().startswith("```"):
            inside = not inside
            continue
        if inside:
            lines.append(ln)
    return lines


def readme_test_command() -> str:
    """The README's test command: the fenced line that runs pytest, its trailing comment dropped."""
    cmds = [re.sub(r"\s+#.*$", "", ln).strip() for ln in fenced_lines(README.read_text())
            if re.search(r"\bpytest\b", ln) and not ln.lstrip().startswith("#")]
    assert cmds, "README.md has no fenced test command"
    return cmds[0]


def test_readme_test_command_is_what_ci_runs():
    if not README.is_file() or not CI.is_file():
        pytest.skip("README.md or .ci/run not written yet")
    cmd = readme_test_command()
    assert 'pip install -e ".[test]"' in cmd and re.search(r"&&\s*pytest", cmd), cmd
    ci = CI.read_text()
    if cmd in ci:                                         # the command is written out in .ci/run
        return
    # ...or .ci/run reads it from the README: run its extraction and compare
    m = re.search(r"^\s*test_cmd=\$\((.*)\)\s*$", ci, re.M)
    assert m, ".ci/run neither contains the README's test command nor reads it from README.md"
    got = subprocess.run(["bash", "-c", m.group(1)], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert got == cmd
    assert re.search(r'eval "\$test_cmd"', ci), ".ci/run extracts the command but does not run it"


def test_ci_script_is_executable():
    if not CI.is_file():
        pytest.skip(".ci/run not written yet")
    assert os.access(CI, os.X_OK)
    assert CI.read_text().startswith("#!")


def test_pyproject_test_extra_has_pytest():
    text = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^test\s*=\s*\[.*"pytest', text, re.M)
    assert 'lab = "common.cli:main"' in text


def test_committed_records_are_valid():
    for rec in load_records(REPO / "results"):
        path = rec.pop("_path")
        assert problems(rec) == [], path


def test_real_repo_report_check():
    if not README.is_file():
        pytest.skip("README.md not written yet")
    proc = subprocess.run([sys.executable, "scripts/report.py", "--check"], cwd=REPO, capture_output=True,
                          text=True, env=clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
