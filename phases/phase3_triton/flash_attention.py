"""Exercise 3.4: flash attention forward, and the kernels of its backward (exercise 3.5).

    lab run phase3.flash_attention [--param sizes=[16384] --param dtypes=[bf16] --param head_dims=[128]]

O = softmax(Q K^T / sqrt(D)) V. Naive attention writes the B·H·N² scores and probabilities and
reads them back (six N² passes in its four kernels), so the N² traffic sets its time. Flash attention never writes them: a program
keeps BLOCK_M query rows on chip and walks the keys in BLOCK_N blocks with the online softmax (a
running row max m and sum l; when the max grows, what came before is rescaled by exp(m_old - m_new)).
HBM then sees Q, K, V read and O written (4·B·H·N·D elements) for 4·B·H·N²·D FLOPs, halved when
causal: compute-bound, the matmul question of exercise 3.3 with a softmax between two dots. Those
are every variant's counts (one problem); naive's N² traffic and the LSE our kernel stores for the
backward are `algorithm_bytes`; fp32 inputs make a tf32 problem (counts.py).
Choices: exp2 with log2(e) folded into the score scale; causal in two stages (unmasked blocks left
of the diagonal, masked ones on it), the longest tiles launched first across a group of heads
whose K and V fit in L2 (query_tile); TMA or pointer loads; masks only on the diagonal and the
ragged tail (any N). Configs by rule (forward_config, backward_config: head dim, N, programs
against SMs, shared memory); the exercise tunes around the rule's pick. The backward recomputes P
from the saved row log-sum-exp: delta = rowsum(dO * O), then a dK/dV kernel looping over queries
and a dQ kernel looping over keys, or (FlashAttention-2's scheme) the dK/dV kernel alone adding
dQ by atomics; by convention 2.5x the forward's FLOPs.
"""
import math
import warnings

import torch

from common.checks import CHECK_CHUNK, TORCH_DTYPES, compare
from common.exercise import Exercise, Needs, Result, Work, measure
from common.params import Bool, Choice, Int
from common.standalone import run_alone
from common.triton_shim import LOG2E_VALUE, ensure_allocator, interpreting, require, tl, triton
from common.triton_tuner import label, launch_options, tune, tuning_summary
from common.variant_rows import attempt, compare_to_library, skipped

from . import counts
from . import kernel_lists


# ------------------------------------------------------------------------------ forward kernel
@triton.jit
def load_rows(src, row0, n_ctx, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr,
              EVEN: tl.constexpr):
    """Rows [row0, row0 + ROWS) of one head's (n_ctx, HEAD_DIM) matrix; rows past n_ctx read as 0."""
    if USE_TMA:
        block = src.load([row0, 0])                            # bounds-checked by the hardware
    else:
        rows = row0 + tl.arange(0, ROWS)
        ptrs = src + rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
        if EVEN:
            block = tl.load(ptrs)
        else:
            block = tl.load(ptrs, mask=rows[:, None] < n_ctx, other=0.0)
    return block


