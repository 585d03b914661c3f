"""Exercise 5.x: a long prompt among running streams, and a prompt whose prefix is cached. Two of
issue 35's goals, each beside its roofline:

    lab run phase5.long_prompt [--param long_tokens=8000] [--param prefix_tokens=4000]

- itl_under_long_prompt: `streams` greedy decode streams run; one prompt of `long_tokens` arrives.
  The streams' inter-token latencies over the window from its arrival to its last token (its
  prefill, then `long_output_tokens` decode steps): median, p99, max, p99/median (and p99 over
  the median of the plain decode gaps before it arrived), and the long
  prompt's TTFT, with chunked prefill on (steps of at most `token_budget` tokens mixing the
  streams' decode rows with one chunk of the prompt) and off (the prompt's prefill is one step of
  its own: every stream waits for all of it). Goal: p99 <= 2x median with chunking on. Prediction:
  a decode step at batch `streams`, a mixed step (decode rows + a chunk of token_budget - streams
  tokens: compute-bound matmuls, attention over half the prompt on average) and the whole
  prefill; the ITL p99 the roofline expects is the mixed step's time (on), a prefill plus a decode
  step (off).
- shared_prefix_ttft: request A (`prefix_tokens`) to its end, then B (the same prefix plus
  `suffix_tokens`): TTFT of each with prefix caching on, B's with it off. Goal: TTFT(A)/TTFT(B)
  >= 5 with caching on. Prediction: a prefill of the whole prompt against one of the suffix only
  (its matmuls plus its attention over the cached prefix).

Correctness gates timing: the streams' greedy tokens with chunking on equal those with it off (and
the long prompt's), A's and B's tokens with caching on equal those with it off, and with caching on
B's prefix came from the cache. Equal except at a near-tie: in bf16 the two settings batch rows
into different shapes that round differently, which can swap two nearly tied best logits; such a
divergence is accepted only within greedy_near_tie's tolerance, measured at that position by
replaying the sequence under each setting (near_tie_replays), later tokens of that sequence are
not compared, and each row records how many sequences diverged so, at what margins, the noise
measured and the tolerance applied.

The chunked budget defaults to 2048 tokens (vLLM's default for online serving): at the engine's
8192 an 8,000-token prompt and 32 decode rows fit in one step, so nothing would be chunked.
"""
import math
import statistics
import time

from common.errors import LabError
from common.exercise import Exercise, Needs, Result, Work, row
from common.params import Choice, Int
from common.standalone import run_alone
from common.timing import summarize

from .benchmark.workload import random_prompts
from .greedy_near_tie import compare_greedy, tie_tolerance
from .models.model_choice import (
    COMMON,
    CPU_COMMON,
    cpu_weights_footprint_bytes,
    engine_settings,
    release_memory,
    shape_of,
    weights_footprint_bytes,
)
from .near_tie_replays import (
    cached_settings,
    chunk_tokens,
    chunked_settings,
    replay_length,
    replayers,
    unchunked_step_tokens,
)
from .predictions.analysis import decode_parts, prefill_bytes, prefill_flops
from .predictions.prediction import summed_prediction

GOAL_ITL_P99_OVER_MEDIAN = 2.0
GOAL_PREFIX_TTFT_X = 5.0
KINDS = ("itl_under_long_prompt", "shared_prefix_ttft")


def check_params(params) -> None:
    """LabError (exit 2, one line) for sizes the two kinds of rows cannot run with."""
    if params["token_budget"] <= params["streams"]:
        raise LabError(f"token_budget ({params['token_budget']}) must exceed streams ({params['streams']}): "
                       "a step holds every stream's decode row plus a chunk of the long prompt")
    if params["suffix_tokens"] >= params["prefix_tokens"]:
        raise LabError(f"suffix_tokens ({params['suffix_tokens']}) must be shorter than prefix_tokens "
                       f"({params['prefix_tokens']}): B is the prefix plus a short suffix")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


