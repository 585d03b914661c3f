"""The CUDA W4A16 kernel (int4_mma.cu): int4 weights multiplied on the tensor cores, re-laid once at
load so that each lane fetches its mma fragments with one 16-byte load per 64 inputs.

    mw = relayout(int4_weight)          # weight_formats.Int4Weight -> MmaInt4Weight (any device; once)
    y = matmul(x, mw)                   # x [M, K] bf16 on a CUDA GPU -> y [M, N] bf16

What decides its speed, and why it is laid out so (the .cu file's header has the details):
- batch 1 reads every weight once: 0.5 byte per weight plus a scale and zero point per group, as a
  stream past L1 with 6 lane words (3 KB) in flight per warp; the activations of a small batch are
  staged in shared memory once per block, so no warp waits on an L2 round trip per chunk for them;
- the hot loop spends its issue slots on dequantization and mma only (pointers bumped per round, two
  independent mma chains per chunk): at batch 1 the kernel is bound by how many warps keep loads in
  flight, so the plan splits K until the warps fill at least three quarters of a wave of resident warps
  (`plan`; a deeper ring, 8 or 16 chunks, measured no faster on an H100: scripts/int4_ring_sweep.py);
- the batch rides in the mma's 8-column operand, so 1 to 8 rows cost one mma per 16x16 weights, and
  up to 64 rows are multiplied per weight read;
- K is split across warps (and across blocks when N is small) so that every SM streams weights:
  `plan` is a rule of (M, N, K, SM count), never a table of shapes.

Two tilings, one rule of M (`kernel_of`):
  mma         up to ROWS_MIN_M - 1 rows: one tile per warp, the block's K range of activations staged
              once (what batch 1 needs: every warp streaming its own weights, nothing shared to wait on);
  rows        ROWS_MIN_M to ROWS_MAX_M rows (`rows_matmul`, `rows_plan`): the block stages windows of
              activations (up to 64 rows), lane words and scales together in a cp.async ring, one barrier
              per window, and each warp multiplies two tiles, so an activation fragment read from shared
              memory feeds twice the mma. From 17 rows the mma tiling's activations no longer fit shared
              memory and every warp re-reads all of them per tile: there the rows tiling measured faster on
              an H200 (and slower at 8 rows, where its barrier per window is not amortized);
  dequantized above ROWS_MAX_M rows: the weights dequantized once into bf16 (one kernel, 2.5 bytes per
              weight) and cuBLAS multiplies at its own rate; the tilings would re-read the weights per 64
              rows at mma.sync's rate.

Three ways to stream the weights, one template parameter (`plan`'s "stream"):
  async       batch 1 (one 8-row block): a ring of ASYNC_DEPTH chunks per warp in shared memory, each
              lane copying its own word and scale entries with cp.async (sm_80+): loads in flight cost
              no registers or scoreboards, so the ring runs ahead of the mma without the register
              ring's waits. From 2 rows on the register ring measured faster on the H200;
  registers   a ring of 16-byte loads per lane in registers (any GPU with bf16 mma, sm_80+): the
              default from 2 rows;
  bulk        a ring of 2 KB bulk copies per warp into shared memory (cp.async.bulk on an mbarrier,
              Hopper's copy engine; sm_90+), with each stage's scales copied beside it (a rung of the
              exercise's ladder; measured slower than both).

Formats taken: group sizes that are powers of two >= 32, or one group per row (per-channel, group
size = K); zero points 0..15 (symmetric GPTQ-style weights have zero 8); scales bf16 or fp16 kept
exactly (fp32 scales are rounded to bf16: the kernel reads 16-bit scales). K must be a multiple of 8
(16-byte activation loads). `unavailable` says why a weight or an input cannot run here.

Fused prologues (one row, staged): `add_rms_norm_matmul` runs the residual add and RMSNorm before
the projection inside the kernel (each block sums the whole row's squares from L2, then stages its
own K slice normalized), saving the norm's own launch at batch 1: the engine's QKV and gate_up take it
(fused_ops.add_rms_norm_linear). `silu_mul_matmul` does the same for SiLU(gate) * up, but the down
projection's blocks each span all of K, so every block recomputes the whole row: measured slower than
the separate kernel, the engine does not use it. The kernel can also be launched as a programmatic
dependent (Hopper PDL: weights streamed before griddepcontrol.wait, activations after);
DEPENDENT_LAUNCH is off because it measured no faster.

Built on phase 2: its nvcc build-and-load helper (build.py) compiles the kernel and calls it by ctypes.
"""
import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from common.errors import LabError

