"""Why a row ran faster than the roof it is compared with, where its record shows the reason.

A percent of the spec bandwidth above 100 is either a mistake or data served from somewhere
faster than DRAM/HBM. The one reason a record can show is the cache: the calls were warm (no
flush between them, or a CUDA-graph replay, which flushes only before its first call) and the
working set fits in the GPU's L2 (`hardware.gpu.l2_mib`, the frame's `l2_bytes`). A row above 100%
with no such reason is left unexplained, never excused.
"""
from .formats import pct, size_bytes
from .frame import value


def why_above_roof(r) -> str | None:
    """The reason row `r` (a frame row) may pass 100% of its bandwidth roof, or None."""
    l2 = value(r, "l2_bytes")
    working_set = value(r, "params.working_set_bytes") or value(r, "prediction.bytes")
    reps = value(r, "timing.graph_reps") or 0
    warm = value(r, "timing.flush_l2") is False or reps > 1
    if not (l2 and working_set and warm and working_set <= l2):
        return None
    how = f"a graph replay of {reps:g} calls, flushed once" if reps > 1 else "warm caches"
    return f"in the {size_bytes(l2)} L2: {how}"


def bandwidth_pct(r) -> str:
    """`metrics.pct_of_peak_bandwidth` as a cell; above 100% followed by the reason, when one is known."""
    v = value(r, "metrics.pct_of_peak_bandwidth")
    why = why_above_roof(r) if v is not None and v > 100 else None
    return f"{pct(v)} ({why})" if why else pct(v)
