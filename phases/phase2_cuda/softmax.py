"""Exercise 2.3: row softmax in CUDA C, from the seed's warp-per-row kernel to rows of 65,536
columns, fp32 and bf16, against torch.softmax and a copy of the same tensor in the same run.

    lab run phase2.softmax [--variant cuda] [--param cols=[1024,65536]]
    python -m phases.phase2_cuda.softmax         # alone: irregular shapes, a small timing table

y[r, :] = exp(x[r, :] - max) / sum(exp(x[r, :] - max)) over the last dimension of a contiguous
rows x cols tensor, fp32 arithmetic (`softmax.cu`). Fewest bytes: x read once, y written once, for
about 5 FLOPs per element, so time = bytes / bandwidth and a copy of the same tensor (`copy`) is
the ceiling: each row reports `pct_of_copy_bandwidth` against it and `speedup_vs_torch` against
the `torch` row. One kernel family per variant (the README's table says what each does and why);
`cuda` dispatches by row length and dtype (DISPATCH in softmax.cu) and each row records the kernel
it ran. Sizes: every row length at 2^28 elements per tensor (far beyond L2), plus the seed's
4,096 x 32 fp32 (inside L2), whose check also requires every row to sum to 1. Correctness gates
timing: every variant is first checked at irregular shapes, both dtypes, aligned and offset by one
element, against float64 torch.softmax at the dtype's tolerance, then at each timed size.
"""
import ctypes

import torch

from common.checks import BYTES_PER_ELEMENT, CHECK_CHUNK, compare, poison
from common.errors import LabError
from common.exercise import (
    Exercise,
    Needs,
    Result,
    Work,
    against_baseline,
    measure,
    reference_check,
)
from common.params import Choice, Int
from common.standalone import run_alone

from . import build
from ._args import INT32_MAX, need_contiguous

SOURCE = "softmax.cu"
_SIG = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
DTYPES = {torch.float32: (0, "fp32"), torch.bfloat16: (1, "bf16")}     # dtype -> (code in softmax.cu, name)
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LAUNCHERS = {                      # variant -> (launcher, longest row it handles or None, needs clusters)
    "cuda": ("launch_softmax", None, False),
    "warp_row": ("launch_softmax_warp_row", 1024, False),
    "warp_packed": ("launch_softmax_warp_packed", 1024, False),
    "block_row": ("launch_softmax_block_row", 32768, False),
    "cluster_row": ("launch_softmax_cluster_row", 131072, True),
    "online": ("launch_softmax_online", None, False),
    "block_row_smem": ("launch_softmax_block_row_smem", 16384, False),
    "cluster_row_smem": ("launch_softmax_cluster_row_smem", 131072, True),
    "cluster_row_smem64": ("launch_softmax_cluster_row_smem64", 131072, True),
    "stream_row": ("launch_softmax_stream_row", 131072, True),
    # A deliberately wrong kernel, for the tests only: it normalizes by the first half of each row.
    "broken_half_row_sum": ("launch_softmax_broken_half_row_sum", None, False),
}
VARIANTS = ("cuda", "warp_row", "warp_packed", "block_row", "cluster_row", "online", "block_row_smem",
            "cluster_row_smem", "cluster_row_smem64", "stream_row")
BASELINES = ("copy", "torch")
KERNELS = ("warp_packed", "warp_row", "block_row", "cluster_row", "online", "block_row_smem", "cluster_row_smem",
           "cluster_row_smem64", "stream_row")   # softmax_choose's codes (enum Kernel in softmax.cu)
SIGNATURES = {**{name: _SIG for name, _, _ in LAUNCHERS.values()}, "softmax_choose": [ctypes.c_int, ctypes.c_int]}
# Where each variant is timed (it is checked wherever it applies): its own range of row lengths.
# block_row from 2048: below that its smallest configuration (128 threads x 16) leaves threads idle.
# The shared-memory kernels on long rows (cluster_row_smem64 from 32768: below that its 64 KB slice
# is one CTA, block_row_smem's case); stream_row from 16384 (the dispatcher's choice from 32769 on;
# at 16384 it is timed against block_row_smem, which it does not beat).
TIMED_COLS = {"warp_row": (1, 1024), "warp_packed": (1, 1024), "block_row": (2048, 32768),
              "cluster_row": (16384, 131072), "block_row_smem": (8192, 16384),
              "cluster_row_smem": (16384, 131072), "cluster_row_smem64": (32768, 131072),
              "stream_row": (16384, 131072)}