from .weight_formats import INT4_MAX, Int4Weight, unpack_int4

SOURCE = Path(__file__).resolve().parent / "int4_mma.cu"
TILE_N = 16                       # weight rows per mma tile
CHUNK_K = 64                      # inputs per 16-byte lane word
BLOCK_K = 32                      # inputs per activation load (and the smallest group)
WARPS = 8                         # warps per block
LANES = 32
MMA_MAX_M = 64                    # activation rows multiplied per weight read
RESIDENT_WARPS_PER_SM = 16       # two blocks of 8 warps fit an SM's registers up to 16 rows (mb <= 2), else one
MIN_CHUNKS_PER_WARP = 16          # from 2 rows a warp's slice is at least 8 KB: ~2.5 turns of its 6-word
                                  # ring, so the ring's fill and the block's epilogue stay a small part of it
MIN_CHUNKS_PER_WARP_ONE_ROW = 4   # at batch 1 at least 2 KB, one turn of the cp.async ring
WAVE_FILL = 0.75                  # batch 1: split K until the warps fill at least this much of one wave of
                                  # resident warps (scripts/int4_ring_sweep.py: below it idle warp slots cost
                                  # more than shorter slices save; near two waves the extra slices lost)
MAX_SPLITS = 16
PER_CHANNEL_LOG2 = 30             # "the group never ends" for one group per row
BF16_128 = 0x4300                 # bf16 bits of 128.0; | z gives 128 + z


