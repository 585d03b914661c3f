"""Tall-skinny C = A @ B (M <= 64): B streamed once by every SM, never copied.

When M is small the product is bound by reading B (K x N, the big operand): 2·M·N·K FLOPs over
K·N·itemsize bytes is M FLOP/byte at 2 bytes, far left of a Hopper's ridge (~300). So the only
goals are (1) read B once, at full HBM bandwidth, and (2) add nothing to its bytes. The general
kernels miss (2) at unaligned rows: an N or K that is not a multiple of 8 at 2 bytes makes them
copy B into 16-byte rows first (tma_padding.py), a read and a write of B before the product reads
it again: three times B's bytes where one would do.

This kernel reads A and B with plain masked `tl.load`s at their own strides (no TMA, no padding):
* one tile row: BLOCK_M = M rounded up to a power of two (at least 16, tl.dot's minimum); rows
  past M re-read row M - 1 (no mask) and are never stored;
* wide N tiles (BLOCK_N 128, or 64 for unaligned B where the rule prefers it), so A (M x K,
  L2-resident) is re-read only M / BLOCK_N as often as B is read;
* split-K by rule (`skinny_config`): the N tiles alone are too few to give every SM a share of
  B's stream, so K is cut into runs; each writes an fp32 partial sum, and the tile's last run to
  finish adds them in the order s = 0, 1, ... and stores C (split_k_sum.last_split_sums: an
  atomic counts arrivals, the sum itself is ordered, so the bits never vary), or a second kernel
  does the same sum (split_k_sum.sum_splits) where no counters can be had.

What unaligned rows cost: a row start that is only 2-byte aligned (N odd at 2 bytes) cannot be
read with 16-byte vector loads, so each thread issues 2-byte loads (8x the load instructions)
into registers, and Triton cannot turn them into cp.async copies (those need 4 bytes or more), so
the shared-memory pipeline is gone too. It costs little here: a warp's 32 two-byte loads are
still one coalesced 64-byte request, and at one warp load instruction per SM per clock the SMs
can issue ~132 x 1.9 GHz x 64 B ~= 16 TB/s of them, over 3x an H200's 4.8 TB/s; what the lost
pipeline took away (bytes in flight) is given back by more programs per SM (streams_per_sm: the
split rule makes that many), so HBM still sees enough requests (Little's law: ~25-30 KB in flight
per SM). What compiling for sm_90 shows (compile_check): aligned B, 16-byte cp.async copies in
the main loop; unaligned B, 2-byte loads, 128 registers a thread at BLOCK_M 16, no spills.
"""
import torch

from common.triton_shim import require, tl, triton

from .split_k_sum import last_split_sums, partial_sums, sum_splits, tile_counters

SKINNY_MAX_M = 64              # up to here a product is B's stream (M FLOP/byte): this kernel's rule
ROW_BYTES_FOR_VECTORS = 16     # a row pitch that is a multiple of this reads in 16-byte vectors
MAX_SPLIT_K = 32
MIN_K_TILES_PER_SPLIT = 2      # a run shorter than this is mostly prologue and epilogue