# ------------------------------------------------------------------ a long prompt among streams
def streams_with_long_prompt(engine, stream_prompts, long_prompt, params) -> dict:
    """Run the streams until each has `warm_tokens` tokens, add the long prompt, step until it is done,
    then stop the streams. Each stream's tokens and the host clock at each of them (when the engine
    hands it out), the long prompt's arrival clock, tokens and first token's clock."""
    from .engine import SamplingParams
    stream_sampling = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    ids = [engine.add_request(p, stream_sampling) for p in stream_prompts]
    tokens = {i: [] for i in ids}
    clocks = {i: [] for i in ids}
    long_id, arrived_s = None, None
    while True:
        for out in engine.step():
            now = time.perf_counter()
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            clocks.setdefault(out.request_id, []).extend([now] * len(out.new_token_ids))
        if long_id is None and min(len(tokens[i]) for i in ids) >= params["warm_tokens"]:
            arrived_s = time.perf_counter()
            long_id = engine.add_request(long_prompt, SamplingParams(max_tokens=params["long_output_tokens"],
                                                                     ignore_eos=True))
        if long_id is not None and len(tokens.get(long_id, [])) >= params["long_output_tokens"]:
            break
    for i in ids:
        engine.abort(i)
    while engine.has_unfinished():
        engine.step()
    engine.step()                           # reports the aborts
    return {"stream_tokens": [tokens[i] for i in ids], "stream_clocks": [clocks[i] for i in ids],
            "arrived_s": arrived_s, "long_tokens": tokens[long_id], "long_first_s": clocks[long_id][0],
            "long_last_s": clocks[long_id][-1]}


def window_itls_ms(run: dict) -> list[float]:
    """Every stream's gaps between consecutive tokens whose later token came after the long
    prompt arrived and no later than its last token: the stalls its prefill caused, then the
    decode steps that carry it."""
    gaps = []
    for clocks in run["stream_clocks"]:
        for before, after in zip(clocks, clocks[1:]):
            if run["arrived_s"] < after <= run["long_last_s"]:
                gaps.append((after - before) * 1e3)
    return gaps


def steady_itls_ms(run: dict) -> list[float]:
    """Every stream's gaps between consecutive tokens before the long prompt arrived: plain decode steps."""
    return [(after - before) * 1e3 for clocks in run["stream_clocks"]
            for before, after in zip(clocks, clocks[1:]) if after <= run["arrived_s"]]


def itl_sequences(on: dict, off: dict, stream_prompts: list, long_prompt: list[int]) -> list[dict]:
    """The streams and the long prompt as compare_greedy's sequences, chunking off the reference."""
    seqs = [{"name": f"stream {i}", "prompt": p, "reference": b, "other": a}
            for i, (p, a, b) in enumerate(zip(stream_prompts, on["stream_tokens"], off["stream_tokens"]))]
    return seqs + [{"name": "the long prompt", "prompt": long_prompt, "reference": off["long_tokens"],
                    "other": on["long_tokens"]}]


def itl_predictions(ctx, shape, params, dtype: str) -> dict:
    """Roofline blocks: a decode step at batch `streams`, a mixed step and the whole prefill."""
    streams, long_tokens = params["streams"], params["long_tokens"]
    context = params["stream_prompt_tokens"] + params["warm_tokens"]
    decode = decode_parts(shape, streams, context)
    chunk = min(params["token_budget"] - streams, long_tokens)
    chunk_context = long_tokens / 2                # a chunk's mean position in the prompt
    mixed = [((streams + chunk) * shape.flops_per_token(0), shape.decode_weight_bytes()),
             (chunk * (shape.flops_per_token(int(chunk_context)) - shape.flops_per_token(0)),
              chunk_context * shape.kv_bytes_per_token()),
             decode[1]]
    prefill = [(prefill_flops(shape, long_tokens), prefill_bytes(shape, long_tokens))]
    return {"decode": summed_prediction(ctx, decode, dtype, None, what="parts of a decode step"),
            "mixed": summed_prediction(ctx, mixed, dtype, None, what="parts of a mixed step (weights, "
                                       "the chunk's attention, the decode rows' attention)"),
            "prefill_then_decode": summed_prediction(ctx, prefill + decode, dtype, None,
                                                     what="steps: the whole prefill, then a decode step"),
            "chunk_tokens": chunk}


