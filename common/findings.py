"""Findings written from records: the sentences in the READMEs that carry numbers.

The prose around these blocks explains; every number in it is filled in here from results/, so
re-running a phase on another GPU rewrites the findings for that GPU too.
"""
from .report import View, g, latest, num, pct, size_bytes


def _measured(v: View, exercise: str):
    sub = latest(v.df, exercise)
    return sub[sub["source"] == "measured"] if len(sub) else sub


def _by_hw(v: View, exercises: list[str]) -> dict:
    """hardware key -> {exercise: DataFrame of its latest measured rows}."""
    out: dict = {}
    for ex in exercises:
        sub = _measured(v, ex)
        for hw, rows in (sub.groupby("hardware") if len(sub) else []):
            out.setdefault(hw, {})[ex] = rows
    return out


def _row(rows, variant=None, **params):
    if rows is None:
        return None
    for _, r in rows.iterrows():
        if r["status"] == "ok" and (variant is None or r["variant"] == variant) and \
                all(r.get(f"params.{k}") == val for k, val in params.items()):
            return r
    return None


def _conditions_sentence(v: View, path: str) -> str:
    """' Right after it, the SMs ran at 1425 MHz at 526 W, held back by: sw_power_cap.'"""
    c = (v.record(path).get("conditions") or {}).get("gpu_after_run") or {}
    reasons = [r for r in (c.get("clock_event_reasons") or []) if r != "gpu_idle"]
    if not reasons:
        return ""
    return (f" Read right after the run, the SM clock was {num(c.get('sm_clock_mhz'))} MHz at {num(c.get('power_draw_w'))} W, "
            f"held back by `{'`, `'.join(reasons)}`: sustained dense math hits the board's power limit before its "
            f"arithmetic peak, so the median is the honest sustained rate and the spec peak is not reachable for long.")


def phase0(v: View) -> str:
    exs = ["phase0.matmul_baseline", "phase0.synchronize", "phase0.timer_check"]
    paras = []
    for hw, got in sorted(_by_hw(v, exs).items()):
        name = next(iter(got.values())).iloc[0]["hardware_name"]
        s = []
        fp32 = _row(got.get("phase0.matmul_baseline"), "fp32")
        tf32 = _row(got.get("phase0.matmul_baseline"), "tf32")
        if fp32 is not None:
            s.append(f"On the {name}, cuBLAS ran the {num(fp32['params.n'])}² FP32 matmul at "
                     f"{num(fp32['metrics.tflops'])} TFLOP/s with TF32 disallowed: {pct(fp32['metrics.pct_of_peak_tflops'])} "
                     f"of the {num(fp32['metrics.peak_tflops'])} TFLOP/s FP32 peak on the spec sheet.")
        if tf32 is not None:
            s.append(f"Allowing TF32 moved the same call onto the tensor cores: {num(tf32['metrics.tflops'])} TFLOP/s, "
                     f"{pct(tf32['metrics.pct_of_peak_tflops'])} of the {num(tf32['metrics.peak_tflops'])} TFLOP/s TF32 peak, "
                     + (f"{num(tf32['metrics.tflops'] / fp32['metrics.tflops'], 2)}x the FP32 rate." if fp32 is not None else ""))
        ns, ws = _row(got.get("phase0.synchronize"), "no_sync"), _row(got.get("phase0.synchronize"), "sync")
        if ns is not None and ws is not None:
            s.append(f"Timed with a host clock and no synchronize, one matmul appeared to take {num(ns['metrics.ms'], 3)} ms, "
                     f"{num(1 / ns['prediction.measured_over_predicted'])}x *less* than the roofline's floor of "
                     f"{num(ns['prediction.predicted_ms'], 3)} ms: an impossible number, because the clock stopped once the "
                     f"launches were queued. With a synchronize it took {num(ws['metrics.ms'], 3)} ms "
                     f"({num(ws['prediction.measured_over_predicted'], 3)}x the floor).")
        tc = got.get("phase0.timer_check")
        if tc is not None and len(tc):
            ratios = [r["metrics.harness_over_do_bench"] for _, r in tc.iterrows() if r.get("metrics.harness_over_do_bench") == r.get("metrics.harness_over_do_bench")]
            ok = all(tc["status"] == "ok")
            if ratios:
                worst = max(abs(x - 1) for x in ratios)
                s.append(f"The lab's timing harness and `triton.testing.do_bench` {'agreed' if ok else 'did NOT agree'} "
                         f"on {len(ratios)} kernels (worst difference {pct(100 * worst)}; the gate is 5%).")
        paras.append(" ".join(s))
    return "\n\n".join(paras) or "_No phase 0 records yet._"


