"""Exercise 2.2: the matmul ladder in CUDA C, rung by rung, against cuBLAS in the same run.

    lab run phase2.matmul [--variant tiled] [--param sizes=[1024,2048,4096,8192]]
    lab run phase2.matmul --variant wgmma_tma_ws --param sizes=[8192] --param shapes=13x4096x14336,5000x6001x4104
    python -m phases.phase2_cuda.matmul          # alone: an irregular shape, a small timing table

`shapes` (MxNxK,...) times the rungs and cuBLAS at your own products too, after the N x N x N
sizes (the TMA rungs need K a multiple of 8: at another K their row says so and is skipped).

C = A @ B for any M, N, K, one kernel per rung (rungs.py lists them; the README says what each
changes and why it is faster), plus a fixed-order sum of partial products where a wgmma rung
splits K (tall-skinny and few-tile products). Baselines, same inputs and same run: `cublas_fp32` (TF32 off, the
fp32 rungs' arithmetic), `cublas_bf16`, and `cublas_bf16_nt` (B column-major, the storage the
wgmma rungs read); each rung's `pct_of_library` is its TFLOP/s over its baseline's, and
`over_base` what it bought over the rung it builds on (analysis.ladder_steps).

Correctness gates timing: each rung is checked against a float64 matmul of the same (rounded)
inputs first at an irregular shape (no dimension a tile multiple, so every bounds check runs; K
trimmed to a multiple of 8 for the TMA rungs), then at the timed size. The fp32 tolerance is below
what TF32 gives, so a silent TF32 path fails. FLOPs 2N^3; fewest bytes N^2 x (2 x input itemsize +
output itemsize); one kernel per call (`matmul_work`, which `lab predict phase2.matmul` lists too).
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
    row,
)
from common.matmul_shapes import Shapes, parse_shapes
from common.params import Int
from common.standalone import run_alone

from . import build
from ._args import INT32_MAX, need_contiguous, need_dtype
from .analysis import ladder_steps
from .rungs import BASELINES, NOMINAL_SMS, RUNGS, VARIANTS, rung_launches, tma_split_k, ws_split_k

F32, BF16 = torch.float32, torch.bfloat16
TORCH = {"fp32": F32, "bf16": BF16}


def dtypes(variant: str) -> tuple[torch.dtype, torch.dtype]:
    """(A and B's dtype, C's dtype) of a rung."""
    rung = RUNGS[variant]
    return TORCH[rung.precision], TORCH[rung.out_precision]


# cuBLAS through torch.matmul(A, B, out=C): (A and B's dtype, how B is stored, C's dtype).
BASELINE_OPERANDS = {"cublas_fp32": ("fp32", "row", "fp32"), "cublas_bf16": ("bf16", "row", "bf16"),
                     "cublas_bf16_nt": ("bf16", "col", "bf16")}


def operands_of(variant: str) -> tuple[str, str, str]:
    """(A and B's dtype, B's storage, C's dtype) of a rung or a cuBLAS baseline."""
    if variant in BASELINE_OPERANDS:
        return BASELINE_OPERANDS[variant]
    rung = RUNGS[variant]
    return rung.precision, rung.b_layout, rung.out_precision


def matmul_work(variant: str, m: int, n: int, k: int, sms: int = NOMINAL_SMS) -> Work:
    """C = A @ B, A m x k, B k x n. FLOPs 2mnk (a multiply and an add per term, the usual count).
    Fewest bytes: A and B read once at their itemsize, C written once at its own (mma_bf16 writes
    fp32): (mk + kn) x in + mn x out; for N^3, N^2 x (2 in + out). One kernel per call, except
    where a wgmma rung splits K on a GPU of `sms` SMs (then its partial sums' kernel too) or
    copies A and B first (rungs.rung_launches); cuBLAS is taken to start one."""
    prec, _, out = operands_of(variant)
    launches = rung_launches(variant, m, n, k, sms) if variant in RUNGS else 1
    return Work(f"{variant} {m}x{n}x{k}", 2 * m * n * k,
                (m * k + k * n) * BYTES_PER_ELEMENT[prec] + m * n * BYTES_PER_ELEMENT[out], prec, launches=launches)


def timed_shapes(params) -> list[tuple[int, int, int]]:
    """The products run() times, in order: each N of `sizes` as N x N x N, then `shapes`."""
    return [(n, n, n) for n in params["sizes"]] + (parse_shapes(params["shapes"]) if params.get("shapes") else [])


def work(params) -> list[Work]:
    """Every row run() times with these parameters, in its order: per shape the three cuBLAS
    baselines, then each rung (naive only while max(M, N, K) <= naive_max_n). A rung this GPU cannot
    run (the wgmma rungs off sm_90) is listed anyway: which GPU it runs on is known only then."""
    return [matmul_work(v, m, n, k) for m, n, k in timed_shapes(params) for v in (*BASELINES, *VARIANTS)
            if not (v == "naive" and max(m, n, k) > params["naive_max_n"])]


_SIG = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_void_p]


