"""Where a model's weights come from: a local Hugging Face checkpoint folder (config.json and
*.safetensors, read with `safetensors`), or seeded random weights of a named shape (vLLM's
`--load-format dummy`: the same bytes to move, no download).

Both give a dict keyed by Hugging Face's LlamaForCausalLM names, so the same dict loads into the
lab's engine, its plain-PyTorch baseline and transformers' model (the correctness reference).
"""
from pathlib import Path

import torch

from common.errors import LabError

from .shapes import LlamaShape, from_checkpoint, named

INIT_STD = 0.02          # Hugging Face's initializer_range for Llama


def tensor_shapes(shape: LlamaShape) -> dict[str, tuple[int, ...]]:
    """Every weight's name and size, as a Hugging Face Llama checkpoint holds them."""
    h, i, q, kv = shape.hidden_size, shape.intermediate_size, shape.q_size, shape.kv_size
    out = {"model.embed_tokens.weight": (shape.vocab_size, h)}
    for layer in range(shape.num_hidden_layers):
        p = f"model.layers.{layer}."
        out.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
    out["model.norm.weight"] = (h,)
    if not shape.tie_word_embeddings:
        out["lm_head.weight"] = (shape.vocab_size, h)
    return out


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


# Tensors a checkpoint may hold that the engine derives itself: RoPE's inverse frequencies (older
# transformers saved the buffer; the engine computes it from config.json).
DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_safetensors(folder: Path, device: str | torch.device = "cpu"):
    """(name, tensor) of every *.safetensors file in the folder, in file order; a file that is not
    a readable safetensors file (corrupt header, truncated data) is one line naming it."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise LabError(f"{folder}: no *.safetensors files")
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except LabError:
            raise
        except Exception as exc:                 # safetensors raises its own error types and OSError
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise LabError(f"{path}: not a readable safetensors file ({detail})") from None


def check_tensor_names(folder: Path, names, expected) -> None:
    """Every expected tensor present, nothing the engine would ignore (a bias, an unknown tensor)."""
    names = set(names)
    extra = sorted(n for n in names - set(expected) if not n.endswith(DERIVED_SUFFIXES))
    if extra:
        raise LabError(f"{folder}: checkpoint holds {len(extra)} tensor(s) the engine does not use, e.g. {extra[0]}: "
                       "refused (it would be ignored)")
    missing = sorted(set(expected) - names)
    if missing:
        raise LabError(f"{folder}: checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")


def drop_tied_head(folder: Path, tensors: dict, shape: LlamaShape) -> None:
    """A tied checkpoint (tie_word_embeddings) may also save lm_head.weight: dropped when it equals
    the embedding; a different one is refused (transformers 5 then unties them, older releases
    tie them: the config and the tensors disagree, and the engine does not pick one silently)."""
    head = tensors.get("lm_head.weight")
    if not shape.tie_word_embeddings or head is None:
        return
    embed = tensors.get("model.embed_tokens.weight")
    if embed is not None and not torch.equal(head, embed):
        raise LabError(f"{folder}: config.json says tie_word_embeddings but lm_head.weight differs from "
                       "model.embed_tokens.weight: refused (fix the config or the checkpoint)")
    del tensors["lm_head.weight"]


def load_checkpoint(folder: Path, dtype: torch.dtype = torch.bfloat16,
                    device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A Hugging Face Llama checkpoint's tensors, checked against its config's names and shapes.
    An int4 checkpoint (config.json's quantization_config) comes back with each projection's
    weight as a quantize.Int4Weight (int4_checkpoints.py). With tied embeddings a saved
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


def resolve(model: str) -> tuple[LlamaShape, Path | None]:
    """`model` is a named shape (random weights) or a checkpoint folder."""
    path = Path(model).expanduser()
    if path.is_dir():
        return from_checkpoint(path), path
    if "/" in model or model.startswith("."):
        raise LabError(f"{model}: no such checkpoint folder")
    return named(model), None


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
