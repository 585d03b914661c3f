"""Exercise 3.3: a tiled, autotuned Triton matmul against cuBLAS, fp16 and bf16, N = 1024 to 8192.

    lab run phase3.matmul [--param sizes=[8192] --param dtypes=[bf16]]

C = A @ B (N x N) costs 2 N^3 FLOPs and must move 3 N^2 x 2 bytes: intensity N/3 FLOP/byte, far
right of the ridge. Keeping the tensor cores fed is a data-movement problem one level down:
* Tiling: a BLOCK_M x BLOCK_N tile of C per program, walking K in BLOCK_K steps; each element
  loaded is used 2·BLOCK_M·BLOCK_N / (BLOCK_M + BLOCK_N) times, which is still left of a Hopper's
  ridge from HBM, so most tiles must come from L2.
* Grouped program order (GROUP_M): concurrent programs share A and B tiles, so L2 serves the re-reads.
* Pipelining (num_stages): the loads of the next K steps are in flight while the tensor cores work.
* TMA and persistence (`triton_tma`): hardware tile copies from a descriptor, bounds-checked, no
  address math or masks; one program per SM loops over tiles, overlapping a tile's epilogue with
  the next tile's loads.
Both kernels are autotuned in the run (_support.tune); the record keeps every candidate's time.
"""
import torch

from common.checks import CHECK_CHUNK, TORCH_DTYPES
from common.exercise import Exercise, Needs, Result, Work, measure, reference_check
from common.params import Bool, Choice, Int
from common.standalone import run_alone
from common.triton_shim import ensure_allocator, interpreting, require, sm_count, tl, triton
from common.triton_tuner import label, launch_options, tune, tuning_summary
from common.variant_rows import attempt, compare_to_library, skipped

from . import counts


# ------------------------------------------------------------------------------ kernels
@triton.jit
def tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M tile rows go down one column band together before moving right."""
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (tile // tiles_per_group) * GROUP_M
    rows_here = min(num_pid_m - first_m, GROUP_M)           # the last group may be shorter
    pid_m = first_m + (tile % tiles_per_group) % rows_here
    pid_n = (tile % tiles_per_group) // rows_here
    return pid_m, pid_n


@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                  stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  EVEN_MN: tl.constexpr, EVEN_K: tl.constexpr):
    """One BLOCK_M x BLOCK_N tile of C per program. EVEN_* drop the masks when the tiles divide
    the matrix exactly (every benchmark size); otherwise the edges and the K tail are masked."""
    pid_m, pid_n = tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)   # accumulate in fp32 whatever the inputs
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_MN and EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K                        # the K tail: zeros add nothing to the dot
            a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c = acc.to(c_ptr.dtype.element_ty)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    if EVEN_MN:
        tl.store(c_ptrs, c)
    else:
        tl.store(c_ptrs, c, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def matmul_tma_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      NUM_PROGRAMS: tl.constexpr, SPLIT_EPILOGUE: tl.constexpr,
                      FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Persistent: program p computes tiles p, p + NUM_PROGRAMS, ... Loads and stores go through
    TMA descriptors built on the device; out-of-range rows and columns read as zeros and are not
    written, so no masks. SPLIT_EPILOGUE stores C in two halves to halve its shared-memory buffer."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    if SPLIT_EPILOGUE:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N // 2])
    else:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS,
                         flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([off_m, ki * BLOCK_K])
            b = b_desc.load([ki * BLOCK_K, off_n])
            acc = tl.dot(a, b, acc)
        if SPLIT_EPILOGUE:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            c0, c1 = tl.split(halves)
            c_desc.store([off_m, off_n], c0.to(c_desc.dtype))
            c_desc.store([off_m, off_n + BLOCK_N // 2], c1.to(c_desc.dtype))
        else:
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


# ------------------------------------------------------------------------------ configs and wrappers
def _cfg(bm, bn, bk, warps, stages, **extra):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps,
            "num_stages": stages, **extra}


# Hopper-friendly tiles: 128-row tiles for the 4-warp wgmma groups, BLOCK_K 64 (128 bytes of
# fp16/bf16: one TMA/swizzle line), 3-4 stages so loads run ahead of the tensor cores.
CONFIGS = [_cfg(128, 256, 64, 8, 3), _cfg(128, 128, 64, 8, 4), _cfg(128, 128, 64, 4, 4), _cfg(64, 128, 64, 4, 4)]
TMA_CONFIGS = [_cfg(128, 256, 64, 8, 3, split=True, flatten=True, ws=False),
               _cfg(128, 128, 64, 8, 4, split=False, flatten=True, ws=False)]
# Hopper warp specialization: with num_warps=4 Triton 3.6 builds one producer warp group (TMA
# loads) and two consumer warp groups (wgmma), 12 warps in all. It does not apply to a flattened
# loop nest, and the split epilogue makes the compiler fail, hence these settings.
WS_CONFIGS = [_cfg(128, 256, 64, 4, 3, split=False, flatten=False, ws=True),
              _cfg(128, 128, 64, 4, 4, split=False, flatten=False, ws=True)]
INTERPRETER_CONFIG = _cfg(64, 64, 32, 4, 1)
INTERPRETER_TMA_CONFIG = _cfg(32, 32, 32, 4, 1, split=True, flatten=True, ws=False)


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, config: dict | None = None):
    """C = A @ B for 2-D tensors of one dtype (any strides), accumulated in fp32."""
    require(a, b)
    assert a.ndim == b.ndim == 2 and a.shape[1] == b.shape[0] and a.dtype == b.dtype
    (M, K), N = a.shape, b.shape[1]
    out = torch.empty((M, N), device=a.device, dtype=a.dtype) if out is None else out
    cfg = config or (INTERPRETER_CONFIG if interpreting() else CONFIGS[0])
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    matmul_kernel[grid](a, b, out, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                        out.stride(0), out.stride(1),
                        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
                        EVEN_MN=M % cfg["BLOCK_M"] == 0 and N % cfg["BLOCK_N"] == 0, EVEN_K=K % cfg["BLOCK_K"] == 0,
                        **launch_options(cfg))
    return out


def tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA needs row-major tensors with 16-byte aligned rows and base addresses."""
    return all(t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
               and t.stride(0) == t.shape[1] for t in tensors)


