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
            rows.append([v.hw(r), r["variant"], num(g(r, "params.n")), "-", "-", "-", "-", "-",
                         f"{r['status']}: {g(r, 'reason')}", "-", "-", v.run_label(r)])
            continue
        lib = g(r, "metrics.library")
        layout = g(r, "params.b_layout")
        rows.append([v.hw(r), r["variant"], num(g(r, "params.n")), g(r, "params.dtype"),
                     "column-major" if layout == "col" else "row-major", num(g(r, "metrics.ms"), 4),
                     num(g(r, "metrics.tflops")), f"{pct(g(r, 'metrics.pct_of_library'))} of {lib}" if lib else "(baseline)",
                     *prediction_cells(r), v.run_label(r)])
    return markdown(rows, ["hardware", "variant", "N", "dtype", "B stored", "ms", "TFLOP/s", "% of cuBLAS (same run)",
                           "predicted ms", "bound", "measured/predicted", "run"])


def t_ladder(v: View) -> str:
    """What each rung bought: at the two largest N every rung ran, TFLOP/s, the factor over the
    rung it builds on (same dtype) and the share of cuBLAS, per GPU."""
    from .matmul import RUNGS, VARIANTS
    sub = latest(v.df, "phase2.matmul")
    if not len(sub):
        return NO_RECORDS.format(ex="phase2.matmul")
    rows = []
    for hw in sorted(set(sub["hardware"])):
        mine = sub[(sub["hardware"] == hw) & (sub["status"] == "ok") & sub["variant"].isin(VARIANTS)]
        if not len(mine):
            continue
        counts = mine.groupby("params.n")["variant"].nunique()
        for n in sorted(counts[counts == counts.max()].index)[-2:]:     # the two largest complete sizes
            rows += _ladder_rows(mine[mine["params.n"] == n].set_index("variant"), n, RUNGS, VARIANTS)
    return markdown(rows, ["hardware", "N", "rung", "dtype", "TFLOP/s", "what it bought", "% of cuBLAS (same run)"])


def _ladder_rows(at, n, RUNGS, VARIANTS) -> list:
    """One size's rungs in ladder order, each against the rung it builds on (same dtype)."""
    rows, previous = [], {}
    for variant in VARIANTS:
        if variant not in at.index:
            continue
        r = at.loc[variant]
        dtype = r["params.dtype"]
        base = RUNGS[variant].base
        before = (base, at.loc[base]["metrics.tflops"]) if base in at.index else previous.get(dtype)
        gain = f"{r['metrics.tflops'] / before[1]:.2f}x over {before[0]}" if before else "(first rung)"
        if not base:                           # a side branch does not become the next rung's base
            previous[dtype] = (variant, r["metrics.tflops"])
        lib = g(r, "metrics.library")
        rows.append([r["hardware_name"], num(n), variant, dtype, num(r["metrics.tflops"]), gain,
                     f"{pct(g(r, 'metrics.pct_of_library'))} of {lib}" if lib else "-"])
    return rows


def t_softmax(v: View) -> str:
    sub = latest(v.df, "phase2.softmax")
    if not len(sub):
        return NO_RECORDS.format(ex="phase2.softmax")
    rows = []
    for _, r in sub.iterrows():
        shape = f"{num(g(r, 'params.rows'))} x {num(g(r, 'params.cols'))}"
        kernel = g(r, "metrics.kernel")
        variant = f"{r['variant']} ({kernel})" if kernel else r["variant"]
        if r["status"] != "ok":
            rows.append([v.hw(r), g(r, "params.dtype", "-"), shape, variant, "-", "-", "-", "-",
                         f"{r['status']}: {g(r, 'reason')}", "-", "-", v.run_label(r)])
            continue
        speedup = g(r, "metrics.speedup_vs_torch")
        rows.append([v.hw(r), g(r, "params.dtype", "-"), shape, variant, num(g(r, "metrics.ms"), 4),
                     num(g(r, "metrics.gbps")), pct(g(r, "metrics.pct_of_copy_bandwidth")),
                     f"{speedup:.2f}x" if speedup else "-", *prediction_cells(r), v.run_label(r)])
    return markdown(rows, ["hardware", "dtype", "rows x cols", "variant (kernel)", "ms", "GB/s", "% of copy (same run)",
                           "speedup vs torch", "predicted ms", "bound", "measured/predicted", "run"])


def t_traffic(v: View) -> str:
    """Nsight Compute counters against the byte counts predicted from the code."""
    sub = latest(v.df, "phase2.traffic")
    if not len(sub):
        return NO_RECORDS.format(ex="phase2.traffic")
    rows = [[v.hw(r), r["variant"], num(g(r, "params.n")), num(g(r, "metrics.global_load_bytes")),
             num(g(r, "metrics.predicted_global_load_bytes")), num(g(r, "metrics.measured_over_predicted"), 3),
             num(g(r, "metrics.l2_read_bytes")), num(g(r, "metrics.dram_bytes")),
             num(g(r, "metrics.dram_over_compulsory"), 3), v.run_label(r)]
            for _, r in sub.iterrows() if r["status"] == "ok"]
    text = markdown(rows, ["hardware", "kernel", "n (elements or N)", "global-load bytes (ncu)", "predicted",
                           "measured/predicted", "L2 read bytes", "DRAM bytes", "DRAM / compulsory", "run"])
    for rec in (r for r in reversed(v.records) if r["exercise"]["id"] == "phase2.traffic" and r["status"] == "ok"):
        s = rec.get("summary") or {}
        if s.get("tiling_global_load_reduction"):
            text += (f"\n\nNaive over tiled ({rec['hardware'].get('name') or rec['hardware']['key']}): global-load bytes "
                     f"{s['tiling_global_load_reduction']:.2f}x (predicted 8x), L2 read bytes "
                     f"{s['tiling_l2_read_reduction']:.2f}x, DRAM bytes {s['tiling_dram_reduction']:.2f}x.")
        break
    return text


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
            rows.append([kernel, res.get("arch") or build.get("arch", "-"), num(res.get("registers")), num(res.get("smem_bytes")),
                         num(res.get("spill_stores_bytes")), num(res.get("spill_loads_bytes"))])
    return markdown(rows, ["kernel", "arch", "registers", "shared memory bytes", "spill stores bytes", "spill loads bytes"])



