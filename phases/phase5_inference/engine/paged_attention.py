"""Decode attention over the paged KV cache: one new query token per sequence attends to its
`context_len` cached tokens, which live in fixed-size blocks found through its block table.

Layout (shared with kv_cache.py and the runner):
    q             [batch, num_heads, head_dim]
    k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim]   (one layer)
    block_tables  [batch, max_blocks_per_seq] int32   (entries past a sequence's blocks: any value)
    context_lens  [batch] int32                        (tokens cached, the new one included)
    returns       [batch, num_heads, head_dim], q's dtype

The reference gathers each sequence's blocks and calls SDPA: slow, obviously right, the check.

The Triton kernel (`paged_decode_attention_triton`) runs one program per (sequence, KV head,
split): it holds all the query heads of that KV head's group (GQA), so each K/V tile is read from
memory once for the whole group, walks the split's tokens BLOCK_N at a time through the block
table, and keeps an fp32 online softmax (running max and sum, exp2 with log2(e) folded into the
scale). Decode is memory-bound: at batch 1 with 8 KV heads a program per (sequence, head) would
leave most SMs idle, so long contexts are cut into splits (flash-decoding) whose partial outputs
and log-sum-exps a second kernel combines. The split count follows from shapes only (batch, KV
heads, the block table's width), and each sequence divides its own length among the splits on the
device: no host sync, no data-dependent allocation, so a CUDA graph can capture it.

The FlexAttention variant (`paged_decode_attention_flex`) views the whole pool as one long K/V
sequence that every query may see, and turns each block table into a BlockMask whose KV blocks are
the sequence's physical blocks; its mask_mod (exact, as eager mode evaluates it everywhere) maps a
physical token back to its logical position through a physical-to-logical table.
"""
import warnings

import torch
import torch.nn.functional as F

from common.triton_shim import HAVE_TRITON, LOG2E_VALUE, interpreting, next_pow2, require, tl, triton

BACKENDS = ("auto", "triton", "flex", "reference")
MIN_TOKENS_PER_SPLIT = 256          # below this a split's fixed cost (partials, the combine) outweighs its gain
MAX_SPLITS = 32


def paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale: float):
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(batch):
        n = int(context_lens[b])
        blocks = block_tables[b, : (n + block_size - 1) // block_size].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n]      # [n, kv_heads, d]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n]
        o = F.scaled_dot_product_attention(
            q[b].unsqueeze(1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
            scale=scale, enable_gqa=num_heads != num_kv_heads)
        out[b] = o.squeeze(1).to(q.dtype)
    return out


# ------------------------------------------------------------------------------ Triton kernels
@triton.jit
def _attend_tiles(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, lo, hi, qk_scale,
                  stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                  HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                  UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Tokens [lo, hi) of one sequence, BLOCK_N at a time: the online-softmax update of the group's
    query heads. MASK only for the last, partial tile (tokens past hi read as nothing)."""
    offs_n = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        tokens = start + offs_n
        if MASK:
            valid = tokens < hi
            page = tl.load(table_row_ptr + tokens // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        else:
            page = tl.load(table_row_ptr + tokens // BLOCK_SIZE).to(tl.int64)
        slot = tokens % BLOCK_SIZE
        k_rows = k_cache_ptr + page * stride_kb + slot * stride_kt + kv_head * stride_kh
        v_rows = v_cache_ptr + page * stride_vb + slot * stride_vt + kv_head * stride_vh
        if MASK:
            k = tl.load(k_rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(v_rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        else:
            k = tl.load(k_rows[:, None] + dims[None, :])
            v = tl.load(v_rows[:, None] + dims[None, :])
        if UPCAST:                                      # the interpreter's tl.dot mishandles bf16
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale     # [GROUP_PAD, BLOCK_N], log2 units
        if MASK:
            s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))          # finite: a tile holds at least one valid token
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)               # rescales what came before (0 on the first tile)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                        out_ptr, part_out_ptr, part_lse_ptr, qk_scale,
                        stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                        stride_table, stride_ob, stride_oh,
                        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                        UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Grid (batch, num_kv_heads, NUM_SPLITS). Split s of a sequence of n tokens takes tokens
    [s·c, (s+1)·c) with c = ceil(n / NUM_SPLITS) rounded up to BLOCK_N (so every tile but the
    sequence's last is full); a split past the end writes an empty partial. One split writes `out`
    directly; several write their normalized partial output and log2-sum-exp2 for the combine."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    n_ctx = tl.load(context_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(n_ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n_ctx)
    full_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N

    group = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + group
    head_ok = group < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_row, kv_head, lo, full_hi,
                                  qk_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                  HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, UPCAST, DOT_PRECISION)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_row, kv_head, full_hi, hi,
                                  qk_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                  HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, UPCAST, DOT_PRECISION)
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]         # an empty split (or context) gives 0, never NaN
    if NUM_SPLITS == 1:
        dst = out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:
        row = (seq.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split   # [batch, heads, splits]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], o, mask=head_ok[:, None])
        lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=head_ok)


@triton.jit
def combine_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh,
                          HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """Grid (batch, num_heads): out = sum_s w_s·o_s / sum_s w_s with w_s = 2^(lse_s - max lse)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    row = (seq.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + row + splits, mask=splits < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)      # an empty context: every weight 0, output 0
    w = tl.math.exp2(lse - top)
    parts = tl.load(part_out_ptr + (row + splits)[:, None] * HEAD_DIM + dims[None, :],
                    mask=(splits < NUM_SPLITS)[:, None], other=0.0)
    total = tl.sum(w, 0)
    o = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + dims, o.to(out_ptr.dtype.element_ty))


# ------------------------------------------------------------------------------ Triton wrapper
_SM_COUNTS: dict = {}


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (cached: the lookup is host work); 4 under the interpreter, a small GPU
    on which splits still get exercised."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def choose_num_splits(batch: int, num_kv_heads: int, max_context_tokens: int, sms: int) -> int:
    """Splits per (sequence, KV head): enough programs for two per SM, but no split shorter than
    MIN_TOKENS_PER_SPLIT of the longest context the block table can hold. From shapes only."""
    programs = max(1, batch * num_kv_heads)
    wanted = -(-2 * sms // programs)
    by_length = max(1, max_context_tokens // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def default_config(head_dim: int) -> dict:
    """Tile and launch options: 64 tokens per tile keeps two tiles of K and V in flight per program."""
    return {"BLOCK_N": 64 if head_dim <= 128 else 32, "num_warps": 4, "num_stages": 2}


def _validate(q, k_cache, v_cache, block_tables, context_lens) -> None:
    if q.ndim != 3 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"paged decode attention wants q [batch, heads, dim] and caches [blocks, block_size, "
                         f"kv_heads, dim]; got q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads of dim {head_dim} cannot attend to {num_kv_heads} KV heads "
                         f"of dim {k_cache.shape[3]}")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"the Triton kernel needs a power-of-two head_dim >= 16, got {head_dim}")
    if block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} "
                         f"do not match a batch of {batch}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or block_tables.stride(1) != 1:
        raise ValueError("q, the caches and block_tables need a contiguous last dimension")


def paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale: float, *,
                                  num_splits: int | None = None, config: dict | None = None,
                                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel (plus the combine when split). `num_splits` None: choose_num_splits;
    `config` None: default_config. A sequence with context_len 0 (a padding slot of a captured
    batch) gets zeros. Runs on CUDA, or on CPU under TRITON_INTERPRET=1."""
    require(q, k_cache, v_cache)                        # Triton installed; CUDA tensors or the interpreter
    _validate(q, k_cache, v_cache, block_tables, context_lens)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    cfg = config or default_config(head_dim)
    splits = num_splits or choose_num_splits(batch, num_kv_heads, block_tables.shape[1] * block_size,
                                              sm_count(q.device))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if batch == 0:
        return out
    if splits > 1:
        part_out = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out                       # not touched with one split
    upcast = interpreting()
    precision = "ieee" if (upcast or q.dtype == torch.float32) else "tf32"
    paged_decode_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, scale * LOG2E_VALUE,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=cfg["BLOCK_N"], NUM_SPLITS=splits, UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2))
    if splits > 1:
        combine_splits_kernel[(batch, num_heads)](part_out, part_lse, out, out.stride(0), out.stride(1),
                                                  HEAD_DIM=head_dim, NUM_SPLITS=splits,
                                                  SPLITS_PAD=next_pow2(splits), num_warps=4)
    return out


# ------------------------------------------------------------------------------ FlexAttention
def paged_block_mask(block_tables, context_lens, num_blocks: int, block_size: int):
    """The BlockMask that makes flex_attention read each sequence's physical blocks out of the whole
    pool (K/V viewed as one sequence of num_blocks·block_size tokens): full blocks skip mask_mod,
    only a partial last block is masked. Built on the device from the tables, without a sync."""
    from torch.nn.attention.flex_attention import BlockMask
    batch, max_blocks = block_tables.shape
    device = block_tables.device
    n_ctx = context_lens.long()
    used = (n_ctx + block_size - 1) // block_size                      # blocks holding the context
    full = n_ctx // block_size                                         # of which full
    logical = torch.arange(max_blocks, device=device)
    in_use = logical[None, :] < used[:, None]
    table = torch.where(in_use, block_tables.long(), 0)
    # physical block -> its logical index in the sequence (-1: not the sequence's); entries not in
    # use go to a spare last column, so a stale entry never overwrites a real one
    physical_to_logical = torch.full((batch, num_blocks + 1), -1, dtype=torch.int32, device=device)
    physical_to_logical.scatter_(1, torch.where(in_use, table, num_blocks),
                                 logical.to(torch.int32).expand(batch, -1).contiguous())

    def mask_mod(b, h, q_idx, kv_idx):
        where = physical_to_logical[b, kv_idx // block_size]
        return (where >= 0) & (where * block_size + kv_idx % block_size < n_ctx[b])

    tail_block = torch.gather(table, 1, full.clamp(max=max_blocks - 1)[:, None])        # [batch, 1]
    partial_indices = torch.cat([tail_block, table[:, 1:]], dim=1) if max_blocks > 1 else tail_block
    return BlockMask.from_kv_blocks(
        kv_num_blocks=(used - full).to(torch.int32)[:, None, None],
        kv_indices=partial_indices.to(torch.int32)[:, None, None, :],
        full_kv_num_blocks=full.to(torch.int32)[:, None, None],
        full_kv_indices=table.to(torch.int32)[:, None, None, :],
        BLOCK_SIZE=(128, block_size), mask_mod=mask_mod, seq_lengths=(1, num_blocks * block_size),
        compute_q_blocks=False)


_FLEX: dict = {}
# One compiled kernel per batch size and pool size (dynamic=False); past torch's default of 8 it
# would fall back to eager flex, which scores the whole pool.
FLEX_RECOMPILE_LIMIT = 64


def _flex_attention(compiled: bool):
    if compiled not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention
        _FLEX[compiled] = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    return _FLEX[compiled]


def paged_decode_attention_flex(q, k_cache, v_cache, block_tables, context_lens, scale: float, *,
                                compiled: bool | None = None) -> torch.Tensor:
    """torch's FlexAttention over the pool through `paged_block_mask`. Compiled on CUDA (its fused
    decoding kernel, split over the KV blocks); eager elsewhere, which scores every query against
    the whole pool (for tests of the mask only)."""
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    compiled = q.device.type == "cuda" if compiled is None else compiled
    mask = paged_block_mask(block_tables, context_lens, num_blocks, block_size)
    pool_k = k_cache.view(1, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
    pool_v = v_cache.view(1, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
    with warnings.catch_warnings(), torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILE_LIMIT):
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        out = _flex_attention(compiled)(q.unsqueeze(2), pool_k, pool_v, block_mask=mask, scale=scale,
                                        enable_gqa=num_heads != num_kv_heads,
                                        kernel_options={"BLOCK_N": block_size} if compiled else None)
    return out.squeeze(2)


# ------------------------------------------------------------------------------ entry point
def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float,
                           backend: str = "auto", num_splits: int | None = None):
    """The engine's entry point. backend: "auto" (Triton on CUDA, the reference elsewhere),
    "triton", "flex" or "reference". num_splits: the Triton kernel's split count (None:
    choose_num_splits from the shapes); the other backends ignore it."""
    if backend == "auto":
        backend = "triton" if q.device.type == "cuda" and HAVE_TRITON else "reference"
    if backend == "triton":
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale,
                                             num_splits=num_splits)
    if backend == "flex":
        return paged_decode_attention_flex(q, k_cache, v_cache, block_tables, context_lens, scale)
    if backend == "reference":
        return paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")

