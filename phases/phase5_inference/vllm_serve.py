"""Exercise 5.5: the same continuous-batching sweep against `vllm serve`, where vLLM is installed.

    lab run phase5.vllm_serve

The exercise writes the model's config.json into a temporary folder and starts
`vllm serve FOLDER --load-format dummy --skip-tokenizer-init` (random weights of the same shape, as
the lab's engine uses; prompts are token ids, so no tokenizer is needed), waits for it to answer,
runs batching.sweep with the same client, and stops it. With a checkpoint (`--param checkpoint=`)
vLLM loads the real weights instead. Where `vllm` is not on PATH the record is skipped with that
reason: the lab's GPU machines have no vLLM wheel for their torch.
"""
import json
import socket
import tempfile
from pathlib import Path

from common.exercise import Exercise, Needs, Result
from common.params import Int
from common.standalone import run_alone

from . import batching
from .benchmark import serving
from .engine import hf_config
from .models.model_choice import COMMON, CPU_COMMON, shape_of, weights_footprint_bytes

START_TIMEOUT_S = 900          # vLLM compiles and captures graphs before it answers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_command(params: dict, model_dir: str, served_name: str, port: int) -> list[str]:
    cmd = ["vllm", "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", served_name, "--dtype", "bfloat16",
           "--gpu-memory-utilization", str(params["gpu_memory_utilization"]),
           "--max-num-seqs", str(params["max_num_seqs"]), "--block-size", str(params["block_size"]),
           "--max-model-len", str(params["prompt_tokens"] + params["output_tokens"] + 64), "--seed", str(params["seed"])]
    if not params.get("checkpoint"):
        cmd += ["--load-format", "dummy", "--skip-tokenizer-init"]
    return cmd


def run(ctx, params):
    shape = shape_of(params)
    with tempfile.TemporaryDirectory(prefix="lab-vllm-") as tmp:
        model_dir = str(params["checkpoint"]) if params.get("checkpoint") else tmp
        if not params.get("checkpoint"):
            (Path(tmp) / "config.json").write_text(json.dumps({**hf_config(shape), "torch_dtype": "bfloat16"}))
        port = free_port()
        cmd = vllm_command(params, model_dir, shape.name, port)
        with serving.launched(cmd, f"http://127.0.0.1:{port}", shape.name, params["start_timeout_s"]) as server:
            rows = batching.sweep(ctx, params, server, shape, "vllm")
    return Result(rows, {**batching.add_ratios(rows), "command": " ".join(["vllm", "serve", "<model>", *cmd[3:]])})


EXERCISE = Exercise(
    id="phase5.vllm_serve",
    title="The continuous-batching sweep against vllm serve (skipped where vLLM is not installed)",
    run=run,
    needs=Needs(tools=("vllm",), modules=("aiohttp",)),
    params={**COMMON, **{k: batching.EXERCISE.schema[k] for k in
                         ("concurrency", "prompt_tokens", "output_tokens", "rounds", "min_requests", "warmups")},
            "start_timeout_s": Int(START_TIMEOUT_S, min=1, max=3600, unit="s")},
    cpu_params={**CPU_COMMON, **batching.EXERCISE.cpu_params},
    quick_params=dict(batching.EXERCISE.quick_params),
    footprint_bytes=weights_footprint_bytes,
)

if __name__ == "__main__":
    run_alone(EXERCISE, {})
