"""Exercise 2.2: the matmul ladder in CUDA C, rung by rung, against cuBLAS in the same run.

    lab run phase2.matmul [--variant tiled] [--param sizes=[1024,2048,4096,8192]]

C = A @ B, row-major, any M, N, K. Each rung is its own kernel in `matmul.cu`:

- `naive`: one thread per output, every operand from global memory (L2) each time.
- `tiled`: the seed's 16x16 shared-memory tiles; each element loaded once per block, not per thread.
- `regblock_1d`: 1D register blocking (64x64 tiles, BK = 8, 512 threads): each thread a column of
  8 outputs, so one B value in a register feeds 8 FMAs and the 8 A values are warp-wide broadcasts
  (the compiler reads them as float4s): 24 shared-load instructions per 64 FMAs instead of 128.
- `coalesced_regblock`: 64x64 block tiles, each thread an 8x8 register tile; float4 loads (when K
  and N are multiples of 4) and 64 FMAs per 16 shared-memory loads.
- `warptiled_1stage`: the CUDA-core kernel around the same 8x8 thread tile: 128x128 block tiles of
  256 threads (two blocks per SM, <= 128 registers), BK = 8, warp tiles of 32x64 with 4x4
  sub-blocks and interleaved lanes so each float4 fragment load is a conflict-free broadcast the
  shared-memory pipe serves in 2 wavefronts instead of 4, A transposed into rows padded to 132
  floats (conflict-free transposing stores), float4 global loads (scalar kernel when unaligned).
- `warptiled`: the same block tile, lane layout and shared layout, fed by `cp.async` into a 3-stage
  ring (24,960 B, no staging registers; each 4-byte A copy writes its element transposed), and an
  8x16 thread tile over 128 threads (0.047 shared loads per FFMA instead of 0.0625; <= 255
  registers, two blocks per SM). One `__syncthreads` per tile, placed before the last k step so the
  next tile's first fragments load across it; 32-bit offsets. The fp32 rung meant to reach 90% of
  `cublas_fp32`; chosen over two other cp.async variants by measurement (see the README).
- `mma_bf16`: bf16 inputs, fp32 accumulation, on tensor cores through the warp-level
  `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` (inline PTX).
- `mma_bf16_pipelined` (`matmul_mma.cu`): the same instruction fed like an Ampere-class GEMM:
  128x256 block tiles of 8 warps (64x64 each), `cp.async` 16-byte copies into a 3-4 stage ring of
  XOR-swizzled 48 KB tiles (BK = 64), `ldmatrix.x4` (`.trans` for the row-major B) into
  double-buffered fragments, a grouped block order for L2; bf16 output like `cublas_bf16`.
  Unaligned operands (K or N not a multiple of 8, or views off 16 bytes) take a scalar-load
  variant of the same kernel. `MMA_SYNC_CAP_NOTE` (stored in the record's summary) says why
  mma.sync cannot reach the Hopper tensor-core peak that `wgmma` reaches.
- `wgmma_tma` (`matmul_wgmma.cu`, Hopper sm_90a only): one CTA of two warpgroups per 128x128 tile
  of C; TMA (the bulk tensor copy engine) loads 128B-swizzled 128x64 tiles of A and of B (B
  column-major, K contiguous) into a 3-stage shared-memory ring guarded by full/empty mbarriers,
  and each warpgroup runs `wgmma.mma_async` m64n128k16 straight from shared memory (no fragments
  in registers but the fp32 accumulators). bf16 output, like the `cublas_bf16_nt` row it races.
- `wgmma_tma_ws`: the same engines, warp-specialized and persistent: one CTA per SM walks 128x256
  tiles in a grouped, L2-friendly order; a producer warpgroup (one thread issuing TMA,
  `setmaxnreg` down to 40 registers) keeps a 4-stage ring of 48 KB full while two consumer
  warpgroups (232 registers each) run m64n256k16 with one wgmma batch kept in flight, and store
  one tile while the producer already loads the next.
- `wgmma_tma_ws_tma_store`: `wgmma_tma_ws` with a different epilogue. Instead of 4-byte stores
  straight from registers (half-used sectors, 64 KB per tile, tensor cores idle meanwhile), each
  consumer warp converts its 16 x 256 slice to bf16 into a private, 128B-swizzled 4 KB of shared
  memory (two 16 x 64 boxes, alternating) and lane 0 hands each box to a TMA store, which clips at
  the matrix edge and completes in the background while the warp starts the next tile's wgmma.
  N % 8 != 0 (rows not 16-byte aligned) falls back to the register epilogue.
- `wgmma_tma_ws_cluster`: `wgmma_tma_ws` in clusters of 2 CTAs along M, each loading its own A and
  multicasting half of B to both (TMA multicast), which cuts L2-to-SM traffic per k-tile from 48
  to 32 KB. Kept as a rung because the measurement says whether clusters pay here.

Baselines, same inputs and same run: `cublas_fp32` (torch.matmul with TF32 off, so it does the
same fp32 arithmetic as the fp32 rungs) and `cublas_bf16` (torch.matmul on the bf16 inputs);
`cublas_bf16_nt` is the same with B stored column-major, the storage the wgmma rungs read.
Each rung's `pct_of_library` is its TFLOP/s as a percentage of the cuBLAS row of the same size and
dtype (fp32 rungs against cublas_fp32, the mma rungs against cublas_bf16, the wgmma rungs
against cublas_bf16_nt).

Correctness gates timing: each variant is first checked against a float64 matmul of the same
inputs at an irregular shape (1000 x 777 x 555 by default: no dimension a multiple of any tile, so
every bounds check runs), then at the timed size; the fp32 rungs at the fp32 tolerance (below what
TF32 gives, so a silent TF32 path fails), the bf16 rungs at the bf16 tolerance against the
float64 product of their bf16-rounded inputs. The TMA rungs need K a multiple of 8 (16-byte row
pitch): they are checked at the irregular shape with K trimmed to 552.

Sizes: square N = 1024, 2048, 4096, 8192; FLOPs 2N^3, fewest bytes N^2 x (2 x input itemsize +
output itemsize). Every rung runs at every size (`naive_max_n` can cap the slowest).
"""
import ctypes
from dataclasses import dataclass

