"""Exercise 2.2: the matmul ladder in CUDA C, rung by rung, against cuBLAS in the same run.

    lab run phase2.matmul [--variant tiled] [--param sizes=[1024,2048,4096]]

C = A @ B, row-major, any M, N, K. Each rung is its own kernel in `matmul.cu`:

- `naive`: one thread per output, every operand from global memory (L2) each time.
- `tiled`: the seed's 16x16 shared-memory tiles; each element loaded once per block, not per thread.
- `coalesced_regblock`: 64x64 block tiles, each thread an 8x8 register tile; float4 loads (when K
  and N are multiples of 4) and 64 FMAs per 16 shared-memory loads.
- `mma_bf16`: bf16 inputs, fp32 accumulation, on tensor cores through the warp-level
  `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` (inline PTX).

Baselines, same inputs and same run: `cublas_fp32` (torch.matmul with TF32 off, so it does the
same fp32 arithmetic as the fp32 rungs) and `cublas_bf16` (torch.matmul on the bf16 inputs).
Each rung's `pct_of_library` is its TFLOP/s as a percentage of the cuBLAS row of the same size and
dtype (fp32 rungs against cublas_fp32, mma_bf16 against cublas_bf16).

Correctness gates timing: each variant is first checked against a float64 matmul of the same
inputs at an irregular shape (1000 x 777 x 555 by default: no dimension a multiple of any tile, so
every bounds check runs), then at the timed size; the fp32 rungs at the fp32 tolerance (below what
TF32 gives, so a silent TF32 path fails), mma_bf16 at the bf16 tolerance against the float64
product of its bf16-rounded inputs.

Sizes: square N = 1024, 2048, 4096; FLOPs 2N^3, fewest bytes 3 N^2 x itemsize. `naive` only up
to N = 2048 by default (`naive_max_n`): at 4096 it takes on the order of a second per call on an
H200 and teaches nothing the smaller sizes do not.
"""
import ctypes

import torch

from common.checks import compare, poison
from common.exercise import Exercise, Needs, measure

from . import build
from ._args import INT32_MAX, need_contiguous, need_dtype

SOURCE = "matmul.cu"
_SIG = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_void_p]
LAUNCHERS = {                      # variant -> (launcher, input dtype)
    "naive": ("launch_matmul_naive", torch.float32),
    "tiled": ("launch_matmul_tiled", torch.float32),
    "coalesced_regblock": ("launch_matmul_regblock", torch.float32),
    "mma_bf16": ("launch_matmul_mma_bf16", torch.bfloat16),
    # A deliberately wrong kernel, for the tests only: it skips the last K % 16 terms.
    "broken_skip_k_tail": ("launch_matmul_tiled_skip_k_tail", torch.float32),
}
VARIANTS = ("naive", "tiled", "coalesced_regblock", "mma_bf16")
KERNELS = {"naive": "matmul_naive", "tiled": "matmul_tiled", "coalesced_regblock": "matmul_regblock",
           "mma_bf16": "matmul_mma_bf16"}
SIGNATURES = {name: _SIG for name, _ in LAUNCHERS.values()}
BASELINES = ("cublas_fp32", "cublas_bf16")
PRECISION = {"naive": "fp32", "tiled": "fp32", "coalesced_regblock": "fp32", "mma_bf16": "bf16",
             "broken_skip_k_tail": "fp32"}
LIBRARY_FOR = {"naive": "cublas_fp32", "tiled": "cublas_fp32", "coalesced_regblock": "cublas_fp32",
               "mma_bf16": "cublas_bf16"}


def matmul(a: torch.Tensor, b: torch.Tensor, variant: str = "tiled", out: torch.Tensor | None = None) -> torch.Tensor:
    """C = a @ b with one of the CUDA kernels; fp32 output (for mma_bf16 too: fp32 accumulators)."""
    if variant not in LAUNCHERS:
        raise ValueError(f"unknown matmul variant '{variant}'; choose from {', '.join(VARIANTS)}")
    launcher, dtype = LAUNCHERS[variant]
    need_dtype("a", a, dtype)
    need_dtype("b", b, dtype)
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D, got {a.dim()}-D and {b.dim()}-D")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    M, K = a.shape
    N = b.shape[1]
    if out is not None:
        need_dtype("out", out, torch.float32)
        if tuple(out.shape) != (M, N):
            raise ValueError(f"out must be {(M, N)}, got {tuple(out.shape)}")
        need_contiguous("out", out)
    need_contiguous("a", a)
    need_contiguous("b", b)
    if max(M * K, K * N, M * N) > INT32_MAX:
        raise ValueError("each matrix must have fewer than 2^31 elements (the kernels index with int)")
    out = torch.empty(M, N, device=a.device, dtype=torch.float32) if out is None else out
    build.require_gpu(a, b, out)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    lib, _ = build.load(SOURCE, SIGNATURES)
    with torch.cuda.device(a.device):
        code = getattr(lib, launcher)(build.ptr(a), build.ptr(b), build.ptr(out), M, N, K,
                                      build.stream(a.device))
    build.check(lib, code, f"matmul {variant} launch")
    return out


# ------------------------------------------------------------------------------ checks
def operands(m: int, n: int, k: int, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(m, k, device=device, generator=g), torch.randn(k, n, device=device, generator=g))