def near_tie_metrics(check: dict) -> dict:
    """How many sequences diverged at an accepted near-tie; per divergence its margin below the best
    logit, the rounding noise the two settings' replays measured there and the tolerance applied; the floor."""
    return {"near_tie_divergences": check["near_tie_divergences"],
            "near_tie_margins": [t["margin"] for t in check["near_ties"]],
            "near_tie_noises": [t["noise"] for t in check["near_ties"]],
            "near_tie_tolerances": [t["tolerance"] for t in check["near_ties"]],
            "near_tie_tolerance": check["near_tie_tolerance"]}


def itl_row(ctx, identity: dict, variant: str, run: dict, check: dict, predictions: dict, dtype: str) -> dict:
    gaps = window_itls_ms(run)
    if not gaps:
        return row(variant, identity, "failed", "no stream made a token inside the long prompt's window", check=check)
    timing = summarize(gaps, "the streams' inter-token gaps from the long prompt's arrival to its last token "
                             "(host clock when the engine hands each token out)", warmup_calls=0, flush_l2=False)
    median, p99 = statistics.median(gaps), percentile(gaps, 99)
    steady = steady_itls_ms(run)
    expected = predictions["mixed" if variant == "chunked" else "prefill_then_decode"]
    prediction = {**expected, "measured_ms": p99,
                  "measured_over_predicted": p99 / expected["predicted_ms"] if expected["predicted_ms"] else None}
    metrics = {"ms": p99, "itl_median_ms": median, "itl_p99_ms": p99, "itl_max_ms": max(gaps),
               "itl_p99_over_median": p99 / median, "itl_count": len(gaps),
               "steady_itl_median_ms": statistics.median(steady) if steady else None,
               "itl_p99_over_steady_median": p99 / statistics.median(steady) if steady else None,
               "long_ttft_ms": (run["long_first_s"] - run["arrived_s"]) * 1e3,
               "predicted_decode_step_ms": predictions["decode"]["predicted_ms"],
               "predicted_mixed_step_ms": predictions["mixed"]["predicted_ms"],
               "predicted_prefill_then_decode_ms": predictions["prefill_then_decode"]["predicted_ms"],
               "predicted_itl_p99_ms": expected["predicted_ms"],
               "predicted_itl_p99_over_decode_step": expected["predicted_ms"] / predictions["decode"]["predicted_ms"],
               "chunk_tokens": predictions["chunk_tokens"] if variant == "chunked" else identity["long_tokens"],
               **near_tie_metrics(check)}
    if variant == "chunked":
        metrics["goal_met"] = metrics["itl_p99_over_median"] <= GOAL_ITL_P99_OVER_MEDIAN
    return row(variant, identity, check=check, timing=timing, metrics=metrics, prediction=prediction)


def itl_rows(ctx, params, shape, make_engine, dtype: str) -> list[dict]:
    streams, long_tokens = params["streams"], params["long_tokens"]
    prompts = random_prompts(streams + 2, params["stream_prompt_tokens"], shape.vocab_size, params["seed"])
    long_prompt, warm_long = (random_prompts(2, long_tokens, shape.vocab_size, params["seed"] + 1))
    max_model_len = long_tokens + params["long_output_tokens"] + params["block_size"]
    runs = {}
    for variant, settings in (("chunked", {"enable_chunked_prefill": True,
                                           "max_num_batched_tokens": params["token_budget"]}),
                              ("unchunked", {"enable_chunked_prefill": False,
                                             "max_num_batched_tokens": unchunked_step_tokens(max_model_len)})):
        engine = make_engine(max_model_len=max_model_len, max_num_seqs=streams + 1, **settings)
        try:
            streams_with_long_prompt(engine, prompts[:streams], warm_long, params)     # warm up every step shape
            ctx.synchronize()
            runs[variant] = streams_with_long_prompt(engine, prompts[:streams], long_prompt, params)
        finally:
            del engine
            release_memory(ctx)
    identity = {"kind": "itl_under_long_prompt", "model": shape.name, "streams": streams, "long_tokens": long_tokens,
                "stream_prompt_tokens": params["stream_prompt_tokens"], "token_budget": params["token_budget"],
                "long_output_tokens": params["long_output_tokens"], "dtype": dtype}
    sequences = itl_sequences(runs["chunked"], runs["unchunked"], prompts[:streams], long_prompt)
    in_chunks = chunked_settings(chunk_tokens(sequences, params["token_budget"]))
    with replayers(ctx, make_engine, replay_length(sequences, params["block_size"]), in_chunks) as (unchunked, chunked):
        check = compare_greedy(sequences, unchunked, tie_tolerance(dtype), "chunked prefill on and off",
                               replay_other=chunked)
    if not check["passed"]:
        return [row(v, identity, "failed", check["reason"], check=check) for v in runs]
    predictions = itl_predictions(ctx, shape, params, dtype)
    rows = [itl_row(ctx, identity, v, runs[v], check, predictions, dtype) for v in runs]
    ok = {r["variant"]: r["metrics"] for r in rows if r["status"] == "ok"}
    if len(ok) == 2:
        ok["chunked"]["itl_max_vs_unchunked"] = ok["chunked"]["itl_max_ms"] / ok["unchunked"]["itl_max_ms"]
    return rows


