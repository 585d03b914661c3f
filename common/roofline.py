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
