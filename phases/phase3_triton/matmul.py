"""Exercise 3.3: a tiled Triton matmul, configs by rule of the shape and GPU, against cuBLAS.

    lab run phase3.matmul [--param sizes=[8192] --param dtypes=[bf16]]
    lab run phase3.matmul --param sizes=[8192] --param shapes=13x4096x14336,5000x6001x4104

`shapes` (MxNxK,...) times both kernels and cuBLAS at your own products too, after the N x N x N
sizes. Both kernels take any shape: where K or N is not a multiple of 8 at 2 bytes, A or B is first
copied into 16-byte rows (tma_padding.py; triton_tma always, triton by its rule's `pad_rows`), and
the row counts the copy's bytes and launch. Except the plain `triton` row of a tall-skinny product
(M <= 64) whose B rows are not 16-byte aligned: bound by reading B, it runs skinny_matmul.py, which reads B in place (masked loads,
split-K by rule) and copies nothing.

C = A @ B (N x N) costs 2 N^3 FLOPs and must move 3 N^2 x 2 bytes: intensity N/3 FLOP/byte, far
right of the ridge. Keeping the tensor cores fed is a data-movement problem one level down:
* Tiling: a BLOCK_M x BLOCK_N tile of C per program, walking K in BLOCK_K steps; each element
  loaded is used 2·BLOCK_M·BLOCK_N / (BLOCK_M + BLOCK_N) times, which is still left of a Hopper's
  ridge from HBM, so most tiles must come from L2.
* Grouped program order (GROUP_M): concurrent programs share A and B tiles, so L2 serves the re-reads.
* Pipelining (num_stages): the loads of the next K steps are in flight while the tensor cores work.
* TMA and persistence (`triton_tma`): hardware tile copies from a descriptor, bounds-checked, no
  address math or masks; one program per SM loops over tiles, overlapping a tile's epilogue with
  the next tile's loads.
* Edges: a tile wholly inside C runs an unmasked loop; only the last tile row and column mask
  their loads, and the K tail is one masked step after the loop (TMA zero-fills instead).
* Unaligned rows (K or N not a multiple of 8 at 2 bytes): neither a descriptor nor a vector load
  can take them, so the operand is copied once into rows padded to 16 bytes (tma_padding.py) and
  the fast loop runs; C keeps the caller's shape (masked pointer stores where its rows are odd).
* Tall-skinny (M <= 64, plain kernel, B rows unaligned): skinny_matmul.py, one tile row, B streamed once by every SM.
* Split-K: when the tiles leave SMs idle (tall-skinny M <= 64: fewer than two waves; else one),
  K is cut into runs whose fp32 partial sums a second kernel adds in a fixed order (deterministic,
  no atomics).
The config is a rule of (M, N, K, element size, SM count, shared memory): `config_for`; the run
times the rule's pick and a neighbour or two (`candidates`) and keeps the fastest (common.triton_tuner.tune;
`--param tune=false`: the rule's pick alone);
the record keeps every candidate's time and the rule's pick.
"""
import torch

from common.checks import CHECK_CHUNK, TORCH_DTYPES
from common.exercise import Exercise, Needs, Result, Work, measure, reference_check
from common.matmul_shapes import Shapes, parse_shapes
from common.params import Bool, Choice, Int
from common.standalone import run_alone
from common.triton_shim import ensure_allocator, interpreting, require, sm_count, tl, triton
from common.triton_tuner import label, launch_options, tune, tuning_summary
from common.variant_rows import attempt, compare_to_library, skipped

from . import counts
from .skinny_matmul import MAX_SPLIT_K as SKINNY_MAX_SPLIT_K
from .skinny_matmul import is_tall_skinny, skinny_candidates, skinny_config, skinny_matmul, takes_skinny
from .skinny_matmul import launches as skinny_launches
from .split_k_sum import partial_sums, split_k_bytes, sum_splits
from .tma_padding import TMA_ROW_BYTES, padded_for_tma, padding_bytes, tma_readable


# ------------------------------------------------------------------------------ kernels
EDGE_STAGES: tl.constexpr = tl.constexpr(2)   # pipeline depth of matmul_kernel's masked edge-column loop
@triton.jit
def tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M tile rows go down one column band together before moving right."""
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (tile // tiles_per_group) * GROUP_M
    rows_here = min(num_pid_m - first_m, GROUP_M)           # the last group may be shorter
    pid_m = first_m + (tile % tiles_per_group) % rows_here
    pid_n = (tile % tiles_per_group) // rows_here
    return pid_m, pid_n


@triton.jit
def k_tile_range(split, K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """Split `split` of SPLIT_K takes k-tiles [lo, hi) of cdiv(K, BLOCK_K), in equal runs (the
    last runs may be short or empty: lo == hi)."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    lo = tl.minimum(split * per_split, k_tiles)
    return lo, tl.minimum(lo + per_split, k_tiles)


