"""Exercise 5.2: continuous batching. Concurrency 1, 2, 4, ..., 256 against the lab's server, each
request a ~100-token prompt and 200 output tokens: output tok/s, median TPOT, TTFT p50/p99 per level.

    lab run phase5.batching [--param concurrency=[1,8,64]] [--param base_url=http://host:8000]

The lesson, predicted before it is measured: a decode step reads every weight once whatever the
batch, so up to the ridge (peak FLOP/s over bandwidth, about 200 sequences for bf16 on an H200) more
concurrent requests cost almost nothing per step: throughput grows with the batch while TPOT stays
flat. Past the ridge a step is compute-bound and TPOT grows. Each level's row holds the roofline's
step time (TPOT) and throughput (analysis.serving_prediction: prefills plus decode steps).

`base_url` benchmarks any OpenAI-compatible server instead of starting the lab's (vllm serve,
another engine); `served_model` names its model; the prediction still uses `model`'s shape.
"""

from common.exercise import Exercise, Needs, Result, Work, row
from common.params import Int, Text
from common.standalone import run_alone
from common.timing import summarize

from .benchmark import serving
from .predictions.analysis import decode_parts, mean_decode_context, ridge_batch, serving_prediction
from .predictions.host_step import host_steps_us
from .predictions.prediction import summed_prediction
from .predictions import kernel_lists
from .models.model_choice import (
    COMMON,
    CPU_COMMON,
    cpu_weights_footprint_bytes,
    engine_settings,
    shape_of,
    weights_footprint_bytes,
)
from .benchmark.workload import random_prompts

MAX_BATCHED_TOKENS = 8192
LEVELS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def level_row(ctx, variant: str, shape, concurrency: int, result: dict, identity: dict, roofs_for_prediction) -> dict:
    """One concurrency level: the client's metrics, the step's roofline (TPOT), the run's throughput."""
    prompt_tokens, output_tokens = identity["prompt_tokens"], identity["output_tokens"]
    context = mean_decode_context(prompt_tokens, output_tokens)
    tpots = [r["tpot_ms"] for r in result["requests"] if r.get("tpot_ms")]
    timing = summarize(tpots, "TPOT per request, streamed by the client", warmup_calls=result.get("warmups", 0),
                       flush_l2=False, graph_reps=output_tokens)
    step = serving_prediction(shape, concurrency, prompt_tokens, output_tokens, *roofs_for_prediction("spec"),
                              MAX_BATCHED_TOKENS)
    prediction = summed_prediction(ctx, decode_parts(shape, concurrency, context), identity["dtype"], timing.median_ms,
                                   launches=result["engine_stats"] and (result["engine_stats"].get("telemetry") or {})
                                   .get("kernels_per_decode_step") or 1,
                                   what="parts of a decode step (weight matmuls, attention)")
    metrics = dict(result["metrics"])
    metrics.update({"ms": timing.median_ms, "predicted_output_tok_s": step["output_tok_s"],
                    "pct_of_predicted_tok_s": 100 * metrics["output_tok_s"] / step["output_tok_s"],
                    "predicted_bound": step["bound"], "mean_decode_context": context})
    calibrated = roofs_for_prediction("calibrated")
    if calibrated:
        cal = serving_prediction(shape, concurrency, prompt_tokens, output_tokens, *calibrated, MAX_BATCHED_TOKENS)
        metrics["calibrated_output_tok_s"] = cal["output_tok_s"]
        metrics["pct_of_calibrated_tok_s"] = 100 * metrics["output_tok_s"] / cal["output_tok_s"]
    return row(variant, {**identity, "concurrency": concurrency}, check=result["check"], timing=timing,
               metrics=metrics, prediction=prediction)


def roofs_lookup(ctx, dtype: str):
    """(bandwidth GB/s, peak TFLOP/s) from the spec sheet, or from this GPU's ceilings record."""
    def get(which: str):
        if which == "spec":
            roofs = ctx.roofs(dtype)
            return roofs.bandwidth_gbps, roofs.peak(dtype)
        c = ctx.ceilings()
        peak = (c or {}).get("matmul_tflops", {}).get(dtype)
        return (c["hbm_gbps"], peak) if c and peak else None
    return get


def add_ratios(rows: list[dict]) -> dict:
    """Each level against concurrency 1 of the same run: throughput multiple and TPOT ratio."""
    ok = {r["params"]["concurrency"]: r for r in rows if r["status"] == "ok"}
    one = ok.get(1)
    summary = {}
    if one:
        for c, r in ok.items():
            r["metrics"]["x_output_tok_s_vs_1"] = r["metrics"]["output_tok_s"] / one["metrics"]["output_tok_s"]
            r["metrics"]["tpot_vs_1"] = r["metrics"]["tpot_median_ms"] / one["metrics"]["tpot_median_ms"]
        if 8 in ok:
            summary.update(x_at_8=ok[8]["metrics"]["x_output_tok_s_vs_1"], tpot_ratio_at_8=ok[8]["metrics"]["tpot_vs_1"])
    if ok:
        best = max(ok.values(), key=lambda r: r["metrics"]["output_tok_s"])
        summary.update(best_concurrency=best["params"]["concurrency"], best_output_tok_s=best["metrics"]["output_tok_s"],
                       best_pct_of_predicted=best["metrics"]["pct_of_predicted_tok_s"])
    return summary


