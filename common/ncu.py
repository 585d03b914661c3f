"""Nsight Compute as a subprocess: profile the kernels a target program launches between
cudaProfilerStart and cudaProfilerStop, and read the chosen metrics back as numbers.

Clocks are left as found (`--clock-control none`): the lab never changes a GPU's settings. Values
are printed in base units (`--print-units base`: bytes, not KB; ns, not us) so no unit parsing is
needed.
"""
import csv
import io
import subprocess
import sys

from .errors import LabError
from .paths import REPO_ROOT


def command(target_module: str, args: list[str], metrics: tuple[str, ...]) -> list[str]:
    return ["ncu", "--profile-from-start", "off", "--clock-control", "none", "--print-units", "base",
            "--csv", "--metrics", ",".join(metrics), sys.executable, "-m", target_module, *args]


def parse_csv(text: str) -> list[dict]:
    """ncu --csv output -> one dict per profiled kernel: {'kernel': name, metric: float, ...}."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if not lines:
        return []
    kernels: dict[str, dict] = {}
    for rec in csv.DictReader(io.StringIO("\n".join(lines))):
        if "Metric Name" not in rec or rec.get("ID") is None:
            continue
        k = kernels.setdefault(rec["ID"], {"kernel": rec.get("Kernel Name")})
        value = (rec.get("Metric Value") or "").replace(",", "")
        try:
            k[rec["Metric Name"]] = float(value)
        except ValueError:
            k[rec["Metric Name"]] = None
    return list(kernels.values())


def profile(target_module: str, args: list[str], metrics: tuple[str, ...], timeout_s: float,
            what: str) -> list[dict]:
    """Run `python -m target_module *args` under ncu; LabError (one line) when nothing came back."""
    try:
        out = subprocess.run(command(target_module, args, metrics), capture_output=True, text=True,
                             timeout=timeout_s, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:
        raise LabError(f"ncu did not finish profiling {what} in {timeout_s:.0f} s") from None
    kernels = parse_csv(out.stdout)
    if out.returncode != 0 or not kernels:
        tail = (out.stderr or out.stdout).strip().splitlines()
        msg = next((ln for ln in reversed(tail) if "ERR" in ln or "rror" in ln), tail[-1] if tail else "no output")
        raise LabError(f"ncu could not profile {what}: {msg.strip()[:200]}")
    return kernels


def profiled_once(op) -> None:
    """For a target program: run `op` once unprofiled (compilation, module loading, library set-up),
    then once between cudaProfilerStart/Stop, the region `command()` asks ncu to profile."""
    import torch

    op()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    op()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
