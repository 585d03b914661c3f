"""Numbers derived from phase 2's rows, computed in one place: the exercises store them in their
records, and the report calls the same functions on records written before they did. Torch-free."""
from .rungs import RUNGS, VARIANTS


def ladder_steps(points) -> dict:
    """What each rung bought at each size: {(variant, n): (base rung or None, TFLOP/s over it)}.

    `points` are (variant, n, tflops) of the ok rows. A rung is compared with the rung it names as
    its `base` (a side branch) or else with the last rung of its precision listed before it at the
    same size; a side branch does not become the next rung's base. The first rung of a precision
    has base None and factor None."""
    by_size: dict = {}
    for variant, n, tflops in points:
        if variant in RUNGS and tflops:
            by_size.setdefault(n, {})[variant] = float(tflops)
    out = {}
    for n, at in by_size.items():
        previous: dict = {}
        for variant in VARIANTS:
            if variant not in at:
                continue
            base = RUNGS[variant].base
            before = (base, at[base]) if base in at else previous.get(RUNGS[variant].precision)
            out[(variant, n)] = (before[0], at[variant] / before[1]) if before else (None, None)
            if not base:
                previous[RUNGS[variant].precision] = (variant, at[variant])
    return out


def ladder_sizes(points, keep: int = 2) -> list:
    """The `keep` largest sizes at which the most rungs ran (the ladder's table shows those)."""
    counts: dict = {}
    for variant, n, _ in points:
        if variant in VARIANTS:
            counts.setdefault(n, set()).add(variant)
    most = max((len(v) for v in counts.values()), default=0)
    return sorted(n for n, v in counts.items() if len(v) == most)[-keep:]


def tiling_reduction(naive: dict, tiled: dict) -> dict:
    """Naive over tiled matmul, from phase2.traffic's metrics of the two kernels at one N: what the
    code predicts for global-load bytes and what the counters saw at each level."""
    return {"predicted_global_load_reduction": naive["predicted_global_load_bytes"] / tiled["predicted_global_load_bytes"],
            "tiling_global_load_reduction": naive["global_load_bytes"] / tiled["global_load_bytes"],
            "tiling_l2_read_reduction": naive["l2_read_bytes"] / tiled["l2_read_bytes"],
            "tiling_dram_reduction": naive["dram_bytes"] / tiled["dram_bytes"]}
