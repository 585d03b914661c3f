"""Every accelerator in hardware.yaml on one roofline, from its spec sheet alone (torch-free).

For each entry: the ridge point (peak FLOP/s over bandwidth), the predicted time of a bf16 8192 x
8192 x 8192 matmul, and batch-1 decode of the Llama 3.1 8B and 3.3 70B shapes (every weight read
once per token: weight bytes over bandwidth), with whether the weights fit one device's memory and,
if not, the fewest devices that hold them. Split over N devices by layers (a pipeline), a batch-1
token still visits every weight at one device's bandwidth; split within each layer (tensor
parallel) the N devices read their shares at once, N times the rate at best (links ignored). Each entry's binding constraint follows: capacity when
the data does not fit, else memory bandwidth or compute by the side of the ridge the work falls on.

The bf16 peak is used; where a vendor publishes none (Groq, Tenstorrent list fp16) the fp16 peak
stands in and the line says so. An entry without either gets no compute roof. Nothing here is
keyed to a particular chip: a hardware.yaml entry a user adds gets every column.

Built on phase 5: its Llama shapes (engine/shapes.py) are the decode workload.
"""
import math
from dataclasses import dataclass

from common import roofline
from common.hardware import HardwareSpec, load_hardware
from phases.phase5_inference.engine import SHAPES, LlamaShape

MATMUL_N = 8192
DECODE_MODELS = ("llama-3.1-8b", "llama-3.3-70b")
BF16_BYTES = 2
CAPACITY, MEMORY, COMPUTE = "capacity", "memory bandwidth", "compute"


@dataclass(frozen=True)
class Decode:
    """Batch-1 decode of one model shape on one entry."""
    model: str
    weight_bytes: float           # what must be held: every parameter in bf16
    bytes_per_token: float        # what a token reads: every weight but the embedding table
    flops_per_token: float
    fits: bool
    min_devices: int
    tok_s: float                  # at one device's bandwidth (one device, or a pipeline of them)
    tok_s_parallel: float         # tensor parallel over min_devices, links and their latency ignored
    binds: str


@dataclass(frozen=True)
class Architecture:
    key: str
    name: str
    kind: str
    bandwidth_gbps: float | None
    memory_gb: float | None
    peak_tflops: float | None
    peak_dtype: str | None        # "bf16", or "fp16" standing in
    interconnect_gbps: float | None
    ridge: float | None           # FLOP/byte
    matmul_ms: float | None
    matmul_bound: str | None      # compute / memory (the roofline's), or capacity
    matmul_intensity: float
    matmul_operand_bytes: float
    decode: dict                  # model -> Decode

    @property
    def matmul_tflops(self) -> float | None:
        return 2 * MATMUL_N**3 / (self.matmul_ms * 1e9) if self.matmul_ms else None


def compute_peak(spec: HardwareSpec) -> tuple[float | None, str | None]:
    """The dense bf16 peak, or fp16 where the sheet has no bf16 figure."""
    for dtype in ("bf16", "fp16"):
        value = spec.peak(dtype).value
        if value:
            return value, dtype
    return None, None


def roofs(spec: HardwareSpec, devices: int = 1) -> roofline.Roofs:
    """The entry's roofs for bf16 work (fp16's peak standing in where needed), `devices` of them
    side by side (aggregate bandwidth and FLOP/s)."""
    peak, dtype = compute_peak(spec)
    bandwidth = spec.figure("memory_bandwidth_gbps").value
    source = f"hardware.yaml:{spec.key}" + (f" x {devices}" if devices > 1 else "")
    note = " (its fp16 peak: no bf16 figure published)" if dtype == "fp16" else ""
    return roofline.Roofs(bandwidth_gbps=bandwidth * devices if bandwidth else bandwidth,
                          peak_tflops={"bf16": peak * devices if peak else None}, source=source + note,
                          bandwidth_source=spec.cite(spec.figure("memory_bandwidth_gbps")),
                          peak_sources={"bf16": spec.cite(spec.peak(dtype)) if dtype else None})


def devices_to_hold(nbytes: float, memory_gb: float | None) -> int:
    return max(1, math.ceil(nbytes / (memory_gb * 1e9))) if memory_gb else 1


def decode(spec: HardwareSpec, shape: LlamaShape) -> Decode | None:
    bandwidth, memory = spec.figure("memory_bandwidth_gbps").value, spec.figure("memory_gb").value
    if not bandwidth:
        return None
    weights, per_token = shape.weight_bytes(BF16_BYTES), shape.decode_weight_bytes(BF16_BYTES)
    n = devices_to_hold(weights, memory)
    binds = (f"{CAPACITY}: {weights / 1e9:.1f} GB of weights need {n} devices of {memory:g} GB, and every "
             "token then crosses their links" if n > 1 else
             f"{MEMORY}: {per_token / 1e9:.1f} GB read per token, about 1 FLOP/byte")
    rate = bandwidth * 1e9 / per_token
    return Decode(shape.name, weights, per_token, shape.flops_per_token(0), n == 1, n, rate, n * rate, binds)


def architecture(spec: HardwareSpec, n: int = MATMUL_N) -> Architecture:
    peak, dtype = compute_peak(spec)
    bandwidth, memory = spec.figure("memory_bandwidth_gbps").value, spec.figure("memory_gb").value
    flops, nbytes = 2 * n**3, 3 * n * n * BF16_BYTES
    ms = bound = None
    if bandwidth:
        p = roofline.predict(flops, nbytes, roofs(spec), "bf16")
        ms, bound = p["predicted_ms"], p["bound"]
        if peak is None:
            ms, bound = None, None                        # only the memory side is known: no time
    if memory and nbytes > memory * 1e9:
        bound = CAPACITY
    return Architecture(
        key=spec.key, name=spec.name, kind=spec.kind, bandwidth_gbps=bandwidth, memory_gb=memory,
        peak_tflops=peak, peak_dtype=dtype, interconnect_gbps=spec.figure("interconnect_gbps").value,
        ridge=roofline.ridge_point(peak, bandwidth) if peak and bandwidth else None,
        matmul_ms=ms, matmul_bound=bound, matmul_intensity=flops / nbytes, matmul_operand_bytes=nbytes,
        decode={m: d for m in DECODE_MODELS for d in [decode(spec, SHAPES[m])] if d is not None})


def architectures(specs: dict | None = None) -> list[Architecture]:
    """Every accelerator entry of hardware.yaml (LAB_HARDWARE_YAML where set), in file order."""
    specs = load_hardware() if specs is None else specs
    return [architecture(s) for s in specs.values() if s.kind != "cpu"]


def matmul_binds(a: Architecture) -> str:
    """Which constraint binds a training-sized matmul, in words."""
    if a.matmul_bound == CAPACITY:
        return (f"{CAPACITY}: the three {MATMUL_N} x {MATMUL_N} bf16 operands ({a.matmul_operand_bytes / 1e9:.2f} GB) "
                f"exceed one device's {a.memory_gb:g} GB, so they must be split across devices")
    if a.ridge is None:
        return "unknown: no compute peak in hardware.yaml"
    side = COMPUTE if a.matmul_intensity > a.ridge else MEMORY
    return f"{side}: {a.matmul_intensity:,.0f} FLOP/byte against a ridge of {a.ridge:,.3g}"
