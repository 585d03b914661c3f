"""Plain PyTorch decode of the same weights: the comparison the engine must beat.

A straightforward Llama (RMSNorm, RoPE with Llama-3 frequency scaling, GQA through SDPA, SwiGLU)
with a static KV cache per layer, [batch, kv_heads, max_seq_len, head_dim], the recipe of
gpt-fast: prefill the prompt, then decode one token at a time, optionally through
`torch.compile(mode="reduce-overhead", fullgraph=True)` (Inductor kernels replayed as a CUDA graph).
Nothing is fused: q/k/v and gate/up are separate matmuls, as a plain model has them.

Weights are the caller's: `load(weights)` makes the parameters views of the HF-named dict's
tensors (no copy), so the baseline costs only its KV cache on top of the dict. The engine fuses
its own copies (qkv, gate_up), so holding the engine and the dict together costs two sets of
weights: measure the baseline first, drop it (`del model`), then hand the dict to the engine and
drop the caller's reference once the engine has built its fused tensors.

Decoding is greedy (argmax) and always runs `max_new_tokens` (no EOS stop), so its tokens compare
one for one with the engine's and transformers' greedy output.
"""
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.errors import LabError

from ..engine.rope import inverse_frequencies
from ..engine import LlamaShape, tensor_shapes

WARMUP_DECODE_STEPS = 3          # reduce-overhead: compile, record the CUDA graph, replay once


def rope_tables(shape: LlamaShape, max_seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [max_seq_len, head_dim], computed in fp32 then cast to the model's dtype."""
    positions = torch.arange(max_seq_len, dtype=torch.float32)
    angles = positions[:, None] * inverse_frequencies(shape)[None, :]
    angles = torch.cat((angles, angles), dim=-1)                  # the half-rotation layout of HF weights
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, heads, seq, head_dim]; cos/sin [seq, head_dim]; rotate-half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def _linear(in_features: int, out_features: int) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=False)
    layer.weight.requires_grad_(False)
    return layer


