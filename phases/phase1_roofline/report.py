"""Phase 1's README blocks, declared (rendered by common/render.py): tables, the roofline and
L2-cliff plots, and the findings."""
from common.above_roof import bandwidth_pct
from common.formats import bullets, elements, num, num4, pct, ratio, size_bytes
from common.frame import by_hardware, find, value
from common.spec import Phase, Plot, Table, Text, col, ident

from . import plots

INTENSITY = col("FLOP/byte", "prediction.intensity_flop_per_byte", num)

ELEMENTWISE = Table("phase1.elementwise", "phase1.elementwise", columns=(
    ident("op", "variant"), ident("elements", "params.n", elements),
    ident("working set", "params.working_set_bytes", size_bytes), col("ms", "metrics.ms", num),
    col("GB/s", "metrics.gbps", num), col("% of spec BW", bandwidth_pct),
    col("% of copy (same run)", "metrics.pct_of_copy_bandwidth", pct), INTENSITY))

MATMUL_COLUMNS = (ident("N", "params.n", num), ident("dtype", "params.dtype"), INTENSITY,
                  col("ms (median)", "metrics.ms", num4), col("TFLOP/s", "metrics.tflops", num),
                  col("best-sample TFLOP/s", "metrics.best_tflops", num), col("% of peak", "metrics.pct_of_peak_tflops", pct))


def ridge_note(view, rows) -> str:
    out = []
    for path in dict.fromkeys(rows["path"]):
        rec = view.record(path)
        s, name = rec["summary"], (rec["hardware"].get("spec") or {}).get("name") or rec["hardware"]["key"]
        out.append(f"Ridge point on {name}: {num(s.get('spec_ridge_flop_per_byte'))} FLOP/byte from the spec sheet "
                   f"(crossover at N = {num(s.get('spec_crossover_n'))}); {num(s.get('measured_ridge_flop_per_byte'))} "
                   f"FLOP/byte from this run's own ceilings ({num(s.get('measured_peak_tflops'))} TFLOP/s best matmul over "
                   f"{num(s.get('measured_copy_gbps'))} GB/s copy, crossover at N = {num(s.get('measured_crossover_n'))}). "
                   f"The smallest N reaching half the best rate was {num(s.get('smallest_n_at_half_of_best'))}.")
    return "\n".join(out)


MATMUL_FP16 = Table("phase1.matmul_fp16", "phase1.matmul_fp16", columns=MATMUL_COLUMNS)
REGIME_SWEEP = Table("phase1.regime_sweep", "phase1.regime_sweep", columns=MATMUL_COLUMNS, note=ridge_note)

def served_from(r) -> str:
    """Why a warm copy may pass 100% of the HBM roof: its working set fits in the L2 (the record's
    `l2_bytes`) and is served from there; '-' where the L2 size is unknown."""
    ws, l2 = value(r, "params.working_set_bytes"), value(r, "summary.l2_bytes")
    if not ws or not l2:
        return "-"
    return f"L2 (fits in {size_bytes(l2)})" if ws <= l2 else "HBM"


CACHE_SWEEP = Table("phase1.cache_sweep", "phase1.cache_sweep", columns=(
    ident("working set", "params.working_set_bytes", size_bytes), col("GB/s", "metrics.gbps", num),
    col("% of spec HBM BW", "metrics.pct_of_peak_bandwidth", pct), col("served from", served_from),
    col("copies per graph replay", "timing.graph_reps", num)))

NSIGHT = Table("phase1.nsight", "phase1.nsight", prediction=False, columns=(
    ident("anchor", "variant"), ident("N", "params.n", num), col("DRAM throughput", "metrics.dram_throughput_pct", pct),
    col("SM throughput", "metrics.sm_throughput_pct", pct), col("DRAM bytes (ncu)", "metrics.dram_bytes", size_bytes),
    col("ideal bytes", "metrics.ideal_bytes", size_bytes), col("ncu/ideal", "metrics.dram_bytes_over_ideal", lambda x: num(x, 3)),
    col("FLOP/byte (ncu bytes)", "metrics.intensity_measured_flop_per_byte", num)))

def ceilings_note(view, rows) -> str:
    out = []
    for path in dict.fromkeys(rows["path"]):
        rec = view.record(path)
        c, name = rec["summary"].get("ceilings") or {}, rec["hardware"].get("name") or rec["hardware"]["key"]
        rates = ", ".join(f"{d} {num(t)}" for d, t in sorted((c.get("matmul_tflops") or {}).items()))
        out.append(f"Ceilings of the {name}, as every calibrated prediction reads them: HBM copy {num(c.get('hbm_gbps'))} GB/s, "
                   f"L2 copy {num(c.get('l2_gbps'))} GB/s up to {size_bytes(c.get('l2_fit_bytes'))}, best matmul TFLOP/s "
                   f"{rates}, latency floor {num(c.get('launch_us'))} µs per kernel ({num(c.get('graph_launch_us'))} µs "
                   f"in a CUDA graph), synchronize {num(c.get('sync_us'))} µs.")
    return "\n".join(out)


