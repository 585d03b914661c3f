"""The program Nsight Compute profiles: one anchor kernel between cudaProfilerStart/Stop.

    python -m phases.phase1_roofline.nsight_target elementwise 33554432
    python -m phases.phase1_roofline.nsight_target matmul_fp16 8192

Inputs are made and the kernel run once before profiling starts, so input generation, lazy module
loading and cuBLAS set-up stay outside the profiled region.
"""
import sys

import torch

from common import ncu


def main(kind: str, n: int) -> None:
    dev = torch.device("cuda")
    if kind == "elementwise":
        a, b = torch.rand(n, device=dev) + 0.5, torch.rand(n, device=dev) + 0.5
        c = torch.empty_like(a)
        op = lambda: torch.mul(a, b, out=c)  # noqa: E731
    elif kind == "matmul_fp16":
        a = torch.randn(n, n, device=dev, dtype=torch.float16)
        b = torch.randn(n, n, device=dev, dtype=torch.float16)
        c = torch.empty(n, n, device=dev, dtype=torch.float16)
        op = lambda: torch.matmul(a, b, out=c)  # noqa: E731
    else:
        raise SystemExit(f"unknown kernel '{kind}'")
    ncu.profiled_once(op)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