import torch

from common.checks import CHECK_CHUNK, compare, poison
from common.errors import LabError
from common.exercise import Exercise, Needs, measure, row
from common.params import Int

from . import build
from ._args import INT32_MAX, need_contiguous, need_dtype

@dataclass(frozen=True)
class Rung:
    """One kernel of the ladder and how to call it."""
    source: str                    # the .cu file
    launcher: str                  # extern "C" int launcher(A, B, C, M, N, K, stream)
    kernel: str                    # the __global__ function, for the ptxas report
    dtype: torch.dtype             # input dtype (A and B)
    out_dtype: torch.dtype         # C's dtype
    library: str                   # the cuBLAS row of the same run it is a percentage of
    b_layout: str = "row"          # "row": B is K x N row-major; "col": B column-major (K contiguous)
    k_multiple: int = 1            # K must be a multiple of this (TMA: 16-byte row pitch)
    min_capability: tuple = (8, 0)  # the oldest GPU it runs on
    arch_specific: bool = False    # built for sm_90a: runs on compute capability 9.0 only
    test_only: bool = False        # deliberately wrong kernels, for the checker's own tests
    base: str | None = None        # the rung it modifies, when that is not the rung listed before it

    @property
    def precision(self) -> str:
        return "bf16" if self.dtype == torch.bfloat16 else "fp32"


MMA_SYNC_CAP_NOTE = (
    "mma.sync.m16n8k16 is Ampere's warp-level, synchronous tensor-core instruction: operands come "
    "from registers (loaded from shared memory by each warp with ldmatrix). Hopper reaches its "
    "tensor-core peak through wgmma instead (warpgroup-level, asynchronous, B and optionally A read "
    "from shared memory by descriptor, m64nNk16 with N up to 256). Arithmetic for H100/H200 SXM: "
    "989 dense BF16 TFLOP/s = 132 SMs x 4096 FLOP/clock x 1.83 GHz, so each of an SM's 4 schedulers "
    "would have to issue one m16n8k16 (2048 multiply-adds) every 4 clocks, operands through the "
    "register file, besides the ldmatrix, cp.async, address and barrier instructions that feed it. "
    "Shared memory, about 33 TB/s for 132 SMs (~128 B/clock/SM), caps it too: with 128x256 block "
    "tiles and 64x64 warp tiles each k16 step moves 32 KB by ldmatrix plus 12 KB by cp.async per "
    "524,288 multiply-adds, 352 clocks of shared memory against 256 clocks of tensor math at peak, "
    "so at most 73% of peak even with perfect overlap (the 33 TB/s shared-memory figure is Hazy "
    "Research's, 'GPUs Go Brrr', 2024-05-12). Public measurements: FlashAttention-3 (Shah et al., arXiv:2407.08608) reports "
    "FlashAttention-2, built on mma.sync, at 35% H100 utilization against 75% with wgmma, TMA and "
    "asynchrony; Luo et al., 'Benchmarking and Dissecting the Nvidia Hopper GPU Architecture' "
    "(arXiv:2402.13499) conclude that the fourth-generation tensor cores reach their throughput "
    "only through wgmma.")

