"""Build a `.cu` file with nvcc into a shared library, cached, and load it with ctypes.

The sources are plain CUDA with `extern "C"` kernels and launchers (no framework headers), so they
build on any machine with nvcc, GPU or not. A library is cached under `<repo>/.lab_cache/cuda/` by
(source hash, arch, flags, nvcc path); its `ptxas -v` report is kept beside it and parsed into
{kernel: {registers, spill_stores_bytes, spill_loads_bytes, smem_bytes, stack_bytes}}.

Arch: `sm_XY` from the device's compute capability (`-arch=sm_XY`), or one given for compile-only
checks. A source that uses arch-specific instructions (`wgmma`, `setmaxnreg`) says so with the line
`// lab-build: arch-specific`; it is then built for `sm_XYa` through
`-gencode=arch=compute_XYa,code=sm_XYa` (the form nvcc 13.0 assembles).

Launchers take raw pointers, sizes and a `cudaStream_t`, and return the `cudaError_t` of
`cudaGetLastError()` after the launch; `check()` turns a non-zero code into a LabError.
"""
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.errors import LabError
from common.paths import REPO_ROOT

HERE = Path(__file__).resolve().parent
CACHE_DIR = REPO_ROOT / ".lab_cache" / "cuda"
BASE_FLAGS = ("-O3", "-std=c++17", "-Xptxas", "-v", "-shared", "-Xcompiler", "-fPIC")
ARCH_SPECIFIC_MARK = "// lab-build: arch-specific"


@dataclass
class Build:
    path: Path                      # the shared library
    arch: str                       # sm_90, sm_90a, ...
    flags: tuple[str, ...]
    log: str                        # nvcc's stderr (the ptxas report)
    cached: bool
    resources: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------ nvcc and arch
def nvcc() -> str:
    path = shutil.which("nvcc")
    if path is None:
        raise LabError("nvcc not found on PATH; install the CUDA toolkit (phase 2 compiles its kernels with it)")
    return path


def device_arch(device: torch.device | int | None = None) -> str:
    """`sm_XY` of the CUDA device; LabError when there is none."""
    if not torch.cuda.is_available():
        raise LabError("running a CUDA kernel needs a CUDA GPU; none is visible on this machine")
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def arch_flags(arch: str) -> list[str]:
    """`-arch=sm_XY`, or the -gencode form for an arch-specific target such as sm_90a."""
    if not re.fullmatch(r"sm_\d{2,3}a?", arch):
        raise LabError(f"unknown CUDA arch '{arch}'; expected e.g. sm_80, sm_90 or sm_90a")
    if arch.endswith("a"):
        num = arch[3:]
        return [f"-gencode=arch=compute_{num},code=sm_{num}"]
    return [f"-arch={arch}"]


def target_arch(source_text: str, arch: str) -> str:
    if ARCH_SPECIFIC_MARK in source_text and not arch.endswith("a"):
        return arch + "a"
    return arch


