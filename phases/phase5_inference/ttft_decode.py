"""Exercise 5.3: time to first token and decode speed, the seed's method: a ~100-token prompt, 200
output tokens, temperature 0, streamed; one warmup, then `runs` requests one at a time. The warmup
is the server's first request: its TTFT is recorded on the prefill row beside the steady state's,
with the engine's own prefill step in each and the start-up's graph capture, to say why they differ.

    lab run phase5.ttft_decode [--param models=[llama-3.1-8b]]

Three ways to decode the same weights, in the same run:
  lab-engine       the lab's server (paged KV cache, CUDA graphs), measured by the streaming client
  pytorch-eager    plain PyTorch: a static KV cache, one token at a time (baseline.py)
  pytorch-compile  the same under torch.compile(mode="reduce-overhead"): gpt-fast's recipe
A decode step reads every weight once plus the cached K and V, so the roofline of batch-1 decode is
those bytes over the copy bandwidth measured in this run; each row says how close it came. The
lab-engine row also compares the client's TPOT with the engine's own step time (serving overhead).
The 70B shape runs only where its 141 GB of weights fit; its row says how much KV cache is left.

Correctness gates timing: the engine's greedy tokens are checked against the plain model in fp32,
teacher-forced: at every step the token the engine chose must score within a tolerance of the fp32
model's best logit, the tolerance being 3x what the plain model in bf16 strays on the same
positions (bit-identical argmax cannot be asked of two bf16 implementations: random weights make
near-ties, and rounding picks among them).
"""
import gc
import statistics

import torch

from common.exercise import Exercise, Needs, Result, Work, measure_copy_gbps, row
from common.params import Bool, Choice, Float, Int
from common.standalone import run_alone
from common.timing import summarize

from .benchmark import serving
from .predictions.analysis import decode_parts, decode_step_bytes, mean_decode_context, prefill_bytes, prefill_flops
from .engine import SHAPES
from .predictions import kernel_lists
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
from .benchmark.workload import random_prompts

GIB = 2**30
NOISE_MARGIN = 3.0             # the engine may stray from the fp32 model 3x as far as the plain bf16 model does
TOLERANCE_FLOOR = 1e-3         # an fp32 run: only summation order separates the two implementations


def decode_row(ctx, variant: str, identity: dict, shape, tpot_runs_ms: list[float], ttft_runs_ms: list[float],
               copy_gbps: float, check: dict, graphed: bool, extra: dict | None = None, tokens: int = 200) -> dict:
    """One decode row: TPOT per run (the timing), bandwidth achieved, % of the copy roofline."""
    context = mean_decode_context(identity["prompt_tokens"], identity["output_tokens"])
    nbytes = decode_step_bytes(shape, 1, context)
    timing = summarize(tpot_runs_ms, "streamed inter-token time per run (TPOT), median of runs", warmup_calls=1,
                       flush_l2=False, graph_reps=tokens if graphed else None)
    tpot = timing.median_ms
    roofline_ms = nbytes / (copy_gbps * 1e6)
    metrics = {
        "ms": tpot, "tpot_ms": tpot, "decode_tok_s": 1e3 / tpot, "gbps": nbytes / (tpot * 1e6),
        "copy_gbps": copy_gbps, "pct_of_copy_roofline": 100 * roofline_ms / tpot, "copy_roofline_ms": roofline_ms,
        "ttft_p50_ms": statistics.median(ttft_runs_ms) if ttft_runs_ms else None,
        "ttft_mean_ms": statistics.fmean(ttft_runs_ms) if ttft_runs_ms else None,
        "bytes_per_token": nbytes, **(extra or {})}
    prediction = summed_prediction(ctx, decode_parts(shape, 1, context), identity["dtype"], tpot,
                                   launches=(extra or {}).get("kernels_per_step") or 1, graphed=graphed,
                                   what="parts of a decode step (weight matmuls, attention)")
    return row(variant, identity, check=check, timing=timing, metrics=metrics, prediction=prediction)


