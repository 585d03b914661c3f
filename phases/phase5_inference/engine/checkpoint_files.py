"""A Hugging Face Llama checkpoint folder as the engine reads it: the names and sizes of its
tensors, its *.safetensors files, the tied LM head, and which folder (or named shape) a model
name means. Shared by weights.py (16-bit checkpoints) and int4_checkpoints.py (int4 ones).
"""
from pathlib import Path

import torch

from common.errors import LabError

from .shapes import LlamaShape, from_checkpoint, named


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


def resolve(model: str) -> tuple[LlamaShape, Path | None]:
    """`model` is a named shape (random weights) or a checkpoint folder."""
    path = Path(model).expanduser()
    if path.is_dir():
        return from_checkpoint(path), path
    if "/" in model or model.startswith("."):
        raise LabError(f"{model}: no such checkpoint folder")
    return named(model), None