# ------------------------------------------------------------------------------ building
def build(source: str | Path, arch: str | None = None, extra_flags: tuple[str, ...] = (),
          cache_dir: str | Path | None = None) -> Build:
    """Compile `source` for `arch` (default: this device's) into a cached shared library."""
    source = Path(source)
    if not source.is_absolute():
        source = HERE / source
    if not source.exists():
        raise LabError(f"CUDA source {source.name} not found")
    text = source.read_bytes()
    arch = target_arch(text.decode(errors="replace"), arch or device_arch())
    exe = nvcc()
    flags = tuple(BASE_FLAGS) + tuple(arch_flags(arch)) + tuple(extra_flags)
    key = hashlib.sha256(b"\0".join([text, arch.encode(), " ".join(flags).encode(), exe.encode()])).hexdigest()[:16]
    folder = Path(cache_dir) if cache_dir else CACHE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    lib = folder / f"{source.stem}-{arch}-{key}.so"
    log_path = lib.with_suffix(".log")
    if lib.exists() and log_path.exists():
        log = log_path.read_text()
        return Build(lib, arch, flags, log, True, parse_ptxas(log))
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        out = Path(tmp) / lib.name
        cmd = [exe, *flags, "-o", str(out), str(source)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            raise LabError(f"nvcc timed out compiling {source.name} for {arch}") from None
        if proc.returncode != 0 or not out.exists():
            raise LabError(f"nvcc failed on {source.name} for {arch}: {first_error(proc.stderr + proc.stdout)}")
        log_path.write_text(proc.stderr)
        os.replace(out, lib)                   # atomic: a half-written library is never cached
    return Build(lib, arch, flags, proc.stderr, False, parse_ptxas(proc.stderr))


def first_error(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for ln in lines:
        if re.search(r"\berror\b", ln, re.IGNORECASE):
            # "/abs/path/x.cu(12): error: ..." -> "x.cu(12): error: ..."
            return re.sub(r"^\S*/([^/\s]+\(\d+\))", r"\1", ln)
    return lines[0] if lines else "no output"


_ENTRY = re.compile(r"(?:Compiling entry function|Function properties for) '?([\w$.]+)'?")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> dict:
    """ptxas -v output -> {kernel: {registers, spill_stores_bytes, spill_loads_bytes, smem_bytes,
    stack_bytes}} (kernels declared extern "C" keep their plain names)."""
    report, current = {}, None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = m.group(1)
            report.setdefault(current, {"registers": None, "spill_stores_bytes": 0, "spill_loads_bytes": 0,
                                        "smem_bytes": 0, "stack_bytes": 0})
            continue
        if current is None:
            continue
        m = _SPILLS.search(line)
        if m:
            report[current].update(stack_bytes=int(m.group(1)), spill_stores_bytes=int(m.group(2)),
                                   spill_loads_bytes=int(m.group(3)))
        m = _USED.search(line)
        if m:
            report[current]["registers"] = int(m.group(1))
            s = _SMEM.search(line)
            report[current]["smem_bytes"] = int(s.group(1)) if s else 0
    return report


# ------------------------------------------------------------------------------ loading and calling
_LOADED: dict[tuple[str, str], tuple[ctypes.CDLL, Build]] = {}


def load(source: str | Path, signatures: dict[str, list] | None = None) -> tuple[ctypes.CDLL, Build]:
    """Build (or reuse) `source` for this GPU and load it; `signatures` maps each launcher to its
    ctypes argtypes (all launchers return int, the cudaError_t)."""
    arch = device_arch()
    key = (str(source), arch)
    if key not in _LOADED:
        b = build(source, arch)
        lib = ctypes.CDLL(str(b.path))
        for name, argtypes in (signatures or {}).items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        if hasattr(lib, "lab_error_string"):
            lib.lab_error_string.argtypes = [ctypes.c_int]
            lib.lab_error_string.restype = ctypes.c_char_p
        _LOADED[key] = (lib, b)
    return _LOADED[key]


def check(lib: ctypes.CDLL, code: int, what: str) -> None:
    """Raise a LabError when a launcher returned a CUDA error."""
    if code != 0:
        name = lib.lab_error_string(code).decode() if hasattr(lib, "lab_error_string") else "?"
        raise LabError(f"{what}: CUDA error {code} ({name})")


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def stream(device: torch.device | None = None) -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


def require_gpu(*tensors: torch.Tensor) -> None:
    """After argument validation: the tensors must live on one CUDA device."""
    if not torch.cuda.is_available():
        raise LabError("running a CUDA kernel needs a CUDA GPU; none is visible on this machine")
    devices = {t.device for t in tensors}
    if any(d.type != "cuda" for d in devices) or len(devices) != 1:
        raise ValueError(f"all tensors must be on one CUDA device; got {sorted(map(str, devices))}")


SOURCES = sorted(p.name for p in HERE.glob("*.cu"))
INT32_MAX_GRID = 2**31 - 1
