"""The model parameters every phase 5 exercise shares (a named shape with seeded random weights, or
a Hugging Face checkpoint folder), checked before any work, the engine settings built from them,
and giving the memory of a model back before the next one loads."""
from common.params import Choice, Float, Folder, Int

from ..engine import SHAPES, LlamaShape, from_checkpoint, named

MODEL = Choice("llama-3.1-8b", tuple(SHAPES), help="a named Llama shape, built with seeded random weights")
CHECKPOINT = Folder(None, help="a Hugging Face Llama checkpoint folder (config.json, *.safetensors); "
                               "overrides `model`")
SEED = Int(0, min=0, max=2**31 - 1, help="seed of the random weights and of the prompts")
GPU_MEMORY_UTILIZATION = Float(0.90, min=0.05, max=0.99,
                               help="fraction of GPU memory the weights, KV pool and activations may use")
BLOCK_SIZE = Int(16, min=1, max=1024, choices=(8, 16, 32, 64, 128, 256), unit="tokens per KV block")
MAX_NUM_SEQS = Int(256, min=1, max=1024, unit="sequences per step")

COMMON = {"model": MODEL, "checkpoint": CHECKPOINT, "seed": SEED,
          "gpu_memory_utilization": GPU_MEMORY_UTILIZATION, "block_size": BLOCK_SIZE,
          "max_num_seqs": MAX_NUM_SEQS}
CPU_COMMON = {"model": "tiny"}


def model_of(params: dict, model: str | None = None) -> str:
    """What the engine loads: the checkpoint folder if one was given, else the named shape."""
    return str(params["checkpoint"]) if params.get("checkpoint") else (model or params["model"])


def shape_of(params: dict, model: str | None = None) -> LlamaShape:
    if params.get("checkpoint"):
        return from_checkpoint(params["checkpoint"])
    return named(model or params["model"])


def engine_settings(params: dict, model: str | None = None, **overrides) -> dict:
    """EngineConfig's fields from the exercise's parameters (the server takes the same names)."""
    out = {"model": model_of(params, model), "seed": params["seed"], "block_size": params["block_size"],
           "gpu_memory_utilization": params["gpu_memory_utilization"], "max_num_seqs": params["max_num_seqs"]}
    out.update(overrides)
    return out


# Bytes per weight as the engine loads them: bf16 on a GPU, fp32 on a CPU (serving.dtype_name;
# a CPU's bf16 matmuls are slow or missing), so the same model needs twice the memory there.
GPU_BYTES_PER_PARAM = 2
CPU_BYTES_PER_PARAM = 4


def weights_footprint_bytes(params: dict, models=None, bytes_per_param: float = GPU_BYTES_PER_PARAM) -> float:
    """The largest model's weights: a run that cannot even hold them is refused before it starts."""
    names = models or [params["model"]]
    if params.get("checkpoint"):
        return from_checkpoint(params["checkpoint"]).weight_bytes(bytes_per_param)
    return max(named(m).weight_bytes(bytes_per_param) for m in names)


def cpu_weights_footprint_bytes(params: dict, models=None) -> float:
    """`Exercise.cpu_footprint_bytes`: the largest model's weights in fp32. On a CPU nothing skips
    a model that does not fit once the run has started, so every model listed must fit."""
    return weights_footprint_bytes(params, models, CPU_BYTES_PER_PARAM)


def refuse_unless_it_fits(shape: LlamaShape, dtype_bytes: int, device, ranks: int = 1) -> None:
    """`lab serve`'s check before loading: LabError (exit 2, one line) when the weights, in the
    dtype the engine will load and split over `ranks` GPUs, exceed the device's memory (a GPU's
    total, or the RAM the host has available)."""
    from common.errors import LabError
    from common.runner import memory_bytes
    need = shape.weight_bytes(dtype_bytes) / ranks
    have = memory_bytes(device)
    if have and need > have:
        where = "this GPU has" if device.type == "cuda" else "this machine has"
        per = f" per GPU over {ranks}" if ranks > 1 else ""
        raise LabError(f"{shape.name}: its weights need {need / 2**30:,.1f} GiB{per} in {dtype_bytes * 8}-bit "
                       f"floats; {where} {have / 2**30:,.1f} GiB{' of RAM available' if device.type != 'cuda' else ''}: "
                       "serve a smaller model")


def release_memory(ctx) -> None:
    """Hand a dropped model's memory back (an 8B engine and the 70B one never fit side by side)."""
    import gc

    import torch
    gc.collect()
    if ctx.is_cuda:
        torch.cuda.empty_cache()