def matmul_tma(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, config: dict | None = None):
    """C = A @ B through TMA descriptors in a persistent kernel (row-major, 16-byte aligned rows)."""
    require(a, b)
    assert a.ndim == b.ndim == 2 and a.shape[1] == b.shape[0] and a.dtype == b.dtype
    (M, K), N = a.shape, b.shape[1]
    out = torch.empty((M, N), device=a.device, dtype=a.dtype) if out is None else out
    if not tma_ok(a, b, out):
        raise ValueError("matmul_tma needs contiguous row-major tensors whose rows are multiples of 16 bytes")
    cfg = config or (INTERPRETER_TMA_CONFIG if interpreting() else TMA_CONFIGS[0])
    ensure_allocator(a.device)
    tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
    programs = min(sm_count(a.device), tiles)
    matmul_tma_kernel[(programs,)](a, b, out, M, N, K,
                                   BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                                   GROUP_M=cfg["GROUP_M"], NUM_PROGRAMS=programs, SPLIT_EPILOGUE=cfg["split"],
                                   FLATTEN=cfg["flatten"], WARP_SPECIALIZE=cfg["ws"], **launch_options(cfg))
    return out


# ------------------------------------------------------------------------------ reference and check
REFERENCE = "float64 matmul of the same inputs"


VARIANTS = ("cublas", "triton", "triton_tma")


def work(params) -> list[Work]:
    """Every row run() times: per dtype and N, cuBLAS and the two Triton kernels, one problem each."""
    return [Work(f"{variant} {dtype} n={n}", c.flops, c.bytes, c.dtype, launches=c.launches)
            for dtype in params["dtypes"] for n in params["sizes"] for c in [counts.matmul_count(n, n, n, dtype)]
            for variant in VARIANTS]


# ------------------------------------------------------------------------------ the exercise
MAX_N = 46340                      # N x N < 2^31: matmul_kernel's offsets (row x stride) are 32-bit