CEILINGS = Table("phase1.ceilings", "phase1.ceilings", prediction=False, note=ceilings_note, columns=(
    ident("ceiling", "variant"), ident("working set or N", lambda r: size_bytes(r.get("params.working_set_bytes"))
                                      if r.get("params.working_set_bytes") == r.get("params.working_set_bytes")
                                      and r.get("params.working_set_bytes") is not None else num(r.get("params.n"))),
    col("ms (median)", "metrics.ms", num4), col("GB/s", "metrics.gbps", num), col("TFLOP/s", "metrics.tflops", num)))

ROOFLINE_PLOT = Plot("phase1.roofline_plot", "phase1_roofline", ("phase1.elementwise", "phase1.matmul_fp16", "phase1.regime_sweep"),
                     plots.roofline, "Roofline of the {name}: spec and measured roofs, every phase 0-1 point")
CACHE_PLOT = Plot("phase1.cache_plot", "phase1_cache", ("phase1.cache_sweep",), plots.cache,
                  "Copy bandwidth against working set on the {name}: the L2 cliff")


def _power_sentence(view, path: str) -> str:
    c = (view.record(path).get("conditions") or {}).get("gpu_after_run") or {}
    reasons = [r for r in (c.get("clock_event_reasons") or []) if r != "gpu_idle"]
    if not reasons:
        return ""
    return (f"Read right after the run, the SM clock was {num(c.get('sm_clock_mhz'))} MHz at {num(c.get('power_draw_w'))} W, "
            f"held back by `{'`, `'.join(reasons)}`: sustained dense math hits the board's power limit before its "
            f"arithmetic peak, so the median is the honest sustained rate and the spec peak is not reachable for long.")


def _memory_bound(ew) -> list[str]:
    big = int(ew["params.n"].max())
    mul, cp = find(ew, "mul", n=big), find(ew, "copy", n=big)
    if mul is None:
        return []
    vs_copy = (f" and {pct(mul['metrics.pct_of_copy_bandwidth'])} of the {num(cp['metrics.gbps'])} GB/s a plain copy "
               f"reached in the same run" if cp is not None else "")
    return [f"**Memory-bound.** The FP32 multiply over {size_bytes(big * 4)} vectors "
            f"({size_bytes(3 * big * 4)} moved per call) ran at {num(mul['metrics.gbps'])} GB/s: "
            f"{pct(mul['metrics.pct_of_peak_bandwidth'])} of the {num(mul['metrics.peak_bandwidth_gbps'])} GB/s on the spec "
            f"sheet{vs_copy}.",
            f"At {num(mul['prediction.intensity_flop_per_byte'])} FLOP/byte the multiply sits "
            f"{num(mul['prediction.ridge_flop_per_byte'] / mul['prediction.intensity_flop_per_byte'])}x left of the FP32 "
            f"ridge, so the roofline predicted {num(mul['prediction.predicted_ms'])} ms from bandwidth alone; it took "
            f"{num(mul['metrics.ms'])} ms ({ratio(mul['prediction.measured_over_predicted'])})."]


def _nsight(e, m) -> list[str]:
    write_back = (" (under 1, most likely because the L2 is write-back: the last lines the kernel writes can still sit in "
                  "L2 when it ends and reach HBM after the counters stop; not verified here)"
                  if e["metrics.dram_bytes_over_ideal"] < 1 else "")
    return [f"**Nsight Compute agrees on who is busy.** The multiply kept DRAM at {pct(e['metrics.dram_throughput_pct'])} "
            f"and the SMs at {pct(e['metrics.sm_throughput_pct'])}; the matmul flipped it, DRAM "
            f"{pct(m['metrics.dram_throughput_pct'])} and SMs {pct(m['metrics.sm_throughput_pct'])}.",
            f"The multiply moved {num(e['metrics.dram_bytes_over_ideal'])}x the bytes the roofline counted{write_back}.",
            f"The matmul moved {num(m['metrics.dram_bytes_over_ideal'])}x its ideal 3N² x 2 bytes, because its tiles re-read "
            f"A and B from HBM whenever L2 cannot hold them, and still at {num(m['metrics.intensity_measured_flop_per_byte'])} "
            f"FLOP/byte it stays far right of the ridge."]