GRAPH_REPS = 20                    # calls per CUDA-graph replay for the launch-bound seed case
FLOPS_PER_ELEMENT = 5              # max, subtract, exp, add, multiply (the log2 e scale folded in)
ROW_SUM_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2}   # |sum(y[r, :]) - 1|, the seed's own check
NOT_SUPPORTED = 801                # cudaErrorNotSupported: no thread-block clusters here


# ------------------------------------------------------------------------------ the wrapper
def softmax(x: torch.Tensor, variant: str = "cuda", out: torch.Tensor | None = None) -> torch.Tensor:
    """Row softmax of a contiguous 2-D fp32 or bf16 tensor on one CUDA device, into `out` (same
    shape and dtype; allocated when None) with one of the CUDA kernels."""
    if variant not in LAUNCHERS:
        raise ValueError(f"unknown softmax variant '{variant}'; choose from {', '.join(VARIANTS)}")
    launcher, max_cols, needs_clusters = LAUNCHERS[variant]
    _need_input("x", x)
    rows, cols = x.shape
    if max_cols is not None and cols > max_cols:
        raise ValueError(f"softmax variant '{variant}' handles rows of at most {max_cols} columns, got {cols}; "
                         "variant 'cuda' handles any length")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        _need_input("out", out)
        if out.dtype != x.dtype:
            raise TypeError(f"out must be {x.dtype} like x, got {out.dtype}")
        if out.shape != x.shape:
            raise ValueError(f"out must be {tuple(x.shape)} like x, got {tuple(out.shape)}")
        if _overlap(x, out):
            raise ValueError("out must not share memory with x (the kernels read x through the read-only cache)")
    build.require_gpu(x, out)
    if needs_clusters and not has_clusters(x.device):
        major, minor = torch.cuda.get_device_capability(x.device)
        raise LabError(f"softmax variant '{variant}' needs thread-block clusters or bulk copies "
                       "(compute capability 9.0 or newer); "
                       f"this GPU is sm_{major}{minor}")
    if rows == 0:
        return out
    lib, _ = build.load(SOURCE, SIGNATURES)
    with torch.cuda.device(x.device):
        code = getattr(lib, launcher)(build.ptr(x), build.ptr(out), rows, cols, DTYPES[x.dtype][0],
                                      build.stream(x.device))
    if code == NOT_SUPPORTED:
        raise LabError(f"softmax {variant}: this GPU cannot launch the cluster kernel for rows of {cols} "
                       f"(CUDA error {code}: {lib.lab_error_string(code).decode()})")
    build.check(lib, code, f"softmax {variant} launch")
    return out


