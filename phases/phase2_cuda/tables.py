"""Phase 2's README blocks, written from records (see common/report.py for the mechanism)."""
from common.report import NO_RECORDS, View, elements, g, latest, markdown, num, pct, prediction_cells


def t_vector_add(v: View) -> str:
    sub = latest(v.df, "phase2.vector_add")
    if not len(sub):
        return NO_RECORDS.format(ex="phase2.vector_add")
    rows = [[v.hw(r), r["variant"], elements(g(r, "params.n")), num(g(r, "metrics.ms"), 4), num(g(r, "metrics.gbps")),
             pct(g(r, "metrics.pct_of_peak_bandwidth")), pct(g(r, "metrics.pct_of_copy_bandwidth")),
             *prediction_cells(r), v.run_label(r)]
            for _, r in sub.iterrows() if r["status"] == "ok"]
    return markdown(rows, ["hardware", "kernel", "elements", "ms", "GB/s", "% of spec BW", "% of copy (same run)",
                           "predicted ms", "bound", "measured/predicted", "run"])


def t_matmul(v: View) -> str:
    sub = latest(v.df, "phase2.matmul")
    if not len(sub):
        return NO_RECORDS.format(ex="phase2.matmul")
    rows = []
    for _, r in sub.iterrows():
        if r["status"] != "ok":
            rows.append([v.hw(r), r["variant"], num(g(r, "params.n")), "-", "-", "-", "-",
                         f"{r['status']}: {g(r, 'reason')}", "-", "-", v.run_label(r)])
            continue
        lib = g(r, "metrics.library")
        rows.append([v.hw(r), r["variant"], num(g(r, "params.n")), g(r, "params.dtype"), num(g(r, "metrics.ms"), 4),
                     num(g(r, "metrics.tflops")), f"{pct(g(r, 'metrics.pct_of_library'))} of {lib}" if lib else "(baseline)",
                     *prediction_cells(r), v.run_label(r)])
    return markdown(rows, ["hardware", "variant", "N", "dtype", "ms", "TFLOP/s", "% of cuBLAS (same run)",
                           "predicted ms", "bound", "measured/predicted", "run"])


def t_build(v: View) -> str:
    """The ptxas resource report stored in the newest matmul or vector-add record."""
    recs = [r for r in v.records if r["exercise"]["id"] in ("phase2.matmul", "phase2.vector_add")
            and r["status"] != "skipped" and r.get("summary", {}).get("build")]
    if not recs:
        return NO_RECORDS.format(ex="phase2.matmul")
    rows, seen = [], set()
    for rec in reversed(recs):                     # newest first
        build = rec["summary"]["build"]
        report = build.get("resources") or build.get("report") or {}
        for kernel, res in sorted(report.items()):
            if kernel in seen or not isinstance(res, dict):
                continue
            seen.add(kernel)
            rows.append([kernel, build.get("arch", "-"), num(res.get("registers")), num(res.get("smem_bytes")),
                         num(res.get("spill_stores_bytes")), num(res.get("spill_loads_bytes"))])
    return markdown(rows, ["kernel", "arch", "registers", "shared memory bytes", "spill stores bytes", "spill loads bytes"])


TABLES = {"phase2.vector_add": t_vector_add, "phase2.matmul": t_matmul, "phase2.build": t_build}


def key_result(v: View) -> list[str]:
    """One line per GPU for the main README's phase table: the best hand-written rung per dtype."""
    sub = latest(v.df, "phase2.matmul")
    out = []
    for hw in (sorted(set(sub["hardware"])) if len(sub) else []):
        mine = sub[(sub["hardware"] == hw) & (sub["status"] == "ok") & ~sub["variant"].str.startswith("cublas")]
        mine = mine[mine["params.n"] == mine["params.n"].max()] if len(mine) else mine
        parts = []
        for dtype in ("fp32", "bf16"):
            d = mine[mine["params.dtype"] == dtype]
            if len(d):
                best = d.loc[d["metrics.pct_of_library"].idxmax()]
                parts.append(f"{dtype} `{best['variant']}` {pct(best['metrics.pct_of_library'])} of cuBLAS at N = {num(best['params.n'])}")
        if parts:
            out.append(f"{mine.iloc[0]['hardware_name']}: " + ", ".join(parts))
    return out
