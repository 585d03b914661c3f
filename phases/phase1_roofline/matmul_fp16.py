"""phase1.matmul_fp16: the compute-bound anchor, an N = 8192 FP16 matmul through cuBLAS.

    lab run phase1.matmul_fp16

For C = A @ B with N x N matrices: FLOPs = 2 N^3; the fewest bytes are 3 N^2 x itemsize (read A
and B, write C once), so in fp16 the intensity is N/3 FLOP/byte: at N = 8192 far right of the ridge.
`matmul_row` is shared with the regime sweep.
"""
import torch

from common.checks import TORCH_DTYPES
from common.exercise import Exercise, Result, Work, measure, reference_check
from common.params import Choice, Int
from common.standalone import run_alone


def footprint_bytes(n: int, dtype: str) -> int:
    """A, B, C in `dtype`, their fp32 draws, and the float64 reference with its upcast inputs."""
    return 3 * n * n * TORCH_DTYPES[dtype].itemsize + n * n * 4 + 3 * n * n * 8


def matmul_work(n: int, dtype: str) -> Work:
    """C = A @ B, N x N: 2N^3 FLOPs; read A and B, write C once: 3N^2 elements."""
    return Work(f"{dtype} n={n}", 2 * n**3, 3 * n * n * TORCH_DTYPES[dtype].itemsize, dtype)


def matmul_row(ctx, n: int, dtype: str) -> dict:
    g = torch.Generator(device=ctx.device).manual_seed(n)
    t = TORCH_DTYPES[dtype]
    a = torch.randn(n, n, device=ctx.device, generator=g).to(t)
    b = torch.randn(n, n, device=ctx.device, generator=g).to(t)
    c = torch.empty(n, n, device=ctx.device, dtype=t)

    def fn():
        torch.matmul(a, b, out=c)

    check = reference_check(ctx, c, fn, a.double() @ b.double(), "float64 matmul of the same inputs", dtype)
    w = matmul_work(n, dtype)
    return measure(ctx, dtype, {"n": n, "dtype": dtype}, fn=fn, check=check, flops=w.flops, bytes_moved=w.bytes,
                   dtype=dtype)


def run_anchor(ctx, params):
    return Result([matmul_row(ctx, params["n"], params["dtype"])])


EXERCISE = Exercise(id="phase1.matmul_fp16", title="Compute-bound anchor: FP16 matmul at N=8192",
                  run=run_anchor, params={"n": Int(8192, min=1, max=65536, unit="rows = columns"),
                                          "dtype": Choice("fp16", ("fp16", "bf16", "fp32"))},
                  cpu_params={"n": 1024, "dtype": "fp32"}, quick_params={"n": 80},
                  footprint_bytes=lambda p: footprint_bytes(p["n"], p["dtype"]),
                  work=lambda p: [matmul_work(p["n"], p["dtype"])])


if __name__ == "__main__":
    run_alone(EXERCISE, {"n": 333})
