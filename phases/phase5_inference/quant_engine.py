"""Exercise 5.5: weight-only quantization inside the engine: the seed's table (bf16 against AWQ int4
through a naive and a fused kernel) reproduced with the lab's own kernels, and extended.

    lab run phase5.quant_engine [--param variants=...] [--param concurrency=[8,64]]

One engine per variant, each on the same seeded random weights (Llama-3.1-8B's shape); every
layer's four projections are quantized at load (engine/quantize.py), the embedding and LM head stay
bf16:
  bf16           no quantization: the baseline of every ratio
  int8_fused     int8 per output row, quant_gemm's Triton W8A16 kernels
  int4_naive     int4 group 128, each projection dequantized to bf16 in memory, then cuBLAS
  int4_fused     the same int4 weights, quant_gemm's Triton W4A16 kernels
  int4_cuda      the same int4 weights, int4_mma's CUDA kernel (what `lab serve --quantization int4` runs)
  int4_library   the same int4 weights in torch's tinygemm format (_weight_int4pack_mm)
Measured: the weights' size; batch-1 decode (the engine's step time per token, median over `runs`
requests of `output_tokens` tokens); and `concurrency` requests at once: the decode step time at
that batch, and output tokens per second over the whole run (prefills included).

Each row sits beside its roofline: a decode step reads every weight once, so its bytes are the
format's (quant_analysis.decode_weight_bytes: packed projections, bf16 rest) plus the KV cache;
a step is the sum of the weight matmuls' and the attention's rooflines (analysis.py's rule). The
naive path's own algorithm moves far more (a bf16 copy written and read back per projection):
its row is predicted for the format's bytes, which is the point: the method promises the bytes,
the implementation decides whether they are the ones moved.

Correctness gates timing: before an engine is timed, the projections of its first and last layer,
through the very modules (and path) the engine multiplies with, are checked against fp32
x @ dequantize(W)^T at batch 1 and 16 (bf16: against the bf16 weight).
"""
import statistics
import time

import torch

from common.errors import LabError
from common.exercise import Exercise, Needs, Result, Work, measure_copy_gbps, reference_check, row
from common.params import Int
from common.standalone import run_alone
from common.timing import summarize

from .predictions import quant_analysis as qa
from .predictions.analysis import mean_decode_context
from .predictions import kernel_lists
from .engine.quantize import GROUP_SIZES
from .models.model_choice import COMMON, engine_settings, release_memory, shape_of, weights_footprint_bytes
from .predictions.prediction import summed_prediction
from .benchmark.workload import random_prompts

GIB = 2**30
VARIANTS = ("bf16", "int8_fused", "int4_naive", "int4_fused", "int4_cuda", "int4_library")
REFERENCE = "fp32 x @ dequantize(W)^T through the engine's own projection modules (bf16: the bf16 weight)"
CHECK_BATCHES = (1, 16)


def format_of(variant: str) -> str:
    return variant.split("_")[0]


def variant_settings(variant: str, group_size: int) -> dict:
    if variant == "bf16":
        return {"quantization": "none"}
    fmt, path = variant.split("_")
    return {"quantization": fmt, "quant_path": path, "quant_group_size": group_size}


# ------------------------------------------------------------------------------ the gate
def projections_check(ctx, engine) -> dict:
    """The first and last layer's four projections, as the engine multiplies them, against fp32."""
    from .engine.fused_ops import linear
    model = engine.runner.model
    worst = None
    for layer in (model.layers[0], model.layers[-1]):
        for name in ("qkv", "o", "gate_up", "down"):
            weight = getattr(layer, name)
            quantized = not isinstance(weight, torch.Tensor)
            n, k = (weight.out_features, weight.in_features) if quantized else weight.shape
            dense = weight.weight_format.dequantize(torch.float32) if quantized else weight.float()
            for batch in CHECK_BATCHES:
                g = torch.Generator(device=ctx.device).manual_seed(batch * 7 + k)
                x = torch.randn(batch, k, device=ctx.device, generator=g).to(model.dtype)
                out = torch.empty(batch, n, dtype=model.dtype, device=ctx.device)
                verdict = reference_check(ctx, out, lambda: out.copy_(linear(x, weight)), x.float() @ dense.t(),
                                          REFERENCE, precision="bf16" if model.dtype == torch.bfloat16 else "fp32")()
                if not verdict["passed"]:
                    return {**verdict, "reason": f"{name} of layer {model.layers.index(layer)} at batch {batch}: "
                                                 f"{verdict['reason']}"}
                worst = verdict
    return worst


