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


# ------------------------------------------------------------------------------ the same sum, in the matmul kernel
@triton.jit
def last_split_sums(part_ptr, c_ptr, counters_ptr, tile, part_offsets, split_stride, c_offsets, mask,
                    SPLIT_K: tl.constexpr):
    """Called by every split of an output tile once its partial is stored: the split that arrives
    last adds the tile's partials in the order s = 0, 1, ... (sum_splits_kernel's order, so the
    same bits as the two-kernel form, whatever the arrival order), stores C, and sets the tile's
    counter back to 0 for the next call. One launch instead of two. The pattern of phase 5's
    quant_gemm (run on an H200): a CTA barrier so every thread's partial is stored before the
    count, an acq_rel atomic at GPU scope, and L1-bypassing (.cg) loads of the other partials."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        total = tl.zeros(part_offsets.shape, dtype=tl.float32)
        for s in tl.range(0, SPLIT_K, loop_unroll_factor=1):     # a loop, not unrolled: unrolled, its
            total += tl.load(part_ptr + s * split_stride + part_offsets,   # loads cost the main loop
                             mask=mask, other=0.0, cache_modifier=".cg")   # registers (and spills)
        tl.store(c_ptr + c_offsets, total.to(c_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(counters_ptr + tile, 0)


MAX_TILE_COUNTERS = 1 << 16
_COUNTERS: dict = {}


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The split-K tile counters of this device and stream (int32, all 0 between calls: the last
    split of a tile resets its own), made once per stream, so calls on concurrent streams never
    share them; None where they cannot serve: more tiles than counters, or none made yet for this
    stream while a CUDA graph is being captured (memory allocated then would belong to the graph)."""
    if tiles > MAX_TILE_COUNTERS:
        return None
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    if key not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _COUNTERS[key] = torch.zeros(MAX_TILE_COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[key]
