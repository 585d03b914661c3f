"""The serving exercises' view of a server: start the lab's (or `vllm serve`, or use any base_url),
drive it with the benchmark client, and turn the client's result into a record row's metrics and
check. The check of a serving run: every request completed, each with exactly the tokens it asked
for (EOS ignored) by the server's own usage count."""
import json
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from common.errors import LabError

from . import client

READY_TIMEOUT_S = 900.0            # an 8B or 70B shape: weights, KV pool, CUDA graphs
METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class Server:
    base_url: str
    model: str | None                 # the served model name (None: the server's first)
    lab: bool                         # the lab's own server (it has /v1/engine/stats)


def dtype_name(ctx) -> str:
    return "bfloat16" if ctx.is_cuda else "float32"


def dtype_label(ctx) -> str:
    return "bf16" if ctx.is_cuda else "fp32"


def torch_dtype(ctx) -> torch.dtype:
    return torch.bfloat16 if ctx.is_cuda else torch.float32


def reachable(base_url: str) -> str | None:
    """A parameter rule: why `base_url` cannot be benchmarked (it does not answer /v1/models)."""
    url = client.root_url(base_url) + "/v1/models"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            json.load(response)
        return None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"the server does not answer GET {url} ({getattr(exc, 'reason', exc)})"


@contextmanager
def lab_server(settings: dict):
    with client.launch_server(settings, ready_timeout_s=READY_TIMEOUT_S) as process:
        yield Server(process.base_url, None, True)


def external(base_url: str, model: str | None) -> Server:
    """A server someone else runs (its `base_url` parameter rule already found it answering)."""
    return Server(base_url, model, False)


@contextmanager
def launched(command: list[str], base_url: str, model: str | None, ready_timeout_s: float):
    with client.launch_command(command, base_url, ready_timeout_s=ready_timeout_s) as process:
        yield Server(process.base_url, model, False)


def serving_check(result, output_tokens: int) -> dict:
    done = [r for r in result.requests if r.success]
    short = [r for r in done if r.completion_tokens != output_tokens]
    passed = result.failed == 0 and not short and len(done) == result.num_requests
    if result.failed:
        reason = f"{result.failed} of {result.num_requests} requests failed: {(result.errors or ['?'])[0]}"
    elif short:
        reason = f"a request returned {short[0].completion_tokens} tokens by the server's usage, asked {output_tokens}"
    else:
        reason = None
    return {"passed": passed, "reference": "every request completes with the tokens it asked for (server usage)",
            "requests": result.num_requests, "reason": reason}


def client_metrics(result) -> dict:
    """The client's summary under the lab's metric names (units in the names)."""
    m = {"output_tok_s": result.output_tokens_per_s, "total_tok_s": result.total_tokens_per_s,
         "request_throughput_per_s": result.request_throughput_per_s, "completed": result.completed,
         "duration_s": result.duration_s, "goodput_per_s": result.request_goodput_per_s}
    for name in METRICS:
        for stat in ("mean", "median", "p99"):
            m[f"{name}_{stat}_ms"] = getattr(result, f"{stat}_{name}_ms")
    stats = result.engine_stats or {}
    decode = stats.get("decode_step_ms") or {}
    m["engine_decode_step_ms"] = decode.get("median")
    m["engine_preemptions"] = stats.get("num_preemptions")
    return m


def load_test(server: Server, prompts: list[list[int]], output_tokens: int, concurrency: int,
              warmup_prompts: list[list[int]]) -> dict:
    """`prompts` at `concurrency` in flight, after `warmup_prompts` (sent first, excluded): the
    client's metrics, per-request TPOT and TTFT, and the check."""
    if warmup_prompts:
        client.benchmark(server.base_url, [client.RequestSpec(p, output_tokens) for p in warmup_prompts],
                         model=server.model, max_concurrency=concurrency, ignore_eos=True, collect_engine_stats=False)
    result = client.benchmark(server.base_url, [client.RequestSpec(p, output_tokens) for p in prompts],
                              model=server.model, max_concurrency=concurrency, ignore_eos=True,
                              collect_engine_stats=server.lab)
    return {"metrics": client_metrics(result), "check": serving_check(result, output_tokens),
            "requests": [{"tpot_ms": 1e3 * r.tpot_s, "ttft_ms": 1e3 * r.ttft_s} for r in result.requests if r.success],
            "warmups": len(warmup_prompts), "engine_stats": result.engine_stats}


def sequential_runs(server: Server, prompt: list[int], output_tokens: int, runs: int) -> dict:
    """The seed's method: one warmup, then `runs` requests one at a time, streamed. The warmup is
    the server's first request, kept apart ("first": its TTFT, TPOT and the engine's step times
    while it ran) rather than dropped, to set beside the steady state."""
    spec = client.RequestSpec(prompt, output_tokens)
    first = client.benchmark(server.base_url, [spec], model=server.model, max_concurrency=1, ignore_eos=True,
                             collect_engine_stats=server.lab)
    result = client.benchmark(server.base_url, [spec] * runs, model=server.model, max_concurrency=1,
                              ignore_eos=True, collect_engine_stats=server.lab)
    check = serving_check(first, output_tokens)
    check = check if not check["passed"] else serving_check(result, output_tokens)
    return {"check": check, "metrics": client_metrics(result),
            "tpot_ms": [1e3 * r.tpot_s for r in result.requests if r.success],
            "ttft_ms": [1e3 * r.ttft_s for r in result.requests if r.success],
            "engine_stats": result.engine_stats or {},
            "first": {"ttft_ms": 1e3 * first.requests[0].ttft_s if first.requests[0].success else None,
                      "tpot_ms": 1e3 * first.requests[0].tpot_s if first.requests[0].success else None,
                      "engine_stats": first.engine_stats or {}}}


def greedy_token_ids(server: Server, prompt: list[int], output_tokens: int) -> list[int]:
    """The server's greedy tokens for `prompt`, as ids (vLLM's `return_token_ids` extension)."""
    body = {"prompt": prompt, "max_tokens": output_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **({"model": server.model} if server.model else {})}
    request = urllib.request.Request(client.root_url(server.base_url) + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        choice = json.load(response)["choices"][0]
    if "token_ids" not in choice:
        raise LabError(f"the server at {server.base_url} does not return token ids (return_token_ids)")
    return [int(t) for t in choice["token_ids"]]