# ------------------------------------------------------------------ a second request sharing a prefix
def timed_request(engine, prompt: list[int], sampling) -> dict:
    """One request alone to its end: its tokens and TTFT (add_request to its first token)."""
    start = time.perf_counter()
    request_id = engine.add_request(prompt, sampling)
    tokens, first_s = [], None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id and out.new_token_ids:
                first_s = first_s or time.perf_counter()
                tokens += out.new_token_ids
    return {"tokens": tokens, "ttft_ms": (first_s - start) * 1e3}


def prefix_pair(engine, prefix: list[int], suffix: list[int], sampling) -> dict:
    """A then B = A's prompt + suffix, each alone; the prompt tokens B found in the cache."""
    a = timed_request(engine, prefix, sampling)
    cached_before = engine.telemetry["cached_prompt_tokens"]
    b = timed_request(engine, prefix + suffix, sampling)
    return {"a": a, "b": b, "b_cached_tokens": engine.telemetry["cached_prompt_tokens"] - cached_before}


def prefix_sequences(on: list[dict], off: list[dict], prefixes: list, suffix: list[int]) -> list[dict]:
    """A and B of every repeat as compare_greedy's sequences, caching off the reference."""
    seqs = []
    for k, (a, b, prefix) in enumerate(zip(on, off, prefixes)):
        seqs += [{"name": f"repeat {k}'s A", "prompt": prefix, "reference": b["a"]["tokens"], "other": a["a"]["tokens"]},
                 {"name": f"repeat {k}'s B", "prompt": prefix + suffix, "reference": b["b"]["tokens"],
                  "other": a["b"]["tokens"]}]
    return seqs


def prefix_predictions(ctx, shape, prefix_tokens: int, suffix_tokens: int, dtype: str) -> tuple[dict, dict]:
    """The whole prompt's prefill, and the suffix's alone over the cached prefix."""
    total = prefix_tokens + suffix_tokens
    whole = [(prefill_flops(shape, total), prefill_bytes(shape, total))]
    context = prefix_tokens + suffix_tokens // 2
    suffix = [(suffix_tokens * shape.flops_per_token(0), shape.decode_weight_bytes()),
              (suffix_tokens * (shape.flops_per_token(context) - shape.flops_per_token(0)),
               total * shape.kv_bytes_per_token())]
    return (summed_prediction(ctx, whole, dtype, None, what="prefill of the whole prompt"),
            summed_prediction(ctx, suffix, dtype, None, what="parts of the suffix's prefill (its matmuls, "
                                                              "its attention over the cached prefix)"))