def sweep(ctx, params, server, shape, variant: str) -> list[dict]:
    dtype = serving.dtype_label(ctx)
    identity = {"model": shape.name, "prompt_tokens": params["prompt_tokens"], "output_tokens": params["output_tokens"],
                "dtype": dtype, "target": variant}
    roofs = roofs_lookup(ctx, dtype)
    rows = []
    for concurrency in ctx.track(params["concurrency"], f"{variant}: concurrency levels"):
        n = max(params["rounds"] * concurrency, params["min_requests"])
        prompts = random_prompts(n + concurrency, params["prompt_tokens"], shape.vocab_size, params["seed"] + concurrency)
        result = serving.load_test(server, prompts[concurrency:], params["output_tokens"], concurrency=concurrency,
                                   warmup_prompts=prompts[:min(concurrency, params["warmups"])])
        if not result["check"]["passed"]:
            rows.append(row(variant, {**identity, "concurrency": concurrency}, "failed", result["check"]["reason"],
                            check=result["check"]))
            continue
        rows.append(level_row(ctx, variant, shape, concurrency, result, identity, roofs))
    return rows


def run(ctx, params):
    shape = shape_of(params)
    if params["base_url"]:
        server = serving.external(params["base_url"], params["served_model"])
        rows = sweep(ctx, params, server, shape, "external")
    else:
        # the host's scheduler step at each level, on this CPU, before any timed row (a ceiling)
        host_us = host_steps_us(params["concurrency"], mean_decode_context(params["prompt_tokens"],
                                                                           params["output_tokens"]))
        settings = engine_settings(params, dtype=serving.dtype_name(ctx), device=ctx.device.type,
                                   max_num_batched_tokens=MAX_BATCHED_TOKENS,
                                   max_model_len=params["prompt_tokens"] + params["output_tokens"] + 64)
        with serving.lab_server(settings) as server:
            rows = sweep(ctx, params, server, shape, "lab-engine")
    summary = add_ratios(rows)
    if not params["base_url"]:
        summary["host_step_us"] = host_us
    roofs = ctx.roofs(serving.dtype_label(ctx))
    if roofs.peak(serving.dtype_label(ctx)):
        summary["ridge_batch_spec"] = ridge_batch(shape, roofs.bandwidth_gbps, roofs.peak(serving.dtype_label(ctx)))
    return Result(rows, summary)


def work(params) -> list[Work]:
    """Each level's decode step, as its two parts (their rooflines add: see analysis.decode_parts)."""
    shape = shape_of(params)
    context = mean_decode_context(params["prompt_tokens"], params["output_tokens"])
    out = []
    for c in params["concurrency"]:
        (mm_flops, mm_bytes), (att_flops, att_bytes) = decode_parts(shape, c, context)
        out.append(Work(f"concurrency {c}: the decode step's weight matmuls", mm_flops, mm_bytes, "bf16"))
        out.append(Work(f"concurrency {c}: its attention over {context:.0f} cached tokens a sequence", att_flops,
                        att_bytes, "bf16"))
    return out


EXERCISE = Exercise(
    id="phase5.batching",
    title="Continuous batching: throughput, TPOT and TTFT at concurrency 1..256",
    run=run,
    needs=Needs(modules=("aiohttp", "safetensors", "tokenizers")),
    params={**COMMON,
            "concurrency": Int(LEVELS, min=1, max=4096, many=True, unit="requests in flight"),
            "prompt_tokens": Int(100, min=1, max=32768, unit="tokens"),
            "output_tokens": Int(200, min=2, max=32768, unit="tokens"),
            "rounds": Int(2, min=1, max=100, unit="requests per level, in multiples of the concurrency"),
            "min_requests": Int(4, min=1, max=10000, unit="requests per level at least"),
            "warmups": Int(4, min=0, max=256, unit="requests before each level, excluded"),
            "base_url": Text(None, nullable=True, rule=serving.reachable,
                             help="benchmark this OpenAI-compatible server instead of starting the lab's"),
            "served_model": Text(None, nullable=True, help="the model name that server serves (default: its first)")},
    cpu_params={**CPU_COMMON, "concurrency": [1, 2, 4], "prompt_tokens": 12, "output_tokens": 8, "min_requests": 2,
                "warmups": 1},
    quick_params={"concurrency": [1, 4], "prompt_tokens": 12, "output_tokens": 8, "min_requests": 2, "warmups": 1},
    footprint_bytes=lambda p: 0 if p["base_url"] else weights_footprint_bytes(p),
    cpu_footprint_bytes=lambda p: 0 if p["base_url"] else cpu_weights_footprint_bytes(p),
    work=work,
    workloads=lambda p: kernel_lists.decode_workloads(shape_of(p), p["concurrency"], p["prompt_tokens"],
                                                      p["output_tokens"]),
)

if __name__ == "__main__":
    run_alone(EXERCISE, {})