# ------------------------------------------------------------------------------ timing the engine
def decode_step_times_ms(engine, prompts: list[list[int]], output_tokens: int) -> tuple[list[float], float]:
    """Run these requests to the end, one engine step at a time; (each decode step's wall time in ms,
    the whole run's seconds). A step returns its tokens to the host, so its wall time is the time
    a client waits for it. Steps that prefill are left out of the decode times."""
    from .engine import SamplingParams
    sampling = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, sampling)
    decode_ms, start = [], time.perf_counter()
    while engine.has_unfinished():
        waiting = len(engine.scheduler.waiting)
        t0 = time.perf_counter()
        engine.step()
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        if not waiting:
            decode_ms.append(elapsed_ms)
    return decode_ms, time.perf_counter() - start


def variant_rows(ctx, params, variant: str, shape, copy_gbps: float) -> list[dict]:
    from .engine import EngineConfig, LLMEngine
    dtype = "bf16" if ctx.is_cuda else "fp32"
    fmt = format_of(variant)
    prompt_len, out_len = params["prompt_tokens"], params["output_tokens"]
    identity = {"model": shape.name, "format": fmt, "group_size": params["group_size"] if fmt == "int4" else None,
                "prompt_tokens": prompt_len, "output_tokens": out_len, "dtype": dtype}
    batches = [1] + list(params["concurrency"])
    settings = engine_settings(params, dtype="bfloat16" if ctx.is_cuda else "float32", device=ctx.device.type,
                               max_model_len=prompt_len + out_len + 16, max_num_seqs=max(batches),
                               **variant_settings(variant, params["group_size"]))
    try:
        engine = LLMEngine(EngineConfig(**settings))
    except LabError as exc:
        return [row(variant, {**identity, "batch": b}, "skipped", str(exc)) for b in batches]
    try:
        check = projections_check(ctx, engine)
        if not check["passed"]:
            return [row(variant, {**identity, "batch": b}, "failed", check["reason"], check=check) for b in batches]
        telemetry = engine.telemetry
        prompts = random_prompts(max(batches), prompt_len, shape.vocab_size, params["seed"])
        decode_step_times_ms(engine, prompts[:1], min(out_len, 8))                  # warm: first calls, allocator
        rows = []
        for batch in batches:
            runs = params["runs"] if batch == 1 else 1
            times, walls = [], []
            for r in range(runs):
                requests = [prompts[r % len(prompts)]] if batch == 1 else prompts[:batch]
                step_ms, wall_s = decode_step_times_ms(engine, requests, out_len)
                times.append(statistics.median(step_ms))
                walls.append(wall_s)
            rows.append(measured_row(ctx, variant, {**identity, "batch": batch}, shape, fmt, params, times,
                                     statistics.median(walls), telemetry, copy_gbps, check))
        return rows
    finally:
        del engine
        release_memory(ctx)


def measured_row(ctx, variant, identity, shape, fmt, params, step_ms_runs, wall_s, telemetry, copy_gbps, check):
    batch = identity["batch"]
    context = mean_decode_context(params["prompt_tokens"], params["output_tokens"])
    parts = qa.decode_parts(shape, fmt, batch, context, params["group_size"])
    step_bytes = sum(b for _, b in parts)
    timing = summarize(step_ms_runs, "engine decode step wall time (host-synchronous), median over steps, "
                                     "then over runs", warmup_calls=1, flush_l2=False)
    step_ms = timing.median_ms
    copy_roofline_ms = step_bytes / (copy_gbps * 1e6)
    metrics = {
        "ms": step_ms, "decode_step_ms": step_ms, "decode_tok_s": batch * 1e3 / step_ms,
        "output_tok_s": batch * params["output_tokens"] / wall_s,
        "weights_gib": telemetry["weights_bytes"] / GIB,
        "predicted_weights_gib": qa.model_bytes(shape, fmt, params["group_size"]) / GIB,
        "bytes_per_step": step_bytes, "bytes_per_token": step_bytes / batch,
        "gbps": step_bytes / (step_ms * 1e6), "copy_gbps": copy_gbps,
        "copy_roofline_ms": copy_roofline_ms, "pct_of_copy_roofline": 100 * copy_roofline_ms / step_ms,
        "kernels_per_step": telemetry.get("kernels_per_decode_step"),
        "quantization": telemetry.get("quantization")}
    prediction = summed_prediction(ctx, parts, identity["dtype"], step_ms,
                                   launches=telemetry.get("kernels_per_decode_step") or 1, graphed=ctx.is_cuda,
                                   what="parts of a decode step (weight matmuls in the format, attention)")
    return row(variant, identity, check=check, timing=timing, metrics=metrics, prediction=prediction)


