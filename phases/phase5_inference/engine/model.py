"""The Llama architecture over a paged KV cache: embedding, layers of (RMSNorm, fused QKV
projection, RoPE with Llama-3 frequency scaling, grouped-query attention, RMSNorm, fused gate_up,
SiLU(gate) * up, down), a final RMSNorm and the LM head (tied to the embedding or not).

A forward pass takes a flat batch: the token ids and positions of every scheduled sequence packed
one after another, and an AttentionMetadata saying how they split. A prefill runs causal attention
within each sequence (Flash varlen attention on a GPU, SDPA per sequence elsewhere) and writes every
token's K and V into the cache through the slot mapping; a decode (one token per sequence) writes
the new token's K and V the same way, then attends over the cache with
`paged_attention.paged_decode_attention`. Matmuls are F.linear in the model's dtype (a Triton
GEMV for a single 16-bit row, with the RMSNorm before it done inside); with a QuantizationConfig the
four projections of every layer are weight-only int8 or int4 (quantize.QuantizedLinear), the
embedding and LM head staying 16-bit. Logits are computed only for the rows asked for (each
sequence's last token), in fp32.

With a TensorParallel (tp_ranks.py) the model holds one rank's shards: its heads, its slice
of the MLP and of the vocabulary; `shape` is then the rank's own (local_shape), o's and down's
partial sums are all-reduced, and the logits all-gathered.
"""
import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.errors import LabError

from . import paged_attention
from .fused_ops import (add_rms_norm, add_rms_norm_linear, add_rms_norm_logits, linear, rope_and_store,
                        silu_and_mul_linear)
from .rope import inverse_frequencies
from .shapes import LlamaShape
from .checkpoint_files import tensor_shapes


@dataclass
class AttentionMetadata:
    """How a flat batch of tokens splits into sequences, and where their K and V go."""
    is_prefill: bool
    slot_mapping: torch.Tensor                   # [tokens] int64: flat cache slot per token (-1: none)
    seq_lens: list[int] | None = None            # prefill: tokens per sequence, in packing order
    cu_seqlens: torch.Tensor | None = None       # prefill: [seqs + 1] int32 offsets (varlen attention)
    max_seq_len: int = 0                         # prefill: the longest sequence
    block_tables: torch.Tensor | None = None     # decode: [seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor | None = None     # decode: [seqs] int32, the new token included
    num_splits: int | None = None                # decode: attention splits per (seq, KV head); None: by shape
    logits_indices: torch.Tensor | None = None   # rows whose hidden state is returned; None: all
    cached_lens: list[int] | None = None         # prefill: tokens of each sequence already cached (a shared prefix)
    context_slots: torch.Tensor | None = None    # prefill with cached_lens: each sequence's whole context's cache
                                                 # slots (cached prefix, then new tokens), packed, int32
    cu_context_lens: torch.Tensor | None = None  # prefill with cached_lens: [seqs + 1] int32 offsets into context_slots
    max_context_len: int = 0                     # prefill with cached_lens: the longest context


def rope_tables(shape: LlamaShape, max_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position x frequency, fp32 [max_positions, head_dim / 2]."""
    freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inverse_frequencies(shape)[None, :]
    return freqs.cos().to(device), freqs.sin().to(device)


def varlen_attention(device: torch.device, dtype: torch.dtype, gqa: bool):
    """torch's Flash varlen attention made causal (torch 2.10 spells it is_causal=True, later
    releases window_size=(-1, 0)), or None where it cannot run (not CUDA, not 16-bit, too old)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    accepted = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in accepted else {"is_causal": True}
    if "enable_gqa" in accepted:
        causal["enable_gqa"] = gqa
    return functools.partial(varlen_attn, **causal)


class LayerWeights:
    __slots__ = ("input_norm", "qkv", "o", "post_norm", "gate_up", "down")


QUANTIZED_PROJECTIONS = ("qkv", "o", "gate_up", "down")     # the embedding and the LM head stay 16-bit