@triton.jit
def attn_fwd_inner(acc, l_i, m_i, q, k_src, v_src, offs_m, lo, hi, n_ctx, causal, qk_scale,
                   HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, EVEN: tl.constexpr,
                   USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Key blocks [lo, hi): the online-softmax update. MASK only on the diagonal and the tail;
    the unmasked stage's blocks lie wholly inside N, so their loads skip the bounds test too."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = load_rows(k_src, start_n, n_ctx, BLOCK_N, HEAD_DIM, USE_TMA, EVEN or not MASK)
        s = tl.dot(q, tl.trans(k))                             # raw scores, fp32 accumulate
        if MASK:
            cols = start_n + offs_n
            keep = (cols[None, :] < n_ctx) & ((cols[None, :] <= offs_m[:, None]) | (causal == 0))
            s = tl.where(keep, s * qk_scale, -1.0e6)          # finite: a masked row never makes NaN
            m_new = tl.maximum(m_i, tl.max(s, 1))
            s = s - m_new[:, None]
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            s = s * qk_scale - m_new[:, None]                  # one FMA per score
        p = tl.math.exp2(s)
        alpha = tl.math.exp2(m_i - m_new)                      # rescales what came before
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = load_rows(v_src, start_n, n_ctx, BLOCK_N, HEAD_DIM, USE_TMA, EVEN or not MASK)
        acc = tl.dot(p.to(v.dtype), v, acc)                    # P in the input dtype for the tensor cores
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def query_tile(n_ctx, n_bh, heads_per_group, longest_first, BLOCK_M: tl.constexpr):
    """(query block, head) of this program in a 1-D grid of cdiv(N, BLOCK_M) x B·H programs.

    Heads are taken `heads_per_group` at a time; inside a group the order is query block major:
    every head's block 0 (or, `longest_first`, every head's last block: under a causal mask the
    one that sees the most keys), then the next. Causal work is then launched longest first
    across the group (LPT scheduling: the grid's tail is the shortest tiles of all its heads,
    not one head's longest), while a group's K and V (the wrapper sizes it to fit in half the
    L2) stay cached for all its programs. With one head per group this is the usual head-major
    order."""
    n_blocks = tl.cdiv(n_ctx, BLOCK_M)
    pid = tl.program_id(0)
    per_group = heads_per_group * n_blocks
    group = pid // per_group
    rem = pid - group * per_group
    first = group * heads_per_group
    in_group = tl.minimum(heads_per_group, n_bh - first)
    start_m = rem // in_group
    if longest_first:
        start_m = n_blocks - 1 - start_m
    return start_m, (first + rem % in_group).to(tl.int64)


@triton.jit(do_not_specialize=["causal", "heads_per_group"])
def attn_fwd_kernel(Q, K, V, O, LSE, qk_scale, n_ctx, causal, n_bh, heads_per_group,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    EVEN: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """1-D grid of query tiles in query_tile's order. Q, K, V, O contiguous (B, H, N, D); LSE
    (B, H, N) fp32 receives each row's log2-sum-exp2 of the scaled scores, which the backward needs.
    WARP_SPECIALIZE configs are only used non-causal with N a multiple of the blocks: the kernel is
    then one unmasked loop with no runtime branch around it, which Triton's Hopper warp
    specialization pass requires (with two loops it does not apply, or the compiler aborts)."""
    if WARP_SPECIALIZE:                          # non-causal only: no branch before the loop
        start_m, bh = query_tile(n_ctx, n_bh, heads_per_group, 0, BLOCK_M)
    else:
        start_m, bh = query_tile(n_ctx, n_bh, heads_per_group, causal, BLOCK_M)
    base = bh * n_ctx * HEAD_DIM
    if USE_TMA:
        q_src = tl.make_tensor_descriptor(Q + base, shape=[n_ctx, HEAD_DIM], strides=[HEAD_DIM, 1],
                                          block_shape=[BLOCK_M, HEAD_DIM])
        k_src = tl.make_tensor_descriptor(K + base, shape=[n_ctx, HEAD_DIM], strides=[HEAD_DIM, 1],
                                          block_shape=[BLOCK_N, HEAD_DIM])
        v_src = tl.make_tensor_descriptor(V + base, shape=[n_ctx, HEAD_DIM], strides=[HEAD_DIM, 1],
                                          block_shape=[BLOCK_N, HEAD_DIM])
        o_dst = tl.make_tensor_descriptor(O + base, shape=[n_ctx, HEAD_DIM], strides=[HEAD_DIM, 1],
                                          block_shape=[BLOCK_M, HEAD_DIM])
    else:
        q_src, k_src, v_src, o_dst = Q + base, K + base, V + base, O + base
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = load_rows(q_src, start_m * BLOCK_M, n_ctx, BLOCK_M, HEAD_DIM, USE_TMA, EVEN)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if WARP_SPECIALIZE:
        acc, l_i, m_i = attn_fwd_inner(acc, l_i, m_i, q, k_src, v_src, offs_m, 0, n_ctx, n_ctx, causal, qk_scale,
                                       HEAD_DIM, BLOCK_N, False, EVEN, USE_TMA, WARP_SPECIALIZE)
    else:
        # Stage 1: key blocks every row of this tile sees whole (left of the diagonal, or all but a
        # ragged tail): no mask. Stage 2: the diagonal blocks (causal) or the tail (N % BLOCK_N).
        full_end = (n_ctx // BLOCK_N) * BLOCK_N
        end = n_ctx
        if causal:
            full_end = start_m * BLOCK_M
            end = min((start_m + 1) * BLOCK_M, n_ctx)
        acc, l_i, m_i = attn_fwd_inner(acc, l_i, m_i, q, k_src, v_src, offs_m, 0, full_end, n_ctx, causal,
                                       qk_scale, HEAD_DIM, BLOCK_N, False, EVEN, USE_TMA, WARP_SPECIALIZE)
        acc, l_i, m_i = attn_fwd_inner(acc, l_i, m_i, q, k_src, v_src, offs_m, full_end, end, n_ctx, causal,
                                       qk_scale, HEAD_DIM, BLOCK_N, True, EVEN, USE_TMA, WARP_SPECIALIZE)
    acc = acc / l_i[:, None]
    lse_ptrs = LSE + bh * n_ctx + offs_m
    if EVEN:
        tl.store(lse_ptrs, m_i + tl.math.log2(l_i))
    else:
        tl.store(lse_ptrs, m_i + tl.math.log2(l_i), mask=offs_m < n_ctx)
    out = acc.to(O.dtype.element_ty)
    if USE_TMA:
        o_dst.store([start_m * BLOCK_M, 0], out)              # rows past n_ctx are not written
    else:
        o_ptrs = o_dst + offs_m[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
        if EVEN:
            tl.store(o_ptrs, out)
        else:
            tl.store(o_ptrs, out, mask=offs_m[:, None] < n_ctx)


# ------------------------------------------------------------------------------ backward kernels
@triton.jit
def attn_bwd_preprocess(O, DO, DELTA, n_ctx, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, EVEN: tl.constexpr):
    """delta_i = sum_d dO_id O_id = sum_j P_ij dP_ij: the row term of the softmax gradient."""
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    o = load_rows(O + bh * n_ctx * HEAD_DIM, tl.program_id(0) * BLOCK_M, n_ctx, BLOCK_M, HEAD_DIM, False, EVEN)
    do = load_rows(DO + bh * n_ctx * HEAD_DIM, tl.program_id(0) * BLOCK_M, n_ctx, BLOCK_M, HEAD_DIM, False, EVEN)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if EVEN:
        tl.store(DELTA + bh * n_ctx + rows, delta)
    else:
        tl.store(DELTA + bh * n_ctx + rows, delta, mask=rows < n_ctx)


@triton.jit
def load_row_stats(LSE, DELTA, rows, n_ctx, EVEN: tl.constexpr):
    if EVEN:
        lse = tl.load(LSE + rows)
        delta = tl.load(DELTA + rows)
    else:
        lse = tl.load(LSE + rows, mask=rows < n_ctx, other=0.0)
        delta = tl.load(DELTA + rows, mask=rows < n_ctx, other=0.0)
    return lse, delta


@triton.jit
def attn_bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_src, delta_src, dq_dst, offs_n, lo, hi, n_ctx, causal,
                        qk_scale, sm_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr,
                        EVEN: tl.constexpr, DQ_ATOMIC: tl.constexpr):
    """Query blocks [lo, hi) against this program's keys, everything transposed (keys are rows).
    DQ_ATOMIC: also add this key block's share of dQ (dS K, scaled) into the fp32 dq_dst."""
    for start_m in range(lo, hi, BLOCK_M):
        q = load_rows(q_src, start_m, n_ctx, BLOCK_M, HEAD_DIM, False, EVEN or not MASK)
        do = load_rows(do_src, start_m, n_ctx, BLOCK_M, HEAD_DIM, False, EVEN or not MASK)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        lse, delta = load_row_stats(lse_src, delta_src, offs_m, n_ctx, EVEN or not MASK)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])   # P^T, recomputed
        if MASK:
            keep = (offs_m[None, :] < n_ctx) & ((offs_m[None, :] >= offs_n[:, None]) | (causal == 0))
            p_t = tl.where(keep, p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do)                     # dV = P^T dO
        dp_t = tl.dot(v, tl.trans(do))                         # dP^T = V dO^T
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)    # dS = P * (dP - delta)
        dk += tl.dot(ds_t, q)                                  # dK = dS^T Q (scale applied at the end)
        if DQ_ATOMIC:                                          # dQ += dS K: 5 matmuls in all, not 7
            dq = tl.dot(tl.trans(ds_t), k) * sm_scale
            ptrs = dq_dst + offs_m[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
            if EVEN or not MASK:
                tl.atomic_add(ptrs, dq, sem="relaxed")
            else:
                tl.atomic_add(ptrs, dq, mask=offs_m[:, None] < n_ctx, sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["causal"])
def attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC, qk_scale, sm_scale, n_ctx, causal,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
                         DQ_ATOMIC: tl.constexpr):
    """Grid (key blocks, batch x heads): dK and dV for BLOCK_N keys, looping over the queries that
    see them (causal: only queries at or after the keys). BLOCK_N must be a multiple of BLOCK_M.
    DQ_ATOMIC (FlashAttention-2's scheme): each program also adds its keys' share of dQ into an
    fp32 accumulator (relaxed atomics, zeroed before), so no dQ kernel recomputes S and dP.
    Head-major grid (key block 0, which most queries see under a causal mask, first in each head):
    query_tile's grouped order cost this kernel registers (spills at D = 128, compile_check)."""
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)
    base = bh * n_ctx * HEAD_DIM
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = load_rows(K + base, start_n, n_ctx, BLOCK_N, HEAD_DIM, False, EVEN)
    v = load_rows(V + base, start_n, n_ctx, BLOCK_N, HEAD_DIM, False, EVEN)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    q_src, do_src, lse_src, delta_src = Q + base, DO + base, LSE + bh * n_ctx, DELTA + bh * n_ctx
    dq_dst = DQ_ACC + base
    full_start = 0
    if causal:                                   # the diagonal band: masked
        full_start = start_n + BLOCK_N
        dk, dv = attn_bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_src, delta_src, dq_dst, offs_n, start_n,
                                     min(full_start, n_ctx), n_ctx, causal, qk_scale, sm_scale, HEAD_DIM, BLOCK_M,
                                     True, EVEN, DQ_ATOMIC)
    full_end = (n_ctx // BLOCK_M) * BLOCK_M
    dk, dv = attn_bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_src, delta_src, dq_dst, offs_n, full_start, full_end,
                                 n_ctx, causal, qk_scale, sm_scale, HEAD_DIM, BLOCK_M, False, EVEN, DQ_ATOMIC)
    if not EVEN:                                 # ragged last query block
        dk, dv = attn_bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_src, delta_src, dq_dst, offs_n,
                                     max(full_start, full_end), n_ctx, n_ctx, causal, qk_scale, sm_scale,
                                     HEAD_DIM, BLOCK_M, True, EVEN, DQ_ATOMIC)
    dk *= sm_scale                               # S = sm_scale Q K^T: the chain rule's factor
    ptrs = offs_n[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    if EVEN:
        tl.store(DK + base + ptrs, dk.to(DK.dtype.element_ty))
        tl.store(DV + base + ptrs, dv.to(DV.dtype.element_ty))
    else:
        tl.store(DK + base + ptrs, dk.to(DK.dtype.element_ty), mask=offs_n[:, None] < n_ctx)
        tl.store(DV + base + ptrs, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < n_ctx)


@triton.jit
def attn_bwd_dq_inner(dq, q, do, lse, delta, k_src, v_src, offs_m, lo, hi, n_ctx, causal, qk_scale,
                      HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, EVEN: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        k = load_rows(k_src, start_n, n_ctx, BLOCK_N, HEAD_DIM, False, EVEN or not MASK)
        v = load_rows(v_src, start_n, n_ctx, BLOCK_N, HEAD_DIM, False, EVEN or not MASK)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
        if MASK:
            cols = start_n + offs_n
            keep = (cols[None, :] < n_ctx) & ((cols[None, :] <= offs_m[:, None]) | (causal == 0))
            p = tl.where(keep, p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)                        # dQ = dS K (scale applied at the end)
    return dq


@triton.jit(do_not_specialize=["causal", "heads_per_group"])
def attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, qk_scale, sm_scale, n_ctx, causal, n_bh, heads_per_group,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr):
    """1-D grid of query tiles in query_tile's order (causal: longest first): dQ for BLOCK_M
    queries, looping over the keys they see. BLOCK_M must be a multiple of BLOCK_N."""
    start_m, bh = query_tile(n_ctx, n_bh, heads_per_group, causal, BLOCK_M)
    base = bh * n_ctx * HEAD_DIM
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = load_rows(Q + base, start_m * BLOCK_M, n_ctx, BLOCK_M, HEAD_DIM, False, EVEN)
    do = load_rows(DO + base, start_m * BLOCK_M, n_ctx, BLOCK_M, HEAD_DIM, False, EVEN)
    lse, delta = load_row_stats(LSE + bh * n_ctx, DELTA + bh * n_ctx, offs_m, n_ctx, EVEN)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full_end = (n_ctx // BLOCK_N) * BLOCK_N
    end = n_ctx
    if causal:
        full_end = start_m * BLOCK_M
        end = min((start_m + 1) * BLOCK_M, n_ctx)
    dq = attn_bwd_dq_inner(dq, q, do, lse, delta, K + base, V + base, offs_m, 0, full_end, n_ctx, causal, qk_scale,
                           HEAD_DIM, BLOCK_N, False, EVEN)
    dq = attn_bwd_dq_inner(dq, q, do, lse, delta, K + base, V + base, offs_m, full_end, end, n_ctx, causal, qk_scale,
                           HEAD_DIM, BLOCK_N, True, EVEN)
    dq *= sm_scale
    ptrs = DQ + base + offs_m[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    if EVEN:
        tl.store(ptrs, dq.to(DQ.dtype.element_ty))
    else:
        tl.store(ptrs, dq.to(DQ.dtype.element_ty), mask=offs_m[:, None] < n_ctx)


# ------------------------------------------------------------------------------ configs
def _fwd(bm, bn, warps, stages, tma, ws=False):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "tma": tma, "ws": ws}


HOPPER_SMS = 132                       # an H100 / H200 SXM: the rules' defaults when no GPU is at hand
HOPPER_SMEM_BYTES = 227 * 1024         # shared memory one block may use on sm_90


def gpu_limits(device) -> dict:
    """SM count and shared memory per block of `device` (the rules' inputs); Hopper's off a GPU."""
    if getattr(device, "type", None) == "cuda":
        props = torch.cuda.get_device_properties(device)
        optin = getattr(props, "shared_memory_per_block_optin", None)   # a block's most; else the SM's less 1 KiB
        return {"sms": props.multi_processor_count,
                "smem_bytes": optin or props.shared_memory_per_multiprocessor - 1024}
    return {"sms": HOPPER_SMS, "smem_bytes": HOPPER_SMEM_BYTES}


def forward_smem_bytes(cfg: dict, head_dim: int, itemsize: int) -> int:
    """Shared memory a forward config asks for: the Q tile, and a K and a V tile per pipeline
    stage (compile_check.py's figures for sm_90 agree within the 1 KiB of barriers added here)."""
    return (cfg["BLOCK_M"] + 2 * cfg["num_stages"] * cfg["BLOCK_N"]) * head_dim * itemsize + 1024


def forward_config(dtype: torch.dtype, head_dim: int, causal: bool, n: int, batch_heads: int,
                   sms: int = HOPPER_SMS, smem_bytes: int = HOPPER_SMEM_BYTES) -> dict:
    """The forward config `attention_forward` runs when given none: a rule, not a table of sizes.

    * Query tile 128 rows (two 64-row wgmma groups: 8 warps at D = 128, whose 128 x 128 fp32
      accumulator needs them; 4 at D <= 64), unless that leaves fewer programs than SMs
      (cdiv(N, 128) x B x H < SMs): then 64 rows and 4 warps, twice the programs.
    * Key tile 128 at D = 128 when each program's key loop is long (N >= 4096: 32+ steps), which
      halves the loop's softmax bookkeeping per key; 64 otherwise, and always at D <= 64, where a
      step's two dots are short and the smaller tile keeps more programs per SM.
    * TMA loads with the 128-key tile or long sequences (N >= 8192); pointer loads otherwise.
    * Three pipeline stages, fewer (then a smaller key tile) until it fits the GPU's shared memory.
    Causal changes no tile: the kernel skips the masked blocks and starts the longest rows first.
    The seed's fp32 (tf32) case keeps 64 x 64 tiles: its tiles take twice the bytes."""
    if dtype == torch.float32:
        cfg = _fwd(64, 64, 4, 3, False)
    else:
        block_m = 128 if triton.cdiv(n, 128) * batch_heads >= sms else 64
        block_n = 128 if head_dim >= 128 and n >= 4096 and block_m == 128 else 64
        warps = 8 if head_dim >= 128 and block_m == 128 else 4
        cfg = _fwd(block_m, block_n, warps, 3, block_n == 128 or n >= 8192)
    itemsize = torch.empty((), dtype=dtype).element_size()
    while forward_smem_bytes(cfg, head_dim, itemsize) > smem_bytes:
        if cfg["num_stages"] > 2:
            cfg = {**cfg, "num_stages": cfg["num_stages"] - 1}
        elif cfg["BLOCK_N"] > 32:
            cfg = {**cfg, "BLOCK_N": cfg["BLOCK_N"] // 2, "num_stages": 3}
        else:
            break
    return cfg


def forward_candidates(dtype: torch.dtype, head_dim: int, causal: bool, warp_specialize: bool = False,
                       n: int | None = None, batch_heads: int | None = None, sms: int = HOPPER_SMS,
                       smem_bytes: int = HOPPER_SMEM_BYTES) -> list[dict]:
    """The rule's pick first (when N and B x H are given), then its neighbours: the other key tile,
    the other load path, the other query tile (all compile for sm_90 without spills: see
    compile_check.py). The exercise tunes over them and records which won."""
    if dtype == torch.float32:                    # the seed's case: tf32 dots, twice the bytes per tile
        out = [_fwd(64, 64, 4, 3, False), _fwd(128, 64, 8, 2, False), _fwd(64, 64, 4, 3, True)]
    elif head_dim <= 64:
        out = [_fwd(128, 64, 4, 3, False), _fwd(128, 64, 4, 3, True), _fwd(128, 128, 8, 3, True),
               _fwd(128, 128, 4, 3, True), _fwd(64, 64, 4, 3, False)]
    else:                                         # 64 x 64 in 2 stages: two programs per SM (80 KiB each)
        out = [_fwd(128, 128, 8, 3, True), _fwd(128, 64, 8, 3, True), _fwd(128, 64, 8, 3, False),
               _fwd(128, 64, 8, 4, True), _fwd(64, 64, 4, 2, False)]
    if n is not None and batch_heads is not None:
        out.insert(0, forward_config(dtype, head_dim, causal, n, batch_heads, sms, smem_bytes))
    if head_dim <= 64:
        ws = [_fwd(128, 128, 4, 3, True, ws=True), _fwd(128, 64, 4, 3, True, ws=True)]
    else:
        ws = [_fwd(128, 128, 4, 2, True, ws=True), _fwd(128, 64, 4, 2, True, ws=True)]
    # Warp specialization (num_warps=4 becomes one producer + two consumer warp groups, 12 warps):
    # non-causal only, N a multiple of 128 (one unmasked loop; see attn_fwd_kernel).
    if warp_specialize and not causal and dtype != torch.float32 and (n is None or n % 128 == 0):
        out += ws
    itemsize = torch.empty((), dtype=dtype).element_size()
    unique = []
    for c in out:
        if c not in unique and forward_smem_bytes(c, head_dim, itemsize) <= smem_bytes:
            unique.append(c)
    return unique


INTERPRETER_FWD = [_fwd(32, 16, 4, 1, False), _fwd(32, 32, 4, 1, True)]
INTERPRETER_FWD_WS = _fwd(32, 32, 4, 1, True, ws=True)     # non-causal, N % 32 == 0 only


def _bwd(bm1, bn1, w1, s1, bm2, bn2, w2, s2):
    return {"dkdv": {"BLOCK_M": bm1, "BLOCK_N": bn1, "num_warps": w1, "num_stages": s1},
            "dq": {"BLOCK_M": bm2, "BLOCK_N": bn2, "num_warps": w2, "num_stages": s2}}


def _part(bm, bn, warps, stages):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}


def backward_smem_bytes(cfg: dict, head_dim: int, itemsize: int, part: str) -> int:
    """Shared memory of a backward kernel: the tiles it keeps (K, V for dK/dV; Q, dO for dQ) and
    the two tiles it streams per stage (Q, dO; or K, V)."""
    kept, streamed = (cfg["BLOCK_N"], cfg["BLOCK_M"]) if part == "dkdv" else (cfg["BLOCK_M"], cfg["BLOCK_N"])
    return 2 * (kept + cfg["num_stages"] * streamed) * head_dim * itemsize + 1024


def backward_config(head_dim: int, causal: bool, n: int, batch_heads: int, sms: int = HOPPER_SMS,
                    smem_bytes: int = HOPPER_SMEM_BYTES) -> dict:
    """The backward's configs by rule ({"dkdv": ..., "dq": ...}), for 16-bit inputs.

    dK/dV keeps a key tile and streams query tiles: 64 x 64 at 4 warps (five live tiles of scores,
    probabilities and their gradients fit the registers at D = 128 only this small); at D <= 64
    and long sequences (N >= 8192) 128 keys at 8 warps, which halves the Q and dO traffic.
    dQ keeps 128 query rows at 8 warps and streams key tiles of 32 (D = 128: the register budget)
    or 64 (D <= 64). Where that leaves fewer programs than SMs, 64-row tiles at 4 warps.
    Stages: 3 at D <= 64, 2 at D = 128, fewer where shared memory is short."""
    stages = 3 if head_dim <= 64 else 2
    dkdv = _part(64, 128, 8, stages) if head_dim <= 64 and n >= 8192 else _part(64, 64, 4, stages)
    if triton.cdiv(n, dkdv["BLOCK_N"]) * batch_heads < sms:
        dkdv = _part(64, 64, 4, stages)
    dq = _part(128, 32 if head_dim >= 128 else 64, 8, 3)
    if triton.cdiv(n, 128) * batch_heads < sms:
        dq = _part(64, 64, 4, stages)
    out = {"dkdv": dkdv, "dq": dq}
    for part, c in out.items():
        while backward_smem_bytes(c, head_dim, 2, part) > smem_bytes and c["num_stages"] > 1:
            c["num_stages"] -= 1
    return out


def atomic_config(head_dim: int, n: int, batch_heads: int, sms: int = HOPPER_SMS) -> dict:
    """The dK/dV kernel's config when it also accumulates dQ by atomics (attention_backward's
    {"atomic": ...}): 64 query rows so the dQ product is a wgmma too (32 rows fall back to
    mma.sync); 8 warps at D = 128, where 4 spill; 128 keys at D <= 64 when the programs fill
    the GPU, halving the atomic traffic per key."""
    if head_dim > 64:
        return _part(64, 64, 8, 2)
    return _part(64, 128, 8, 3) if triton.cdiv(n, 128) * batch_heads >= sms else _part(64, 64, 4, 3)


def atomic_candidates(head_dim: int) -> list[dict]:
    """Atomic-dQ configs that compile for sm_90 without spills (compile_check.py)."""
    if head_dim <= 64:
        return [_part(64, 128, 8, 3), _part(64, 64, 4, 3), _part(32, 128, 4, 3)]
    return [_part(64, 64, 8, 2), _part(32, 128, 8, 3)]


def dkdv_candidates(head_dim: int, rule: dict | None = None) -> list[dict]:
    """The rule's dK/dV config first (when given), then the ones the lab has seen win."""
    if head_dim <= 64:
        out = [_part(64, 128, 8, 3), _part(32, 128, 4, 3), _part(64, 64, 4, 3)]
    else:
        out = [_part(64, 128, 8, 2), _part(32, 128, 8, 3), _part(64, 64, 4, 2)]
    return ([rule] if rule else []) + [c for c in out if c != rule]


def dq_candidates(head_dim: int, rule: dict | None = None) -> list[dict]:
    if head_dim <= 64:
        out = [_part(128, 64, 8, 3), _part(128, 32, 4, 3), _part(64, 64, 4, 3)]
    else:
        out = [_part(128, 64, 8, 2), _part(128, 32, 8, 3), _part(64, 64, 4, 2)]
    return ([rule] if rule else []) + [c for c in out if c != rule]


def backward_candidates(dtype: torch.dtype, head_dim: int) -> list[dict]:
    """Pairs for compile_check; the exercise tunes the two kernels separately."""
    return [{"dkdv": a, "dq": b} for a, b in zip(dkdv_candidates(head_dim), dq_candidates(head_dim))]


INTERPRETER_BWD = _bwd(32, 64, 4, 1, 64, 32, 4, 1)


# ------------------------------------------------------------------------------ wrappers
HEAD_DIMS = (16, 32, 64, 128, 256)     # what the kernels accept (tl.arange needs a power of two, tl.dot >= 16)
# What the exercise can run: at D = 256 every forward config needs more shared memory than Hopper's
# 227 KiB per block (compile_check.py shows it), so none would pass.
EXERCISE_HEAD_DIMS = (16, 32, 64, 128)


def _shape_check(*ts: torch.Tensor) -> tuple[int, int, int, int]:
    q = ts[0]
    assert q.ndim == 4 and all(t.shape == q.shape and t.dtype == q.dtype for t in ts), "q, k, v: one (B, H, N, D) shape"
    assert all(t.is_contiguous() for t in ts), "attention kernels take contiguous (B, H, N, D) tensors"
    assert q.shape[-1] in HEAD_DIMS, "head dim must be a power of two from 16 to 256"
    return q.shape


def heads_per_group(n_bh: int, n: int, head_dim: int, itemsize: int, causal: bool, device) -> int:
    """How many heads query_tile interleaves: causal, as many as keep their K and V (which every
    program of a head streams) within half the L2 (at least 1, at most all); otherwise 1 (equal
    tiles: head-major order is already balanced)."""
    if not causal:
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 50 * 2**20
    return max(1, min(n_bh, (l2 // 2) // (2 * n * head_dim * itemsize)))


def attention_forward(q, k, v, causal: bool = False, sm_scale: float | None = None, config: dict | None = None,
                      out: torch.Tensor | None = None, group_heads: int | None = None):
    """O and the row log2-sum-exp2 (for the backward). q, k, v: contiguous (B, H, N, D).
    `group_heads` overrides heads_per_group() (tests force a ragged last group)."""
    require(q, k, v)
    B, H, N, D = _shape_check(q, k, v)
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    cfg = config or (INTERPRETER_FWD[0] if interpreting() else
                     forward_config(q.dtype, D, causal, N, B * H, **gpu_limits(q.device)))
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty((B, H, N), device=q.device, dtype=torch.float32)
    if cfg["tma"]:
        ensure_allocator(q.device)
    even = N % cfg["BLOCK_M"] == 0 and N % cfg["BLOCK_N"] == 0
    if cfg["ws"] and (causal or not even):
        raise ValueError("warp-specialized configs run only non-causal attention with N a multiple of the blocks")
    group = heads_per_group(B * H, N, D, q.element_size(), causal and not cfg["ws"], q.device) \
        if group_heads is None else group_heads
    grid = (triton.cdiv(N, cfg["BLOCK_M"]) * B * H,)
    attn_fwd_kernel[grid](q, k, v, out, lse, sm_scale * LOG2E_VALUE, N, int(causal), B * H, group,
                          HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                          EVEN=even, USE_TMA=cfg["tma"], WARP_SPECIALIZE=cfg["ws"], **launch_options(cfg))
    return out, lse


def attention_backward(q, k, v, o, lse, do, causal: bool = False, sm_scale: float | None = None,
                       config: dict | None = None, grads=None, parts=("dkdv", "dq"), group_heads: int | None = None):
    """dQ, dK, dV from the forward's O and LSE. `parts` lets the tuner run one kernel at a time.
    A config {"atomic": {...}} runs the dK/dV kernel alone with dQ accumulated by atomics into an
    fp32 buffer, then copied out (4 launches: delta, zeroing, the kernel, the copy)."""
    require(q, k, v, o, do)
    B, H, N, D = _shape_check(q, k, v, o, do)
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    cfg = config or (INTERPRETER_BWD if interpreting() else backward_config(D, causal, N, B * H, **gpu_limits(q.device)))
    dq, dk, dv = grads if grads is not None else (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    delta = torch.empty_like(lse)
    pre_block = 64
    attn_bwd_preprocess[(triton.cdiv(N, pre_block), B * H)](o, do, delta, N, HEAD_DIM=D, BLOCK_M=pre_block,
                                                             EVEN=N % pre_block == 0, num_warps=4)
    qk_scale = sm_scale * LOG2E_VALUE
    group = heads_per_group(B * H, N, D, q.element_size(), causal, q.device) if group_heads is None else group_heads
    if "atomic" in cfg:
        c = cfg["atomic"]
        assert c["BLOCK_N"] % c["BLOCK_M"] == 0
        dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        attn_bwd_dkdv_kernel[(triton.cdiv(N, c["BLOCK_N"]), B * H)](
            q, k, v, do, lse, delta, dk, dv, dq_acc, qk_scale, sm_scale, N, int(causal), HEAD_DIM=D,
            BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], EVEN=N % c["BLOCK_N"] == 0 and N % c["BLOCK_M"] == 0,
            DQ_ATOMIC=True, **launch_options(c))
        dq.copy_(dq_acc)
        return dq, dk, dv
    if "dkdv" in parts:
        c = cfg["dkdv"]
        assert c["BLOCK_N"] % c["BLOCK_M"] == 0
        attn_bwd_dkdv_kernel[(triton.cdiv(N, c["BLOCK_N"]), B * H)](
            q, k, v, do, lse, delta, dk, dv, dk, qk_scale, sm_scale, N, int(causal), HEAD_DIM=D,
            BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], EVEN=N % c["BLOCK_N"] == 0 and N % c["BLOCK_M"] == 0,
            DQ_ATOMIC=False, **launch_options(c))
    if "dq" in parts:
        c = cfg["dq"]
        assert c["BLOCK_M"] % c["BLOCK_N"] == 0
        attn_bwd_dq_kernel[(triton.cdiv(N, c["BLOCK_M"]) * B * H,)](
            q, k, v, do, lse, delta, dq, qk_scale, sm_scale, N, int(causal), B * H, group, HEAD_DIM=D,
            BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], EVEN=N % c["BLOCK_N"] == 0 and N % c["BLOCK_M"] == 0,
            **launch_options(c))
    return dq, dk, dv


class FlashAttention(torch.autograd.Function):
    """Differentiable flash attention: forward saves O and the row LSE, never P."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale):
        o, lse = attention_forward(q, k, v, causal, sm_scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.sm_scale = causal, sm_scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k, v, o, lse, do.contiguous(), ctx.causal, ctx.sm_scale)
        return dq, dk, dv, None, None


def flash_attention(q, k, v, causal: bool = False, sm_scale: float | None = None) -> torch.Tensor:
    return FlashAttention.apply(q, k, v, causal, sm_scale)


# ------------------------------------------------------------------------------ references and baselines
def naive_attention(q, k, v, causal: bool = False, sm_scale: float | None = None) -> torch.Tensor:
    """Materializes the B·H·N·N scores and probabilities: the seed's baseline."""
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s = (q @ k.transpose(-2, -1)) * sm_scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION"}


def sdpa_context(variant: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[variant])])


def sdpa(q, k, v, causal: bool) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def sdpa_unsupported(variant: str, q, k, v, causal: bool) -> str | None:
    """Why this SDPA backend refuses these inputs on this machine, or None if it runs them."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with sdpa_context(variant):
                sdpa(q[:1, :1], k[:1, :1], v[:1, :1], causal)
        return None
    except (RuntimeError, AttributeError) as exc:
        return f"{SDPA_BACKENDS[variant]} unavailable for these inputs: {str(exc).splitlines()[0][:160].rstrip('.')}"


def fallback_forward_config(head_dim: int) -> dict:
    """A pointer-based forward config (no TMA, no warp specialization) for when none was tuned."""
    if interpreting():
        return INTERPRETER_FWD[0]
    return _fwd(128, 64, 8, 3, False) if head_dim > 64 else _fwd(128, 64, 4, 3, False)


def check_heads(b: int, h: int) -> list[tuple[int, int]]:
    """The heads a check compares at full size: the first and the last (all of them if few)."""
    if b * h <= 4:
        return [(i, j) for i in range(b) for j in range(h)]
    return [(0, 0), (b - 1, h - 1)]


def reference_forward(q, k, v, causal, sm_scale, heads) -> torch.Tensor:
    """float64 naive attention of the selected heads, stacked (len(heads), N, D)."""
    return torch.stack([naive_attention(q[b, h].double(), k[b, h].double(), v[b, h].double(), causal, sm_scale)
                        for b, h in heads])


def reference_lse(q, k, causal, sm_scale, heads) -> torch.Tensor:
    """float64 row statistics the kernel stores for the backward: log2(sum_j 2^(s_ij·log2 e)) =
    logsumexp(s_i) / ln 2, for the selected heads, stacked (len(heads), N)."""
    out = []
    for b, h in heads:
        s = (q[b, h].double() @ k[b, h].double().T) * sm_scale
        if causal:
            n = s.shape[-1]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        out.append(torch.logsumexp(s, dim=-1) / math.log(2.0))
    return torch.stack(out)


def check_lse(lse, lse_ref, heads) -> dict:
    """The forward's second output is checked too: the backward recomputes P from it, so an O that
    is right with an LSE that is wrong poisons every gradient while the forward's own check passes."""
    got = torch.stack([lse[b, h] for b, h in heads])
    return compare(got, lse_ref, "tf32", f"float64 logsumexp / ln 2 of the scaled scores, heads {heads}")


def check_forward(fill, q, k, v, causal, sm_scale, precision: str, ref=None, heads=None) -> dict:
    """Poison O, let `fill(out)` compute it, compare the selected heads with float64 attention."""
    heads = heads or check_heads(q.shape[0], q.shape[1])
    ref = reference_forward(q, k, v, causal, sm_scale, heads) if ref is None else ref
    out = torch.full_like(q, float("nan"))
    fill(out)
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    got = torch.stack([out[b, h] for b, h in heads])
    return compare(got, ref, precision, f"float64 naive attention, heads {heads}")


PRECISION = {torch.float32: "tf32", torch.bfloat16: "bf16", torch.float16: "fp16"}
DTYPE_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


attention_flops = counts.attention_flops          # 4·B·H·N²·D, halved when causal
attention_bytes = counts.attention_bytes          # Q, K, V read and O written once: the problem's bytes
naive_bytes = counts.naive_bytes                  # what naive attention itself moves (its N x N passes)


# ------------------------------------------------------------------------------ the exercise
def user_problems(params) -> list[dict]:
    """A user's own shapes (`--param shapes=[[B,H,N,D],...]`), each for every dtype and causality."""
    return [{"group": "user", "n": n, "batch": b, "heads": h, "head_dim": d, "dtype": dtype, "causal": causal}
            for dtype in params["dtypes"] for b, h, n, d in params["shapes"] for causal in params["causal"]]


def shape_rule(shape: list[int]) -> str | None:
    """A user's (B, H, N, D): a head dim the kernels run, tensors that int64 offsets address."""
    b, h, n, d = shape
    if d not in EXERCISE_HEAD_DIMS:
        return f"head dim D={d} is not one of {', '.join(map(str, EXERCISE_HEAD_DIMS))}"
    return None


def problems(params) -> list[dict]:
    """The user's shapes when given (they replace everything else); else the seed's fp32 case,
    then the main sweep at a fixed token count and model width."""
    if params.get("shapes"):
        return user_problems(params)
    out = [{"group": "seed", "n": n, "batch": params["seed_batch"], "heads": params["seed_heads"],
            "head_dim": params["seed_head_dim"], "dtype": "fp32", "causal": False} for n in params["seed_sizes"]]
    for dtype in params["dtypes"]:
        for d in params["head_dims"]:
            for causal in params["causal"]:
                for n in params["sizes"]:
                    out.append({"group": "main", "n": n, "batch": max(1, params["tokens"] // n),
                                "heads": max(1, params["model_dim"] // d), "head_dim": d, "dtype": dtype,
                                "causal": causal})
    return out


def variants_of(p: dict) -> list[str]:
    """The variants run() times for a problem: naive for the seed's fp32 case only."""
    return (["naive"] if p["group"] == "seed" else []) + [*SDPA_BACKENDS, "triton"]


def work(params) -> list[Work]:
    """Every row run() would time (an SDPA backend that refuses the inputs is skipped at run time):
    one problem per shape, dtype and causality, the same FLOPs, bytes and dtype for every variant."""
    out = []
    for p in problems(params):
        for variant in variants_of(p):
            c = counts.forward_count(variant, p["batch"], p["heads"], p["n"], p["head_dim"], p["dtype"], p["causal"])
            out.append(Work(f"{variant} {p['dtype']} d={p['head_dim']} causal={p['causal']} n={p['n']} "
                            f"{p['batch']}x{p['heads']}", c.flops, c.bytes, c.dtype, launches=c.launches))
    return out


def problem_footprint(p: dict) -> int:
    """Device bytes one problem holds at once (see footprint_bytes)."""
    b, h, n, d = p["batch"], p["heads"], p["n"], p["head_dim"]
    s, bhnd, k = TORCH_DTYPES[p["dtype"]].itemsize, p["batch"] * p["heads"] * n * d, len(check_heads(b, h))
    held = 3 * s * bhnd + 8 * k * n * d                      # q, k, v; the float64 reference of k heads
    reference = 3 * 8 * n * n + 2 * n * n + 3 * 8 * n * d    # one head's float64 scores (3 at once), masks, q, k, v
    check = 2 * s * bhnd + 4 * b * h * n + s * k * n * d + 3 * 8 * min(k * n * d, CHECK_CHUNK)   # O twice, LSE
    naive = (2 * 4 * b * h * n * n + 2 * 4 * bhnd) if p["group"] == "seed" else 0   # fp32 scores, probabilities
    return held + max(reference, check, naive)


def footprint_bytes(p: dict) -> int:
    """Largest problem: q, k, v, O, LSE, float64 reference heads and their N x N scores, naive's B·H·N² (seed)."""
    return max(problem_footprint(x) for x in problems(p))


_WINNERS: dict = {}                 # (head_dim, causal, n) -> bf16's winning config, reused for fp16


def run(ctx, params):
    rows, tuning = [], {}
    for p in ctx.track(problems(params), "attention problems"):
        t = TORCH_DTYPES[p["dtype"]]
        b, h, n, d, causal = p["batch"], p["heads"], p["n"], p["head_dim"], p["causal"]
        g = torch.Generator(device=ctx.device).manual_seed(n * 1000 + d)
        q, k, v = (torch.randn(b, h, n, d, device=ctx.device, generator=g).to(t) for _ in range(3))
        sm_scale = 1.0 / math.sqrt(d)
        precision = PRECISION[t]
        heads = check_heads(b, h)
        ref = reference_forward(q, k, v, causal, sm_scale, heads)

        def cost(variant):                        # one problem: the same FLOPs, bytes and dtype for every variant
            c = counts.forward_count(variant, b, h, n, d, p["dtype"], causal)
            return {"flops": c.flops, "bytes_moved": c.bytes, "dtype": c.dtype, "launches": c.launches}

        def own_bytes(r):                         # the algorithm's traffic where it is not the problem's
            extra = counts.forward_algorithm_bytes(r["variant"], b, h, n, d, t.itemsize)
            if extra is not None:
                r["metrics"]["algorithm_bytes"] = extra
                if r["status"] == "ok":
                    r["metrics"]["algorithm_gbps"] = extra / (r["metrics"]["ms"] * 1e6)
            return r

        here = []
        timing = None if ctx.quick else {"target_ms": 100.0}   # many rows: 100 ms of samples each

        def check(fill, prec=precision):
            return check_forward(fill, q, k, v, causal, sm_scale, prec, ref=ref, heads=heads)

        def naive_row():
            before = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision("highest")   # strict fp32, as the seed's PyTorch ran it
            try:
                r = measure(ctx, "naive", p, fn=lambda: naive_attention(q, k, v, causal, sm_scale),
                            check=lambda: check(lambda o: o.copy_(naive_attention(q, k, v, causal, sm_scale)), "fp32"),
                            timing=timing, **cost("naive"))
            finally:
                torch.set_float32_matmul_precision(before)
            r["metrics"]["algorithm_bytes_formula"] = ("(4·B·H·N·D + 6·B·H·N²)·bytes (Q, K, V, O; S written by Q K^T, "
                                                       "read and written by the scale, read by softmax; P written and read)")
            r["metrics"]["matmul_precision"] = "highest (strict fp32): a slower variant of the tf32 problem"
            return r

        def sdpa_row(variant):
            why = sdpa_unsupported(variant, q, k, v, causal)
            if why:
                return skipped(variant, p, why)
            try:
                with sdpa_context(variant):
                    return measure(ctx, variant, p, fn=lambda: sdpa(q, k, v, causal),
                                   check=lambda: check(lambda o: o.copy_(sdpa(q, k, v, causal))),
                                   timing=timing, **cost(variant))
            except RuntimeError as exc:               # a library path that refuses this size: not our failure
                return skipped(variant, p, f"{SDPA_BACKENDS[variant]} raised: {str(exc).splitlines()[0][:160]}")

        def triton_row():
            key = (d, causal, n)
            cands = forward_candidates(t, d, causal, params["warp_specialize"], n, b * h, **gpu_limits(ctx.device))
            rule = forward_config(t, d, causal, n, b * h, **gpu_limits(ctx.device))
            reuse = t == torch.float16 and key in _WINNERS and not interpreting()
            if interpreting():
                cands = INTERPRETER_FWD
            elif reuse:                           # fp16 runs bf16's winner (same tiles, same code path),
                cands = [_WINNERS[key]] + [c for c in cands if c != _WINNERS[key]]   # the rest as fallbacks

            def fill(c):
                return lambda o: attention_forward(q, k, v, causal, sm_scale, c, out=o)

            lse_ref = []                          # computed once, on the first candidate whose O passes

            def check_both(c):
                verdict = check(fill(c))          # O against float64 attention
                if not verdict["passed"]:
                    return verdict
                if not lse_ref:
                    lse_ref.append(reference_lse(q, k, causal, sm_scale, heads))
                _, lse = attention_forward(q, k, v, causal, sm_scale, c)
                lse_verdict = check_lse(lse, lse_ref[0], heads)
                return verdict if lse_verdict["passed"] else {**lse_verdict, "reason": "LSE: " + lse_verdict["reason"]}

            cfg, trials = tune(ctx, ("attn_fwd", p["dtype"], b, h, n, d, causal, ctx.device.type), cands,
                               launch=lambda c: attention_forward(q, k, v, causal, sm_scale, c),
                               check=check_both, first_good=reuse)
            if t == torch.bfloat16:
                _WINNERS[key] = cfg
            tuning[f"{p['dtype']} d={d} causal={causal} n={n}"] = tuning_summary(trials)
            r = measure(ctx, "triton", p, fn=lambda: attention_forward(q, k, v, causal, sm_scale, cfg),
                        check=lambda: check_both(cfg), timing=timing, **cost("triton"))
            r["metrics"]["algorithm_bytes_formula"] = "4·B·H·N·D·bytes + 4·B·H·N (also writes the fp32 LSE for the backward)"
            r["metrics"]["config"] = label(cfg)
            r["metrics"]["rule_config"] = label(rule)          # what attention_forward runs untuned
            rule_ms = next((x["ms"] for x in trials if x["config"] == label(rule)), None)
            if rule_ms:
                r["metrics"]["rule_ms_in_tuning"] = rule_ms
            r["metrics"]["attn_matrix_bytes"] = b * h * n * n * t.itemsize     # what naive would write
            return r

        for variant in variants_of(p):
            if not ctx.wants(variant):
                continue
            if variant == "naive":
                here.append(attempt("naive", p, naive_row))
                here[-1]["metrics"]["attn_matrix_bytes"] = b * h * n * n * t.itemsize
            elif variant == "triton":
                here.append(attempt("triton", p, triton_row))
            else:
                here.append(attempt(variant, p, lambda variant=variant: sdpa_row(variant)))
        for r in here:
            own_bytes(r)
            r["metrics"]["flops_formula"] = "4·B·H·N²·D" + (" / 2 (causal)" if causal else "")
            r["metrics"]["bytes_formula"] = "4·B·H·N·D·bytes (Q, K, V read, O written)"
        compare_to_library(here, "triton", tuple(SDPA_BACKENDS), "tflops")
        naive = next((r for r in here if r["variant"] == "naive" and r["status"] == "ok"), None)
        ours = next((r for r in here if r["variant"] == "triton" and r["status"] == "ok"), None)
        if naive and ours:
            ours["metrics"]["speedup_vs_naive"] = naive["metrics"]["ms"] / ours["metrics"]["ms"]
        rows += here
    return Result(rows, {"tuning": tuning, "flops_convention": "4·B·H·N²·D per forward (two N² matmuls), halved when causal",
                         "bytes_convention": "the problem's: Q, K, V read and O written once, every variant alike; "
                                             "naive's N x N traffic and our LSE are metrics.algorithm_bytes",
                         "naive_matmul_precision": "highest (strict fp32, no TF32)",
                         "triton_fp32_dots": "tf32 (tl.dot's default input precision)"})


EXERCISE = Exercise(
    id="phase3.flash_attention",
    title="Flash attention forward: the seed's fp32 case vs naive, then bf16/fp16 vs SDPA's fastest backend",
    run=run, needs=Needs(cuda=True, modules=("triton",)),
    params={"seed_sizes": Int([512, 1024, 2048, 4096], min=1, many=True, unit="tokens N of the fp32 seed case"),
            "seed_batch": Int(2, min=1, unit="batches B (seed case)"),
            "seed_heads": Int(4, min=1, unit="heads H (seed case)"),
            "seed_head_dim": Int(64, choices=EXERCISE_HEAD_DIMS, unit="head dim D (seed case)"),
            "sizes": Int([1024, 2048, 4096, 8192, 16384], min=1, many=True, unit="tokens N"),
            "dtypes": Choice(["bf16", "fp16"], ("bf16", "fp16", "fp32"), many=True),
            "head_dims": Int([128, 64], choices=EXERCISE_HEAD_DIMS, many=True, unit="head dim D"),
            "causal": Bool([False, True], many=True),
            "tokens": Int(16384, min=1, unit="tokens per problem (B = tokens // N, at least 1)"),
            "model_dim": Int(2048, min=1, unit="H x D (H = model_dim // D, at least 1)"),
            # Off by default: with Triton 3.6 the warp-specialized configs failed their checks (out-of-bounds
            # writes at head dim 64, a wrong LSE at 128). Opt in with --param warp_specialize=true.
            "warp_specialize": Bool(False),
            # A user's own sizes: replaces the seed case and the sweep (dtypes and causal still apply),
            # e.g. --param shapes=[[2,16,1537,128]] --param causal=true
            "shapes": Int(None, min=1, many=True, length=4, also=(None,), rule=shape_rule,
                          unit="B, H, N, D: your own shapes (replaces the seed case and the sweep)")},
    cpu_params={"seed_sizes": [256], "sizes": [256], "dtypes": ["fp16"], "head_dims": [64], "causal": [False],
                "tokens": 512, "model_dim": 128},
    quick_params={"seed_sizes": [200], "sizes": [1024], "dtypes": ["bf16"], "head_dims": [128], "causal": [True],
                  "tokens": 2048, "model_dim": 256},
    variants=("naive", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "triton"), footprint_bytes=footprint_bytes,
    work=work, workloads=lambda p: kernel_lists.forward_workloads(problems(p), variants_of))


if __name__ == "__main__":
    run_alone(EXERCISE, {"seed_sizes": [200], "sizes": [200], "dtypes": ["fp16"], "head_dims": [32], "causal": [True],
                         "tokens": 400, "model_dim": 64})
