"""Where the lab's files live: the repo root, hardware.yaml, results/."""
import os
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


# Where a run whose records are not results goes: a CPU-only machine's (its rows describe that
# machine, not the lab's GPUs) and any `--quick` smoke run. Git ignores it and `lab report` never
# reads it, so such a run can never dirty the committed READMEs by accident.
LOCAL_RESULTS = "local-results"


def results_dir(override: str | None = None) -> Path:
    """--results flag > LAB_RESULTS_DIR > <repo>/results."""
    chosen = override or os.environ.get("LAB_RESULTS_DIR")
    return Path(chosen) if chosen else REPO_ROOT / "results"


def run_results_dir(override: str | None = None, local: bool = False) -> Path:
    """Where `lab run` writes: --results > LAB_RESULTS_DIR > <repo>/local-results for a local run
    (on a CPU, or --quick) > <repo>/results."""
    if override or os.environ.get("LAB_RESULTS_DIR") or not local:
        return results_dir(override)
    return REPO_ROOT / LOCAL_RESULTS


def shown_path(path: Path, results: Path) -> str:
    """A record's path as the run's summary prints it: relative to the repo, or, for a results
    folder outside it, the folder's name and the path inside it (never just the file name, which
    several exercises' records share)."""
    path, results = Path(path).resolve(), Path(results).resolve()
    try:
        return path.relative_to(REPO_ROOT).as_posix()
    except ValueError:
        pass
    try:
        return f"{results.name}/{path.relative_to(results).as_posix()}"
    except ValueError:
        return path.name


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


# An absolute path anywhere in a string: /x at the start or after a space, '=', ':', a quote, a
# bracket or a comma ("--param data_dir=/abs", "KEY=/abs", "(/home/x)"); also ~/x, file:///x and
# C:\x. "GB/s", "a/b" and URLs (https://host/...) are not paths: a word character, a dot or a
# second slash comes before the slash there.
ABSOLUTE_PATH = re.compile(r"""(?:(?<![\w.~/>])/(?=[\w.~-])[^\s'",;)\]]*"""
                           r"""|(?<![\w.])~/[^\s'",;)\]]*"""
                           r"""|file://[^\s'",;)\]]*"""
                           r"""|(?<![\w])[A-Za-z]:\\[^\s'",;)\]]*)""")
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"]*", re.IGNORECASE)


def absolute_paths(text: str) -> list[str]:
    """The absolute paths a string holds (URLs other than file:// are not paths)."""
    if "/" not in text and "\\" not in text:          # no separator, no path (most strings: fast)
        return []
    found = ABSOLUTE_PATH.findall(URL.sub(lambda m: m.group(0) if m.group(0).startswith("file:") else "", text))
    return [f for f in found if f not in ("/",)]


def scrub_paths(text: str) -> str:
    """The string with each absolute path replaced by <path>/its-last-part."""
    def short(m):
        name = re.split(r"[\\/]", m.group(0).rstrip("/\\"))[-1]
        return f"<path>/{name}" if name else "<path>"
    kept = []

    def hold(m):                            # keep http(s) URLs whole
        if m.group(0).startswith("file:"):
            return m.group(0)
        kept.append(m.group(0))
        return f"\0{len(kept) - 1}\0"
    text = URL.sub(hold, text)
    text = ABSOLUTE_PATH.sub(short, text)
    return re.sub(r"\0(\d+)\0", lambda m: kept[int(m.group(1))], text)
