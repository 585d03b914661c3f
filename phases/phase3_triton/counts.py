"""Phase 3's counts: the FLOPs, bytes and kernel launches of every row the exercises time, one
function per formula. The exercises' run() and work() call them, the tests check them against
hand computations, and the report applies them to records written before they were corrected
(issue 19). Plain Python (no torch): `lab report` imports this module.

Conventions, the same in every exercise:
* bytes: the fewest bytes the PROBLEM must move through device memory, each input read once and
  each output written once. One problem (same shape, dtype, causality) has one byte count, whatever
  the variant, so the accuracy tables group its variants and count only the fastest. What an
  algorithm moves beyond that (the unfused softmax's intermediates, naive attention's N x N
  matrices, the LSE our forward stores for the backward) is its own metric, `algorithm_bytes`.
* FLOPs: vector add 1 per element; softmax 5 per element (max, subtract, exp, sum, divide);
  matmul 2·M·N·K; attention forward 4·B·H·N²·D (two N² matmuls of 2·N²·D per head), halved when
  causal; attention backward 2.5x the forward (five N² matmuls: FlashAttention-2's convention).
* launches: the kernels one timed call starts; the calibrated model's latency term counts each.
* dtype: the arithmetic the roofline's compute peak is read for. Attention on fp32 inputs is a
  "tf32" problem (checked to tf32's tolerance; the Triton kernel's dots are tf32), naive included.
"""
from dataclasses import dataclass

ITEMSIZE = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}
LSE_ITEMSIZE = 4                      # the row log-sum-exp is fp32 whatever the inputs


@dataclass(frozen=True)
class Count:
    """One timed row's roofline inputs."""
    flops: float
    bytes: int
    dtype: str | None
    launches: int = 1


# ------------------------------------------------------------------------------ 3.1 vector add
def copy_count(n: int) -> Count:
    """out = x, n fp32 elements: no FLOPs; read x, write out."""
    return Count(0, 2 * n * 4, None)


def add_count(n: int) -> Count:
    """out = x + y, n fp32 elements: 1 FLOP each; read x and y, write out."""
    return Count(n, 3 * n * 4, "fp32")


# ------------------------------------------------------------------------------ 3.2 softmax
SOFTMAX_FLOPS_PER_ELEMENT = 5         # max, subtract, exp, sum, divide
UNFUSED_LAUNCHES = 5                  # max, subtract, exp, sum, divide: one kernel each


def softmax_bytes(m: int, n: int) -> int:
    """Row softmax of an M x N fp32 matrix: read x, write y."""
    return 2 * m * n * 4


def softmax_launches(variant: str, kernel_kind: str | None = None) -> int:
    """The unfused chain starts 5 kernels; our split kernel 2 (its exchange slots are zeroed by a
    memset kernel first); torch.softmax, our other kernels and the copy 1."""
    if variant == "unfused":
        return UNFUSED_LAUNCHES
    return 2 if variant == "triton" and kernel_kind == "split" else 1


def softmax_count(m: int, n: int, variant: str, kernel_kind: str | None = None) -> Count:
    """Every variant of one shape: the same problem (the copy: no FLOPs, same bytes)."""
    if variant == "copy":
        return Count(0, softmax_bytes(m, n), None)
    return Count(SOFTMAX_FLOPS_PER_ELEMENT * m * n, softmax_bytes(m, n), "fp32", softmax_launches(variant, kernel_kind))


def unfused_bytes(m: int, n: int) -> int:
    """What the five-kernel chain itself moves, each kernel reading its inputs and writing its output
    once: max reads x (M·N) and writes the row maxima (M) and their int64 indices (8·M bytes);
    subtract reads x and the maxima, writes z; exp reads z, writes e; sum reads e, writes M sums;
    divide reads e and the sums, writes y. 5 reads and 3 writes of M·N, 4 fp32 row vectors."""
    return (8 * m * n + 4 * m) * 4 + 8 * m


UNFUSED_FORMULA = "(8·M·N + 4·M)·4 + 8·M (5 kernels: 5 reads and 3 writes of M·N, 4 fp32 row vectors, max's int64 indices)"
SOFTMAX_FORMULA = "2·M·N·4 (read x, write y)"


# ------------------------------------------------------------------------------ 3.3 matmul
def matmul_count(m: int, n: int, k: int, dtype: str) -> Count:
    """C = A @ B, (M x K)(K x N): 2·M·N·K FLOPs; read A and B, write C once each."""
    return Count(2 * m * n * k, (m * k + k * n + m * n) * ITEMSIZE[dtype], dtype)


# ------------------------------------------------------------------------------ 3.4, 3.5 attention
LIBRARY = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient")
NAIVE_LAUNCHES = 4                    # Q K^T, the scale multiply, softmax, P V
TRITON_BACKWARD_LAUNCHES = 3          # delta = rowsum(dO * O), the dK/dV kernel, the dQ kernel
# SDPA's backward kernels per call, from PyTorch's and the libraries' sources (not counted on a GPU):
# flash: dO made contiguous in its (B, N, H, D) layout, FA2's dot(dO, O), main and dQ-conversion kernels;
# efficient: the dO copy and one CUTLASS kernel (it computes delta itself for fp16/bf16);
# cuDNN: its FlashAttention-2-style preprocess, main and dQ-conversion kernels.
LIBRARY_BACKWARD_LAUNCHES = {"sdpa_flash": 4, "sdpa_efficient": 2, "sdpa_cudnn": 3}


