"""Exercise 6.3: Groq's LPU through its API, by the seed's method: a ~100-token prompt, 200 output
tokens, temperature 0, streamed, one warmup excluded, then 5 requests one at a time, per model.

    GROQ_API_KEY=... lab run phase6.groq_api [--param models=[llama-3.1-8b-instant]]
    lab run phase6.groq_api --param base_url=http://127.0.0.1:8000/v1 --param models=[tiny]   # any OpenAI-compatible server

TTFT is split into the network round trip (measured here), the queue, prompt and completion times
the API reports about itself, and the rest. Decode speed is 1 / TPOT after the first token. The
row's prediction is the spec-sheet roofline of the hardware named by `hardware` (the LPU for
Groq: a batch-1 token reads every weight at one chip's SRAM bandwidth, as in a pipeline of the
fewest chips that hold them); Groq does not publish its deployment, so the row is kept out of the
lab's prediction-accuracy figures. Without GROQ_API_KEY, or without a route to the API's host, the
exercise is skipped with the reason. The key never reaches a record.

Built on phase 5: its benchmark client and Llama shapes measure Groq as they measure the lab's server.
"""
import statistics

from common import roofline
from common.errors import Skip
from common.exercise import Exercise, Needs, Result, row
from common.hardware import load_hardware
from common.params import Bool, Float, Int, Param, Text
from common.standalone import run_alone
from common.timing import summarize

from . import groq_client
from .architectures import roofs
from phases.phase5_inference.benchmark.client import summarize as phase5_summary
from phases.phase5_inference.engine import SHAPES

VARIANT = "groq_sdk"
# Groq's model ids -> the lab's shapes of the same architecture (for the prediction)
SHAPE_OF = {"llama-3.1-8b-instant": "llama-3.1-8b", "llama-3.3-70b-versatile": "llama-3.3-70b"}


def hardware_rule(key) -> str | None:
    known = load_hardware()
    return None if key in known else f"no hardware.yaml entry '{key}'; known: {', '.join(known)}"


def url_rule(url) -> str | None:
    """A parameter rule: why `url` cannot be used. A base_url given but unreachable is the user's
    mistake (exit 2 before any work, as phase 5's base_url is), not a skip."""
    try:
        ep = groq_client.endpoint(url)
    except ValueError as exc:
        return str(exc)
    if url is None:
        return None
    try:
        groq_client.round_trips_ms(ep, samples=1)
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        return f"no route to {groq_client.safe_url(ep.base_url)} ({reason.lower()})"
    return None


def prediction(model: str, hardware: str | None, tpot_ms: float, context: int) -> dict:
    """A decode step of `model`'s shape on `hardware`'s roofs (one device's bandwidth), excluded
    from the accuracy figures: what stands behind a remote API is not known."""
    shape = SHAPES.get(SHAPE_OF.get(model, model))
    why = "a remote API: the devices behind it, their number and batching are not published"
    if shape is None or hardware is None:
        return {"model": "none", "excluded": why + ("; no lab shape for this model" if shape is None else
                                                     "; no hardware named")}
    spec = load_hardware()[hardware]
    flops = shape.flops_per_token(context)
    nbytes = shape.decode_weight_bytes() + context * shape.kv_bytes_per_token()
    return {**roofline.predict(flops, nbytes, roofs(spec), "bf16", tpot_ms), "launches": 1, "excluded": why,
            "shape": shape.name}


