"""Exercise 5.x: best-of-n with a checker, on a task the lab's own model learns. The exercise trains a
small Llama (models/llama_training.py, phase 7's loop) on toy arithmetic ("a+b=" with `digits`-digit
numbers, models/arithmetic.py), then samples n answers to each held-out question through the
engine's n samples (engine/sample_groups.py) at temperature > 0: accuracy against n (pass@n: any
sample right, by the checker; and the majority vote) and cost against n (tok/s, wall time), each
level's decode step beside its roofline.

    lab run phase5.best_of_n [--param n=[1,4,16]] [--param digits=3]

The claim measured (the talk in shared/seeds/001_b29bfe611a5ae8f8.txt): below the ridge extra samples are
nearly free, so a small model sampled many times with a verifier buys accuracy for little time.
Sample i of question q draws from seed + q * MAX_N + i, and a seeded sample's tokens do not depend
on its batch, so the samples of a smaller n are the first ones of a larger n: pass@n never falls.
The prompts are shorter than a KV block, so here the samples share no blocks (each prefills its
few tokens); the cost is the decode steps'.
"""
import tempfile
import time
from pathlib import Path

from common.exercise import Exercise, Needs, Result, Work, row
from common.params import Float, Int
from common.standalone import run_alone
from common.timing import summarize

from .models import arithmetic
from .models.model_choice import release_memory
from .predictions import kernel_lists
from .predictions.analysis import decode_parts, mean_decode_context
from .predictions.host_step import host_steps_us
from .predictions.prediction import summed_prediction

MAX_N = 1024                    # samples per question at most: the seeds of two questions never meet
BLOCK_SIZE = 16
KV_BLOCKS_PER_SEQ = 4           # a question and its answer fill one or two blocks; more blocks are idle host state


def model_shape(params):
    return arithmetic.arithmetic_llama(f"arithmetic-{params['hidden']}x{params['layers']}", params["hidden"],
                                       params["layers"], params["heads"], params["hidden"] // params["heads"],
                                       params["heads"])


