"""Phase 5: inference and serving. The lab's own engine (paged KV cache, continuous batching, CUDA
graphs, an OpenAI-compatible server), its benchmark client, and what decode costs by the roofline.

Exercise modules sit here; beside them engine/ (the engine and its server), benchmark/ (client,
workloads, baselines), models/ (choosing a model; the lab's trained ones), predictions/ (the
roofline of each part) and reporting/ (what report.py draws on)."""
from common.phase_discovery import Command

# One module per exercise, named after its id; the registry imports them (the report does not).
EXERCISE_MODULES = ("startup", "decode_attention", "ttft_decode", "batching", "offline", "vllm_serve",
                    "quant_kernels", "quant_engine", "quant_quality", "speculative", "tensor_parallel", "samples", "best_of_n", "long_prompt",)

# What this phase adds to `lab`: common/phase_discovery.py finds it; engine/server.py's main parses the flags.
LAB_COMMANDS = (Command("serve", "engine.server",
                        "the phase 5 engine behind an OpenAI-compatible HTTP server (`lab serve --help`)",
                        needs=("aiohttp", "safetensors", "tokenizers"), extra="serve"),)
