"""Weight-only quantization of a linear layer's weight W [N out, K in], and the drop-in module that
multiplies by it: int8 per output channel, and int4 group-wise with zero points (AWQ-style).
Round-to-nearest; torch only (the fused kernels are in quant_gemm.py).

Layouts: weight_formats.py (Int8Weight, Int4Weight and the int4 packing).

Symmetric int4 (GPTQ's sym=True) is the same layout with every zero point 8 (quantize_int4's
symmetric=True): W ≈ (q − 8) · scale. Checkpoints quantized elsewhere (AutoAWQ, GPTQ) are converted
into this layout at load by int4_checkpoints.py.

Error bounds (tested): each dequantized weight is within scale/2 of the original (its row's scale
for int8, its group's for int4). Stored scales are rounded UP to the scale dtype and the int4
range always includes 0 (zero exactly representable, as torchao's preserve_zero), so no value is
clamped by more than rounding.

`QuantizedLinear.forward` runs one of three paths on the same quantized weight:
    "naive"    dequantize the whole weight to the activation dtype, then F.linear (the slow path
               whose extra traffic the exercise measures)
    "fused"    quant_gemm's Triton kernels, dequantizing in registers (CUDA, or the interpreter)
    "library"  torch's tinygemm ops (_weight_int4pack_mm / _weight_int8pack_mm; on a CPU their
               _for_cpu twins), in their own packed formats converted once and cached
    "cuda"     int4 only: int4_mma's CUDA kernel (tensor cores, weights re-laid once and cached)
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from common.errors import LabError

from .weight_formats import GROUP_SIZES, INT4_MAX, INT8_MAX, Int4Weight, Int8Weight, pack_int4, unpack_int4

LIBRARY_INT4_GROUP_SIZES = (32, 64, 128, 256)        # what tinygemm accepts
LIBRARY_INNER_K_TILES = 8                            # tinygemm's K tiling (2, 4 or 8); K % (16·8) == 0
PATHS = ("naive", "fused", "library", "cuda")


# ------------------------------------------------------------------------------ rounding
def default_scale_dtype(weight: torch.Tensor, scale_dtype: torch.dtype | None = None) -> torch.dtype:
    """The scales' dtype: the one asked for, else the weight's float dtype (fp32 for integers)."""
    return scale_dtype or (weight.dtype if weight.is_floating_point() else torch.float32)


def round_up_to(values_fp32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values in `dtype`, each the nearest representable value >= the fp32 one (a scale rounded
    down would stretch the range past the integers and clamp the extremes)."""
    stored = values_fp32.to(dtype)
    below = stored.float() < values_fp32
    return torch.where(below, torch.nextafter(stored, torch.full_like(stored, float("inf"))), stored)


