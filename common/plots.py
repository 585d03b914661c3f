"""Plots drawn from records: the roofline with measured points, and the L2 cliff.

Files: results/plots/roofline_<hardware>.png, results/plots/cache_<hardware>.png.
"""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PLOT_META = {"Software": None}        # no version stamp: the PNG depends only on the records


def _latest(records, exercise, hw):
    got = [r for r in records if r["exercise"]["id"] == exercise and r["hardware"]["key"] == hw
           and r["status"] != "skipped" and r.get("source", {}).get("kind", "measured") == "measured"]
    return got[-1] if got else None


def _hardware_keys(records, exercise_prefix="phase1."):
    return sorted({r["hardware"]["key"] for r in records if r["exercise"]["id"].startswith(exercise_prefix)
                   and r["status"] != "skipped" and r.get("source", {}).get("kind", "measured") == "measured"})


def expected(records, results: Path) -> list[Path]:
    out = []
    for hw in _hardware_keys(records):
        out.append(Path(results) / "plots" / f"roofline_{hw}.png")
        if _latest(records, "phase1.cache_sweep", hw):
            out.append(Path(results) / "plots" / f"cache_{hw}.png")
    return out


def draw_all(records, results: Path) -> list[Path]:
    made = []
    for hw in _hardware_keys(records):
        folder = Path(results) / "plots"
        folder.mkdir(parents=True, exist_ok=True)
        made.append(roofline_plot(records, hw, folder / f"roofline_{hw}.png"))
        cs = _latest(records, "phase1.cache_sweep", hw)
        if cs:
            made.append(cache_plot(cs, folder / f"cache_{hw}.png"))
    return made


def _ok_rows(rec):
    return [r for r in (rec or {}).get("rows", []) if r["status"] == "ok" and r.get("prediction")]


def roofline_plot(records, hw, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = [10 ** (k / 20) for k in range(-40, 101)]               # 0.01 .. 1e5 FLOP/byte
    spec = None
    for rec in records[::-1]:
        if rec["hardware"]["key"] == hw and rec["hardware"].get("spec"):
            spec = rec["hardware"]["spec"]
            break
    name = (spec or {}).get("name") or hw
    if spec and spec.get("memory_bandwidth_gbps"):
        bw = spec["memory_bandwidth_gbps"]
        for dtype, style in (("fp16", "-"), ("fp32", "--")):
            peak = (spec.get("peak_tflops") or {}).get(dtype)
            if peak:
                ax.plot(xs, [min(peak, x * bw / 1e3) for x in xs], style, color="tab:gray",
                        label=f"spec roof: {bw:,.0f} GB/s, {dtype} {peak:g} TFLOP/s")
    sweep = _latest(records, "phase1.regime_sweep", hw)
    s = (sweep or {}).get("summary", {})
    if s.get("measured_copy_gbps") and s.get("measured_peak_tflops"):
        bw, peak = s["measured_copy_gbps"], s["measured_peak_tflops"]
        ax.plot(xs, [min(peak, x * bw / 1e3) for x in xs], "-", color="tab:green", alpha=0.7,
                label=f"measured roof: copy {bw:,.0f} GB/s, best matmul {peak:,.0f} TFLOP/s")
    series = [("phase1.regime_sweep", "o", "tab:blue", "FP16 matmul sweep (N=64..8192)"),
              ("phase1.matmul_fp16", "*", "tab:red", "FP16 matmul anchor"),
              ("phase1.elementwise", "s", "tab:orange", "FP32 multiply"),
              ("phase0.matmul_baseline", "^", "tab:purple", "FP32/TF32 matmul 4096")]
    for ex, marker, color, label in series:
        pts = [(r["prediction"]["intensity_flop_per_byte"], r["metrics"]["tflops"]) for r in _ok_rows(_latest(records, ex, hw))
               if r["metrics"].get("tflops") and r["prediction"].get("intensity_flop_per_byte")]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, color=color, s=60 if marker == "*" else 30, label=label, zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"Roofline: {name}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata=PLOT_META)
    plt.close(fig)
    return path


def cache_plot(rec, path: Path) -> Path:
    rows = _ok_rows(rec)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ws = [r["params"]["working_set_bytes"] / 2**20 for r in rows]
    ax.plot(ws, [r["metrics"]["gbps"] for r in rows], "o-", label="copy, warm caches (no L2 flush)")
    spec = rec["hardware"].get("spec") or {}
    if spec.get("memory_bandwidth_gbps"):
        ax.axhline(spec["memory_bandwidth_gbps"], color="tab:gray", ls="--", label="spec HBM bandwidth")
    l2 = rec.get("summary", {}).get("l2_bytes")
    if l2:
        ax.axvline(l2 / 2**20, color="tab:red", ls=":", label=f"L2 = {l2 / 2**20:.0f} MiB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("working set (MiB)")
    ax.set_ylabel("GB/s (bytes read + written)")
    ax.set_title(f"Bandwidth vs working set: {spec.get('name') or rec['hardware']['key']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata=PLOT_META)
    plt.close(fig)
    return path
