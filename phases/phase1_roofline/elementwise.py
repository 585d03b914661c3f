"""The memory-bound anchor: c = a * b over fp32 vectors, next to a plain copy in the same run.

    lab run phase1.elementwise [--param sizes=[33554432]]

Per element the multiply does 1 FLOP and must move 12 bytes (read a and b, write c: 3 x 4 bytes),
so its arithmetic intensity is 1/12 = 0.083 FLOP/byte, hundreds of times below any GPU's ridge
point: the roofline predicts time = bytes / bandwidth, and the arithmetic is free.
The copy (8 bytes per element, no FLOPs) is the practical ceiling of the memory system; the
multiply is reported as a percentage of the copy bandwidth measured at the same size.
Sizes: the seed's 32M elements (33,554,432) and 1Gi elements (12 GiB moved per call), the latter
far beyond any L2 so every byte comes from HBM.
"""
import torch

from common.checks import CHECK_CHUNK
from common.exercise import Exercise, Result, Work, against_baseline, measure, reference_check
from common.params import Int
from common.standalone import run_alone


def footprint_bytes(p: dict) -> int:
    """a, b, c at the largest size, plus one chunk of the float64 check (output, reference, difference)."""
    n = max(p["sizes"])
    return 3 * 4 * n + 3 * 8 * min(n, CHECK_CHUNK)


def copy_work(n: int) -> Work:
    """c = a: no FLOPs; read a, write c: two fp32 arrays."""
    return Work(f"copy n={n}", 0, 2 * 4 * n, None, working_set_bytes=2 * 4 * n)


def mul_work(n: int) -> Work:
    """c = a * b: one FLOP per element; read a and b, write c: three fp32 arrays."""
    return Work(f"mul n={n}", n, 3 * 4 * n, "fp32", working_set_bytes=3 * 4 * n)


def work(params) -> list[Work]:
    return [w for n in params["sizes"] for w in (copy_work(n), mul_work(n))]


def run(ctx, params):
    rows = []
    for n in ctx.track(params["sizes"], "elementwise sizes"):
        g = torch.Generator(device=ctx.device).manual_seed(n)
        # Random, never zero: +0.5 keeps every product away from the trivial cases.
        a = torch.rand(n, device=ctx.device, generator=g) + 0.5
        b = torch.rand(n, device=ctx.device, generator=g) + 0.5
        c = torch.empty_like(a)
        cw, mw = copy_work(n), mul_work(n)

        def copy(a=a, c=c):
            c.copy_(a)

        def mul(a=a, b=b, c=c):
            torch.mul(a, b, out=c)

        copy_row = None
        if ctx.wants("copy"):
            copy_row = measure(ctx, "copy", {"n": n, "dtype": "fp32", "working_set_bytes": cw.working_set_bytes}, fn=copy,
                               check=reference_check(ctx, c, copy, a, "the source tensor"),
                               flops=cw.flops, bytes_moved=cw.bytes, dtype=cw.dtype)
            rows.append(copy_row)
        if ctx.wants("mul"):
            product = lambda s, e, a=a, b=b: a[s:e].double() * b[s:e].double()  # noqa: E731
            mul_row = measure(ctx, "mul", {"n": n, "dtype": "fp32", "working_set_bytes": mw.working_set_bytes}, fn=mul,
                              flops=mw.flops, bytes_moved=mw.bytes, dtype=mw.dtype,
                              check=reference_check(ctx, c, mul, product, "float64 product of the same inputs",
                                                    "fp32", expected_shape=a.shape))
            against_baseline([mul_row], copy_row, "gbps", "pct_of_copy_bandwidth")
            if "pct_of_copy_bandwidth" in mul_row["metrics"]:
                mul_row["metrics"]["copy_gbps_same_run"] = copy_row["metrics"]["gbps"]
            rows.append(mul_row)
        del a, b, c, copy, mul
    return Result(rows)


EXERCISE = Exercise(id="phase1.elementwise", title="Memory-bound anchor: fp32 element-wise multiply vs copy",
                    run=run, params={"sizes": Int([33554432, 1073741824], min=1, unit="fp32 elements", many=True)},
                    cpu_params={"sizes": [4194304, 67108864]}, quick_params={"sizes": [100003]},
                    variants=("copy", "mul"), footprint_bytes=footprint_bytes, work=work)


if __name__ == "__main__":
    run_alone(EXERCISE, {"sizes": [100_003, 1_000_037]})
