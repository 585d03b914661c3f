"""The roofline model: two numbers (bandwidth, peak FLOP/s) predict a kernel's time before it runs.

    time >= max(FLOPs / peak_flops, bytes / bandwidth)

Arithmetic intensity I = FLOPs / bytes (FLOP per byte moved to or from device memory). The ridge
point I* = peak_flops / bandwidth separates the regimes: below it the memory system is the limit
(memory-bound), above it the arithmetic units are (compute-bound).

Units: bandwidth in GB/s (1e9 bytes/s), peaks in TFLOP/s (1e12 FLOP/s), times in ms.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Roofs:
    """The two ceilings of one machine, and where they came from."""
    bandwidth_gbps: float
    peak_tflops: dict            # dtype -> TFLOP/s (None where unknown)
    source: str                  # "hardware.yaml:h200_sxm" or "measured:..." 
    bandwidth_source: str | None = None
    peak_sources: dict | None = None

    def peak(self, dtype: str) -> float | None:
        return self.peak_tflops.get(dtype)


def intensity(flops: float, bytes_moved: float) -> float | None:
    return flops / bytes_moved if bytes_moved else None


def ridge_point(peak_tflops: float, bandwidth_gbps: float) -> float:
    """FLOP/byte at which compute time equals memory time: (TFLOP/s * 1e12) / (GB/s * 1e9)."""
    return peak_tflops * 1e3 / bandwidth_gbps


def memory_ms(bytes_moved: float, bandwidth_gbps: float) -> float:
    return bytes_moved / (bandwidth_gbps * 1e9) * 1e3


def compute_ms(flops: float, peak_tflops: float) -> float:
    return flops / (peak_tflops * 1e12) * 1e3


def attainable_tflops(ai: float, peak_tflops: float, bandwidth_gbps: float) -> float:
    """The roof itself: min(peak, I * bandwidth)."""
    return min(peak_tflops, ai * bandwidth_gbps / 1e3)


def predict(flops: float, bytes_moved: float, roofs: Roofs, dtype: str | None,
            measured_ms: float | None = None) -> dict:
    """Prediction block for a record: predicted time, bound, and measured/predicted when timed.

    With no FLOPs (a copy) the prediction is purely bandwidth; with no peak for the dtype the
    compute term is unknown and the prediction says so.
    """
    mem = memory_ms(bytes_moved, roofs.bandwidth_gbps) if bytes_moved else 0.0
    peak = roofs.peak(dtype) if dtype else None
    comp = compute_ms(flops, peak) if (flops and peak) else (0.0 if not flops else None)
    if comp is None:
        predicted, bound = mem, "memory (compute peak unknown)"
    else:
        predicted = max(mem, comp)
        bound = "compute" if comp > mem else "memory"
    ai = intensity(flops, bytes_moved)
    block = {
        "model": "roofline",
        "roofs_source": roofs.source,
        "dtype": dtype,
        "flops": flops,
        "bytes": bytes_moved,
        "intensity_flop_per_byte": ai,
        "bandwidth_gbps": roofs.bandwidth_gbps,
        "peak_tflops": peak,
        "ridge_flop_per_byte": ridge_point(peak, roofs.bandwidth_gbps) if peak else None,
        "memory_ms": mem,
        "compute_ms": comp,
        "predicted_ms": predicted,
        "bound": bound,
        "measured_ms": measured_ms,
        "measured_over_predicted": (measured_ms / predicted) if (measured_ms and predicted) else None,
    }
    return block


# ------------------------------------------------------------------------------ the calibrated model
LATENCY, MEMORY, COMPUTE, COMMUNICATION = "latency", "memory", "compute", "communication"


def calibrated(flops: float, bytes_moved: float, dtype: str | None, ceilings: dict, measured_ms: float | None = None,
               *, working_set_bytes: float | None = None, warm: bool = False, graph_reps: int | None = None,
               launches: int = 1) -> dict:
    """The prediction from ceilings measured on this machine (a `phase1.ceilings` record's summary):

        time = launches x latency floor + max(bytes / bandwidth, FLOPs / sustained matmul rate)

    The bandwidth is the L2 copy rate when the caches are warm (no flush, or a CUDA-graph replay,
    which flushes only before its first call) and the working set fits in L2, else the HBM copy rate. The floor is what the timing harness shows for an empty kernel:
    a launch per call, or per replayed kernel under a CUDA graph. The bound is the largest term."""
    warm = warm or bool(graph_reps and graph_reps > 1)     # a replay flushes once, before its first call
    fits = warm and working_set_bytes is not None and working_set_bytes <= ceilings["l2_fit_bytes"]
    bandwidth = ceilings["l2_gbps"] if fits and ceilings.get("l2_gbps") else ceilings["hbm_gbps"]
    peak = (ceilings.get("matmul_tflops") or {}).get(dtype) if dtype else None
    floor_us = ceilings["graph_launch_us"] if graph_reps and ceilings.get("graph_launch_us") else ceilings["launch_us"]
    terms = {LATENCY: launches * floor_us / 1e3,
             MEMORY: memory_ms(bytes_moved, bandwidth) if bytes_moved else 0.0,
             COMPUTE: compute_ms(flops, peak) if flops and peak else 0.0}
    predicted = terms[LATENCY] + max(terms[MEMORY], terms[COMPUTE])
    return {"predicted_ms": predicted, "bound": max(terms, key=terms.get),
            "measured_over_predicted": measured_ms / predicted if measured_ms and predicted else None,
            "ceilings_record": ceilings.get("record"), "bandwidth_gbps": bandwidth, "peak_tflops": peak,
            "latency_ms": terms[LATENCY], "memory_ms": terms[MEMORY], "compute_ms": terms[COMPUTE]}


def alpha_beta_ms(size_bytes: float, busbw_factor: float, alpha_us: float, beta_busbw_gbps: float) -> float:
    """A collective's time from two measured constants: alpha, the fixed cost of one call (from the
    smallest messages), plus the bus bytes (size x the collective's nccl-tests factor, e.g.
    2(n-1)/n for all-reduce) over beta, the bus bandwidth the largest messages reach."""
    return alpha_us / 1e3 + size_bytes * busbw_factor / (beta_busbw_gbps * 1e6)