@dataclass(frozen=True)
class QuantizationConfig:
    """Weight-only quantization of every layer's four projections (quantize.py): bits 8 (per
    output row) or 4 (group-wise with zero points), multiplied by `path` (naive, fused, library).
    `prequantized`: the int4_checkpoints.Int4CheckpointFormat of a checkpoint quantized elsewhere
    (AWQ, GPTQ): its projections arrive as Int4Weight and are used as they are, not re-quantized."""
    bits: int
    path: str = "fused"
    group_size: int = 128
    prequantized: object = None

    def quantize(self, weight: torch.Tensor, dtype: torch.dtype):
        """The projection as a QuantizedLinear, its scales in the model's dtype; the library path's
        own format is made here (one call), not inside a CUDA-graph capture."""
        from .quantize import QuantizedLinear, quantize
        module = QuantizedLinear(quantize(weight, self.bits, self.group_size, scale_dtype=dtype), path=self.path)
        if self.path == "library":
            module(torch.zeros(1, weight.shape[1], dtype=dtype, device=weight.device))
        return module

    def wrap(self, weight, dtype: torch.dtype, device: torch.device):
        """A checkpoint's own Int4Weight as a QuantizedLinear on `path`, refused here (one line) if
        the path cannot take it on this device, not at the first request."""
        from common.triton_shim import interpreting

        from .quant_gemm import kernel_group_size
        from .quantize import QuantizedLinear, library_unavailable
        if self.path == "fused":
            if device.type != "cuda" and not interpreting():
                raise LabError("quant_path 'fused' runs Triton kernels: it needs a CUDA GPU (or TRITON_INTERPRET=1); "
                               "on a CPU use quant_path naive or library")
            kernel_group_size(weight.group_size, weight.in_features)
        module = QuantizedLinear(weight, path=self.path)
        if self.path == "library":
            why = library_unavailable(weight, torch.zeros(1, 1, dtype=dtype, device=device))
            if why:
                raise LabError(f"quant_path 'library' cannot serve this checkpoint: {why}")
            module(torch.zeros(1, weight.in_features, dtype=dtype, device=device))
        return module

    def label(self) -> str:
        if self.prequantized is not None:
            return f"{self.prequantized.label()} {self.path}"
        group = f" g{self.group_size}" if self.bits == 4 else ""
        return f"int{self.bits}{group} {self.path}"


def concat_int4(parts: list) -> "Int4Weight":
    """Int4Weights of one input size and group size stacked along N (q/k/v into qkv, gate/up into
    gate_up): packed words, scales and zero points concatenate along their output axis."""
    from .quantize import Int4Weight
    first = parts[0]
    if any((p.in_features, p.group_size) != (first.in_features, first.group_size) for p in parts):
        raise LabError("int4 projections fused into one must share K and the group size, got "
                       f"{[(p.in_features, p.group_size) for p in parts]}")
    return Int4Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts], dim=1),
                      torch.cat([p.zeros for p in parts], dim=1), first.in_features, first.group_size)