def _need_input(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES:
        raise TypeError(f"{name} must be torch.float32 or torch.bfloat16, got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows x cols; softmax over the last dim), got {t.dim()}-D; "
                         "reshape to (-1, cols) first")
    need_contiguous(name, t)
    if t.shape[1] < 1:
        raise ValueError(f"{name} must have at least one column, got shape {tuple(t.shape)}")
    if t.numel() > INT32_MAX:
        raise ValueError(f"{name} must have fewer than 2^31 elements (the kernels count rows and columns "
                         f"with int), got {t.numel()}")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def has_clusters(device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def chosen_kernel(cols: int, dtype: torch.dtype, device) -> str:
    """The kernel variant `cuda` runs for rows of `cols` elements of `dtype` on `device`."""
    lib, _ = build.load(SOURCE, SIGNATURES)
    with torch.cuda.device(device):
        return KERNELS[lib.softmax_choose(cols, DTYPES[dtype][0])]


def applies(variant: str, cols: int, device) -> bool:
    """Can `variant` run rows of `cols` elements on `device`?"""
    _, max_cols, needs_clusters = LAUNCHERS[variant]
    return (max_cols is None or cols <= max_cols) and (not needs_clusters or has_clusters(device))


def timed_at(variant: str, cols: int, dtype: torch.dtype, device) -> bool:
    """Is `variant` timed at this row length? Each kernel within its own range; warp_packed only where
    its layout differs from warp_row's (where the dispatcher picks it)."""
    return _timed(variant, cols, has_clusters(device), lambda: chosen_kernel(cols, dtype, device))


def _timed(variant: str, cols: int, clusters: bool, dispatched) -> bool:
    """timed_at on a GPU with or without clusters; `dispatched()` is the `cuda` variant's kernel there."""
    _, max_cols, needs_clusters = LAUNCHERS[variant]
    if (max_cols is not None and cols > max_cols) or (needs_clusters and not clusters):
        return False
    if variant == "warp_packed" and dispatched() != "warp_packed":
        return False
    lo, hi = TIMED_COLS.get(variant, (1, None))
    return cols >= lo and (hi is None or cols <= hi)


# ------------------------------------------------------------------------------ the counts
# The longest row DISPATCH in softmax.cu sends to warp_packed, per dtype (fewer than 32 lanes per row
# up to there): what work() needs of the dispatcher without a GPU to ask. A test holds it to softmax_choose.
PACKED_MAX_COLS = {"fp32": 128, "bf16": 256}


def softmax_work(variant: str, rows: int, cols: int, dtype: str, group: str = "sweep") -> Work:
    """One timed call on a rows x cols tensor of `dtype` (fp32 or bf16; y has x's dtype).
    Fewest bytes, every variant and both baselines: x read once and y written once, each at the
    dtype's itemsize: 2 x rows x cols x itemsize (8 bytes per element in fp32, 4 in bf16: bf16 in,
    bf16 out). FLOPs: none for the copy, FLOPS_PER_ELEMENT per element for a softmax (torch's or
    ours). One kernel per call: each launcher starts one (`cuda` the one it dispatches to, `online`
    both of its passes in one kernel, stream_row's fallback one), torch.softmax one, the copy one.
    The seed's case is timed as a CUDA-graph replay of GRAPH_REPS calls."""
    n, itemsize = rows * cols, BYTES_PER_ELEMENT[dtype]
    nbytes = 2 * n * itemsize
    return Work(f"{variant} {rows}x{cols} {dtype}", 0 if variant == "copy" else FLOPS_PER_ELEMENT * n, nbytes,
                None if variant == "copy" else dtype, working_set_bytes=nbytes,
                graph_reps=GRAPH_REPS if group == "seed" else None, launches=1)


def work(params) -> list[Work]:
    """Every row run() times with these parameters on a GPU with thread-block clusters (sm_90, the
    H200), in its order: per shape the copy, torch.softmax, then each variant where it is timed."""
    out = []
    for rows, cols, dtype, group in shapes(params):
        short = "warp_packed" if cols <= PACKED_MAX_COLS[dtype] else "warp_row"    # all that _timed asks of it
        out += [softmax_work(v, rows, cols, dtype, group) for v in (*BASELINES, *VARIANTS)
                if v in BASELINES or _timed(v, cols, True, lambda short=short: short)]
    return out


# ------------------------------------------------------------------------------ reference and checks
def reference(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.double(), dim=1)


def inputs(rows: int, cols: int, dtype: torch.dtype, device, seed: int, offset: int = 0) -> torch.Tensor:
    """randn x 4 (exp spans many decades); with offset = 1, a contiguous view starting one element
    into its buffer, so it is not 16-byte aligned (the kernels must take their scalar path)."""
    g = torch.Generator(device=device).manual_seed(seed)
    flat = (torch.randn(rows * cols + offset, device=device, generator=g) * 4).to(dtype)
    return flat[offset:].view(rows, cols)


def output_like(x: torch.Tensor, offset: int = 0) -> torch.Tensor:
    rows, cols = x.shape
    return torch.empty(rows * cols + offset, device=x.device, dtype=x.dtype)[offset:].view(rows, cols)


def check_variant(variant: str, x: torch.Tensor, out: torch.Tensor, ref: torch.Tensor | None = None) -> dict:
    """Poison `out`, run the variant, compare with the float64 softmax at the dtype's tolerance."""
    ref = reference(x) if ref is None else ref
    poison(out)
    softmax(x, variant, out)
    torch.cuda.synchronize(out.device)
    return compare(out, ref, DTYPES[x.dtype][1], "float64 torch.softmax of the same inputs")


def row_sums(out: torch.Tensor, tolerance: float) -> dict:
    """The seed's check: every row of the output sums to 1 (in float64) within `tolerance`."""
    worst = float((out.double().sum(dim=1) - 1).abs().max()) if out.numel() else 0.0
    ok = worst <= tolerance                        # NaN compares False: fails
    return {"max_row_sum_error": worst, "row_sum_tolerance": tolerance, "passed": ok,
            "reason": None if ok else f"a row sums to 1 +- {worst:.2e}, beyond {tolerance:.0e}"}


def with_row_sums(verdict: dict, out: torch.Tensor, dtype: str) -> dict:
    if not verdict["passed"]:
        return verdict
    sums = row_sums(out, ROW_SUM_TOLERANCE[dtype])
    return {**verdict, "max_row_sum_error": sums["max_row_sum_error"], "row_sum_tolerance": sums["row_sum_tolerance"],
            "passed": sums["passed"], "reason": sums["reason"]}


def _guarded(fn) -> dict:
    """fn()'s verdict, or a failed one saying why it raised (a launch error must not cost the run)."""
    try:
        return fn()
    except (LabError, ValueError, TypeError) as exc:
        return {"passed": False, "reason": str(exc)}


# ------------------------------------------------------------------------------ the exercise
def irregular_checks(ctx, params, wanted: list[str]) -> dict:
    """{variant: {"ROWSxCOLS dtype[ misaligned]": verdict}} for every wanted variant where it applies."""
    found = {v: {} for v in wanted}
    for rows, cols in params["irregular_shapes"]:
        for dtype in params["dtypes"]:
            for offset in (0, 1):
                key = f"{rows}x{cols} {dtype}" + (" misaligned" if offset else "")
                for v, verdict in _checks_at(ctx, rows, cols, dtype, offset, wanted).items():
                    found[v][key] = verdict
    return found


def _checks_at(ctx, rows: int, cols: int, dtype: str, offset: int, wanted: list[str]) -> dict:
    x = inputs(rows, cols, TORCH_DTYPES[dtype], ctx.device, seed=rows * 7919 + cols, offset=offset)
    out, ref = output_like(x, offset), reference(x)
    return {v: _guarded(lambda v=v: check_variant(v, x, out, ref)) for v in wanted if applies(v, cols, ctx.device)}


def first_failure(checks: dict) -> dict | None:
    for key, verdict in checks.items():
        if not verdict["passed"]:
            return {**verdict, "reason": f"at {key}: {verdict['reason']}"}
    return None


def shapes(params) -> list[tuple[int, int, str, str]]:
    """(rows, cols, dtype, group): the seed's case, then every row length in every dtype."""
    out = [(*params["seed_shape"], "fp32", "seed")]
    for dtype in params["dtypes"]:
        for cols in params["cols"]:
            out.append((max(1, params["total_elements"] // cols), cols, dtype, "sweep"))
    return out


def one_shape(ctx, rows: int, cols: int, dtype: str, group: str, wanted: list[str], irregular: dict) -> list[dict]:
    """copy, torch.softmax, then each wanted variant timed at this row length, related to both."""
    tdtype = TORCH_DTYPES[dtype]
    x = inputs(rows, cols, tdtype, ctx.device, seed=rows * 7919 + cols)
    out = torch.empty_like(x)
    ref = reference(x) if wanted or ctx.wants("torch") else None
    seed = group == "seed"
    size = {"rows": rows, "cols": cols, "dtype": dtype, "group": group,
            "working_set_bytes": softmax_work("copy", rows, cols, dtype, group).working_set_bytes}
    what = "float64 torch.softmax of the same inputs"

    def timed(variant: str, fn, check) -> dict:
        w = softmax_work(variant, rows, cols, dtype, group)
        return measure(ctx, variant, size, fn=fn, check=check, flops=w.flops, bytes_moved=w.bytes, dtype=w.dtype,
                       timing={"graph_reps": w.graph_reps} if w.graph_reps else None, launches=w.launches)

    def gated(check):
        """A launch error is a failed check; the seed's case must also have every row sum to 1."""
        def checked() -> dict:
            verdict = _guarded(check)
            return with_row_sums(verdict, out, dtype) if seed else verdict
        return checked

    # The seed's case is a few microseconds of GPU work: timed call by call, the Python wrapper's own
    # time would leave the GPU idle between the events. Every row of it (ours and the baselines) is
    # timed as a CUDA-graph replay of GRAPH_REPS calls, device time only (softmax_work says so).
    here = []
    if wanted or ctx.wants("copy"):                    # the ceiling for every row of ours
        def copy():
            out.copy_(x)

        here.append(timed("copy", copy, reference_check(ctx, out, copy, x, "the source tensor")))
    if wanted or ctx.wants("torch"):                   # the library to beat
        def torch_softmax():
            out.copy_(torch.softmax(x, dim=1))

        here.append(timed("torch", lambda: torch.softmax(x, dim=1),
                          gated(reference_check(ctx, out, torch_softmax, ref, what, dtype))))
    for v in wanted:
        if not timed_at(v, cols, tdtype, ctx.device):
            continue

        def fn(v=v):
            softmax(x, v, out)

        failed = first_failure(irregular[v])
        check = (lambda failed=failed: failed) if failed else gated(reference_check(ctx, out, fn, ref, what, dtype))
        r = timed(v, fn, check)
        if v == "cuda":
            r["metrics"]["kernel"] = chosen_kernel(cols, tdtype, ctx.device)
        here.append(r)
    return _relate(here)


def run(ctx, params):
    wanted = [v for v in VARIANTS if ctx.wants(v)]
    irregular = irregular_checks(ctx, params, wanted)
    rows_out, dispatch, seed_sums = [], {}, {}
    for rows, cols, dtype, group in ctx.track(shapes(params), "softmax shapes"):
        here = one_shape(ctx, rows, cols, dtype, group, wanted, irregular)
        if group == "seed":
            seed_sums = {r["variant"]: r["check"] for r in here if r["variant"] != "copy" and r.get("check")}
        dispatch[f"{dtype} {cols}"] = chosen_kernel(cols, TORCH_DTYPES[dtype], ctx.device)
        rows_out += here
    _, b = build.load(SOURCE, SIGNATURES)
    summary = {"irregular_shapes": params["irregular_shapes"], "irregular_checks": irregular,
               "seed_row_sum_checks": seed_sums, "dispatch": dispatch,
               "dispatch_table": "DISPATCH in softmax.cu (per dtype: first {max_cols, kernel} entry with cols <= max_cols)",
               "clusters": has_clusters(ctx.device),
               "not_run": {v: "needs compute capability 9.0+ (thread-block clusters, bulk copies)"
                           for v in wanted if LAUNCHERS[v][2] and not has_clusters(ctx.device)},
               "build": {"arch": b.arch, "flags": list(b.flags),
                         "resources": {k: r for k, r in b.resources.items() if k.startswith("softmax_")}},
               "l2_bytes": getattr(torch.cuda.get_device_properties(ctx.device), "L2_cache_size", None)}
    return Result(rows_out, summary)


def _relate(here: list[dict]) -> list[dict]:
    """Every row against the copy (the bandwidth ceiling), ours against torch.softmax: same size, same run."""
    against_baseline(here, next((r for r in here if r["variant"] == "copy"), None), "gbps", "pct_of_copy_bandwidth")
    torch_row = next((r for r in here if r["variant"] == "torch" and r["status"] == "ok"), None)
    for r in here:
        if r["status"] == "ok" and r["variant"] not in BASELINES and torch_row:
            r["metrics"]["speedup_vs_torch"] = torch_row["metrics"]["ms"] / r["metrics"]["ms"]
    return here


def _fits_int32(shape: list[int]) -> str | None:
    """The kernels count elements with int: a shape must hold fewer than 2^31."""
    return f"{shape[0]} x {shape[1]} is 2^31 elements or more" if shape[0] * shape[1] > INT32_MAX else None


def footprint_bytes(p: dict) -> int:
    """The largest tensor: x, out, the float64 reference, then its float64 input or a check (output, chunk)."""
    shapes = [p["seed_shape"], *p["irregular_shapes"]]
    n = max(*(max(p["total_elements"], c) for c in p["cols"]), *(r * c for r, c in shapes))
    s = max(4 if d == "fp32" else 2 for d in p["dtypes"])
    return 2 * s * n + 8 * n + max(8 * n, s * n + 3 * 8 * min(n, CHECK_CHUNK))


EXERCISE = Exercise(
    id="phase2.softmax",
    title="CUDA softmax: the seed's warp per row, then block, cluster and online kernels to 65,536 columns, "
          "fp32 and bf16, vs torch.softmax and copy",
    run=run, needs=Needs(cuda=True, nvidia=True, tools=("nvcc",)),
    params={"cols": Int([32, 128, 512, 1024, 4096, 16384, 65536], min=1, max=INT32_MAX, unit="columns (row length)",
                        many=True),
            "total_elements": Int(2**28, min=1, max=INT32_MAX, unit="elements per tensor (rows = this // cols)"),
            "dtypes": Choice(["fp32", "bf16"], tuple(TORCH_DTYPES), many=True),
            "seed_shape": Int([4096, 32], min=1, length=2, unit="rows, columns (fp32)"),
            "irregular_shapes": Int([[1000, 1000], [77, 33], [3, 65537], [5, 100000]], min=1, max=INT32_MAX,
                                    length=2, many=True, rule=_fits_int32, unit="rows, columns (checked, not timed)")},
    cpu_params={},
    quick_params={"cols": [128, 4096, 65536], "total_elements": 2**20,
                  "irregular_shapes": [[77, 33], [3, 65537]]},
    variants=(*BASELINES, *VARIANTS), footprint_bytes=footprint_bytes, work=work)


if __name__ == "__main__":
    run_alone(EXERCISE, {"cols": [1000, 4097, 65536], "total_elements": 2**20, "irregular_shapes": [[77, 33], [3, 65537]]})
