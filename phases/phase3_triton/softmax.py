"""Exercise 3.2: fused softmax. One read and one write per element, against the seed's five-kernel
chain, which moves four times the bytes, and torch.softmax.

    lab run phase3.softmax [--param cols=[2048,65536]]

The problem moves 2·M·N x 4 bytes (read x, write y) for 5·M·N FLOPs (max, subtract, exp, sum,
divide), whatever the variant: that is every row's `bytes_moved`. Fused keeps the row on chip and
moves just that. Unfused (the same five operations) is five kernels, 5 reads and 3 writes of M x N
plus the row vectors, about 4x the problem's bytes: its own traffic is the row's `algorithm_bytes`,
and its 5 launches are counted. At ~0.6 FLOP/byte both are memory-bound, so the roofline predicts
fused = a copy's speed and unfused ~4x slower. (Counts: counts.py.)
Three kernels cover every row length; `plan()` picks one by a rule of the width, the rows'
alignment and the GPU (what `softmax(x)` runs), and the exercise's tuner times it beside the other
candidates:
* `softmax_kernel`: whole rows in registers (several short rows per program), optionally persistent;
  16-byte loads wherever rows start on 16 bytes (`vector_elems`: 100 fp32 columns do), one warp per
  program for short rows that do not (101 columns), so a row is never cut across warps.
* `softmax_online_kernel`: long rows in chunks, a running max and sum (the online softmax), then a
  second, backwards pass that finds the row in L2 (evict-last hints, bounded rows in flight).
* `softmax_split_kernel`: the multi-program row path: ceil(cols / CHUNK) resident programs share a
  row, each holding CHUNK columns in registers, exchanging (max, sum) through memory one row
  ahead, so HBM sees exactly one read and one write at any width (plan() uses it past 32,768
  columns).
"""
import torch

from common.checks import CHECK_CHUNK
from common.exercise import (
    Exercise,
    Needs,
    Result,
    Work,
    against_baseline,
    measure,
    reference_check,
)
from common.params import Int
from common.standalone import run_alone
from common.triton_shim import (
    LOG2E,
    interpreting,
    next_pow2,
    require,
    resident_programs_per_sm,
    sm_count,
    tl,
    triton,
)
from common.triton_tuner import label, launch_options, tune, tuning_summary
from common.variant_rows import attempt, compare_to_library

from . import analysis, counts


