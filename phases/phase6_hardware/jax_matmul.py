"""Exercise 6.1: a bf16 matmul through jax.jit against torch (cuBLAS) and the phase 3 Triton kernel,
on the same device in the same run.

    lab run phase6.jax_matmul [--param sizes=[8192]]

The seed measured a TPU v5e through JAX at 142.3 TFLOP/s (72% of 197). On a GPU the question is
whether XLA's code generation (its own GEMM emitter, or a call into cuBLAS: the compiled HLO says
which, and the record keeps its custom-call targets) gets within a few percent of cuBLAS called
directly. The same inputs go to all three; each output is checked against a float64 matmul before
any timing. JAX is timed by host wall clock around back-to-back calls (wall_timing.py); torch and
Triton by the lab's harness and also by that same wall clock, and the ratios use the latter.

Built on phase 3: its Triton matmul and FLOP count.
"""
import torch

from common.checks import TORCH_DTYPES, compare
from common.errors import Skip
from common.exercise import Exercise, Needs, Result, Work, measure, reference_check
from common.params import Choice, Int
from common.standalone import run_alone
from common.variant_rows import attempt

from . import hlo, jax_backend
from .side_by_side import add_wall, compare as compare_rows, jax_row, scrubbed

VARIANTS = ("jax_jit", "torch", "triton")
REFERENCE = "float64 matmul of the same inputs"


def library(ctx) -> str:
    return "hipBLASLt/rocBLAS" if ctx.is_rocm else "cuBLAS" if ctx.is_cuda else "CPU BLAS"


def cost(n: int, dtype: str) -> dict:
    from phases.phase3_triton import counts
    c = counts.matmul_count(n, n, n, dtype)
    return {"flops": c.flops, "bytes_moved": c.bytes, "dtype": c.dtype}


def torch_row(ctx, a, b, c, ref, size, dtype):
    r = measure(ctx, "torch", size, fn=lambda: torch.matmul(a, b, out=c),
                check=reference_check(ctx, c, lambda: torch.matmul(a, b, out=c), ref, REFERENCE, precision=dtype),
                **cost(size["n"], dtype))
    r["metrics"]["library"] = library(ctx)
    return add_wall(ctx, r, lambda: torch.matmul(a, b, out=c))


def triton_row(ctx, a, b, c, ref, size, dtype):
    from phases.phase3_triton import matmul as p3
    from common.triton_shim import HAVE_TRITON, interpreting
    from common.triton_tuner import label, tune
    from common.variant_rows import attempt, skipped
    if not HAVE_TRITON:
        return skipped("triton", size, "needs the Python package `triton`; not installed")
    if not ctx.is_cuda and not interpreting():
        return skipped("triton", size, "the phase 3 Triton kernel needs a GPU (or TRITON_INTERPRET=1 on a CPU)")

    def make():
        check = lambda cfg: reference_check(ctx, c, lambda: p3.matmul(a, b, c, cfg), ref, REFERENCE, precision=dtype)  # noqa: E731
        cands = [p3.INTERPRETER_CONFIG] if interpreting() else p3.CONFIGS
        cfg, _ = tune(ctx, ("triton", size["n"], dtype, ctx.device.type), cands,
                      launch=lambda k: p3.matmul(a, b, c, k), check=lambda k: check(k)())
        r = measure(ctx, "triton", size, fn=lambda: p3.matmul(a, b, c, cfg), check=check(cfg), **cost(size["n"], dtype))
        r["metrics"]["config"] = label(cfg)
        return add_wall(ctx, r, lambda: p3.matmul(a, b, c, cfg))
    return attempt("triton", size, make)


