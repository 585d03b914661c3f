"""The lab's inference engine, shaped like nano-vllm: requests in, tokens out, one step at a time.

    from phases.phase5_inference.engine import EngineConfig, LLMEngine, SamplingParams
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32"))
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8))

The pipeline (phase 5 README, "The engine"): llm.py's LLMEngine.step asks scheduler.py which
sequences run, runner.py turns them into tensors and runs model.py (or replays cuda_graphs.py's
captured steps), the sampler picks the tokens, and the scheduler's postprocess appends them and
finishes sequences. The HTTP face (server.py, OpenAI-compatible) is imported on its own: it needs
aiohttp.

Each public name is imported from its module on first use, so that `from ...engine import SHAPES`
stays torch-free (the report layer and `lab predict` read shapes without torch).
"""
import importlib

_HOMES = {
    "AsyncEngine": "async_engine", "EngineStopped": "async_engine", "QueueFull": "async_engine",
    "EngineConfig": "config",
    "LLMEngine": "llm", "StepOutput": "llm",
    "SamplingParams": "sequence", "Sequence": "sequence",
    "SHAPES": "shapes", "LlamaShape": "shapes", "from_checkpoint": "shapes", "hf_config": "shapes", "named": "shapes",
    "load_tokenizer": "tokenizer",
    "load_checkpoint": "weights", "random_weights": "weights", "tensor_shapes": "weights", "weights_for": "weights",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:                    # AttributeError lets `from engine import some_module` find the module
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
