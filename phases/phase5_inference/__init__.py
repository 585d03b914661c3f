"""Phase 5: inference and serving. The lab's own engine (paged KV cache, continuous batching, CUDA
graphs, an OpenAI-compatible server), its benchmark client, and what decode costs by the roofline."""

# One module per exercise, named after its id; the registry imports them (the report does not).
EXERCISE_MODULES = ("startup", "decode_attention", "ttft_decode", "batching", "offline", "vllm_serve",
                    "quant_kernels", "quant_engine", "quant_quality", "speculative", "tensor_parallel",)