def signatures(source: str) -> dict:
    return {r.launcher: _SIG for r in RUNGS.values() if r.source == source}


def column_major(b: torch.Tensor) -> torch.Tensor:
    """The same K x N matrix stored column-major (K contiguous): what the "col" rungs read."""
    return b.t().contiguous().t()


def matmul(a: torch.Tensor, b: torch.Tensor, variant: str = "tiled", out: torch.Tensor | None = None) -> torch.Tensor:
    """C = a @ b with one of the CUDA kernels (a: M x K, b: K x N); C's dtype is the rung's
    `out_precision`. Rungs with b_layout "col" need b column-major: pass `column_major(b)`."""
    rung = RUNGS.get(variant)
    if rung is None:
        raise ValueError(f"unknown matmul variant '{variant}'; choose from {', '.join(VARIANTS)}")
    in_dtype, out_dtype = dtypes(variant)
    need_dtype("a", a, in_dtype)
    need_dtype("b", b, in_dtype)
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D, got {a.dim()}-D and {b.dim()}-D")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    M, K = a.shape
    N = b.shape[1]
    if out is not None:
        need_dtype("out", out, out_dtype)
        if tuple(out.shape) != (M, N):
            raise ValueError(f"out must be {(M, N)}, got {tuple(out.shape)}")
        need_contiguous("out", out)
    need_contiguous("a", a)
    if rung.b_layout == "col":
        if not b.t().is_contiguous():
            raise ValueError(f"variant {variant} reads b column-major (K contiguous); pass column_major(b)")
    else:
        need_contiguous("b", b)
    if K % rung.k_multiple:
        raise ValueError(f"variant {variant} needs K to be a multiple of {rung.k_multiple} "
                         f"(rows of 16 bytes for the TMA copy engine); got K = {K}")
    if max(M * K, K * N, M * N) > INT32_MAX:
        raise ValueError("each matrix must have fewer than 2^31 elements (the kernels index with int)")
    out = torch.empty(M, N, device=a.device, dtype=out_dtype) if out is None else out
    build.require_gpu(a, b, out)
    why_not = runnable(variant, a.device)
    if why_not:
        raise LabError(f"variant {variant} {why_not}")
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    lib, _ = build.load(rung.source, signatures(rung.source))
    with torch.cuda.device(a.device):
        code = getattr(lib, rung.launcher)(build.ptr(a), build.ptr(b), build.ptr(out), M, N, K,
                                           build.stream(a.device))
    build.check(lib, code, f"matmul {variant} launch")
    return out


# ------------------------------------------------------------------------------ checks
WHAT = {"fp32": "float64 matmul of the same inputs", "bf16": "float64 matmul of the same bf16-rounded inputs"}


def operands(m: int, n: int, k: int, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(m, k, device=device, generator=g), torch.randn(k, n, device=device, generator=g))


def check_variant(variant: str, a32: torch.Tensor, b32: torch.Tensor, out: torch.Tensor | None = None,
                  ref64: torch.Tensor | None = None) -> dict:
    """Poison `out`, run the variant on (a32, b32) cast to its dtype (b in its layout), compare with
    the float64 product of the same (rounded) inputs."""
    in_dtype, out_dtype = dtypes(variant)
    a, b = a32.to(in_dtype), b32.to(in_dtype)
    if ref64 is None:
        ref64 = a.double() @ b.double()
    if RUNGS[variant].b_layout == "col":
        b = column_major(b)
    if out is None or out.dtype != out_dtype:
        out = torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=out_dtype)
    poison(out)
    matmul(a, b, variant, out)
    torch.cuda.synchronize(out.device)
    return compare(out, ref64, RUNGS[variant].precision, WHAT[RUNGS[variant].precision])