def first_request_metrics(first: dict, steady_ttfts_ms: list[float], steady_stats: dict, telemetry: dict) -> dict:
    """The server's first request beside the steady state: its TTFT and TPOT, the
    engine's own prefill step in each, the start-up's CUDA-graph capture (done before any request),
    and why they differ, in words built from those numbers: what the engine's prefill step adds
    (first use of its kernels: Triton and cuBLAS selection and loading, the allocator's first
    growth) and what lies outside the step (server, tokenizer, the client's first connection)."""
    steady_ttft = statistics.median(steady_ttfts_ms)
    first_ttft = first.get("ttft_ms")
    first_step = ((first.get("engine_stats") or {}).get("prefill_step_ms") or {}).get("median")
    steady_step = (steady_stats.get("prefill_step_ms") or {}).get("median")
    capture_s = telemetry.get("graph_capture_s")
    out = {"first_request_ttft_ms": first_ttft, "first_request_tpot_ms": first.get("tpot_ms"),
           "first_over_steady_ttft": first_ttft / steady_ttft if first_ttft else None,
           "first_engine_prefill_step_ms": first_step, "steady_engine_prefill_step_ms": steady_step,
           "graph_capture_s": capture_s, "startup_s": telemetry.get("startup_s")}
    if first_ttft is None:
        return out
    excess = first_ttft - steady_ttft
    why = [f"first request TTFT {first_ttft:.1f} ms against {steady_ttft:.1f} ms steady ({excess:+.1f} ms)"]
    why.append(f"CUDA graphs were captured at start-up ({capture_s:.2f} s, before any request), so it does not pay "
               "for them" if capture_s else "no CUDA graphs were captured (none on this device)")
    if first_step is not None and steady_step is not None:
        step_excess = first_step - steady_step
        why.append(f"the engine's prefill step took {first_step:.1f} ms against {steady_step:.1f} ms "
                   f"({step_excess:+.1f} ms: the first prefill of this shape, its kernels' selection and loading and "
                   "its allocations, which start-up did not warm)")
        why.append(f"{excess - step_excess:+.1f} ms lies outside the engine step (server, tokenizer, first connection)")
    out["first_request_why"] = "; ".join(why)
    return out


def prefill_row(ctx, identity: dict, shape, ttft_runs_ms: list[float], check: dict, extra: dict | None = None) -> dict:
    """TTFT as the client sees it, against the prefill's roofline (weights once, prompt FLOPs);
    `extra`: the first request beside it (first_request_metrics)."""
    p = identity["prompt_tokens"]
    timing = summarize(ttft_runs_ms, "streamed time to first token per run", warmup_calls=1, flush_l2=False)
    prediction = ctx.predict(prefill_flops(shape, p), prefill_bytes(shape, p), identity["dtype"], timing,
                             measured_ms=timing.median_ms)
    return row("lab-engine-prefill", {**identity, "stage": "prefill"}, check=check, timing=timing,
               metrics={"ms": timing.median_ms, "ttft_p50_ms": timing.median_ms, "ttft_p99_ms": timing.max_ms,
                        "tflops": prefill_flops(shape, p) / (timing.median_ms * 1e9), **(extra or {})},
               prediction=prediction)


