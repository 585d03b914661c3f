"""The quantized weights' layouts, shared by the code that makes them (quantize.py, awq.py,
int4_checkpoints.py) and the kernels that read them (quant_gemm.py, int4_mma.py).

Layouts (what the kernels and the tests rely on):

int8 (`Int8Weight`), symmetric, one scale per output row:
    qweight  int8 [N, K], row n = output channel n, values in [-127, 127] (-128 unused)
    scales   [N] (the scale dtype, default the weight's)
    W[n, k] ≈ qweight[n, k] · scales[n]

int4 (`Int4Weight`), asymmetric, one (scale, zero) per group of `group_size` consecutive inputs
of one output row:
    qweight  int32 [N, ceil(K / 8)]: packed along the INPUT dimension K. Word w of row n holds
             the unsigned 4-bit values of k = 8w .. 8w + 7, value k = 8w + j in bits [4j, 4j + 4)
             (nibble 0 = the lowest bits = the smallest k; plain order, not AWQ's 0,2,4,6,1,3,5,7
             interleave). Nibbles past K (K % 8 != 0) are 0 and never used.
    scales   [G, N], G = ceil(K / group_size): group g covers k in [g·group_size, (g+1)·group_size);
             the last group may be partial (K need not be a multiple of group_size).
             Per-channel is group_size == K (one group, G = 1), what GPTQ's group_size -1 means.
    zeros    uint8 [G, N], integer zero points in [0, 15]
    W[n, k] ≈ (q[n, k] − zeros[k // group_size, n]) · scales[k // group_size, n]
    [G, N] rather than [N, G]: a program holding a tile of output rows reads one contiguous run
    of scales per group.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.errors import LabError

INT4_MAX = 15
INT8_MAX = 127
NIBBLES_PER_WORD = 8
GROUP_SIZES = (16, 32, 64, 128, 256, 512, 1024)      # powers of 2 >= 16: a kernel's K tile divides one


# ------------------------------------------------------------------------------ packing
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint4 values [N, K] (any integer dtype, each in [0, 15]) -> int32 [N, ceil(K / 8)], value k
    in bits [4·(k % 8), 4·(k % 8) + 4) of word k // 8 (the module docstring's layout)."""
    if q.dim() != 2:
        raise LabError(f"pack_int4 takes a 2-D [N, K] tensor, got shape {tuple(q.shape)}")
    n_rows, k_in = q.shape
    words = -(-k_in // NIBBLES_PER_WORD)
    padded = torch.zeros(n_rows, words * NIBBLES_PER_WORD, dtype=torch.int64, device=q.device)
    padded[:, :k_in] = q.to(torch.int64)
    if bool(((padded < 0) | (padded > INT4_MAX)).any()):
        raise LabError("pack_int4: values must be in [0, 15]")
    shifts = 4 * torch.arange(NIBBLES_PER_WORD, device=q.device, dtype=torch.int64)
    packed = (padded.view(n_rows, words, NIBBLES_PER_WORD) << shifts).sum(-1)      # disjoint bits: sum == or
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)    # same 32 bits, signed


def unpack_int4(packed: torch.Tensor, k_in: int) -> torch.Tensor:
    """pack_int4's inverse: int32 [N, ceil(K / 8)] -> uint8 [N, K] values in [0, 15]."""
    n_rows, words = packed.shape
    if words != -(-k_in // NIBBLES_PER_WORD):
        raise LabError(f"unpack_int4: {words} words per row do not hold K={k_in} nibbles")
    return unpack_int4_words(packed)[:, :k_in].to(torch.uint8)


def unpack_int4_words(packed: torch.Tensor) -> torch.Tensor:
    """int32 [N, W] -> int32 [N, 8·W], every nibble including the padding past K (int32 shifts:
    the sign bits an arithmetic shift brings in are masked off)."""
    shifts = 4 * torch.arange(NIBBLES_PER_WORD, device=packed.device, dtype=torch.int32)
    return ((packed[:, :, None] >> shifts) & INT4_MAX).reshape(packed.shape[0], -1)


# ------------------------------------------------------------------------------ formats
@dataclass
class Int8Weight:
    """Symmetric per-output-channel int8 (layout in the module docstring)."""
    qweight: torch.Tensor           # int8 [N, K]
    scales: torch.Tensor            # [N]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W ≈ q · scale, rounded once to `dtype` (q is exact in any float type, so computing in
        the wider of `dtype` and the scales' gives the fp32 result)."""
        compute = torch.promote_types(dtype, self.scales.dtype)
        return (self.qweight.to(compute) * self.scales.to(compute)[:, None]).to(dtype)

    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * self.scales.element_size()

    def to(self, device) -> "Int8Weight":
        return Int8Weight(self.qweight.to(device), self.scales.to(device))


@dataclass
class Int4Weight:
    """Asymmetric group-wise int4, packed 8 per int32 along K (layout in the module docstring)."""
    qweight: torch.Tensor           # int32 [N, ceil(K / 8)]
    scales: torch.Tensor            # [G, N]
    zeros: torch.Tensor             # uint8 [G, N]
    in_features: int
    group_size: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W ≈ (q − zero) · scale per group, rounded once to `dtype`: q − zero is exact in any float
        type and the product is rounded once, so computing in the wider of `dtype` and the scales'
        gives the fp32 result. Whole groups are broadcast (no gather): the naive path's cost."""
        compute = torch.promote_types(dtype, self.scales.dtype)
        n_rows, groups = self.out_features, self.scales.shape[0]
        q = unpack_int4_words(self.qweight)
        q = F.pad(q, (0, groups * self.group_size - q.shape[1])).view(n_rows, groups, self.group_size)
        zero = self.zeros.t().to(compute)[:, :, None]
        scale = self.scales.t().to(compute)[:, :, None]
        w = (q.to(compute) - zero) * scale
        return w.view(n_rows, groups * self.group_size)[:, :self.in_features].to(dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))

    def to(self, device) -> "Int4Weight":
        return Int4Weight(self.qweight.to(device), self.scales.to(device), self.zeros.to(device),
                          self.in_features, self.group_size)
