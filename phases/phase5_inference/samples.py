"""Exercise 5.x: n samples of one prompt for the price of one. n = 1, 2, 4, ..., 256 samples of one
prompt through the engine's shared prefix (engine/sample_groups.py: the prompt is prefilled once, each
sample then recomputes only its tail): output tok/s and TPOT against n, beside the roofline's
prediction of each decode step and its ridge.

    lab run phase5.samples [--param n=[1,16]] [--param prompt_tokens=129]

The claim measured (after the talk in shared/seeds/001_b29bfe611a5ae8f8.txt): a decode step reads every weight
once whatever the batch, so below the ridge (peak FLOP/s over bandwidth, ~200 sequences for bf16 on
an H200) extra samples are nearly free: tok/s grows ~linearly with n while TPOT stays ~flat; only
each sample's attention over its context adds bytes. The goal (H200): 16 samples >= 12x the tok/s
of one at <= 1.2x its TPOT.

The default prompt is 8 blocks + 1 token, so each sample after the first recomputes one prompt token.
Samples draw from the engine's shared generator unless `seeded` (then sample i from seed + i, its own
stream: reproducible, at one noise draw per sample per step).
"""
import time

from common.exercise import Exercise, Needs, Result, Work, row
from common.params import Bool, Float, Int
from common.standalone import run_alone
from common.timing import summarize

from .benchmark.workload import random_prompts
from .models.model_choice import (
    COMMON,
    CPU_COMMON,
    cpu_weights_footprint_bytes,
    engine_settings,
    release_memory,
    shape_of,
    weights_footprint_bytes,
)
from .predictions import kernel_lists
from .predictions.analysis import decode_parts, mean_decode_context, ridge_batch
from .predictions.host_step import host_steps_us
from .predictions.prediction import summed_prediction

LEVELS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
GOAL_N, GOAL_X, GOAL_TPOT_RATIO = 16, 12.0, 1.2


def tail_tokens(prompt_tokens: int, block_size: int) -> int:
    """Prompt tokens each sample after the first recomputes: from its last token's block on."""
    return prompt_tokens - (prompt_tokens - 1) // block_size * block_size


def sample_n(engine, prompt: list[int], sampling, n: int) -> dict:
    """Run n samples of `prompt` to the end: each sample's tokens and the host's clock at each of
    them (when the engine hands them out, as a client would see them), the wall time, the decode
    steps' times and the prefill tokens the engine computed."""
    prefill_before = engine.telemetry["prefill_tokens"]
    decode_ms = []
    start = time.perf_counter()
    ids = engine.add_samples(prompt, sampling, n)
    tokens = {i: [] for i in ids}
    clocks = {i: [] for i in ids}
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        if engine.last_step.get("kind") == "decode":
            decode_ms.append(engine.last_step["ms"])
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
            clocks[out.request_id] += [now] * len(out.new_token_ids)
    wall_s = time.perf_counter() - start
    return {"tokens": [tokens[i] for i in ids], "clocks": [clocks[i] for i in ids], "wall_s": wall_s,
            "started_s": start, "decode_ms": decode_ms,
            "prefill_tokens": engine.telemetry["prefill_tokens"] - prefill_before}


def check_samples(run: dict, n: int, prompt_tokens: int, output_tokens: int, block_size: int, vocab: int) -> dict:
    """Every sample made exactly output_tokens ids in the vocabulary, and the prompt was prefilled
    once: the engine computed the prompt plus one tail per further sample, no more."""
    expected_prefill = prompt_tokens + (n - 1) * tail_tokens(prompt_tokens, block_size)
    short = [i for i, t in enumerate(run["tokens"]) if len(t) != output_tokens]
    bad = [i for i, t in enumerate(run["tokens"]) if any(not 0 <= x < vocab for x in t)]
    reason = None
    if short:
        reason = f"sample {short[0]} made {len(run['tokens'][short[0]])} tokens, asked {output_tokens}"
    elif bad:
        reason = f"sample {bad[0]} has a token id outside the vocabulary"
    elif run["prefill_tokens"] != expected_prefill:
        reason = (f"the engine prefilled {run['prefill_tokens']} tokens, {expected_prefill} expected "
                  f"(the prompt once, then a {tail_tokens(prompt_tokens, block_size)}-token tail per sample)")
    return {"passed": reason is None, "reason": reason, "prefill_tokens": run["prefill_tokens"],
            "expected_prefill_tokens": expected_prefill,
            "reference": "requested lengths, vocabulary range, prefill tokens of a shared prompt"}