def teacher_forced_logits(plain, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The plain model's fp32 logits at every position where the engine chose a token, fed the
    engine's own tokens: [len(tokens), vocab]."""
    with torch.no_grad():
        return plain.prefill_logits(prompt + tokens[:-1])[0, len(prompt) - 1:].float()


def gaps_below_best(truth: torch.Tensor, tokens) -> torch.Tensor:
    """How far below the reference's best logit each chosen token scores (0 where it is the best)."""
    tokens = torch.as_tensor(tokens, device=truth.device)
    return truth.max(dim=1).values - truth.gather(1, tokens[:, None]).squeeze(1)


def teacher_forced_check(truth: torch.Tensor, tokens: list[int], tolerance: float, noise: dict | None = None) -> dict:
    """Every token the engine chose scores within `tolerance` of the reference's best logit.
    `truth`: teacher_forced_logits of the reference (the fp32 model on the same weights)."""
    gap = gaps_below_best(truth, tokens)
    worst = float(gap.max()) if len(tokens) else float("inf")
    passed = worst <= tolerance
    return {"passed": passed, "reference": "the plain Llama in fp32 on the same weights, teacher-forced on the engine's "
                                           "tokens; tolerance: 3x the largest gap of the plain model in the run's "
                                           "precision on the same positions (its own rounding noise)",
            "max_logit_gap": worst, "tolerance": tolerance, "tokens_checked": len(tokens),
            "argmax_agreement": float((gap == 0).float().mean()), **(noise or {}),
            "reason": None if passed else f"the engine's token scores {worst:.3g} below the reference's best logit "
                                          f"(tolerance {tolerance:.3g})"}


def engine_check(plain, weights: dict, shape, prompt: list[int], tokens: list[int], device) -> dict:
    """The engine's greedy tokens against the fp32 model, with the tolerance the plain model in the
    run's precision earns on the same positions: a correct bf16 implementation picks near-ties
    differently (random weights make many), a wrong one (RoPE, cache, masking) scores far below."""
    from .benchmark.baseline import PlainLlama

    same_precision = teacher_forced_logits(plain, prompt, tokens)
    if plain.dtype == torch.float32:
        truth = same_precision
    else:
        reference = PlainLlama(shape, max_seq_len=len(prompt) + len(tokens) + 8, dtype=torch.float32, device=device)
        reference.load({k: v.float() for k, v in weights.items()})
        truth = teacher_forced_logits(reference, prompt, tokens)
        del reference
        gc.collect()
    own = gaps_below_best(truth, same_precision.argmax(dim=1))
    noise = {"plain_max_logit_gap": float(own.max()), "plain_argmax_agreement": float((own == 0).float().mean())}
    tolerance = max(TOLERANCE_FLOOR, NOISE_MARGIN * noise["plain_max_logit_gap"])
    return teacher_forced_check(truth, tokens, tolerance, noise)


def engine_rows(ctx, params, model: str, shape, prompt, copy_gbps, dtype) -> tuple[list[dict], list[int] | None]:
    total = torch.cuda.get_device_properties(ctx.device).total_memory if ctx.is_cuda else None
    utilization = params["gpu_memory_utilization"]
    if total and shape.weight_bytes() > utilization * total:
        utilization = params["large_model_utilization"]
    identity = {"model": shape.name, "prompt_tokens": len(prompt), "output_tokens": params["output_tokens"],
                "runs": params["runs"], "dtype": dtype, "gpu_memory_utilization": utilization}
    if total and shape.weight_bytes() > utilization * total:
        return [row("lab-engine", identity, "skipped",
                    f"{shape.weight_bytes() / GIB:.1f} GiB of bf16 weights exceed {utilization:.2f} x this GPU's "
                    f"{total / GIB:.1f} GiB: no room for a KV cache")], None
    settings = engine_settings(params, model, gpu_memory_utilization=utilization, dtype=serving.dtype_name(ctx),
                               device=ctx.device.type, max_model_len=len(prompt) + params["output_tokens"] + 64)
    with serving.lab_server(settings) as server:
        result = serving.sequential_runs(server, prompt, params["output_tokens"], params["runs"])
        tokens = serving.greedy_token_ids(server, prompt, params["output_tokens"])
    if not result["check"]["passed"]:
        return [row("lab-engine", identity, "failed", result["check"]["reason"], check=result["check"])], None
    tpots, ttfts = result["tpot_ms"], result["ttft_ms"]
    telemetry = result["engine_stats"].get("telemetry") or {}      # the client's stats read of the same run
    engine_step_ms = result["metrics"]["engine_decode_step_ms"]
    extra = {"engine_step_ms": engine_step_ms,
             "serving_overhead": statistics.median(tpots) / engine_step_ms if engine_step_ms else None,
             "kv_capacity_tokens": telemetry.get("kv_capacity_tokens"),
             "kv_pool_gib": (telemetry.get("kv_pool_bytes") or 0) / GIB,
             "weights_gib": (telemetry.get("weights_bytes") or 0) / GIB,
             "kernels_per_step": telemetry.get("kernels_per_decode_step"),
             "ttft_p99_ms": result["metrics"]["ttft_p99_ms"]}
    pending = {"passed": True, "reference": "checked against the plain model below", "reason": None}
    return [decode_row(ctx, "lab-engine", identity, shape, tpots, ttfts, copy_gbps, pending, graphed=True, extra=extra,
                       tokens=params["output_tokens"]),
            prefill_row(ctx, identity, shape, ttfts, pending,
                        first_request_metrics(result["first"], ttfts, result["engine_stats"], telemetry))], tokens


def plain_rows(ctx, params, model: str, shape, prompt, copy_gbps, dtype, engine_tokens) -> tuple[list[dict], dict]:
    from .benchmark.baseline import PlainLlama
    from .engine import weights_for

    identity = {"model": shape.name, "prompt_tokens": len(prompt), "output_tokens": params["output_tokens"],
                "runs": params["runs"], "dtype": dtype}
    _, weights = weights_for(model, params["seed"], dtype=serving.torch_dtype(ctx), device=ctx.device)
    plain = PlainLlama(shape, max_seq_len=len(prompt) + params["output_tokens"] + 8, dtype=serving.torch_dtype(ctx),
                       device=ctx.device)
    plain.load(weights)
    check = (engine_check(plain, weights, shape, prompt, engine_tokens, ctx.device) if engine_tokens
             else {"passed": True, "reference": "no engine tokens to check", "reason": None})
    rows = []
    for variant, mode in (("pytorch-eager", "eager"), ("pytorch-compile", "compile")):
        if not ctx.wants(variant) or (mode == "compile" and not params["compile"]):
            continue
        results = [plain.generate(prompt, params["output_tokens"], mode=mode) for _ in range(params["runs"] + 1)]
        own_tokens = [int(t) for t in results[0][0]]
        timings = [t for _, t in results[1:]]
        tpots = [t["decode_ms_mean"] for t in timings]
        ttfts = [t["prefill_ms"] for t in timings]
        extra = {"compile_s": results[0][1].get("compile_s"),
                 "agrees_with_engine_tokens": (sum(a == b for a, b in zip(own_tokens, engine_tokens or []))
                                               / max(1, len(engine_tokens or [])))}
        rows.append(decode_row(ctx, variant, identity, shape, tpots, ttfts, copy_gbps,
                               {"passed": True, "reference": "the plain model is the reference", "reason": None},
                               graphed=mode == "compile", extra=extra, tokens=params["output_tokens"]))
    del plain, weights
    release_memory(ctx)
    return rows, check


def run(ctx, params):
    dtype = "bf16" if ctx.is_cuda else "fp32"
    copy_gbps = measure_copy_gbps(ctx, 1 << 30) if ctx.is_cuda else measure_copy_gbps(ctx)
    rows, summary = [], {"copy_gbps": copy_gbps}
    for model in ctx.track(params["models"], "models"):
        shape = shape_of(params, model)
        prompt = random_prompts(1, params["prompt_tokens"], shape.vocab_size, params["seed"])[0]
        mine, tokens = engine_rows(ctx, params, model, shape, prompt, copy_gbps, dtype) if ctx.wants("lab-engine") \
            else ([], None)
        if model in params["baseline_models"]:
            plain, check = plain_rows(ctx, params, model, shape, prompt, copy_gbps, dtype, tokens)
            for r in mine:                            # the engine's rows stand or fall with the check
                if r["status"] == "ok":
                    r["check"] = check
                    if not check["passed"]:
                        r.update(status="failed", reason=check["reason"], timing=None, metrics={}, prediction=None)
            mine += plain
        rows += mine
    by = {(r["variant"], r["params"]["model"]): r["metrics"] for r in rows if r["status"] == "ok"}
    for (variant, model), m in by.items():
        base = by.get(("pytorch-compile", model))
        if variant == "lab-engine" and base:
            m["speedup_vs_compile"] = base["tpot_ms"] / m["tpot_ms"]
    return Result(rows, summary)


def work(params) -> list[Work]:
    out = []
    for model in params["models"]:
        shape = shape_of(params, model)
        context = mean_decode_context(params["prompt_tokens"], params["output_tokens"])
        (mm_flops, mm_bytes), (att_flops, att_bytes) = decode_parts(shape, 1, context)
        out.append(Work(f"{shape.name}: a batch-1 decode step's weight matmuls", mm_flops, mm_bytes, "bf16"))
        out.append(Work(f"{shape.name}: its attention over {context:.0f} cached tokens", att_flops, att_bytes, "bf16"))
        out.append(Work(f"{shape.name}: prefill of {params['prompt_tokens']} tokens",
                        prefill_flops(shape, params["prompt_tokens"]), prefill_bytes(shape, params["prompt_tokens"]),
                        "bf16"))
    return out


EXERCISE = Exercise(
    id="phase5.ttft_decode",
    title="TTFT and batch-1 decode: the lab's engine against plain PyTorch (eager, torch.compile)",
    run=run,
    needs=Needs(modules=("aiohttp", "safetensors", "tokenizers")),
    variants=("lab-engine", "pytorch-eager", "pytorch-compile"),
    params={**COMMON,
            "models": Choice(["llama-3.1-8b", "llama-3.3-70b"], tuple(SHAPES), many=True),
            "baseline_models": Choice(["llama-3.1-8b"], tuple(SHAPES), many=True),
            "prompt_tokens": Int(100, min=1, max=32768, unit="tokens"),
            "output_tokens": Int(200, min=2, max=32768, unit="tokens"),
            "runs": Int(5, min=1, max=100, unit="timed requests after one warmup"),
            "compile": Bool(True, help="also time the torch.compile baseline (compiling takes a minute)"),
            "large_model_utilization": Float(0.98, min=0.05, max=0.99,
                                             help="utilization for a model whose weights exceed gpu_memory_utilization")},
    cpu_params={**CPU_COMMON, "models": ["tiny"], "baseline_models": ["tiny"], "prompt_tokens": 12,
                "output_tokens": 8, "runs": 2, "compile": False},
    quick_params={"prompt_tokens": 12, "output_tokens": 8, "runs": 2},
    footprint_bytes=lambda p: min(weights_footprint_bytes(p, [m]) for m in p["models"]),
    cpu_footprint_bytes=lambda p: cpu_weights_footprint_bytes(p, p["models"]),    # no model skips on a CPU
    work=work,
    workloads=lambda p: [w for m in p["models"]
                         for w in kernel_lists.ttft_workloads(shape_of(p, m), p["prompt_tokens"], p["output_tokens"])],
)

if __name__ == "__main__":
    run_alone(EXERCISE, {"models": ["tiny"], "baseline_models": ["tiny"]})
