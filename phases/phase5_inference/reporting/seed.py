"""The seed write-up's phase 5 figures (vLLM 0.18 on A100 SXM4 80GB, Llama 3.1 8B bf16), quoted for
comparison. They are the specification of what phase 5 measures, never results of this lab: every
table or sentence that shows them names CITATION."""
CITATION = "seed write-up (shared/seeds/000_d50e6b73398ffa0d.txt), Phase 5, vLLM 0.18 on an A100 SXM4 80GB"

STARTUP_8B = {"weights_gib": 14.99, "kv_pool_gib": 55.20, "kv_capacity_tokens": 452_192, "max_concurrency_8k": 55}
BATCHING_8B = {1: 91.2, 2: 186.5, 4: 367.6, 8: 731.1}          # concurrency: output tok/s
TTFT_8B_MS = 18.1
DECODE_8B_TOK_S = 93.0
TTFT_70B_TP2_MS = 58.0
KV_LEFT_70B_TP2_GIB = 3.93
DECODE_70B_TP2_TOK_S = 21.2            # Llama 3.3 70B bf16 on two A100s at TP=2 (exercise 5.4)
KV_TOKENS_70B_TP2 = 25_728             # the KV capacity that 3.93 GiB held

# Exercise 5.2, quantization (vLLM's AWQ INT4 through its naive kernel and through Marlin): model
# size in GiB, batch-1 decode tok/s, and x the bf16 run of the same model
QUANT_8B = {"bf16": (14.99, 93.1, 1.0), "AWQ int4, naive kernel": (5.37, 20.7, 0.2),
            "AWQ int4, Marlin": (5.37, 199.1, 2.14)}
QUANT_MISTRAL_MARLIN_X = 2.27

# Exercise 5.3, speculative decoding (vLLM, temperature 0): (target, draft, draft kind, tok/s with
# the draft, tok/s of the target alone, draft acceptance rate, mean tokens per verify pass)
SPECULATIVE = (
    ("Mistral 7B AWQ Marlin", "TinyLlama 15M", "mismatched", 67.5, 218.9, None, None),
    ("Llama 3.1 8B AWQ Marlin", "Llama 3.2 1B", "matched", 106.4, 199.1, 0.595, 3.98),
)