def attention_dtype(dtype: str) -> str:
    return "tf32" if dtype in ("fp32", "tf32") else dtype


def attention_flops(b: int, h: int, n: int, d: int, causal: bool) -> float:
    """Two N² matmuls per head (S = Q K^T, O = P V), 2·N²·D each; half the scores when causal."""
    return 4 * b * h * n * n * d * (0.5 if causal else 1.0)


def attention_bytes(b: int, h: int, n: int, d: int, itemsize: int) -> int:
    """The forward's problem: read Q, K, V, write O, once each. The LSE our kernel also writes for the
    backward is not part of it (SDPA's inference path does not produce one): see forward_algorithm_bytes."""
    return 4 * b * h * n * d * itemsize


def lse_bytes(b: int, h: int, n: int) -> int:
    """The row log-sum-exp, fp32, one per query row."""
    return b * h * n * LSE_ITEMSIZE


def naive_bytes(b: int, h: int, n: int, d: int, itemsize: int) -> int:
    """What naive (non-causal) attention itself moves, each of its 4 kernels reading its inputs and
    writing its output once: Q K^T reads Q, K and writes S (N² per head); the scale multiply reads
    and writes S; softmax reads S, writes P; P V reads P and V, writes O. Q, K, V, O once plus
    six N² passes."""
    return (4 * b * h * n * d + 6 * b * h * n * n) * itemsize


def forward_algorithm_bytes(variant: str, b: int, h: int, n: int, d: int, itemsize: int) -> int | None:
    """The algorithm's own traffic where it differs from the problem's: naive's N x N passes, our
    kernel's extra LSE output. None for the libraries (their internals are theirs)."""
    if variant == "naive":
        return naive_bytes(b, h, n, d, itemsize)
    if variant == "triton":
        return attention_bytes(b, h, n, d, itemsize) + lse_bytes(b, h, n)
    return None


def forward_count(variant: str, b: int, h: int, n: int, d: int, dtype: str, causal: bool) -> Count:
    """Every forward variant of one problem: the same FLOPs, bytes and dtype; naive starts 4 kernels."""
    if variant == "naive" and causal:
        raise ValueError("naive attention is timed non-causal only (the seed's case)")
    return Count(attention_flops(b, h, n, d, causal), attention_bytes(b, h, n, d, ITEMSIZE[dtype]),
                 attention_dtype(dtype), NAIVE_LAUNCHES if variant == "naive" else 1)


BACKWARD_FLOPS_FACTOR = 2.5


def backward_flops(b: int, h: int, n: int, d: int, causal: bool) -> float:
    """2.5x the forward (five N² matmuls: S, dP recomputed once, dV, dK, dQ), halved when causal.
    Our kernels recompute S and dP in both passes (seven matmuls), so this understates their work."""
    return BACKWARD_FLOPS_FACTOR * attention_flops(b, h, n, d, causal)


def backward_bytes(b: int, h: int, n: int, d: int, itemsize: int) -> int:
    """Read Q, K, V, O, dO and the forward's fp32 LSE, write dQ, dK, dV: 8·B·H·N·D elements and B·H·N
    fp32 row statistics (every variant reads the LSE its forward saved)."""
    return 8 * b * h * n * d * itemsize + lse_bytes(b, h, n)


def backward_launches(variant: str) -> int:
    return TRITON_BACKWARD_LAUNCHES if variant == "triton" else LIBRARY_BACKWARD_LAUNCHES[variant]


def backward_count(variant: str, b: int, h: int, n: int, d: int, dtype: str, causal: bool) -> Count:
    return Count(backward_flops(b, h, n, d, causal), backward_bytes(b, h, n, d, ITEMSIZE[dtype]), attention_dtype(dtype),
                 backward_launches(variant))


# ------------------------------------------------------------------------------ a recorded row's counts
def row_count(exercise: str, variant: str, params: dict, metrics: dict | None = None) -> Count | None:
    """The counts of a recorded row from its params (and, for the softmax, the kernel the tuner
    picked): what the report's calibrator uses for rows recorded before these formulas."""
    metrics = metrics or {}
    p = params
    if exercise == "phase3.vector_add":
        return copy_count(p["n"]) if variant == "copy" else add_count(p["n"])
    if exercise == "phase3.softmax":
        kind = {"softmax_split_kernel": "split"}.get(metrics.get("kernel"))
        return softmax_count(p["rows"], p["cols"], variant, kind)
    if exercise == "phase3.matmul":
        return matmul_count(p.get("m", p["n"]), p["n"], p.get("k", p["n"]), p["dtype"])   # M x N x K rows too
    shape = (p["batch"], p["heads"], p["n"], p["head_dim"], p["dtype"], bool(p["causal"]))
    if exercise == "phase3.flash_attention":
        return forward_count(variant, *shape)
    if exercise == "phase3.flash_attention_bwd":
        return backward_count(variant, *shape)
    return None
