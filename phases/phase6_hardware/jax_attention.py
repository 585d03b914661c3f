"""Exercise 6.2: attention through XLA, and what it fused: the seed's shape (B=4, H=16, S=2048,
d=64, bf16) and phase 3's (B=1, H=16, S=16384, d=128), against torch SDPA and the phase 3 Triton
flash-attention kernel, same device, same run.

    lab run phase6.jax_attention [--param shapes=[[4,16,2048,64]]]

JAX variants: `jax_jit_math`, jax.jit of the plain math (scores, softmax in fp32, weighted sum);
`jax_dpa`, `jax_dpa_xla`, `jax_dpa_cudnn`, jax.nn.dot_product_attention with implementation None,
"xla" and "cudnn". An implementation this backend refuses becomes a skipped row with its reason.
torch variants: SDPA with each backend forced (flash, cuDNN, memory-efficient, math; those that
refuse the inputs are skipped), and the phase 3 Triton kernel.

The seed found that on a TPU, XLA fused matmul, softmax and matmul into one kernel by itself. Each
JAX row keeps what its compiled HLO holds (hlo.py): fusions, custom calls, kernels, and whether an
S x S score buffer is ever in device memory, with the compiler's temp bytes beside the size of a
bf16 score matrix. Every output is checked against float64 attention (first and last head) before
it is timed; ratios compare wall-clock times taken the same way for every row (wall_timing.py).

Built on phase 3: its flash-attention kernel, checks and FLOP count.
"""
import math
import warnings
from contextlib import nullcontext

import torch

from common.checks import TORCH_DTYPES, compare
from common.errors import Skip
from common.exercise import Exercise, Needs, Result, Work, measure
from common.params import Choice, Int
from common.standalone import run_alone

from . import hlo, jax_backend, wall_timing
from .side_by_side import add_wall, compare as compare_rows, jax_row, scrubbed

SEED_SHAPE = [4, 16, 2048, 64]
PHASE3_SHAPE = [1, 16, 16384, 128]
JAX_IMPLEMENTATIONS = {"jax_dpa": None, "jax_dpa_xla": "xla", "jax_dpa_cudnn": "cudnn"}
SDPA = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION",
        "sdpa_math": "MATH"}
VARIANTS = ("jax_jit_math", *JAX_IMPLEMENTATIONS, *SDPA, "triton")


def shape_rule(shape) -> str | None:
    b, h, s, d = shape
    if s in (b, h, d):
        return f"S={s} equals another dimension: the S x S score buffer could not be told apart"
    return None


def problem(shape, dtype: str) -> dict:
    b, h, s, d = shape
    return {"batch": b, "heads": h, "seq": s, "head_dim": d, "dtype": dtype, "causal": False}


def cost(p: dict) -> dict:
    from phases.phase3_triton import counts
    c = counts.forward_count("triton", p["batch"], p["heads"], p["seq"], p["head_dim"], p["dtype"], False)
    return {"flops": c.flops, "bytes_moved": c.bytes, "dtype": c.dtype}


def plain_math(q, k, v):
    """softmax(Q K^T / sqrt(d)) V as a user writes it: scores and softmax in fp32, back to q's dtype."""
    import jax
    import jax.numpy as jnp
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1).astype(q.dtype), v)


def library_attention(implementation):
    def attention(q, k, v):                  # (B, S, H, D), jax.nn's layout
        import jax
        return jax.nn.dot_product_attention(q, k, v, implementation=implementation)
    return attention


