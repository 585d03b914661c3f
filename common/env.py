"""What a number was measured on: GPU, driver, clocks, software versions, git state, command.

Everything here is read, never assumed; what cannot be read is None (never an empty string).
"""
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from .git import lab_git, run_quiet
from .paths import REPO_ROOT, scrub_paths


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def nvcc_version() -> str | None:
    out = run_quiet(["nvcc", "--version"])
    m = re.search(r"release ([\d.]+)", out or "")
    return m.group(1) if m else None


def ncu_version() -> str | None:
    out = run_quiet(["ncu", "--version"])
    m = re.search(r"Version ([\d.]+)", out or "")
    return m.group(1) if m else None


# nvidia-smi --query-gpu fields, one query each so that one field unknown to an older driver
# does not lose the others. The clock-event field was renamed from clocks_throttle_reasons.
SMI_FIELDS = {
    "driver": "driver_version",
    "sm_clock_mhz": "clocks.sm",
    "sm_clock_max_mhz": "clocks.max.sm",
    "mem_clock_mhz": "clocks.mem",
    "mem_clock_max_mhz": "clocks.max.mem",
    "temperature_c": "temperature.gpu",
    "power_draw_w": "power.draw",
    "power_limit_w": "power.limit",
    "persistence_mode": "persistence_mode",
}
THROTTLE_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


def _smi_query(field: str, index: int) -> str | None:
    out = run_quiet(["nvidia-smi", f"--id={index}", f"--query-gpu={field}",
                     "--format=csv,noheader,nounits"])
    if out is None or "not supported" in out.lower() or "[n/a]" in out.lower():
        return None
    return out.splitlines()[0].strip()


def _number(text: str | None):
    try:
        return float(text) if text is not None else None
    except ValueError:
        return text


def nvidia_smi(index: int = 0) -> dict:
    """Driver, clocks, power and the active clock-event (throttle) reasons of GPU `index`."""
    info = {key: _number(_smi_query(field, index)) for key, field in SMI_FIELDS.items()}
    if isinstance(info["driver"], float):
        info["driver"] = _smi_query("driver_version", index)
    for field in THROTTLE_FIELDS:
        mask = _smi_query(field, index)
        if mask is not None:
            info["clock_event_reasons_mask"] = mask   # 0x0: none; 0x1: idle; see nvidia-smi -q
            break
    else:
        info["clock_event_reasons_mask"] = None
    info["clock_event_reasons"] = clock_event_reasons(info["clock_event_reasons_mask"])
    return info


# Bits of nvidia-smi's clocks_event_reasons.active mask (nvml's clocksEventReasons).
CLOCK_EVENT_BITS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
                    0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
                    0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
                    0x100: "display_clock_setting"}


def clock_event_reasons(mask: str | None) -> list[str] | None:
    """'0x0000000000000004' -> ['sw_power_cap']."""
    try:
        value = int(mask, 16)
    except (TypeError, ValueError):
        return None
    return [name for bit, name in CLOCK_EVENT_BITS.items() if value & bit]


def gpu_conditions(index: int = 0) -> dict | None:
    """Clocks, power, temperature and why clocks are held back, read right after a measurement:
    a GPU at its power cap runs slower than its spec sheet, and the record should say so."""
    if shutil.which("nvidia-smi") is None:
        return None
    keys = ("sm_clock_mhz", "mem_clock_mhz", "temperature_c", "power_draw_w")
    info = {k: _number(_smi_query(SMI_FIELDS[k], index)) for k in keys}
    mask = next((m for m in (_smi_query(f, index) for f in THROTTLE_FIELDS) if m is not None), None)
    info["clock_event_reasons"] = clock_event_reasons(mask)
    return info