def model_row(client, ep, model: str, params: dict, rtts: list[float]) -> dict:
    identity = {"model": model, "endpoint": ep.label, "prompt": "~100 tokens (groq_client.PROMPT)",
                "output_tokens": params["output_tokens"], "runs": params["runs"], "temperature": 0.0}
    ask = dict(max_tokens=params["output_tokens"], ignore_eos=params["ignore_eos"])
    for _ in range(params["warmups"]):
        warm = groq_client.stream_once(client, ep, model, **ask)
        if not warm.result.success:
            return row(VARIANT, identity, "failed", f"warmup request failed: {warm.result.error}",
                       check={"passed": False, "reason": warm.result.error, "reference": "every request streams text and usage"})
    runs = [groq_client.stream_once(client, ep, model, **ask) for _ in range(params["runs"])]
    bad = [r.result for r in runs if not r.result.success or r.result.completion_tokens < 2]
    check = {"passed": not bad, "reference": "every request streams text and reports its usage, at least 2 tokens",
             "requests": len(runs), "reason": None}
    if bad:
        check["reason"] = bad[0].error or f"only {bad[0].completion_tokens} token(s) came back"
        return row(VARIANT, identity, "failed", f"{len(bad)} of {len(runs)} requests failed: {check['reason']}", check=check)
    results = [r.result for r in runs]
    summary = phase5_summary(results, sum(r.e2el_s for r in results), model=model, num_warmups=params["warmups"])
    tpots = [1e3 * r.tpot_s for r in results]
    ttfts = [1e3 * r.ttft_s for r in results]
    rtt = statistics.median(rtts)
    queue, prompt, completion = (groq_client.api_ms(runs, k) for k in groq_client.API_TIMES)
    ttft = statistics.fmean(ttfts)
    tokens = statistics.fmean(r.completion_tokens for r in results)
    metrics = {
        "ms": statistics.median(tpots), "tpot_ms": statistics.median(tpots), "decode_tok_s": 1e3 / statistics.fmean(tpots),
        "e2e_tok_s": statistics.fmean(r.completion_tokens / r.e2el_s for r in results),
        "ttft_mean_ms": ttft, "ttft_p50_ms": statistics.median(ttfts), "ttft_max_ms": max(ttfts),
        "network_rtt_ms": rtt, "api_queue_ms": queue, "api_prompt_ms": prompt, "api_completion_ms": completion,
        "ttft_rest_ms": ttft - rtt - (queue or 0.0) - (prompt or 0.0),
        "api_decode_tok_s": tokens / (completion / 1e3) if completion else None,
        "completion_tokens_mean": tokens, "prompt_tokens": results[0].prompt_tokens,
        "itl_p99_ms": summary.p99_itl_ms, "e2el_mean_ms": summary.mean_e2el_ms,
        "served_by": "Groq API" if ep.is_groq else f"OpenAI-compatible server at {ep.label}",
        "sdk": f"groq {groq_client_version()}"}
    timing = summarize(tpots, "streamed inter-token time per request (TPOT), groq SDK, host clock",
                       warmup_calls=params["warmups"], flush_l2=False)
    context = results[0].prompt_tokens + int(tokens) // 2
    return row(VARIANT, identity, check=check, timing=timing, metrics=metrics,
               prediction=prediction(model, params["hardware"], timing.median_ms, context))


def groq_client_version() -> str | None:
    from common.env import package_version
    return package_version("groq")


def run(ctx, params):
    try:
        ep = groq_client.endpoint(params["base_url"])
    except ValueError as exc:
        raise Skip(str(exc)) from None
    try:
        rtts = groq_client.round_trips_ms(ep)
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise Skip(f"no route to the API at {groq_client.safe_url(ep.base_url)} ({reason.lower()})") from None
    client = groq_client.make_client(ep, params["request_timeout_s"])
    try:
        rows = [model_row(client, ep, model, params, rtts) for model in ctx.track(params["models"], "models")]
    finally:
        client.close()
    return Result(rows, {"endpoint": ep.label, "network_rtt_ms": rtts, "method": "the seed's: ~100-token prompt, "
                         "output tokens asked, temperature 0, streamed, warmups excluded, requests one at a time"})


EXERCISE = Exercise(
    id="phase6.groq_api",
    title="Groq's LPU through its API: TTFT split into network, queue and prompt time, and decode tok/s",
    run=run, needs=Needs(modules=("groq",), env=("GROQ_API_KEY",)),
    params={"models": Param(["llama-3.1-8b-instant", "llama-3.3-70b-versatile"], "str", many=True,
                            help="model ids the API serves"),
            "base_url": Text(None, nullable=True, rule=url_rule,
                             help="the API's base URL (default GROQ_BASE_URL, else https://api.groq.com); "
                                  "an OpenAI-compatible server as its /v1 root"),
            "hardware": Text("groq_lpu", nullable=True, rule=hardware_rule,
                             help="the hardware.yaml entry behind the API, for the prediction"),
            "output_tokens": Int(200, min=2, max=8192, unit="tokens"),
            "runs": Int(5, min=1, max=100, unit="timed requests"),
            "warmups": Int(1, min=0, max=10, unit="requests not timed"),
            "ignore_eos": Bool(False, help="ask for exactly output_tokens (vLLM's and the lab server's extension; "
                                           "Groq's API does not take it)"),
            "request_timeout_s": Float(60.0, min=1, max=3600, unit="s")},
    variants=(VARIANT,), quick_params={"output_tokens": 16, "runs": 2},
    footprint_bytes=lambda p: 1)            # the model runs remotely: nothing of it is held on this device


if __name__ == "__main__":
    run_alone(EXERCISE, {})
