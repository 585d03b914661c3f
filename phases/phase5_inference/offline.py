"""Exercise 5.4: offline throughput on nano-vllm's benchmark workload: 256 sequences at once, input
and output lengths uniform in 100..1024, random token ids, EOS ignored; output tokens per second.

    lab run phase5.offline [--param num_seqs=256]

No server: the engine's own `generate`, as nano-vllm and `vllm`'s offline LLM.generate measure it.
The prediction walks the same schedule step by step (prefills packed up to the token limit, then
decode steps as sequences finish, each part of each step its own roofline: analysis.offline_steps)
and sums it.
"""
import time


from common.exercise import Exercise, Needs, Result, Work, row
from common.params import Int
from common.standalone import run_alone
from common.timing import summarize

from .predictions.analysis import offline_steps
from .models.model_choice import (
    COMMON,
    CPU_COMMON,
    cpu_weights_footprint_bytes,
    engine_settings,
    release_memory,
    shape_of,
    weights_footprint_bytes,
)
from .predictions.prediction import summed_prediction
from .benchmark.workload import random_lengths, random_prompts

MAX_BATCHED_TOKENS = 16384


def low_not_above_high(lengths: list) -> str | None:
    return None if lengths[0] <= lengths[1] else f"the low end {lengths[0]} is above the high end {lengths[1]}"


LENGTH_RANGE = Int([100, 1024], min=1, max=65536, length=2, rule=low_not_above_high, unit="tokens, [low, high]")


def check_outputs(outputs: list[list[int]], wanted: list[int], vocab: int) -> dict:
    """Each sequence made exactly its requested tokens (EOS ignored), every id in the vocabulary."""
    short = [i for i, (o, n) in enumerate(zip(outputs, wanted)) if len(o) != n]
    bad = [i for i, o in enumerate(outputs) if any(not 0 <= t < vocab for t in o)]
    passed = not short and not bad
    reason = None if passed else (f"sequence {short[0]} made {len(outputs[short[0]])} tokens, asked {wanted[short[0]]}"
                                  if short else f"sequence {bad[0]} has a token id outside the vocabulary")
    return {"passed": passed, "reference": "requested lengths, vocabulary range", "reason": reason}


def run(ctx, params):
    from .engine import EngineConfig, LLMEngine, SamplingParams

    shape = shape_of(params)
    n, seed = params["num_seqs"], params["seed"]
    (lo_in, hi_in), (lo_out, hi_out) = params["input_tokens"], params["output_tokens"]
    prompts = random_prompts(n, (lo_in, hi_in), shape.vocab_size, seed)
    output_lens = random_lengths(n, lo_out, hi_out, seed + 1)
    engine = LLMEngine(EngineConfig(**engine_settings(
        params, dtype="bfloat16" if ctx.is_cuda else "float32", device=ctx.device.type,
        max_num_batched_tokens=MAX_BATCHED_TOKENS, max_model_len=hi_in + hi_out + 1)))
    try:
        engine.generate([prompts[0][:16]] * 2, SamplingParams(max_tokens=4, ignore_eos=True))    # warm up
        sampling = [SamplingParams(max_tokens=o, ignore_eos=True) for o in output_lens]
        steps_before, preempted_before = engine.telemetry.get("steps", 0), engine.num_preemptions
        ctx.synchronize()
        t0 = time.perf_counter()
        outputs = engine.generate(prompts, sampling)
        ctx.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
        check = check_outputs(outputs, output_lens, shape.vocab_size)
        identity = {"model": shape.name, "num_seqs": n, "input_tokens": [lo_in, hi_in],
                    "output_tokens": [lo_out, hi_out], "dtype": "bf16" if ctx.is_cuda else "fp32"}
        if not check["passed"]:
            return Result([row("lab-engine", identity, "failed", check["reason"], check=check)])
        out_tokens, in_tokens = sum(output_lens), sum(len(p) for p in prompts)
        steps = offline_steps(shape, [len(p) for p in prompts], output_lens, params["max_num_seqs"], MAX_BATCHED_TOKENS)
        dtype = "bf16" if ctx.is_cuda else "fp32"
        timing = summarize([wall_ms], "perf_counter around engine.generate, synchronized", warmup_calls=1,
                           flush_l2=False)
        prediction = summed_prediction(ctx, [part for step in steps for part in step], dtype, wall_ms,
                                       launches=len(steps) * (engine.telemetry.get("kernels_per_decode_step") or 1),
                                       what="parts of the engine's steps")
        metrics = {
            "ms": wall_ms, "wall_s": wall_ms / 1e3, "output_tokens": out_tokens, "input_tokens": in_tokens,
            "output_tok_s": out_tokens / (wall_ms / 1e3), "total_tok_s": (out_tokens + in_tokens) / (wall_ms / 1e3),
            "predicted_output_tok_s": out_tokens / (prediction["predicted_ms"] / 1e3),
            "predicted_steps": len(steps), "engine_steps": engine.telemetry.get("steps", 0) - steps_before,
            "preemptions": engine.num_preemptions - preempted_before,
            "kv_capacity_tokens": engine.telemetry.get("kv_capacity_tokens"),
        }
        if prediction.get("calibrated"):
            metrics["calibrated_output_tok_s"] = out_tokens / (prediction["calibrated"]["predicted_ms"] / 1e3)
        return Result([row("lab-engine", identity, check=check, timing=timing, metrics=metrics, prediction=prediction)],
                      {"output_tok_s": metrics["output_tok_s"],
                       "pct_of_predicted": 100 * prediction["predicted_ms"] / wall_ms})
    finally:
        del engine
        release_memory(ctx)


def work(params) -> list[Work]:
    shape = shape_of(params)
    mid_in, mid_out = sum(params["input_tokens"]) // 2, sum(params["output_tokens"]) // 2
    steps = offline_steps(shape, [mid_in] * params["num_seqs"], [mid_out] * params["num_seqs"],
                          params["max_num_seqs"], MAX_BATCHED_TOKENS)
    return [Work(f"{params['num_seqs']} sequences, {mid_in} in / {mid_out} out (the mean lengths), summed totals",
                 sum(f for step in steps for f, _ in step), sum(b for step in steps for _, b in step), "bf16")]


EXERCISE = Exercise(
    id="phase5.offline",
    title="Offline throughput on nano-vllm's workload (256 sequences, lengths uniform in 100..1024)",
    run=run,
    needs=Needs(modules=("safetensors",)),
    params={**COMMON,
            "num_seqs": Int(256, min=1, max=4096, unit="sequences"),
            "input_tokens": LENGTH_RANGE, "output_tokens": LENGTH_RANGE},
    cpu_params={**CPU_COMMON, "num_seqs": 8, "input_tokens": [4, 24], "output_tokens": [4, 16]},
    quick_params={"num_seqs": 4, "input_tokens": [4, 12], "output_tokens": [2, 8]},
    footprint_bytes=weights_footprint_bytes, cpu_footprint_bytes=cpu_weights_footprint_bytes,
    work=work,
)

if __name__ == "__main__":
    run_alone(EXERCISE, {})