@dataclass
class MmaInt4Weight:
    """An Int4Weight re-laid for int4_mma.cu (layout in its header)."""
    wq: torch.Tensor              # int32 [n_tiles, k_chunks, 32, 4]
    meta: torch.Tensor            # int32 [n_tiles, groups, 8, 2]
    out_features: int
    in_features: int
    group_size: int
    fp16_scales: bool

    @property
    def n_tiles(self) -> int:
        return self.wq.shape[0]

    @property
    def k_chunks(self) -> int:
        return self.wq.shape[1]

    @property
    def groups(self) -> int:
        return self.meta.shape[1]

    @property
    def log2_blocks_per_group(self) -> int:
        if self.group_size >= self.in_features:
            return PER_CHANNEL_LOG2
        return (self.group_size // BLOCK_K).bit_length() - 1

    def nbytes(self) -> int:
        return self.wq.numel() * 4 + self.meta.numel() * 4

    def to(self, device) -> "MmaInt4Weight":
        return MmaInt4Weight(self.wq.to(device), self.meta.to(device), self.out_features, self.in_features,
                             self.group_size, self.fp16_scales)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------ what it takes
def format_unsupported(qw: Int4Weight) -> str | None:
    """Why this weight cannot be re-laid for the kernel, or None."""
    g, k = qw.group_size, qw.in_features
    if k % 8:
        return f"the CUDA int4 kernel needs K a multiple of 8 (16-byte activation loads), got K={k}"
    per_channel = g >= k
    if not per_channel and (g < BLOCK_K or g & (g - 1)):
        return f"the CUDA int4 kernel takes group sizes that are powers of two >= {BLOCK_K} or per-channel, got {g}"
    return None


def device_unavailable(device: torch.device) -> str | None:
    """Why the kernel cannot run on this device (not a GPU, no bf16 mma, no nvcc), or None."""
    if device.type != "cuda":
        return f"the CUDA int4 kernel runs on a CUDA GPU, not {device.type}"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return "the CUDA int4 kernel needs bf16 mma (compute capability 8.0 or newer)"
    from phases.phase2_cuda.build import nvcc
    try:
        nvcc()
    except LabError as e:
        return str(e)
    return None


def unavailable(qw: Int4Weight, x: torch.Tensor) -> str | None:
    """Why `multiply` cannot multiply x by this weight here (format, input, device, build), or None."""
    why = format_unsupported(qw)
    if why:
        return why
    if x.dtype != torch.bfloat16:
        return f"the CUDA int4 kernel takes bf16 activations, got {x.dtype}"
    return device_unavailable(x.device)


# ------------------------------------------------------------------------------ the re-layout
def fragment_map() -> tuple[torch.Tensor, torch.Tensor]:
    """(row in tile, input in chunk) of nibble p of word s of lane l: two int64 [32, 4, 8] maps.

    Nibble p is register i = p % 4 of the lane's A fragment, low half for p < 4 and high half
    after. PTX's m16n8k16 A fragment: register i holds row g + 8 (i % 2) (g = lane // 4), logical
    columns 2t + 8 (i // 2) + {0, 1} (t = lane % 4). Logical column c of k-step s is input
    32 (s // 2) + 8 ((c % 8) // 2) + 4 (s % 2) + 2 (c // 8) + c % 2 of the chunk: lane t's
    activations for a 32-input block are then the 8 contiguous inputs 8t .. 8t + 7."""
    lane = torch.arange(LANES).view(LANES, 1, 1)
    step = torch.arange(4).view(1, 4, 1)
    nibble = torch.arange(8).view(1, 1, 8)
    g, t = lane // 4, lane % 4
    reg, half = nibble % 4, nibble // 4
    row = g + 8 * (reg % 2)
    upper = reg // 2
    k = 32 * (step // 2) + 8 * t + 4 * (step % 2) + 2 * upper + half
    return row.expand(LANES, 4, 8), k.expand(LANES, 4, 8)


def relayout(qw: Int4Weight) -> MmaInt4Weight:
    """Int4Weight (weight_formats.py's layout) -> the kernel's: lane words and per-tile scales; on qw's
    device. Rows past N and inputs past K are zero nibbles (their activations are zero)."""
    why = format_unsupported(qw)
    if why:
        raise LabError(why)
    n, k = qw.out_features, qw.in_features
    device = qw.qweight.device
    n_tiles, k_chunks = cdiv(n, TILE_N), cdiv(k, CHUNK_K)
    q = torch.zeros(n_tiles * TILE_N, k_chunks * CHUNK_K, dtype=torch.uint8, device=device)
    q[:n, :k] = unpack_int4(qw.qweight, k)
    rows, ks = (m.to(device) for m in fragment_map())
    tiles = q.view(n_tiles, TILE_N, k_chunks, CHUNK_K).permute(0, 2, 1, 3)        # [tile, chunk, 16, 64]
    nibbles = tiles[:, :, rows, ks].to(torch.int64)                                # [tile, chunk, 32, 4, 8]
    words = (nibbles << (4 * torch.arange(8, device=device))).sum(-1)
    wq = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()
    return MmaInt4Weight(wq, tile_meta(qw, n_tiles), n, k, qw.group_size, qw.scales.dtype == torch.float16)


def tile_meta(qw: Int4Weight, n_tiles: int) -> torch.Tensor:
    """int32 [n_tiles, groups, 8, 2]: entry (tile, group, g, j) = 16-bit scale of row 16 tile + g + 8j
    in the low half, bf16 bits of 128 + its zero point in the high half."""
    groups, n = qw.scales.shape
    scales = qw.scales if qw.scales.dtype in (torch.bfloat16, torch.float16) else qw.scales.to(torch.bfloat16)
    bits = scales.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF                    # [G, N]
    zeros = qw.zeros.to(torch.int64)
    if bool(((zeros < 0) | (zeros > INT4_MAX)).any()):
        raise LabError("int4 zero points must be in [0, 15]")
    packed = bits | ((BF16_128 | zeros) << 16)
    packed = F.pad(packed, (0, n_tiles * TILE_N - n))                                        # [G, N_pad]
    packed = packed.view(groups, n_tiles, 2, 8).permute(1, 0, 3, 2)                           # [tile, G, g, j]
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).contiguous()


def dequantize_relaid(mw: MmaInt4Weight) -> torch.Tensor:
    """fp32 [N, K] from the re-laid weight alone (the kernel's view of it): the test that the
    re-layout loses nothing, and the CPU twin of lab_int4_dequantize."""
    rows, ks = fragment_map()
    words = mw.wq.to(torch.int64) & 0xFFFFFFFF
    nibbles = (words[..., None] >> (4 * torch.arange(8, device=words.device))) & INT4_MAX      # [tile, chunk, 32, 4, 8]
    n_tiles, k_chunks = mw.n_tiles, mw.k_chunks
    q = torch.zeros(n_tiles, k_chunks, TILE_N, CHUNK_K, dtype=torch.int64, device=words.device)
    q[:, :, rows.to(words.device), ks.to(words.device)] = nibbles
    q = q.permute(0, 2, 1, 3).reshape(n_tiles * TILE_N, k_chunks * CHUNK_K)
    meta = mw.meta.to(torch.int64) & 0xFFFFFFFF                                              # [tile, G, g, j]
    per_row = meta.permute(0, 3, 2, 1).reshape(n_tiles * TILE_N, mw.groups)                   # [N_pad, G]
    scale_bits = (per_row & 0xFFFF).to(torch.int32).to(torch.int16)
    scale = scale_bits.view(torch.float16 if mw.fp16_scales else torch.bfloat16).float()
    zero = ((per_row >> 16) & 0xFF).float()                                                  # low byte of 0x43zz
    group_of_k = torch.clamp(torch.arange(k_chunks * CHUNK_K, device=q.device) // mw.group_size, max=mw.groups - 1)
    w = (q.float() - zero[:, group_of_k]) * scale[:, group_of_k]
    return w[:mw.out_features, :mw.in_features]


# ------------------------------------------------------------------------------ the launch rule
def next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def floor_pow2(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


def plan(m: int, n: int, k: int, sms: int, k_split: int | None = None, bulk: bool = False) -> dict:
    """The partition for an [m, k] x [k, n] problem on `sms` SMs: 8-row activation blocks per tile
    (mb), warps along K per tile (wk), tiles per block (wn = 8 / wk) and blocks along K (splits),
    K split in powers of two (balanced to one word).

    Batch 1: K is split until the call's warps fill WAVE_FILL of one wave of the SMs' resident warps,
    each slice at least MIN_CHUNKS_PER_WARP_ONE_ROW lane words; the split stays inside a block (wk <= 8)
    unless the tiles alone would leave more than half the SMs without a block (a split across blocks
    adds an fp32 round trip through L2 and a last-block sum: measured slower on every matrix tried,
    all with at least 1.7x as many tiles as SMs; between half and 1.7x the SMs it is untested).
    From 2 rows: at most one wave (rounded down), slices at least MIN_CHUNKS_PER_WARP long: every block
    stages all its rows' activations, so a finer split adds an L2 read of M x K per extra block
    (measured slower on the 8B's qkv at batch 4 and 16 with twice the blocks). Where that leaves fewer
    blocks than SMs (few tiles and a short K, as in a 1B model's projections), the slices shorten, within
    a block and down to the batch-1 floor, until every SM has a block: an idle SM's share of the
    bandwidth is lost outright (measured faster on the 1B's qkv and o and the 8B's o at batch 4 and
    16), while a split across blocks to fill the last few SMs was slower (the 1B's down)."""
    n_tiles, k_chunks, m_tiles = cdiv(n, TILE_N), cdiv(k, CHUNK_K), cdiv(m, MMA_MAX_M)
    mb = next_pow2(cdiv(min(m, MMA_MAX_M), 8))
    resident = RESIDENT_WARPS_PER_SM if mb <= 2 else RESIDENT_WARPS_PER_SM // 2
    tiles = n_tiles * m_tiles
    finest = floor_pow2(max(1, k_chunks // MIN_CHUNKS_PER_WARP_ONE_ROW))     # slices at the batch-1 floor
    if k_split is None and m == 1:
        across_blocks = 2 * tiles < sms
        most = min(finest, WARPS * (MAX_SPLITS if across_blocks else 1))
        k_split = 1
        while 2 * k_split <= most and tiles * k_split < WAVE_FILL * sms * resident:
            k_split *= 2
    elif k_split is None:
        most = min(floor_pow2(max(1, sms * resident // tiles)), WARPS * MAX_SPLITS)
        k_split = min(most, floor_pow2(max(1, k_chunks // MIN_CHUNKS_PER_WARP)))
        while cdiv(tiles * k_split, WARPS) < sms and 2 * k_split <= min(most, finest, WARPS):
            k_split *= 2
    wk = min(k_split, WARPS)
    return {"mb": mb, "wk": wk, "wn": WARPS // wk, "splits": k_split // wk, "bulk": bulk, "stream": stream_of(m, bulk)}


STREAMS = {"registers": 0, "bulk": 1, "async": 2}     # the launcher's `bulk` argument


def stream_of(m: int, bulk: bool = False) -> str:
    """How the weights are streamed: bulk copies when asked (a rung), the cp.async ring at batch 1
    (one row: the ring is the only thing in flight and its depth decides), else the register ring."""
    if bulk:
        return "bulk"
    return "async" if m == 1 else "registers"


def launches(m: int) -> int:
    """Kernels per `multiply` call: the tensor-core kernel, or the dequantization and cuBLAS."""
    return 2 if uses_dequantized(m) else 1


# ------------------------------------------------------------------------------ calling it
SIGNATURES = {
    "lab_w4a16_mma": [ctypes.c_void_p] * 6 + [ctypes.c_int] * 14 + [ctypes.c_void_p] * 3 + [ctypes.c_float, ctypes.c_int,
                                                                                       ctypes.c_void_p],
    "lab_int4_dequantize": [ctypes.c_void_p] * 3 + [ctypes.c_int] * 7 + [ctypes.c_void_p],
    "lab_w4a16_rows": [ctypes.c_void_p] * 6 + [ctypes.c_int] * 11 + [ctypes.c_void_p],
}
_COUNTERS: dict = {}


def library():
    from phases.phase2_cuda import build
    return build.load(SOURCE, SIGNATURES)


def counters(device: torch.device, size: int) -> torch.Tensor:
    """A zeroed int32 buffer per device for the split-K arrival counts (each use leaves it zero)."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < size:
        have = torch.zeros(max(size, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = have
    return have


def split_workspace(y: torch.Tensor, mw: MmaInt4Weight, splits: int, grid_x: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partials [splits][M_pad][N_pad], arrival counters) for a launch split `splits` ways along K
    over `grid_x` tile groups; without a split the kernel reads neither (y stands in for both)."""
    if splits == 1:
        return y, y
    m_tiles = cdiv(y.shape[0], MMA_MAX_M)
    partials = torch.empty(splits * m_tiles * MMA_MAX_M * mw.n_tiles * TILE_N, dtype=torch.float32, device=y.device)
    return partials, counters(y.device, grid_x * m_tiles)


def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def bulk_copies(device: torch.device) -> bool:
    """Whether this GPU has the bulk-copy engine (compute capability 9.0 or newer)."""
    return torch.cuda.get_device_capability(device)[0] >= 9


DEPENDENT_LAUNCH = False         # launch as programmatic dependents (Hopper PDL): measured no faster on an
                                 # H200 over 32 layers of 8B projections (with the trigger at the kernel's
                                 # start, after its main loop, or implicit), so off; True for an A/B


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels launch as programmatic dependents here (Hopper's griddepcontrol, sm_90+)."""
    return torch.cuda.get_device_capability(device)[0] >= 9


PROLOGUES = {"add_rms_norm": 1, "silu_mul": 2}      # int4_mma.cu's PROLOGUE_*


def prologue_fits(m: int, mw: MmaInt4Weight, sms: int) -> bool:
    """Whether a fused prologue can run for this call: one row whose block slice of K is staged in
    shared memory (the launcher's rule, int4_mma.cu's X_SMEM_MAX_BYTES)."""
    if m != 1 or mw.in_features % 8:
        return False
    cfg = plan(m, mw.out_features, mw.in_features, sms)
    k_split = cfg["wk"] * cfg["splits"]
    block_chunks = cdiv(mw.k_chunks * cfg["wk"], k_split) + 1
    return block_chunks * CHUNK_K * 2 <= X_SMEM_MAX_BYTES


X_SMEM_MAX_BYTES = 32 * 1024


ROWS_MIN_M = 17                  # from three 8-row blocks: the mma tiling's activations leave shared memory
ROWS_MAX_M = 128                 # two 64-row passes over the weights; above, dequantize once and cuBLAS


def kernel_of(m: int) -> str:
    """Which path `multiply` takes for M rows: "mma", "rows" or "dequantized" (module docstring)."""
    if m > ROWS_MAX_M:
        return "dequantized"
    return "rows" if m >= ROWS_MIN_M else "mma"


def uses_dequantized(m: int) -> bool:
    """Above ROWS_MAX_M rows `multiply` dequantizes once and lets cuBLAS multiply."""
    return kernel_of(m) == "dequantized"


def chosen_config(m: int, n: int, k: int, group_size: int, sms: int) -> dict:
    """The config `multiply` launches for an [m, k] x [k, n] product with this group size, for records."""
    small = group_size == BLOCK_K < k             # a group per 32-input block (log2_blocks_per_group 0)
    kind = kernel_of(m)
    if kind == "rows":
        return rows_plan(m, n, k, sms, small)
    if kind == "dequantized":
        return {"kernel": "dequantized"}
    return dict(plan(m, n, k, sms), kernel="mma")


def weight_reads(m: int) -> int:
    """How many times a `multiply` of M rows reads the int4 weights (64 rows per pass)."""
    return 1 if uses_dequantized(m) else cdiv(m, MMA_MAX_M)


def multiply(x: torch.Tensor, mw: MmaInt4Weight) -> torch.Tensor:
    """y = x @ W^T by the rule of M (`kernel_of`): the mma tiling, the rows tiling, or dequantize + cuBLAS."""
    kind = kernel_of(x.shape[0])
    if kind == "dequantized":
        return F.linear(x, dequantize(mw))
    return rows_matmul(x, mw) if kind == "rows" else matmul(x, mw)


def matmul(x: torch.Tensor, mw: MmaInt4Weight, config: dict | None = None) -> torch.Tensor:
    """y = x @ W^T, x [M, K] bf16 on the GPU (contiguous rows), y [M, N] bf16."""
    _check_input(x, mw.in_features, "x")
    return _launch(x.contiguous(), mw, config)


def add_rms_norm_matmul(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        mw: MmaInt4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * norm_weight @ W^T, x + residual) for one row in one kernel (residual
    None: RMSNorm(x), and x is returned as the residual), rounded as fused_ops' Triton kernels round.
    Needs prologue_fits."""
    _check_input(x, mw.in_features, "x")
    if x.shape[0] != 1 or not prologue_fits(1, mw, sm_count(x.device)):
        raise LabError(f"int4 add_rms_norm_matmul: one row whose K slice fits shared memory, got {tuple(x.shape)}")
    if residual is not None:
        _check_input(residual, mw.in_features, "residual")
    if norm_weight.shape != (mw.in_features,) or norm_weight.dtype != torch.bfloat16:
        raise LabError(f"int4 add_rms_norm_matmul: norm_weight must be bf16 [{mw.in_features}], "
                       f"got {norm_weight.dtype} {tuple(norm_weight.shape)}")
    new_residual = x if residual is None else torch.empty_like(residual)
    y = _launch(x.contiguous(), mw, None, PROLOGUES["add_rms_norm"], None if residual is None else residual.contiguous(),
                norm_weight.contiguous(), None if residual is None else new_residual, eps)
    return y, new_residual


def silu_mul_matmul(gate_up: torch.Tensor, mw: MmaInt4Weight) -> torch.Tensor:
    """(SiLU(gate_up[:, :K]) * gate_up[:, K:]) @ W^T for one row in one kernel, K = W's inputs."""
    k = mw.in_features
    _check_input(gate_up, 2 * k, "gate_up")
    if gate_up.shape[0] != 1 or not prologue_fits(1, mw, sm_count(gate_up.device)):
        raise LabError(f"int4 silu_mul_matmul: one row whose K slice fits shared memory, got {tuple(gate_up.shape)}")
    return _launch(gate_up.contiguous(), mw, None, PROLOGUES["silu_mul"])


def _check_input(x: torch.Tensor, width: int, name: str) -> None:
    if x.dim() != 2 or x.shape[1] != width:
        raise LabError(f"int4 matmul: {name} must be [M, {width}], got {tuple(x.shape)}")
    if x.dtype != torch.bfloat16 or x.device.type != "cuda":
        raise LabError(f"int4 matmul: {name} must be bf16 on a CUDA GPU, got {x.dtype} on {x.device.type}")


def _launch(x: torch.Tensor, mw: MmaInt4Weight, config: dict | None, prologue: int = 0,
            residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
            residual_out: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """The kernel's launch: y [M, N] for x [M, K] (with a prologue, M = 1 and x may be [1, 2K])."""
    from phases.phase2_cuda import build
    tensors = [t for t in (x, residual, norm_weight) if t is not None]
    if any(t.data_ptr() % 16 for t in tensors):
        if prologue:
            raise LabError("int4 matmul: a fused prologue needs 16-byte aligned inputs")
        x = x.clone()
    m = x.shape[0]
    y = torch.empty(m, mw.out_features, dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return y
    cfg = config or plan(m, mw.out_features, mw.in_features, sm_count(x.device))
    stream = cfg.get("stream") or stream_of(m, cfg["bulk"])
    if stream == "bulk" and not bulk_copies(x.device):
        raise LabError("int4 matmul: the bulk-copy stream needs compute capability 9.0 (Hopper) or newer")
    if stream == "async" and cfg["mb"] != 1:
        raise LabError(f"int4 matmul: the cp.async ring takes one 8-row block (mb 1), got mb {cfg['mb']}")
    pdl = cfg.get("pdl", DEPENDENT_LAUNCH) and dependent_launch(x.device)
    lib, _ = library()
    partials, count = split_workspace(y, mw, cfg["splits"], cdiv(mw.n_tiles, cfg["wn"]))

    def ptr(t):
        return None if t is None else build.ptr(t)
    code = lib.lab_w4a16_mma(build.ptr(x), build.ptr(mw.wq), build.ptr(mw.meta), build.ptr(y), build.ptr(partials),
                             build.ptr(count), m, mw.out_features, mw.in_features, mw.n_tiles, mw.k_chunks, mw.groups,
                             mw.log2_blocks_per_group, cfg["wn"], cfg["wk"], cfg["splits"], cfg["mb"],
                             int(mw.fp16_scales), STREAMS[stream], prologue, ptr(residual), ptr(norm_weight),
                             ptr(residual_out), float(eps), int(pdl), build.stream(x.device))
    build.check(lib, code, "int4 mma launch")
    return y


# ------------------------------------------------------------------------------ the rows tiling
ROWS_WINDOW = 2                   # chunks per staged window (int4_mma.cu's ROWS_WINDOW)
ROWS_X_PITCH = ROWS_WINDOW * CHUNK_K * 2 + 64
ROWS_MIN_WINDOWS_PER_SPLIT = 4    # a split's ring fills and drains once: at least a few windows past it
SM_SHARED_BYTES = 228 * 1024      # shared memory per SM on sm_80/sm_90 (the H100 and H200)
ROWS_TILES_PER_WARP = (2,)       # int4_mma.cu's ROWS_TILES_PER_WARP


def rows_smem_bytes(mb: int, tw: int, small_group: bool) -> int:
    """Dynamic shared memory of one rows block (int4_mma.cu's RowsLayout)."""
    metas = 2 if small_group else 1
    stage = mb * 8 * ROWS_X_PITCH + WARPS * tw * ROWS_WINDOW * 512 + WARPS * tw * ROWS_WINDOW * metas * 64
    stages = 4 if 4 * stage <= 200 * 1024 else 3
    return stages * stage


def rows_blocks_per_sm(mb: int, tw: int, small_group: bool) -> int:
    """Rows blocks resident per SM: two up to 2 row blocks (int4_mma.cu's launch bounds) when two fit
    shared memory."""
    if mb > 2:
        return 1
    return max(1, min(2, SM_SHARED_BYTES // (rows_smem_bytes(mb, tw, small_group) + 1024)))


def rows_plan(m: int, n: int, k: int, sms: int, small_group: bool = False, tw: int | None = None,
              splits: int | None = None) -> dict:
    """The rows kernel's partition: 8-row blocks (mb), tiles per warp (tw), blocks along K (splits).

    A rule of (M, N, K, SM count): each (tw, splits) is costed as the waves of blocks over the SMs'
    resident slots times one block's lane words (the time of a wave is its slowest block), plus the
    fp32 partials a split writes and its last block reads back (L2 traffic, a quarter of a DRAM word's
    cost); the cheapest wins, ties to fewer splits
    and more tiles per warp (fewer activation reads per mma)."""
    n_tiles, k_chunks, m_tiles = cdiv(n, TILE_N), cdiv(k, CHUNK_K), cdiv(m, MMA_MAX_M)
    mb = max(2, next_pow2(cdiv(min(m, MMA_MAX_M), 8)))
    best = None
    for tw_c in ([tw] if tw else ROWS_TILES_PER_WARP):
        slots = sms * rows_blocks_per_sm(mb, tw_c, small_group)
        blocks_n = cdiv(n_tiles, WARPS * tw_c) * m_tiles
        max_splits = max(1, k_chunks // (ROWS_WINDOW * ROWS_MIN_WINDOWS_PER_SPLIT))
        for s in ([splits] if splits else [1 << i for i in range(5) if 1 << i <= max_splits]):
            waves = cdiv(blocks_n * s, slots)
            words = tw_c * cdiv(k_chunks, s)                       # a warp's lane words (512 B each)
            # its fp32 outputs (mb x 512 B per tile) written per split and read back by the last block,
            # through L2: counted at a quarter of a DRAM word
            partials = 0 if s == 1 else tw_c * mb * (1 + s) / 4
            cost = (waves * (words + partials), s, -tw_c)
            if best is None or cost < best[0]:
                best = (cost, tw_c, s)
    _, tw_best, s_best = best
    return {"kernel": "rows", "mb": mb, "tw": tw_best, "splits": s_best}


def rows_matmul(x: torch.Tensor, mw: MmaInt4Weight, config: dict | None = None) -> torch.Tensor:
    """y = x @ W^T through the rows tiling (any M; built for 9 to 64 rows per weight read)."""
    from phases.phase2_cuda import build
    _check_input(x, mw.in_features, "x")
    x = x.contiguous()
    if x.data_ptr() % 16:
        x = x.clone()
    m = x.shape[0]
    y = torch.empty(m, mw.out_features, dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return y
    small = mw.log2_blocks_per_group == 0
    cfg = config or rows_plan(m, mw.out_features, mw.in_features, sm_count(x.device), small)
    partials, count = split_workspace(y, mw, cfg["splits"], cdiv(mw.n_tiles, WARPS * cfg["tw"]))
    lib, _ = library()
    code = lib.lab_w4a16_rows(build.ptr(x), build.ptr(mw.wq), build.ptr(mw.meta), build.ptr(y), build.ptr(partials),
                              build.ptr(count), m, mw.out_features, mw.in_features, mw.n_tiles, mw.k_chunks, mw.groups,
                              mw.log2_blocks_per_group, cfg["tw"], cfg["splits"], cfg["mb"], int(mw.fp16_scales),
                              build.stream(x.device))
    build.check(lib, code, "int4 rows launch")
    return y


def dequantize(mw: MmaInt4Weight) -> torch.Tensor:
    """bf16 [N, K] on the GPU from the re-laid weight (one kernel)."""
    from phases.phase2_cuda import build
    w = torch.empty(mw.out_features, mw.in_features, dtype=torch.bfloat16, device=mw.wq.device)
    lib, _ = library()
    code = lib.lab_int4_dequantize(build.ptr(mw.wq), build.ptr(mw.meta), build.ptr(w), mw.out_features,
                                   mw.in_features, mw.n_tiles, mw.k_chunks, mw.groups, mw.log2_blocks_per_group,
                                   int(mw.fp16_scales), build.stream(mw.wq.device))
    build.check(lib, code, "int4 dequantize launch")
    return w
