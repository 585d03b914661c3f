"""The repository as a whole: README and CI agree, committed tables match committed results."""
import os
import re
import shutil
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
    m = re.search(r"^\s*test_cmd=\$\(readme_command '(.*)'\)\s*$", ci, re.M)
    assert m, ".ci/run neither contains the README's test command nor reads it from README.md"
    line = next(ln for ln in README.read_text().splitlines() if re.search(m.group(1), ln))
    assert re.sub(r"\s*#.*$", "", line) == cmd
    assert re.search(r'step .*"\$test_cmd"', ci), ".ci/run extracts the command but does not run it"


def test_ci_runs_both_readme_commands_in_both_orders_away_from_shared():
    ci = CI.read_text()
    assert re.search(r"^\s*main_cmd=\$\(readme_command '.*lab run.*'\)", ci, re.M)
    order = re.findall(r'^step "\$work/([\w-]+)/lab" "\$(\w+)"', ci, re.M)
    assert order == [("main-then-tests", "main_cmd"), ("main-then-tests", "test_cmd"),
                     ("tests-then-main", "test_cmd"), ("tests-then-main", "main_cmd")]
    assert "mktemp -d" in ci and 'shared" ]' in ci                  # copies with no shared/ folder beside them


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


def tracked_files(repo) -> list[str] | None:
    """The files git tracks in `repo` (None where there is no git checkout)."""
    try:
        out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z"], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return [f for f in out.stdout.decode().split("\0") if f] if out.returncode == 0 else None


def committed_copy(repo, dest):
    """The tracked files of `repo`, as they are in its working tree, copied to dest: the committed
    state, without the records a `lab run` on this machine has added."""
    files = tracked_files(repo)
    if files is None:
        pytest.skip("no git checkout: the committed state of results/ is unknown here")
    for name in files:
        src = repo / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def test_committed_copy_leaves_out_untracked_records(tmp_path):
    repo = tmp_path / "repo"
    (repo / "results").mkdir(parents=True)
    (repo / "results" / "committed.json").write_text("{}")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    (repo / "results" / "new-from-lab-run.json").write_text("{}")
    dest = committed_copy(repo, tmp_path / "copy")
    assert sorted(p.name for p in (dest / "results").iterdir()) == ["committed.json"]


def test_real_repo_report_check(tmp_path):
    """README tables, findings and plots match the committed records. Checked on a copy of the
    tracked files, so records that `lab run` just wrote on this machine cannot make it fail."""
    if not README.is_file():
        pytest.skip("README.md not written yet")
    copy = committed_copy(REPO, tmp_path / "lab")
    proc = subprocess.run([sys.executable, "scripts/report.py", "--check"], cwd=copy, capture_output=True,
                          text=True, env=clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_committed_records_were_never_deleted_or_rewritten():
    from common.report import records_rewritten
    assert records_rewritten(REPO) == []


def test_nothing_reads_outside_the_repository():
    """Code and tests find their data inside the clone, never in a folder beside or above it."""
    pattern = re.compile(r"\.\./shared|/ \"shared\"|REPO_ROOT\.parent|__file__\).*parent\.parent\.parent")
    offenders = []
    for folder in ("common", "phases", "tests", "scripts"):
        for path in (REPO / folder).rglob("*.py"):
            if path.name == "test_repo.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert offenders == []


def test_the_data_phase_7_needs_ships_with_the_repository():
    from phases.phase7_gpt import data as D
    assert D.SHIPPED == REPO / "data"
    assert set(D.verify(D.SHIPPED)) == set(D.FILES)
    assert "Licences" in (REPO / "data" / "README.md").read_text()