@triton.jit
def skinny_matmul_kernel(a_ptr, b_ptr, c_ptr, part_ptr, counters_ptr, M, N, K,
                         stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT_K: tl.constexpr, A_ALIGN: tl.constexpr, B_ALIGN: tl.constexpr,
                         C_ALIGN: tl.constexpr, MASK_FREE_MAIN: tl.constexpr, FIXUP: tl.constexpr):
    """Program (n, s) computes C[:, n-th BLOCK_N columns] over the s-th of SPLIT_K equal runs of
    k-tiles (the last runs may be short or empty). Rows of A past M are clamped to row M - 1 (read,
    never stored). MASK_FREE_MAIN (aligned B): a tile wholly inside C runs an unmasked, pipelined
    loop (a mask whose bound is not a multiple of 16 would split the vector loads), the last tile
    column a masked unpipelined one, and the K tail is one masked step after the loop. Else (B's
    loads scalar anyway): one loop, every load masked, which holds the fewest registers (ptxas:
    128 a thread at BLOCK_M 16, BLOCK_K 32, 4 warps, against ~200 for the three-loop form). SPLIT_K == 1 stores
    C; else the fp32 sum goes to part[s] (M x N, row pitch N), and with FIXUP the tile's last
    split adds them in order and stores C (split_k_sum.last_split_sums: one launch). *_ALIGN: the power of two (<= 16)
    each row stride is a multiple of, so aligned rows keep their vector loads."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    lo = tl.minimum(split * per_split, k_tiles)
    hi = tl.minimum(lo + per_split, k_tiles)
    full_hi = tl.minimum(hi, K // BLOCK_K)             # k-tiles with no K tail in them
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    in_m = offs_m[:, None] < M
    in_n = offs_n[None, :] < N
    rows_a = tl.minimum(offs_m, M - 1)                 # rows past M re-read row M - 1: no mask, never stored
    a_ptrs = a_ptr + tl.multiple_of(rows_a * stride_am, A_ALIGN)[:, None] + (lo * BLOCK_K + offs_k)[None, :] * stride_ak
    b_ptrs = b_ptr + tl.multiple_of((lo * BLOCK_K + offs_k) * stride_bk, B_ALIGN)[:, None] + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)   # fp32 whatever the inputs
    if not MASK_FREE_MAIN:                             # one loop, every load masked: fewest registers
        for kt in range(lo, hi):                       # (unaligned B: its loads are scalar anyway)
            in_k = offs_k < K - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=in_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=in_k[:, None] & in_n, other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    else:
        if (pid_n + 1) * BLOCK_N <= N:
            for _ in range(lo, full_hi):               # no mask at all: a mask whose bound is not a
                acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc)   # multiple of 16 splits vectors
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
        else:                                          # the last tile column: B's columns masked,
            for _ in tl.range(lo, full_hi, num_stages=1):   # unpipelined (no second shared-memory ring)
                acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs, mask=in_n, other=0.0), acc)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
        if (full_hi < hi) & (lo < hi):                 # the K tail, in the run that holds it
            in_k = offs_k < K - full_hi * BLOCK_K
            a = tl.load(a_ptrs, mask=in_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=in_k[:, None] & in_n, other=0.0)
            acc = tl.dot(a, b, acc)
    c_offsets = tl.multiple_of(offs_m * stride_cm, C_ALIGN)[:, None] + offs_n[None, :] * stride_cn
    if SPLIT_K == 1:
        tl.store(c_ptr + c_offsets, acc.to(c_ptr.dtype.element_ty), mask=in_m & in_n)
    else:
        part_offsets = (offs_m * N)[:, None] + offs_n[None, :]
        tl.store(part_ptr + split * M * N + part_offsets, acc, mask=in_m & in_n)
        if FIXUP:                                      # the last split of this tile sums them, in order
            last_split_sums(part_ptr, c_ptr, counters_ptr, pid_n, part_offsets, M * N, c_offsets, in_m & in_n,
                            SPLIT_K)


# ------------------------------------------------------------------------------ the rule
def is_tall_skinny(M: int) -> bool:
    return M <= SKINNY_MAX_M


def takes_skinny(M: int, N: int, itemsize: int) -> bool:
    """Whether the plain kernel hands this product to skinny_matmul: tall-skinny with B's rows not
    16-byte aligned (where the plain kernel would copy B into padded rows first). With aligned B the
    plain kernel reads B in place already, and on an H200 it measured faster than this kernel's aligned
    loop at four of five aligned shapes, by up to 4x at M = 64, so it keeps those."""
    return is_tall_skinny(M) and not rows_vectorizable(N, itemsize)


def rows_vectorizable(cols: int, itemsize: int) -> bool:
    """Whether a contiguous operand's rows (`cols` elements) start on 16-byte boundaries."""
    return (cols * itemsize) % ROW_BYTES_FOR_VECTORS == 0


