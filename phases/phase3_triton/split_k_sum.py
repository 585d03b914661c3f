"""Split-K's deterministic reduction: the fp32 partial sums of each K run, one M x N slab per
split, added by a second small kernel in the fixed order s = 0, 1, ... (the same bits every run,
unlike atomics, whose order of arrival varies)."""
import torch

from common.triton_shim import tl, triton

SUM_BLOCK = 1024                  # elements of C per program of the summing kernel


@triton.jit
def sum_splits_kernel(part_ptr, c_ptr, M, N, stride_cm, stride_cn, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """C = sum over s of part[s] (fp32, M x N each), added in the order s = 0, 1, ...: the same
    bits every run, unlike atomics."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(part_ptr + s * M * N + offs, mask=inside, other=0.0)
    rows, cols = offs // N, offs % N
    tl.store(c_ptr + rows * stride_cm + cols * stride_cn, total.to(c_ptr.dtype.element_ty), mask=inside)


def partial_sums(M: int, N: int, split_k: int, device) -> torch.Tensor:
    """fp32 partial sums, one M x N slab per split (a dummy when there is no split)."""
    return torch.empty((split_k, M, N) if split_k > 1 else (1,), device=device, dtype=torch.float32)


def sum_splits(parts: torch.Tensor, out: torch.Tensor, split_k: int) -> None:
    """out = parts[0] + parts[1] + ... + parts[split_k - 1], in that order, in fp32, cast to out's dtype."""
    M, N = out.shape
    sum_splits_kernel[(triton.cdiv(M * N, SUM_BLOCK),)](parts, out, M, N, out.stride(0), out.stride(1),
                                                        SPLIT_K=split_k, BLOCK=SUM_BLOCK)


def split_k_bytes(m: int, n: int, split_k: int) -> int:
    """Device-memory bytes the partial sums add: each of split_k fp32 M x N slabs written once and
    read once (0 without a split)."""
    return 2 * 4 * split_k * m * n if split_k > 1 else 0
