"""Phase 5's inference engine: a Llama model over a paged KV cache, continuous batching, CUDA graphs."""
