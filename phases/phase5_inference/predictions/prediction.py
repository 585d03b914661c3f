"""A run of many engine steps, or a step of several phases, predicted part by part: the roofline
of each part (its FLOPs and bytes), summed. One roofline over the totals would be wrong: prefills
are compute-bound and decode steps memory-bound, and within a decode step the weight matmuls and
attention run one after the other, so neither overlaps the other. The block has the keys every
record's `prediction` has (spec sheet, and `calibrated` from this GPU's ceilings record when one
exists, with `launches` kernel floors added once)."""
from common import roofline


def summed_prediction(ctx, parts: list[tuple[float, float]], dtype: str, measured_ms: float | None,
                      launches: int = 1, graphed: bool = True, what: str = "engine steps") -> dict:
    """`parts`: (flops, bytes) of each part, in order."""
    roofs = ctx.roofs(dtype)
    peak = roofs.peak(dtype)
    mem = [roofline.memory_ms(b, roofs.bandwidth_gbps) for _, b in parts]
    comp = [roofline.compute_ms(f, peak) if peak else 0.0 for f, _ in parts]
    predicted = sum(max(m, c) for m, c in zip(mem, comp))
    flops, nbytes = sum(f for f, _ in parts), sum(b for _, b in parts)
    compute_bound_ms = sum(c for m, c in zip(mem, comp) if c > m)
    block = {
        "model": f"roofline per part, summed over {len(parts)} {what}",
        "roofs_source": roofs.source, "dtype": dtype, "flops": flops, "bytes": nbytes,
        "intensity_flop_per_byte": roofline.intensity(flops, nbytes),
        "bandwidth_gbps": roofs.bandwidth_gbps, "peak_tflops": peak,
        "ridge_flop_per_byte": roofline.ridge_point(peak, roofs.bandwidth_gbps) if peak else None,
        "memory_ms": sum(mem), "compute_ms": sum(comp), "predicted_ms": predicted,
        "bound": "compute" if compute_bound_ms > predicted - compute_bound_ms else "memory",
        "measured_ms": measured_ms,
        "measured_over_predicted": measured_ms / predicted if measured_ms and predicted else None,
        "launches": launches,
    }
    ceilings = ctx.ceilings()
    if ceilings:
        block["calibrated"] = {**calibrated_sum(parts, dtype, ceilings, measured_ms, launches, graphed),
                               "computed": "at run time"}
    return block


def calibrated_sum(parts, dtype, ceilings: dict, measured_ms, launches: int, graphed: bool) -> dict:
    each = [roofline.calibrated(f, b, dtype, ceilings, launches=0) for f, b in parts]
    floor_us = ceilings["graph_launch_us"] if graphed and ceilings.get("graph_launch_us") else ceilings["launch_us"]
    terms = {"latency": launches * floor_us / 1e3,
             "memory": sum(p["memory_ms"] for p in each), "compute": sum(p["compute_ms"] for p in each)}
    bound_ms = {"latency": terms["latency"]}
    for p in each:
        bound_ms[p["bound"]] = bound_ms.get(p["bound"], 0.0) + p["predicted_ms"]
    predicted = terms["latency"] + sum(p["predicted_ms"] for p in each)
    return {"predicted_ms": predicted, "bound": max(bound_ms, key=bound_ms.get),
            "measured_over_predicted": measured_ms / predicted if measured_ms and predicted else None,
            "ceilings_record": ceilings.get("record"), "bandwidth_gbps": each[0]["bandwidth_gbps"] if each else None,
            "peak_tflops": each[0]["peak_tflops"] if each else None,
            "latency_ms": terms["latency"], "memory_ms": terms["memory"], "compute_ms": terms["compute"]}
