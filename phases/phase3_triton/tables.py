"""Phase 3's README blocks and plots, written from results/ only.

Blocks (in phases/phase3_triton/README.md): phase3.vector_add, phase3.softmax, phase3.matmul,
phase3.flash_attention, phase3.flash_attention_bwd, phase3.goals, phase3.findings. Plots:
results/plots/phase3_bandwidth_<hardware>.png and phase3_attention_<hardware>.png.
"""
from pathlib import Path

import pandas as pd

from common.report import View, elements, g, latest, markdown, num, pct, size_bytes

EX = {"add": "phase3.vector_add", "softmax": "phase3.softmax", "matmul": "phase3.matmul",
      "fwd": "phase3.flash_attention", "bwd": "phase3.flash_attention_bwd"}
NO_RECORDS = "_No records yet: run `lab run {ex}` on a GPU, then `lab report`._"
LIBRARY_NAMES = {"torch": "torch.add", "cublas": "cuBLAS", "sdpa_flash": "SDPA flash", "sdpa_cudnn": "SDPA cuDNN",
                 "sdpa_efficient": "SDPA efficient"}


# ------------------------------------------------------------------------------ helpers
def _measured(v: View, ex: str) -> pd.DataFrame:
    sub = latest(v.df, ex)
    return sub[sub["source"] == "measured"] if len(sub) else sub


def _pick(rows: pd.DataFrame, variant: str, **params):
    """The ok row of `variant` whose params match (None if absent)."""
    if rows is None or not len(rows):
        return None
    for _, r in rows.iterrows():
        if r["variant"] == variant and r["status"] == "ok" and \
                all(g(r, f"params.{k}") == val for k, val in params.items()):
            return r
    return None


def _by_hw(sub: pd.DataFrame):
    return list(sub.groupby("hardware", sort=True)) if len(sub) else []


def _lib(name) -> str:
    return LIBRARY_NAMES.get(name, name or "-")


def _gbps(r) -> str:
    return num(g(r, "metrics.gbps")) if r is not None else "-"


def _tflops(r) -> str:
    return num(g(r, "metrics.tflops")) if r is not None else "-"


def _failed_lines(v: View, sub: pd.DataFrame) -> str:
    """Rows that failed their check or were skipped, grouped by variant and reason, so a table
    never hides them."""
    bad = sub[sub["status"] != "ok"] if len(sub) else sub
    if not len(bad):
        return ""
    groups: dict = {}
    for _, r in bad.iterrows():
        groups.setdefault((r["variant"], r["status"], g(r, "reason", "-")), []).append(r)
    items = [f"`{variant}` {status} in {len(rs)} case{'s' if len(rs) > 1 else ''} ({_params(rs[0])}"
             f"{', ...' if len(rs) > 1 else ''}): {reason}" for (variant, status, reason), rs in groups.items()]
    return "\n\nNot timed: " + "; ".join(items) + "."


def _params(r) -> str:
    out = []
    for k in r.index:
        if k.startswith("params.") and k != "params.group" and not isinstance(r[k], (dict, list)) and pd.notna(r[k]):
            val = r[k]
            val = int(val) if isinstance(val, float) and val.is_integer() else val
            out.append(f"{k[7:]}={val}")
    return ", ".join(out)


