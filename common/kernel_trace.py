"""A profiler trace's kernels set against a workload's kernel list (common/workload.py): does the
summed model launch what the GPU ran, and does it put the time where the GPU spent it?

Both sides are grouped by kind, by name: attention, matmul (cuBLAS, CUTLASS, a GEMV), and every
other kernel (norms, element-wise, casts, copies, reductions, sampling). Grouping by kind, not
kernel by kernel, because the two sides name kernels differently (a cuBLAS kernel's mangled name
against "QKV (+ RMSNorm)") and a fused kernel of one is two of the other; a model kernel whose name
says attention is attention whatever it runs on, else its kind decides (MATMUL and GEMV: matmul).
Per group: launches per step and time per step, and each side's share of its total. Torch-free:
common/kernel_trace_check.py runs the profiler on a GPU; the CPU tests feed it a fake trace.
"""
from . import workload
from .formats import markdown, num

ATTENTION, MATMUL, OTHER = "attention", "matmul", "other"
GROUPS = (ATTENTION, MATMUL, OTHER)
# Name fragments, lower case, checked in this order (attention first: a flash kernel runs matmuls).
TRACE_WORDS = ((ATTENTION, ("flash", "fmha", "attn", "attention", "sdpa", "paged")),
               (MATMUL, ("gemm", "gemv", "xmma", "cutlass", "nvjet", "matmul", "splitk", "cublas", "wgmma", "mma_",
                         "w4a16", "w8a16", "int4pack")))   # the weight-only quantized kernels (int4 CUDA, Triton, tinygemm)


def trace_group(name: str) -> str:
    """The group of a kernel named as the profiler names it."""
    low = name.lower()
    return next((group for group, words in TRACE_WORDS if any(w in low for w in words)), OTHER)


def model_group(k: workload.Kernel) -> str:
    """The group of a kernel of the model's list."""
    if "attention" in k.name.lower():
        return ATTENTION
    return MATMUL if k.kind in (workload.MATMUL, workload.GEMV) else OTHER


def compare(trace: list[tuple[str, float, int]], steps: int, w: workload.Workload, ceilings: dict,
            spec_fp32_tflops: float | None = None) -> dict:
    """`trace`: (kernel name, total device µs, calls) over `steps` profiled steps. Per group and in
    all: launches and ms per step on each side, each side's share, the largest traced kernels."""
    if steps < 1:
        raise ValueError("steps must be >= 1")
    rates, fallbacks = workload.rates(ceilings, spec_fp32_tflops)
    groups = {g: {"group": g, "trace_launches": 0.0, "trace_ms": 0.0, "model_launches": 0, "model_ms": 0.0}
              for g in GROUPS}
    for name, total_us, calls in trace:
        g = groups[trace_group(name)]
        g["trace_launches"] += calls / steps
        g["trace_ms"] += total_us / 1e3 / steps
    for k in w.kernels:
        g = groups[model_group(k)]
        g["model_launches"] += k.count
        g["model_ms"] += workload.kernel_ms(k, rates)[0]
    trace_ms = sum(g["trace_ms"] for g in groups.values())
    model_ms = sum(g["model_ms"] for g in groups.values())
    for g in groups.values():
        g["trace_share"] = g["trace_ms"] / trace_ms if trace_ms else None
        g["model_share"] = g["model_ms"] / model_ms if model_ms else None
    top = sorted(trace, key=lambda t: -t[1])[:15]
    host = workload.predict(w, ceilings, spec_fp32_tflops)["host_ms"]
    return {"workload": w.name, "steps": steps, "groups": list(groups.values()),
            "totals": {"trace_launches": sum(g["trace_launches"] for g in groups.values()),
                       "model_launches": sum(g["model_launches"] for g in groups.values()),
                       "trace_kernel_ms": trace_ms, "model_kernel_ms": model_ms, "model_host_ms": host,
                       "trace_over_model_kernel_ms": trace_ms / model_ms if model_ms else None},
            "trace_top": [{"kernel": n, "group": trace_group(n), "ms_per_step": us / 1e3 / steps,
                           "calls_per_step": c / steps} for n, us, c in top],
            "fallbacks": fallbacks, "ceilings_record": ceilings.get("record")}


def table(result: dict) -> str:
    """The comparison as a markdown table: one line per group and one for all."""
    def pct(x):
        return "-" if x is None else f"{100 * x:.0f}%"
    lines = [[g["group"], num(g["trace_launches"]), str(g["model_launches"]), num(g["trace_ms"]), num(g["model_ms"]),
              pct(g["trace_share"]), pct(g["model_share"])] for g in result["groups"]]
    t = result["totals"]
    lines.append(["all", num(t["trace_launches"]), str(t["model_launches"]), num(t["trace_kernel_ms"]),
                  num(t["model_kernel_ms"]), "100%", "100%"])
    return markdown(lines, ["group", "traced launches / step", "model launches", "traced ms / step", "model ms",
                            "traced share", "model share"])
