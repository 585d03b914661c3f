"""RoPE's inverse frequencies for a Llama shape, computed exactly as transformers computes them:
plain RoPE, "linear" scaling (every frequency divided by `factor`: position interpolation), or
Llama 3.1's "llama3" frequency scaling (wavelengths longer than the original context
divided by `factor`, short ones kept, a smooth blend between the two cut-offs). The engine and the
plain-PyTorch baseline both build their cos/sin tables from it; the tests hold it to transformers'
LlamaRotaryEmbedding."""
import math

import torch

from common.errors import LabError

from .shapes import LlamaShape


def inverse_frequencies(shape: LlamaShape) -> torch.Tensor:
    """fp32 [head_dim / 2]."""
    dim = shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = shape.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type != "llama3":
        raise LabError(f"{shape.name}: rope_scaling type {rope_type!r} is not supported (default, linear or llama3)")
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)
