"""W4A16 and W8A16 matmuls that dequantize in registers: y [M, N] = x [M, K] @ W^T, with W held in
weight_formats.py's layouts (int4: int32 [N, ceil(K/8)] packed along K, scales and zero points
[groups, N]; int8: int8 [N, K] and a scale per row). Decode reads every weight once per step, so a
kernel that reads 0.5 or 1 byte per weight instead of 2 is up to 4x or 2x faster, provided the
unpacking costs less time than the bytes it saved; the naive path (dequantize to bf16 in memory,
then cuBLAS) pays the full 2 bytes and more.

One kernel per format, two shapes of use, chosen by `default_config`:
  GEMV-shaped (M <= GEMV_MAX_M): a program owns BLOCK_N output rows (all M activation rows) and one
      K range; it streams its rows' packed words tile by tile. One row (and int4's BLOCK_M of 2, 4
      or 8 rows, dequantized once per program) multiplies on the CUDA cores, the next tile's words
      loaded while this one is computed (PREFETCH); more rows use tl.dot on a 16-row tile (the
      padding rows cost no memory traffic).
      When cdiv(N, BLOCK_N) programs are too few to fill the GPU, K is split across programs
      (split-K): each writes an fp32 partial [SPLIT_K, M, N] and counts itself in its output
      tile's counter; the last to arrive sums the tile's partials in split order and rounds to the
      output dtype (_last_split_sums). Not fp32 atomics into the output: the sum is deterministic,
      which the engine's batch-invariance tests need; and one kernel, not a second for the sum.
  Tiled (M > GEMV_MAX_M): programs over (M tiles, N tiles), tl.dot on dequantized bf16 tiles, no split.

Dequantization in registers, exact, and without int-to-float conversions (a quarter-rate
instruction that bound the first version): integers are placed in a float's mantissa by bit
operations (the constants passed at run time, or the compiler folds the trick back).
  int4, tl.dot: a K tile lies inside one group (BLOCK_K divides group_size); 0x4300 | q read as
      bf16 is 128 + q exactly, minus 128 + z is q − z exactly; the scale multiplies the tile's dot.
  int4, CUDA cores: nibble j read as 1 + q/16 (fp32), scale and zero point per word, so a tile
      may span several groups (BLOCK_K a multiple of group_size).
  int8: q in [−127, 127] is exact in bf16 for tl.dot; on the CUDA cores 1 + (q + 128)/256; the row
      scale multiplies the finished sum.
Accumulation is fp32. Under TRITON_INTERPRET=1 the dots run in fp32 (DOT_FP32; the interpreter's
bf16 tl.dot is wrong), as do fp32 activations on a GPU (ieee, not tf32).
"""
import torch

from common.errors import LabError
from common.triton_shim import interpreting, require, tl, triton

from .weight_formats import GROUP_SIZES, NIBBLES_PER_WORD

GEMV_MAX_M = 16
MAX_SPLIT_K = 16
DOT_MIN = 16                        # tl.dot's smallest tile side on NVIDIA GPUs
DOT_K_MIN = tl.constexpr(16)        # the same, readable inside kernels
CORE_ROWS = (1, 2, 4)               # BLOCK_M below DOT_MIN: rows multiplied on the CUDA cores
ONE_BITS = 0x3F800000                       # fp32 1.0: a value m in its top mantissa bits reads as 1 + m/2^k
MANTISSA_TOP = tl.constexpr(19)             # a nibble in fp32 bits 19..22 reads as 1 + q/16
NIBBLE_AT_TOP = tl.constexpr(0xF << 19)


@triton.jit
def _store_partial(out_ptr, out_split, final_ptr, counters_ptr, tile, offsets, mask, values, n_splits, stride_split,
                   FIXUP: tl.constexpr):
    """Store a program's result (its split's partial, or the output when K is not split) and,
    with FIXUP, take part in its tile's split sum."""
    tl.store(out_split + offsets, values.to(out_ptr.dtype.element_ty), mask=mask)
    if FIXUP:
        _last_split_sums(out_ptr, final_ptr, counters_ptr, tile, offsets, mask, n_splits, stride_split)