def gpu_info() -> dict | None:
    """The visible CUDA GPUs as torch sees them, plus nvidia-smi's view of GPU 0."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", None)
    rocm = getattr(torch.version, "hip", None) is not None
    info = {
        "name": props.name,
        "count": torch.cuda.device_count(),
        "backend": "rocm" if rocm else "cuda",
        "gcn_arch": (getattr(props, "gcnArchName", None) or None) if rocm else None,   # AMD's ISA (gfx942)
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 2),
        "l2_mib": round(l2 / 2**20, 2) if l2 else None,
        **nvidia_smi(0),
    }
    if info["count"] > 1:
        info["topology"] = run_quiet(["nvidia-smi", "topo", "-m"])
    return info


def host_info() -> dict:
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"os": platform.system(), "machine": platform.machine(), "cpu": cpu or platform.processor() or None,
            "cpu_count": os.cpu_count()}


def software_info() -> dict:
    cuda_ok = torch.cuda.is_available()
    nccl = None
    if cuda_ok:
        try:
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - NCCL absent from this torch build
            nccl = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": getattr(torch.version, "hip", None),
        "cudnn": cudnn,
        "nccl": nccl,
        "triton": package_version("triton"),
        "jax": package_version("jax"),
        "numpy": package_version("numpy"),
        "nvcc": nvcc_version(),
        "ncu": ncu_version(),
    }


def git_info(root: Path = REPO_ROOT) -> dict:
    """Commit (full id) and dirty flag of the checkout that holds the lab's own package, computed
    by git, never assumed. Dirty means tracked files differ from the commit (`git describe
    --dirty`); results/ is excluded, since a run writes there.

    A git repository that merely encloses the lab (a copy of the tree inside another project) is
    not the lab's: then there is no commit. LAB_GIT_COMMIT names the commit when the copy's .git
    cannot (a copy sent to another machine without its history): it must be a full id, git
    verifies it where the history is present and then computes the dirty flag against it; where it
    is not, dirty is null (unknown), and the source says so.
    """
    from .errors import LabError
    git = ["git", "-c", f"safe.directory={root}", "-C", str(root)]
    ours = lab_git(root) is not None
    env_commit = os.environ.get("LAB_GIT_COMMIT")
    if env_commit:
        known = run_quiet([*git, "rev-parse", "--verify", "--quiet", f"{env_commit}^{{commit}}"]) if ours else None
        if known:
            return {"commit": known, "dirty": _dirty(git, known), "source": "LAB_GIT_COMMIT, verified by git"}
        if not re.fullmatch(r"[0-9a-f]{40}", env_commit):
            raise LabError(f"LAB_GIT_COMMIT '{env_commit}' is not a full 40-character commit id, and no git "
                           "history here can expand it")
        if ours and run_quiet([*git, "rev-parse", "HEAD"]):
            raise LabError(f"LAB_GIT_COMMIT {env_commit[:12]}... is not a commit of this checkout's history")
        return {"commit": env_commit, "dirty": None,
                "source": "LAB_GIT_COMMIT, not verified (no git history here); dirty unknown"}
    if ours:
        commit = run_quiet([*git, "rev-parse", "HEAD"])
        if commit:
            return {"commit": commit, "dirty": _dirty(git, "HEAD"), "source": "git"}
    if (Path(root) / ".git").exists():
        head = _read_head(Path(root) / ".git")
        if head and re.fullmatch(r"[0-9a-f]{40}", head):
            return {"commit": head, "dirty": None, "source": ".git/HEAD (no git binary); dirty unknown"}
    return {"commit": None, "dirty": None, "source": None}


def _dirty(git: list[str], commit: str) -> bool | None:
    """Tracked files outside results/ that differ from `commit` (None if git cannot tell)."""
    try:
        out = subprocess.run([*git, "diff", "--quiet", commit, "--", ".", ":(exclude)results"],
                             capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return {0: False, 1: True}.get(out.returncode)


def _read_head(git_dir: Path) -> str | None:
    """The commit HEAD points at, read from .git without a git binary."""
    try:
        head = (git_dir / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head or None
        ref = head[5:]
        if (git_dir / ref).is_file():
            return (git_dir / ref).read_text().strip()
        for line in (git_dir / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    except OSError:
        pass
    return None


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed, with the program shortened to its name and every absolute path, in
    any spelling (`--x=/a`, `KEY=/a`, `/a`, `~/a`), shortened to <path>/its-last-part."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return "lab"
    return " ".join([Path(argv[0]).name, *(scrub_paths(arg) for arg in argv[1:])])