def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype | None = None) -> Int8Weight:
    """Symmetric round-to-nearest per output row: scale = max|W[n]| / 127 (rounded up to
    scale_dtype, default the weight's float dtype), q = round(W / scale)."""
    if weight.dim() != 2:
        raise LabError(f"quantize_int8 takes a 2-D [N, K] weight, got shape {tuple(weight.shape)}")
    w = weight.float()
    scale_dtype = default_scale_dtype(weight, scale_dtype)
    amax = w.abs().amax(dim=1).clamp(min=1e-8)
    scales = round_up_to(amax / INT8_MAX, scale_dtype)
    q = torch.round(w / scales.float()[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(q, scales)


def check_group_size(group_size: int, in_features: int | None = None) -> None:
    """group_size is one of GROUP_SIZES, or per-channel (== in_features: one group over all of K)."""
    if group_size in GROUP_SIZES or (in_features is not None and group_size == in_features):
        return
    raise LabError(f"int4 group_size must be one of {GROUP_SIZES} (a kernel's K tile must divide a group) or "
                   f"per-channel (the input size{'' if in_features is None else f' {in_features}'}), got {group_size}")


SYMMETRIC_ZERO = 8                  # GPTQ's symmetric zero point: q − 8 in [−8, 7]
SYMMETRIC_LEVELS = 7                # max|W_g| maps to ±7: both signs fit without clamping


def quantize_int4(weight: torch.Tensor, group_size: int = 128, scale_dtype: torch.dtype | None = None,
                  symmetric: bool = False) -> Int4Weight:
    """Round-to-nearest per (output row, group of `group_size` inputs; group_size == K is
    per-channel). Asymmetric (default, AWQ-style): the range [min(W_g, 0), max(W_g, 0)] mapped onto
    0..15, scale = range / 15 (rounded up to scale_dtype), zero = round(−min / scale),
    q = clamp(round(W / scale) + zero, 0, 15). Symmetric (GPTQ's sym=True): zero = 8 for every group,
    scale = max|W_g| / 7 (not GPTQ's 2·max/15, which clamps +max by half a step), q = round(W / scale)
    + 8 in [1, 15]. K need not be a multiple of group_size (the last group is partial)."""
    if weight.dim() != 2:
        raise LabError(f"quantize_int4 takes a 2-D [N, K] weight, got shape {tuple(weight.shape)}")
    n_rows, k_in = weight.shape
    check_group_size(group_size, k_in)
    scale_dtype = default_scale_dtype(weight, scale_dtype)
    groups = -(-k_in // group_size)
    pad = groups * group_size - k_in
    w = weight.float()
    w_min = F.pad(w, (0, pad), value=float("inf")).view(n_rows, groups, group_size).amin(-1).clamp(max=0.0)
    w_max = F.pad(w, (0, pad), value=float("-inf")).view(n_rows, groups, group_size).amax(-1).clamp(min=0.0)
    if symmetric:
        amax = torch.maximum(-w_min, w_max)
        scales = round_up_to((amax / SYMMETRIC_LEVELS).clamp(min=1e-8), scale_dtype)      # [N, G]
        s = scales.float()
        zeros = torch.full_like(s, SYMMETRIC_ZERO)
    else:
        scales = round_up_to(((w_max - w_min) / INT4_MAX).clamp(min=1e-8), scale_dtype)      # [N, G]
        s = scales.float()
        zeros = torch.round(-w_min / s).clamp(0, INT4_MAX)
    group_of_k = torch.arange(k_in, device=w.device) // group_size
    q = (torch.round(w / s[:, group_of_k]) + zeros[:, group_of_k]).clamp(0, INT4_MAX)
    return Int4Weight(pack_int4(q.to(torch.uint8)), scales.t().contiguous(), zeros.to(torch.uint8).t().contiguous(),
                      k_in, group_size)


def quantize(weight: torch.Tensor, bits: int, group_size: int = 128, scale_dtype=None,
             symmetric: bool = False) -> Int8Weight | Int4Weight:
    if bits == 8:
        return quantize_int8(weight, scale_dtype)
    if bits == 4:
        return quantize_int4(weight, group_size, scale_dtype, symmetric)
    raise LabError(f"weight-only quantization supports bits=4 or bits=8, got {bits}")


# ------------------------------------------------------------------------------ the library's formats
def library_unavailable(qw: Int8Weight | Int4Weight, x: torch.Tensor) -> str | None:
    """Why torch's tinygemm op cannot multiply x by this weight here, or None if it can."""
    name = "_weight_int8pack_mm" if isinstance(qw, Int8Weight) else "_weight_int4pack_mm"
    if not hasattr(torch.ops.aten, name if x.is_cuda else name.replace("int4pack_mm", "int4pack_mm_for_cpu")):
        return f"this torch ({torch.__version__}) has no torch.{name}"
    if x.device.type not in ("cuda", "cpu"):
        return f"torch.{name} runs on CUDA or CPU, not {x.device.type}"
    if isinstance(qw, Int4Weight):
        if x.dtype != torch.bfloat16:
            return f"torch.{name} takes bf16 activations, got {x.dtype}"
        if qw.group_size not in LIBRARY_INT4_GROUP_SIZES:
            return f"torch.{name} takes group sizes {LIBRARY_INT4_GROUP_SIZES}, got {qw.group_size}"
        if qw.in_features % (16 * LIBRARY_INNER_K_TILES) or qw.in_features % qw.group_size:
            return (f"torch.{name} needs K a multiple of {16 * LIBRARY_INNER_K_TILES} and of the group size, "
                    f"got K={qw.in_features}")
        n_multiple = 8 if x.is_cuda else 16
        if qw.out_features % n_multiple:
            return f"torch.{name} needs N a multiple of {n_multiple} on {x.device.type}, got N={qw.out_features}"
    return None


def library_int4_operands(qw: Int4Weight, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, scale_and_zeros) in tinygemm's formats. tinygemm dequantizes as
    (q − 8) · scale + zero_f, so our integer zero z becomes the float zero_f = (8 − z) · scale;
    scale_and_zeros is bf16 [G, N, 2]. CUDA takes uint8 [N, K/2] with the even k in the high
    nibble; the CPU twin takes the int32 values [N, K]."""
    q = unpack_int4(qw.qweight, qw.in_features).to(device)
    scales = qw.scales.float().to(device)
    zero_f = (8.0 - qw.zeros.float().to(device)) * scales
    scale_and_zeros = torch.stack([scales, zero_f], dim=-1).to(torch.bfloat16).contiguous()
    if device.type == "cuda":
        q8 = q.to(torch.uint8)
        packed = torch._convert_weight_to_int4pack((q8[:, ::2] << 4 | q8[:, 1::2]).contiguous(), LIBRARY_INNER_K_TILES)
    else:
        packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), LIBRARY_INNER_K_TILES)
    return packed, scale_and_zeros


# ------------------------------------------------------------------------------ the module
class QuantizedLinear(nn.Module):
    """Drop-in for nn.Linear (weight-only quantized): y = x @ W^T (+ bias), W quantized once.
    `path` picks how forward multiplies (module docstring); it can be changed at any time, the
    quantized weight stays the same. Errors: a path that cannot run here raises LabError.

    `input_scale` (optional, [K]): a per-input-channel factor applied to x before the matmul,
    y = (x · input_scale) @ W^T. AWQ (awq.py) quantizes W·diag(s) and passes input_scale = 1/s,
    so y = Q(W·diag(s)) (x / s) ≈ x W^T; kept here rather than folded into the LayerNorm before."""

    def __init__(self, qweight: Int8Weight | Int4Weight, bias: torch.Tensor | None = None, path: str = "fused",
                 input_scale: torch.Tensor | None = None):
        super().__init__()
        if path not in PATHS:
            raise LabError(f"unknown QuantizedLinear path {path!r}; choose one of {PATHS}")
        if input_scale is not None and tuple(input_scale.shape) != (qweight.in_features,):
            raise LabError(f"QuantizedLinear input_scale must have shape [{qweight.in_features}] (one per input "
                           f"channel), got {tuple(input_scale.shape)}")
        self.weight_format = qweight
        self.input_scale = None if input_scale is None else input_scale.detach()
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.path = path
        self.bits = 8 if isinstance(qweight, Int8Weight) else 4
        self._library_cache: dict = {}

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int = 128, path: str = "fused",
                    scale_dtype=None) -> "QuantizedLinear":
        return cls(quantize(linear.weight.detach(), bits, group_size, scale_dtype), linear.bias, path)

    @property
    def in_features(self) -> int:
        return self.weight_format.in_features

    @property
    def out_features(self) -> int:
        return self.weight_format.out_features

    def _apply(self, fn, recurse=True):
        """.to() / .cuda(): move the quantized tensors too (they are not registered buffers: the
        dataclass keeps them together)."""
        super()._apply(fn, recurse)
        qw = self.weight_format
        for name, tensor in list(vars(qw).items()):
            if isinstance(tensor, torch.Tensor):
                setattr(qw, name, fn(tensor).to(tensor.dtype))   # device follows; stored dtypes stay
        if self.input_scale is not None:
            self.input_scale = fn(self.input_scale).to(self.input_scale.dtype)
        self._library_cache.clear()
        return self

    def extra_repr(self) -> str:
        group = f", group_size={self.weight_format.group_size}" if self.bits == 4 else ""
        scale = "" if self.input_scale is None else f", input_scale=[{self.input_scale.numel()}]"
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}{group}, " \
               f"path={self.path}{scale}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.input_scale is not None:                 # x · diag(input_scale), rounded once to x's dtype
            x2 = (x2 * self.input_scale).to(x2.dtype)
        if self.path == "naive":
            y = F.linear(x2, self.weight_format.dequantize(x.dtype))
        elif self.path == "fused":
            y = self._fused(x2)
        elif self.path == "cuda":
            y = self._cuda(x2)
        else:
            y = self._library(x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def _fused(self, x2: torch.Tensor) -> torch.Tensor:
        from . import quant_gemm
        if isinstance(self.weight_format, Int8Weight):
            return quant_gemm.w8a16_matmul(x2, self.weight_format.qweight, self.weight_format.scales)
        qw = self.weight_format
        return quant_gemm.w4a16_matmul(x2, qw.qweight, qw.scales, qw.zeros, qw.group_size)

    def _cuda(self, x2: torch.Tensor) -> torch.Tensor:
        from . import int4_mma
        if not isinstance(self.weight_format, Int4Weight):
            raise LabError("QuantizedLinear path 'cuda': the CUDA kernel takes int4 weights only (int8: 'fused')")
        return int4_mma.multiply(x2, self._mma(x2))

    def fuses_input(self, x: torch.Tensor) -> bool:
        """Whether the kernel before this projection (RMSNorm, SiLU * up) can run inside it for x:
        the CUDA path, int4, no activation scale, one bf16 row on a GPU whose K slice fits (int4_mma)."""
        from . import int4_mma
        if self.path != "cuda" or not isinstance(self.weight_format, Int4Weight) or self.input_scale is not None:
            return False
        if x.dim() != 2 or x.shape[0] != 1 or x.dtype != torch.bfloat16 or not x.is_cuda:
            return False
        return int4_mma.prologue_fits(1, self._mma(x), int4_mma.sm_count(x.device))

    def add_rms_norm_forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(RMSNorm(x + residual)), x + residual) in one kernel (fuses_input(x) must hold)."""
        from . import int4_mma
        y, new_residual = int4_mma.add_rms_norm_matmul(x, residual, norm_weight, eps, self._mma(x))
        return (y if self.bias is None else y + self.bias.to(y.dtype)), new_residual

    def silu_mul_forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(SiLU(gate) * up) in one kernel (fuses_input of one row must hold)."""
        from . import int4_mma
        y = int4_mma.silu_mul_matmul(gate_up, self._mma(gate_up))
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _mma(self, x2: torch.Tensor):
        """The weight re-laid for the CUDA kernel on x2's device (once)."""
        from . import int4_mma
        key = ("mma", x2.device)
        if key not in self._library_cache:
            why = int4_mma.unavailable(self.weight_format, x2)
            if why:
                raise LabError(f"QuantizedLinear path 'cuda': {why}")
            self._library_cache[key] = int4_mma.relayout(self.weight_format)
        return self._library_cache[key]

    def _library(self, x2: torch.Tensor) -> torch.Tensor:
        why = library_unavailable(self.weight_format, x2)
        if why:
            raise LabError(f"QuantizedLinear path 'library': {why}")
        qw = self.weight_format
        if isinstance(qw, Int8Weight):
            return torch._weight_int8pack_mm(x2.contiguous(), qw.qweight, qw.scales.to(x2.dtype))
        key = x2.device
        if key not in self._library_cache:
            self._library_cache[key] = library_int4_operands(qw, x2.device)
        packed, scale_and_zeros = self._library_cache[key]
        op = torch._weight_int4pack_mm if x2.is_cuda else torch._weight_int4pack_mm_for_cpu
        return op(x2.contiguous(), packed, qw.group_size, scale_and_zeros)