@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, part_ptr, M, N, K,
                  stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  SPLIT_K: tl.constexpr, A_ALIGN: tl.constexpr, B_ALIGN: tl.constexpr, C_ALIGN: tl.constexpr,
                  EVEN_N: tl.constexpr, SHIFT_N: tl.constexpr, n_read):
    """One BLOCK_M x BLOCK_N tile of C and one of SPLIT_K runs of K per program (grid: tiles x
    SPLIT_K). No mask in the main loop of a tile wholly inside C: rows of A past M are clamped to
    row M - 1 (A is contiguous along K, so its loads stay vectorized; those rows of C are not
    stored). The last tile column, where N % BLOCK_N != 0:
    - SHIFT_N (> 0, the column alignment in elements): the tile starts early enough to end at
      `n_read` (N rounded up to SHIFT_N, columns every row of B holds: shift_columns()), on a
      multiple of SHIFT_N so B's loads stay vectorized; it reads B unmasked and stores only its
      columns past the tile column before it, below N. One loop is compiled;
    - else a second, masked copy of the loop, pipelined less deeply (EDGE_STAGES) so the two fit
      the shared memory; that copy alone costs the main loop's speed in every tile (registers
      and code for both), which is why the shift exists. matmul() shifts tiles at most
      SHIFT_MAX_BLOCK_N wide: at 128x256 the shifted loop measured slower than the masked one,
      and neither reaches the EVEN_N loop's speed (the irregular-N gap is still open).
    The last partial k-tile (K % BLOCK_K) is one masked step after the loop. SPLIT_K > 1 writes fp32
    partial sums to part[split] (summed in a fixed order by sum_splits_kernel: deterministic).
    *_ALIGN: the power of two (<= 16) each row stride is a multiple of: Triton infers it only for
    strides divisible by 16, so K = 4104 would otherwise lose A's vector loads (alignment()).
    EVEN_N (N % BLOCK_N == 0): no tile column reaches past N, so no edge path is compiled at all.
    """
    pid_m, pid_n = tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    split = tl.program_id(1)
    lo, hi = k_tile_range(split, K, BLOCK_K, SPLIT_K)
    full_hi = tl.minimum(hi, K // BLOCK_K)             # k-tiles with no K tail in them
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    first_n = pid_n * BLOCK_N                          # the first column this tile stores
    if SHIFT_N:
        offs_n = tl.multiple_of(tl.minimum(first_n, n_read - BLOCK_N), SHIFT_N) + tl.arange(0, BLOCK_N)
    else:
        offs_n = first_n + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_a = tl.minimum(offs_m, M - 1)
    a_rows = tl.multiple_of(rows_a * stride_am, A_ALIGN)
    b_rows = tl.multiple_of((lo * BLOCK_K + offs_k) * stride_bk, B_ALIGN)
    a_ptrs = a_ptr + a_rows[:, None] + (lo * BLOCK_K + offs_k)[None, :] * stride_ak
    b_ptrs = b_ptr + b_rows[:, None] + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)   # accumulate in fp32 whatever the inputs
    in_m = offs_m[:, None] < M
    in_n = offs_n[None, :] < N
    if EVEN_N or SHIFT_N or (pid_n + 1) * BLOCK_N <= N:   # every column read inside B's rows: no masks
        for _ in range(lo, full_hi):
            acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    else:
        for _ in tl.range(lo, full_hi, num_stages=EDGE_STAGES):   # the last tile column: B's columns masked
            acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs, mask=in_n, other=0.0), acc)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    if (full_hi < hi) & (lo < hi):                     # the K tail, in the run that holds it
        k_left = K - full_hi * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & in_n, other=0.0)
        acc = tl.dot(a, b, acc)
    mine = in_m & in_n
    if SHIFT_N:                                        # the columns the tile column before stores: not ours
        mine &= offs_n[None, :] >= first_n
    if SPLIT_K == 1:
        c_ptrs = c_ptr + tl.multiple_of(offs_m * stride_cm, C_ALIGN)[:, None] + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mine)
    else:
        p_ptrs = part_ptr + tl.multiple_of((split * M + offs_m) * N, C_ALIGN)[:, None] + offs_n[None, :]
        tl.store(p_ptrs, acc, mask=mine)


