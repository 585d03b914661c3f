"""Where a model's weights come from: a local Hugging Face checkpoint folder (config.json and
*.safetensors, read with `safetensors`), or seeded random weights of a named shape (vLLM's
`--load-format dummy`: the same bytes to move, no download).

Both give a dict keyed by Hugging Face's LlamaForCausalLM names, so the same dict loads into the
lab's engine, its plain-PyTorch baseline and transformers' model (the correctness reference).
"""
from pathlib import Path

import torch

from common.errors import LabError

# The folder's own helpers live in checkpoint_files.py (int4_checkpoints.py imports them there too).
from .checkpoint_files import check_tensor_names, drop_tied_head, read_safetensors, resolve, tensor_shapes
from .shapes import LlamaShape, from_checkpoint

INIT_STD = 0.02          # Hugging Face's initializer_range for Llama


def random_weights(shape: LlamaShape, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                   device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Seeded normal(0, 0.02) matrices and unit norm weights, made directly on `device` (an 8B
    model's 16 GB never passes through host memory). The same seed gives the same weights on the
    same kind of device."""
    return dict(iter_random_weights(shape, seed, dtype, device))


def iter_random_weights(shape: LlamaShape, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                        device: str | torch.device = "cpu"):
    """random_weights' tensors one at a time, (name, tensor), the same values in the same order: a
    tensor-parallel rank keeps its shard of each and lets the rest go before the next is made."""
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, size in tensor_shapes(shape).items():
        if name.endswith("norm.weight"):
            yield name, torch.ones(size, dtype=dtype, device=device)
        else:
            t = torch.empty(size, dtype=dtype, device=device)
            yield name, t.normal_(0.0, INIT_STD, generator=generator)


def load_checkpoint(folder: Path, dtype: torch.dtype = torch.bfloat16,
                    device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A Hugging Face Llama checkpoint's tensors, checked against its config's names and shapes.
    An int4 checkpoint (config.json's quantization_config) comes back with each projection's
    weight as a weight_formats.Int4Weight (int4_checkpoints.py). With tied embeddings a saved
    lm_head.weight equal to the embedding is dropped (drop_tied_head)."""
    from .shapes import read_config

    folder = Path(folder)
    shape = from_checkpoint(folder)
    config = read_config(folder)
    if config.get("quantization_config") is not None:
        from .int4_checkpoints import load_int4_checkpoint
        return load_int4_checkpoint(folder, shape, config["quantization_config"], dtype, device)
    expected = tensor_shapes(shape)
    out = {name: t.to(dtype) for name, t in read_safetensors(folder, device)}     # one tensor at a time
    drop_tied_head(folder, out, shape)
    check_tensor_names(folder, out, expected)
    for name, size in expected.items():
        if tuple(out[name].shape) != size:
            raise LabError(f"{folder}: {name} has shape {tuple(out[name].shape)}, config says {size}")
    return {name: out[name] for name in expected}                 # derived buffers (inv_freq) left out


def expandable_segments(device) -> None:
    """Have the CUDA caching allocator grow segments instead of carving fixed ones. The engine
    fuses q/k/v and gate/up after loading, freeing the parts as it goes: with fixed segments the
    freed parts stay reserved in fragments, and a 70B shape on one 141 GB GPU (131 GiB of weights)
    runs out of memory fusing its last layers with 7 GiB reserved but unused."""
    if torch.device(device).type == "cuda":
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def weights_for(model: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                device: str | torch.device = "cpu") -> tuple[LlamaShape, dict[str, torch.Tensor]]:
    expandable_segments(device)
    shape, path = resolve(model)
    if path is not None:
        return shape, load_checkpoint(path, dtype, device)
    return shape, random_weights(shape, seed, dtype, device)


def iter_weights_for(model: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                     device: str | torch.device = "cpu"):
    """(shape, an iterator of (name, full tensor)): random weights made on `device` one tensor at a
    time; a checkpoint read into host memory (each rank then moves only its shards to its GPU)."""
    expandable_segments(device)
    shape, path = resolve(model)
    if path is not None:
        weights = load_checkpoint(path, dtype, "cpu")
        if any(not isinstance(t, torch.Tensor) for t in weights.values()):
            raise LabError(f"{path}: an int4 checkpoint is served on one GPU (tensor parallelism splits 16-bit "
                           "weights only)")
        return shape, iter(weights.items())
    return shape, iter_random_weights(shape, seed, dtype, device)
