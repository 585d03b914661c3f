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


def from_hf_config(config: dict, name: str) -> LlamaShape:
    """A Hugging Face LlamaConfig (config.json) as a shape. Only the Llama architecture is accepted."""
    archs = config.get("architectures") or ["LlamaForCausalLM"]
    if config.get("model_type", "llama") != "llama" or "LlamaForCausalLM" not in archs:
        raise LabError(f"{name}: not a Llama checkpoint (model_type={config.get('model_type')!r}, "
                       f"architectures={archs})")
    heads = config["num_attention_heads"]
    eos = config.get("eos_token_id")
    return LlamaShape(
        name=name, vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"], num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        max_position_embeddings=config.get("max_position_embeddings", 8192),
        rope_theta=float(config.get("rope_theta", 10_000.0)), rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_scaling=config.get("rope_scaling"), bos_token_id=config.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos)


def from_checkpoint(folder: Path) -> LlamaShape:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise LabError(f"{folder}: no config.json (a Hugging Face checkpoint folder holds config.json "
                       "and *.safetensors)")
    return from_hf_config(json.loads(path.read_text()), name=Path(folder).name)


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