def footprint_bytes(p: dict) -> int:
    """A, B, C and the float64 reference at the largest size, plus the reference's float64 inputs or a check chunk."""
    n2 = max(p["sizes"]) ** 2
    itemsize = max(TORCH_DTYPES[d].itemsize for d in p["dtypes"])
    return 3 * itemsize * n2 + 8 * n2 + max(2 * 8 * n2, 3 * 8 * min(n2, CHECK_CHUNK))


def run(ctx, params):
    rows, tuning = [], {}
    work = [(n, d) for d in params["dtypes"] for n in params["sizes"]]
    for n, dtype in ctx.track(work, "matmul sizes"):
        t = TORCH_DTYPES[dtype]
        g = torch.Generator(device=ctx.device).manual_seed(n)
        a = torch.randn(n, n, device=ctx.device, generator=g).to(t)
        b = torch.randn(n, n, device=ctx.device, generator=g).to(t)
        c = torch.empty(n, n, device=ctx.device, dtype=t)
        ref = a.double() @ b.double()
        size = {"n": n, "dtype": dtype}
        mc = counts.matmul_count(n, n, n, dtype)      # one problem, one kernel per call, whatever the variant
        cost = {"flops": mc.flops, "bytes_moved": mc.bytes, "dtype": mc.dtype, "launches": mc.launches}
        here = []

        def check(fill):
            return reference_check(ctx, c, fill, ref, REFERENCE, precision=dtype)

        if ctx.wants("cublas"):
            here.append(attempt("cublas", size, lambda: measure(
                ctx, "cublas", size, fn=lambda: torch.matmul(a, b, out=c),
                check=check(lambda: torch.matmul(a, b, out=c)), **cost)))
        tma_cands = TMA_CONFIGS + (WS_CONFIGS if params.get("warp_specialize", True) else [])
        for variant, impl, cands in (("triton", matmul, [INTERPRETER_CONFIG] if interpreting() else CONFIGS),
                                     ("triton_tma", matmul_tma, [INTERPRETER_TMA_CONFIG] if interpreting() else tma_cands)):
            if not ctx.wants(variant):
                continue
            if variant == "triton_tma" and ctx.is_rocm:
                here.append(skipped(variant, size, "TMA descriptors are NVIDIA Hopper hardware; this is a ROCm GPU"))
                continue

            def triton_row(variant=variant, impl=impl, cands=cands):
                cfg, trials = tune(ctx, (variant, n, dtype, ctx.device.type), cands,
                                   launch=lambda k: impl(a, b, c, k),
                                   check=lambda k: check(lambda: impl(a, b, c, k))())
                tuning[f"{variant} {dtype} {n}"] = tuning_summary(trials)
                r = measure(ctx, variant, size, fn=lambda: impl(a, b, c, cfg),
                            check=check(lambda: impl(a, b, c, cfg)), **cost)
                r["metrics"]["config"] = label(cfg)
                return r

            here.append(attempt(variant, size, triton_row))
        compare_to_library(here, "triton", ("cublas",), "tflops")
        compare_to_library(here, "triton_tma", ("cublas",), "tflops")
        rows += here
    return Result(rows, {"tuning": tuning})


EXERCISE = Exercise(
    id="phase3.matmul", title="Tiled, autotuned Triton matmul (plain and TMA-persistent) vs cuBLAS, fp16 and bf16",
    run=run, needs=Needs(cuda=True, modules=("triton",)),
    params={"sizes": Int([1024, 2048, 4096, 8192], min=1, max=MAX_N, unit="N of an N x N x N product", many=True),
            "dtypes": Choice(["bf16", "fp16"], ("bf16", "fp16"), many=True),
            "warp_specialize": Bool(True, help="also tune the warp-specialized TMA configs")},
    cpu_params={"sizes": [256], "dtypes": ["fp16"]},
    quick_params={"sizes": [256], "dtypes": ["bf16"]},
    variants=VARIANTS, footprint_bytes=footprint_bytes, work=work)


if __name__ == "__main__":
    run_alone(EXERCISE, {"sizes": [200], "dtypes": ["fp16"]})