@triton.jit
def matmul_tma_kernel(a_ptr, b_ptr, c_ptr, part_ptr, M, N, K, stride_am, stride_bk, stride_cm, stride_cn,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      SPLIT_K: tl.constexpr, NUM_PROGRAMS: tl.constexpr, SPLIT_EPILOGUE: tl.constexpr,
                      FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, C_TMA: tl.constexpr):
    """Persistent: program p computes work units p, p + NUM_PROGRAMS, ..., a unit being one tile
    and one of SPLIT_K runs of K. A and B are read through TMA descriptors built on the device
    (row pitches stride_am, stride_bk: multiples of 16 bytes, tma_padding sees to it); rows,
    columns and K past the shape read as zeros, so no masks. C goes out through a descriptor too
    when C_TMA (its rows 16-byte aligned), else through a masked pointer store at its own strides.
    SPLIT_K > 1 stores fp32 partial sums to part[split] (masked stores), summed by
    sum_splits_kernel. SPLIT_EPILOGUE stores C in two halves to halve its shared-memory buffer."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_bk, 1], block_shape=[BLOCK_K, BLOCK_N])
    if C_TMA:
        if SPLIT_EPILOGUE:
            c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1],
                                               block_shape=[BLOCK_M, BLOCK_N // 2])
        else:
            c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1],
                                               block_shape=[BLOCK_M, BLOCK_N])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for unit in tl.range(tl.program_id(0), num_pid_m * num_pid_n * SPLIT_K, NUM_PROGRAMS,
                         flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = tile_coords(unit // SPLIT_K, num_pid_m, num_pid_n, GROUP_M)
        split = unit % SPLIT_K
        lo, hi = k_tile_range(split, K, BLOCK_K, SPLIT_K)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(lo, hi):
            a = a_desc.load([off_m, ki * BLOCK_K])
            b = b_desc.load([ki * BLOCK_K, off_n])
            acc = tl.dot(a, b, acc)
        if SPLIT_K > 1:
            offs_m = off_m + tl.arange(0, BLOCK_M)
            offs_n = off_n + tl.arange(0, BLOCK_N)
            tl.store(part_ptr + (split * M + offs_m[:, None]) * N + offs_n[None, :], acc,
                     mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
        elif not C_TMA:
            offs_m = off_m + tl.arange(0, BLOCK_M)
            offs_n = off_n + tl.arange(0, BLOCK_N)
            tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
                     mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
        elif SPLIT_EPILOGUE:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            c0, c1 = tl.split(halves)
            c_desc.store([off_m, off_n], c0.to(c_desc.dtype))
            c_desc.store([off_m, off_n + BLOCK_N // 2], c1.to(c_desc.dtype))
        else:
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


# ------------------------------------------------------------------------------ configs: a rule, not a table
SMEM_BYTES_DEFAULT = 227 * 1024        # Hopper's per-block limit; the interpreter and CPU compile checks use it
MAX_SPLIT_K = 16
SHIFT_MAX_BLOCK_N = 128                # wider tiles keep the masked edge loop (shifted 128x256 tiles measured far slower)
MIN_K_TILES_PER_SPLIT = 4              # fewer and the partial sums' traffic outweighs what the split buys


def _cfg(bm, bn, bk, warps, stages, split_k=1, group_m=8, **extra):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "SPLIT_K": split_k,
            "num_warps": warps, "num_stages": stages, **extra}


def split_k_for(M: int, N: int, K: int, itemsize: int, tiles: int, k_tiles: int, sms: int) -> int:
    """How many runs to cut K into so that the work units (tiles x split) fill the GPU: two waves
    for a tall-skinny product (M <= 64: bound by streaming B, so twice the loads in flight), one
    for any other; 1 when the tiles alone do that. Of the splits from the fewest that reach the
    target up to twice that, the one whose last wave leaves the fewest SMs idle (the smaller on
    a tie). Each run keeps at least MIN_K_TILES_PER_SPLIT k-tiles, and the fp32 partial sums
    (written and read back: 8 bytes per element of C per split) stay within a quarter of the
    bytes of A and B, so a split never costs more traffic than it hides (N = 1024 squares are not
    split; 13 x 4096 x 14336 is)."""
    target = (2 if M <= 64 else 1) * sms
    if tiles >= target:
        return 1
    by_traffic = (M * K + K * N) * itemsize // (4 * 8 * M * N)
    most = max(1, min(MAX_SPLIT_K, k_tiles // MIN_K_TILES_PER_SPLIT, by_traffic))
    fewest = min(-(-target // tiles), most)

    def wave_fill(split: int) -> float:
        units = tiles * split
        return units / (-(-units // sms) * sms)
    return max(range(fewest, min(most, 2 * fewest) + 1), key=lambda split: (wave_fill(split), -split))


def stages_for(bm: int, bn: int, bk: int, itemsize: int, smem_bytes: int, most: int = 5) -> int:
    """As many pipeline stages of (A BM x BK + B BK x BN) as the shared memory holds, leaving room
    for the epilogue's staging of C (BM x BN at the output's itemsize), between 2 and `most`.
    (matmul_kernel's edge-column loop reuses the main loop's buffers: compile_check shows it.)"""
    stage = (bm * bk + bk * bn) * itemsize
    fit = (smem_bytes - bm * bn * itemsize) // stage
    return int(max(2, min(most, fit)))


def fills_twice_at_256(M: int, N: int, sms: int) -> bool:
    """128 x 256 tiles cover the SMs at least twice: a wide tile loses no SMs to the last wave."""
    return -(-M // 128) * -(-N // 256) >= 2 * sms


def config_for(M: int, N: int, K: int, itemsize: int, sms: int, smem_bytes: int = SMEM_BYTES_DEFAULT,
               tma: bool = False) -> dict:
    """The config the rule picks for C = A @ B (M x K times K x N) on a GPU with `sms` SMs:
    - M <= 64 (tall-skinny, bound by reading B): BLOCK_M = M rounded up to a power of two (at
      least 16, tl.dot's minimum), BLOCK_N 128 (64 when even that leaves SMs idle), BLOCK_K 128
      so each load is long, 4 warps;
    - otherwise 128-row tiles, BLOCK_K 64 (128 bytes: one swizzle line), 8 warps: 128 x 256 (two
      wgmma warpgroups) for the TMA kernel when they fill the SMs at least twice over, else 128 x
      128. The plain kernel stays at 128 x 128: its loads are per-thread pointers and masks held in
      registers for every stage in flight, beside a 128 x 256 fp32 accumulator that alone takes
      128 of each thread's registers at 8 warps; the TMA kernel's loads are descriptors and take
      none (compile_check at N = 8192: 214 registers a thread for the plain kernel's 128 x 256, 154
      for the TMA kernel's). The plain kernel's tuner still times 128 x 256 beside it (candidates);
    then split-K when the tiles leave SMs idle (fewer than two waves of them when tall-skinny:
    split_k_for), stages from the shared memory left. The plain kernel's config says pad_rows:
    an operand whose rows are not 16-byte aligned is copied into padded rows first (as
    matmul_tma's always are): unaligned rows cost it its vector loads and, at 128 x 256 tiles,
    spill registers (compile_check: 255 registers and 8 KB spilled at N = 5003 unpadded, none
    padded), so the unpadded form is no candidate either.
    Depends only on the shape, the element size and the GPU, so any shape gets a reasoned config.
    The plain kernel's tall-skinny products (M <= 64) with unaligned B rows are skinny_matmul's
    instead: B read in place by masked loads, never copied (skinny_matmul.takes_skinny, skinny_config)."""
    if not tma and takes_skinny(M, N, itemsize):
        return skinny_config(M, N, K, itemsize, sms)
    if M <= 64:
        bm = max(16, 1 << (M - 1).bit_length())
        bn = 128 if -(-N // 128) * 2 >= sms or N <= 64 else 64
        bk = 128 if K >= 128 else 64
        warps = 4
    else:
        bm = 128
        bn = 256 if tma and fills_twice_at_256(M, N, sms) else 128
        bk = 64
        warps = 8
    tiles = -(-M // bm) * -(-N // bn)
    split = split_k_for(M, N, K, itemsize, tiles, -(-K // bk), sms)
    stages = stages_for(bm, bn, bk, itemsize, smem_bytes, most=4 if bn == 256 else 5)
    cfg = _cfg(bm, bn, bk, warps, stages, split)
    if tma:
        cfg.update(split=bn == 256, flatten=True, ws=False)
    else:
        cfg["pad_rows"] = True
    return cfg


def candidates(M: int, N: int, K: int, itemsize: int, sms: int, smem_bytes: int = SMEM_BYTES_DEFAULT,
               tma: bool = False, warp_specialize: bool = False) -> list[dict]:
    """The rule's pick first, then its neighbours the tuner may prefer on this GPU: one stage less;
    for the plain kernel, where 128 x 256 tiles would fill the SMs twice, that wider tile (so a GPU
    with more registers per thread can still show it wins); for the TMA kernel the warp-specialized
    form (4 warps: one producer, two consumer groups; Triton builds it only for an unflattened loop
    and a single epilogue store). No duplicates. The plain kernel's tall-skinny products:
    skinny_candidates."""
    if not tma and takes_skinny(M, N, itemsize):
        return skinny_candidates(M, N, K, itemsize, sms)
    pick = config_for(M, N, K, itemsize, sms, smem_bytes, tma)
    out = [pick, {**pick, "num_stages": max(2, pick["num_stages"] - 1)}]
    if not tma and M > 64 and fills_twice_at_256(M, N, sms):
        wide = _cfg(128, 256, 64, 8, stages_for(128, 256, 64, itemsize, smem_bytes, most=4), pick["SPLIT_K"])
        out.append({**wide, "pad_rows": True})
    if tma and warp_specialize and pick["BLOCK_M"] >= 64:
        out.append({**pick, "num_warps": 4, "split": False, "flatten": False, "ws": True})
    unique = []
    for c in out:
        if c not in unique:
            unique.append(c)
    return unique


# The interpreter runs numpy per program: small tiles keep the CPU tests quick (the rule's own
# picks are tested too, on shapes small enough for them).
INTERPRETER_CONFIG = _cfg(64, 64, 32, 4, 1)
INTERPRETER_TMA_CONFIG = _cfg(32, 32, 32, 4, 1, split=True, flatten=True, ws=False)


def interpreter_config(M: int, N: int, K: int, itemsize: int, tma: bool) -> dict:
    """What the interpreter runs: the small fixed tiles, or at M <= 64 (plain kernel) the
    tall-skinny rule itself on a 4-SM GPU (its tiles are small enough for numpy)."""
    if tma:
        return INTERPRETER_TMA_CONFIG
    return skinny_config(M, N, K, itemsize, 4) if is_tall_skinny(M) else INTERPRETER_CONFIG


def alignment(stride: int) -> int:
    """The largest power of two <= 16 that divides a row stride (in elements): what the kernel may
    promise Triton about row starts (the base pointers' 16-byte alignment Triton checks itself)."""
    return min(16, stride & -stride) if stride > 0 else 1


def launches(cfg: dict) -> int:
    """Kernels one call starts: the matmul, and the sum of the partial products when K is split
    (the skinny kernel's own count: it may sum them itself)."""
    if cfg.get("kernel") == "skinny":
        return skinny_launches(cfg)
    return 1 if cfg.get("SPLIT_K", 1) == 1 else 2


def default_config(a: torch.Tensor, b: torch.Tensor, tma: bool = False) -> dict:
    """The rule's config for these operands on their device (small fixed tiles in the interpreter)."""
    if interpreting():
        return interpreter_config(a.shape[0], b.shape[1], a.shape[1], a.element_size(), tma)
    props = torch.cuda.get_device_properties(a.device)
    smem = getattr(props, "shared_memory_per_block_optin", SMEM_BYTES_DEFAULT)
    return config_for(a.shape[0], b.shape[1], a.shape[1], a.element_size(), sm_count(a.device), smem, tma)


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, config: dict | None = None):
    """C = A @ B for 2-D tensors of one dtype (any strides), accumulated in fp32. `config` defaults
    to the rule's pick for this shape and GPU (config_for); with pad_rows, A or B whose rows are
    not 16-byte aligned is copied into padded rows first (tma_padding), as matmul_tma does."""
    require(a, b)
    assert a.ndim == b.ndim == 2 and a.shape[1] == b.shape[0] and a.dtype == b.dtype
    (M, K), N = a.shape, b.shape[1]
    out = torch.empty((M, N), device=a.device, dtype=a.dtype) if out is None else out
    cfg = config or default_config(a, b)
    if cfg.get("kernel") == "skinny":                 # B read in place: no padding copy
        return skinny_matmul(a, b, out, cfg)
    if copies_operands(cfg, tma=False):
        a, b = padded_for_tma(a), padded_for_tma(b)
    split_k = cfg.get("SPLIT_K", 1)
    parts = partial_sums(M, N, split_k, a.device)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]), split_k)
    even_n = N % cfg["BLOCK_N"] == 0
    shifts = not even_n and cfg["BLOCK_N"] <= SHIFT_MAX_BLOCK_N
    shift, n_read = shift_columns(b, cfg["BLOCK_N"]) if shifts else (0, N)
    matmul_kernel[grid](a, b, out, parts, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                        out.stride(0), out.stride(1),
                        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
                        SPLIT_K=split_k, A_ALIGN=alignment(a.stride(0)), B_ALIGN=alignment(b.stride(0)),
                        C_ALIGN=alignment(out.stride(0) if split_k == 1 else N), EVEN_N=even_n,
                        SHIFT_N=shift, n_read=n_read, **launch_options(cfg))
    if split_k > 1:
        sum_splits(parts, out, split_k)
    return out


