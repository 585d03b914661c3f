"""Phase 5's steps for the profiler check (common/kernel_trace_check.py): the lab engine's batch-1
decode step (its CUDA graph replayed, over the mean context of ttft_decode's and batching's
requests) beside its kernel list (kernel_lists.decode_step); for quant_engine, the same step with
the projections in int4 through the engine's CUDA kernel (the batch-1 breakdown: where
an int4 step's time goes beside a bf16 one).

    python -m common.kernel_trace_check --exercise phase5.ttft_decode --param model=llama-3.1-8b
    python -m common.kernel_trace_check --exercise phase5.quant_engine [--param group_size=128]
"""
from common.errors import LabError

from . import kernel_lists
from .analysis import mean_decode_context
from ..engine.shapes import named

PARAMS = {"model": "llama-3.1-8b", "prompt_tokens": 100, "output_tokens": 200}
INT4_PARAMS = {**PARAMS, "group_size": 128}


def checked(params: dict, allowed: dict) -> dict:
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise LabError(f"phase 5's trace step has no parameter '{unknown[0]}' (it takes {', '.join(allowed)})")
    return {**allowed, **params}


def probe(p: dict, device, **quant):
    """(the engine's batch-1 decode step over the mean context, the shape, that context)."""
    shape = named(p["model"])
    context = int(mean_decode_context(int(p["prompt_tokens"]), int(p["output_tokens"])))
    from ..engine import EngineConfig, LLMEngine
    engine = LLMEngine(EngineConfig(model=p["model"], device=str(device), max_num_seqs=8,
                                    max_model_len=int(p["prompt_tokens"]) + int(p["output_tokens"]) + 64, **quant))
    return engine.runner.decode_probe(context), shape, context


def decode_step(params: dict, device):
    """(one batch-1 decode step, its workload, a label): seeded random weights of the named shape."""
    step, shape, context = probe(checked(params, PARAMS), device)
    return step, kernel_lists.decode_step(shape, 1, context), f"{shape.name} batch-1 decode step over {context} tokens"


def int4_decode_step(params: dict, device):
    """The same step with every projection in int4 (group `group_size`) through the CUDA kernel."""
    p = checked(params, INT4_PARAMS)
    group = int(p["group_size"])
    step, shape, context = probe(p, device, quantization="int4", quant_path="cuda", quant_group_size=group)
    workload = kernel_lists.decode_step(shape, 1, context, weight_bytes=kernel_lists.int4_weight_bytes(group),
                                        norm_in_quant_kernel=True)
    return step, workload, f"{shape.name} int4 (group {group}, CUDA kernel) batch-1 decode step over {context} tokens"


TRACE_STEPS = {"phase5.ttft_decode": decode_step, "phase5.batching": decode_step,
               "phase5.quant_engine": int4_decode_step}