# ------------------------------------------------------------------------------ vector add
def t_vector_add(v: View) -> str:
    sub = _measured(v, EX["add"])
    if not len(sub):
        return NO_RECORDS.format(ex=EX["add"])
    out = []
    for hw, rows in _by_hw(sub):
        table = []
        for n in sorted({int(x) for x in rows["params.n"].dropna()}):
            cp, th, tr = (_pick(rows, x, n=n) for x in ("copy", "torch", "triton"))
            if tr is None and th is None:
                continue
            ref = tr if tr is not None else th
            table.append([elements(n), size_bytes(g(ref, "params.working_set_bytes")), _gbps(cp), _gbps(th), _gbps(tr),
                          pct(g(tr, "metrics.pct_of_copy_bandwidth")) if tr is not None else "-",
                          pct(g(tr, "metrics.pct_of_library")) if tr is not None else "-",
                          num(g(tr, "prediction.predicted_ms"), 3) if tr is not None else "-",
                          num(g(tr, "prediction.measured_over_predicted"), 3) if tr is not None else "-",
                          g(tr, "metrics.config", "-") if tr is not None else "-"])
        first = rows.iloc[0]
        out.append(f"**{v.hw(first)}**, run {v.run_label(first)}. Bytes per call: copy 2·n·4, add 3·n·4 "
                   f"(read x, read y, write out); GB/s counts those bytes.\n\n" + markdown(
                       table, ["elements", "working set (add)", "copy GB/s", "torch.add GB/s", "Triton GB/s",
                               "Triton % of copy", "Triton % of torch.add", "predicted ms (Triton)",
                               "measured/predicted", "Triton config"]) + _failed_lines(v, rows))
    return "\n\n".join(out)


# ------------------------------------------------------------------------------ softmax
def t_softmax(v: View) -> str:
    sub = _measured(v, EX["softmax"])
    if not len(sub):
        return NO_RECORDS.format(ex=EX["softmax"])
    out = []
    for hw, rows in _by_hw(sub):
        first = rows.iloc[0]
        seed = rows[rows["params.group"] == "seed"]
        per_variant = []
        for _, r in seed.iterrows():
            if r["status"] != "ok":
                continue
            per_variant.append([f"{int(r['params.rows']):,} x {int(r['params.cols']):,}", r["variant"],
                                g(r, "metrics.bytes_formula", "-"), size_bytes(g(r, "prediction.bytes")),
                                num(g(r, "metrics.ms") * 1000, 3) + " µs", num(g(r, "metrics.gbps")),
                                num(g(r, "metrics.effective_gbps")), pct(g(r, "metrics.pct_of_copy_effective")),
                                num(g(r, "prediction.measured_over_predicted"), 3)])
        sweep = rows[rows["params.group"] == "sweep"]
        table = []
        for cols in sorted({int(x) for x in sweep["params.cols"].dropna()}):
            th, un, tr = (_pick(sweep, x, cols=cols) for x in ("torch", "unfused", "triton"))
            ref = tr if tr is not None else th
            if ref is None:
                continue
            table.append([f"{cols:,}", f"{int(ref['params.rows']):,}", _gbps(th),
                          num(g(un, "metrics.effective_gbps")) if un is not None else "-", _gbps(tr),
                          pct(g(tr, "metrics.pct_of_copy_bandwidth")) if tr is not None else "-",
                          pct(g(tr, "metrics.pct_of_library")) if tr is not None else "-",
                          (g(tr, "metrics.kernel", "-") + ": " + g(tr, "metrics.config", "-")) if tr is not None else "-"])
        text = f"**{v.hw(first)}**, run {v.run_label(first)}.\n\nThe seed's shape, every variant with the bytes it moves:\n\n"
        text += markdown(per_variant, ["shape", "variant", "bytes formula", "bytes moved", "time", "GB/s (its own bytes)",
                                       "effective GB/s (2·M·N·4 / time)", "% of copy (effective)", "measured/predicted"])
        if table:
            total = sweep.iloc[0]
            text += (f"\n\nRow-length sweep, {size_bytes(g(total, 'params.working_set_bytes'))} moved per fused call "
                     f"(far beyond L2). GB/s counts 2·M·N·4 bytes for every variant, so the columns compare "
                     f"time directly:\n\n")
            text += markdown(table, ["row length", "rows", "torch.softmax GB/s", "unfused (5-op) GB/s", "Triton GB/s",
                                     "Triton % of copy", "Triton % of torch.softmax", "Triton kernel and config"])
        out.append(text + _failed_lines(v, rows))
    return "\n\n".join(out)


