"""The first benchmark: one 4096 x 4096 FP32 matmul through cuBLAS, against the spec sheet.

    lab run phase0.matmul_baseline [--variant fp32|tf32]

Two variants, because "FP32 matmul" means two different things on a GPU with tensor cores:
- fp32: true single precision on the CUDA cores (torch matmul precision "highest");
- tf32: the inputs rounded to TF32 (10-bit mantissa) and fed to the tensor cores ("high").
Each is compared with its own peak from hardware.yaml, and the record says which was allowed.
The fp32 check tolerance sits below TF32's error, so TF32 sneaking in would fail the fp32 row.

FLOPs = 2 N^3 (one multiply and one add per inner-product term);
fewest bytes = 3 N^2 x 4 (read A and B once, write C once), so intensity = N/6 FLOP/byte.
"""
from contextlib import contextmanager

import torch

from common.exercise import Exercise, Result, Work, measure, reference_check, row
from common.params import Int
from common.standalone import run_alone


@contextmanager
def matmul_precision(mode: str):
    """'highest' = true FP32; 'high' = TF32 allowed. Restored afterwards."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(mode)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def matmul_work(n: int, variant: str) -> Work:
    """C = A @ B in fp32 storage: 2N^3 FLOPs; read A and B, write C once (3N^2 x 4 bytes)."""
    return Work(f"{variant} n={n}", 2 * n**3, 3 * n * n * 4, variant)


def fp32_matmul_rows(ctx, n: int, variants, timing=None) -> list[dict]:
    g = torch.Generator(device=ctx.device).manual_seed(0)
    a = torch.randn(n, n, device=ctx.device, generator=g)
    b = torch.randn(n, n, device=ctx.device, generator=g)
    c = torch.empty(n, n, device=ctx.device)
    ref = a.double() @ b.double()
    rows = []
    for variant in variants:
        params = {"n": n, "dtype": "fp32", "tf32_allowed": variant == "tf32"}
        if variant == "tf32" and not ctx.is_cuda:
            rows.append(row(variant, params, "skipped", "TF32 is a tensor-core mode of NVIDIA GPUs"))
            continue
        with matmul_precision("high" if variant == "tf32" else "highest"):
            def fn():
                torch.matmul(a, b, out=c)

            check = reference_check(ctx, c, fn, ref, "float64 matmul of the same inputs", variant)
            w = matmul_work(n, variant)
            rows.append(measure(ctx, variant, params, fn=fn, check=check, flops=w.flops,
                                bytes_moved=w.bytes, dtype=variant, timing=timing))
    return rows


def footprint_bytes(n: int) -> int:
    """A, B, C in fp32 and the float64 reference with its two upcast inputs."""
    return 3 * n * n * 4 + 3 * n * n * 8


def run(ctx, params):
    variants = [v for v in ("fp32", "tf32") if ctx.wants(v)]
    return Result(fp32_matmul_rows(ctx, params["n"], ctx.track(variants, "matmul 4096 fp32")))


EXERCISE = Exercise(id="phase0.matmul_baseline", title="4096 x 4096 FP32 matmul baseline vs spec peak",
                    run=run, params={"n": Int(4096, min=1, max=65536, unit="rows = columns")},
                    cpu_params={"n": 1024}, quick_params={"n": 96},
                    variants=("fp32", "tf32"), footprint_bytes=lambda p: footprint_bytes(p["n"]),
                    work=lambda p: [matmul_work(p["n"], v) for v in ("fp32", "tf32")])


if __name__ == "__main__":
    run_alone(EXERCISE, {"n": 333})