def findings(view) -> str:
    exercises = ["phase1.elementwise", "phase1.matmul_fp16", "phase1.regime_sweep", "phase1.cache_sweep", "phase1.nsight"]
    paras = []
    for _, got in sorted(by_hardware(view.frame, exercises).items()):
        name = next(iter(got.values())).iloc[0]["hardware_name"]
        s = _memory_bound(got["phase1.elementwise"]) if "phase1.elementwise" in got else []
        mm = find(got.get("phase1.matmul_fp16"))
        if mm is not None:
            s.append(f"**Compute-bound.** The FP16 matmul at N = {num(mm['params.n'])} "
                     f"({num(mm['prediction.intensity_flop_per_byte'])} FLOP/byte) ran at {num(mm['metrics.tflops'])} TFLOP/s "
                     f"(median), {pct(mm['metrics.pct_of_peak_tflops'])} of the {num(mm['metrics.peak_tflops'])} TFLOP/s dense "
                     f"peak; measured/predicted {num(mm['prediction.measured_over_predicted'])}. Its fastest sample reached "
                     f"{num(value(mm, 'metrics.best_tflops'))} TFLOP/s.")
            s.append(_power_sentence(view, mm["path"]))
        e, m = find(got.get("phase1.nsight"), "elementwise"), find(got.get("phase1.nsight"), "matmul_fp16")
        if e is not None and m is not None:
            s += _nsight(e, m)
        sweep = got.get("phase1.regime_sweep")
        ok = sweep[sweep["status"] == "ok"].sort_values("params.n") if sweep is not None else []
        if len(ok):
            lo, hi, summ = ok.iloc[0], ok.iloc[-1], view.record(ok.iloc[0]["path"])["summary"]
            s.append(f"**The regime change.** Across N = {num(lo['params.n'])} to {num(hi['params.n'])} the rate rose from "
                     f"{num(lo['metrics.tflops'])} to {num(hi['metrics.tflops'])} TFLOP/s. The spec sheet puts the ridge at "
                     f"{num(summ.get('spec_ridge_flop_per_byte'))} FLOP/byte (N ≈ {num(summ.get('spec_crossover_n'))}); this "
                     f"run's own ceilings put it at {num(summ.get('measured_ridge_flop_per_byte'))} (N ≈ "
                     f"{num(summ.get('measured_crossover_n'))}).")
            s.append(f"The smallest products missed both roofs by {num(lo['prediction.measured_over_predicted'])}x: at "
                     f"{num(lo['metrics.ms'] * 1000)} µs they are bound by kernel start-up, a third regime the two-line "
                     "model does not draw.")
        cache = got.get("phase1.cache_sweep")
        summ = view.record(cache.iloc[0]["path"])["summary"] if cache is not None else {}
        if summ.get("hbm_plateau_gbps"):
            s.append(f"**The L2 cliff.** Copy bandwidth with warm caches peaked at {num(summ['peak_gbps'])} GB/s for a "
                     f"{size_bytes(summ['peak_working_set_bytes'])} working set (L2: {size_bytes(summ['l2_bytes'])}), "
                     f"{num(summ['peak_over_plateau'])}x the {num(summ['hbm_plateau_gbps'])} GB/s plateau once the working "
                     f"set is many times the L2 and every byte comes from HBM.")
        paras.append(bullets(s, f"On the {name}:"))
    return "\n\n".join(paras)


def headline(view) -> list[str]:
    out = []
    for _, got in sorted(by_hardware(view.frame, ["phase1.elementwise", "phase1.matmul_fp16"]).items()):
        ew, parts = got.get("phase1.elementwise"), []
        big = find(ew, "mul", n=int(ew["params.n"].max())) if ew is not None else None
        if big is not None:
            parts.append(f"multiply {num(big['metrics.gbps'])} GB/s ({pct(big['metrics.pct_of_peak_bandwidth'])} of spec)")
        mm = find(got.get("phase1.matmul_fp16"))
        if mm is not None:
            parts.append(f"FP16 matmul {num(mm['metrics.tflops'])} TFLOP/s ({pct(mm['metrics.pct_of_peak_tflops'])})")
        if parts:
            out.append(f"{next(iter(got.values())).iloc[0]['hardware_name']}: " + ", ".join(parts))
    return out


PHASE = Phase(1, "Roofline & memory hierarchy", "phase1_roofline",
              blocks=(CEILINGS, ELEMENTWISE, MATMUL_FP16, REGIME_SWEEP, CACHE_SWEEP, NSIGHT, ROOFLINE_PLOT, CACHE_PLOT,
                      Text("phase1.findings", findings, "_No phase 1 records yet._")),
              headline=headline)
