"""The exercise, the unit of the lab, and the context it runs in.

An exercise module defines one `Exercise`: what it needs, its parameters (GPU defaults, smaller
CPU defaults, tiny `quick` ones for smoke tests), its named variants, and a `run(ctx, params)`
that returns result rows. Rows come from `measure()`, which enforces the lab's order: check the
output against a reference first; time only what passed; attach the roofline prediction.
"""
import importlib.util
import os
import shutil
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from . import roofline
from .checks import BYTES_PER_ELEMENT, compare, exact, poison
from .hardware import DTYPES, HardwareSpec
from .params import Param
from .timing import Timing, benchmark


@dataclass(frozen=True)
class Needs:
    """What an exercise requires; the runner skips it, with the reason, when unmet."""
    cuda: bool = False
    nvidia: bool = False             # NVIDIA only: CUDA C built by nvcc, Nsight (not a ROCm build)
    gpus: int = 1
    tools: tuple[str, ...] = ()      # executables on PATH, e.g. ("ncu",)
    modules: tuple[str, ...] = ()    # importable Python modules, e.g. ("triton",)
    env: tuple[str, ...] = ()        # environment variables, e.g. API keys

    def unmet(self, ctx: "Context") -> str | None:
        if self.cuda and not ctx.is_cuda:
            return "needs a CUDA GPU; " + ("running with --device cpu" if torch.cuda.is_available()
                                            else "none is visible on this machine")
        if self.nvidia and ctx.is_rocm:
            return (f"needs an NVIDIA GPU (CUDA C built by nvcc, NVIDIA tools); this torch is a ROCm build "
                    f"(HIP {torch.version.hip}) on {torch.cuda.get_device_name(ctx.device)}")
        if self.cuda and ctx.gpu_count < self.gpus:
            return f"needs {self.gpus} GPUs; this machine has {ctx.gpu_count}"
        for tool in self.tools:
            if shutil.which(tool) is None:
                return f"needs `{tool}` on PATH; not found"
        for module in self.modules:
            if importlib.util.find_spec(module) is None:
                return f"needs the Python package `{module}`; not installed"
        for var in self.env:
            if not os.environ.get(var):
                return f"needs the environment variable {var}; not set"
        return None


@dataclass(frozen=True)
class Work:
    """What one timed row will ask of the machine, known before it runs: the roofline's inputs.
    An exercise's `work(params)` lists them, from the same formulas its run() passes to measure(),
    so `lab predict EXERCISE` prints both predictions for any size before anything is run."""
    label: str
    flops: float
    bytes: float
    dtype: str | None
    working_set_bytes: float | None = None
    warm: bool = False                    # timed without an L2 flush
    graph_reps: int | None = None         # timed as a CUDA-graph replay
    launches: int = 1                     # kernels one timed call starts


@dataclass(frozen=True)
class Exercise:
    """One exercise. `params` declares every parameter as a `common.params.Param` (default, type,
    allowed values, unit); after construction `params` holds the defaults and `schema` the
    declarations. `footprint_bytes(params)` predicts the most device memory a run with those
    parameters holds at once, so a problem that cannot fit is refused before any work
    (`cpu_footprint_bytes` on a CPU, where the run loads more, as phase 5's fp32 weights).
    `skips(ctx, params)` says, before running, why run() would skip every row on this machine
    with those parameters (a reason the `needs` cannot express), so `lab list` does not say "runs"."""
    id: str                                  # "phase1.elementwise"
    title: str
    run: Callable
    needs: Needs = Needs()
    params: dict = field(default_factory=dict)
    cpu_params: dict = field(default_factory=dict)
    quick_params: dict = field(default_factory=dict)
    variants: tuple[str, ...] = ()
    bench_version: int = 1
    footprint_bytes: Callable[[dict], float] | None = None
    cpu_footprint_bytes: Callable[[dict], float] | None = None   # on a CPU, where it differs (fp32 weights)
    work: Callable[[dict], list[Work]] | None = None
    workloads: Callable[[dict], list] | None = None   # [(label, common.workload.Workload)]: the summed prediction
    skips: Callable[["Context", dict], str | None] | None = None  # why run() would skip here with these params
    check: Callable[[dict], None] | None = None   # LabError for values fine alone but not together (before any work)
    schema: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        undeclared = [k for k, v in self.params.items() if not isinstance(v, Param)]
        if undeclared:
            raise TypeError(f"{self.id}: parameter '{undeclared[0]}' is not declared as a Param")
        object.__setattr__(self, "schema", dict(self.params))
        object.__setattr__(self, "params", {k: p.default for k, p in self.params.items()})
        for label, extra in (("cpu_params", self.cpu_params), ("quick_params", self.quick_params)):
            unknown = set(extra) - set(self.schema)
            if unknown:
                raise TypeError(f"{self.id}: {label} sets undeclared '{sorted(unknown)[0]}'")

    @property
    def phase(self) -> int:
        return int(self.id.split(".")[0].removeprefix("phase"))

    @property
    def name(self) -> str:
        return self.id.split(".", 1)[1]

    def resolve_params(self, on_cpu: bool, quick: bool, overrides: dict) -> dict:
        """Defaults, then the CPU and quick sets, then the user's overrides, each value checked
        against its declaration (ParamError, one line, on the first bad one)."""
        params = dict(self.params)
        if on_cpu:
            params.update(self.cpu_params)
        if quick:
            params.update(self.quick_params)
        params.update({k: v for k, v in overrides.items() if k in self.schema})
        params = {k: self.schema[k].check(k, v) for k, v in params.items()}
        if self.check is not None:
            self.check(params)
        return params

    def recorded_params(self, params: dict) -> dict:
        """The parameters as the record stores them (folders relative to the repo or hashed)."""
        return {k: (self.schema[k].recorded(v) if k in self.schema else v) for k, v in params.items()}