def add_ratios(rows: list[dict]) -> None:
    """speedup_vs_bf16 at the same batch, from the same run."""
    base = {r["params"]["batch"]: r["metrics"] for r in rows if r["variant"] == "bf16" and r["status"] == "ok"}
    for r in rows:
        b = base.get(r["params"]["batch"])
        if r["status"] == "ok" and b:
            r["metrics"]["speedup_vs_bf16"] = b["decode_step_ms"] / r["metrics"]["decode_step_ms"]
            r["metrics"]["output_speedup_vs_bf16"] = r["metrics"]["output_tok_s"] / b["output_tok_s"]


def run(ctx, params):
    shape = shape_of(params)
    copy_gbps = measure_copy_gbps(ctx, 1 << 30) if ctx.is_cuda else measure_copy_gbps(ctx)
    rows = []
    for variant in ctx.track([v for v in VARIANTS if ctx.wants(v)], "variants"):
        rows += variant_rows(ctx, params, variant, shape, copy_gbps)
    add_ratios(rows)
    return Result(rows, {"copy_gbps": copy_gbps, "model": shape.name,
                         "bytes_convention": "per decode step: weights once (projections packed in the format, the "
                                             "rest bf16) + the KV cache of every sequence at the mean context"})


def work(params) -> list[Work]:
    shape = shape_of(params)
    context = mean_decode_context(params["prompt_tokens"], params["output_tokens"])
    out = []
    for fmt in ("bf16", "int8", "int4"):
        for batch in [1] + list(params["concurrency"]):
            (mm_flops, mm_bytes), (att_flops, att_bytes) = qa.decode_parts(shape, fmt, batch, context,
                                                                           params["group_size"])
            out.append(Work(f"{shape.name} {fmt} decode step at batch {batch}: weight matmuls", mm_flops, mm_bytes,
                            "bf16"))
            out.append(Work(f"{shape.name} {fmt} decode step at batch {batch}: attention", att_flops, att_bytes,
                            "bf16"))
    return out


EXERCISE = Exercise(
    id="phase5.quant_engine",
    title="Weight-only int8 and int4 inside the engine: model size, batch-1 decode and throughput at 8 and 64 "
          "requests, naive vs fused vs tinygemm, against bf16 and the roofline",
    run=run, needs=Needs(cuda=True, modules=("triton",)),
    variants=VARIANTS,
    params={**COMMON,
            "prompt_tokens": Int(100, min=1, max=4096, unit="tokens"),
            "output_tokens": Int(64, min=2, max=4096, unit="tokens per request"),
            "runs": Int(3, min=1, max=50, help="batch-1 requests timed (median)"),
            "concurrency": Int([8, 64], min=2, max=1024, many=True, unit="requests at once"),
            "group_size": Int(128, choices=GROUP_SIZES, unit="int4 inputs per (scale, zero)")},
    cpu_params={"model": "tiny", "output_tokens": 6, "runs": 1, "concurrency": [3]},
    quick_params={"output_tokens": 16, "runs": 1, "concurrency": [8]},
    footprint_bytes=lambda p: weights_footprint_bytes(p) * 1.6, work=work,
    workloads=lambda p: kernel_lists.quant_workloads(shape_of(p), [1, *p["concurrency"]], p["prompt_tokens"],
                                                     p["output_tokens"], p["group_size"]))


if __name__ == "__main__":
    run_alone(EXERCISE, {"concurrency": [8]})