def _after_irregular(irregular: dict, check):
    """The timed size's check, unless the rung already failed at the irregular shape."""
    def gated() -> dict:
        if not irregular["passed"]:
            return {**irregular, "reason": f"at {irregular['shape']}: {irregular['reason']}"}
        return check()
    return gated


class _NoTF32:
    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.saved


def runnable(variant: str, device) -> str | None:
    """Why a rung cannot run on this GPU, or None."""
    rung, cap = RUNGS[variant], torch.cuda.get_device_capability(device)
    want = ".".join(map(str, rung.min_capability))
    if rung.arch_specific and cap != rung.min_capability:
        return f"needs compute capability exactly {want} (built for sm_{want.replace('.', '')}a); this GPU is {cap[0]}.{cap[1]}"
    if cap < rung.min_capability:
        return f"needs compute capability {want} or newer; this GPU is {cap[0]}.{cap[1]}"
    return None


# ------------------------------------------------------------------------------ the exercise
MAX_N = 46340                      # the largest N with N x N < 2^31 elements (the kernels index with int)


def footprint_bytes(p: dict) -> int:
    """fp32/bf16 operands, outputs and float64 references at the largest product, plus a check's temporaries."""
    def at(m: int, n: int, k: int) -> int:
        ins, mn = m * k + k * n, m * n
        held = (4 + 2) * ins + 2 * k * n + (4 + 2) * mn    # fp32 and bf16 A, B; B column-major; fp32 and bf16 C
        refs = 2 * 8 * mn                                  # the fp32 and the bf16 float64 products
        check = 3 * 2 * mn + 3 * 8 * min(mn, CHECK_CHUNK)  # a bf16 rung's rounded copies, one float64 chunk
        split = max(ws_split_k(m, n, k, NOMINAL_SMS), tma_split_k(m, n, k, NOMINAL_SMS))
        kernels = 4 * split * m * n * (split > 1) + 2 * (m + n) * (k + 63)   # split-K sums; pitch128's copies
        return held + refs + max(check, 8 * ins) + kernels   # or: the float64 A and B a reference is built from
    sweep = max(at(*shape) for shape in timed_shapes(p))
    m, n, k = p["irregular_shape"]                 # fp32 operands and trimmed copies, bf16 copies, float64
    irregular = 24 * (m * k + k * n) + 12 * m * n + 3 * 8 * min(m * n, CHECK_CHUNK)   # A, B, C and reference
    return max(sweep, irregular)


def one_shape(ctx, shape: tuple, wanted: list[str], irregular: dict, naive_max_n: int) -> list[dict]:
    """The baselines the wanted rungs need, then each rung, at one M x N x K; rows in ladder order."""
    m, n, k = shape
    a32, b32 = operands(m, n, k, ctx.device, seed=n if m == n == k else (m * 131 + n) * 131 + k)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    inputs = {("fp32", "row"): (a32, b32), ("bf16", "row"): (a16, b16), ("bf16", "col"): (a16, column_major(b16))}
    outs = {"fp32": torch.empty(m, n, device=ctx.device), "bf16": torch.empty(m, n, device=ctx.device, dtype=BF16)}
    libraries = {RUNGS[v].library for v in wanted} | {b for b in BASELINES if ctx.wants(b)}
    refs = {p: (a32.double() @ b32.double()) if p == "fp32" else (a16.double() @ b16.double())
            for p in sorted({BASELINE_OPERANDS[b][0] for b in libraries})}
    here = {}
    sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count if ctx.device.type == "cuda" else NOMINAL_SMS

    def timed(v: str, fn, check) -> dict:
        w = matmul_work(v, m, n, k, sms)
        prec, b_layout, _ = operands_of(v)
        return measure(ctx, v, {"m": m, "n": n, "k": k, "dtype": prec, "b_layout": b_layout}, fn=fn, check=check,
                       flops=w.flops, bytes_moved=w.bytes, dtype=w.dtype, launches=w.launches)

    for base in BASELINES:
        if base not in libraries:
            continue
        prec, b_layout, _ = BASELINE_OPERANDS[base]
        (x, y), o = inputs[(prec, b_layout)], outs[prec]

        def fn(x=x, y=y, o=o):
            torch.matmul(x, y, out=o)

        here[base] = timed(base, fn, reference_check(ctx, o, fn, refs[prec], f"float64 matmul of the same {prec} inputs",
                                                     prec))
    for v in wanted:
        rung = RUNGS[v]
        if v == "naive" and max(m, n, k) > naive_max_n:
            continue
        size = {"m": m, "n": n, "k": k, "dtype": rung.precision, "b_layout": rung.b_layout}
        why_not = runnable(v, ctx.device) or (
            f"needs K to be a multiple of {rung.k_multiple} (16-byte rows for TMA); K = {k}" if k % rung.k_multiple else None)
        if why_not:
            here[v] = row(v, size, "skipped", why_not)
            continue
        (x, y), out = inputs[(rung.precision, rung.b_layout)], outs[rung.out_precision]

        def fn(v=v, x=x, y=y, out=out):
            matmul(x, y, v, out)

        check = reference_check(ctx, out, fn, refs[rung.precision], WHAT[rung.precision], rung.precision)
        here[v] = timed(v, fn, _after_irregular(irregular[v], check))
    for base in BASELINES:
        against_baseline([here[v] for v in wanted if v in here and RUNGS[v].library == base], here.get(base),
                         "tflops", "pct_of_library")
    return [here[k] for k in (*BASELINES, *VARIANTS) if k in here]


