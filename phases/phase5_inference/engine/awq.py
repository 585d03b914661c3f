"""AWQ's activation-aware scale search (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization
for LLM Compression and Acceleration"), written from the paper's idea for one linear layer.

A few input channels carry much larger activations than the rest; the weights that multiply them
matter most, and group-wise int4 rounds them as coarsely as any other. AWQ scales those weight
columns up before quantizing (their relative rounding error shrinks) and the activations down by
the same factor, which leaves the product unchanged in exact arithmetic:

    x W^T = (x / s) (W · diag(s))^T       quantized:  y ≈ (x / s) Q(W · diag(s))^T

The scale comes from the calibration activations X [T, K] alone, one number per input channel:

    s = mean_t |X[t, k]| ^ alpha, normalized by sqrt(max(s) · min(s)) (so the scales straddle 1)

and alpha is searched on a grid of points in [0, 1] (20 by default, both ends included) for the
smallest output error on the calibration tokens,

    loss(alpha) = || X W^T − (X / s) Q(W · diag(s))^T ||²      (squared Frobenius norm, fp32)

alpha = 0 gives s = 1 exactly, i.e. plain round-to-nearest (RTN), so the search can never do worse
than RTN on its own calibration set (it can on other data). Q is quantize.quantize_int4 with the
same group size and scale dtype as RTN would use, so the two differ only in s.

Where the scale goes: the paper folds 1/s into the operation before the layer (the LayerNorm's
gain, or the previous linear's output rows), so it costs nothing at run time. Here the drop-in
QuantizedLinear keeps it instead (`input_scale` = 1/s, one multiply of x per call): nothing
outside the linear layer is touched, and it works for inputs that no LayerNorm feeds (the
attention output into c_proj, the GELU output into the MLP's c_proj). Not done here: the paper's
second step, a search over weight clipping ranges, and its block-wise search (it measures the
error at the output of the whole attention or MLP block; this measures it per linear layer).
"""
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from common.errors import LabError

from .quantize import QuantizedLinear, default_scale_dtype, quantize_int4

GRID_POINTS = 20
MIN_MAGNITUDE = 1e-4           # a channel that is always ~0 keeps a usable (tiny) scale, never 0


def alpha_grid(points: int = GRID_POINTS) -> list[float]:
    """`points` evenly spaced alphas from 0 to 1, both included (0 first: plain RTN)."""
    if points < 2:
        raise LabError(f"AWQ's alpha grid needs at least 2 points (0 and 1), got {points}")
    return [i / (points - 1) for i in range(points)]


def channel_magnitude(x: torch.Tensor) -> torch.Tensor:
    """mean |x| per input channel: x [..., K] -> fp32 [K]."""
    return x.reshape(-1, x.shape[-1]).float().abs().mean(dim=0)


def awq_scales(magnitude: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = magnitude^alpha, normalized by sqrt(max(s) · min(s)); exactly 1 everywhere at alpha = 0."""
    s = magnitude.float().clamp(min=MIN_MAGNITUDE).pow(alpha).clamp(min=MIN_MAGNITUDE)
    return s / (s.max() * s.min()).sqrt()


def effective_weight(weight: torch.Tensor, s: torch.Tensor, group_size: int,
                     scale_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Q(W · diag(s)) / s in fp32: the weight the scaled, quantized layer multiplies x by."""
    scale_dtype = default_scale_dtype(weight, scale_dtype)
    q = quantize_int4(weight.float() * s[None, :], group_size, scale_dtype)
    return q.dequantize(torch.float32) / s[None, :]


def output_error(weight: torch.Tensor, x: torch.Tensor, s: torch.Tensor, group_size: int,
                 scale_dtype: torch.dtype | None = None) -> float:
    """|| X W^T − (X / s) Q(W · diag(s))^T ||² = || X (W − Q(W s) / s)^T ||², in fp32."""
    delta = weight.float() - effective_weight(weight, s, group_size, scale_dtype)
    return float((x.reshape(-1, x.shape[-1]).float() @ delta.t()).double().pow(2).sum())


@dataclass
class ScaleSearch:
    """What the search found for one layer (every loss a squared Frobenius norm over the
    calibration tokens, in fp32; `reference_energy` = ||X W^T||², to make them relative)."""
    alpha: float
    scale: torch.Tensor                  # s, fp32 [K]: the weight's columns were multiplied by it
    loss: float                          # at the chosen alpha
    rtn_loss: float                      # at alpha = 0 (s = 1): round-to-nearest
    reference_energy: float
    alphas: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    tokens: int = 0

    def as_dict(self) -> dict:
        """JSON-safe (no tensor): what a record keeps of the search."""
        energy = self.reference_energy or float("nan")
        return {"alpha": self.alpha, "loss": self.loss, "rtn_loss": self.rtn_loss,
                "loss_over_rtn": self.loss / self.rtn_loss if self.rtn_loss else None,
                "relative_loss": self.loss / energy, "relative_rtn_loss": self.rtn_loss / energy,
                "calibration_tokens": self.tokens, "alphas": self.alphas, "losses": self.losses}


@torch.no_grad()
def search_scale(weight: torch.Tensor, x: torch.Tensor, group_size: int = 128, alphas=None,
                 scale_dtype: torch.dtype | None = None) -> ScaleSearch:
    """Grid search of alpha for W [N, K] on calibration inputs x [..., K] (module docstring).
    `alphas` defaults to alpha_grid(); alpha = 0 is always evaluated, so rtn_loss is RTN's loss
    and the chosen loss is never above it (ties keep the smaller alpha)."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise LabError(f"AWQ: inputs [..., {x.shape[-1]}] do not fit a weight [N, K] of shape {tuple(weight.shape)}")
    x2 = x.reshape(-1, x.shape[-1]).float()
    if x2.shape[0] == 0:
        raise LabError("AWQ: no calibration tokens")
    grid = sorted(set([0.0] + [float(a) for a in (alpha_grid() if alphas is None else alphas)]))
    if grid[0] < 0 or grid[-1] > 1:
        raise LabError(f"AWQ: alphas must lie in [0, 1], got {grid}")
    magnitude = channel_magnitude(x2)
    losses = [output_error(weight, x2, awq_scales(magnitude, a), group_size, scale_dtype) for a in grid]
    best = min(range(len(grid)), key=lambda i: (losses[i], i))
    energy = float((x2 @ weight.float().t()).double().pow(2).sum())
    return ScaleSearch(alpha=grid[best], scale=awq_scales(magnitude, grid[best]), loss=losses[best],
                       rtn_loss=losses[0], reference_energy=energy, alphas=grid, losses=losses,
                       tokens=x2.shape[0])


def awq_linear(linear: nn.Linear, x: torch.Tensor, group_size: int = 128, path: str = "naive", alphas=None,
               scale_dtype: torch.dtype | None = None) -> tuple[QuantizedLinear, ScaleSearch]:
    """An int4 QuantizedLinear of `linear` with AWQ's scale: weight Q(W · diag(s)) and input_scale
    1/s (so it multiplies (x / s) by it), and the search's record. With alphas=[0] it is RTN
    exactly: s = 1, the same quantized weight as QuantizedLinear.from_linear(linear, 4, ...)."""
    w = linear.weight.detach()
    found = search_scale(w, x, group_size, alphas, scale_dtype)
    scale_dtype = default_scale_dtype(w, scale_dtype)
    s = found.scale.to(w.device)
    qw = quantize_int4(w.float() * s[None, :], group_size, scale_dtype)
    module = QuantizedLinear(qw, linear.bias, path, input_scale=1.0 / s)
    return module, found
