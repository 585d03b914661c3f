"""Phase 0's README blocks, declared (rendered by common/render.py)."""
from common.formats import bullets, num, num4, pct, ratio
from common.frame import by_hardware, find
from common.spec import Phase, Table, Text, col, ident


def _tf32(r):
    allowed = r.get("params.tf32_allowed")
    return "not stated" if allowed is None or allowed != allowed else ("yes" if allowed else "no")


def _pct_of_peak(r):
    return f"{pct(r.get('metrics.pct_of_peak_tflops'))} of {num(r.get('metrics.peak_tflops'))}"


GATES = Table("phase0.gates", "phase0.gates", prediction=False, columns=(
    ident("gate", "variant"), col("status", "status"),
    col("observed", lambda r: r.get("metrics.observed") or r.get("reason"))))

MATMUL_BASELINE = Table("phase0.matmul_baseline", "phase0.matmul_baseline", columns=(
    ident("variant", "variant"), ident("TF32 allowed", _tf32), col("ms (median)", "metrics.ms", num),
    col("TFLOP/s", "metrics.tflops", num), col("best-sample TFLOP/s", "metrics.best_tflops", num),
    col("% of peak (TFLOP/s)", _pct_of_peak)))

SYNCHRONIZE = Table("phase0.synchronize", "phase0.synchronize", hide_failed=True, columns=(
    ident("timing", lambda r: "with synchronize" if r.get("params.synchronize") else "without synchronize"),
    col("ms per matmul", "metrics.ms", num), col("implied TFLOP/s", "metrics.tflops", num),
    col("% of peak", "metrics.pct_of_peak_tflops", pct)))

TIMER_CHECK = Table("phase0.timer_check", "phase0.timer_check", columns=(
    ident("kernel", "variant"), col("harness ms", "metrics.ms", num4), col("do_bench ms", "metrics.do_bench_ms", num4),
    col("harness/do_bench", "metrics.harness_over_do_bench", num4)))


def findings(view) -> str:
    paras = []
    exercises = ["phase0.matmul_baseline", "phase0.synchronize", "phase0.timer_check"]
    for _, got in sorted(by_hardware(view.frame, exercises).items()):
        name = next(iter(got.values())).iloc[0]["hardware_name"]
        s = []
        fp32, tf32 = find(got.get("phase0.matmul_baseline"), "fp32"), find(got.get("phase0.matmul_baseline"), "tf32")
        if fp32 is not None:
            s.append(f"cuBLAS ran the {num(fp32['params.n'])}² FP32 matmul at {num(fp32['metrics.tflops'])} "
                     f"TFLOP/s with TF32 disallowed: {pct(fp32['metrics.pct_of_peak_tflops'])} of the "
                     f"{num(fp32['metrics.peak_tflops'])} TFLOP/s FP32 peak on the spec sheet.")
        if tf32 is not None:
            s.append(f"Allowing TF32 moved the same call onto the tensor cores: {num(tf32['metrics.tflops'])} TFLOP/s, "
                     f"{pct(tf32['metrics.pct_of_peak_tflops'])} of the {num(tf32['metrics.peak_tflops'])} TFLOP/s TF32 peak"
                     + (f", {num(tf32['metrics.tflops'] / fp32['metrics.tflops'], 2)}x the FP32 rate." if fp32 is not None else "."))
        no_sync, sync = find(got.get("phase0.synchronize"), "no_sync"), find(got.get("phase0.synchronize"), "sync")
        if no_sync is not None and sync is not None:
            s.append(f"Timed with a host clock and no synchronize, one matmul appeared to take {num(no_sync['metrics.ms'])} ms, "
                     f"{num(1 / no_sync['prediction.measured_over_predicted'])}x *less* than the roofline's floor of "
                     f"{num(no_sync['prediction.predicted_ms'])} ms: an impossible number, because the clock stopped once the "
                     f"launches were queued.")
            s.append(f"With a synchronize it took {num(sync['metrics.ms'])} ms "
                     f"({ratio(sync['prediction.measured_over_predicted'])} the floor).")
        timer = got.get("phase0.timer_check")
        if timer is not None and len(timer):
            gaps = (timer["metrics.harness_over_do_bench"].dropna() - 1).abs()
            if len(gaps):
                agreed = "agreed" if (timer["status"] == "ok").all() else "did NOT agree"
                s.append(f"The lab's timing harness and `triton.testing.do_bench` {agreed} on {len(gaps)} kernels "
                         f"(worst difference {pct(100 * gaps.max())}; the gate is 5%).")
        paras.append(bullets(s, f"On the {name}:"))
    return "\n\n".join(paras)


def headline(view) -> list[str]:
    out = []
    for _, got in sorted(by_hardware(view.frame, ["phase0.matmul_baseline"]).items()):
        r = find(got["phase0.matmul_baseline"], "fp32")
        if r is not None:
            out.append(f"{r['hardware_name']}: FP32 matmul {num(r['metrics.tflops'])} TFLOP/s "
                       f"({pct(r['metrics.pct_of_peak_tflops'])} of peak)")
    return out


PHASE = Phase(0, "Environment & tooling", "phase0_environment",
              excluded={("phase0.synchronize", "no_sync"): "lesson: timed by a host clock without a synchronize, "
                                                            "so the number is wrong on purpose"},
              blocks=(GATES, MATMUL_BASELINE, SYNCHRONIZE, TIMER_CHECK,
                      Text("phase0.findings", findings, "_No phase 0 records yet._")),
              headline=headline)
