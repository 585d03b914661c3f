"""Spec sheets from hardware.yaml, and matching the GPU in hand to one of them.

Every peak the lab compares against comes from here (with its source), never from a literal in code.
"""
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import yaml

from .errors import LabError
from .paths import hardware_yaml

DTYPES = ("fp32", "tf32", "fp16", "bf16", "fp8", "int8")


@dataclass(frozen=True)
class Figure:
    """One spec-sheet number with where it came from."""
    value: float | None
    source: str | None = None
    note: str | None = None

    def as_dict(self) -> dict:
        return {"value": self.value, "source": self.source, "note": self.note}


@dataclass
class HardwareSpec:
    key: str
    name: str
    vendor: str | None
    kind: str
    match: list[str]
    figures: dict[str, Figure]               # memory_bandwidth_gbps, l2_mb, ...
    peak_tflops: dict[str, Figure] = field(default_factory=dict)
    sources: dict[str, dict] = field(default_factory=dict)

    def figure(self, name: str) -> Figure:
        return self.figures.get(name, Figure(None))

    def peak(self, dtype: str) -> Figure:
        return self.peak_tflops.get(dtype, Figure(None))

    def cite(self, fig: Figure) -> str | None:
        """'NVIDIA H200 datasheet (2024-11)' for a figure, for records and tables."""
        if fig.source is None:
            return None
        src = self.sources.get(fig.source, {})
        title = src.get("title") or fig.source
        date = src.get("date")
        return f"{title} ({date})" if date else title

    def summary(self) -> dict:
        """The spec block stored in every record made on this hardware."""
        return {
            "key": self.key,
            "name": self.name,
            "memory_bandwidth_gbps": self.figure("memory_bandwidth_gbps").value,
            "peak_tflops": {d: self.peak(d).value for d in DTYPES},
            "l2_mb": self.figure("l2_mb").value,
            "sm_count": self.figure("sm_count").value,
            "source": "hardware.yaml",
        }


def _figure(raw) -> Figure:
    if raw is None:
        return Figure(None)
    if isinstance(raw, dict):
        return Figure(raw.get("value"), raw.get("source"), raw.get("note"))
    return Figure(raw)


@lru_cache(maxsize=8)
def _load(path: str) -> dict[str, HardwareSpec]:
    p = Path(path)
    if not p.is_file():
        raise LabError(f"hardware spec file not found: {p.name} (expected at the repo root)")
    try:
        doc = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise LabError(f"{p.name} is not valid YAML: {str(exc).splitlines()[0]}") from None
    sources = doc.get("sources") or {}
    specs = {}
    for key, entry in (doc.get("hardware") or {}).items():
        figures = {k: _figure(v) for k, v in entry.items()
                   if k not in ("name", "vendor", "kind", "match", "peak_tflops")}
        peaks = {d: _figure(v) for d, v in (entry.get("peak_tflops") or {}).items()}
        specs[key] = HardwareSpec(key=key, name=entry.get("name", key), vendor=entry.get("vendor"),
                                  kind=entry.get("kind", "gpu"), match=list(entry.get("match") or []),
                                  figures=figures, peak_tflops=peaks, sources=sources)
    return specs


def load_hardware(path: str | Path | None = None) -> dict[str, HardwareSpec]:
    return _load(str(hardware_yaml(str(path) if path else None)))


def match_gpu(device_name: str, specs: dict[str, HardwareSpec]) -> HardwareSpec | None:
    """The first entry whose `match` regexes hit the device name (as torch reports it)."""
    for spec in specs.values():
        if any(re.search(pattern, device_name, re.IGNORECASE) for pattern in spec.match):
            return spec
    return None


def get_spec(key: str, specs: dict[str, HardwareSpec]) -> HardwareSpec:
    if key not in specs:
        raise LabError(f"unknown hardware key '{key}'; known: {', '.join(sorted(specs))}")
    return specs[key]


def slug(name: str) -> str:
    """A folder-safe key for hardware not in hardware.yaml ('NVIDIA Foo 9000' -> 'nvidia_foo_9000')."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "unknown"