# ------------------------------------------------------------------------------ kernels
@triton.jit
def softmax_kernel(x_ptr, y_ptr, n_rows, n_cols_v, stride_x_v, stride_y_v, n_programs,
                   ROWS: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, VEC: tl.constexpr,
                   WIDE: tl.constexpr):
    """ROWS whole rows per tile, each padded to BLOCK_N (a power of two) with -inf. Program p takes
    tiles p, p + n_programs, ...: with one program per tile that is one tile each; with fewer
    (persistent) programs, STAGES > 1 has the compiler load the next tiles while this one is
    reduced and written (a software pipeline through shared memory).

    The width and the strides arrive divided by VEC (see `vector_elems`) and are multiplied back
    here: a product with a constant is one Triton knows to be a multiple of VEC, so every row
    start is 16-byte aligned in its eyes and the loads and stores are 16-byte vectors, even when
    the width (100) is not the multiple of 16 elements Triton's own specialization looks for.
    Offsets inside a tile are int32 from one int64 tile start (fewer registers than an int64
    address per element); WIDE keeps them int64 where ROWS x stride could pass 2^31."""
    n_cols = n_cols_v * VEC
    stride_x = stride_x_v * VEC
    stride_y = stride_y_v * VEC
    cols = tl.arange(0, BLOCK_N)
    local = tl.arange(0, ROWS)
    if WIDE:
        local = local.to(tl.int64)
    for tile in tl.range(tl.program_id(0), tl.cdiv(n_rows, ROWS), n_programs, num_stages=STAGES):
        first = tile * ROWS
        mask = ((first + local)[:, None] < n_rows) & (cols[None, :] < n_cols)
        x_tile = x_ptr + first.to(tl.int64) * stride_x
        y_tile = y_ptr + first.to(tl.int64) * stride_y
        x = tl.load(x_tile + local[:, None] * stride_x + cols[None, :], mask=mask, other=float("-inf"))
        x = x.to(tl.float32) * LOG2E               # exp(v) = exp2(v * log2 e): one multiply, then ex2
        x_max = tl.max(x, axis=1)                  # subtracting the max keeps exp2 from overflowing
        e = tl.math.exp2(x - x_max[:, None])       # padding: exp2(-inf) = 0, so it adds nothing
        inv = 1.0 / tl.sum(e, axis=1)              # one division per row, then multiplies
        y = e * inv[:, None]
        tl.store(y_tile + local[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_online_kernel(x_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y, n_programs,
                          CHUNK: tl.constexpr, EVEN: tl.constexpr, KEEP: tl.constexpr, STREAM: tl.constexpr):
    """Persistent: program p handles rows p, p + n_programs, ... Two passes over each row."""
    cols = tl.arange(0, CHUNK)
    n_chunks = tl.cdiv(n_cols, CHUNK)
    stride_x, stride_y = stride_x.to(tl.int64), stride_y.to(tl.int64)   # offsets past 2^31 elements
    for row in range(tl.program_id(0), n_rows, n_programs):
        x_row = x_ptr + row * stride_x
        y_row = y_ptr + row * stride_y
        # Pass 1: a running max and sum per lane (no cross-lane reduction inside the loop).
        m = tl.full([CHUNK], float("-inf"), tl.float32)
        s = tl.zeros([CHUNK], tl.float32)
        for c in range(0, n_chunks):
            offs = c * CHUNK + cols
            if EVEN:
                x = tl.load(x_row + offs, eviction_policy=KEEP)
            else:
                x = tl.load(x_row + offs, mask=offs < n_cols, other=float("-inf"), eviction_policy=KEEP)
            x = x.to(tl.float32) * LOG2E
            m_new = tl.maximum(m, x)
            ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # a lane that has seen nothing yet
            s = s * tl.math.exp2(m - ref) + tl.math.exp2(x - ref)  # rescale the old sum to the new max
            m = m_new
        row_max = tl.max(m, axis=0)
        inv = 1.0 / tl.sum(s * tl.math.exp2(m - row_max), axis=0)
        # Pass 2, backwards: the chunks pass 1 read last are the likeliest to still be in L2.
        for c in range(0, n_chunks):
            offs = (n_chunks - 1 - c) * CHUNK + cols
            if EVEN:
                x = tl.load(x_row + offs, eviction_policy=STREAM)
                y = tl.math.exp2(x.to(tl.float32) * LOG2E - row_max) * inv
                tl.store(y_row + offs, y.to(y_ptr.dtype.element_ty), eviction_policy=STREAM)
            else:
                mask = offs < n_cols
                x = tl.load(x_row + offs, mask=mask, other=float("-inf"), eviction_policy=STREAM)
                y = tl.math.exp2(x.to(tl.float32) * LOG2E - row_max) * inv
                tl.store(y_row + offs, y.to(y_ptr.dtype.element_ty), mask=mask, eviction_policy=STREAM)


@triton.jit
def _publish_packed(x, slot, part, tag):
    """This part's (max, sum) of its chunk as one 64-bit word, its row's `tag` (1..7) in the low
    three bits of the max. One relaxed atomic store carries data and flag together, so no release
    fence (which would wait for this warp's earlier stores) is needed. Changing the max's last bits
    costs nothing in accuracy: the sum is taken against the published value itself."""
    m = tl.max(x, axis=0)
    m = tl.where(m == float("-inf"), -3.0e38, m)              # an all-padding chunk: sum 0, finite max
    m_bits = (m.to(tl.int32, bitcast=True) & ~7) | tag
    m = m_bits.to(tl.float32, bitcast=True)
    s = tl.sum(tl.math.exp2(x - m), axis=0)
    word = m_bits.to(tl.uint32, bitcast=True).to(tl.int64) | (s.to(tl.int32, bitcast=True).to(tl.int64) << 32)
    tl.atomic_xchg(slot + part, word, sem="relaxed")


@triton.jit
def _load_part(x_ptr, row, stride_x, cols, mask, zero, n_rows):
    """This part's chunk of `row`, times log2 e; -inf past the row's end or past the last row
    (the row test broadcast over `zero`, a tensor of the chunk's shape: interpreter-friendly)."""
    return tl.load(x_ptr + row * stride_x + cols, mask=mask & ((zero + row) < n_rows),
                   other=float("-inf")).to(tl.float32) * LOG2E


@triton.jit
def softmax_split_kernel(x_ptr, y_ptr, slots_ptr, n_rows, n_cols, stride_x, stride_y,
                         n_groups, SPLIT: tl.constexpr, PARTS: tl.constexpr, CHUNK: tl.constexpr,
                         MAX_SPINS: tl.constexpr):
    """Cooperative, for rows too long for one program's registers: SPLIT programs (the parts of a
    group) share a row, each holding CHUNK columns in registers, so every element is read from HBM
    once and written once. Persistent: group g takes rows g, g + n_groups, ...

    The parts exchange each row's (max, sum) through memory, and the exchange is kept off the
    critical path by working one row ahead: a part holds three chunks, the row it writes (i), the
    row whose statistics it publishes (i+1) and the row being loaded (i+2). It publishes row i+1
    before it waits for row i, which every part published an iteration earlier, so the wait is
    usually over at once. A part's statistics and its "ready" flag are one 64-bit word (see
    _publish_packed), written with a relaxed atomic: no release fence, which would wait for the
    part's own stores of the previous row to land.

    Words live in 4 slots per group (slot = iteration % 4), zeroed before each launch; the tag
    (iteration % 7 + 1) tells this row's word from the one 4 rows back and from the zeroed start.
    4 slots suffice: a part publishes row i+4 at the start of its iteration i+3, after its wait for
    row i+2 ended; that wait needs every part to have published row i+2, which each does at the
    start of its iteration i+1, after it read row i's words in iteration i. (With 3 slots a fast
    part could overwrite row i's words while a slow one, having just published row i+1, is still
    waiting to read them.) The wrapper
    launches no more programs than can be resident at once, so every wait ends; MAX_SPINS bounds
    it anyway (a timed-out part writes garbage, which the check rejects, instead of hanging).

    SPLIT is any count (ceil(cols / CHUNK), so an odd width wastes at most one part's tail);
    PARTS, the next power of two, is the width of the vector of words a part reads: lanes past
    SPLIT count as ready, with max -3e38 and sum 0 (they add nothing to the combine)."""
    pid = tl.program_id(0)
    group, part = pid // SPLIT, pid % SPLIT
    cols = part * CHUNK + tl.arange(0, CHUNK)
    mask = cols < n_cols
    parts = tl.arange(0, PARTS)
    real = parts < SPLIT
    slots = slots_ptr + group * (4 * SPLIT)
    stride_x, stride_y = stride_x.to(tl.int64), stride_y.to(tl.int64)
    zero = tl.zeros([CHUNK], tl.int32)
    x = _load_part(x_ptr, group, stride_x, cols, mask, zero, n_rows)
    _publish_packed(x, slots, part, 1)
    x_next = _load_part(x_ptr, group + n_groups, stride_x, cols, mask, zero, n_rows)
    it = 0
    for row in range(group, n_rows, n_groups):
        # issued first: in flight during the wait and the write
        x_after = _load_part(x_ptr, row + 2 * n_groups, stride_x, cols, mask, zero, n_rows)
        _publish_packed(x_next, slots + ((it + 1) % 4) * SPLIT, part, (it + 1) % 7 + 1)
        slot = slots + (it % 4) * SPLIT
        tag = it % 7 + 1
        words = tl.load(slot + parts, mask=real, other=0, volatile=True)   # volatile: from L2, past the incoherent L1
        spins = 0
        while (tl.min((((words & 7) == tag) | (parts >= SPLIT)).to(tl.int32), axis=0) == 0) & (spins < MAX_SPINS):
            words = tl.load(slot + parts, mask=real, other=0, volatile=True)
            spins += 1
        ms = tl.where(real, (words & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True), -3.0e38)
        ss = tl.where(real, (words >> 32).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
        row_max = tl.max(ms, axis=0)
        inv = 1.0 / tl.sum(ss * tl.math.exp2(ms - row_max), axis=0)
        y = tl.math.exp2(x - row_max) * inv
        tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
        x = x_next
        x_next = x_after
        it += 1


_SPLIT_SLOTS: dict = {}


def _split_slots(device, n_groups: int, split: int) -> torch.Tensor:
    """The split kernel's 4 x SPLIT words per group, zeroed on every call (a tiny memset that the
    timing includes): a zero word carries tag 0, which no row has."""
    key = (str(device), n_groups, split)
    if key not in _SPLIT_SLOTS:
        _SPLIT_SLOTS[key] = torch.empty(n_groups * 4 * split, device=device, dtype=torch.int64)
    slots = _SPLIT_SLOTS[key]
    slots.zero_()
    return slots


# ------------------------------------------------------------------------------ the rule, configs and wrapper
VECTOR_BYTES = 16           # the widest load and store a thread issues


def contiguous_vector_elems(n_cols: int, elem_bytes: int = 4) -> int:
    """vector_elems of a contiguous tensor of this width (its rows start where the last ended)."""
    vec = VECTOR_BYTES // elem_bytes
    while n_cols % vec:
        vec //= 2
    return vec


def vector_elems(*tensors: torch.Tensor) -> int:
    """The most elements (a power of two, at most VECTOR_BYTES wide) that divide the width, every
    row stride and every tensor's start: then each row starts on a VECTOR_BYTES boundary and the
    kernels may tell Triton so. 4 for fp32 rows of 100 columns, 1 for 1537."""
    size = tensors[0].element_size()
    vec = VECTOR_BYTES // size
    for t in tensors:
        while vec > 1 and (t.shape[1] % vec or t.stride(0) % vec or (t.data_ptr() // size) % vec
                           or t.data_ptr() % size):
            vec //= 2
    return vec


VALUES_PER_THREAD = 16      # fp32 values a thread holds: 64 bytes in flight each, no spills
ROW_TILE_MIN = 4096         # elements a rows program holds at least (short rows: several per program)
REGISTER_ROW_MAX = 32768    # the longest row one program holds in registers (32 warps x 32 values)
SPLIT_CHUNK_MIN = 4096      # split rows only when there are 2 such chunks (few-rows case)
WARP_ROW_MAX = 512          # unaligned rows up to this width: one warp per program (see plan())
SPLIT_WARPS_PER_SM = 16     # split programs per SM x their warps (~100-128 registers a thread: 64K fit)


def plan(n_rows: int, n_cols: int, sms: int, vec: int | None = None, elem_bytes: int = 4) -> dict:
    """The config `softmax()` runs when given none: a rule of the width, the rows' alignment
    (`vec` elements of `elem_bytes`, see vector_elems; None: that of a contiguous tensor) and the
    GPU's SM count. (The sizes below are fp32's, measured; other dtypes reuse them.)

    * Rows up to WARP_ROW_MAX whose starts are not 16-byte aligned (101 columns) load one
      element per lane, so a warp spans only 32 columns: with several warps per program a short
      row is cut across warps (a barrier per reduction) and each lane holds 1-2 of its columns
      (5 shuffles per element per reduction, 27% of copy measured at 100 columns before the rows
      were vectorized). One warp per program holds whole rows, >= 4 columns a lane up to 128
      columns and VALUES_PER_THREAD values a lane: the CUDA warp kernels' shape.

    * Rows up to REGISTER_ROW_MAX (padded to a power of two) are held whole in one program's
      registers, several short rows per program so each holds >= ROW_TILE_MIN elements, at
      VALUES_PER_THREAD per thread (the longest rows 32 per thread at the 32-warp limit).
    * Longer rows, or rows too few to give every SM one (n_rows < SMs, n_cols >= 2 chunks), are
      split across programs: ceil(n_cols / CHUNK) parts, each holding CHUNK columns, exchanging
      their (max, sum) (softmax_split_kernel): still one HBM read and one write per element.
      Every chunk size keeps 16 warps per SM (CHUNK 2048 at 4 per SM, 4096 at 2, 8192 at 1); the rule
      takes the one that leaves the fewest lanes idle: padding past the row's end (an odd width's
      last part) and program slots no whole group fills. Ties go to 4096, the size measured best.
      (An even share per part with two rows' loads in flight was measured slower on an H200, 2-15
      points of copy bandwidth from 32,769 to 262,144 columns, and taken back.)
    * Rows wider than every chunking can hold at once (over ~1M columns on 132 SMs) take the
      two-pass online kernel."""
    block = next_pow2(n_cols)
    few_rows = n_rows < sms and n_cols >= 2 * SPLIT_CHUNK_MIN
    vec = contiguous_vector_elems(n_cols, elem_bytes) if vec is None else vec
    if block <= WARP_ROW_MAX and vec < VECTOR_BYTES // elem_bytes:
        rows = max(1, 32 * VALUES_PER_THREAD // block)
        return {"kind": "rows", "ROWS": rows, "BLOCK_N": block, "num_warps": 1, "num_stages": 1}
    if block <= REGISTER_ROW_MAX and not few_rows:
        tile = max(block, ROW_TILE_MIN)
        warps = max(4, min(32, tile // (32 * VALUES_PER_THREAD)))
        return {"kind": "rows", "ROWS": tile // block, "BLOCK_N": block, "num_warps": warps, "num_stages": 1}
    best, best_use = None, 0.0
    for chunk in (4096, 2048, 8192):                  # the order breaks ties
        per_sm = SPLIT_WARPS_PER_SM * 32 * VALUES_PER_THREAD // chunk
        split, slots = -(-n_cols // chunk), sms * per_sm
        if split > slots:
            continue
        busy = min(n_rows, slots // split) * split / slots
        use = n_cols / (split * chunk) * busy
        if use > best_use * 1.01:
            best, best_use = split_config(n_cols, chunk, per_sm), use
    if best is not None:
        return best
    return {"kind": "online", "CHUNK": 4096, "programs_per_sm": 4, "hints": True, "num_warps": 8, "num_stages": 2}


def split_config(n_cols: int, chunk: int, programs_per_sm: int) -> dict:
    """ceil(n_cols / chunk) parts of `chunk` columns, VALUES_PER_THREAD per thread."""
    return {"kind": "split", "SPLIT": -(-n_cols // chunk), "CHUNK": chunk, "programs_per_sm": programs_per_sm,
            "num_warps": max(1, min(32, chunk // (32 * VALUES_PER_THREAD))), "num_stages": 1}


def candidates(n_cols: int, n_rows: int | None = None, sms: int | None = None) -> list[dict]:
    """Configs worth timing at this row length, the rule's pick first (when the rows and the SM
    count are given); the tuner keeps the fastest correct one, and the record says which won."""
    block = next_pow2(n_cols)
    out = [plan(n_rows, n_cols, sms)] if n_rows is not None and sms is not None else []
    if block <= 32768:                             # whole rows in registers
        tiles = {max(block, 4096), max(block, 8192)} | ({16384} if block <= 1024 else set())
        for tile in sorted(tiles):
            rows = tile // block
            for per_thread in (8, 16, 32):         # fp32 elements each thread holds
                warps = max(4, min(32, tile // (32 * per_thread)))
                out.append({"kind": "rows", "ROWS": rows, "BLOCK_N": block, "num_warps": warps, "num_stages": 1})
    if block <= WARP_ROW_MAX:                      # one warp holding whole rows (plan()'s pick for unaligned ones)
        for per_thread in (16, 32):
            out.append({"kind": "rows", "ROWS": max(1, 32 * per_thread // block), "BLOCK_N": block, "num_warps": 1,
                        "num_stages": 1})
    if block <= 1024:                              # small programs, 8 values per thread (CUDA's warp kernels' shape)
        for tile in (512, 1024, 2048):
            if tile >= block:
                out.append({"kind": "rows", "ROWS": tile // block, "BLOCK_N": block, "num_warps": tile // 256,
                            "num_stages": 1})
    if block <= 4096:                              # persistent, next tiles loaded during this one
        for tile, warps, per_sm, stages in ((8192, 8, 2, 2), (8192, 8, 2, 3), (4096, 4, 4, 2), (4096, 4, 4, 3)):
            out.append({"kind": "rows", "ROWS": tile // block, "BLOCK_N": block, "num_warps": warps, "num_stages": 1,
                        "programs_per_sm": per_sm, "STAGES": stages})
    if n_cols >= 8192:                             # long rows: chunked, two passes, L2-resident
        for chunk in (4096, 8192):
            for per_sm in (1, 2, 4):
                out.append({"kind": "online", "CHUNK": chunk, "programs_per_sm": per_sm,
                            "hints": True, "num_warps": chunk // 512, "num_stages": 2})
        out.append({"kind": "online", "CHUNK": 4096, "programs_per_sm": 2, "hints": False,
                    "num_warps": 8, "num_stages": 2})
    if n_cols >= 8192:                             # cooperative: ceil(cols / CHUNK) programs per row, one HBM read
        # (CHUNK, programs per SM): 16 values per thread, three chunks per thread in registers
        # (written, published, loading); all the programs must fit on the GPU at once, which the
        # wrapper checks.
        for chunk, per_sm in ((2048, 4), (4096, 2), (4096, 3), (8192, 1), (8192, 2)):
            if -(-n_cols // chunk) <= 512:
                out.append(split_config(n_cols, chunk, per_sm))
    unique = []
    for c in out:
        if c not in unique:
            unique.append(c)
    return unique


def interpreter_configs(n_cols: int) -> list[dict]:
    """One config per kernel, small enough for the CPU interpreter; the split kernel with at least
    two parts whenever the row has two chunks of 16 (see softmax() for how it runs here)."""
    chunk = max(16, next_pow2(-(-n_cols // 3)))
    return [{"kind": "rows", "ROWS": 4, "BLOCK_N": next_pow2(n_cols), "num_warps": 4},
            {"kind": "rows", "ROWS": 2, "BLOCK_N": next_pow2(n_cols), "num_warps": 4, "programs_per_sm": 1, "STAGES": 2},
            {"kind": "online", "CHUNK": 256, "programs_per_sm": 1, "hints": True, "num_warps": 4},
            {"kind": "split", "SPLIT": -(-n_cols // chunk), "CHUNK": chunk, "programs_per_sm": 1, "num_warps": 4},
            {"kind": "rows", "ROWS": max(1, 512 // next_pow2(n_cols)), "BLOCK_N": next_pow2(n_cols), "num_warps": 1}]


def softmax(x: torch.Tensor, out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """Row-wise softmax of a 2-D tensor whose rows are contiguous; `config` None: plan()'s rule."""
    require(x)
    assert x.ndim == 2 and x.stride(1) == 1
    out = torch.empty_like(x) if out is None else out
    n_rows, n_cols = x.shape
    cfg = config or plan(n_rows, n_cols, sm_count(x.device), vector_elems(x, out), x.element_size())
    if cfg["kind"] == "rows":
        tiles = triton.cdiv(n_rows, cfg["ROWS"])
        programs = min(tiles, sm_count(x.device) * cfg["programs_per_sm"]) if "programs_per_sm" in cfg else tiles
        vec = vector_elems(x, out)
        wide = cfg["ROWS"] * max(x.stride(0), out.stride(0)) + cfg["BLOCK_N"] >= 2**31
        softmax_kernel[(programs,)](x, out, n_rows, n_cols // vec, x.stride(0) // vec, out.stride(0) // vec, programs,
                                    ROWS=cfg["ROWS"], BLOCK_N=cfg["BLOCK_N"], STAGES=cfg.get("STAGES", 1), VEC=vec,
                                    WIDE=wide, **launch_options(cfg))
    elif cfg["kind"] == "split":
        split_softmax(x, out, cfg, adapt=config is None)
    else:
        programs = min(n_rows, sm_count(x.device) * cfg["programs_per_sm"])
        keep, stream = ("evict_last", "evict_first") if cfg["hints"] else ("", "")
        softmax_online_kernel[(programs,)](x, out, n_rows, n_cols, x.stride(0), out.stride(0), programs,
                                           CHUNK=cfg["CHUNK"], EVEN=n_cols % cfg["CHUNK"] == 0,
                                           KEEP=keep, STREAM=stream, **launch_options(cfg))
    return out


def split_softmax(x: torch.Tensor, out: torch.Tensor, cfg: dict, launches: int | None = None,
                  adapt: bool = False) -> None:
    """The multi-program row path. On a GPU: one launch of n_groups x SPLIT programs, never more
    than fit at once (the parts of a group wait for each other).

    Triton's CPU interpreter runs programs one after another, so within one launch a part can
    never see the words of parts that run after it. There the kernel is launched twice over the
    same (not re-zeroed) words, with at most 3 rows per group (4 slots, and a part's last
    iteration publishes the row after its last into the fourth): the first launch leaves
    every row's words in place, the second reads them and writes the right answer. Every index,
    mask, tag and the combine of the GPU's code path are exercised; only the waiting is not.
    `launches` overrides the count (a test shows one interpreted launch is rejected). With
    `adapt` (the rule's own config), fewer programs per SM are launched where fewer fit, instead
    of refusing; a config the tuner tries is refused, so the record shows what it asked for."""
    n_rows, n_cols = x.shape
    split, chunk = cfg["SPLIT"], cfg["CHUNK"]
    if chunk & (chunk - 1) or chunk * split < n_cols or chunk * (split - 1) >= n_cols:
        raise ValueError(f"{label(cfg)}: needs a power-of-two CHUNK and SPLIT = ceil({n_cols} / CHUNK)")
    consts = dict(SPLIT=split, PARTS=next_pow2(split), CHUNK=chunk, MAX_SPINS=1 if interpreting() else 1 << 16,
                  **launch_options(cfg))
    per_sm = cfg["programs_per_sm"]
    if interpreting():
        n_groups, launches = -(-n_rows // 3), launches or 2
    else:
        n_groups, launches = max(1, min(n_rows, (sm_count(x.device) * per_sm) // split)), 1
        if x.device.type == "cuda" and sm_count(x.device) * per_sm < split:
            raise ValueError(f"{label(cfg)}: {split} parts of a row do not fit {per_sm} per SM at once")
    args = (x, out, _split_slots(x.device, n_groups, split), n_rows, n_cols, x.stride(0), out.stride(0), n_groups)
    resident = resident_programs_per_sm(softmax_split_kernel, (label(cfg), x.dtype, str(x.device)), x.device,
                                        args, consts)
    if resident is not None and resident < per_sm:
        if not adapt or resident * sm_count(x.device) < split:
            raise ValueError(f"{label(cfg)}: an SM holds only {resident} of these programs at once, not {per_sm}")
        n_groups = max(1, min(n_rows, (sm_count(x.device) * resident) // split))
        args = (x, out, _split_slots(x.device, n_groups, split), *args[3:7], n_groups)
    for _ in range(launches):
        softmax_split_kernel[(n_groups * split,)](*args, **consts)


# ------------------------------------------------------------------------------ reference and baselines
def reference(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.double(), dim=1)


def softmax_unfused(x: torch.Tensor) -> torch.Tensor:
    """The seed's five-operation softmax: five kernels, each a round trip to memory."""
    m = x.max(dim=1, keepdim=True).values
    z = x - m
    e = torch.exp(z)
    s = e.sum(dim=1, keepdim=True)
    return e / s


bytes_fused = counts.softmax_bytes                # the problem's bytes: read x, write y
bytes_unfused = counts.unfused_bytes              # what the five-kernel chain itself moves

FORMULA = {"triton": counts.SOFTMAX_FORMULA, "torch": counts.SOFTMAX_FORMULA, "unfused": counts.SOFTMAX_FORMULA,
           "copy": "2·M·N·4 (read x, write a copy)"}
ALGORITHM_FORMULA = {**FORMULA, "unfused": counts.UNFUSED_FORMULA}


def algorithm_bytes(variant: str, m: int, n: int) -> int:
    """The bytes the variant's own kernels move: the chain's intermediates for unfused, else the problem's."""
    return bytes_unfused(m, n) if variant == "unfused" else bytes_fused(m, n)


REFERENCE = "float64 torch.softmax of the same inputs"


# ------------------------------------------------------------------------------ the exercise
def shapes(params) -> list[tuple[int, int, str]]:
    """(rows, columns, group): the user's own shapes when given (`--param shapes=[[rows,cols],...]`),
    else the seed's case and the sweep of widths at a fixed element count."""
    if params.get("shapes"):
        return [(m, n, "user") for m, n in params["shapes"]]
    out = [(*params["seed_shape"], "seed")]
    for n in params["cols"]:
        out.append((max(1, params["total_elements"] // n), n, "sweep"))
    return out


def _fits_int32(shape: list[int]) -> str | None:
    """Row offsets are int64 but a row's columns are int32 inside the kernels."""
    return f"{shape[1]} columns is 2^31 or more" if shape[1] >= 2**31 else None


def work(params) -> list[Work]:
    """Every row run() times: per shape the copy (once per tensor size), torch.softmax, the unfused
    chain and the Triton kernel (its launches assume a one-kernel config; the split kernel adds one)."""
    out, seen = [], set()
    for m, n, group in shapes(params):
        for variant in ("copy", "torch", "unfused", "triton"):
            if variant == "copy":
                if m * n in seen:
                    continue
                seen.add(m * n)
            c = counts.softmax_count(m, n, variant)
            out.append(Work(f"{variant} {group} {m}x{n}", c.flops, c.bytes, c.dtype, working_set_bytes=bytes_fused(m, n),
                            launches=c.launches))
    return out


def footprint_bytes(p: dict) -> int:
    """Largest fp32 tensor: x, out, float64 reference, plus the unfused chain's 3 or a check's output and chunk."""
    n = max(m * cols for m, cols, _ in shapes(p))
    return (4 + 4 + 8) * n + max(3 * 4 * n, 8 * n, 4 * n + 3 * 8 * min(n, CHECK_CHUNK))


def run(ctx, params):
    rows, tuning, copies = [], {}, {}             # copies: elements -> the copy row of that size
    for m, n, group in ctx.track(shapes(params), "softmax shapes"):
        g = torch.Generator(device=ctx.device).manual_seed(m * 100003 + n)
        x = torch.randn(m, n, device=ctx.device, generator=g) * 4    # spread: exp() spans many decades
        out = torch.empty_like(x)
        ref = reference(x)
        size = {"rows": m, "cols": n, "dtype": "fp32", "group": group, "working_set_bytes": bytes_fused(m, n)}

        def cost(variant, kind=None):              # one problem: the same FLOPs and bytes for every variant
            c = counts.softmax_count(m, n, variant, kind)
            return {"flops": c.flops, "bytes_moved": c.bytes, "dtype": c.dtype, "launches": c.launches}

        here = []

        def check(fill):
            return reference_check(ctx, out, fill, ref, REFERENCE, precision="fp32")

        if ctx.wants("copy") and m * n not in copies:    # the ceiling, once per tensor size
            copies[m * n] = measure(ctx, "copy", size, fn=lambda: out.copy_(x),
                                    check=reference_check(ctx, out, lambda: out.copy_(x), x, "the source tensor"),
                                    **cost("copy"))
            here.append(copies[m * n])
        if ctx.wants("torch"):
            here.append(attempt("torch", size, lambda: measure(
                ctx, "torch", size, fn=lambda: torch.softmax(x, dim=1),
                check=check(lambda: out.copy_(torch.softmax(x, dim=1))), **cost("torch"))))
        if ctx.wants("unfused"):
            here.append(attempt("unfused", size, lambda: measure(
                ctx, "unfused", size, fn=lambda: softmax_unfused(x), check=check(lambda: out.copy_(softmax_unfused(x))),
                **cost("unfused"))))

        def triton_row():
            rule = plan(m, n, sm_count(ctx.device))
            cands = interpreter_configs(n) if interpreting() else candidates(n, m, sm_count(ctx.device))
            cfg, trials = tune(ctx, ("softmax", m, n, ctx.device.type), cands, launch=lambda c: softmax(x, out, c),
                               check=lambda c: check(lambda: softmax(x, out, c))())
            tuning[f"{m}x{n}"] = tuning_summary(trials)
            rule_ms = next((t["ms"] for t in trials if t["config"] == label(rule)), None)
            r = measure(ctx, "triton", size, fn=lambda: softmax(x, out, cfg), check=check(lambda: softmax(x, out, cfg)),
                        **cost("triton", cfg["kind"]))
            r["metrics"]["config"] = label(cfg)
            r["metrics"]["rule_config"] = label(rule)          # what softmax(x) runs untuned (plan())
            if rule_ms and r["status"] == "ok":
                r["metrics"]["rule_ms_in_tuning"] = rule_ms
            r["metrics"]["kernel"] = {"rows": "softmax_kernel", "online": "softmax_online_kernel",
                                      "split": "softmax_split_kernel"}[cfg["kind"]]
            return r

        if ctx.wants("triton"):
            here.append(attempt("triton", size, triton_row))
        for r in here:
            r["metrics"]["bytes_formula"] = FORMULA[r["variant"]]
            r["metrics"]["flops_formula"] = "0 (a copy)" if r["variant"] == "copy" else "5·M·N (max, subtract, exp, sum, divide)"
            r["metrics"]["algorithm_bytes"] = algorithm_bytes(r["variant"], m, n)
            r["metrics"]["algorithm_bytes_formula"] = ALGORITHM_FORMULA[r["variant"]]
            if r["status"] == "ok":                # every variant against the fewest bytes: 2·M·N·4
                r["metrics"]["effective_gbps"] = bytes_fused(m, n) / (r["metrics"]["ms"] * 1e6)
                r["metrics"]["algorithm_gbps"] = r["metrics"]["algorithm_bytes"] / (r["metrics"]["ms"] * 1e6)
        against_baseline(here, copies.get(m * n), "gbps", "pct_of_copy_bandwidth")
        against_baseline(here, copies.get(m * n), "effective_gbps", "pct_of_copy_effective")
        compare_to_library(here, "triton", ("torch",), "gbps")
        fused, unfused = (next((r for r in here if r["variant"] == v and r["status"] == "ok"), None)
                          for v in ("triton", "unfused"))
        if fused and unfused:
            unfused["metrics"].update(analysis.fusion_cost(unfused["metrics"]["algorithm_bytes"], unfused["metrics"]["ms"],
                                                           fused["metrics"]["algorithm_bytes"], fused["metrics"]["ms"]))
        rows += here
    return Result(rows, {"tuning": tuning})


EXERCISE = Exercise(
    id="phase3.softmax", title="Fused softmax: Triton vs the 5-op unfused chain vs torch.softmax, rows up to 65,536",
    run=run, needs=Needs(cuda=True, modules=("triton",)),
    params={"seed_shape": Int([1024, 2048], min=1, length=2, unit="rows, columns"),
            "cols": Int([32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536], min=1, many=True,
                        unit="columns (row length)"),
            "total_elements": Int(2**27, min=1, unit="fp32 elements per tensor (rows = this // cols)"),
            # A user's own sizes: replaces the seed case and the sweep, e.g. --param shapes=[[1000,100000]]
            "shapes": Int(None, min=1, many=True, length=2, also=(None,), rule=_fits_int32,
                          unit="rows, columns: your own shapes (replaces the seed case and the sweep)")},
    cpu_params={"cols": [128, 4096], "total_elements": 2**20},
    quick_params={"seed_shape": [64, 2048], "cols": [1537], "total_elements": 2**14},
    variants=("copy", "torch", "unfused", "triton"), footprint_bytes=footprint_bytes, work=work)


if __name__ == "__main__":
    run_alone(EXERCISE, {"seed_shape": [37, 1537], "cols": [300], "total_elements": 3000})
