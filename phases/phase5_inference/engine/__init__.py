"""The lab's inference engine, shaped like nano-vllm: requests in, tokens out, one step at a time.

    from phases.phase5_inference.engine import EngineConfig, LLMEngine, SamplingParams
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32"))
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8))

The pipeline (README, "The engine"): llm.py's LLMEngine.step asks scheduler.py which sequences run,
runner.py turns them into tensors and runs model.py (with cuda_graphs.py's captured steps), the
sampler picks the tokens, and the scheduler's postprocess appends them and finishes sequences.
The HTTP face (server.py, OpenAI-compatible) is imported on its own: it needs aiohttp.
"""
from .async_engine import AsyncEngine, EngineStopped, QueueFull
from .config import EngineConfig
from .llm import LLMEngine, StepOutput
from .sequence import SamplingParams, Sequence
from .shapes import SHAPES, LlamaShape, from_checkpoint, hf_config, named
from .tokenizer import load_tokenizer
from .weights import load_checkpoint, random_weights, tensor_shapes, weights_for

__all__ = ["AsyncEngine", "EngineConfig", "EngineStopped", "LLMEngine", "LlamaShape", "QueueFull", "SHAPES",
           "SamplingParams", "Sequence", "StepOutput", "from_checkpoint", "hf_config", "load_checkpoint",
           "load_tokenizer", "named", "random_weights", "tensor_shapes", "weights_for"]
