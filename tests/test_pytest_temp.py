"""A passing pytest run leaves nothing in the temp folder: its own files and its children's
(torchrun's torchelastic_* logs) go under pytest's folder, removed when every test passed (issue 33, item 6)."""
import subprocess
import sys
from pathlib import Path

from conftest import REPO, clean_env


def test_childrens_temp_files_land_in_pytests_folder(tmp_path_factory):
    child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.mkdtemp(prefix='torchelastic_'))"],
                           env=clean_env(), capture_output=True, text=True, timeout=60)
    assert Path(child.stdout.strip()).is_relative_to(tmp_path_factory.getbasetemp())


def test_a_passing_run_removes_its_temp_folder(tmp_path):
    """A child pytest run (its temp root under this run's TMPDIR) that passes leaves no pytest-N folder."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_cpu_cache_roof.py::test_cache_sizes_read_as_linux_publishes_them"],
                          cwd=REPO, env=clean_env(TMPDIR=str(tmp_path)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    left = [p for p in tmp_path.rglob("pytest-*") if p.is_dir() and not p.name.startswith("pytest-of-")]
    assert left == [], left
    assert not list(tmp_path.rglob("torchelastic_*"))
