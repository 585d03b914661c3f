"""Running git (or any tool) quietly, and finding the lab's own checkout. No torch here: the
report uses these too."""
import shutil
import subprocess
from pathlib import Path

from .paths import REPO_ROOT


def run_quiet(cmd: list[str], timeout: float = 20.0) -> str | None:
    """stdout of a command, or None if it is missing, fails or hangs."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def lab_git(root: Path = REPO_ROOT) -> list[str] | None:
    """The git command for the lab's own checkout, or None where `root` is not the top of a git
    repository (no git, or a copy inside another project's repository)."""
    git = ["git", "-c", f"safe.directory={root}", "-C", str(root)]
    top = run_quiet([*git, "rev-parse", "--show-toplevel"])
    return git if top is not None and Path(top).resolve() == Path(root).resolve() else None