def prefix_rows(ctx, params, shape, make_engine, dtype: str) -> list[dict]:
    from .engine import SamplingParams
    prefix_tokens, suffix_tokens, repeats = params["prefix_tokens"], params["suffix_tokens"], params["repeats"]
    sampling = SamplingParams(max_tokens=params["output_tokens"], ignore_eos=True)
    prefixes = random_prompts(repeats + 1, prefix_tokens, shape.vocab_size, params["seed"] + 2)
    suffix = random_prompts(1, suffix_tokens, shape.vocab_size, params["seed"] + 3)[0]
    max_model_len = prefix_tokens + suffix_tokens + params["output_tokens"] + params["block_size"]
    runs = {}
    for variant, caching in (("prefix-cache", True), ("no-prefix-cache", False)):
        engine = make_engine(max_model_len=max_model_len, max_num_seqs=1, enable_prefix_caching=caching,
                             max_num_batched_tokens=unchunked_step_tokens(max_model_len))
        try:
            prefix_pair(engine, prefixes[-1], suffix, sampling)                 # warm up both prompt lengths
            ctx.synchronize()
            runs[variant] = [prefix_pair(engine, p, suffix, sampling) for p in prefixes[:repeats]]
        finally:
            del engine
            release_memory(ctx)
    identity = {"kind": "shared_prefix_ttft", "model": shape.name, "prefix_tokens": prefix_tokens,
                "suffix_tokens": suffix_tokens, "output_tokens": params["output_tokens"], "dtype": dtype}
    sequences = prefix_sequences(runs["prefix-cache"], runs["no-prefix-cache"], prefixes[:repeats], suffix)
    length = replay_length(sequences, params["block_size"])
    with replayers(ctx, make_engine, length, cached_settings(length), cached_prefix_tokens=prefix_tokens) as (
            uncached, cached):
        check = compare_greedy(sequences, uncached, tie_tolerance(dtype), "prefix caching on and off",
                               replay_other=cached)
    reason = check["reason"]
    for k, (on, off) in enumerate(zip(runs["prefix-cache"], runs["no-prefix-cache"])):
        if reason:
            break
        if on["b_cached_tokens"] < prefix_tokens // params["block_size"] * params["block_size"] - params["block_size"]:
            reason = (f"repeat {k}: B found {on['b_cached_tokens']} prompt tokens in the cache, "
                      f"~{prefix_tokens} expected")
        elif off["b_cached_tokens"]:
            reason = f"repeat {k}: B found cached tokens with prefix caching off"
    check = {**check, "passed": reason is None, "reason": reason,
             "reference": check["reference"] + "; B's cached prompt tokens"}
    if reason:
        return [row(v, identity, "failed", reason, check=check) for v in runs]
    whole, suffix_only = prefix_predictions(ctx, shape, prefix_tokens, suffix_tokens, dtype)
    rows = []
    for variant, pairs in runs.items():
        ttft_a = [p["a"]["ttft_ms"] for p in pairs]
        ttft_b = [p["b"]["ttft_ms"] for p in pairs]
        timing = summarize(ttft_b, "B's TTFT (add_request to its first token), one per repeat", warmup_calls=1,
                           flush_l2=False)
        expected = suffix_only if variant == "prefix-cache" else whole
        b_ms = statistics.median(ttft_b)
        metrics = {"ms": b_ms, "ttft_b_ms": b_ms, "ttft_a_ms": statistics.median(ttft_a),
                   "ttft_a_over_b": statistics.median(ttft_a) / b_ms,
                   "b_cached_prompt_tokens": pairs[0]["b_cached_tokens"],
                   "predicted_ttft_a_ms": whole["predicted_ms"], "predicted_ttft_b_ms": expected["predicted_ms"],
                   "predicted_ttft_a_over_b": whole["predicted_ms"] / expected["predicted_ms"],
                   **near_tie_metrics(check)}
        if variant == "prefix-cache":
            metrics["goal_met"] = metrics["ttft_a_over_b"] >= GOAL_PREFIX_TTFT_X
        prediction = {**expected, "measured_ms": b_ms, "measured_over_predicted": b_ms / expected["predicted_ms"]}
        rows.append(row(variant, identity, check=check, timing=timing, metrics=metrics, prediction=prediction))
    return rows