def shift_columns(b: torch.Tensor, block_n: int) -> tuple[int, int]:
    """(alignment, n_read) for matmul_kernel's shifted last tile column, or (0, N) where B cannot
    take it. n_read is N rounded up to 16 bytes of columns; every row of B must hold that many
    (unit column stride, a row pitch that is a multiple of 16 bytes and at least n_read, the last
    row's too inside B's storage: a padded copy's always do), and the tile must fit (n_read >=
    BLOCK_N). The few columns read past N are never stored."""
    K, N = b.shape
    align = TMA_ROW_BYTES // b.element_size()
    n_read = -(-N // align) * align
    pitch = b.stride(0)
    end_bytes = (b.storage_offset() + max(K - 1, 0) * pitch + n_read) * b.element_size()
    if (b.stride(1) != 1 or pitch % align or pitch < n_read or n_read < block_n
            or end_bytes > b.untyped_storage().nbytes()):
        return 0, N
    return align, n_read


def copies_operands(cfg: dict, tma: bool) -> bool:
    """Whether a call with this config copies unaligned operands into padded rows: matmul_tma's
    always do, the plain kernel's when its config says pad_rows (config_for's do)."""
    return tma or cfg.get("pad_rows", False)


def row_bytes(m: int, n: int, k: int, itemsize: int, cfg: dict, tma: bool) -> int:
    """The bytes one call moves through device memory: A, B and C once each, the padding copies
    where the config makes them, and split-K's fp32 partial sums (written and read back)."""
    pad_bytes = padding_cost(m, n, k, itemsize)[0] if copies_operands(cfg, tma) else 0
    return (m * k + k * n + m * n) * itemsize + pad_bytes + split_k_bytes(m, n, cfg.get("SPLIT_K", 1))


def padded_operands(a: torch.Tensor, b: torch.Tensor) -> str:
    """Which of A and B a padding call copies into 16-byte rows first ("A", "B", "A,B" or "")."""
    return ",".join(name for name, t in (("A", a), ("B", b)) if not tma_readable(t))


def padding_cost(m: int, n: int, k: int, itemsize: int) -> tuple[int, int]:
    """(bytes, launches) of the padding copies for contiguous M x K and K x N operands:
    an operand whose rows (K or N elements) are not a multiple of 16 bytes is copied, read and
    written once, in one kernel."""
    padded = [(rows, cols) for rows, cols in ((m, k), (k, n)) if (cols * itemsize) % TMA_ROW_BYTES]
    return sum(padding_bytes(rows, cols, itemsize) for rows, cols in padded), len(padded)


def matmul_tma(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, config: dict | None = None):
    """C = A @ B through TMA descriptors in a persistent kernel, at any shape and strides: an
    operand whose rows are not 16-byte aligned (or not row-major) is copied once into padded rows
    first (tma_padding; the copy is part of each call, and of the row's bytes). C keeps the
    caller's shape: a C whose rows are not 16-byte aligned is written by masked pointer stores
    (no padded C and no copy back: the same bytes, in narrower stores, and no second pass).
    `config` defaults to the rule's pick (config_for(..., tma=True))."""
    require(a, b)
    assert a.ndim == b.ndim == 2 and a.shape[1] == b.shape[0] and a.dtype == b.dtype
    (M, K), N = a.shape, b.shape[1]
    out = torch.empty((M, N), device=a.device, dtype=a.dtype) if out is None else out
    cfg = config or default_config(a, b, tma=True)
    a, b = padded_for_tma(a), padded_for_tma(b)
    ensure_allocator(a.device)
    split_k = cfg.get("SPLIT_K", 1)
    parts = partial_sums(M, N, split_k, a.device)
    units = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]) * split_k
    programs = min(sm_count(a.device), units)
    matmul_tma_kernel[(programs,)](a, b, out, parts, M, N, K, a.stride(0), b.stride(0), out.stride(0), out.stride(1),
                                   BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                                   GROUP_M=cfg["GROUP_M"], SPLIT_K=split_k, NUM_PROGRAMS=programs,
                                   SPLIT_EPILOGUE=cfg["split"], FLATTEN=cfg["flatten"], WARP_SPECIALIZE=cfg["ws"],
                                   C_TMA=tma_readable(out), **launch_options(cfg))
    if split_k > 1:
        sum_splits(parts, out, split_k)
    return out


