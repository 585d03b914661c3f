"""The matmul ladder's rungs as data: which kernel each is, what it reads and writes, which cuBLAS
row of the same run it is measured against, and which rung it builds on. Torch-free, so the report
(which must not import torch) and matmul.py (which launches the kernels) read the same table."""
from dataclasses import dataclass


@dataclass(frozen=True)
class Rung:
    """One kernel of the ladder and how to call it."""
    source: str                    # the .cu file
    launcher: str                  # extern "C" int launcher(A, B, C, M, N, K, stream)
    kernel: str                    # the __global__ function, for the ptxas report
    precision: str                 # A and B: "fp32" or "bf16"
    out_precision: str             # C
    library: str                   # the cuBLAS row of the same run it is a percentage of
    b_layout: str = "row"          # "row": B is K x N row-major; "col": B column-major (K contiguous)
    k_multiple: int = 1            # K must be a multiple of this (TMA: 16-byte row pitch)
    min_capability: tuple = (8, 0)  # the oldest GPU it runs on
    arch_specific: bool = False    # built for sm_90a: runs on compute capability 9.0 only
    test_only: bool = False        # deliberately wrong kernels, for the checker's own tests
    base: str | None = None        # the rung it modifies, when that is not the rung listed before it


def _fp32(launcher: str, kernel: str, **kw) -> Rung:
    return Rung("matmul.cu", launcher, kernel, "fp32", "fp32", "cublas_fp32", **kw)


def _wgmma(name: str, **kw) -> Rung:
    # Hopper (sm_90a): TMA + wgmma, B column-major (K-major, as wgmma reads it), bf16 out like cuBLAS.
    return Rung("matmul_wgmma.cu", f"launch_matmul_{name}", f"matmul_{name}", "bf16", "bf16", "cublas_bf16_nt",
                b_layout="col", k_multiple=8, min_capability=(9, 0), arch_specific=True, **kw)


RUNGS = {
    "naive": _fp32("launch_matmul_naive", "matmul_naive"),
    "tiled": _fp32("launch_matmul_tiled", "matmul_tiled"),
    "regblock_1d": _fp32("launch_matmul_regblock_1d", "matmul_regblock_1d"),
    "coalesced_regblock": _fp32("launch_matmul_regblock", "matmul_regblock"),
    "warptiled_1stage": _fp32("launch_matmul_warptiled_1stage", "matmul_warptiled_1stage"),
    "warptiled": _fp32("launch_matmul_warptiled", "matmul_warptiled"),
    "mma_bf16": Rung("matmul_mma.cu", "launch_matmul_mma_bf16", "matmul_mma_bf16", "bf16", "fp32", "cublas_bf16"),
    "mma_bf16_pipelined": Rung("matmul_mma.cu", "launch_matmul_mma_bf16_pipelined", "matmul_mma_bf16_pipelined",
                               "bf16", "bf16", "cublas_bf16"),
    "wgmma_tma": _wgmma("wgmma_tma"),
    "wgmma_tma_ws": _wgmma("wgmma_tma_ws"),
    "wgmma_tma_ws_tma_store": _wgmma("wgmma_tma_ws_tma_store"),     # the epilogue through TMA stores
    "wgmma_tma_ws_cluster": _wgmma("wgmma_tma_ws_cluster", base="wgmma_tma_ws"),   # a side branch
    # Another side branch, an experiment: with K % 64 != 0, A and B copied to 128-byte-aligned rows first.
    "wgmma_tma_ws_pitch128": Rung("matmul_wgmma.cu", "launch_matmul_wgmma_tma_ws_pitch128", "matmul_wgmma_tma_ws",
                                  "bf16", "bf16", "cublas_bf16_nt", b_layout="col", k_multiple=8,
                                  min_capability=(9, 0), arch_specific=True, base="wgmma_tma_ws"),
    # A deliberately wrong kernel, for the tests only: it skips the last K % 16 terms.
    "broken_skip_k_tail": _fp32("launch_matmul_tiled_skip_k_tail", "matmul_tiled", test_only=True),
    # Another, for the split-K path: wgmma_tma_ws whose sum of partial products drops the last run of K.
    "broken_wgmma_drop_last_run": Rung("matmul_wgmma.cu", "launch_matmul_wgmma_tma_ws_drop_last_run",
                                       "matmul_wgmma_tma_ws", "bf16", "bf16", "cublas_bf16_nt", b_layout="col",
                                       k_multiple=8, min_capability=(9, 0), arch_specific=True, test_only=True),
}
VARIANTS = tuple(k for k, r in RUNGS.items() if not r.test_only)
# cuBLAS through torch, same inputs, same run: fp32 with TF32 off (the same arithmetic as the fp32
# rungs); bf16 with B row-major; bf16 with B column-major (the storage the "col" rungs read).
BASELINES = ("cublas_fp32", "cublas_bf16", "cublas_bf16_nt")
FP32_RUNGS = tuple(v for v in VARIANTS if RUNGS[v].precision == "fp32")
MMA_RUNGS = tuple(v for v in VARIANTS if RUNGS[v].source == "matmul_mma.cu")
WGMMA_RUNGS = tuple(v for v in VARIANTS if RUNGS[v].source == "matmul_wgmma.cu")


