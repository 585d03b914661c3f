"""Phase 3's rows as workloads (common/workload.py): the kernels each timed call launches, with the
FLOPs, bytes and exponentials of each, from counts.py's formulas. Torch-free (`lab predict`, report).

Attention is not one matmul. Its forward is two products on the tensor cores (S = Q K^T, O = P V)
with the softmax's exponentials between them, one per score, on the special-function units (16 per
SM per clock against the tensor cores' thousands of FLOPs). The kernels the lab times (PyTorch's
flash and cuDNN's SDPA, and our Triton kernel, all FlashAttention-2's loop) compute a tile's scores,
exponentiate them and multiply by V in the same warps one after the other, so the two roofs ADD
(`overlap=False`); FlashAttention-3's ping-pong schedule, where one warpgroup's softmax runs under the
other's products, would take their max instead. The backward recomputes the exponentials once
(FlashAttention-2: P from S and the saved LSE); our Triton backward twice (its dK/dV and dQ kernels
each rebuild P).

Causal attention skips the tiles above the diagonal but computes the diagonal tiles whole, so its
products and exponentials are (nb + 1) / (2 nb) of the full square, nb = ceil(N / TILE) query tiles,
TILE = 128 rows (FlashAttention-2's and cuDNN's query tile on sm_90, stated, not measured).
"""
import math

from common.workload import ELEMENTWISE, MATMUL, TORCH, TRITON, Kernel, Workload

from . import counts

TILE = 128


def causal_fraction(n: int, causal: bool) -> float:
    """The share of the N x N scores a tiled kernel computes: 1, or (nb + 1) / (2 nb) when causal."""
    if not causal:
        return 1.0
    nb = math.ceil(n / TILE)
    return (nb + 1) / (2 * nb)


def _launch(variant: str) -> str:
    return TRITON if variant == "triton" else TORCH


def attention_forward(variant: str, b: int, h: int, n: int, d: int, dtype: str, causal: bool) -> Workload:
    c = counts.forward_count(variant, b, h, n, d, dtype, causal)
    size = counts.ITEMSIZE[dtype]
    scores = b * h * n * n
    if variant == "naive":                       # four kernels, the N x N matrices through memory
        return Workload(f"naive attention {b}x{h}x{n}x{d}", (
            Kernel("S = Q K^T", MATMUL, 2 * scores * d, (2 * b * h * n * d + scores) * size, c.dtype),
            Kernel("S x scale", ELEMENTWISE, scores, 2 * scores * size, None),
            Kernel("softmax(S)", ELEMENTWISE, 4 * scores, 2 * scores * size, None, exps=scores),
            Kernel("O = P V", MATMUL, 2 * scores * d, (scores + 2 * b * h * n * d) * size, c.dtype)))
    f = causal_fraction(n, causal)
    return Workload(f"{variant} attention {b}x{h}x{n}x{d}{' causal' if causal else ''}", (
        Kernel("attention forward (Q K^T, softmax, P V)", MATMUL, 4 * scores * d * f, c.bytes, c.dtype,
               exps=scores * f, launch=_launch(variant)),),
        notes=("products and exponentials added: FlashAttention-2's loop runs them in the same warps in turn",))


def attention_backward(variant: str, b: int, h: int, n: int, d: int, dtype: str, causal: bool) -> Workload:
    """The main kernel(s) and the small ones around them (counts.LIBRARY_BACKWARD_LAUNCHES)."""
    c = counts.backward_count(variant, b, h, n, d, dtype, causal)
    size = counts.ITEMSIZE[dtype]
    f = causal_fraction(n, causal)
    scores, rows = b * h * n * n * f, b * h * n * d
    prep = Kernel("delta = rowsum(dO * O)", ELEMENTWISE, 2 * rows, 2 * rows * size + b * h * n * 4, None,
                  launch=_launch(variant))
    if variant == "triton":                      # dK/dV: S, dP, dV, dK; dQ: S, dP, dQ (each rebuilds P)
        main = (Kernel("dK, dV", MATMUL, 8 * scores * d, c.bytes * 5 / 8, c.dtype, exps=scores, launch=TRITON),
                Kernel("dQ", MATMUL, 6 * scores * d, c.bytes * 3 / 8, c.dtype, exps=scores, launch=TRITON))
        return Workload(f"triton attention backward {b}x{h}x{n}x{d}", (prep, *main))
    body = Kernel("attention backward (5 products, P recomputed)", MATMUL, 10 * scores * d, c.bytes, c.dtype,
                  exps=scores)
    dq = Kernel("dQ fp32 accumulator to dtype", ELEMENTWISE, 0, rows * (4 + size), None)
    copy = Kernel("dO made contiguous", ELEMENTWISE, 0, 2 * rows * size, None)
    kernels = {"sdpa_flash": (copy, prep, body, dq), "sdpa_efficient": (copy, body), "sdpa_cudnn": (prep, body, dq)}
    return Workload(f"{variant} attention backward {b}x{h}x{n}x{d}", kernels[variant])


