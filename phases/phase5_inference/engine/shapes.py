"""The Llama architecture's shape: named shapes (Llama 3.x, and tiny ones for tests), a Hugging Face
config.json read into the same form, and the byte counts every phase 5 prediction is made from.

Torch-free: `lab predict`, the report and the scheduler's pool sizing use it without a GPU.
"""
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from common.errors import LabError

BF16_BYTES = 2


@dataclass(frozen=True)
class LlamaShape:
    """Everything the model's tensors and the KV cache's size follow from (Hugging Face's names)."""
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 500_000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # Llama 3.1's frequency scaling ("rope_type": "llama3"); None: plain RoPE.
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    # --------------------------------------------------------------- parameter counts
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def layer_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        attention = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        mlp = 3 * h * i
        return attention + mlp + 2 * h                       # + the two RMSNorm weights

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def params(self) -> int:
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.embedding_params() + self.num_hidden_layers * self.layer_params() + self.hidden_size + lm_head

    # --------------------------------------------------------------- bytes
    def weight_bytes(self, bytes_per_param: float = BF16_BYTES) -> float:
        return self.params() * bytes_per_param

    def decode_weight_bytes(self, bytes_per_param: float = BF16_BYTES) -> float:
        """Bytes of weights one decode step reads: all of them except the embedding table, of which
        a step reads one row per sequence (tied embeddings are read whole, as the LM head)."""
        unread = 0 if self.tie_word_embeddings else self.embedding_params()
        return (self.params() - unread) * bytes_per_param

    def kv_bytes_per_token(self, bytes_per_element: float = BF16_BYTES) -> float:
        """K and V of one token in every layer."""
        return 2 * self.num_hidden_layers * self.kv_size * bytes_per_element

    def flops_per_token(self, context_len: int = 0) -> float:
        """Forward FLOPs of one token: 2 per weight it multiplies, plus attention's QK^T and PV over
        `context_len` earlier tokens (2 x 2 x heads x head_dim each)."""
        matmul = 2 * (self.params() - self.embedding_params() - self.hidden_size
                      - self.num_hidden_layers * 2 * self.hidden_size)
        if self.tie_word_embeddings:
            matmul += 2 * self.embedding_params()
        attention = 4 * self.num_hidden_layers * self.q_size * context_len
        return matmul + attention

    def to_dict(self) -> dict:
        return asdict(self)


def _llama3_scaling(factor: float, original: int = 8192) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": original}


LLAMA3_EOS = (128001, 128008, 128009)

SHAPES: dict[str, LlamaShape] = {s.name: s for s in (
    # Tests: small enough for CPU fp32 beside transformers; the vocabulary covers GPT-2's ids so
    # text prompts work through the GPT-2 BPE the repository ships; the scaling's original context
    # (64) is shorter than test prompts, so the Llama-3 frequency scaling is exercised, not idle.
    LlamaShape("tiny", vocab_size=50304, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
               rope_theta=10_000.0, rope_scaling=_llama3_scaling(8.0, original=64), eos_token_id=50256),
    LlamaShape("tiny-tied", vocab_size=50304, hidden_size=96, intermediate_size=256, num_hidden_layers=3,
               num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
               tie_word_embeddings=True, eos_token_id=50256),
    LlamaShape("llama-3.2-1b", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
               tie_word_embeddings=True, rope_scaling=_llama3_scaling(32.0), bos_token_id=128000,
               eos_token_id=LLAMA3_EOS),
    LlamaShape("llama-3.1-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
               rope_scaling=_llama3_scaling(8.0), bos_token_id=128000, eos_token_id=LLAMA3_EOS),
    LlamaShape("llama-3.3-70b", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
               num_attention_heads=64, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
               rope_scaling=_llama3_scaling(8.0), bos_token_id=128000, eos_token_id=LLAMA3_EOS),
)}


def named(name: str) -> LlamaShape:
    if name not in SHAPES:
        raise LabError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    return SHAPES[name]


