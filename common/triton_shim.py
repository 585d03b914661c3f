"""Triton, or a stand-in where it is not installed, and where a kernel may run: shared by phase 3's
kernels, phase 5's engine and phase 6's comparisons. The autotuner is triton_tuner.py.

Triton is optional for the lab as a whole: `lab list` and the other phases must work without it.
So the kernels are written against `triton` and `tl` imported from here; when Triton is missing
they are stand-ins that let the modules import (decorators return a stub, `tl.constexpr`
annotations resolve) and fail with a clear message only if a kernel is launched.

Kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1,
set before Triton is imported), which is how CPU-only CI checks every kernel for correctness.
"""
import math
import os

import torch

from common.errors import LabError

try:                                    # pragma: no cover - which branch runs depends on the machine
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:                     # pragma: no cover
    HAVE_TRITON = False

    class _Absent:
        """triton / triton.language when not installed: attribute access and decorator calls
        succeed (so the modules import); launching a kernel raises."""

        def __getattr__(self, name):
            return self

        def __call__(self, *args, **kwargs):
            if len(args) == 1 and callable(args[0]) and not kwargs:
                return _MissingKernel(getattr(args[0], "__name__", "kernel"))
            return self                 # a decorator factory: triton.jit(...), triton.autotune(...)

    class _MissingKernel:
        def __init__(self, name):
            self.__name__ = name

        def __getitem__(self, grid):
            raise LabError(f"kernel {self.__name__} needs the Python package `triton`; not installed")

        def __call__(self, *args, **kwargs):
            self[None]

    triton = tl = _Absent()

LOG2E_VALUE = 1.4426950408889634        # exp(x) = exp2(x * log2(e)): the hardware has exp2, not exp
LOG2E = tl.constexpr(LOG2E_VALUE)       # kernels may read only constexpr globals


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (decided when Triton is imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def require(*tensors: torch.Tensor) -> None:
    """Refuse launches that cannot work, with a reason instead of a crash inside Triton."""
    if not HAVE_TRITON:
        raise LabError("needs the Python package `triton`; not installed")
    for t in tensors:
        if t.device.type != "cuda" and not interpreting() and not _COMPILE_ONLY:
            raise ValueError(f"a Triton kernel needs CUDA tensors (got {t.device}); on a CPU set "
                             f"TRITON_INTERPRET=1 before importing triton to use the interpreter")


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4                            # the interpreter: any small number exercises the loops


_RESIDENT: dict = {}


def resident_programs_per_sm(kernel, key, device: torch.device, args: tuple, kwargs: dict) -> int | None:
    """How many programs of `kernel`, compiled for these arguments, one SM holds at once: the
    tightest of registers (allocated per warp in units of 256), threads and shared memory. Kernels
    whose programs wait for each other must not launch more than this per SM, or a waiting program
    could keep the one it waits for from ever being scheduled. None where nothing runs (the
    interpreter, compile-only builds). Cached under `key`: the warm-up lookup costs host time."""
    if interpreting() or _COMPILE_ONLY or device.type != "cuda":
        return None
    if key not in _RESIDENT:
        compiled = kernel.warmup(*args, grid=(1,), **kwargs)
        compiled._init_handles()                    # loads the binary: n_regs is known from here on
        props = torch.cuda.get_device_properties(device)
        warps = compiled.metadata.num_warps
        regs_per_warp = -(-compiled.n_regs * 32 // 256) * 256
        by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * warps)
        by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
        smem = compiled.metadata.shared + 1024      # the driver reserves 1 KiB per block
        by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // smem
        _RESIDENT[key] = min(by_regs, by_threads, by_smem, 32)
    return _RESIDENT[key]


_allocator_device = None


def ensure_allocator(device: torch.device) -> None:
    """Kernels that build TMA descriptors on the device (`tl.make_tensor_descriptor`) need scratch
    memory for them (128 bytes per descriptor per program); Triton asks this allocator for it."""
    global _allocator_device
    if _allocator_device == device.type:
        return

    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device=device)

    triton.set_allocator(alloc)
    _allocator_device = device.type


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


# ------------------------------------------------------------------------------ compile without a GPU
_COMPILE_ONLY = False


class compile_only:
    """Inside `with compile_only(capability=90) as built:`, a kernel launch compiles for that GPU
    (here sm_90, the H200) and returns without running; `built` collects the compiled kernels.
    It needs no GPU: wrappers are called with CPU tensors, which only supply dtypes, strides and
    alignment. compile_check.py uses it to read shared memory, registers and spills per config."""

    def __init__(self, capability: int = 90):
        self.capability = capability
        self.built: list = []

    def __enter__(self):
        global _COMPILE_ONLY
        from triton.backends.compiler import GPUTarget
        from triton.runtime.driver import driver
        from triton.runtime.jit import JITFunction
        target = GPUTarget("cuda", self.capability, 32)

        class _Fake:                       # just enough of a driver for the JIT to pick a target
            def get_current_device(self):
                return 0

            def get_current_stream(self, device=None):
                return 0

            def get_current_target(self):
                return target

        self._saved = (driver._active, JITFunction.__getitem__)
        driver.set_active(_Fake())
        built = self.built

        def getitem(kernel, grid):
            def compile_now(*args, **kwargs):
                compiled = kernel.run(*args, grid=grid, warmup=True, **kwargs)
                built.append((kernel.__name__, compiled))
                return compiled
            return compile_now

        JITFunction.__getitem__ = getitem
        _COMPILE_ONLY = True
        return self

    def __exit__(self, *exc):
        global _COMPILE_ONLY
        from triton.runtime.driver import driver
        from triton.runtime.jit import JITFunction
        driver._active, JITFunction.__getitem__ = self._saved
        _COMPILE_ONLY = False
        return False
