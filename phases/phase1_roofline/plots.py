"""Phase 1's plots: the roofline with every measured point, and bandwidth against working set.
matplotlib is imported only when a plot is drawn, so `lab report --check` does without it."""
from common.plotting import pyplot, save


def _latest_record(view, exercise: str, hw: str) -> dict | None:
    rows = view.latest(exercise, measured_only=True)
    rows = rows[rows["hardware"] == hw] if len(rows) else rows
    return view.record(rows.iloc[0]["path"]) if len(rows) else None


def _ok_rows(rec) -> list[dict]:
    return [r for r in (rec or {}).get("rows", []) if r["status"] == "ok" and r.get("prediction")]


def _spec(view, hw: str) -> dict:
    for rec in reversed(view.frame.records):
        if rec["hardware"]["key"] == hw and rec["hardware"].get("spec"):
            return rec["hardware"]["spec"]
    return {}



def roofline(view, hw: str, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = [10 ** (k / 20) for k in range(-40, 101)]               # 0.01 .. 1e5 FLOP/byte
    spec = _spec(view, hw)
    if spec.get("memory_bandwidth_gbps"):
        bw = spec["memory_bandwidth_gbps"]
        for dtype, style in (("fp16", "-"), ("fp32", "--")):
            peak = (spec.get("peak_tflops") or {}).get(dtype)
            if peak:
                ax.plot(xs, [min(peak, x * bw / 1e3) for x in xs], style, color="tab:gray",
                        label=f"spec roof: {bw:,.0f} GB/s, {dtype} {peak:g} TFLOP/s")
    s = (_latest_record(view, "phase1.regime_sweep", hw) or {}).get("summary", {})
    if s.get("measured_copy_gbps") and s.get("measured_peak_tflops"):
        bw, peak = s["measured_copy_gbps"], s["measured_peak_tflops"]
        ax.plot(xs, [min(peak, x * bw / 1e3) for x in xs], "-", color="tab:green", alpha=0.7,
                label=f"measured roof: copy {bw:,.0f} GB/s, best matmul {peak:,.0f} TFLOP/s")
    c = (_latest_record(view, "phase1.ceilings", hw) or {}).get("summary", {}).get("ceilings") or {}
    fp16 = (c.get("matmul_tflops") or {}).get("fp16")
    if c.get("hbm_gbps") and fp16:
        ax.plot(xs, [min(fp16, x * c["hbm_gbps"] / 1e3) for x in xs], "-", color="tab:olive",
                label=f"calibrated roof: HBM copy {c['hbm_gbps']:,.0f} GB/s, fp16 matmul {fp16:,.0f} TFLOP/s")
        ns = [2 ** (k / 4) for k in range(16, 57)]                   # N = 16 .. 16384
        rate = [2 * n**3 / (1e9 * (c["launch_us"] / 1e3 + max(6 * n * n / (c["hbm_gbps"] * 1e6), 2 * n**3 / (fp16 * 1e9))))
                for n in ns]
        ax.plot([n / 3 for n in ns], rate, ":", color="tab:olive",
                label=f"calibrated, N x N fp16 matmul with the {c['launch_us']:.1f} us latency floor")
    series = [("phase1.regime_sweep", "o", "tab:blue", "FP16 matmul sweep (N=64..8192)"),
              ("phase1.matmul_fp16", "*", "tab:red", "FP16 matmul anchor"),
              ("phase1.elementwise", "s", "tab:orange", "FP32 multiply"),
              ("phase0.matmul_baseline", "^", "tab:purple", "FP32/TF32 matmul 4096")]
    for ex, marker, color, label in series:
        pts = [(r["prediction"]["intensity_flop_per_byte"], r["metrics"]["tflops"])
               for r in _ok_rows(_latest_record(view, ex, hw))
               if r["metrics"].get("tflops") and r["prediction"].get("intensity_flop_per_byte")]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, color=color, s=60 if marker == "*" else 30, label=label, zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"Roofline: {spec.get('name') or hw}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    save(fig, path)


def cache(view, hw: str, path) -> None:
    plt = pyplot()
    rec = _latest_record(view, "phase1.cache_sweep", hw)
    rows = _ok_rows(rec)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([r["params"]["working_set_bytes"] / 2**20 for r in rows], [r["metrics"]["gbps"] for r in rows], "o-",
            label="copy, warm caches (no L2 flush)")
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
    save(fig, path)