F32, BF16 = torch.float32, torch.bfloat16
RUNGS = {
    "naive": Rung("matmul.cu", "launch_matmul_naive", "matmul_naive", F32, F32, "cublas_fp32"),
    "tiled": Rung("matmul.cu", "launch_matmul_tiled", "matmul_tiled", F32, F32, "cublas_fp32"),
    "regblock_1d": Rung("matmul.cu", "launch_matmul_regblock_1d", "matmul_regblock_1d", F32, F32, "cublas_fp32"),
    "coalesced_regblock": Rung("matmul.cu", "launch_matmul_regblock", "matmul_regblock", F32, F32, "cublas_fp32"),
    "warptiled_1stage": Rung("matmul.cu", "launch_matmul_warptiled_1stage", "matmul_warptiled_1stage", F32, F32,
                             "cublas_fp32"),
    "warptiled": Rung("matmul.cu", "launch_matmul_warptiled", "matmul_warptiled", F32, F32, "cublas_fp32"),
    "mma_bf16": Rung("matmul_mma.cu", "launch_matmul_mma_bf16", "matmul_mma_bf16", BF16, F32, "cublas_bf16"),
    "mma_bf16_pipelined": Rung("matmul_mma.cu", "launch_matmul_mma_bf16_pipelined", "matmul_mma_bf16_pipelined",
                               BF16, BF16, "cublas_bf16"),
    # Hopper (sm_90a): TMA + wgmma, B column-major (K-major, as wgmma reads it), bf16 out like cuBLAS.
    "wgmma_tma": Rung("matmul_wgmma.cu", "launch_matmul_wgmma_tma", "matmul_wgmma_tma", BF16, BF16,
                      "cublas_bf16_nt", b_layout="col", k_multiple=8, min_capability=(9, 0), arch_specific=True),
    "wgmma_tma_ws": Rung("matmul_wgmma.cu", "launch_matmul_wgmma_tma_ws", "matmul_wgmma_tma_ws", BF16, BF16,
                         "cublas_bf16_nt", b_layout="col", k_multiple=8, min_capability=(9, 0),
                         arch_specific=True),
    # The same with the epilogue through shared memory and TMA stores, off the tensor cores' path.
    "wgmma_tma_ws_tma_store": Rung("matmul_wgmma.cu", "launch_matmul_wgmma_tma_ws_tma_store",
                                   "matmul_wgmma_tma_ws_tma_store", BF16, BF16, "cublas_bf16_nt", b_layout="col",
                                   k_multiple=8, min_capability=(9, 0), arch_specific=True),
    # wgmma_tma_ws with clusters of 2 CTAs sharing B through TMA multicast: measured, it does not pay here.
    "wgmma_tma_ws_cluster": Rung("matmul_wgmma.cu", "launch_matmul_wgmma_tma_ws_cluster", "matmul_wgmma_tma_ws_cluster",
                                 BF16, BF16, "cublas_bf16_nt", b_layout="col", k_multiple=8, min_capability=(9, 0),
                                 arch_specific=True, base="wgmma_tma_ws"),
    # A deliberately wrong kernel, for the tests only: it skips the last K % 16 terms.
    "broken_skip_k_tail": Rung("matmul.cu", "launch_matmul_tiled_skip_k_tail", "matmul_tiled", F32, F32,
                               "cublas_fp32", test_only=True),
}
VARIANTS = tuple(k for k, r in RUNGS.items() if not r.test_only)
# cuBLAS through torch, same inputs, same run: fp32 with TF32 off (the same arithmetic as the fp32
# rungs); bf16 with B row-major; bf16 with B column-major (the storage the "col" rungs read).
BASELINES = ("cublas_fp32", "cublas_bf16", "cublas_bf16_nt")
_SIG = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_void_p]


def signatures(source: str) -> dict:
    return {r.launcher: _SIG for r in RUNGS.values() if r.source == source}


