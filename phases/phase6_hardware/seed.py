"""Figures phase 6 quotes: the seed write-up's own runs (a TPU v5e through JAX, Groq's API, an A100
with vLLM) and the community or vendor figures it relayed where its access failed (Tenstorrent,
AMD, ArtificialAnalysis' cloud medians). None is a result of this lab; each carries where it
comes from, and every table, plot or sentence that shows one names that source.

Keys are hardware.yaml keys, so the cross-architecture table finds them beside the entry they
describe; `quoted.py` turns the same figures into quoted records."""
from dataclasses import dataclass

SEED_FILE = "shared/seeds/000_d50e6b73398ffa0d.txt"
SEED = f"seed write-up ({SEED_FILE}), Phase 6"


def citing(whom: str) -> str:
    """A figure the seed relayed from someone else: the seed first (a table labels a row with the
    words before the first parenthesis), then whose figure it is."""
    return f"seed write-up, citing {whom} ({SEED_FILE}, Phase 6)"


@dataclass(frozen=True)
class Quote:
    """One figure from elsewhere: its value (the midpoint where a range was given), the range,
    who measured it, and on how many devices."""
    value: float
    source: str
    by: str = "the seed"          # who, in a few words (a table cell)
    low: float | None = None
    high: float | None = None
    devices: int = 1
    note: str | None = None

    def text(self, unit: str = "") -> str:
        shown = f"{self.low:g}-{self.high:g}" if self.low is not None else f"{self.value:,g}"
        return shown + unit + (f" on {self.devices} devices" if self.devices > 1 else "")


# bf16 dense matmul, TFLOP/s achieved (the seed gives no matrix size for these)
MATMUL_TFLOPS = {
    "tpu_v5e": Quote(142.3, SEED, note="jax.jit on one TPU v5e chip (Google Colab), 72.2% of 197"),
    "a100_sxm_80gb": Quote(250, SEED, note="about 250, the seed's phase 2 cuBLAS figure as its phase 6 table gives it"),
    "rtx_4090": Quote(130, SEED, note="about 130, the seed's phase 1 figure as its phase 6 table gives it"),
    "wormhole_n300": Quote(157.5, citing("community benchmarks: corsix.org, FOSDEM 2025"),
                           by="corsix.org, FOSDEM 2025, via the seed", low=140, high=175, note="not measured by the seed: its Koyeb deployments failed"),
}

# Attention on the TPU: batch 4, 16 heads, 2048 tokens, head dim 64, bf16, through jax.jit
TPU_ATTENTION = {"batch": 4, "heads": 16, "seq": 2048, "head_dim": 64, "ms": 2.60,
                 "claim": "XLA fused matmul, softmax and matmul into one TPU kernel with no programmer intervention"}

# Batch-1 decode, output tok/s, by (hardware key, lab model shape)
DECODE_TOK_S = {
    ("groq_lpu", "llama-3.1-8b"): Quote(672.9, SEED, note="GroqCloud API, streamed; the chip count behind it is not published"),
    ("groq_lpu", "llama-3.3-70b"): Quote(263.1, SEED, note="GroqCloud API, streamed"),
    ("a100_sxm_80gb", "llama-3.1-8b"): Quote(93.0, SEED, note="vLLM, local"),
    ("a100_sxm_80gb", "llama-3.3-70b"): Quote(21.2, SEED, devices=2, note="vLLM, tensor parallel over 2 A100s"),
    ("wormhole_n300", "llama-3.1-8b"): Quote(24, citing("Tenstorrent's own hand-optimized figure"),
                                             by="Tenstorrent, via the seed", note="about 24"),
    ("mi300x", "llama-3.3-70b"): Quote(37, citing("Chips and Cheese and AMD's MLPerf Inference v4.1"),
                                       by="Chips and Cheese, AMD MLPerf v4.1, via the seed", note="about 37, one GPU (the 70B weights fit in 192 GB)"),
}

# The seed's Groq table: model -> (output tok/s, TTFT ms) per source; ~100-token prompt, 200 tokens,
# temperature 0, streamed, 1 warmup excluded, mean of 5 runs
GROQ_RUNS = {
    "groq_lpu": {"llama-3.1-8b": (672.9, 130.8), "llama-3.3-70b": (263.1, 135.4)},
    "a100_sxm_80gb": {"llama-3.1-8b": (93.0, 18.1), "llama-3.3-70b": (21.2, 58.0)},
    "cloud_api_median": {"llama-3.1-8b": (154.8, 930.0), "llama-3.3-70b": (85.5, 1410.0)},
}
GROQ_SOURCES = {"groq_lpu": SEED + " (GroqCloud API)", "a100_sxm_80gb": SEED + ", from its Phase 5 (vLLM, local)",
                "cloud_api_median": citing("ArtificialAnalysis' cloud API medians")}
GROQ_SPEC_DECODE_70B_TOK_S = Quote(1665, citing("Groq's published figure for Llama 3 70B with speculative decoding"),
                                   by="Groq, via the seed")
# The seed's split of Groq's 8B TTFT: network, LPU compute, the API's own infrastructure (ms)
GROQ_TTFT_SPLIT_MS = {"network": 6.5, "lpu_compute": 14.0, "api_overhead": 110.0, "round_trip": 13.0}
