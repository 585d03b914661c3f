"""What the phase-3 modules share: Triton (or a stand-in), where a kernel may run, the autotuner,
and the bookkeeping that sets each Triton row beside the library row of the same size.

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


def launch_options(cfg: dict) -> dict:
    """The launch-time options of a config (the rest are the kernel's constexpr arguments)."""
    return {"num_warps": cfg.get("num_warps", 4), "num_stages": cfg.get("num_stages", 3)}


def label(cfg: dict) -> str:
    """'BLOCK_M=128 BLOCK_N=64 num_warps=8 num_stages=3 tma=True': one config, readable in a table."""
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


# ------------------------------------------------------------------------------ autotuning
_TUNED: dict = {}


def tune(ctx, key, candidates: list[dict], launch, check, first_good: bool = False) -> tuple[dict, list[dict]]:
    """The fastest of `candidates` that compiles and passes `check(cfg)`, timed with the lab's own
    harness (short runs, L2 flushed). Returns (config, trials); trials list every candidate with
    its time or the reason it was dropped, so a record shows what the tuner saw.

    A config that fails to compile (too much shared memory, an unsupported feature on this Triton)
    or computes a wrong answer is dropped, not fatal: correctness gates tuning as it gates timing.
    Under the interpreter, or with first_good (a config already chosen elsewhere, with fallbacks),
    nothing is timed: the first candidate that passes is taken. A --quick run (a smoke test) tries
    only the first two candidates.
    """
    if key in _TUNED:
        return _TUNED[key]
    if getattr(ctx, "quick", False):
        candidates = candidates[:2]
    trials, passed = [], []                          # passed: (ms or None, cfg)
    for cfg in candidates:
        try:
            verdict = check(cfg)                     # compiles, runs on a poisoned output, compares
            if not verdict["passed"]:
                trials.append({"config": label(cfg), "ms": None, "error": f"check: {verdict['reason']}"})
                continue
            ms = None
            if not interpreting() and not first_good and len(candidates) > 1:
                ms = ctx.time(lambda: launch(cfg), warmup_ms=5.0, target_ms=25.0, min_samples=5,
                              max_samples=50).median_ms
            trials.append({"config": label(cfg), "ms": ms, "error": None})
            passed.append((ms, cfg))
            if interpreting() or first_good:
                break
        except Exception as exc:  # noqa: BLE001 - a config that cannot run is dropped, with why
            msg = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
            trials.append({"config": label(cfg), "ms": None,
                           "error": f"{type(exc).__name__}: {msg[-1][:200] if msg else ''}".strip()})
    if not passed:
        raise LabError(f"no candidate config ran correctly for {key}: "
                       + "; ".join(f"[{t['config']}] {t['error']}" for t in trials)[:800])
    timed = [p for p in passed if p[0] is not None]
    best = min(timed, key=lambda p: p[0])[1] if timed else passed[0][1]
    _TUNED[key] = (best, trials)
    return best, trials


def tuning_summary(trials: list[dict]) -> dict:
    """Compact form for a record's summary: config -> ms (or the error)."""
    return {t["config"]: (round(t["ms"], 5) if t["ms"] is not None else t["error"]) for t in trials}


# ------------------------------------------------------------------------------ rows side by side
def skipped(variant: str, params: dict, reason: str) -> dict:
    """A variant that cannot run here (a library backend that rejects these inputs)."""
    from common.exercise import row
    return row(variant, params, "skipped", reason)


def compare_to_library(rows: list[dict], ours: str, libraries: tuple[str, ...], metric: str) -> None:
    """For each of our rows, the fastest library row with the same params: its name and ms, and
    our `metric` (a rate) as a percent of its rate (`pct_of_library`; above 100% we are faster)."""
    from common.exercise import against_baseline
    for r in rows:
        if r["variant"] != ours or r["status"] != "ok":
            continue
        libs = [x for x in rows if x["variant"] in libraries and x["status"] == "ok" and x["params"] == r["params"]]
        if libs:
            best = min(libs, key=lambda x: x["metrics"]["ms"])
            r["metrics"].update(library=best["variant"], library_ms=best["metrics"]["ms"])
            against_baseline([r], best, metric, "pct_of_library")


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


def attempt(variant: str, params: dict, make_row) -> dict:
    """`make_row()`, or a 'failed' row saying why it raised: one variant that cannot run (no config
    compiled, a library error, out of memory) must not cost the record every other row."""
    from common.exercise import row
    try:
        return make_row()
    except LabError as exc:
        return row(variant, params, "failed", str(exc))
    except Exception as exc:  # noqa: BLE001 - recorded in the row, not raised
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        return row(variant, params, "failed", f"{type(exc).__name__}: {lines[0][:300] if lines else ''}".strip())