# ------------------------------------------------------------------------------ torch's rows
def sdpa_backend(variant: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([getattr(SDPBackend, SDPA[variant])])


def sdpa_row(ctx, variant, p, q, k, v, check):
    from phases.phase3_triton.flash_attention import sdpa
    from common.variant_rows import skipped

    def call():
        return sdpa(q, k, v, False)
    try:
        with warnings.catch_warnings(), sdpa_backend(variant):
            warnings.simplefilter("ignore")
            call()
            r = measure(ctx, variant, p, fn=call, check=lambda: check(lambda o: o.copy_(call())), **cost(p))
            return add_wall(ctx, r, call)
    except (RuntimeError, AttributeError) as exc:       # a backend that refuses these inputs here
        return skipped(variant, p, f"{SDPA[variant]} unavailable here: {jax_backend.why(exc).split('. ')[0]}")


def triton_row(ctx, p, q, k, v, check):
    from phases.phase3_triton import flash_attention as fa
    from common.triton_shim import HAVE_TRITON, interpreting
    from common.triton_tuner import label, tune
    from common.variant_rows import attempt, skipped
    if not HAVE_TRITON:
        return skipped("triton", p, "needs the Python package `triton`; not installed")
    if not ctx.is_cuda and not interpreting():
        return skipped("triton", p, "the phase 3 Triton kernel needs a GPU (or TRITON_INTERPRET=1 on a CPU)")
    if p["head_dim"] not in fa.HEAD_DIMS:
        return skipped("triton", p, f"the phase 3 kernel takes head dims {fa.HEAD_DIMS}")
    scale = 1.0 / math.sqrt(p["head_dim"])

    def make():
        cands = fa.INTERPRETER_FWD if interpreting() else fa.forward_candidates(q.dtype, p["head_dim"], False)
        fill = lambda cfg: lambda o: fa.attention_forward(q, k, v, False, scale, cfg, out=o)   # noqa: E731
        cfg, _ = tune(ctx, ("phase6_attn_fwd", *q.shape, str(q.dtype), ctx.device.type), cands,
                      launch=lambda c: fa.attention_forward(q, k, v, False, scale, c), check=lambda c: check(fill(c)))
        call = lambda: fa.attention_forward(q, k, v, False, scale, cfg)     # noqa: E731
        r = measure(ctx, "triton", p, fn=call, check=lambda: check(fill(cfg)), **cost(p))
        r["metrics"]["config"] = label(cfg)
        return add_wall(ctx, r, call)
    return attempt("triton", p, make)


# ------------------------------------------------------------------------------ JAX's rows
def jax_attention_row(ctx, dev, variant, p, fn, args, to_bhsd, ref, heads):
    """Compile (a refusal is a skipped row), read the HLO, check, time (an error there: a failed row)."""
    from common.variant_rows import attempt, skipped
    try:
        compiled, text, temp = hlo.compiled(fn, *args)
        wall_timing.jax_wait(compiled(*args))           # a runtime refusal surfaces here, not mid-timing
    except Exception as exc:  # noqa: BLE001 - an implementation this backend does not have
        return skipped(variant, p, jax_backend.why(exc))
    fusion = hlo.attention_report(text, p["batch"], p["heads"], p["seq"], temp)

    def check():
        out = to_bhsd(jax_backend.to_torch(compiled(*args), ctx.device))
        return compare(torch.stack([out[b, h] for b, h in heads]), ref, "bf16" if p["dtype"] == "bf16" else p["dtype"],
                       f"float64 attention, heads {heads}")
    extra = {"hlo": fusion, "score_materialized": fusion["score_materialized"], "hlo_kernels": fusion["kernels"],
             "hlo_fusions": fusion["fusions"], "hlo_custom_calls": fusion["custom_calls"],
             "hlo_custom_call_targets": ", ".join(fusion["custom_call_targets"]) or None,
             "hlo_temp_bytes": temp, "score_bytes_bf16": 2 * p["batch"] * p["heads"] * p["seq"] ** 2}
    c = cost(p)
    return attempt(variant, p, lambda: jax_row(ctx, dev, variant, p, run=lambda: compiled(*args), check=check,
                                               flops=c["flops"], nbytes=c["bytes_moved"], dtype=c["dtype"],
                                               launches=max(1, fusion["kernels"]), extra=extra))


def jax_rows(ctx, p, q, k, v, ref, heads) -> list[dict]:
    from common.variant_rows import skipped
    wanted = [v_ for v_ in ("jax_jit_math", *JAX_IMPLEMENTATIONS) if ctx.wants(v_)]
    if not wanted:
        return []
    try:
        dev = jax_backend.device()
        why = jax_backend.mismatch(ctx, dev) if ctx.is_cuda else None
    except Skip as exc:
        why = str(exc)
    if why:
        return [skipped(v_, p, why) for v_ in wanted]
    bhsd = [jax_backend.to_jax(t, dev) for t in (q, k, v)]
    bshd = [jax_backend.to_jax(t.transpose(1, 2).contiguous(), dev) for t in (q, k, v)]
    rows = []
    for variant in wanted:
        if variant == "jax_jit_math":
            rows.append(jax_attention_row(ctx, dev, variant, p, plain_math, bhsd, lambda o: o, ref, heads))
        else:
            rows.append(jax_attention_row(ctx, dev, variant, p, library_attention(JAX_IMPLEMENTATIONS[variant]), bshd,
                                          lambda o: o.transpose(1, 2), ref, heads))
    return rows


# ------------------------------------------------------------------------------ the exercise
def run(ctx, params):
    from phases.phase3_triton.flash_attention import check_forward, check_heads, reference_forward
    rows, answers = [], {}
    t = TORCH_DTYPES[params["dtype"]]
    for shape in ctx.track(params["shapes"], "attention shapes"):
        p = problem(shape, params["dtype"])
        b, h, s, d = shape
        g = torch.Generator(device=ctx.device).manual_seed(s * 1000 + d)
        q, k, v = (torch.randn(b, h, s, d, device=ctx.device, generator=g).to(t) for _ in range(3))
        heads = check_heads(b, h)
        ref = reference_forward(q, k, v, False, 1.0 / math.sqrt(d), heads)
        precision = "bf16" if params["dtype"] == "bf16" else "fp16"

        def check(fill):
            return check_forward(fill, q, k, v, False, 1.0 / math.sqrt(d), precision, ref=ref, heads=heads)
        here = []
        for variant in SDPA:
            if ctx.wants(variant):
                here.append(sdpa_row(ctx, variant, p, q, k, v, check))
        if ctx.wants("triton"):
            here.append(triton_row(ctx, p, q, k, v, check))
        if ctx.is_cuda:
            torch.cuda.empty_cache()                     # JAX allocates on its own: give it the room
        here += jax_rows(ctx, p, q, k, v, ref, heads)
        best_sdpa = compare_rows(here, tuple(SDPA), "pct_of_best_sdpa")
        compare_rows(here, ("triton",), "pct_of_triton")
        math_row = next((r for r in here if r["variant"] == "jax_jit_math" and r["status"] == "ok"), None)
        if math_row is not None:
            answers["x".join(map(str, shape))] = {
                "xla_fused_attention": not math_row["metrics"]["score_materialized"],
                "kernels": math_row["metrics"]["hlo_kernels"], "best_sdpa": (best_sdpa or {}).get("variant"),
                "avoided_scores": [r["variant"] for r in here if r["status"] == "ok"
                                   and r["metrics"].get("score_materialized") is False]}
        rows += here
        del q, k, v, ref
    return Result(scrubbed(rows), {"fusion": answers, "timing_note": "ratios compare wall_ms, every row timed by the same host "
                                                          "wall clock over back-to-back calls"})


def work(params) -> list[Work]:
    out = []
    for shape in params["shapes"]:
        c = cost(problem(shape, params["dtype"]))
        out += [Work(f"{v} {'x'.join(map(str, shape))}", c["flops"], c["bytes_moved"], c["dtype"]) for v in VARIANTS]
    return out


def footprint_bytes(p: dict) -> int:
    """Q, K, V, O twice over (torch, JAX), the plain math's fp32 scores and probabilities, and the
    float64 reference of one head."""
    worst = 0
    for b, h, s, d in p["shapes"]:
        item = TORCH_DTYPES[p["dtype"]].itemsize
        worst = max(worst, 8 * b * h * s * d * item + 2 * 4 * b * h * s * s + 3 * 8 * s * s)
    return worst


EXERCISE = Exercise(
    id="phase6.jax_attention",
    title="Attention through XLA (jit of the math, jax.nn.dot_product_attention) vs SDPA and the phase 3 kernel, "
          "with what XLA fused",
    run=run, needs=Needs(modules=("jax",)),
    params={"shapes": Int([SEED_SHAPE, PHASE3_SHAPE], min=1, many=True, length=4, unit="B, H, S, D", rule=shape_rule),
            "dtype": Choice("bf16", ("bf16", "fp16"))},
    cpu_params={"shapes": [[1, 2, 200, 32]]},
    quick_params={"shapes": [[2, 4, 1000, 64]]},
    variants=VARIANTS, footprint_bytes=footprint_bytes, work=work)


if __name__ == "__main__":
    run_alone(EXERCISE, {"shapes": [[1, 2, 200, 32]]})
