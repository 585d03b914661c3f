"""Phase 3's derived numbers, in one place: the exercises store them in their records, and the
report calls the same functions for records written before these fields existed. Plain Python
(no torch, no pandas), so `lab report` can import it anywhere."""

L2_MULTIPLE = 8        # "far beyond L2": a working set at least this many times the GPU's L2 cache


def far_beyond_l2(working_set_bytes, l2_bytes) -> bool:
    """True when the bytes one call moves are at least L2_MULTIPLE x the GPU's L2, so nearly every
    byte comes from HBM; False where the L2 size is unknown (a CPU run)."""
    return bool(l2_bytes) and working_set_bytes is not None and working_set_bytes >= L2_MULTIPLE * l2_bytes


def fusion_cost(unfused_bytes, unfused_ms, fused_bytes, fused_ms) -> dict:
    """What the unfused chain costs against the fused kernel on the same shape: the bytes it moves
    and the time it takes, each as a multiple of the fused kernel's."""
    return {"bytes_over_fused": unfused_bytes / fused_bytes, "time_over_fused": unfused_ms / fused_ms}


OWN = {"bytes": ("metrics.algorithm_bytes", "prediction.bytes"), "gbps": ("metrics.algorithm_gbps", "metrics.gbps"),
       "bytes_formula": ("metrics.algorithm_bytes_formula", "metrics.bytes_formula")}


def own(r, what: str):
    """A row's own traffic ('bytes', 'gbps', 'bytes_formula'): what its algorithm moves (the unfused
    chain's intermediates, naive attention's N x N passes), where the row records it apart from the
    problem's bytes; else the row's bytes, which records before issue 19 stored as the algorithm's."""
    for key in OWN[what]:
        v = r.get(key) if hasattr(r, "get") else None
        if v is not None and not (isinstance(v, float) and v != v):
            return v
    return None