def run(ctx, params):
    wanted = [v for v in VARIANTS if ctx.wants(v)]
    m_i, n_i, k_i = params["irregular_shape"]
    ia, ib = operands(m_i, n_i, k_i, ctx.device, seed=1)
    irregular = {}
    with _NoTF32():
        for v in wanted:
            if runnable(v, ctx.device) is None:
                k_v = k_i - k_i % RUNGS[v].k_multiple      # TMA rungs: the largest K below k_i they take
                irregular[v] = {**check_variant(v, ia[:, :k_v].contiguous(), ib[:k_v].contiguous()),
                                "shape": [m_i, n_i, k_v]}
        del ia, ib
        rows = []
        for shape in ctx.track(timed_shapes(params), "matmul shapes"):
            rows += one_shape(ctx, tuple(shape), wanted, irregular, params["naive_max_n"])

    def key(r: dict) -> tuple:
        return r["params"]["m"], r["params"]["n"], r["params"]["k"]
    steps = ladder_steps([(r["variant"], key(r), r["metrics"].get("tflops")) for r in rows if r["status"] == "ok"])
    for r in rows:
        base, factor = steps.get((r["variant"], key(r)), (None, None))
        if factor is not None:
            r["metrics"]["base_rung"], r["metrics"]["over_base"] = base, factor
    resources = {}
    for v in wanted:
        b_ = build.load(RUNGS[v].source, signatures(RUNGS[v].source))[1]
        resources[v] = {**(b_.resources.get(RUNGS[v].kernel) or {}), "source": RUNGS[v].source, "arch": b_.arch,
                        "kernel": RUNGS[v].kernel, "flags": list(b_.flags)}
    return Result(rows, {"irregular_shape": [m_i, n_i, k_i], "irregular_checks": irregular,
                         "naive_max_n": params["naive_max_n"], "build": {"resources": resources}})


EXERCISE = Exercise(
    id="phase2.matmul", title="CUDA matmul ladder: naive to warp-tiled fp32, mma.sync and wgmma+TMA bf16, vs cuBLAS",
    run=run, needs=Needs(cuda=True, nvidia=True, tools=("nvcc",)),
    params={"sizes": Int([1024, 2048, 4096, 8192], min=1, max=MAX_N, unit="N of an N x N x N product", many=True),
            "naive_max_n": Int(8192, min=0, unit="largest N the naive rung is timed at"),
            "irregular_shape": Int([1000, 777, 555], min=1, max=INT32_MAX, length=3,
                                   unit="M, N, K of the bounds check (checked, not timed)"),
            "shapes": Shapes()},
    cpu_params={}, quick_params={"sizes": [256], "irregular_shape": [100, 77, 55]},
    variants=(*VARIANTS, *BASELINES), footprint_bytes=footprint_bytes, work=work)


if __name__ == "__main__":
    # N = 520: no tile multiple, but a multiple of 8 (the TMA rungs' 16-byte rows).
    run_alone(EXERCISE, {"sizes": [520], "irregular_shape": [100, 77, 55]})
