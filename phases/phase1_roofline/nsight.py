"""Hardware counters for the two anchors: DRAM and SM throughput, and the bytes that really moved.

    lab run phase1.nsight          (needs `ncu`, Nsight Compute, and a GPU whose counters it can read)

Nsight Compute replays one kernel of each anchor and reads:
- dram__throughput: DRAM traffic as a percentage of the peak DRAM throughput,
- sm__throughput: the busiest SM unit as a percentage of its peak ("compute throughput"),
- dram__bytes_read / dram__bytes_write: bytes that crossed the HBM interface.
The roofline's byte count is checked against the counters: the multiply should move exactly
3 x N x 4 bytes; a large matmul moves somewhat more than the ideal 3 N^2 x 2, because its tiles
re-read A and B from HBM whenever L2 cannot hold them.
Clocks are left as found (`--clock-control none`); the lab never changes a GPU's settings.
"""
import csv
import io
import subprocess
import sys

from common.errors import LabError
from common.exercise import Exercise, Needs, row
from common.paths import REPO_ROOT

METRICS = ("dram__throughput.avg.pct_of_peak_sustained_elapsed",
           "sm__throughput.avg.pct_of_peak_sustained_elapsed",
           "dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")


def ncu_command(kind: str, n: int) -> list[str]:
    return ["ncu", "--profile-from-start", "off", "--clock-control", "none", "--print-units", "base",
            "--csv", "--metrics", ",".join(METRICS),
            sys.executable, "-m", "phases.phase1_roofline.nsight_target", kind, str(n)]


def parse_ncu_csv(text: str) -> list[dict]:
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


def profile(kind: str, n: int, timeout_s: float) -> list[dict]:
    try:
        out = subprocess.run(ncu_command(kind, n), capture_output=True, text=True, timeout=timeout_s,
                             cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:
        raise LabError(f"ncu did not finish profiling {kind} in {timeout_s:.0f} s") from None
    kernels = parse_ncu_csv(out.stdout)
    if out.returncode != 0 or not kernels:
        tail = (out.stderr or out.stdout).strip().splitlines()
        msg = next((ln for ln in reversed(tail) if "ERR" in ln or "rror" in ln), tail[-1] if tail else "no output")
        raise LabError(f"ncu could not profile {kind}: {msg.strip()[:200]}")
    return kernels


def run(ctx, params):
    anchors = [("elementwise", params["elementwise_n"], params["elementwise_n"],
                3 * params["elementwise_n"] * 4),
               ("matmul_fp16", params["matmul_n"], 2 * params["matmul_n"] ** 3, 3 * params["matmul_n"] ** 2 * 2)]
    rows = []
    for kind, n, flops, ideal_bytes in ctx.track(anchors, "ncu anchors"):
        if not ctx.wants(kind):
            continue
        kernels = profile(kind, n, params["timeout_s"])
        read = sum(k.get("dram__bytes_read.sum") or 0 for k in kernels)
        write = sum(k.get("dram__bytes_write.sum") or 0 for k in kernels)
        main = max(kernels, key=lambda k: k.get("gpu__time_duration.sum") or 0)
        metrics = {
            "kernel_names": [k["kernel"] for k in kernels],
            "kernels_profiled": len(kernels),
            "dram_throughput_pct": main.get(METRICS[0]),
            "sm_throughput_pct": main.get(METRICS[1]),
            "dram_bytes_read": read, "dram_bytes_write": write, "dram_bytes": read + write,
            "ideal_bytes": ideal_bytes, "dram_bytes_over_ideal": (read + write) / ideal_bytes,
            "flops": flops, "intensity_ideal_flop_per_byte": flops / ideal_bytes,
            "intensity_measured_flop_per_byte": flops / (read + write) if read + write else None,
            "ncu_kernel_ms": (main.get("gpu__time_duration.sum") or 0) / 1e6,   # ns -> ms
        }
        rows.append(row(kind, {"kernel": kind, "n": n}, metrics=metrics))
    return rows


EXERCISE = Exercise(id="phase1.nsight", title="Nsight Compute: DRAM and SM throughput of the two anchors",
                    run=run, needs=Needs(cuda=True, tools=("ncu",)),
                    params={"elementwise_n": 33554432, "matmul_n": 8192, "timeout_s": 300},
                    quick_params={"elementwise_n": 1 << 20, "matmul_n": 256},
                    variants=("elementwise", "matmul_fp16"))