def column_major(b: torch.Tensor) -> torch.Tensor:
    """The same K x N matrix stored column-major (K contiguous): what the "col" rungs read."""
    return b.t().contiguous().t()


def matmul(a: torch.Tensor, b: torch.Tensor, variant: str = "tiled", out: torch.Tensor | None = None) -> torch.Tensor:
    """C = a @ b with one of the CUDA kernels (a: M x K, b: K x N); C's dtype is the rung's
    `out_dtype`. Rungs with b_layout "col" need b column-major: pass `column_major(b)`."""
    rung = RUNGS.get(variant)
    if rung is None:
        raise ValueError(f"unknown matmul variant '{variant}'; choose from {', '.join(VARIANTS)}")
    need_dtype("a", a, rung.dtype)
    need_dtype("b", b, rung.dtype)
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D, got {a.dim()}-D and {b.dim()}-D")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    M, K = a.shape
    N = b.shape[1]
    if out is not None:
        need_dtype("out", out, rung.out_dtype)
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
    out = torch.empty(M, N, device=a.device, dtype=rung.out_dtype) if out is None else out
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
def operands(m: int, n: int, k: int, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(m, k, device=device, generator=g), torch.randn(k, n, device=device, generator=g))


def check_variant(variant: str, a32: torch.Tensor, b32: torch.Tensor, out: torch.Tensor | None = None,
                  ref64: torch.Tensor | None = None) -> dict:
    """Poison `out`, run the variant on (a32, b32) cast to its dtype (b in its layout), compare with
    the float64 product of the same (rounded) inputs."""
    rung = RUNGS[variant]
    a, b = a32.to(rung.dtype), b32.to(rung.dtype)
    if ref64 is None:
        ref64 = a.double() @ b.double()
    if rung.b_layout == "col":
        b = column_major(b)
    if out is None or out.dtype != rung.out_dtype:
        out = torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=rung.out_dtype)
    poison(out)
    matmul(a, b, variant, out)
    torch.cuda.synchronize(out.device)
    what = "float64 matmul of the same " + ("bf16-rounded inputs" if rung.dtype == BF16 else "inputs")
    return compare(out, ref64, rung.precision, what)


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
    """fp32/bf16 operands, outputs and float64 references at the largest size, plus a check's temporaries."""
    n2 = max(n * n for n in p["sizes"])
    held = (2 * 4 + 3 * 2 + 4 + 2) * n2            # a32, b32; a16, b16, b16 column-major; fp32 and bf16 C
    refs = 2 * 8 * n2                              # the fp32 and the bf16 float64 products
    check = 3 * 2 * n2 + 3 * 8 * min(n2, CHECK_CHUNK)   # a bf16 rung's rounded copies, one float64 chunk
    sweep = held + refs + max(check, 2 * 8 * n2)   # or: the float64 A and B a reference is built from
    m, n, k = p["irregular_shape"]                 # fp32 operands and trimmed copies, bf16 copies, float64
    irregular = 24 * (m * k + k * n) + 12 * m * n + 3 * 8 * min(m * n, CHECK_CHUNK)   # A, B, C and reference
    return max(sweep, irregular)