def level_row(ctx, shape, n: int, run: dict, check: dict, identity: dict, dtype: str, launches: int) -> dict:
    """One n: tok/s over the whole run (prefill included), TPOT per sample, and the decode step's
    roofline at batch n beside the measured TPOT."""
    output_tokens = identity["output_tokens"]
    tpots = [(c[-1] - c[0]) * 1e3 / (len(c) - 1) for c in run["clocks"] if len(c) > 1]
    timing = summarize(tpots, "TPOT per sample: host clock from its first to its last token / (tokens - 1)",
                       warmup_calls=1, flush_l2=False, graph_reps=output_tokens)
    context = mean_decode_context(identity["prompt_tokens"], output_tokens)
    prediction = summed_prediction(ctx, decode_parts(shape, n, context), dtype, timing.median_ms, launches=launches,
                                   what="parts of a decode step at batch n (weight matmuls, attention)")
    total = n * output_tokens
    first_token_ms = (min(c[0] for c in run["clocks"]) - run["started_s"]) * 1e3
    metrics = {"ms": timing.median_ms, "tpot_median_ms": timing.median_ms, "output_tokens": total,
               "wall_s": run["wall_s"], "output_tok_s": total / run["wall_s"],
               "decode_tok_s": n * 1e3 / timing.median_ms, "ttft_ms": first_token_ms,
               "decode_step_median_ms": sorted(run["decode_ms"])[len(run["decode_ms"]) // 2] if run["decode_ms"] else None,
               "prefill_tokens": run["prefill_tokens"], "mean_decode_context": context,
               "predicted_tpot_ms": prediction["predicted_ms"],
               "predicted_decode_tok_s": n * 1e3 / prediction["predicted_ms"], "predicted_bound": prediction["bound"]}
    if prediction.get("calibrated"):
        metrics["calibrated_tpot_ms"] = prediction["calibrated"]["predicted_ms"]
    return row("lab-engine", {**identity, "n": n}, check=check, timing=timing, metrics=metrics, prediction=prediction)


def add_ratios(rows: list[dict], ridge: float | None) -> dict:
    """Each n against n = 1 of the same run, and the goal at n = 16."""
    ok = {r["params"]["n"]: r for r in rows if r["status"] == "ok"}
    summary: dict = {"ridge_batch_spec": ridge}
    one = ok.get(1)
    for n, r in ok.items():
        m = r["metrics"]
        m["below_ridge"] = None if ridge is None else n < ridge
        if one:
            m["x_output_tok_s_vs_1"] = m["output_tok_s"] / one["metrics"]["output_tok_s"]
            m["x_decode_tok_s_vs_1"] = m["decode_tok_s"] / one["metrics"]["decode_tok_s"]
            m["tpot_vs_1"] = m["tpot_median_ms"] / one["metrics"]["tpot_median_ms"]
            m["predicted_tpot_vs_1"] = m["predicted_tpot_ms"] / one["metrics"]["predicted_tpot_ms"]
    if one and GOAL_N in ok:
        m = ok[GOAL_N]["metrics"]
        summary.update({f"x_output_tok_s_at_{GOAL_N}": m["x_output_tok_s_vs_1"], f"tpot_vs_1_at_{GOAL_N}": m["tpot_vs_1"],
                        "goal": f"{GOAL_N} samples >= {GOAL_X:g}x the tok/s of one at <= {GOAL_TPOT_RATIO:g}x its TPOT",
                        "goal_met": m["x_output_tok_s_vs_1"] >= GOAL_X and m["tpot_vs_1"] <= GOAL_TPOT_RATIO})
    if ok:
        best = max(ok.values(), key=lambda r: r["metrics"]["output_tok_s"])
        summary.update(best_n=best["params"]["n"], best_output_tok_s=best["metrics"]["output_tok_s"])
    return summary


def run(ctx, params):
    from .engine import EngineConfig, LLMEngine, SamplingParams

    shape = shape_of(params)
    prompt_tokens, output_tokens, block_size = params["prompt_tokens"], params["output_tokens"], params["block_size"]
    dtype = "bf16" if ctx.is_cuda else "fp32"
    levels = params["n"]
    # the host's scheduler step at each n, on this CPU, before any timed row (a ceiling: kernel_lists)
    host_us = host_steps_us(levels, mean_decode_context(prompt_tokens, output_tokens))
    engine = LLMEngine(EngineConfig(**engine_settings(
        params, dtype="bfloat16" if ctx.is_cuda else "float32", device=ctx.device.type,
        max_num_seqs=max(params["max_num_seqs"], max(levels)),
        max_model_len=prompt_tokens + output_tokens + block_size)))
    try:
        prompt = random_prompts(1, prompt_tokens, shape.vocab_size, params["seed"])[0]
        sampling = SamplingParams(max_tokens=output_tokens, temperature=params["temperature"],
                                  seed=params["seed"] if params["seeded"] else None, ignore_eos=True)
        sample_n(engine, prompt, SamplingParams(max_tokens=4, ignore_eos=True), max(levels))   # warm up every batch size
        identity = {"model": shape.name, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
                    "temperature": params["temperature"], "seeded": params["seeded"], "dtype": dtype}
        launches = engine.telemetry.get("kernels_per_decode_step") or 1
        rows = []
        for n in ctx.track(levels, "samples per prompt"):
            ctx.synchronize()
            result = sample_n(engine, prompt, sampling, n)
            check = check_samples(result, n, prompt_tokens, output_tokens, block_size, shape.vocab_size)
            if not check["passed"]:
                rows.append(row("lab-engine", {**identity, "n": n}, "failed", check["reason"], check=check))
                continue
            rows.append(level_row(ctx, shape, n, result, check, identity, dtype, launches))
        roofs = ctx.roofs(dtype)
        peak = roofs.peak(dtype)
        ridge = ridge_batch(shape, roofs.bandwidth_gbps, peak) if peak else None
        return Result(rows, {**add_ratios(rows, ridge), "host_step_us": host_us,
                             "sampler_draw": engine.runner.sampler.DRAW})
    finally:
        del engine
        release_memory(ctx)


def work(params) -> list[Work]:
    """Each n's decode step, as its two parts (their rooflines add: see analysis.decode_parts)."""
    shape = shape_of(params)
    context = mean_decode_context(params["prompt_tokens"], params["output_tokens"])
    out = []
    for n in params["n"]:
        (mm_flops, mm_bytes), (att_flops, att_bytes) = decode_parts(shape, n, context)
        out.append(Work(f"n {n}: the decode step's weight matmuls", mm_flops, mm_bytes, "bf16"))
        out.append(Work(f"n {n}: its attention over {context:.0f} cached tokens a sample", att_flops, att_bytes, "bf16"))
    return out


EXERCISE = Exercise(
    id="phase5.samples",
    title="n samples of one prompt through its shared prefix: tok/s and TPOT against n, beside the ridge",
    run=run,
    needs=Needs(modules=("safetensors",)),
    params={**COMMON,
            "n": Int(LEVELS, min=1, max=1024, many=True, unit="samples of the prompt"),
            "prompt_tokens": Int(129, min=1, max=32768, unit="tokens"),
            "output_tokens": Int(128, min=2, max=32768, unit="tokens per sample"),
            "temperature": Float(1.0, min=0.0, max=2.0, help="sampling temperature (0: greedy, every sample alike)"),
            "seeded": Bool(False, help="each sample its own seeded generator (seed + i: reproducible, one noise "
                                       "draw per sample per step) rather than the engine's shared one (one draw)")},
    cpu_params={**CPU_COMMON, "n": [1, 2, 4], "prompt_tokens": 17, "output_tokens": 8},
    quick_params={"n": [1, 4], "prompt_tokens": 17, "output_tokens": 4},
    footprint_bytes=weights_footprint_bytes, cpu_footprint_bytes=cpu_weights_footprint_bytes,
    work=work,
    workloads=lambda p: kernel_lists.samples_workloads(shape_of(p), p["n"], p["prompt_tokens"], p["output_tokens"],
                                                       p["temperature"], p["seeded"]),
)

if __name__ == "__main__":
    run_alone(EXERCISE, {})