def phase1(v: View) -> str:
    exs = ["phase1.elementwise", "phase1.matmul_fp16", "phase1.regime_sweep", "phase1.cache_sweep", "phase1.nsight"]
    paras = []
    for hw, got in sorted(_by_hw(v, exs).items()):
        name = next(iter(got.values())).iloc[0]["hardware_name"]
        s = []
        ew = got.get("phase1.elementwise")
        if ew is not None:
            big = int(ew["params.n"].max())
            mul, cp = _row(ew, "mul", n=big), _row(ew, "copy", n=big)
            if mul is not None:
                s.append(f"**Memory-bound.** On the {name}, the FP32 multiply over {size_bytes(big * 4)} vectors "
                         f"({size_bytes(3 * big * 4)} moved per call) ran at {num(mul['metrics.gbps'])} GB/s: "
                         f"{pct(mul['metrics.pct_of_peak_bandwidth'])} of the {num(mul['metrics.peak_bandwidth_gbps'])} GB/s "
                         f"on the spec sheet" + (f" and {pct(mul['metrics.pct_of_copy_bandwidth'])} of the "
                                                 f"{num(cp['metrics.gbps'])} GB/s a plain copy reached in the same run" if cp is not None else "")
                         + f". At {num(mul['prediction.intensity_flop_per_byte'])} FLOP/byte it sits "
                         f"{num(mul['prediction.ridge_flop_per_byte'] / mul['prediction.intensity_flop_per_byte'])}x left of the "
                         f"FP32 ridge, so the roofline predicted {num(mul['prediction.predicted_ms'], 3)} ms from bandwidth alone; it took "
                         f"{num(mul['metrics.ms'], 3)} ms ({num(mul['prediction.measured_over_predicted'], 3)}x).")
        mm = _row(got.get("phase1.matmul_fp16"))
        if mm is not None:
            s.append(f"**Compute-bound.** The FP16 matmul at N = {num(mm['params.n'])} ({num(mm['prediction.intensity_flop_per_byte'])} "
                     f"FLOP/byte) ran at {num(mm['metrics.tflops'])} TFLOP/s (median), {pct(mm['metrics.pct_of_peak_tflops'])} of the "
                     f"{num(mm['metrics.peak_tflops'])} TFLOP/s dense peak; measured/predicted {num(mm['prediction.measured_over_predicted'], 3)}. "
                     f"Its fastest sample reached {num(g(mm, 'metrics.best_tflops'))} TFLOP/s." + _conditions_sentence(v, mm["path"]))
        ns = got.get("phase1.nsight")
        if ns is not None:
            e, m = _row(ns, "elementwise"), _row(ns, "matmul_fp16")
            if e is not None and m is not None:
                s.append(f"Nsight Compute agrees on who is busy: the multiply kept DRAM at {pct(e['metrics.dram_throughput_pct'])} "
                         f"and the SMs at {pct(e['metrics.sm_throughput_pct'])}; the matmul flipped it, DRAM "
                         f"{pct(m['metrics.dram_throughput_pct'])} and SMs {pct(m['metrics.sm_throughput_pct'])}. The multiply moved "
                         f"{num(e['metrics.dram_bytes_over_ideal'], 3)}x the bytes the roofline counted"
                         + (" (under 1, most likely because the L2 is write-back: the last lines the kernel writes can still "
                            "sit in L2 when it ends and reach HBM after the counters stop; not verified here)" if e['metrics.dram_bytes_over_ideal'] < 1 else "")
                         + f"; the matmul {num(m['metrics.dram_bytes_over_ideal'], 3)}x its ideal 3N² x 2 bytes, because its "
                         f"tiles re-read A and B from HBM whenever L2 cannot hold them, and still at "
                         f"{num(m['metrics.intensity_measured_flop_per_byte'])} FLOP/byte it stays far right of the ridge.")
        sw = got.get("phase1.regime_sweep")
        if sw is not None:
            summ = v.record(sw.iloc[0]["path"])["summary"]
            ok = sw[sw["status"] == "ok"].sort_values("params.n")
            if len(ok):
                lo, hi = ok.iloc[0], ok.iloc[-1]
                s.append(f"**The regime change.** Across N = {num(lo['params.n'])} to {num(hi['params.n'])} the rate rose from "
                         f"{num(lo['metrics.tflops'])} to {num(hi['metrics.tflops'])} TFLOP/s. The spec sheet puts the ridge at "
                         f"{num(summ.get('spec_ridge_flop_per_byte'))} FLOP/byte (N ≈ {num(summ.get('spec_crossover_n'))}); this run's "
                         f"own ceilings put it at {num(summ.get('measured_ridge_flop_per_byte'))} (N ≈ {num(summ.get('measured_crossover_n'))}). "
                         f"The smallest products missed both roofs by {num(lo['prediction.measured_over_predicted'])}x: at "
                         f"{num(lo['metrics.ms'] * 1000, 3)} µs they are bound by kernel start-up, a third regime the two-line model does not draw.")
        cs = got.get("phase1.cache_sweep")
        if cs is not None:
            summ = v.record(cs.iloc[0]["path"])["summary"]
            if summ.get("hbm_plateau_gbps"):
                s.append(f"**The L2 cliff.** Copy bandwidth with warm caches peaked at {num(summ['peak_gbps'])} GB/s for a "
                         f"{size_bytes(summ['peak_working_set_bytes'])} working set (L2: {size_bytes(summ['l2_bytes'])}), "
                         f"{num(summ['peak_over_plateau'], 3)}x the {num(summ['hbm_plateau_gbps'])} GB/s plateau once the working set "
                         f"is many times the L2 and every byte comes from HBM.")
        paras.append("\n\n".join(s))
    return "\n\n".join(paras) or "_No phase 1 records yet._"


