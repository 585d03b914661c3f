"""Phase 5's steps for the profiler check (common/kernel_trace_check.py): the lab engine's batch-1
decode step (its CUDA graph replayed, over the mean context of ttft_decode's and batching's
requests) beside its kernel list (kernel_lists.decode_step).

    python -m common.kernel_trace_check --exercise phase5.ttft_decode --param model=llama-3.1-8b
"""
from common.errors import LabError

from . import kernel_lists
from .analysis import mean_decode_context
from ..engine.shapes import named

PARAMS = {"model": "llama-3.1-8b", "prompt_tokens": 100, "output_tokens": 200}


def decode_step(params: dict, device):
    """(one batch-1 decode step, its workload, a label): seeded random weights of the named shape."""
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise LabError(f"phase 5's trace step has no parameter '{unknown[0]}' (it takes {', '.join(PARAMS)})")
    p = {**PARAMS, **params}
    shape = named(p["model"])
    context = int(mean_decode_context(int(p["prompt_tokens"]), int(p["output_tokens"])))
    from ..engine import EngineConfig, LLMEngine
    engine = LLMEngine(EngineConfig(model=p["model"], device=str(device), max_num_seqs=8,
                                    max_model_len=int(p["prompt_tokens"]) + int(p["output_tokens"]) + 64))
    step = engine.runner.decode_probe(context)
    return step, kernel_lists.decode_step(shape, 1, context), f"{shape.name} batch-1 decode step over {context} tokens"


TRACE_STEPS = {"phase5.ttft_decode": decode_step, "phase5.batching": decode_step}
