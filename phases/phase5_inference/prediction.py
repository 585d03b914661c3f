"""A run of many engine steps predicted step by step: the roofline of each step (its FLOPs and
bytes), summed. One roofline over the run's totals would be wrong: prefills are compute-bound and
decode steps memory-bound, and the two do not overlap. The block has the keys every record's
`prediction` has (spec sheet, and `calibrated` from this GPU's ceilings record when one exists)."""
from common import roofline


def summed_prediction(ctx, steps: list[tuple[float, float]], dtype: str, measured_ms: float | None,
                      launches_per_step: int = 1, graphed: bool = True) -> dict:
    """`steps`: (flops, bytes) of each engine step, in order."""
    roofs = ctx.roofs(dtype)
    peak = roofs.peak(dtype)
    mem = [b / (roofs.bandwidth_gbps * 1e6) for _, b in steps]
    comp = [f / (peak * 1e9) if peak else 0.0 for f, _ in steps]
    predicted = sum(max(m, c) for m, c in zip(mem, comp))
    flops, nbytes = sum(f for f, _ in steps), sum(b for _, b in steps)
    block = {
        "model": f"roofline per engine step, summed over {len(steps)} steps",
        "roofs_source": roofs.source, "dtype": dtype, "flops": flops, "bytes": nbytes,
        "intensity_flop_per_byte": roofline.intensity(flops, nbytes),
        "bandwidth_gbps": roofs.bandwidth_gbps, "peak_tflops": peak,
        "ridge_flop_per_byte": roofline.ridge_point(peak, roofs.bandwidth_gbps) if peak else None,
        "memory_ms": sum(mem), "compute_ms": sum(comp), "predicted_ms": predicted,
        "bound": "compute" if sum(c for m, c in zip(mem, comp) if c > m) > sum(m for m, c in zip(mem, comp) if m >= c)
                 else "memory",
        "measured_ms": measured_ms,
        "measured_over_predicted": measured_ms / predicted if measured_ms and predicted else None,
        "launches": launches_per_step * len(steps),
    }
    ceilings = ctx.ceilings()
    if ceilings:
        block["calibrated"] = {**calibrated_sum(steps, dtype, ceilings, measured_ms, launches_per_step, graphed),
                               "computed": "at run time"}
    return block


def calibrated_sum(steps, dtype, ceilings: dict, measured_ms, launches_per_step: int, graphed: bool) -> dict:
    parts = [roofline.calibrated(f, b, dtype, ceilings, graph_reps=2 if graphed else None,
                                 launches=launches_per_step) for f, b in steps]
    terms = {k: sum(p[f"{k}_ms"] for p in parts) for k in ("latency", "memory", "compute")}
    predicted = sum(p["predicted_ms"] for p in parts)
    bound_ms = {}
    for p in parts:
        bound_ms[p["bound"]] = bound_ms.get(p["bound"], 0.0) + p["predicted_ms"]
    return {"predicted_ms": predicted, "bound": max(bound_ms, key=bound_ms.get),
            "measured_over_predicted": measured_ms / predicted if measured_ms and predicted else None,
            "ceilings_record": ceilings.get("record"), "bandwidth_gbps": parts[0]["bandwidth_gbps"] if parts else None,
            "peak_tflops": parts[0]["peak_tflops"] if parts else None,
            "latency_ms": terms["latency"], "memory_ms": terms["memory"], "compute_ms": terms["compute"]}