def train(ctx, params, shape, train_ids, val_ids, folder: Path) -> dict:
    """Train the model and write its checkpoint (bf16 on a GPU, fp32 on a CPU) for the engine."""
    import torch

    from .models.llama_training import TrainSettings, save_checkpoint, train_llama
    settings = TrainSettings(steps=params["train_steps"], batch_size=params["batch_size"], seq_len=64,
                             lr=params["lr"], warmup_steps=max(1, params["train_steps"] // 20), seed=params["seed"])
    model, info = train_llama(shape, train_ids, val_ids, settings, ctx.device)
    save_checkpoint(model, shape, folder, dtype=torch.bfloat16 if ctx.is_cuda else torch.float32)
    del model
    return info


def answer_all(engine, questions, n: int, sampling, seed: int) -> dict:
    """Every question's n samples at once: their tokens per question, wall time, decode step times."""
    import dataclasses

    decode_ms = []
    start = time.perf_counter()
    groups = [engine.add_samples(arithmetic.prompt_ids(a, b), dataclasses.replace(sampling, seed=seed + q * MAX_N), n)
              for q, (a, b) in enumerate(questions)]
    tokens = {rid: [] for ids in groups for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if engine.last_step.get("kind") == "decode":
            decode_ms.append(engine.last_step["ms"])
    return {"samples": [[tokens[rid] for rid in ids] for ids in groups], "wall_s": time.perf_counter() - start,
            "decode_ms": decode_ms}


def check_samples(samples: list[list[list[int]]], max_tokens: int) -> dict:
    """What the checker needs to be fair: every sample came back, with 1..max_tokens ids of the vocabulary."""
    bad = [(q, i) for q, per in enumerate(samples) for i, s in enumerate(per)
           if not 1 <= len(s) <= max_tokens or any(not 0 <= t < arithmetic.VOCAB_SIZE for t in s)]
    reason = None if not bad else f"question {bad[0][0]} sample {bad[0][1]}: no answer or an id outside the vocabulary"
    return {"passed": not bad, "reason": reason, "reference": "every sample answered within max_tokens, ids in the vocabulary"}


def level_row(ctx, shape, variant: str, identity: dict, n: int, run: dict, dtype: str, launches: int,
              max_num_seqs: int, prompt_len: float, questions) -> dict:
    grades = [arithmetic.grade(a, b, per) for (a, b), per in zip(questions, run["samples"])]
    samples = sum(len(per) for per in run["samples"])
    output_tokens = sum(len(s) for per in run["samples"] for s in per)
    step_ms = run["decode_ms"] or [run["wall_s"] * 1e3]
    timing = summarize(step_ms, "the engine's decode steps over the run (LLMEngine.last_step ms)", warmup_calls=1,
                       flush_l2=False)
    batch = min(len(questions) * n, max_num_seqs)
    context = prompt_len + identity["max_tokens"] / 2
    prediction = summed_prediction(ctx, decode_parts(shape, batch, context), dtype, timing.median_ms, launches=launches,
                                   what=f"parts of a decode step at batch {batch} (weight matmuls, attention)")
    metrics = {"ms": timing.median_ms, "pass_at_n": sum(g["pass"] for g in grades) / len(grades),
               "majority_accuracy": sum(g["majority"] for g in grades) / len(grades),
               "sample_accuracy": sum(g["correct"] for g in grades) / samples,
               "questions": len(grades), "samples": samples, "output_tokens": output_tokens,
               "wall_s": run["wall_s"], "wall_ms_per_question": run["wall_s"] * 1e3 / len(grades),
               "output_tok_s": output_tokens / run["wall_s"], "decode_steps": len(run["decode_ms"]),
               "decode_batch": batch, "predicted_step_ms": prediction["predicted_ms"]}
    return row(variant, {**identity, "n": n}, check=check_samples(run["samples"], identity["max_tokens"]),
               timing=timing, metrics=metrics, prediction=prediction)


def run(ctx, params):
    from .engine import EngineConfig, LLMEngine, SamplingParams

    shape = model_shape(params)
    questions, train_ids, val_ids = arithmetic.split(params["digits"], params["questions"], params["train_lines"],
                                                     params["train_lines"] // 20 + 100, params["seed"])
    dtype = "bf16" if ctx.is_cuda else "fp32"
    max_tokens = params["digits"] + 2                      # the sum's digits (one more at most) and the newline
    with tempfile.TemporaryDirectory(prefix="lab-arithmetic-") as folder:
        info = train(ctx, params, shape, train_ids, val_ids, Path(folder))
        engine = LLMEngine(EngineConfig(model=folder, dtype="bfloat16" if ctx.is_cuda else "float32",
                                        device=ctx.device.type, seed=params["seed"], block_size=BLOCK_SIZE,
                                        max_model_len=arithmetic.MAX_POSITIONS, max_num_seqs=params["max_num_seqs"],
                                        num_kv_blocks=KV_BLOCKS_PER_SEQ * params["max_num_seqs"] + arithmetic.MAX_POSITIONS // BLOCK_SIZE))
    try:
        identity = {"model": shape.name, "params": info["params"], "digits": params["digits"],
                    "temperature": params["temperature"], "max_tokens": max_tokens, "dtype": dtype}
        launches = engine.telemetry.get("kernels_per_decode_step") or 1
        prompt_len = sum(len(arithmetic.prompt_ids(a, b)) for a, b in questions) / len(questions)
        # the host's scheduler step at each level's batch, on this CPU, before any timed row (a ceiling)
        batches = sorted({min(len(questions) * n, params["max_num_seqs"]) for n in [1, *params["n"]]})
        host_us = host_steps_us(batches, round(mean_decode_context(prompt_len, max_tokens)))
        answer_all(engine, questions[:2], 2, SamplingParams(max_tokens=2, ignore_eos=True), 0)     # warm up
        greedy = answer_all(engine, questions, 1, SamplingParams(max_tokens=max_tokens), params["seed"])
        rows = [level_row(ctx, shape, "greedy", {**identity, "temperature": 0.0}, 1, greedy, dtype, launches,
                          params["max_num_seqs"], prompt_len, questions)]
        sampling = SamplingParams(max_tokens=max_tokens, temperature=params["temperature"])
        for n in ctx.track(params["n"], "samples per question"):
            result = answer_all(engine, questions, n, sampling, params["seed"])
            rows.append(level_row(ctx, shape, "sampled", identity, n, result, dtype, launches, params["max_num_seqs"],
                                  prompt_len, questions))
        for r in rows:
            if not r["check"]["passed"]:
                r.update(status="failed", reason=r["check"]["reason"], timing=None, metrics={}, prediction=None)
        summary = {"train_s": info["train_s"], "train_steps": info["steps"], "val_loss": info["val_loss"],
                   "params": info["params"], "held_out_questions": len(questions),
                   "greedy_accuracy": rows[0]["metrics"].get("pass_at_n"), "host_step_us": host_us,
                   "sampler_draw": engine.runner.sampler.DRAW}
        sampled = [r for r in rows[1:] if r["status"] == "ok"]
        if sampled:
            best = max(sampled, key=lambda r: r["metrics"]["pass_at_n"])
            one = next((r for r in sampled if r["params"]["n"] == 1), None)
            summary.update(best_pass_at_n=best["metrics"]["pass_at_n"], best_n=best["params"]["n"])
            if one:
                for r in sampled:
                    r["metrics"]["wall_vs_1"] = r["metrics"]["wall_s"] / one["metrics"]["wall_s"]
        return Result(rows, summary)
    finally:
        del engine
        release_memory(ctx)


TRAIN_BYTES_PER_PARAM = 16          # fp32 weights, gradients and AdamW's two moments
ACTIVATION_BYTES_PER_TOKEN_WIDTH = 40    # per layer, a token's saved activations in units of the width (generous)


def footprint_bytes(params) -> float:
    """Training's peak: the fp32 weights, gradients and optimizer state, and a batch's activations
    and logits (the engine after it sizes its KV pool to what is free)."""
    shape = model_shape(params)
    tokens = params["batch_size"] * 64
    return (TRAIN_BYTES_PER_PARAM * shape.params()
            + tokens * (ACTIVATION_BYTES_PER_TOKEN_WIDTH * shape.hidden_size * shape.num_hidden_layers
                        + 3 * 4 * shape.vocab_size))


def work(params) -> list[Work]:
    """Each n's decode step (all questions' samples in flight, up to max_num_seqs)."""
    shape = model_shape(params)
    context = 2 * params["digits"] + 3 + (params["digits"] + 2) / 2
    out = []
    for n in params["n"]:
        batch = min(params["questions"] * n, params["max_num_seqs"])
        (mm_flops, mm_bytes), (att_flops, att_bytes) = decode_parts(shape, batch, context)
        out.append(Work(f"n {n}: the decode step's weight matmuls at batch {batch}", mm_flops, mm_bytes, "bf16"))
        out.append(Work(f"n {n}: its attention", att_flops, att_bytes, "bf16"))
    return out


EXERCISE = Exercise(
    id="phase5.best_of_n",
    title="Best-of-n with a checker: a model the lab trains on toy arithmetic, accuracy and cost against n",
    run=run,
    needs=Needs(modules=("safetensors",)),
    params={"n": Int([1, 2, 4, 8, 16, 32, 64], min=1, max=MAX_N, many=True, unit="samples per question"),
            "digits": Int(2, min=1, max=4, unit="digits of each addend"),
            "questions": Int(64, min=1, max=4096, unit="held-out questions"),
            "temperature": Float(1.0, min=0.05, max=2.0, help="sampling temperature of the n samples"),
            "train_steps": Int(2000, min=1, max=100_000, unit="training steps"),
            "train_lines": Int(200_000, min=100, max=10_000_000, unit="training lines (a+b=c)"),
            "batch_size": Int(128, min=1, max=4096, unit="training windows per step"),
            "lr": Float(2e-3, min=1e-6, max=1.0, help="peak learning rate"),
            "hidden": Int(256, min=32, max=4096, choices=(32, 64, 128, 256, 384, 512, 768, 1024), unit="model width"),
            "layers": Int(4, min=1, max=48, unit="transformer layers"),
            "heads": Int(4, min=1, max=64, choices=(1, 2, 4, 8), unit="attention heads (head_dim = hidden / heads)"),
            "max_num_seqs": Int(256, min=1, max=1024, unit="sequences per engine step"),
            "seed": Int(0, min=0, max=2**31 - 1, help="seed of the data, the training and the samples")},
    cpu_params={"n": [1, 2, 4], "digits": 1, "questions": 8, "train_steps": 40, "train_lines": 2000,
                "batch_size": 16, "hidden": 64, "layers": 1, "heads": 2},
    quick_params={"n": [1, 4], "digits": 1, "questions": 4, "train_steps": 10, "train_lines": 500, "batch_size": 8,
                  "hidden": 32, "layers": 1, "heads": 1},
    footprint_bytes=footprint_bytes, cpu_footprint_bytes=footprint_bytes,
    work=work,
    workloads=kernel_lists.best_of_n_workloads,
)

if __name__ == "__main__":
    run_alone(EXERCISE, {})
