"""The program Nsight Compute profiles for phase2.traffic: one CUDA kernel between
cudaProfilerStart/Stop.

    python -m phases.phase2_cuda.traffic_target vector_add 1048576
    python -m phases.phase2_cuda.traffic_target naive 4096

The kernel is built, its inputs made and the kernel run once before profiling starts, so
compilation, input generation and module loading stay outside the profiled region.
"""
import sys

import torch

from common import ncu

from . import matmul, vector_add


def main(kind: str, n: int) -> None:
    dev = torch.device("cuda")
    if kind == "vector_add":
        a, b = vector_add.inputs(n, dev)
        c = torch.empty_like(a)
        op = lambda: vector_add.add(a, b, c)  # noqa: E731
    elif kind in ("naive", "tiled"):
        a, b = matmul.operands(n, n, n, dev, seed=n)
        c = torch.empty(n, n, device=dev)
        op = lambda: matmul.matmul(a, b, kind, c)  # noqa: E731
    else:
        raise SystemExit(f"unknown kernel '{kind}'")
    ncu.profiled_once(op)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