def _met(value, target) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "not measured"
    return "met" if value >= target else "**not met**"


def _at(sub, variants, n=None):
    """The ok rows of `variants` (at size n when given)."""
    d = sub[(sub["status"] == "ok") & sub["variant"].isin(variants)]
    return d[d["params.n"] == n] if n is not None and len(d) else d


def t_goals(v: View) -> str:
    """The phase-2 issue's goals, each checked against the newest records, per GPU."""
    from .matmul import RUNGS
    mm, va, sm = (latest(v.df, f"phase2.{x}") for x in ("matmul", "vector_add", "softmax"))
    hws = sorted(set().union(*[set(d["hardware"]) for d in (mm, va, sm) if len(d)]))
    out = []
    for hw in hws:
        rows, name = [], None
        m = mm[mm["hardware"] == hw] if len(mm) else mm
        if len(m):
            name = m.iloc[0]["hardware_name"]
            fp32 = [k for k, r in RUNGS.items() if r.precision == "fp32" and not r.test_only]
            goals = [("CUDA-core FP32 matmul, best rung at N = 4,096: % of cuBLAS FP32 (no TF32)", fp32, 4096, 90, "≥ 90%")]
            for n in (4096, 8192):
                goals.append((f"mma.sync BF16 at N = {n:,}: % of cuBLAS BF16",
                              [k for k in RUNGS if k.startswith("mma_")], n, 55, "≥ 55%"))
            for n in (4096, 8192):
                goals.append((f"wgmma + TMA BF16 at N = {n:,}: % of cuBLAS BF16 (same B storage)",
                              [k for k in RUNGS if k.startswith("wgmma_")], n, 90, "≥ 90% (stretch 100%)"))
            for goal, variants, n, target, target_text in goals:
                d = _at(m, variants, n)
                if len(d):                        # the best of those rungs at that size
                    b = d.loc[d["metrics.pct_of_library"].idxmax()]
                    rows.append([goal, target_text,
                                 f"{pct(b['metrics.pct_of_library'])} ({b['variant']}, {num(b['metrics.tflops'])} TFLOP/s)",
                                 _met(b["metrics.pct_of_library"], target)])
        a = va[va["hardware"] == hw] if len(va) else va
        if len(a):
            name = name or a.iloc[0]["hardware_name"]
            big = a[(a["params.n"] == a["params.n"].max()) & (a["status"] == "ok") & (a["variant"] != "copy")]
            if len(big):
                b = big.loc[big["metrics.pct_of_copy_bandwidth"].idxmax()]
                rows.append([f"vector add far beyond L2 ({elements(b['params.n'])} elements): % of copy (same run)", "≥ 90%",
                             f"{pct(b['metrics.pct_of_copy_bandwidth'])} ({b['variant']})",
                             _met(b["metrics.pct_of_copy_bandwidth"], 90)])
        s = sm[sm["hardware"] == hw] if len(sm) else sm
        if len(s):
            name = name or s.iloc[0]["hardware_name"]
            ours = s[(s["variant"] == "cuda") & (s["status"] == "ok") & (s["params.group"] == "sweep")]
            if len(ours):
                w = ours.loc[ours["metrics.pct_of_copy_bandwidth"].idxmin()]
                rows.append(["softmax far beyond L2 (`cuda` dispatcher): % of copy (same run), worst row length", "≥ 90%",
                             f"{pct(w['metrics.pct_of_copy_bandwidth'])} ({w['params.dtype']}, {int(w['params.cols']):,} columns)",
                             _met(w["metrics.pct_of_copy_bandwidth"], 90)])
                w = ours.loc[ours["metrics.speedup_vs_torch"].idxmin()]
                rows.append(["softmax faster than torch.softmax at every row length (worst)", "> 1.00x",
                             f"{w['metrics.speedup_vs_torch']:.2f}x ({w['params.dtype']}, {int(w['params.cols']):,} columns)",
                             _met(w["metrics.speedup_vs_torch"], 1.0)])
            seed = s[(s["variant"] == "cuda") & (s["status"] == "ok") & (s["params.group"] == "seed")]
            if len(seed):
                w = seed.iloc[0]
                rows.append([f"the seed's {int(w['params.rows']):,} x {int(w['params.cols']):,} softmax (in L2): vs torch.softmax",
                             "> 1.00x", f"{w['metrics.speedup_vs_torch']:.2f}x", _met(w["metrics.speedup_vs_torch"], 1.0)])
        if rows:
            out.append(f"**{name}**\n\n" + markdown(rows, ["goal (from the phase-2 issue)", "target", "measured", "status"]))
    return "\n\n".join(out) or NO_RECORDS.format(ex="phase2.matmul")


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


TABLES = {"phase2.goals": t_goals, "phase2.vector_add": t_vector_add, "phase2.ladder": t_ladder, "phase2.matmul": t_matmul,
          "phase2.softmax": t_softmax,
          "phase2.traffic": t_traffic,
          "phase2.build": t_build}