def check_variant(variant: str, a32: torch.Tensor, b32: torch.Tensor, out: torch.Tensor,
                  ref64: torch.Tensor | None = None) -> dict:
    """Poison `out`, run the variant on (a32, b32) (cast to bf16 for mma_bf16), compare with float64."""
    dtype = LAUNCHERS[variant][1]
    a, b = a32.to(dtype), b32.to(dtype)
    if ref64 is None:
        ref64 = a.double() @ b.double()
    poison(out)
    matmul(a, b, variant, out)
    torch.cuda.synchronize(out.device)
    what = "float64 matmul of the same " + ("bf16-rounded inputs" if dtype == torch.bfloat16 else "inputs")
    return compare(out, ref64, PRECISION[variant], what)


class _NoTF32:
    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.saved


# ------------------------------------------------------------------------------ the exercise
def run(ctx, params):
    m_i, n_i, k_i = params["irregular_shape"]
    ia, ib = operands(m_i, n_i, k_i, ctx.device, seed=1)
    irregular_out = torch.empty(m_i, n_i, device=ctx.device)
    irregular = {}
    wanted = [v for v in VARIANTS if ctx.wants(v)]
    with _NoTF32():
        for v in wanted:
            irregular[v] = check_variant(v, ia, ib, irregular_out)
    del ia, ib, irregular_out

    rows = []
    with _NoTF32():
        for n in ctx.track(params["sizes"], "matmul sizes"):
            a32, b32 = operands(n, n, n, ctx.device, seed=n)
            a16, b16 = a32.bfloat16(), b32.bfloat16()
            out = torch.empty(n, n, device=ctx.device)
            out16 = torch.empty(n, n, device=ctx.device, dtype=torch.bfloat16)
            refs = {}

            def ref(kind):
                if kind not in refs:
                    refs[kind] = (a32.double() @ b32.double()) if kind == "fp32" else (a16.double() @ b16.double())
                return refs[kind]

            here = {}
            lib_needed = {LIBRARY_FOR[v] for v in wanted} | {b for b in BASELINES if ctx.wants(b)}
            for base in BASELINES:
                if base not in lib_needed:
                    continue
                x, y, o, prec = (a32, b32, out, "fp32") if base == "cublas_fp32" else (a16, b16, out16, "bf16")

                def fn(x=x, y=y, o=o):
                    torch.matmul(x, y, out=o)

                def check(fn=fn, o=o, prec=prec):
                    poison(o); fn(); ctx.synchronize()
                    return compare(o, ref(prec), prec, f"float64 matmul of the same {prec} inputs")

                here[base] = measure(ctx, base, _size(n, prec, base), fn=fn, check=check, flops=2 * n**3,
                                     bytes_moved=3 * n * n * o.element_size(), dtype=prec)
            for v in wanted:
                size = _size(n, PRECISION[v], v)
                if v == "naive" and n > params["naive_max_n"]:
                    continue
                x, y = (a16, b16) if v == "mma_bf16" else (a32, b32)

                def fn(v=v, x=x, y=y):
                    matmul(x, y, v, out)

                def check(v=v):
                    if not irregular[v]["passed"]:
                        return {**irregular[v], "reason": f"at {m_i}x{n_i}x{k_i}: {irregular[v]['reason']}"}
                    return check_variant(v, a32, b32, out, ref(PRECISION[v]))

                r = measure(ctx, v, size, fn=fn, check=check, flops=2 * n**3,
                            bytes_moved=n * n * (2 * x.element_size() + 4), dtype=PRECISION[v])
                lib_row = here.get(LIBRARY_FOR[v])
                if r["status"] == "ok" and lib_row and lib_row["status"] == "ok":
                    r["metrics"]["library"] = LIBRARY_FOR[v]
                    r["metrics"]["library_tflops_same_run"] = lib_row["metrics"]["tflops"]
                    r["metrics"]["pct_of_library"] = 100 * r["metrics"]["tflops"] / lib_row["metrics"]["tflops"]
                here[v] = r
            rows += [here[k] for k in (*BASELINES, *VARIANTS) if k in here]
            del a32, b32, a16, b16, out, out16, refs
    _, b_ = build.load(SOURCE, SIGNATURES)
    summary = {"irregular_shape": [m_i, n_i, k_i], "irregular_checks": irregular,
               "naive_max_n": params["naive_max_n"],
               "build": {"arch": b_.arch, "flags": list(b_.flags),
                         "resources": {v: b_.resources.get(KERNELS[v]) for v in VARIANTS}}}
    return rows, summary


def _size(n: int, dtype: str, variant: str) -> dict:
    return {"m": n, "n": n, "k": n, "dtype": dtype}


EXERCISE = Exercise(
    id="phase2.matmul", title="CUDA matmul ladder: naive, tiled, register-blocked, mma.sync bf16 vs cuBLAS",
    run=run, needs=Needs(cuda=True, tools=("nvcc",)),
    params={"sizes": [1024, 2048, 4096], "naive_max_n": 2048, "irregular_shape": [1000, 777, 555]},
    cpu_params={}, quick_params={"sizes": [256], "irregular_shape": [100, 77, 55]},
    variants=(*VARIANTS, *BASELINES))