NOMINAL_SMS = 132                  # H100 / H200 SXM: what a count made without a GPU at hand assumes


def split_k(m: int, n: int, k: int, slots: int, bm: int, bn: int) -> int:
    """The split of K of the wgmma rungs: split_k_rule in matmul_wgmma.cu, mirrored here
    (torch-free) for the launch counts; a GPU test checks that the two agree. 1 when the bm x bn
    tiles fill the `slots` (CTAs the GPU holds at once), else enough runs of K to cover them
    once, at most 16, each at least 4 k-tiles of 64, the fp32 partial sums within a quarter of
    A's and B's bytes."""
    if min(m, n, k, slots) <= 0:
        return 1
    tiles = -(-m // bm) * -(-n // bn)
    if tiles >= slots:
        return 1
    split = min(-(-slots // tiles), 16, -(-k // 64) // 4, (m * k + k * n) * 2 // (32 * m * n))
    return max(1, split)


def ws_split_k(m: int, n: int, k: int, sms: int) -> int:
    """wgmma_tma_ws (lab_wgmma_ws_split_k): one persistent CTA per SM, 128 x 256 tiles."""
    return split_k(m, n, k, sms, 128, 256)


def tma_split_k(m: int, n: int, k: int, sms: int) -> int:
    """wgmma_tma (lab_wgmma_tma_split_k): two CTAs per SM, 128 x 128 tiles."""
    return split_k(m, n, k, 2 * sms, 128, 128)


def mma_split_k(m: int, n: int, k: int, sms: int) -> int:
    """mma_bf16_pipelined (lab_mma_pipelined_split_k): one CTA per SM, 128 x 256 tiles."""
    return split_k(m, n, k, sms, 128, 256)


def rung_launches(variant: str, m: int, n: int, k: int, sms: int = NOMINAL_SMS) -> int:
    """Kernels one call of a rung starts: two (the product, then the sum of its partial products)
    where mma_bf16_pipelined, wgmma_tma or wgmma_tma_ws splits K; wgmma_tma_ws_tma_store and wgmma_tma_ws_cluster hand
    such a product over to wgmma_tma_ws, so the same holds for them; wgmma_tma_ws_pitch128 adds its
    two copies of A and B when K % 64 != 0."""
    if variant == "wgmma_tma":
        return 2 if tma_split_k(m, n, k, sms) > 1 else 1
    if variant == "mma_bf16_pipelined":
        return 2 if mma_split_k(m, n, k, sms) > 1 else 1
    if variant in ("wgmma_tma_ws", "wgmma_tma_ws_tma_store", "wgmma_tma_ws_cluster"):
        return 2 if ws_split_k(m, n, k, sms) > 1 else 1
    if variant == "wgmma_tma_ws_pitch128":            # + the two pitched copies when K % 64 != 0
        return (2 if ws_split_k(m, n, k, sms) > 1 else 1) + (2 if k % 64 and k % 8 == 0 else 0)
    return 1