def run(ctx, params):
    wanted = [v for v in VARIANTS if ctx.wants(v)]
    m_i, n_i, k_i = params["irregular_shape"]
    ia, ib = operands(m_i, n_i, k_i, ctx.device, seed=1)
    irregular = {}
    with _NoTF32():
        for v in wanted:
            if runnable(v, ctx.device) is None:
                # TMA rungs need K a multiple of 8: check them at the largest such K below k_i.
                k_v = k_i - k_i % RUNGS[v].k_multiple
                irregular[v] = check_variant(v, ia[:, :k_v].contiguous(), ib[:k_v].contiguous())
                irregular[v]["shape"] = [m_i, n_i, k_v]
    del ia, ib

    rows = []
    with _NoTF32():
        for n in ctx.track(params["sizes"], "matmul sizes"):
            a32, b32 = operands(n, n, n, ctx.device, seed=n)
            a16, b16 = a32.bfloat16(), b32.bfloat16()
            b16_col = column_major(b16)
            outs = {F32: torch.empty(n, n, device=ctx.device), BF16: torch.empty(n, n, device=ctx.device, dtype=BF16)}
            refs = {}

            def ref(precision):
                if precision not in refs:
                    refs[precision] = (a32.double() @ b32.double()) if precision == "fp32" else (a16.double() @ b16.double())
                return refs[precision]

            here = {}
            lib_needed = {RUNGS[v].library for v in wanted} | {b for b in BASELINES if ctx.wants(b)}
            baseline_args = {"cublas_fp32": (a32, b32, outs[F32], "fp32"), "cublas_bf16": (a16, b16, outs[BF16], "bf16"),
                             "cublas_bf16_nt": (a16, b16_col, outs[BF16], "bf16")}
            for base in BASELINES:
                if base not in lib_needed:
                    continue
                x, y, o, prec = baseline_args[base]

                def fn(x=x, y=y, o=o):
                    torch.matmul(x, y, out=o)

                def check(fn=fn, o=o, prec=prec):
                    poison(o); fn(); ctx.synchronize()
                    return compare(o, ref(prec), prec, f"float64 matmul of the same {prec} inputs")

                size = {"m": n, "n": n, "k": n, "dtype": prec, "b_layout": "col" if base.endswith("_nt") else "row"}
                here[base] = measure(ctx, base, size, fn=fn, check=check, flops=2 * n**3,
                                     bytes_moved=n * n * (2 * x.element_size() + o.element_size()), dtype=prec)
            for v in wanted:
                rung = RUNGS[v]
                if v == "naive" and n > params["naive_max_n"]:
                    continue
                size = {"m": n, "n": n, "k": n, "dtype": rung.precision, "b_layout": rung.b_layout}
                why_not = runnable(v, ctx.device)
                if why_not:
                    here[v] = row(v, size, "skipped", why_not)
                    continue
                x, y = (a16, b16) if rung.dtype == BF16 else (a32, b32)
                y = column_major(y) if rung.b_layout == "col" else y
                out = outs[rung.out_dtype]

                def fn(v=v, x=x, y=y, out=out):
                    matmul(x, y, v, out)

                def check(v=v, out=out):
                    if not irregular[v]["passed"]:
                        return {**irregular[v], "reason": f"at {irregular[v]['shape']}: {irregular[v]['reason']}"}
                    return check_variant(v, a32, b32, out, ref(RUNGS[v].precision))

                r = measure(ctx, v, size, fn=fn, check=check, flops=2 * n**3,
                            bytes_moved=n * n * (2 * x.element_size() + out.element_size()), dtype=rung.precision)
                lib_row = here.get(rung.library)
                if r["status"] == "ok" and lib_row and lib_row["status"] == "ok":
                    r["metrics"]["library"] = rung.library
                    r["metrics"]["library_tflops_same_run"] = lib_row["metrics"]["tflops"]
                    r["metrics"]["pct_of_library"] = 100 * r["metrics"]["tflops"] / lib_row["metrics"]["tflops"]
                here[v] = r
            rows += [here[k] for k in (*BASELINES, *VARIANTS) if k in here]
            del a32, b32, a16, b16, b16_col, outs, refs
    resources = {}
    for v in wanted:
        b_ = build.load(RUNGS[v].source, signatures(RUNGS[v].source))[1]
        resources[v] = {**(b_.resources.get(RUNGS[v].kernel) or {}), "source": RUNGS[v].source, "arch": b_.arch,
                        "kernel": RUNGS[v].kernel, "flags": list(b_.flags)}
    summary = {"irregular_shape": [m_i, n_i, k_i], "irregular_checks": irregular,
               "naive_max_n": params["naive_max_n"], "build": {"resources": resources}}
    if any(RUNGS[v].source == "matmul_mma.cu" for v in wanted):
        summary["why_mma_sync_caps"] = MMA_SYNC_CAP_NOTE
    return rows, summary


EXERCISE = Exercise(
    id="phase2.matmul", title="CUDA matmul ladder: naive to warp-tiled fp32, mma.sync and wgmma+TMA bf16, vs cuBLAS",
    run=run, needs=Needs(cuda=True, tools=("nvcc",)),
    params={"sizes": Int([1024, 2048, 4096, 8192], min=1, max=MAX_N, unit="N of an N x N x N product", many=True),
            "naive_max_n": Int(8192, min=0, unit="largest N the naive rung is timed at"),
            "irregular_shape": Int([1000, 777, 555], min=1, max=INT32_MAX, length=3,
                                   unit="M, N, K of the bounds check (checked, not timed)")},
    cpu_params={}, quick_params={"sizes": [256], "irregular_shape": [100, 77, 55]},
    variants=(*VARIANTS, *BASELINES), footprint_bytes=footprint_bytes)