def run(ctx, params):
    from .engine import EngineConfig, LLMEngine
    from .engine.weights import random_weights

    shape = shape_of(params)
    dtype = "bf16" if ctx.is_cuda else "fp32"
    torch_dtype = "bfloat16" if ctx.is_cuda else "float32"
    weights = None
    if not params.get("checkpoint"):          # made once, shared by the four engines (each its own KV pool)
        import torch
        weights = random_weights(shape, params["seed"], getattr(torch, torch_dtype), ctx.device)

    def make_engine(max_num_seqs: int, **settings):
        """max_num_seqs sized to the rows a kind runs (the CUDA graphs captured at startup follow it)."""
        return LLMEngine(EngineConfig(**engine_settings({**params, "max_num_seqs": max_num_seqs}, dtype=torch_dtype,
                                                        device=ctx.device.type, **settings)), weights=weights)

    try:
        rows = []
        if "itl_under_long_prompt" in params["kinds"]:
            rows += itl_rows(ctx, params, shape, make_engine, dtype)
        if "shared_prefix_ttft" in params["kinds"]:
            rows += prefix_rows(ctx, params, shape, make_engine, dtype)
        return Result(rows, summary(rows))
    finally:
        weights = None                        # the closure's reference too: the memory goes back now
        release_memory(ctx)


def summary(rows: list[dict]) -> dict:
    """The two goals, where their rows ran."""
    out = {}
    for r in rows:
        if r["status"] != "ok":
            continue
        m = r["metrics"]
        if r["variant"] == "chunked":
            out.update(itl_p99_over_median=m["itl_p99_over_median"],
                       itl_goal=f"ITL p99 <= {GOAL_ITL_P99_OVER_MEDIAN:g}x median with a long prompt arriving",
                       itl_goal_met=m["goal_met"])
        if r["variant"] == "prefix-cache":
            out.update(ttft_a_over_b=m["ttft_a_over_b"], prefix_goal_met=m["goal_met"],
                       prefix_goal=f"TTFT(A) / TTFT(B) >= {GOAL_PREFIX_TTFT_X:g} with the prefix cached")
    return out


def work(params) -> list[Work]:
    """The long prompt's prefill and the shared prefix's: the compute-bound parts this measures."""
    shape = shape_of(params)
    total = params["prefix_tokens"] + params["suffix_tokens"]
    return [Work(f"prefill of the {params['long_tokens']}-token prompt", prefill_flops(shape, params["long_tokens"]),
                 prefill_bytes(shape, params["long_tokens"]), "bf16"),
            Work(f"prefill of A + suffix ({total} tokens)", prefill_flops(shape, total), prefill_bytes(shape, total),
                 "bf16")]


EXERCISE = Exercise(
    id="phase5.long_prompt",
    title="a long prompt among decode streams (chunked prefill) and a shared prefix's TTFT (prefix caching)",
    run=run,
    needs=Needs(modules=("safetensors",)),
    params={**{k: v for k, v in COMMON.items() if k != "max_num_seqs"},     # each engine sized to its rows
            "kinds": Choice(list(KINDS), KINDS, many=True, help="which rows: a long prompt among streams, a shared prefix"),
            "streams": Int(32, min=1, max=1024, unit="decode streams running when the long prompt arrives"),
            "stream_prompt_tokens": Int(128, min=1, max=32768, unit="tokens per stream's prompt"),
            "warm_tokens": Int(4, min=2, max=4096, unit="tokens each stream makes before the long prompt arrives"),
            "long_tokens": Int(8000, min=2, max=131072, unit="tokens of the long prompt"),
            "long_output_tokens": Int(4, min=1, max=4096, unit="tokens the long prompt makes (decode steps after it)"),
            "token_budget": Int(2048, min=2, max=131072, unit="tokens per chunked step (max_num_batched_tokens)"),
            "prefix_tokens": Int(4000, min=2, max=131072, unit="tokens of A's prompt, B's prefix"),
            "suffix_tokens": Int(16, min=1, max=131072, unit="tokens B adds after the prefix"),
            "output_tokens": Int(4, min=1, max=4096, unit="tokens A and B make"),
            "repeats": Int(3, min=1, max=100, unit="A, B pairs per variant (fresh prefixes)")},
    cpu_params={**CPU_COMMON, "streams": 4, "stream_prompt_tokens": 8, "long_tokens": 300, "token_budget": 64,
                "prefix_tokens": 96, "suffix_tokens": 8, "repeats": 1},
    quick_params={"streams": 4, "long_tokens": 512, "prefix_tokens": 512},
    footprint_bytes=weights_footprint_bytes, cpu_footprint_bytes=cpu_weights_footprint_bytes,
    work=work,
    check=check_params,
)

if __name__ == "__main__":
    run_alone(EXERCISE, {})