class Attention(nn.Module):
    """GQA self-attention writing its K/V into a static cache [batch, kv_heads, max_seq_len, head_dim]."""

    def __init__(self, shape: LlamaShape, max_batch_size: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        h = shape.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = (
            shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim)
        self.q_proj = _linear(h, shape.q_size)
        self.k_proj = _linear(h, shape.kv_size)
        self.v_proj = _linear(h, shape.kv_size)
        self.o_proj = _linear(shape.q_size, h)
        cache_size = (max_batch_size, self.num_kv_heads, max_seq_len, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_size, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_size, dtype=dtype, device=device), persistent=False)

    def forward(self, x, cos, sin, positions, decode_mask):
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = self.k_cache[:batch], self.v_cache[:batch]
        k_cache.index_copy_(2, positions, k)
        v_cache.index_copy_(2, positions, v)
        gqa = self.num_heads != self.num_kv_heads
        if seq > 1:                       # prefill from position 0: the prompt attends to itself
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:                             # decode: the whole cache, positions past this one masked
            out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=decode_mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.gate_proj = _linear(shape.hidden_size, shape.intermediate_size)
        self.up_proj = _linear(shape.hidden_size, shape.intermediate_size)
        self.down_proj = _linear(shape.intermediate_size, shape.hidden_size)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape, max_batch_size: int, max_seq_len: int, dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape, max_batch_size, max_seq_len, dtype, device)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def forward(self, x, cos, sin, positions, decode_mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, decode_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Named `model` inside PlainLlama, so parameter names are Hugging Face's."""

    def __init__(self, shape: LlamaShape, max_batch_size: int, max_seq_len: int, dtype, device):
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(shape, max_batch_size, max_seq_len, dtype, device)
                                    for _ in range(shape.num_hidden_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class PlainLlama(nn.Module):
    """Llama with a static KV cache for up to `max_batch_size` equal-length prompts of
    `max_seq_len` positions (prompt + generated tokens).

    prefill(prompt_ids) -> first token; decode_one(token, pos) -> next token (tokens are int64
    tensors [batch] on the device, so a decode loop never waits on the host); generate() times both.
    """

    def __init__(self, shape: LlamaShape, max_seq_len: int, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cpu", max_batch_size: int = 1):
        super().__init__()
        if not 1 <= max_seq_len <= shape.max_position_embeddings:
            raise LabError(f"max_seq_len must be in [1, {shape.max_position_embeddings}] for {shape.name}, "
                           f"got {max_seq_len}")
        if max_batch_size < 1:
            raise LabError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.shape, self.max_seq_len, self.dtype = shape, max_seq_len, dtype
        self.max_batch_size = max_batch_size
        self.device = torch.device(device)
        with torch.device("meta"):         # parameters are placeholders until load() assigns the caller's tensors
            self.model = Backbone(shape, max_batch_size, max_seq_len, dtype, self.device)
            self.lm_head = _linear(shape.hidden_size, shape.vocab_size)
        cos, sin = rope_tables(shape, max_seq_len, dtype)
        self.register_buffer("rope_cos", cos.to(self.device), persistent=False)
        self.register_buffer("rope_sin", sin.to(self.device), persistent=False)
        self.register_buffer("cache_positions", torch.arange(max_seq_len, device=self.device), persistent=False)
        self._compiled_decode = None
        self._compile_options: dict | None = None

    # ------------------------------------------------------------------ weights
    def load(self, weights: dict[str, torch.Tensor]) -> "PlainLlama":
        """Make the parameters the dict's own tensors (no copy). They must already have this
        model's dtype and device: converting would duplicate them."""
        expected = tensor_shapes(self.shape)
        missing = sorted(set(expected) - set(weights))
        if missing:
            raise LabError(f"weights for {self.shape.name} lack {len(missing)} tensors, e.g. {missing[0]}")
        for name, size in expected.items():
            t = weights[name]
            if tuple(t.shape) != size:
                raise LabError(f"{name} has shape {tuple(t.shape)}, {self.shape.name} needs {size}")
            if t.dtype != self.dtype or not _same_device(t.device, self.device):
                raise LabError(f"{name} is {t.dtype} on {t.device}, the model is {self.dtype} on {self.device} "
                               "(convert the dict first: loading never copies)")
        state = {name: weights[name] for name in expected}
        if self.shape.tie_word_embeddings:
            state["lm_head.weight"] = weights["model.embed_tokens.weight"]
        self.load_state_dict(state, strict=True, assign=True)
        self.requires_grad_(False)
        return self

    def _check_loaded(self) -> None:
        if self.lm_head.weight.is_meta:
            raise LabError("PlainLlama has no weights yet: call load(weights) first")

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """input_ids [batch, seq] at `positions` [seq] (int64; seq > 1 only as a prefill from 0).
        Writes K/V into the cache; returns logits [batch, seq, vocab] or, by default, the last
        position's [batch, vocab]."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        decode_mask = (self.cache_positions <= positions[-1]).view(1, 1, 1, -1)
        for layer in self.model.layers:
            x = layer(x, cos, sin, positions, decode_mask)
        if not all_logits:
            x = x[:, -1]
        return self.lm_head(self.model.norm(x))

    def _prompt_tensor(self, prompt_ids) -> torch.Tensor:
        ids = torch.as_tensor(prompt_ids, dtype=torch.int64)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise LabError("prompt_ids must be a non-empty list of token ids, or equal-length lists of them")
        if ids.shape[0] > self.max_batch_size:
            raise LabError(f"{ids.shape[0]} prompts, but the cache was built for max_batch_size={self.max_batch_size}")
        if ids.shape[1] > self.max_seq_len:
            raise LabError(f"prompt of {ids.shape[1]} tokens exceeds max_seq_len={self.max_seq_len}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.shape.vocab_size:
            raise LabError(f"token ids must be in [0, {self.shape.vocab_size})")
        return ids.to(self.device)

    @torch.no_grad()
    def prefill_logits(self, prompt_ids) -> torch.Tensor:
        """Logits [batch, seq, vocab] of every prompt position; fills the cache from position 0."""
        self._check_loaded()
        ids = self._prompt_tensor(prompt_ids)
        return self(ids, torch.arange(ids.shape[1], device=self.device), all_logits=True)

    @torch.no_grad()
    def prefill(self, prompt_ids) -> torch.Tensor:
        """The prompt's K/V into the cache; returns the first generated token, int64 [batch]."""
        self._check_loaded()
        ids = self._prompt_tensor(prompt_ids)
        return self(ids, torch.arange(ids.shape[1], device=self.device)).argmax(dim=-1)

    @torch.no_grad()
    def decode_logits(self, token: torch.Tensor, pos) -> torch.Tensor:
        """Logits [batch, vocab] of `token` [batch] placed at position `pos`."""
        self._check_loaded()
        return self(token.view(-1, 1), self._position_tensor(pos))

    @torch.no_grad()
    def decode_one(self, token: torch.Tensor, pos) -> torch.Tensor:
        """The greedy next token, int64 [batch], after `token` [batch] at position `pos` (an int,
        or an int64 device tensor [1], which a compiled graph replays without re-tracing)."""
        self._check_loaded()
        return self._decode_step(token, self._position_tensor(pos))

    def _decode_step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return self(token.view(-1, 1), position).argmax(dim=-1)

    def _position_tensor(self, pos) -> torch.Tensor:
        if isinstance(pos, torch.Tensor):
            return pos.view(1)
        if not 0 <= pos < self.max_seq_len:
            raise LabError(f"position {pos} is outside the cache's [0, {self.max_seq_len})")
        return torch.tensor([pos], dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------------ compile
    def compiled_decode(self, compile_options: dict | None = None):
        """`_decode_step` through torch.compile (default: Inductor, reduce-overhead, fullgraph),
        built once per set of options. The cache and RoPE tables are marked static, so the CUDA
        graph updates the cache in place instead of copying it in and out."""
        options = compile_options or {"mode": "reduce-overhead", "fullgraph": True}
        if self._compiled_decode is None or options != self._compile_options:
            for buffer in self.buffers():
                torch._dynamo.mark_static_address(buffer)
            self._compiled_decode = torch.compile(self._decode_step, **options)
            self._compile_options = dict(options)
        return self._compiled_decode

    # ------------------------------------------------------------------ timed generation
    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int, mode: str = "eager",
                 compile_options: dict | None = None) -> tuple[list, dict]:
        """Greedy generation of exactly `max_new_tokens` tokens (the first from the prefill).

        prompt_ids: a list of ids (returns a list of ids) or equal-length lists (returns lists).
        Before the timed run, one prefill and WARMUP_DECODE_STEPS decode steps warm up kernels,
        cuBLAS and, for mode="compile", compile and record the graph (their K/V land at
        positions the timed run overwrites before reading). Prefill is eager in both modes.

        timings: prefill_ms (the time to first token: prompt upload, prefill, argmax, synchronised),
        decode_ms_per_token (one entry per decode step, CUDA events on a GPU), decode_ms_median,
        decode_ms_mean (wall time of the decode loop / steps), decode_tokens_per_s (all sequences),
        compile_s (first compiled call), warmup_s (all warmup calls, compile included).
        """
        if mode not in ("eager", "compile"):
            raise LabError(f"mode must be 'eager' or 'compile', got {mode!r}")
        if max_new_tokens < 1:
            raise LabError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self._check_loaded()
        single = torch.as_tensor(prompt_ids).dim() == 1
        ids = self._prompt_tensor(prompt_ids)
        batch, prompt_len = ids.shape
        if prompt_len + max_new_tokens - 1 > self.max_seq_len:
            raise LabError(f"{prompt_len} prompt + {max_new_tokens} new tokens need max_seq_len >= "
                           f"{prompt_len + max_new_tokens - 1}, the cache has {self.max_seq_len}")
        step = self.compiled_decode(compile_options) if mode == "compile" else self._decode_step
        on_cuda = self.device.type == "cuda"

        warmup_start = time.perf_counter()
        token = self.prefill(ids)
        compile_s = 0.0
        for i in range(min(WARMUP_DECODE_STEPS, self.max_seq_len - prompt_len)):
            call_start = time.perf_counter()
            token = self._call(step, token, torch.tensor([prompt_len + i], device=self.device), mode)
            _synchronize(self.device)
            if i == 0 and mode == "compile":
                compile_s = time.perf_counter() - call_start
        _synchronize(self.device)
        warmup_s = time.perf_counter() - warmup_start

        prefill_start = time.perf_counter()
        token = self.prefill(ids)
        _synchronize(self.device)
        prefill_ms = 1e3 * (time.perf_counter() - prefill_start)

        generated = [token]
        position = torch.tensor([prompt_len], dtype=torch.int64, device=self.device)
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(max_new_tokens)] if on_cuda else []
        host_marks = [time.perf_counter()]
        if on_cuda:
            marks[0].record()
        for i in range(1, max_new_tokens):
            token = self._call(step, token, position, mode)
            generated.append(token)
            position += 1
            if on_cuda:
                marks[i].record()
            else:
                host_marks.append(time.perf_counter())
        _synchronize(self.device)
        decode_s = time.perf_counter() - host_marks[0]
        steps = max_new_tokens - 1
        if on_cuda:
            per_token_ms = [marks[i - 1].elapsed_time(marks[i]) for i in range(1, max_new_tokens)]
        else:
            per_token_ms = [1e3 * (b - a) for a, b in zip(host_marks, host_marks[1:])]

        rows = torch.stack(generated, dim=1).tolist()
        tokens = rows[0] if single else rows
        mean_ms = 1e3 * decode_s / steps if steps else math.nan
        timings = {
            "mode": mode, "batch_size": batch, "prompt_tokens": prompt_len, "new_tokens": max_new_tokens,
            "prefill_ms": prefill_ms,
            "decode_ms_per_token": per_token_ms,
            "decode_ms_median": statistics.median(per_token_ms) if per_token_ms else math.nan,
            "decode_ms_mean": mean_ms,
            "decode_tokens_per_s": batch * 1e3 / mean_ms if steps else math.nan,
            "compile_s": compile_s, "warmup_s": warmup_s,
        }
        return tokens, timings

    @staticmethod
    def _call(step, token: torch.Tensor, position: torch.Tensor, mode: str) -> torch.Tensor:
        """One decode step. A CUDA graph's output is overwritten by its next replay, so it is
        cloned before it is kept or fed back."""
        if mode == "compile":
            torch.compiler.cudagraph_mark_step_begin()
            return step(token, position).clone()
        return step(token, position)


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index is None or b.index is None:
        return True
    return a.index == b.index


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