# ------------------------------------------------------------------------------ matmul
def t_matmul(v: View) -> str:
    sub = _measured(v, EX["matmul"])
    if not len(sub):
        return NO_RECORDS.format(ex=EX["matmul"])
    out = []
    for hw, rows in _by_hw(sub):
        first = rows.iloc[0]
        table = []
        for dtype in sorted({x for x in rows["params.dtype"].dropna()}):
            for n in sorted({int(x) for x in rows[rows["params.dtype"] == dtype]["params.n"].dropna()}):
                cb, tr, tm = (_pick(rows, x, n=n, dtype=dtype) for x in ("cublas", "triton", "triton_tma"))
                best = max([r for r in (tr, tm) if r is not None], key=lambda r: g(r, "metrics.tflops", 0), default=None)
                table.append([dtype, f"{n:,}", _tflops(cb), _tflops(tr),
                              pct(g(tr, "metrics.pct_of_library")) if tr is not None else "-", _tflops(tm),
                              pct(g(tm, "metrics.pct_of_library")) if tm is not None else "-",
                              pct(g(best, "metrics.pct_of_peak_tflops")) if best is not None else "-",
                              (f"{best['variant']}: {g(best, 'metrics.config', '-')}") if best is not None else "-"])
        out.append(f"**{v.hw(first)}**, run {v.run_label(first)}. FLOPs 2·N³, bytes 3·N²·2; TFLOP/s from the median "
                   f"time.\n\n" + markdown(table, ["dtype", "N", "cuBLAS TFLOP/s", "Triton TFLOP/s", "Triton % of cuBLAS",
                                                   "Triton TMA TFLOP/s", "TMA % of cuBLAS", "best Triton % of peak",
                                                   "best Triton config"]) + _failed_lines(v, rows))
    return "\n\n".join(out)