PHASES = [(0, "Environment & tooling", "phase0_environment"), (1, "Roofline & memory hierarchy", "phase1_roofline"),
          (2, "CUDA kernels", "phase2_cuda"), (3, "Triton kernels", "phase3_triton"), (4, "Distributed primitives", "phase4_distributed"),
          (5, "Inference & serving", None), (6, "Alternative hardware", None), (7, "A GPT from scratch", "phase7_gpt")]


def _phase_key_result(folder: str, v: View) -> list[str]:
    import importlib
    import importlib.util
    if importlib.util.find_spec(f"phases.{folder}.tables") is None:
        return []
    fn = getattr(importlib.import_module(f"phases.{folder}.tables"), "key_result", None)
    return list(fn(v)) if fn else []


def phase_table(v: View) -> str:
    """The README's phase table: status and key result, from records."""
    by0 = _by_hw(v, ["phase0.matmul_baseline"])
    by1 = _by_hw(v, ["phase1.elementwise", "phase1.matmul_fp16"])
    rows = []
    for n, topic, folder in PHASES:
        link = f"[{topic}](phases/{folder}/README.md)" if folder else topic
        hws = sorted(set((by0 if n == 0 else by1 if n == 1 else {}).keys()))
        key = []
        for hw in hws:
            if n == 0:
                r = _row(by0[hw].get("phase0.matmul_baseline"), "fp32")
                if r is not None:
                    key.append(f"{r['hardware_name']}: FP32 matmul {num(r['metrics.tflops'])} TFLOP/s ({pct(r['metrics.pct_of_peak_tflops'])} of peak)")
            if n == 1:
                ew, mm = by1[hw].get("phase1.elementwise"), by1[hw].get("phase1.matmul_fp16")
                big = _row(ew, "mul", n=int(ew["params.n"].max())) if ew is not None else None
                m = _row(mm)
                parts = []
                if big is not None:
                    parts.append(f"multiply {num(big['metrics.gbps'])} GB/s ({pct(big['metrics.pct_of_peak_bandwidth'])} of spec)")
                if m is not None:
                    parts.append(f"FP16 matmul {num(m['metrics.tflops'])} TFLOP/s ({pct(m['metrics.pct_of_peak_tflops'])})")
                if parts:
                    key.append(f"{big['hardware_name'] if big is not None else hw}: " + ", ".join(parts))
        if folder and n > 1:                    # later phases describe themselves (tables.key_result)
            key += _phase_key_result(folder, v)
        has_records = any(r["exercise"].get("phase") == n and r["status"] != "skipped"
                          and r.get("source", {}).get("kind", "measured") == "measured" for r in v.records)
        status = "measured" if (key or has_records) else ("built, not yet measured" if folder else "planned")
        rows.append([str(n), link, status, "; ".join(key) or "-"])
    from .report import markdown
    return markdown(rows, ["phase", "topic", "status", "key result (from results/)"])


BLOCKS = {"phase0.findings": phase0, "phase1.findings": phase1, "phases": phase_table}