@triton.jit
def _int4_tile_scales(scales_ptr, zeros_ptr, k0, words_in_tile, rows_n, n_ok, word_ok, N,
                      GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """(scale, zero point) of every word of a K tile, fp32, shaped to broadcast over [BLOCK_N,
    BLOCK_K // 8]: [BLOCK_N, 1] when the tile lies inside one group, else one per word."""
    if BLOCK_K <= GROUP:
        group = k0 // GROUP
        scale = tl.load(scales_ptr + group * N + rows_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        zero = tl.load(zeros_ptr + group * N + rows_n, mask=n_ok, other=0).to(tl.float32)[:, None]
    else:
        at = ((k0 + 8 * words_in_tile) // GROUP)[None, :] * N + rows_n[:, None]
        ok = n_ok[:, None] & word_ok[None, :]
        scale = tl.load(scales_ptr + at, mask=ok, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + at, mask=ok, other=0).to(tl.float32)
    return scale, zero


@triton.jit
def _last_split_sums(partials_ptr, final_ptr, counters_ptr, tile, offsets, mask, n_splits, stride_split):
    """Called by every split of an output tile once its partial is stored: the split that arrives
    last sums the tile's partials in split order (deterministic, whatever the arrival order) into
    the final output, rounded once, and sets the tile's counter back to 0 for the next call. One
    kernel instead of a second one for the sum: a decode step saves a launch per projection."""
    tl.debug_barrier()                              # every thread's partial stored before the count
    arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == n_splits - 1:
        total = tl.zeros(offsets.shape, dtype=tl.float32)
        for s in range(0, n_splits):
            total += tl.load(partials_ptr + s * stride_split + offsets, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(final_ptr + offsets, total.to(final_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(counters_ptr + tile, 0)


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, scales_ptr, zeros_ptr, out_ptr, M, N, K, n_words, k_per_split,
                  stride_xm, stride_qn, stride_om, stride_split, one_bits, magic_bits, final_ptr, counters_ptr, n_splits,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, MAGIC_DTYPE: tl.constexpr,
                  MAGIC_VALUE: tl.constexpr, PREFETCH: tl.constexpr, FIXUP: tl.constexpr):
    """out[split, m, n] = sum over this split's k of x[m, k] · (q[n, k] − z[g, n]) · s[g, n]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rows_n < N
    words_in_tile = tl.arange(0, BLOCK_K // 8)
    nibble = tl.arange(0, 8)
    shifts = nibble * 4
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(K, k_start + k_per_split)
    qw_rows = qw_ptr + rows_n[:, None].to(tl.int64) * stride_qn
    out_split = out_ptr + pid_k.to(tl.int64) * stride_split
    if USE_DOT:
        rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = rows_m < M
        x_rows = x_ptr + rows_m[:, None].to(tl.int64) * stride_xm
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_stop, BLOCK_K):
            word_cols = k0 // 8 + words_in_tile
            words = tl.load(qw_rows + word_cols[None, :], mask=n_ok[:, None] & (word_cols < n_words)[None, :],
                            other=0)
            group = k0 // GROUP
            scale = tl.load(scales_ptr + group * N + rows_n, mask=n_ok, other=0.0).to(tl.float32)
            zero = tl.load(zeros_ptr + group * N + rows_n, mask=n_ok, other=0).to(tl.float32)
            # q − z exactly, as a 16-bit float: MAGIC_VALUE + q made by ORing the nibble into the
            # mantissa (no int-to-float conversion, a quarter-rate instruction), minus MAGIC_VALUE + z
            # (both integers the 16-bit type holds exactly, so the difference is exact too)
            offset_zero = (MAGIC_VALUE + zero).to(MAGIC_DTYPE)[:, None]
            if BLOCK_K // 8 >= DOT_K_MIN and BLOCK_M <= DOT_K_MIN:
                # one dot per nibble position j over the tile's words (k = 8w + j, x gathered to
                # match): the nibbles never need reordering into k order, which on a GPU costs a
                # trip of the whole tile through shared memory. Decode-sized M only: with 64 rows
                # and more the eight gathers of x cost more than the reorder saves (an 8B decode
                # step at batch 64 took 61.6 ms this way against 14.2 ms)
                part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for j in tl.static_range(8):
                    cols = word_cols * 8 + j
                    x = tl.load(x_rows + cols[None, :], mask=m_ok[:, None] & (cols < K)[None, :], other=0.0)
                    offset_q = (((words >> (4 * j)) & 0xF) | magic_bits).to(tl.int16).to(MAGIC_DTYPE, bitcast=True)
                    if DOT_FP32:                # (the interpreter's 16-bit float arithmetic is not to be trusted)
                        q_minus_z = offset_q.to(tl.float32) - offset_zero.to(tl.float32)
                        part += tl.dot(x.to(tl.float32), tl.trans(q_minus_z), input_precision="ieee")
                    else:
                        part += tl.dot(x, tl.trans(offset_q - offset_zero))
            else:                               # too few words for a dot per nibble: reorder into k order
                cols = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_rows + cols[None, :], mask=m_ok[:, None] & (cols < K)[None, :], other=0.0)
                nibbles = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xF, [BLOCK_N, BLOCK_K])
                offset_q = (nibbles | magic_bits).to(tl.int16).to(MAGIC_DTYPE, bitcast=True)
                if DOT_FP32:
                    q_minus_z = offset_q.to(tl.float32) - offset_zero.to(tl.float32)
                    part = tl.dot(x.to(tl.float32), tl.trans(q_minus_z), input_precision="ieee")
                else:
                    part = tl.dot(x, tl.trans(offset_q - offset_zero))
            acc += part * scale[None, :]
        _store_partial(out_ptr, out_split, final_ptr, counters_ptr, pid_m * tl.num_programs(1) + pid_n,
                       rows_m[:, None].to(tl.int64) * stride_om + rows_n[None, :], m_ok[:, None] & n_ok[None, :],
                       acc, n_splits, stride_split, FIXUP)
    elif BLOCK_M > 1:                                       # a few activation rows: CUDA cores, dequantized once
        rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = rows_m < M
        x_rows = x_ptr + rows_m[:, None].to(tl.int64) * stride_xm
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_stop, BLOCK_K):
            word_cols = k0 // 8 + words_in_tile
            words = tl.load(qw_rows + word_cols[None, :], mask=n_ok[:, None] & (word_cols < n_words)[None, :],
                            other=0)
            scale, zero = _int4_tile_scales(scales_ptr, zeros_ptr, k0, words_in_tile, rows_n, n_ok,
                                            word_cols < n_words, N, GROUP, BLOCK_K)
            part = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
            x_per_word = tl.zeros([BLOCK_M, BLOCK_K // 8], dtype=tl.float32)
            for j in tl.static_range(8):        # as in the one-row branch below
                cols = word_cols * 8 + j
                x = tl.load(x_rows + cols[None, :], mask=m_ok[:, None] & (cols < K)[None, :], other=0.0).to(tl.float32)
                if 4 * j >= MANTISSA_TOP:
                    placed = words >> (4 * j - MANTISSA_TOP)
                else:
                    placed = words << (MANTISSA_TOP - 4 * j)
                one_plus_q16 = ((placed & NIBBLE_AT_TOP) | one_bits).to(tl.float32, bitcast=True)
                part += one_plus_q16[None, :, :] * x[:, None, :]
                x_per_word += x
            acc += tl.sum((16.0 * part - (16.0 + zero)[None, :, :] * x_per_word[:, None, :]) * scale[None, :, :],
                          axis=2)
        _store_partial(out_ptr, out_split, final_ptr, counters_ptr, pid_m * tl.num_programs(1) + pid_n,
                       rows_m[:, None].to(tl.int64) * stride_om + rows_n[None, :], m_ok[:, None] & n_ok[None, :],
                       acc, n_splits, stride_split, FIXUP)
    else:                                                   # one activation row per program: CUDA cores
        x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
        acc = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
        word_cols = k_start // 8 + words_in_tile
        if PREFETCH:
            words = tl.load(qw_rows + word_cols[None, :], mask=n_ok[:, None] & (word_cols < n_words)[None, :], other=0)
        else:
            words = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.int32)
        for k0 in range(k_start, k_stop, BLOCK_K):
            word_cols = k0 // 8 + words_in_tile
            if PREFETCH:                        # the next tile's words in flight while this one is computed
                next_cols = word_cols + BLOCK_K // 8
                next_words = tl.load(qw_rows + next_cols[None, :], other=0,
                                     mask=n_ok[:, None] & (next_cols * 8 < k_stop)[None, :])   # inside this split
            else:
                words = tl.load(qw_rows + word_cols[None, :], mask=n_ok[:, None] & (word_cols < n_words)[None, :],
                                other=0)
                next_words = words
            scale, zero = _int4_tile_scales(scales_ptr, zeros_ptr, k0, words_in_tile, rows_n, n_ok,
                                            word_cols < n_words, N, GROUP, BLOCK_K)
            # nibble j of every word placed in the top of an fp32 mantissa: 1 + q/16 exactly, in two
            # integer instructions (a shift fixed at trace time, then mask-and-OR), no int-to-float
            # conversion (a quarter-rate instruction); one_bits (1.0's bits) is a runtime argument
            # so the compiler cannot fold the trick back into one. Then
            #   sum_j x_j (q_j − z) = 16 · sum_j x_j (1 + q_j/16) − (16 + z) · sum_j x_j
            part = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
            x_per_word = tl.zeros([BLOCK_K // 8], dtype=tl.float32)
            for j in tl.static_range(8):        # nibble j of every word: each thread keeps its own words
                x = tl.load(x_row + word_cols * 8 + j, mask=word_cols * 8 + j < K, other=0.0).to(tl.float32)
                if 4 * j >= MANTISSA_TOP:
                    placed = words >> (4 * j - MANTISSA_TOP)
                else:
                    placed = words << (MANTISSA_TOP - 4 * j)
                one_plus_q16 = ((placed & NIBBLE_AT_TOP) | one_bits).to(tl.float32, bitcast=True)
                part += one_plus_q16 * x[None, :]
                x_per_word += x
            acc += (16.0 * part - (16.0 + zero) * x_per_word[None, :]) * scale
            words = next_words
        _store_partial(out_ptr, out_split, final_ptr, counters_ptr, pid_m * tl.num_programs(1) + pid_n,
                       pid_m.to(tl.int64) * stride_om + rows_n, n_ok, tl.sum(acc, axis=1), n_splits, stride_split, FIXUP)


@triton.jit
def _w8a16_kernel(x_ptr, qw_ptr, scales_ptr, out_ptr, M, N, K, k_per_split,
                  stride_xm, stride_qn, stride_om, stride_split, one_bits, final_ptr, counters_ptr, n_splits,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, FIXUP: tl.constexpr):
    """out[split, m, n] = s[n] · sum over this split's k of x[m, k] · q[n, k]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rows_n < N
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(K, k_start + k_per_split)
    qw_rows = qw_ptr + rows_n[:, None].to(tl.int64) * stride_qn
    out_split = out_ptr + pid_k.to(tl.int64) * stride_split
    scale = tl.load(scales_ptr + rows_n, mask=n_ok, other=0.0).to(tl.float32)
    if USE_DOT:
        rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = rows_m < M
        x_rows = x_ptr + rows_m[:, None].to(tl.int64) * stride_xm
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_stop, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            x = tl.load(x_rows + cols[None, :], mask=m_ok[:, None] & col_ok[None, :], other=0.0)
            q = tl.load(qw_rows + cols[None, :], mask=n_ok[:, None] & col_ok[None, :], other=0)
            if DOT_FP32:
                acc += tl.dot(x.to(tl.float32), tl.trans(q.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(q.to(x_ptr.dtype.element_ty)))
        _store_partial(out_ptr, out_split, final_ptr, counters_ptr, pid_m * tl.num_programs(1) + pid_n,
                       rows_m[:, None].to(tl.int64) * stride_om + rows_n[None, :], m_ok[:, None] & n_ok[None, :],
                       (acc * scale[None, :]), n_splits, stride_split, FIXUP)
    else:
        x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        x_total = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(k_start, k_stop, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            x = tl.load(x_row + cols, mask=col_ok, other=0.0).to(tl.float32)
            q = tl.load(qw_rows + cols[None, :], mask=n_ok[:, None] & col_ok[None, :], other=0)
            # 1 + (q + 128)/256 exactly: q + 128 (in [1, 255]) shifted into the top of an fp32
            # mantissa and 1.0's bits added (one_bits at run time: see the int4 kernel), then
            #   sum_k x_k q_k = 256 · sum_k x_k (1 + (q_k + 128)/256) − 384 · sum_k x_k
            one_plus_q = ((q.to(tl.int32) << 15) + (one_bits + (128 << 15))).to(tl.float32, bitcast=True)
            acc += one_plus_q * x[None, :]
            x_total += x
        dot = 256.0 * tl.sum(acc, axis=1) - 384.0 * tl.sum(x_total, axis=0)
        _store_partial(out_ptr, out_split, final_ptr, counters_ptr, pid_m * tl.num_programs(1) + pid_n,
                       pid_m.to(tl.int64) * stride_om + rows_n, n_ok, (dot * scale), n_splits, stride_split, FIXUP)


@triton.jit
def _sum_splits_kernel(partials_ptr, out_ptr, numel, splits, BLOCK: tl.constexpr):
    """out[i] = sum over s (in order) of partials[s, i], rounded once to out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, splits):
        total += tl.load(partials_ptr + s * numel + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


SUM_BLOCK = 1024


# ------------------------------------------------------------------------------ configs
def sm_count(device) -> int:
    """SMs of a CUDA device; 4 elsewhere (the interpreter: small enough that split-K is exercised)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def default_config(bits: int, m: int, n: int, k: int, group_size: int, sms: int, act_bytes: int = 2) -> dict:
    """The engine's choice for a problem: per shape of use, the candidate (candidate_configs) with
    the best geometric mean over the Llama-3.1-8B projections in an H200 sweep (the quant_kernels
    record with tune=true keeps the table). act_bytes 4 (fp32 activations, and fp32 dot operands)
    doubles each stage's tiles, so the pipeline keeps half as many stages (the 16-bit ones would
    ask an H200 for more shared memory than it has)."""
    block_k4 = lambda bk: min(bk, group_size)                  # an int4 tile lies inside one group
    if m == 1:
        cfg = {"BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": block_k4(128) if bits == 4 else 128, "num_warps": 4,
               "num_stages": 3, "per_sm": 4}
        if bits == 4:
            cfg["PREFETCH"] = False
    elif m <= GEMV_MAX_M:
        cfg = {"BLOCK_M": DOT_MIN, "BLOCK_N": 128, "BLOCK_K": block_k4(128), "num_warps": 8, "num_stages": 3,
               "per_sm": 4} if bits == 4 else \
              {"BLOCK_M": DOT_MIN, "BLOCK_N": 32, "BLOCK_K": 512, "num_warps": 4, "num_stages": 3, "per_sm": 1}
    elif bits == 4:
        block_m = 64 if m <= 64 else 128
        cfg = {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": block_k4(128), "num_warps": 4 if block_m == 64 else 8,
               "num_stages": 4, "per_sm": 0}
    else:
        block_m = 32 if m <= 64 else 128
        cfg = {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4 if block_m == 32 else 8,
               "num_stages": 4, "per_sm": 0}
    per_sm = cfg.pop("per_sm")
    if act_bytes > 2:
        cfg["num_stages"] = max(1, cfg["num_stages"] // 2)
    m_tiles = -(-m // cfg["BLOCK_M"])
    cfg["SPLIT_K"] = split_for(m_tiles, n, k, cfg, per_sm, sms) if per_sm else 1
    return cfg


def split_for(m_tiles: int, n: int, k: int, cfg: dict, per_sm: int, sms: int) -> int:
    """Splits of K so that the grid reaches per_sm programs per SM, each split a whole number of
    K tiles, at most MAX_SPLIT_K."""
    programs = m_tiles * -(-n // cfg["BLOCK_N"])
    return max(1, min(-(-per_sm * sms // programs), -(-k // cfg["BLOCK_K"]), MAX_SPLIT_K))


def candidate_configs(bits: int, m: int, n: int, k: int, group_size: int, sms: int) -> list[dict]:
    """What `lab run phase5.quant_kernels --param tune=true` times besides default_config: tile
    sides, warps, split-K reaching 1, 2 and 4 programs per SM, and (one int4 row) prefetching."""
    out = []
    if m <= GEMV_MAX_M:
        core_rows = 1 if m == 1 else next((r for r in CORE_ROWS if r >= m), None) if bits == 4 else None
        shapes = [(core_rows, k_tiles_on_cores(bits, group_size))] if core_rows else []
        shapes.append((DOT_MIN, tuple(bk for bk in (32, 64, 128, 256) if group_size % bk == 0)
                       if bits == 4 else (128, 256, 512)))
        for block_m, ks in shapes:
            for block_n in (32, 64, 128):
                for block_k in ks:
                    for warps in (4, 8):
                        for per_sm in (1, 2, 4):
                            for prefetch in ((True, False) if bits == 4 and block_m == 1 else (True,)):
                                cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps,
                                       "num_stages": 3}
                                if bits == 4 and block_m == 1:
                                    cfg["PREFETCH"] = prefetch
                                cfg["SPLIT_K"] = split_for(-(-m // block_m), n, k, cfg, per_sm, sms)
                                out.append(cfg)
    else:
        for block_m in (32, 64, 128):
            for block_n in (64, 128):
                for block_k in (bk for bk in (64, 128) if bits == 8 or group_size % bk == 0):
                    for stages in (3, 4):
                        out.append({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": 1,
                                    "num_warps": 4 if block_m * block_n <= 4096 else 8, "num_stages": stages})
    unique = {tuple(sorted(c.items())): c for c in out}
    return list(unique.values())


def k_tiles_on_cores(bits: int, group_size: int) -> tuple:
    """K tiles the CUDA-core paths can take: int4 any multiple of 8 that divides the group or is a
    multiple of it (scales are then read per word)."""
    if bits == 8:
        return (128, 256, 512)
    return tuple(sorted({bk for bk in (64, 128, 256, 512) if group_size % bk == 0 or bk % group_size == 0}))


def launches(cfg: dict) -> int:
    """Kernels one call starts: the matmul, plus a split sum when K is split and the in-kernel sum
    (tile counters) is turned off."""
    return 1 if cfg["SPLIT_K"] == 1 or cfg.get("FIXUP", True) else 2


def _check_config(cfg: dict, bits: int, group_size: int | None) -> None:
    bm, bk = cfg["BLOCK_M"], cfg["BLOCK_K"]
    if bm not in CORE_ROWS and bm < DOT_MIN:
        raise LabError(f"BLOCK_M must be one of {CORE_ROWS} (CUDA cores) or >= {DOT_MIN} (tl.dot), got {bm}")
    if bm >= DOT_MIN and bk < DOT_MIN:
        raise LabError(f"BLOCK_K must be >= {DOT_MIN} with tl.dot, got {bk}")
    if bits == 4 and (bk % NIBBLES_PER_WORD or (group_size % bk if bm >= DOT_MIN else group_size % bk and bk % group_size)):
        raise LabError(f"int4 BLOCK_K must be a multiple of 8 dividing the group size {group_size} (or, on the CUDA-core "
                       f"paths, a multiple of it), got {bk}")
    if not 1 <= cfg["SPLIT_K"] <= MAX_SPLIT_K:
        raise LabError(f"SPLIT_K must be in [1, {MAX_SPLIT_K}], got {cfg['SPLIT_K']}")


def _launch(kernel, x, out_dtype, n: int, k: int, cfg: dict, weight_args: tuple, extra_ints: tuple, magic: tuple,
            constexprs: dict):
    """Grid, split-K partials and their sum, shared by both formats: the last split of each tile
    sums them in the kernel (tile counters), or, where no counters can be had (too many tiles, or
    a first call inside a CUDA-graph capture), a second kernel does."""
    m = x.shape[0]
    bm, bk, splits = cfg["BLOCK_M"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    k_per_split = -(-(-(-k // bk)) // splits) * bk                 # whole K tiles per split
    splits = -(-k // k_per_split)                                 # no empty split
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (-(-m // bm), -(-n // cfg["BLOCK_N"]), splits)
    counters = tile_counters(x.device, grid[0] * grid[1]) if splits > 1 and cfg.get("FIXUP", True) else None
    dot_fp32 = interpreting() or x.dtype == torch.float32
    kernel[grid](x, *weight_args, target, m, n, k, *extra_ints, k_per_split, x.stride(0), weight_args[0].stride(0),
                 n, m * n, *magic, out, counters if counters is not None else out, splits, **constexprs,
                 BLOCK_M=bm, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, USE_DOT=bm >= DOT_MIN, DOT_FP32=dot_fp32,
                 FIXUP=counters is not None, num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3))
    if splits > 1 and counters is None:
        _sum_splits_kernel[(-(-(m * n) // SUM_BLOCK),)](target, out, m * n, splits, BLOCK=SUM_BLOCK, num_warps=4)
    return out


MAX_TILE_COUNTERS = 1 << 16
_COUNTERS: dict = {}


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's split-K tile counters (int32, all 0 between calls: the last split of a tile
    resets its own), made once; None where they cannot serve: more tiles than counters, or no
    counters yet and a CUDA graph being captured (memory allocated then would belong to the graph).
    Kernels on one device share them, so two split-K calls must not run on concurrent streams."""
    if tiles > MAX_TILE_COUNTERS:
        return None
    key = (device.type, device.index)
    if key not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _COUNTERS[key] = torch.zeros(MAX_TILE_COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def magic_for(dtype: torch.dtype) -> dict:
    """(runtime bits, constexprs) of the 16-bit float whose mantissa takes a nibble: bits | q read as
    MAGIC_DTYPE is exactly MAGIC_VALUE + q (bf16: 128 + q, 8 significant bits; fp16: 1024 + q, 11).
    fp16 activations get fp16's; bf16 and fp32 (whose dots run in fp32) get bf16's. The bits are
    passed at run time, as is ONE_BITS, so the compiler cannot fold the trick back into an
    int-to-float conversion."""
    if dtype == torch.float16:
        return 0x6400, {"MAGIC_DTYPE": tl.float16, "MAGIC_VALUE": 1024.0}
    return 0x4300, {"MAGIC_DTYPE": tl.bfloat16, "MAGIC_VALUE": 128.0}



def _check_inputs(x, qweight, k: int, name: str) -> None:
    require(x, qweight)
    if x.dim() != 2 or x.shape[1] != k:
        raise LabError(f"{name}: x must be [M, {k}], got {tuple(x.shape)}")
    if x.stride(-1) != 1 or not qweight.is_contiguous():
        raise LabError(f"{name}: x's rows and the packed weight must be contiguous")
    if x.shape[0] == 0:
        raise LabError(f"{name}: x has no rows")


def kernel_group_size(group_size: int, k: int) -> int:
    """The GROUP the int4 kernel is compiled for: the weight's group size (one of GROUP_SIZES), or,
    per-channel (group_size == K, one group), the smallest power of two >= K, max(16, ...): every
    k < K then falls in group 0, and every power-of-two K tile divides it, so the tile rules hold."""
    if group_size in GROUP_SIZES:
        return group_size
    if group_size == k:
        return max(GROUP_SIZES[0], 1 << (k - 1).bit_length())
    raise LabError(f"w4a16_matmul: group_size must be one of {GROUP_SIZES} or per-channel (== K = {k}), "
                   f"got {group_size}")


def w4a16_matmul(x, qweight, scales, zeros, group_size: int, config: dict | None = None):
    """x [M, K] (bf16, fp16 or fp32) @ the int4 weight^T -> [M, N] in x's dtype (weight_formats.py's layout;
    K = x.shape[1]). config: BLOCK_M/N/K, SPLIT_K, num_warps, num_stages; None: default_config."""
    k = x.shape[1]
    n = qweight.shape[0]
    _check_inputs(x, qweight, k, "w4a16_matmul")
    kernel_group = kernel_group_size(group_size, k)
    if qweight.shape[1] != -(-k // NIBBLES_PER_WORD) or scales.shape != (-(-k // group_size), n) \
            or zeros.shape != scales.shape:
        raise LabError(f"w4a16_matmul: packed weight {tuple(qweight.shape)}, scales {tuple(scales.shape)}, zeros "
                       f"{tuple(zeros.shape)} do not describe K={k}, N={n}, group_size={group_size}")
    group_size = kernel_group
    cfg = config or default_config(4, x.shape[0], n, k, group_size, sm_count(x.device), x.element_size())
    _check_config(cfg, 4, group_size)
    bits, constexprs = magic_for(x.dtype)
    return _launch(_w4a16_kernel, x, x.dtype, n, k, cfg, (qweight, scales.contiguous(), zeros.contiguous()),
                   (qweight.shape[1],), (ONE_BITS, bits),
                   {"GROUP": group_size, "PREFETCH": cfg.get("PREFETCH", True), **constexprs})


def w8a16_matmul(x, qweight, scales, config: dict | None = None):
    """x [M, K] @ the int8 weight^T (q [N, K] · scales [N]) -> [M, N] in x's dtype."""
    k = x.shape[1]
    n = qweight.shape[0]
    _check_inputs(x, qweight, k, "w8a16_matmul")
    if qweight.shape[1] != k or scales.shape != (n,):
        raise LabError(f"w8a16_matmul: weight {tuple(qweight.shape)} and scales {tuple(scales.shape)} do not "
                       f"describe K={k}, N={n}")
    cfg = config or default_config(8, x.shape[0], n, k, 0, sm_count(x.device), x.element_size())
    _check_config(cfg, 8, None)
    return _launch(_w8a16_kernel, x, x.dtype, n, k, cfg, (qweight, scales.contiguous()), (), (ONE_BITS,), {})