def jax_rows(ctx, a, b, ref, size, dtype) -> dict:
    from common.variant_rows import skipped
    try:
        dev = jax_backend.device()
    except Skip as exc:
        return skipped("jax_jit", size, str(exc))
    why = jax_backend.mismatch(ctx, dev) if ctx.is_cuda else None
    if why:
        return skipped("jax_jit", size, why)
    aj, bj = jax_backend.to_jax(a, dev), jax_backend.to_jax(b, dev)
    compiled, text, temp = hlo.compiled(lambda x, y: x @ y, aj, bj)
    found = hlo.analyze(text)
    extra = {"hlo": {**found.as_dict(), "temp_bytes": temp}, "hlo_kernels": found.kernels,
             "hlo_custom_call_targets": ", ".join(found.custom_call_targets) or None,
             "hlo_fusion_kinds": ", ".join(found.fusion_kinds) or None}
    return jax_row(ctx, dev, "jax_jit", size, run=lambda: compiled(aj, bj),
                   check=lambda: compare(jax_backend.to_torch(compiled(aj, bj), ref.device), ref, dtype, REFERENCE),
                   flops=cost(size["n"], dtype)["flops"], nbytes=cost(size["n"], dtype)["bytes_moved"],
                   dtype=dtype, launches=max(1, found.kernels), extra=extra)


def run(ctx, params):
    rows = []
    dtype = params["dtype"]
    for n in ctx.track(params["sizes"], "matmul sizes"):
        g = torch.Generator(device=ctx.device).manual_seed(n)
        a = torch.randn(n, n, device=ctx.device, generator=g).to(TORCH_DTYPES[dtype])
        b = torch.randn(n, n, device=ctx.device, generator=g).to(TORCH_DTYPES[dtype])
        c = torch.empty(n, n, device=ctx.device, dtype=TORCH_DTYPES[dtype])
        ref = a.double() @ b.double()
        size = {"n": n, "dtype": dtype}
        here = []
        if ctx.wants("torch"):
            here.append(torch_row(ctx, a, b, c, ref, size, dtype))
        if ctx.wants("triton"):
            here.append(triton_row(ctx, a, b, c, ref, size, dtype))
        if ctx.wants("jax_jit"):
            here.append(attempt("jax_jit", size, lambda: jax_rows(ctx, a, b, ref, size, dtype)))
        compare_rows(here, ("torch",), "pct_of_torch")
        rows += here
        del a, b, c, ref
        if ctx.is_cuda:
            torch.cuda.empty_cache()                     # leave the memory to JAX's allocator in the next size
    return Result(scrubbed(rows), {"timing_note": "ratios (pct_of_torch) compare wall_ms: every row timed by the same host "
                                        "wall clock over back-to-back calls; torch and Triton rows keep the harness's "
                                        "CUDA-event timing in ms", "library": library(ctx)})


def work(params) -> list[Work]:
    return [Work(f"{v} {params['dtype']} n={n}", c["flops"], c["bytes_moved"], c["dtype"])
            for n in params["sizes"] for c in [cost(n, params["dtype"])] for v in VARIANTS]


def footprint_bytes(p: dict) -> int:
    """A, B, C; their float64 copies and the float64 reference; JAX's A, B and result."""
    n2 = max(p["sizes"]) ** 2
    item = TORCH_DTYPES[p["dtype"]].itemsize
    return 3 * item * n2 + 3 * 8 * n2 + 3 * item * n2


EXERCISE = Exercise(
    id="phase6.jax_matmul",
    title="bf16 matmul through jax.jit against torch's cuBLAS and the phase 3 Triton kernel, same GPU, same run",
    run=run, needs=Needs(modules=("jax",)),
    params={"sizes": Int([1000, 8192], min=1, max=46340, many=True, unit="N of an N x N x N product"),
            "dtype": Choice("bf16", ("bf16", "fp16"))},
    cpu_params={"sizes": [200]},
    quick_params={"sizes": [1000]},
    variants=VARIANTS, footprint_bytes=footprint_bytes, work=work)


if __name__ == "__main__":
    run_alone(EXERCISE, {"sizes": [200]})
