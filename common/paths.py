"""Where the lab's files live: the repo root, hardware.yaml, results/."""
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def results_dir(override: str | None = None) -> Path:
    """--results flag > LAB_RESULTS_DIR > <repo>/results."""
    chosen = override or os.environ.get("LAB_RESULTS_DIR")
    return Path(chosen) if chosen else REPO_ROOT / "results"


def hardware_yaml(override: str | None = None) -> Path:
    chosen = override or os.environ.get("LAB_HARDWARE_YAML")
    return Path(chosen) if chosen else REPO_ROOT / "hardware.yaml"


def relative_to_repo(path: Path) -> str:
    """A path as it may appear in a record or a README: relative, never absolute."""
    path = Path(path).resolve()
    try:
        return path.relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return path.name