def streams_per_sm(b_aligned: bool, block_m: int) -> int:
    """Programs one SM needs at once to keep its share of HBM busy (Little's law: ~25-30 KB in
    flight per SM on an H200). Aligned B: one, whose cp.async ring keeps two 32 KB k-tiles in
    flight. Unaligned B: each program has only the 8 KB k-tile its registers are loading in
    flight, so as many as the register file holds: four at BLOCK_M 16 (128 registers a thread),
    two above (the accumulator and A's tile take the rest: ~240 at BLOCK_M 64)."""
    if b_aligned:
        return 1
    return 4 if block_m <= 16 else 2


def split_cost_bytes(M: int, N: int, K: int, itemsize: int, block_n: int, split: int, sms: int,
                     streams: int) -> float:
    """The bytes-at-full-bandwidth a split costs, to compare splits: B's stream stretched by the
    slots its waves leave idle (a wave being sms x streams programs, each streaming an equal
    K / split x BLOCK_N share of B), plus the partial sums written and read back when split."""
    tiles = -(-N // block_n)
    slots = sms * streams
    waves = -(-(tiles * split) // slots)
    stream = waves * slots * (K / split) * block_n * itemsize
    return stream + (8 * split * M * N if split > 1 else 0)


def skinny_split(M: int, N: int, K: int, itemsize: int, block_n: int, block_k: int, sms: int, streams: int) -> int:
    """The split of K with the least split_cost_bytes (the smaller on a tie), among those from 1
    to MAX_SPLIT_K that leave every run at least MIN_K_TILES_PER_SPLIT k-tiles and none empty
    (runs are cdiv(k_tiles, split) long: 129 k-tiles in 32 runs of 5 would leave 6 empty)."""
    k_tiles = -(-K // block_k)
    ok = [s for s in range(1, MAX_SPLIT_K + 1)
          if s == 1 or (k_tiles // s >= MIN_K_TILES_PER_SPLIT and -(-k_tiles // -(-k_tiles // s)) == s)]
    return min(ok, key=lambda s: (split_cost_bytes(M, N, K, itemsize, block_n, s, sms, streams), s))


UNALIGNED_TILES = ((128, 32), (64, 64))   # (BLOCK_N, BLOCK_K) of 4096 elements: the same registers each


def skinny_config(M: int, N: int, K: int, itemsize: int, sms: int) -> dict:
    """The rule's config for a tall-skinny product on a GPU with `sms` SMs (only the SM count and
    the shape enter). BLOCK_M: M rounded up to a power of two, at least 16.
    Aligned B (rows of N elements a multiple of 16 bytes): a 128 x 128 tile of B (32 KB at 2
    bytes), 4 warps, 3 stages, the mask-free main loop (vector loads, cp.async ring).
    Unaligned B: 4 warps, 1 stage (nothing to pipeline), one masked loop, and a B tile of 4096
    elements (UNALIGNED_TILES): scalar loads cost ~4 registers each (64-bit address, value), so
    a small tile keeps several programs on an SM (128 registers a thread at BLOCK_M 16, ~250 at
    64: compile_check); of 128 x 32 and 64 x 64, the one whose best split costs less (the
    narrower has twice the N tiles, so it needs half the split and its partial sums).
    The split: skinny_split, summed in the kernel (fixup: one launch, which at ~25 us products
    is worth ~5 us, the lab's calibrated launch cost)."""
    aligned = rows_vectorizable(N, itemsize)
    bm = max(16, 1 << (max(M, 1) - 1).bit_length())
    streams = streams_per_sm(aligned, bm)

    def best(tile):
        bn, bk = tile
        split = skinny_split(M, N, K, itemsize, bn, bk, sms, streams)
        return split_cost_bytes(M, N, K, itemsize, bn, split, sms, streams), bn, bk, split
    _, bn, bk, split = min((best(t) for t in ([(128, 128)] if aligned else UNALIGNED_TILES)),
                           key=lambda c: (c[0], -c[1]))
    return {"kernel": "skinny", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split,
            "num_warps": 4, "num_stages": 3 if aligned else 1, "mask_free_main": aligned, "fixup": True}


def skinny_candidates(M: int, N: int, K: int, itemsize: int, sms: int) -> list[dict]:
    """The rule's pick first, then neighbours the tuner may prefer on the GPU at hand: half and
    twice the split, the partials summed by a second kernel, and one stage more (aligned B) or
    the other B tile with its own split (unaligned B). No duplicates."""
    pick = skinny_config(M, N, K, itemsize, sms)
    k_tiles = -(-K // pick["BLOCK_K"])
    twice = min(2 * pick["SPLIT_K"], max(1, k_tiles // MIN_K_TILES_PER_SPLIT), MAX_SPLIT_K)
    out = [pick, {**pick, "SPLIT_K": max(1, pick["SPLIT_K"] // 2)}, {**pick, "SPLIT_K": twice},
           {**pick, "fixup": False}]
    if pick["mask_free_main"]:
        out.append({**pick, "num_stages": 4})
    else:
        bn, bk = next(t for t in UNALIGNED_TILES if t != (pick["BLOCK_N"], pick["BLOCK_K"]))
        split = skinny_split(M, N, K, itemsize, bn, bk, sms, streams_per_sm(False, pick["BLOCK_M"]))
        out.append({**pick, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split})
    unique = []
    for c in out:
        if c not in unique:
            unique.append(c)
    return unique


# ------------------------------------------------------------------------------ the call
def alignment(stride: int) -> int:
    """The largest power of two <= 16 dividing a row stride (elements): what the kernel may promise
    Triton about row starts."""
    return min(16, stride & -stride) if stride > 0 else 1


def launch_skinny(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, parts: torch.Tensor, cfg: dict,
                  counters: torch.Tensor | None = None) -> None:
    """The matmul kernel alone: C (SPLIT_K == 1), or the fp32 partial sums in `parts` (split_k x
    M x N), and C too when `counters` are given (the in-kernel ordered sum)."""
    (M, K), N = a.shape, b.shape[1]
    split_k = cfg["SPLIT_K"]
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), split_k)
    skinny_matmul_kernel[grid](a, b, out, parts, counters if counters is not None else parts, M, N, K,
                               a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
                               BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                               SPLIT_K=split_k, A_ALIGN=alignment(a.stride(0)), B_ALIGN=alignment(b.stride(0)),
                               C_ALIGN=alignment(out.stride(0)), MASK_FREE_MAIN=cfg["mask_free_main"],
                               FIXUP=counters is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def skinny_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, cfg: dict) -> torch.Tensor:
    """C = A @ B with the tall-skinny kernel, for 2-D operands of one dtype at any strides; B is
    read in place, never copied. A split K is summed in the kernel where cfg["fixup"] and tile
    counters can be had (split_k_sum.tile_counters), else by a second kernel: the same order, the
    same bits. Refuses an M its one tile row cannot hold."""
    require(a, b)
    M, N = a.shape[0], b.shape[1]
    if M > cfg["BLOCK_M"]:
        raise ValueError(f"skinny_matmul: M = {M} exceeds the config's BLOCK_M = {cfg['BLOCK_M']} (one tile row)")
    split_k = cfg["SPLIT_K"]
    parts = partial_sums(M, N, split_k, a.device)
    counters = tile_counters(a.device, triton.cdiv(N, cfg["BLOCK_N"])) if split_k > 1 and cfg.get("fixup") else None
    launch_skinny(a, b, out, parts, cfg, counters)
    if split_k > 1 and counters is None:
        sum_splits(parts, out, split_k)
    return out


def launches(cfg: dict) -> int:
    """Kernels one call starts: the matmul, and the sum of the partials when K is split and not
    summed in the kernel."""
    return 1 if cfg["SPLIT_K"] == 1 or cfg.get("fixup") else 2