# ------------------------------------------------------------------------------ reference and check
REFERENCE = "float64 matmul of the same inputs"


VARIANTS = ("cublas", "triton", "triton_tma")
NOMINAL_SMS = 132                  # H100 / H200 SXM: what work() (no GPU at hand) assumes for the split-K rule


def timed_shapes(params) -> list[tuple[int, int, int]]:
    """The products run() times, in order: each N of `sizes` as N x N x N, then `shapes`."""
    return [(n, n, n) for n in params["sizes"]] + (parse_shapes(params["shapes"]) if params.get("shapes") else [])


def shape_label(m: int, n: int, k: int) -> str:
    return f"n={n}" if m == n == k else f"{m}x{n}x{k}"


def shape_params(m: int, n: int, k: int, dtype: str) -> dict:
    """A row's params: {"n", "dtype"} at N x N x N (the report's tables), M, N and K at a user's shape."""
    return {"n": n, "dtype": dtype} if m == n == k else {"m": m, "n": n, "k": k, "dtype": dtype}


def work(params) -> list[Work]:
    """Every row run() times: per dtype and shape, cuBLAS and the two Triton kernels, one problem
    each. A Triton row is two launches where the rule splits K (on a 132-SM GPU: the row itself
    records what ran on the GPU it ran on) and adds the partial sums' bytes (row_bytes); it adds
    its padding copies' bytes and launches at shapes whose rows are not 16-byte aligned, except
    the plain kernel's tall-skinny rows (M <= 64), which read B in place."""
    out = []
    for dtype in params["dtypes"]:
        for m, n, k in timed_shapes(params):
            c = counts.matmul_count(m, n, k, dtype)
            itemsize = TORCH_DTYPES[dtype].itemsize
            out.append(Work(f"cublas {dtype} {shape_label(m, n, k)}", c.flops, c.bytes, c.dtype))
            for variant in VARIANTS[1:]:
                tma = variant == "triton_tma"
                pick = config_for(m, n, k, itemsize, NOMINAL_SMS, tma=tma)
                pad_launches = padding_cost(m, n, k, itemsize)[1] if copies_operands(pick, tma) else 0
                out.append(Work(f"{variant} {dtype} {shape_label(m, n, k)}", c.flops,
                                row_bytes(m, n, k, itemsize, pick, tma), c.dtype, launches=launches(pick) + pad_launches))
    return out