# ------------------------------------------------------------------------------ config.json
# Every key a Llama-family config.json can carry, sorted by what the engine does with it. A key in
# none of these sets is refused by name: the engine does not guess what an unknown key changes.
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
USED_KEYS = frozenset(REQUIRED_KEYS) | {
    "architectures", "model_type", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "rope_theta", "rope_scaling", "rope_parameters",
    "hidden_act", "attention_bias", "mlp_bias", "quantization_config"}
# Keys that do not change the engine's output: bookkeeping, training-only settings (dropout, init),
# kernel or cache choices of transformers, and generation defaults (the request's fields decide).
HARMLESS_KEYS = frozenset({
    "torch_dtype", "dtype", "transformers_version", "_name_or_path", "initializer_range", "use_cache",
    "pad_token_id", "sep_token_id", "decoder_start_token_id", "attention_dropout", "pretraining_tp",
    "output_hidden_states", "output_attentions", "return_dict", "torchscript", "use_bfloat16", "tf_legacy_loss",
    "pruned_heads", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "tie_encoder_decoder", "id2label", "label2id", "problem_type",
    "finetuning_task", "tokenizer_class", "prefix", "task_specific_params", "_attn_implementation_autoset",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens"})
# RoPE: the rope types the engine computes, and the parameters each one reads (transformers' names).
ROPE_PARAMETERS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
}
LLAMA_DEFAULTS = {"rope_theta": 10_000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048}   # LlamaConfig's


def _positive_int(config: dict, key: str, name: str) -> int:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LabError(f"{name}: config.json {key} must be a positive integer, got {value!r}")
    return value


def _positive_number(value, key: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise LabError(f"{name}: config.json {key} must be a positive number, got {value!r}")
    return float(value)


def _rope_form(theta, scaling: dict, where: str, name: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) of one form's values, its type and parameters checked."""
    scaling = dict(scaling)
    theta = _positive_number(LLAMA_DEFAULTS["rope_theta"] if theta is None else theta, "rope_theta", name)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in ROPE_PARAMETERS:
        raise LabError(f"{name}: config.json {where} rope_type {rope_type!r} is not supported "
                       f"(the engine computes {', '.join(ROPE_PARAMETERS)})")
    unread = sorted(set(scaling) - ROPE_PARAMETERS[rope_type])
    if unread:
        raise LabError(f"{name}: config.json {where}.{unread[0]} is not read by rope_type {rope_type!r}: refused")
    missing = sorted(ROPE_PARAMETERS[rope_type] - set(scaling))
    if missing:
        raise LabError(f"{name}: config.json {where} of rope_type {rope_type!r} lacks {missing[0]}")
    for key, value in scaling.items():
        _positive_number(value, f"{where}.{key}", name)
    return theta, (None if rope_type == "default" else {"rope_type": rope_type, **scaling})


def rope_of(config: dict, name: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config form: transformers 5's `rope_parameters`
    {rope_theta, rope_type, ...} or the older top-level `rope_theta` and `rope_scaling` {type or
    rope_type, ...}. rope_scaling is None for plain RoPE. Unknown rope types, parameters a type does
    not read, and two forms in one file that describe different RoPEs are refused by name."""
    params = config.get("rope_parameters")
    legacy_theta, legacy_scaling = config.get("rope_theta"), config.get("rope_scaling")
    if legacy_scaling is not None and not isinstance(legacy_scaling, dict):
        raise LabError(f"{name}: config.json rope_scaling must be an object or null, got {legacy_scaling!r}")
    legacy = _rope_form(legacy_theta, legacy_scaling or {}, "rope_scaling", name)
    if params is None:
        return legacy
    if not isinstance(params, dict):
        raise LabError(f"{name}: config.json rope_parameters must be an object, got {params!r}")
    new = _rope_form(params.get("rope_theta", legacy_theta),
                     {k: v for k, v in params.items() if k != "rope_theta"}, "rope_parameters", name)
    if (legacy_theta is not None or legacy_scaling is not None) and new != legacy:
        raise LabError(f"{name}: config.json rope_parameters {params} and the top-level rope_theta/rope_scaling "
                       "disagree: refused")
    return new


def from_hf_config(config: dict, name: str) -> LlamaShape:
    """A Hugging Face LlamaConfig (config.json) as a shape. Only the Llama architecture is accepted;
    every key is used, harmless, or refused by name (module constants above)."""
    if not isinstance(config, dict):
        raise LabError(f"{name}: config.json must hold a JSON object")
    archs = config.get("architectures") or ["LlamaForCausalLM"]
    if config.get("model_type", "llama") != "llama" or list(archs) != ["LlamaForCausalLM"]:
        raise LabError(f"{name}: not a Llama checkpoint (model_type={config.get('model_type')!r}, "
                       f"architectures={archs}); the engine runs LlamaForCausalLM")
    unknown = sorted(set(config) - USED_KEYS - HARMLESS_KEYS)
    if unknown:
        raise LabError(f"{name}: config.json key {unknown[0]!r} is not implemented by the engine: refused "
                       f"({len(unknown)} such key(s))")
    for key in REQUIRED_KEYS:
        if key not in config:
            raise LabError(f"{name}: config.json lacks {key}")
    for key, supported in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if config.get(key, supported) != supported:
            raise LabError(f"{name}: config.json {key}={config[key]!r} is not supported (only {supported!r})")
    sizes = {key: _positive_int(config, key, name) for key in REQUIRED_KEYS}
    heads = sizes["num_attention_heads"]
    kv_heads = _positive_int(config, "num_key_value_heads", name) if config.get("num_key_value_heads") else heads
    if heads % kv_heads:
        raise LabError(f"{name}: config.json num_attention_heads {heads} is not a multiple of "
                       f"num_key_value_heads {kv_heads}")
    if config.get("head_dim"):
        head_dim = _positive_int(config, "head_dim", name)
    elif sizes["hidden_size"] % heads:
        raise LabError(f"{name}: config.json hidden_size {sizes['hidden_size']} is not a multiple of "
                       f"num_attention_heads {heads} (and no head_dim is given)")
    else:
        head_dim = sizes["hidden_size"] // heads
    if head_dim % 2:
        raise LabError(f"{name}: head_dim {head_dim} is odd; RoPE rotates pairs")
    theta, scaling = rope_of(config, name)
    eos = config.get("eos_token_id")
    max_positions = (_positive_int(config, "max_position_embeddings", name)
                     if config.get("max_position_embeddings") is not None else LLAMA_DEFAULTS["max_position_embeddings"])
    eps = config.get("rms_norm_eps")
    if eps is not None:
        _positive_number(eps, "rms_norm_eps", name)
    return LlamaShape(
        name=name, **sizes, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=max_positions,
        rope_theta=theta, rms_norm_eps=float(LLAMA_DEFAULTS["rms_norm_eps"] if eps is None else eps),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), rope_scaling=scaling,
        bos_token_id=config.get("bos_token_id"), eos_token_id=tuple(eos) if isinstance(eos, list) else eos)


def read_config(folder: Path) -> dict:
    """config.json of a checkpoint folder as a dict; a missing or unparsable file is one line."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise LabError(f"{folder}: no config.json (a Hugging Face checkpoint folder holds config.json "
                       "and *.safetensors)")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LabError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LabError(f"{path}: must hold a JSON object, got {type(config).__name__}")
    return config


def from_checkpoint(folder: Path) -> LlamaShape:
    return from_hf_config(read_config(folder), name=Path(folder).name)


def hf_config(shape: LlamaShape) -> dict:
    """The shape as a Hugging Face config dict (what transformers' LlamaConfig(**...) accepts)."""
    d = shape.to_dict()
    d.pop("name")
    if isinstance(d["eos_token_id"], tuple):
        d["eos_token_id"] = list(d["eos_token_id"])
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, **d}


def with_context(shape: LlamaShape, max_positions: int) -> LlamaShape:
    return replace(shape, max_position_embeddings=max_positions)