# ------------------------------------------------------------------------------ attention
def _attention_table(rows: pd.DataFrame, backward: bool) -> str:
    main = rows if backward else rows[rows["params.group"] == "main"]
    table = []
    keys = main[["params.dtype", "params.head_dim", "params.causal", "params.n"]].dropna().drop_duplicates()
    keys = keys.sort_values(["params.dtype", "params.head_dim", "params.causal", "params.n"],
                            ascending=[True, False, True, True])
    for _, k in keys.iterrows():
        sel = dict(dtype=k["params.dtype"], head_dim=int(k["params.head_dim"]), causal=bool(k["params.causal"]), n=int(k["params.n"]))
        tr = _pick(main, "triton", **sel)
        libs = {x: _pick(main, x, **sel) for x in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient")}
        ref = tr if tr is not None else next((r for r in libs.values() if r is not None), None)
        if ref is None:
            continue
        table.append([sel["dtype"], str(sel["head_dim"]), "yes" if sel["causal"] else "no", f"{sel['n']:,}",
                      f"{int(ref['params.batch'])} x {int(ref['params.heads'])}", _tflops(tr),
                      *[_tflops(libs[x]) for x in libs],
                      _lib(g(tr, "metrics.library")) if tr is not None else "-",
                      pct(g(tr, "metrics.pct_of_library")) if tr is not None else "-",
                      g(tr, "metrics.config", "-") if tr is not None else "-"])
    return markdown(table, ["dtype", "head dim", "causal", "N", "batch x heads",
                            "Triton TFLOP/s" + (" (bwd)" if backward else ""), "SDPA flash", "SDPA cuDNN",
                            "SDPA efficient", "fastest library", "Triton % of fastest", "Triton config"])


def t_flash_attention(v: View) -> str:
    sub = _measured(v, EX["fwd"])
    if not len(sub):
        return NO_RECORDS.format(ex=EX["fwd"])
    out = []
    for hw, rows in _by_hw(sub):
        first = rows.iloc[0]
        seed = rows[rows["params.group"] == "seed"]
        table = []
        for n in sorted({int(x) for x in seed["params.n"].dropna()}):
            tr, nv = _pick(seed, "triton", n=n), _pick(seed, "naive", n=n)
            lib = None if tr is None else g(tr, "metrics.library")
            table.append([f"{n:,}", size_bytes(g(nv if nv is not None else tr, "metrics.attn_matrix_bytes")),
                          num(g(nv, "metrics.ms"), 3) if nv is not None else "-",
                          num(g(tr, "metrics.ms"), 3) if tr is not None else "-",
                          num(g(tr, "metrics.speedup_vs_naive"), 3) + "x" if tr is not None and g(tr, "metrics.speedup_vs_naive") else "-",
                          _tflops(tr), _tflops(nv),
                          (f"{_lib(lib)}: {num(g(tr, 'metrics.library_ms'), 3)} ms" if lib else "-")])
        text = (f"**{v.hw(first)}**, run {v.run_label(first)}.\n\nThe seed's case (batch 2, 4 heads, head dim 64, fp32; "
                f"Triton's dots in TF32, naive in strict FP32 as PyTorch runs it by default):\n\n")
        text += markdown(table, ["N", "naive's N x N matrix (one of them)", "naive ms", "Triton ms", "Triton speedup",
                                 "Triton TFLOP/s", "naive TFLOP/s", "fastest SDPA backend (fp32)"])
        text += ("\n\nbf16 and fp16 at 16K tokens per batch (batch = 16384 / N) and 2048 model width "
                 "(heads = 2048 / head dim); FLOPs 4·B·H·N²·D, halved when causal:\n\n")
        text += _attention_table(rows, backward=False)
        out.append(text + _failed_lines(v, rows))
    return "\n\n".join(out)


def t_flash_attention_bwd(v: View) -> str:
    sub = _measured(v, EX["bwd"])
    if not len(sub):
        return NO_RECORDS.format(ex=EX["bwd"])
    out = []
    for hw, rows in _by_hw(sub):
        first = rows.iloc[0]
        out.append(f"**{v.hw(first)}**, run {v.run_label(first)}. FLOPs 2.5 x 4·B·H·N²·D (halved when causal), "
                   f"the usual convention; checked against float64 autograd through naive attention.\n\n"
                   + _attention_table(rows, backward=True) + _failed_lines(v, rows))
    return "\n\n".join(out)


# ------------------------------------------------------------------------------ goals and findings
def _facts(v: View) -> dict:
    """hardware -> the handful of numbers the goals and findings are written from."""
    facts: dict = {}
    for key, ex in EX.items():
        for hw, rows in _by_hw(_measured(v, ex)):
            facts.setdefault(hw, {"name": rows.iloc[0]["hardware_name"]})[key] = rows
    return facts


def _add_facts(rows):
    ok = rows[(rows["variant"] == "triton") & (rows["status"] == "ok")]
    if not len(ok):
        return None
    big = ok[ok["params.working_set_bytes"] >= 8 * 60 * 2**20]     # 8x the largest L2 in the lab's GPUs
    big = big if len(big) else ok.sort_values("params.n").tail(1)
    worst = big.sort_values("metrics.pct_of_copy_bandwidth").iloc[0]
    largest = ok.sort_values("params.n").iloc[-1]
    return {"worst_big": worst, "largest": largest, "seed": _pick(rows, "triton", n=98432)}


def _softmax_facts(rows):
    sweep = rows[(rows["params.group"] == "sweep") & (rows["variant"] == "triton") & (rows["status"] == "ok")]
    if not len(sweep):
        return None
    return {"min_copy": sweep.sort_values("metrics.pct_of_copy_bandwidth").iloc[0],
            "min_lib": sweep.sort_values("metrics.pct_of_library").iloc[0],
            "longest": sweep.sort_values("params.cols").iloc[-1],
            "seed_triton": _pick(rows[rows["params.group"] == "seed"], "triton"),
            "seed_unfused": _pick(rows[rows["params.group"] == "seed"], "unfused"),
            "seed_torch": _pick(rows[rows["params.group"] == "seed"], "torch")}


def _matmul_best(rows, dtype="bf16"):
    ok = rows[(rows["variant"].isin(["triton", "triton_tma"])) & (rows["status"] == "ok") & (rows["params.dtype"] == dtype)]
    if not len(ok):
        return None
    top = ok[ok["params.n"] == ok["params.n"].max()]
    return top.sort_values("metrics.tflops").iloc[-1]


def _attn_goal_rows(rows):
    ok = rows[(rows["variant"] == "triton") & (rows["status"] == "ok") & (rows["params.group"] == "main")
              & (rows["params.dtype"] == "bf16") & (rows["params.head_dim"] == 128) & (rows["params.causal"] == False)]  # noqa: E712
    return ok.sort_values("params.n") if len(ok) else None


def _met(value, target) -> str:
    if value is None or pd.isna(value):
        return "not measured"
    return "met" if value >= target else "not met"


def t_goals(v: View) -> str:
    out = []
    for hw, f in sorted(_facts(v).items()):
        rows = []
        a = _add_facts(f["add"]) if "add" in f else None
        if a:
            w = a["worst_big"]
            rows.append(["vector add far beyond L2: % of copy (same run)", "≥ 90%",
                         f"{pct(w['metrics.pct_of_copy_bandwidth'])} (worst, at {elements(w['params.n'])} elements)",
                         _met(w["metrics.pct_of_copy_bandwidth"], 90)])
        s = _softmax_facts(f["softmax"]) if "softmax" in f else None
        if s:
            w = s["min_copy"]
            rows.append(["fused softmax far beyond L2: % of copy (same run)", "≥ 90%",
                         f"{pct(w['metrics.pct_of_copy_bandwidth'])} (worst row length: {int(w['params.cols']):,})",
                         _met(w["metrics.pct_of_copy_bandwidth"], 90)])
            w = s["min_lib"]
            rows.append(["fused softmax vs torch.softmax at every row length", "≥ 100%",
                         f"{pct(w['metrics.pct_of_library'])} (worst row length: {int(w['params.cols']):,})",
                         _met(w["metrics.pct_of_library"], 100)])
        m = _matmul_best(f["matmul"]) if "matmul" in f else None
        if m is not None:
            rows.append([f"Triton bf16 matmul at N = {int(m['params.n']):,}: % of cuBLAS", "≥ 90% (stretch 95%)",
                         f"{pct(g(m, 'metrics.pct_of_library'))} ({m['variant']}, {num(m['metrics.tflops'])} TFLOP/s)",
                         _met(g(m, "metrics.pct_of_library"), 90)])
        at = _attn_goal_rows(f["fwd"]) if "fwd" in f else None
        if at is not None:
            top = at.iloc[-1]
            rows.append([f"flash attention fwd, bf16, d=128, non-causal, N = {int(top['params.n']):,}: TFLOP/s",
                         "≥ 500 (stretch 600)", f"{num(top['metrics.tflops'])} ({pct(g(top, 'metrics.pct_of_library'))} of "
                         f"{_lib(g(top, 'metrics.library'))})", _met(top["metrics.tflops"], 500)])
        if rows:
            out.append(f"**{f['name']}**\n\n" + markdown(rows, ["goal (from the phase-3 issue)", "target", "measured", "status"]))
    return "\n\n".join(out) or "_No phase 3 records yet._"


def t_findings(v: View) -> str:
    paras = []
    for hw, f in sorted(_facts(v).items()):
        name, s_ = f["name"], []
        a = _add_facts(f["add"]) if "add" in f else None
        if a:
            big = a["largest"]
            seed = a["seed"]
            s_.append("**Vector add.** " + (f"The seed's {elements(98432)}-element case matched torch bit for bit "
                                              f"(the mask kept the half-empty last block inside the arrays). " if seed is not None else "")
                      + f"At {elements(big['params.n'])} elements ({size_bytes(big['params.working_set_bytes'])} per call) "
                      f"the Triton kernel moved {num(big['metrics.gbps'])} GB/s, {pct(big['metrics.pct_of_copy_bandwidth'])} "
                      f"of the {num(big['metrics.copy_gbps_same_run'])} GB/s a copy reached at the same size and "
                      f"{pct(g(big, 'metrics.pct_of_library'))} of torch.add's rate; the roofline predicted "
                      f"{num(big['prediction.predicted_ms'], 3)} ms from bandwidth alone and it took {num(big['metrics.ms'], 3)} ms.")
        s = _softmax_facts(f["softmax"]) if "softmax" in f else None
        if s:
            tr, un, th = s["seed_triton"], s["seed_unfused"], s["seed_torch"]
            if tr is not None and un is not None:
                s_.append(f"**Why fusion wins.** On the seed's {int(tr['params.rows']):,} x {int(tr['params.cols']):,} softmax "
                          f"the five-kernel chain moved {size_bytes(un['prediction.bytes'])} against the fused kernel's "
                          f"{size_bytes(tr['prediction.bytes'])} ({num(un['prediction.bytes'] / tr['prediction.bytes'], 3)}x) and took "
                          f"{num(un['metrics.ms'] / tr['metrics.ms'], 3)}x as long: the unfused chain itself ran at "
                          f"{num(un['metrics.gbps'])} GB/s of its own traffic, so it is not slow arithmetic but "
                          f"{num(un['prediction.bytes'] / tr['prediction.bytes'], 2)}x the bytes."
                          + (f" torch.softmax, one fused kernel too, took {num(th['metrics.ms'] * 1000, 3)} µs against "
                             f"Triton's {num(tr['metrics.ms'] * 1000, 3)} µs." if th is not None else ""))
            lo, ln = s["min_lib"], s["longest"]
            s_.append(f"Across the row-length sweep the fused kernel's worst showing against torch.softmax was "
                      f"{pct(lo['metrics.pct_of_library'])} of its speed (rows of {int(lo['params.cols']):,}); at the longest rows "
                      f"({int(ln['params.cols']):,} elements) the tuner picked "
                      f"`{g(ln, 'metrics.kernel')}` and it ran at {num(ln['metrics.gbps'])} GB/s, "
                      f"{pct(ln['metrics.pct_of_copy_bandwidth'])} of copy, {pct(g(ln, 'metrics.pct_of_library'))} of torch.softmax.")
        m = _matmul_best(f["matmul"]) if "matmul" in f else None
        if m is not None:
            n = int(m["params.n"])
            s_.append(f"**Why tiling wins, and the gap.** The bf16 product at N = {n:,} has an intensity of "
                      f"{num(m['prediction.intensity_flop_per_byte'])} FLOP/byte overall, but every K step of a tile only "
                      f"reuses what it loads a bounded number of times, so the tile shape and the L2 decide whether the "
                      f"tensor cores wait. The best Triton kernel ({m['variant']}, `{g(m, 'metrics.config')}`) reached "
                      f"{num(m['metrics.tflops'])} TFLOP/s, {pct(g(m, 'metrics.pct_of_library'))} of cuBLAS "
                      f"({num(m['metrics.tflops'] * 100 / g(m, 'metrics.pct_of_library'))} TFLOP/s in the same run) and "
                      f"{pct(m['metrics.pct_of_peak_tflops'])} of the spec-sheet peak; measured/predicted "
                      f"{num(m['prediction.measured_over_predicted'], 3)}."
                      + _conditions(v, m["path"]))
        at = _attn_goal_rows(f["fwd"]) if "fwd" in f else None
        if at is not None:
            top = at.iloc[-1]
            s_.append(f"**Flash attention.** bf16, head dim 128, non-causal, N = {int(top['params.n']):,}: "
                      f"{num(top['metrics.tflops'])} TFLOP/s, {pct(g(top, 'metrics.pct_of_library'))} of the fastest "
                      f"library path ({_lib(g(top, 'metrics.library'))}, {num(g(top, 'metrics.library_ms'), 3)} ms against "
                      f"Triton's {num(top['metrics.ms'], 3)} ms), {pct(top['metrics.pct_of_peak_tflops'])} of the dense "
                      f"bf16 peak; config `{g(top, 'metrics.config')}`.")
        fw = f.get("fwd")
        if fw is not None:
            seed = fw[(fw["params.group"] == "seed") & (fw["variant"] == "triton") & (fw["status"] == "ok")]
            if len(seed):
                big = seed.sort_values("params.n").iloc[-1]
                s_.append(f"In the seed's fp32 case at N = {int(big['params.n']):,}, naive attention materialized "
                          f"{size_bytes(big['metrics.attn_matrix_bytes'])} per N x N matrix, and the fused kernel ran "
                          f"{num(g(big, 'metrics.speedup_vs_naive'), 3)}x as fast as it.")
        bw = f.get("bwd")
        if bw is not None:
            ok = bw[(bw["variant"] == "triton") & (bw["status"] == "ok") & (bw["params.dtype"] == "bf16")
                    & (bw["params.head_dim"] == 128) & (bw["params.causal"] == False)]  # noqa: E712
            if len(ok):
                top = ok.sort_values("params.n").iloc[-1]
                s_.append(f"**Backward.** At the same shape the backward ran at {num(top['metrics.tflops'])} TFLOP/s "
                          f"(conventional FLOPs), {pct(g(top, 'metrics.pct_of_library'))} of "
                          f"{_lib(g(top, 'metrics.library'))}'s backward.")
        if s_:
            paras.append(f"On the {name}:\n\n" + "\n\n".join(s_))
    return "\n\n".join(paras) or "_No phase 3 records yet._"


def _conditions(v: View, path: str) -> str:
    c = (v.record(path).get("conditions") or {}).get("gpu_after_run") or {}
    reasons = [r for r in (c.get("clock_event_reasons") or []) if r != "gpu_idle"]
    if not reasons:
        return ""
    return (f" Right after the run the SM clock read {num(c.get('sm_clock_mhz'))} MHz at {num(c.get('power_draw_w'))} W, "
            f"held back by `{'`, `'.join(reasons)}`: both Triton and cuBLAS run under the same power cap.")


TABLES = {"phase3.vector_add": t_vector_add, "phase3.softmax": t_softmax, "phase3.matmul": t_matmul,
          "phase3.flash_attention": t_flash_attention, "phase3.flash_attention_bwd": t_flash_attention_bwd,
          "phase3.goals": t_goals, "phase3.findings": t_findings}


# ------------------------------------------------------------------------------ plots
def _latest_record(records, ex, hw):
    got = [r for r in records if r["exercise"]["id"] == ex and r["hardware"]["key"] == hw and r["status"] != "skipped"
           and r.get("source", {}).get("kind", "measured") == "measured"]
    return sorted(got, key=lambda r: r["_path"])[-1] if got else None


def _hardware(records) -> list[str]:
    return sorted({r["hardware"]["key"] for r in records if r["exercise"]["id"] in EX.values()
                   and r["status"] != "skipped" and r.get("source", {}).get("kind", "measured") == "measured"})


def expected(records, results) -> list[Path]:
    out = []
    for hw in _hardware(records):
        if _latest_record(records, EX["add"], hw) or _latest_record(records, EX["softmax"], hw):
            out.append(Path(results) / "plots" / f"phase3_bandwidth_{hw}.png")
        if _latest_record(records, EX["fwd"], hw):
            out.append(Path(results) / "plots" / f"phase3_attention_{hw}.png")
    return out


def draw(records, results) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    meta = {"Software": None}
    made = []
    for path in expected(records, results):
        path.parent.mkdir(parents=True, exist_ok=True)
        hw = path.stem.split("_", 2)[2]
        fig, ax = plt.subplots(figsize=(8, 4.8))
        if path.stem.startswith("phase3_bandwidth"):
            add = _latest_record(records, EX["add"], hw)
            for variant, style in (("copy", "k--"), ("torch", "s-"), ("triton", "o-")):
                pts = sorted((r["params"]["working_set_bytes"] / 2**20, r["metrics"]["gbps"]) for r in (add or {}).get("rows", [])
                             if r["variant"] == variant and r["status"] == "ok")
                if pts:
                    ax.plot(*zip(*pts), style, label=f"vector add: {variant}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("vector add working set (MiB)")
            ax.set_ylabel("GB/s")
            handles, labels = ax.get_legend_handles_labels()
            sm = _latest_record(records, EX["softmax"], hw)
            curves = [(variant, style, sorted((r["params"]["cols"], r["metrics"].get("effective_gbps") or 0)
                                              for r in (sm or {}).get("rows", []) if r["variant"] == variant
                                              and r["status"] == "ok" and r["params"].get("group") == "sweep"))
                      for variant, style in (("torch", "v-"), ("unfused", "x-"), ("triton", "^-"))]
            if any(pts for _, _, pts in curves):
                top = ax.twiny()                    # softmax shares the GB/s axis, its own x axis
                for variant, style, pts in curves:
                    if pts:
                        top.plot(*zip(*pts), style, alpha=0.7, label=f"softmax: {variant} (top axis)")
                top.set_xscale("log", base=2)
                top.set_xlabel("softmax row length (elements), effective GB/s = 2·M·N·4 / time")
                h2, l2 = top.get_legend_handles_labels()
                handles, labels = handles + h2, labels + l2
            ax.legend(handles, labels, fontsize=7, loc="lower right")
            ax.set_title(f"Phase 3 bandwidth: {hw}")
        else:
            fwd = _latest_record(records, EX["fwd"], hw)
            for variant, style in (("triton", "o-"), ("sdpa_cudnn", "s--"), ("sdpa_flash", "v--"), ("sdpa_efficient", "x:")):
                pts = sorted((r["params"]["n"], r["metrics"]["tflops"]) for r in fwd["rows"]
                             if r["variant"] == variant and r["status"] == "ok" and r["params"].get("group") == "main"
                             and r["params"].get("dtype") == "bf16" and r["params"].get("head_dim") == 128
                             and not r["params"].get("causal"))
                if pts:
                    ax.plot(*zip(*pts), style, label=variant)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length N")
            ax.set_ylabel("TFLOP/s (4·B·H·N²·D / time)")
            ax.set_title(f"Attention forward, bf16, head dim 128, non-causal: {hw}")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=110, metadata=meta)
        plt.close(fig)
        made.append(path)
    return made


def key_result(v: View) -> list[str]:
    """One line per GPU for the main README's phase table: the matmul and attention headlines."""
    out = []
    mm, fa = latest(v.df, "phase3.matmul"), latest(v.df, "phase3.flash_attention")
    hardware = sorted(set(mm["hardware"]) if len(mm) else set()) if len(mm) else []
    for hw in hardware:
        parts, name = [], hw
        m = mm[(mm["hardware"] == hw) & (mm["status"] == "ok") & mm["variant"].str.startswith("triton")
               & (mm["params.dtype"] == "bf16")]
        if len(m):
            top = m[m["params.n"] == m["params.n"].max()]
            best = top.loc[top["metrics.pct_of_library"].idxmax()]
            name = best["hardware_name"]
            parts.append(f"bf16 matmul {pct(best['metrics.pct_of_library'])} of cuBLAS at N = {num(best['params.n'])}")
        if len(fa):
            f = fa[(fa["hardware"] == hw) & (fa["status"] == "ok") & (fa["variant"] == "triton")
                   & (fa["params.dtype"] == "bf16") & (fa["params.head_dim"] == 128) & (fa["params.causal"] == False)]  # noqa: E712
            if len(f):
                r = f.loc[f["params.n"].idxmax()]
                parts.append(f"flash attention fwd {num(r['metrics.tflops'])} TFLOP/s (bf16, d=128, N = {num(r['params.n'])}, "
                             f"{pct(r['metrics.pct_of_library'])} of {r['metrics.library']})")
        if parts:
            out.append(f"{name}: " + ", ".join(parts))
    return out