class Context:
    """Where an exercise runs: the device, its spec sheet, the roofs, the harness, progress."""

    def __init__(self, device: torch.device, spec: HardwareSpec | None, hardware_key: str,
                 variants: tuple[str, ...] = (), quick: bool = False, progress=None, results=None):
        self.device = device
        self.results = results                   # the run's results folder (None: the default one)
        self.spec = spec
        self.hardware_key = hardware_key
        self.variants = variants
        self.quick = quick
        self._progress = progress
        self._measured_peaks: dict[str, float] = {}
        self._measured_bandwidth: float | None = None
        self._cache_bandwidth: float | None = None         # a CPU's last-level cache copy (see roofs)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def is_rocm(self) -> bool:
        """A GPU reached through a ROCm build of PyTorch (torch.cuda speaks HIP there): Triton and
        torch run; CUDA C and NVIDIA's tools do not."""
        return self.is_cuda and getattr(torch.version, "hip", None) is not None

    @property
    def gpu_count(self) -> int:
        return torch.cuda.device_count() if self.is_cuda else 0

    def wants(self, variant: str) -> bool:
        return not self.variants or variant in self.variants

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def time(self, fn, **kwargs) -> Timing:
        if self.quick:
            kwargs.setdefault("target_ms", 5.0)
            kwargs.setdefault("min_samples", 3)
            kwargs.setdefault("warmup_ms", 1.0)
        return benchmark(fn, self.device, **kwargs)

    def track(self, items: Iterable, description: str) -> Iterable:
        items = list(items)
        if self._progress is None:
            return items
        return self._progress.track(items, description=f"  {description}", total=len(items))

    def ceilings(self) -> dict | None:
        """The newest measured phase1.ceilings summary for this hardware in this run's results
        folder, with `record` (its path), for the calibrated prediction; None if none exists yet.
        Looked up again whenever the folder's ceilings files change, so `lab run
        phase1.ceilings 1` predicts the exercises after the ceilings from the record it just wrote."""
        from .paths import results_dir
        folder = results_dir(self.results) / "phase1" / "ceilings" / self.hardware_key
        files = frozenset(p.name for p in folder.glob("*.json")) if folder.is_dir() else frozenset()
        if files != getattr(self, "_ceilings_files", None):      # a new file (names need not sort by age)
            from .calibration import ceilings_by_hardware
            from .records import is_smoke, load_records
            found = ceilings_by_hardware([r for r in load_records(results_dir(self.results), exercise="phase1.ceilings",
                                                                  hardware=self.hardware_key)
                                          if self.quick or not is_smoke(r)])     # a smoke roof calibrates only smoke
            self._ceilings, self._ceilings_files = found.get(self.hardware_key), files
        return getattr(self, "_ceilings", None)

    def predict(self, flops: float, bytes_moved: float, dtype: str | None, timing: Timing, *, launches: int = 1,
                working_set_bytes: float | None = None, measured_ms: float | None = None) -> dict:
        """A timed row's `prediction`: the spec-sheet roofline, and `calibrated` from this machine's
        ceilings record when one exists (else the report computes it later and says so)."""
        measured = measured_ms if measured_ms is not None else timing.median_ms
        prediction = roofline.predict(flops, bytes_moved, self.roofs(dtype, working_set_bytes or bytes_moved), dtype,
                                      measured)
        prediction["launches"] = launches
        ceilings = self.ceilings()
        if ceilings:
            prediction["calibrated"] = {**roofline.calibrated(
                flops, bytes_moved, dtype, ceilings, measured, working_set_bytes=working_set_bytes or bytes_moved,
                warm=not timing.flush_l2, graph_reps=timing.graph_reps, launches=launches), "computed": "at run time"}
        return prediction

    def phase1_ceiling(self) -> dict | None:
        """The best matmul rate phase 1 measured on this hardware (summary of the newest measured
        regime-sweep record in this run's results folder), for MFU against a measured ceiling:
        {"tflops", "dtype", "source"}, or None if phase 1 has not run here."""
        from .paths import results_dir
        from .records import is_smoke, load_records
        recs = [r for r in load_records(results_dir(self.results), exercise="phase1.regime_sweep",
                                        hardware=self.hardware_key)
                if r.get("source", {}).get("kind", "measured") == "measured" and r.get("status") != "skipped"
                and (self.quick or not is_smoke(r))
                and (r.get("summary") or {}).get("measured_peak_tflops")]
        if not recs:
            return None
        s = recs[-1]["summary"]
        return {"tflops": s["measured_peak_tflops"], "dtype": s.get("dtype"), "source": f"results/{recs[-1]['_path']}"}

    # ----- roofs ------------------------------------------------------------------------------
    def roofs(self, dtype: str | None = None, working_set_bytes: float | None = None) -> roofline.Roofs:
        """The spec-sheet roofs of this GPU; on a CPU (no spec sheet) ceilings measured here: the
        copy bandwidth of the last-level cache for a working set that fits in it (a CPU is timed
        warm, so such a row is served from the cache), else of a copy far larger than any cache."""
        if self.spec is not None:
            bw = self.spec.figure("memory_bandwidth_gbps")
            return roofline.Roofs(
                bandwidth_gbps=bw.value,
                peak_tflops={d: self.spec.peak(d).value for d in DTYPES},
                source=f"hardware.yaml:{self.spec.key}",
                bandwidth_source=self.spec.cite(bw),
                peak_sources={d: self.spec.cite(self.spec.peak(d)) for d in DTYPES})
        if dtype and dtype not in self._measured_peaks and dtype in ("fp32", "fp16", "bf16"):
            self._measured_peaks[dtype] = measure_matmul_tflops(self, dtype)
        cache = self._cache_roof(working_set_bytes)
        if cache is not None:
            return roofline.Roofs(bandwidth_gbps=cache[0], peak_tflops=dict(self._measured_peaks),
                                  source="measured on this machine (copy bandwidth, library matmul)",
                                  bandwidth_source=cache[1], peak_sources=None)
        if self._measured_bandwidth is None:
            self._measured_bandwidth = measure_copy_gbps(self)
        return roofline.Roofs(bandwidth_gbps=self._measured_bandwidth,
                              peak_tflops=dict(self._measured_peaks),
                              source="measured on this machine (copy bandwidth, library matmul)",
                              bandwidth_source="measured: torch copy", peak_sources=None)

    def _cache_roof(self, working_set_bytes: float | None) -> tuple[float, str] | None:
        """(GB/s, source) of a copy inside the CPU's last-level cache, when the working set fits
        there (common/cpu_cache.py); None on a GPU, or where the working set or the cache is unknown."""
        from .cpu_cache import MEASURE_FRACTION, last_level_cache
        llc = None if self.is_cuda or not working_set_bytes else last_level_cache()
        if llc is None or working_set_bytes > llc[1]:
            return None
        if self._cache_bandwidth is None:
            self._cache_bandwidth = measure_copy_gbps(self, int(MEASURE_FRACTION * llc[1]) // 2)
        return self._cache_bandwidth, f"measured: torch copy within the L{llc[0]} cache (this working set fits there)"


def measure_copy_gbps(ctx: Context, nbytes: int = 256 * 2**20) -> float:
    """Device copy bandwidth, counting bytes read plus bytes written; timed with the harness's
    defaults, as the rows it bounds are (a shorter timing read low on a busy CPU)."""
    src = torch.rand(nbytes // 4, device=ctx.device)
    dst = torch.empty_like(src)
    t = benchmark(lambda: dst.copy_(src), ctx.device)
    return 2 * nbytes / (t.median_ms * 1e6)


def measure_matmul_tflops(ctx: Context, dtype: str, n: int = 1024) -> float:
    from .checks import TORCH_DTYPES
    a = torch.randn(n, n, device=ctx.device, dtype=TORCH_DTYPES[dtype])
    b = torch.randn(n, n, device=ctx.device, dtype=TORCH_DTYPES[dtype])
    t = benchmark(lambda: a @ b, ctx.device)                 # the harness's defaults, as the rows it bounds
    return 2 * n**3 / (t.median_ms * 1e9)


@dataclass
class Result:
    """What every `run(ctx, params)` returns: the result rows and the record's summary (values
    computed from the whole run: ceilings, verdicts, ratios a table or finding shows)."""
    rows: list[dict]
    summary: dict = field(default_factory=dict)


def row(variant: str, params: dict, status: str = "ok", reason: str | None = None, *,
        check: dict | None = None, timing: Timing | None = None, metrics: dict | None = None,
        prediction: dict | None = None) -> dict:
    return {"variant": variant, "params": params, "status": status, "reason": reason, "check": check,
            "timing": timing.as_dict() if timing else None, "metrics": metrics or {},
            "prediction": prediction}


def throughput_metrics(ms: float, flops: float, bytes_moved: float, roofs: roofline.Roofs,
                       dtype: str | None, best_ms: float | None = None) -> dict:
    """ms (median), GB/s, TFLOP/s and percent of the roofs, with the peaks' sources; with
    `best_ms` (the fastest sample) also the best-sample rates, which show what the chip does
    before sustained load brings its clocks down."""
    metrics = {"ms": ms}
    if bytes_moved:
        metrics["gbps"] = bytes_moved / (ms * 1e6)
        metrics["pct_of_peak_bandwidth"] = 100 * metrics["gbps"] / roofs.bandwidth_gbps
        metrics["peak_bandwidth_gbps"] = roofs.bandwidth_gbps
        metrics["peak_bandwidth_source"] = roofs.bandwidth_source or roofs.source
    if flops:
        metrics["tflops"] = flops / (ms * 1e9)
        peak = roofs.peak(dtype) if dtype else None
        metrics["peak_tflops"] = peak
        metrics["pct_of_peak_tflops"] = 100 * metrics["tflops"] / peak if peak else None
        metrics["peak_tflops_source"] = ((roofs.peak_sources or {}).get(dtype) or roofs.source) if peak else None
    if best_ms:
        metrics["best_ms"] = best_ms
        if bytes_moved:
            metrics["best_gbps"] = bytes_moved / (best_ms * 1e6)
        if flops:
            metrics["best_tflops"] = flops / (best_ms * 1e9)
    return metrics


def measure(ctx: Context, variant: str, params: dict, *, fn: Callable[[], object],
            check: Callable[[], dict], flops: float, bytes_moved: float, dtype: str | None,
            timing: dict | None = None, launches: int = 1) -> dict:
    """Check, then time, then predict: one result row.

    `check()` runs the kernel on a poisoned output and compares it with the reference; a failed
    check produces a 'failed' row with no timing at all. `bytes_moved` is the fewest bytes the
    operation must move through device memory (each input read once, each output written once);
    `launches` the kernels one call starts (the calibrated model's latency term counts each).
    """
    verdict = check()
    if not verdict["passed"]:
        return row(variant, params, "failed", verdict["reason"], check=verdict)
    t = ctx.time(fn, **(timing or {}))
    roofs = ctx.roofs(dtype, working_set_bytes=params.get("working_set_bytes") or bytes_moved)
    prediction = ctx.predict(flops, bytes_moved, dtype, t, launches=launches,
                             working_set_bytes=params.get("working_set_bytes"))
    return row(variant, params, "ok", None, check=verdict, timing=t,
               metrics=throughput_metrics(t.median_ms, flops, bytes_moved, roofs, dtype, t.min_ms),
               prediction=prediction)


def elements_bytes(n: int, dtype: str) -> int:
    return n * BYTES_PER_ELEMENT[dtype]


def reference_check(ctx: Context, out: torch.Tensor, run: Callable[[], object], reference, reference_name: str,
                    precision: str | None = None, **compare_kw) -> Callable[[], dict]:
    """The `check` for measure(): poison `out` (NaN), run the kernel once, synchronize, and compare
    with `reference` (a tensor, or for a tolerance check a (start, stop) -> float64 chunk function,
    as checks.compare takes). `precision` None means bit-exact (copies, integer ops)."""
    def check() -> dict:
        poison(out)
        run()
        ctx.synchronize()
        if precision is None:
            return exact(out, reference, reference_name)
        return compare(out, reference, precision, reference_name, **compare_kw)
    return check


def against_baseline(rows: list[dict], baseline: dict | None, metric: str, as_key: str) -> list[dict]:
    """The same-run comparison: each ok row gets metrics[as_key] = 100 x its `metric` over the
    baseline row's (a rate: GB/s, TFLOP/s; for times pass the baseline's rate instead). The
    baseline row itself is left alone; nothing is added when the baseline failed or is absent."""
    base = (baseline or {}).get("metrics", {}).get(metric) if (baseline or {}).get("status") == "ok" else None
    if not base:
        return rows
    for r in rows:
        if r is not baseline and r["status"] == "ok" and r["metrics"].get(metric) is not None:
            r["metrics"][as_key] = 100 * r["metrics"][metric] / base
    return rows