def one_kernel(name: str, c: counts.Count, variant: str, kind: str, exps: float = 0.0) -> Workload:
    """The row's FLOPs and bytes in one kernel, and the rest of its launches (the split softmax's
    memset, the unfused chain's other four) as kernels at their launch floor: the fewest bytes are
    the problem's, whatever the chain moves beyond them (its measured time shows that)."""
    main = Kernel(name, kind, c.flops, c.bytes, c.dtype, exps, _launch(variant))
    rest = (Kernel("its other launches", ELEMENTWISE, 0, 0, None, launch=_launch(variant), count=c.launches - 1),)
    return Workload(name, (main, *rest) if c.launches > 1 else (main,))


EXERCISES = ("phase3.vector_add", "phase3.softmax", "phase3.matmul", "phase3.flash_attention",
             "phase3.flash_attention_bwd")


def row_workload(r: dict) -> Workload | None:
    """A frame row's workload (common/workload_accuracy.py), from its params and the softmax's kernel."""
    params = {k[len("params."):]: v for k, v in r.items() if k.startswith("params.") and v == v and v is not None}
    try:
        return workload_of(r["exercise"], r["variant"], params, {"kernel": r.get("metrics.kernel")})
    except (KeyError, ValueError):
        return None


def workload_of(exercise: str, variant: str, params: dict, metrics: dict | None = None) -> Workload | None:
    """A phase 3 row's workload from its params (None: not a phase 3 timed row)."""
    p = params
    if exercise in ("phase3.flash_attention", "phase3.flash_attention_bwd"):
        shape = (int(p["batch"]), int(p["heads"]), int(p["n"]), int(p["head_dim"]), p["dtype"], bool(p["causal"]))
        return (attention_forward if exercise == "phase3.flash_attention" else attention_backward)(variant, *shape)
    c = counts.row_count(exercise, variant, p, metrics)
    if c is None:
        return None
    if exercise == "phase3.softmax":
        exps = 0 if variant == "copy" else p["rows"] * p["cols"]
        return one_kernel(f"softmax {p['rows']}x{p['cols']}", c, variant, ELEMENTWISE, exps)
    kind = MATMUL if exercise == "phase3.matmul" else ELEMENTWISE
    return one_kernel(f"{exercise.split('.')[1]} {variant}", c, variant, kind)


# ------------------------------------------------------------------------------ `lab predict`
def _label(variant: str, p: dict) -> str:
    return f"{variant} {p['dtype']} d={p['head_dim']} causal={p['causal']} n={p['n']} {p['batch']}x{p['heads']}"


def forward_workloads(problems: list[dict], variants_of) -> list[tuple[str, Workload]]:
    """flash_attention's rows: (label, workload) of every problem and variant it times."""
    shape = ("batch", "heads", "n", "head_dim", "dtype", "causal")
    return [(_label(v, p), attention_forward(v, *(p[k] for k in shape))) for p in problems for v in variants_of(p)]


def backward_workloads(problems: list[dict], variants) -> list[tuple[str, Workload]]:
    shape = ("batch", "heads", "n", "head_dim", "dtype", "causal")
    return [(_label(v, p), attention_backward(v, *(p[k] for k in shape))) for p in problems for v in variants]
