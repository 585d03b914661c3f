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