# ------------------------------------------------------------------------------ the exercise
MAX_N = 46340                      # N x N < 2^31: matmul_kernel's offsets (row x stride) are 32-bit


def footprint_bytes(p: dict) -> int:
    """A, B, C and the float64 reference at the largest product, plus the reference's float64
    inputs or a check chunk, plus split-K's fp32 partial sums (at most MAX_SPLIT_K x M x N) and
    the Triton kernels' padded copies of A and B (rows up to 16 bytes longer)."""
    itemsize = max(TORCH_DTYPES[d].itemsize for d in p["dtypes"])

    def at(m: int, n: int, k: int) -> int:
        ins, mn = m * k + k * n, m * n
        parts = 4 * max(MAX_SPLIT_K, SKINNY_MAX_SPLIT_K) * mn if m * n < NOMINAL_SMS * 128 * 256 else 0
        padded = m * (k + 16) + k * (n + 16)
        return itemsize * (ins + mn + padded) + 8 * mn + max(8 * ins, 3 * 8 * min(mn, CHECK_CHUNK)) + parts
    return max(at(*shape) for shape in timed_shapes(p))


def run(ctx, params):
    rows, tuning = [], {}
    sms = sm_count(ctx.device) if ctx.device.type == "cuda" else 4
    work = [(shape, d) for d in params["dtypes"] for shape in timed_shapes(params)]
    for (m, n, k), dtype in ctx.track(work, "matmul shapes"):
        t = TORCH_DTYPES[dtype]
        g = torch.Generator(device=ctx.device).manual_seed(n if m == n == k else (m * 131 + n) * 131 + k)
        a = torch.randn(m, k, device=ctx.device, generator=g).to(t)
        b = torch.randn(k, n, device=ctx.device, generator=g).to(t)
        c = torch.empty(m, n, device=ctx.device, dtype=t)
        ref = a.double() @ b.double()
        size = shape_params(m, n, k, dtype)
        mc = counts.matmul_count(m, n, k, dtype)      # one problem; cuBLAS is taken to start one kernel
        cost = {"flops": mc.flops, "bytes_moved": mc.bytes, "dtype": mc.dtype}
        here = []

        def check(fill):
            return reference_check(ctx, c, fill, ref, REFERENCE, precision=dtype)

        if ctx.wants("cublas"):
            here.append(attempt("cublas", size, lambda: measure(
                ctx, "cublas", size, fn=lambda: torch.matmul(a, b, out=c),
                check=check(lambda: torch.matmul(a, b, out=c)), launches=mc.launches, **cost)))
        rule = {"itemsize": t.itemsize, "sms": sms}
        if not interpreting() and ctx.device.type == "cuda":
            props = torch.cuda.get_device_properties(ctx.device)
            rule["smem_bytes"] = getattr(props, "shared_memory_per_block_optin", SMEM_BYTES_DEFAULT)
        plain = [interpreter_config(m, n, k, t.itemsize, False)] if interpreting() else candidates(m, n, k, **rule)
        tma = [INTERPRETER_TMA_CONFIG] if interpreting() else candidates(
            m, n, k, **rule, tma=True, warp_specialize=params.get("warp_specialize", False))
        if not params.get("tune", True):              # the rule's pick alone (its fallbacks kept if it fails)
            plain, tma = plain[:1], tma[:1]
        for variant, impl, cands in (("triton", matmul, plain), ("triton_tma", matmul_tma, tma)):
            if not ctx.wants(variant):
                continue
            if variant == "triton_tma" and ctx.is_rocm:
                here.append(skipped(variant, size, "TMA descriptors are NVIDIA Hopper hardware; this is a ROCm GPU"))
                continue
            def triton_row(variant=variant, impl=impl, cands=cands):
                cfg, trials = tune(ctx, (variant, m, n, k, dtype, ctx.device.type), cands,
                                   launch=lambda q: impl(a, b, c, q),
                                   check=lambda q: check(lambda: impl(a, b, c, q))())
                tuning[f"{variant} {dtype} {shape_label(m, n, k)}"] = tuning_summary(trials)
                pads = copies_operands(cfg, tma=variant == "triton_tma")
                pad_bytes, pad_launches = padding_cost(m, n, k, t.itemsize) if pads else (0, 0)
                r = measure(ctx, variant, size, fn=lambda: impl(a, b, c, cfg),
                            check=check(lambda: impl(a, b, c, cfg)), launches=launches(cfg) + pad_launches,
                            **{**cost, "bytes_moved": row_bytes(m, n, k, t.itemsize, cfg, variant == "triton_tma")})
                r["metrics"]["config"] = label(cfg)
                r["metrics"]["rule_config"] = label(cands[0])
                r["metrics"]["padded_operands"] = (padded_operands(a, b) or None) if pads else None
                r["metrics"]["padding_bytes"] = pad_bytes
                return r

            here.append(attempt(variant, size, triton_row))
        compare_to_library(here, "triton", ("cublas",), "tflops")
        compare_to_library(here, "triton_tma", ("cublas",), "tflops")
        rows += here
    return Result(rows, {"tuning": tuning})


EXERCISE = Exercise(
    id="phase3.matmul", title="Tiled Triton matmul (plain and TMA-persistent), configs by rule, vs cuBLAS, fp16 and bf16",
    run=run, needs=Needs(cuda=True, modules=("triton",)),
    params={"sizes": Int([1024, 2048, 4096, 8192], min=1, max=MAX_N, unit="N of an N x N x N product", many=True),
            "dtypes": Choice(["bf16", "fp16"], ("bf16", "fp16"), many=True),
            "warp_specialize": Bool(False, help="also tune the warp-specialized TMA configs (they return NaN with Triton 3.6 on an H200: off by default)"),
            "tune": Bool(True, help="time the rule's neighbouring configs too and keep the fastest; "
                                    "false: time the rule's pick alone"),
            "shapes": Shapes()},
    cpu_params={"sizes": [256], "dtypes": ["fp16"]},
    quick_params={"sizes": [256], "dtypes": ["bf16"]},
    variants=VARIANTS, footprint_bytes=footprint_bytes, work=work)


if __name__ == "__main__":
    run_alone(EXERCISE, {"sizes": [200], "dtypes": ["fp16"], "shapes": "13x300x520,200x136x264"})
