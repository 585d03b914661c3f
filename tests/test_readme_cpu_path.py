"""The README's CPU path works on an ordinary Linux box as written, and .ci/run keeps working
where only the package registry is reachable (issue 33, items 3 and 4)."""
import os
import re
import subprocess
import sys

from common import paths
from conftest import REPO

README = (REPO / "README.md").read_text()
CI = (REPO / ".ci" / "run").read_text()
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def fenced(text: str) -> list[str]:
    return [ln for block in re.findall(r"```\w*\n(.*?)```", text, re.S) for ln in block.splitlines()]


def test_the_cpu_path_is_a_venv_and_pytorchs_own_cpu_index():
    [line] = [ln for ln in fenced(README) if CPU_INDEX in ln]
    assert re.search(r"python3 -m venv \S+ && \. \S+/bin/activate && pip install torch --index-url " + re.escape(CPU_INDEX),
                     line), line
    required = re.search(r'requires-python = ">=(\d+\.\d+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert f"Python >= {required}" in README
    assert re.search(r"tests take [^.]*minutes", README)


def test_the_two_readme_commands_ci_reads_keep_their_first_line_form():
    def first(pattern):          # .ci/run's readme_command
        return re.sub(r"\s*#.*$", "", next(ln for ln in README.splitlines() if re.search(pattern, ln)))
    assert first(r"^pip install -e \. *&& *lab run") == "pip install -e . && lab run 0 1"
    assert first(r"^pip install .*&& *pytest") == 'pip install -e ".[test]" && pytest -q'


def test_the_quick_start_says_where_local_records_go_and_git_ignores_it():
    assert f"`{paths.LOCAL_RESULTS}/`" in README and "never reads" in README
    assert f"/{paths.LOCAL_RESULTS}/" in (REPO / ".gitignore").read_text().splitlines()


def _ci_torch_install(tmp_path, reachable: set[str]) -> list[str]:
    """Run .ci/run's torch step with a stand-in python3 that has no torch and reaches only
    `reachable` ("pytorch", "registry"); return the pip commands it was asked for."""
    block = re.search(r'^if ! python3 -c "import torch".*?^fi$', CI, re.S | re.M).group(0)
    log = tmp_path / "calls"
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(f"""#!{sys.executable}
import sys
args = sys.argv[1:]
if args[:1] == ["-c"]:
    sys.exit(1)                                            # no torch yet
open({str(log)!r}, "a").write(" ".join(args) + "\\n")
source = "pytorch" if "--index-url" in args else "registry"
sys.exit(0 if source in {sorted(reachable)!r} else 1)
""")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return log.read_text().splitlines()


def test_ci_installs_torch_the_portable_way_first(tmp_path):
    calls = _ci_torch_install(tmp_path, {"pytorch", "registry"})
    assert len(calls) == 1 and f"--index-url {CPU_INDEX}" in calls[0]


def test_ci_falls_back_to_the_registry_where_only_it_is_reachable(tmp_path):
    calls = _ci_torch_install(tmp_path, {"registry"})
    assert len(calls) == 2 and calls[1].endswith("install -q torch==2.13.0")
