"""What each rank holds when a Llama is split over N ranks (tensor_parallel.py tells the scheme):
whether a shape splits, a rank's local shape, its shard shapes and bytes (pure shape arithmetic,
which the exercise's predictions use too), and the shards themselves cut from full tensors.
"""
from dataclasses import replace

import torch

from .shapes import LlamaShape
from .weights import tensor_shapes

def unsplittable(shape: LlamaShape, tp: int) -> str | None:
    """Why `shape` cannot be split over `tp` ranks, in one line, or None."""
    h, kv, i = shape.num_attention_heads, shape.num_key_value_heads, shape.intermediate_size
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        return f"tensor parallel size must be a positive integer, got {tp!r}"
    if h % tp:
        return f"{shape.name}: {h} attention heads do not split evenly over {tp} ranks"
    if kv % tp and tp % kv:
        return f"{shape.name}: {kv} KV heads do not split over {tp} ranks (evenly, or as whole copies)"
    if i % tp:
        return f"{shape.name}: an intermediate size of {i} does not split evenly over {tp} ranks"
    return None


def local_shape(shape: LlamaShape, tp: int) -> LlamaShape:
    """The shape one rank computes: its heads, KV heads and intermediate slice (hidden size and
    vocabulary whole: the logits are gathered)."""
    if tp == 1:
        return shape
    return replace(shape, num_attention_heads=shape.num_attention_heads // tp,
                   num_key_value_heads=max(1, shape.num_key_value_heads // tp),
                   intermediate_size=shape.intermediate_size // tp)


def kv_heads_held(shape: LlamaShape, tp: int, rank: int) -> tuple[int, int]:
    """(first KV head, how many) rank `rank` holds."""
    kv = shape.num_key_value_heads
    if kv >= tp:
        return rank * (kv // tp), kv // tp
    return rank * kv // tp, 1


def vocab_rows(shape: LlamaShape, tp: int) -> int:
    """LM-head rows per rank: the vocabulary over tp, rounded up (the last rank's tail is zeros)."""
    return -(-shape.vocab_size // tp)


def shard_shapes(shape: LlamaShape, tp: int) -> dict[str, tuple[int, ...]]:
    """Every tensor one rank holds, by its Hugging Face name (the LM head always, tied or not)."""
    out = tensor_shapes(local_shape(shape, tp))
    out["lm_head.weight"] = (vocab_rows(shape, tp), shape.hidden_size)
    return out


def rank_weight_bytes(shape: LlamaShape, tp: int, bytes_per_param: float = 2) -> float:
    """Bytes of weights one rank holds (tp == 1: the model, as held by the engine)."""
    if tp == 1:
        return shape.weight_bytes(bytes_per_param)
    count = 0
    for size in shard_shapes(shape, tp).values():
        n = 1
        for d in size:
            n *= d
        count += n
    return count * bytes_per_param


def rank_decode_weight_bytes(shape: LlamaShape, tp: int, bytes_per_param: float = 2) -> float:
    """Bytes of weights one rank reads per decode step: all it holds but the embedding table (one
    row per sequence); with tied embeddings the tp == 1 engine reads the table whole as the head."""
    if tp == 1:
        return shape.decode_weight_bytes(bytes_per_param)
    return rank_weight_bytes(shape, tp, bytes_per_param) - shape.embedding_params() * bytes_per_param


def rank_kv_bytes_per_token(shape: LlamaShape, tp: int, bytes_per_element: float = 2) -> float:
    return shape.kv_bytes_per_token(bytes_per_element) * kv_heads_held(shape, tp, 0)[1] / shape.num_key_value_heads


def _piece(name: str, t: torch.Tensor, shape: LlamaShape, rank: int, tp: int) -> torch.Tensor | None:
    """Rank `rank`'s part of tensor `name` as a view, or None where the rank holds it whole."""
    d = shape.head_dim
    heads = shape.num_attention_heads // tp
    inter = shape.intermediate_size // tp
    if name.endswith("self_attn.q_proj.weight"):
        return t[rank * heads * d:(rank + 1) * heads * d]
    if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
        first, count = kv_heads_held(shape, tp, rank)
        return t[first * d:(first + count) * d]
    if name.endswith("self_attn.o_proj.weight"):
        return t[:, rank * heads * d:(rank + 1) * heads * d]
    if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
        return t[rank * inter:(rank + 1) * inter]
    if name.endswith("mlp.down_proj.weight"):
        return t[:, rank * inter:(rank + 1) * inter]
    return None


def _vocab_slice(t: torch.Tensor, shape: LlamaShape, rank: int, tp: int, dtype, device) -> torch.Tensor:
    rows = vocab_rows(shape, tp)
    lo, hi = min(rank * rows, shape.vocab_size), min((rank + 1) * rows, shape.vocab_size)
    out = torch.zeros(rows, t.shape[1], dtype=dtype, device=device)
    out[:hi - lo] = t[lo:hi]
    return out


def shard(items, shape: LlamaShape, rank: int, tp: int, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors from (name, full tensor) pairs, each cut, copied to `device` and let go
    before the next (an iterator of random weights never holds the whole model)."""
    out = {}
    for name, t in items:
        if name == "lm_head.weight" or (name == "model.embed_tokens.weight" and shape.tie_word_embeddings):
            out["lm_head.weight"] = _vocab_slice(t, shape, rank, tp, dtype, device)
        if name == "lm_head.weight":
            continue
        piece = _piece(name, t, shape, rank, tp)
        if piece is None:
            out[name] = t.to(device=device, dtype=dtype)
        else:
            out[name] = piece.to(device=device, dtype=dtype, copy=True).contiguous()
        del t, piece
    return out
