"""Exercise 5.1: what an inference server knows the moment it starts: the weights' size, the KV pool
left beside them, how many tokens that pool holds, and how many 8K-token requests fit at once.

    lab run phase5.startup [--param models=[llama-3.1-8b,llama-3.3-70b]]

The engine loads each model (seeded random weights of its real shape, or a checkpoint), sizes the
paged KV pool from the GPU memory left under `gpu_memory_utilization`, and allocates it: every
figure is what the engine actually holds. Beside each, the prediction from the shape alone:
weights = parameters x 2 bytes; KV per token = 2 x layers x kv_heads x head_dim x 2 bytes.
A model whose weights leave no room under the utilization gets a row saying so, with the numbers.
"""

import torch

from common.errors import LabError
from common.exercise import Exercise, Needs, Result, row
from common.params import Choice, Float, Int
from common.standalone import run_alone

from .engine import SHAPES
from .models.model_choice import (
    COMMON,
    cpu_weights_footprint_bytes,
    engine_settings,
    release_memory,
    shape_of,
    weights_footprint_bytes,
)

GIB = 2**30


def startup_row(ctx, params: dict, model: str, utilization: float) -> dict:
    from .engine import EngineConfig, LLMEngine

    shape = shape_of(params, model)
    context = params["context_tokens"]
    identity = {"model": shape.name, "gpu_memory_utilization": utilization, "context_tokens": context,
                "block_size": params["block_size"]}
    element_bytes = 2 if ctx.is_cuda else 4                 # bf16 on a GPU, fp32 on a CPU
    predicted = {"weights_gib": shape.weight_bytes(element_bytes) / GIB,
                 "kv_bytes_per_token": shape.kv_bytes_per_token(element_bytes), "params_billion": shape.params() / 1e9}
    total = torch.cuda.get_device_properties(ctx.device).total_memory if ctx.is_cuda else None
    if total and shape.weight_bytes() > total:
        return row(shape.name, identity, "skipped", f"{shape.weight_bytes() / GIB:.1f} GiB of bf16 weights exceed "
                   f"this GPU's {total / GIB:.1f} GiB", metrics=predicted)
    settings = engine_settings(params, model, gpu_memory_utilization=utilization, cuda_graphs=False,
                               dtype="bfloat16" if ctx.is_cuda else "float32", device=ctx.device.type)
    try:
        engine = LLMEngine(EngineConfig(**settings))
    except LabError as exc:              # the weights leave no room for a KV pool: the finding itself
        release_memory(ctx)
        return row(shape.name, identity, "skipped", str(exc), metrics=predicted)
    except torch.cuda.OutOfMemoryError as exc:       # the engine's own failure: this row, not the others
        release_memory(ctx)
        return row(shape.name, identity, "failed", f"out of memory while loading: {str(exc).splitlines()[0][:200]}",
                   metrics=predicted)
    t = engine.telemetry
    del engine
    release_memory(ctx)
    blocks_per_request = -(-context // t["block_size"])
    metrics = {
        **predicted,
        "measured_weights_gib": t["weights_bytes"] / GIB,
        "kv_pool_gib": t["kv_pool_bytes"] / GIB,
        "kv_blocks": t["num_kv_blocks"],
        "kv_capacity_tokens": t["kv_capacity_tokens"],
        "max_concurrency_at_context": t["num_kv_blocks"] // blocks_per_request,
        "gpu_total_gib": (t.get("gpu_total_bytes") or 0) / GIB or None,
        "load_s": t.get("load_s"),
        "activation_reserve_gib": (t.get("activation_reserve_bytes") or 0) / GIB or None,
    }
    expected = shape.params() * element_bytes
    check = {"passed": t["weights_bytes"] == expected, "reference": "parameters x bytes per parameter",
             "reason": None if t["weights_bytes"] == expected else
             f"the engine holds {t['weights_bytes']} bytes of weights, the shape has {expected}"}
    return row(shape.name, identity, "ok" if check["passed"] else "failed", check["reason"], check=check,
               metrics=metrics)


def run(ctx, params):
    rows = [startup_row(ctx, params, model, u)
            for model in ctx.track(params["models"], "models")
            for u in params["utilizations"]]
    return Result(rows, {"context_tokens": params["context_tokens"]})


EXERCISE = Exercise(
    id="phase5.startup",
    title="Startup telemetry: weights, KV pool, KV capacity, concurrency at 8K",
    run=run,
    needs=Needs(modules=("safetensors",)),
    params={**COMMON,
            "models": Choice(["llama-3.1-8b", "llama-3.3-70b"], tuple(SHAPES), many=True),
            "utilizations": Float([0.90, 0.98], min=0.05, max=0.99, many=True),
            "context_tokens": Int(8192, min=1, max=131072, unit="tokens per request")},
    cpu_params={"models": ["tiny", "tiny-tied"], "utilizations": [0.5]},
    quick_params={"models": ["tiny"], "utilizations": [0.5]},
    footprint_bytes=lambda p: min(weights_footprint_bytes(p, [m]) for m in p["models"]),
    cpu_footprint_bytes=lambda p: cpu_weights_footprint_bytes(p, p["models"]),    # no model skips on a CPU
)

if __name__ == "__main__":
    run_alone(EXERCISE, {})