class LlamaModel:
    """Weights as plain tensors (fused QKV and gate_up) and a forward over the paged cache.
    `kv_caches` (per-layer (k_cache, v_cache)) and the RoPE tables are set by the runner."""

    def __init__(self, shape: LlamaShape, dtype: torch.dtype, device: torch.device,
                 decode_backend: str = "auto", quantization: "QuantizationConfig | None" = None, tp=None):
        """tp: a tensor_parallel.TensorParallel (weights given to load() are then this rank's shards)."""
        self.tp = tp
        self.full_shape = shape
        self.shape = shape = shape if tp is None else tp.local_shape(shape)
        self.quantization = quantization
        self.dtype = dtype
        self.device = torch.device(device)
        self.decode_backend = decode_backend
        self.scale = shape.head_dim ** -0.5
        self.gqa = shape.num_attention_heads != shape.num_key_value_heads
        self.prefill_varlen = varlen_attention(self.device, dtype, self.gqa)
        self.layers: list[LayerWeights] = []
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.rope_cos = self.rope_sin = None

    # -------------------------------------------------------------------------- weights
    def load(self, weights: dict[str, torch.Tensor], consume: bool = False) -> None:
        """Take Hugging Face-named weights (checked against the shape), fusing q/k/v and gate/up.
        consume=True pops each tensor once used, so the unfused copy is freed layer by layer."""
        from .quantize import Int4Weight
        expected = tensor_shapes(self.shape) if self.tp is None else self.tp.shard_shapes(self.full_shape)
        for name, size in expected.items():
            if name not in weights:
                raise LabError(f"{self.shape.name}: weights lack {name}")
            w = weights[name]
            got = (w.out_features, w.in_features) if isinstance(w, Int4Weight) else tuple(w.shape)
            if got != size:
                raise LabError(f"{self.shape.name}: {name} has shape {got}, expected {size}")
        prequantized = isinstance(weights["model.layers.0.self_attn.q_proj.weight"], Int4Weight)
        if prequantized and (self.quantization is None or self.quantization.prequantized is None):
            raise LabError(f"{self.shape.name}: int4 weights from a checkpoint need its QuantizationConfig "
                           "(int4_checkpoints.checkpoint_quantization)")
        if not prequantized and self.quantization is not None and self.quantization.prequantized is not None:
            raise LabError(f"{self.shape.name}: the QuantizationConfig is a checkpoint's int4 format, but the weights "
                           "are 16-bit")
        take = weights.pop if consume else weights.__getitem__

        def tensor(name):
            if prequantized and isinstance(weights[name], Int4Weight):
                return take(name).to(self.device)
            return take(name).to(device=self.device, dtype=self.dtype)

        def fused(names):
            parts = [tensor(n) for n in names]
            if prequantized:
                return self.quantization.wrap(concat_int4(parts) if len(parts) > 1 else parts[0], self.dtype,
                                              self.device)
            return torch.cat(parts) if len(parts) > 1 else parts[0]

        self.embed = tensor("model.embed_tokens.weight")
        self.layers = []
        for index in range(self.shape.num_hidden_layers):
            p = f"model.layers.{index}."
            layer = LayerWeights()
            layer.input_norm = tensor(p + "input_layernorm.weight")
            layer.qkv = fused([p + f"self_attn.{n}_proj.weight" for n in "qkv"])
            layer.o = fused([p + "self_attn.o_proj.weight"])
            layer.post_norm = tensor(p + "post_attention_layernorm.weight")
            layer.gate_up = fused([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
            layer.down = fused([p + "mlp.down_proj.weight"])
            if self.quantization is not None and not prequantized:
                for name in QUANTIZED_PROJECTIONS:
                    setattr(layer, name, self.quantization.quantize(getattr(layer, name), self.dtype))
            self.layers.append(layer)
        self.norm = tensor("model.norm.weight")
        tied = self.shape.tie_word_embeddings and self.tp is None
        self.lm_head = self.embed if tied else tensor("lm_head.weight")

    def weight_bytes(self) -> int:
        """Bytes the weights occupy: tensors as allocated, quantized projections as packed (their
        weight, scales and zero points)."""
        tensors = [self.embed, self.norm] + [getattr(layer, n) for layer in self.layers for n in LayerWeights.__slots__]
        if self.lm_head is not self.embed:
            tensors.append(self.lm_head)
        return sum(t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.weight_format.nbytes()
                   for t in tensors)

    def set_rope(self, shape: LlamaShape, max_positions: int) -> None:
        self.rope_cos, self.rope_sin = rope_tables(shape, max_positions, self.device)

    # -------------------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The final-normed hidden states of rows meta.logits_indices (all rows when None)."""
        hidden, residual = self._last_layer_outputs(input_ids, positions, meta)
        return add_rms_norm(hidden, residual, self.norm, self.shape.rms_norm_eps)

    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       out: torch.Tensor | None = None, argmax_out: torch.Tensor | None = None) -> torch.Tensor:
        """compute_logits(forward(...)), into `out` when given, and their argmax into argmax_out
        when given; for one row on a GPU the final norm, the LM head and the argmax's first half are
        one kernel."""
        hidden, residual = self._last_layer_outputs(input_ids, positions, meta)
        if self.tp is not None:                     # this rank's slice of the vocabulary, then all of it
            local = add_rms_norm_logits(hidden, residual, self.norm, self.shape.rms_norm_eps, self.lm_head)
            return self.tp.gather_logits(local, self.shape.vocab_size, out=out, argmax_out=argmax_out)
        return add_rms_norm_logits(hidden, residual, self.norm, self.shape.rms_norm_eps, self.lm_head,
                                   out=out, argmax_out=argmax_out)

    def _last_layer_outputs(self, input_ids: torch.Tensor, positions: torch.Tensor,
                            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's MLP output, the residual stream before it) of rows meta.logits_indices
        (all rows when None): their sum, normed, is the final hidden state. Each RMSNorm runs inside
        the projection after it (add_rms_norm_linear: one kernel for one row on a GPU)."""
        s = self.shape
        eps = s.rms_norm_eps
        tokens = input_ids.shape[0]
        hidden = F.embedding(input_ids, self.embed)
        residual = None
        for index, layer in enumerate(self.layers):
            qkv, residual = add_rms_norm_linear(hidden, residual, layer.input_norm, eps, layer.qkv)
            k_cache, v_cache = self.kv_caches[index]
            q = rope_and_store(qkv, positions, self.rope_cos, self.rope_sin, k_cache, v_cache, meta.slot_mapping,
                               s.num_attention_heads, s.num_key_value_heads, s.head_dim)
            if meta.is_prefill and meta.cached_lens is not None:
                attention = self._prefill_attention_over_cache(q, k_cache, v_cache, meta)
            elif meta.is_prefill:
                attention = self._prefill_attention(q, qkv, meta)
            else:
                attention = paged_attention.paged_decode_attention(
                    q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale,
                    backend=self.decode_backend, num_splits=meta.num_splits)
            hidden = linear(attention.reshape(tokens, s.q_size), layer.o)
            if self.tp is not None:
                hidden = self.tp.all_reduce(hidden)
            gate_up, residual = add_rms_norm_linear(hidden, residual, layer.post_norm, eps, layer.gate_up)
            hidden = silu_and_mul_linear(gate_up, layer.down)
            if self.tp is not None:
                hidden = self.tp.all_reduce(hidden)
        if meta.logits_indices is not None:
            hidden, residual = hidden[meta.logits_indices], residual[meta.logits_indices]
        return hidden, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.lm_head).float()
        return logits if self.tp is None else self.tp.gather_logits(logits, self.shape.vocab_size)

    def _prefill_attention(self, q: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Causal attention within each packed sequence. q [tokens, heads, d]; k and v are read
        from qkv (k already rotated in place)."""
        s = self.shape
        tokens = q.shape[0]
        k = qkv[:, s.q_size:s.q_size + s.kv_size].view(tokens, s.num_key_value_heads, s.head_dim)
        v = qkv[:, s.q_size + s.kv_size:].view(tokens, s.num_key_value_heads, s.head_dim)
        if self.prefill_varlen is not None:
            return self.prefill_varlen(q, k, v, meta.cu_seqlens, meta.cu_seqlens, meta.max_seq_len, meta.max_seq_len,
                                       scale=self.scale)
        out = torch.empty_like(q)
        start = 0
        for n in meta.seq_lens:
            rows = slice(start, start + n)
            out[rows] = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1),
                is_causal=True, scale=self.scale, enable_gqa=self.gqa).transpose(0, 1)
            start += n
        return out

    def _prefill_attention_over_cache(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                      meta: AttentionMetadata) -> torch.Tensor:
        """Causal attention of each sequence's new tokens over its whole context, cached prefix
        and new tokens alike, read from the paged cache (this layer's K and V of the new tokens
        were stored before): query r of a sequence with c cached tokens sits at position c + r and
        sees keys 0 .. c + r. Every context is gathered in one index_select per layer; then one
        Flash varlen call for all sequences on a GPU (its causal mask aligns each sequence's
        queries with the end of its keys: the bottom-right alignment this needs), else SDPA per
        sequence with an explicit mask. A mixed chunked step's decode rows are such sequences
        too (one new token each), so one call per layer matters there most."""
        s = self.shape
        k = k_cache.view(-1, s.num_key_value_heads, s.head_dim).index_select(0, meta.context_slots)
        v = v_cache.view(-1, s.num_key_value_heads, s.head_dim).index_select(0, meta.context_slots)
        if self.prefill_varlen is not None:
            return self.prefill_varlen(q, k, v, meta.cu_seqlens, meta.cu_context_lens, meta.max_seq_len,
                                       meta.max_context_len, scale=self.scale)
        out = torch.empty_like(q)
        start = context_start = 0
        for n, cached in zip(meta.seq_lens, meta.cached_lens):
            context = cached + n
            visible = torch.ones(n, context, dtype=torch.bool, device=q.device).tril(diagonal=cached)
            rows, keys = slice(start, start + n), slice(context_start, context_start + context)
            out[rows] = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1), k[keys].transpose(0, 1), v[keys].transpose(0, 1), attn_mask=visible,
                scale=self.scale, enable_gqa=self.gqa).transpose(0, 1)
            start += n
            context_start += context
        return out
