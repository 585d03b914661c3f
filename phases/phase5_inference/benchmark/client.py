"""The serving benchmark client, with `vllm bench serve`'s metrics and conventions, so the lab's
server, `vllm serve` and any OpenAI-compatible endpoint are measured the same way.

Each request streams POST /v1/completions (prompt as text or token ids) with
stream_options.include_usage. Per request: TTFT (send to the first chunk with a choice), ITLs (gaps
between later chunks), E2EL (send to the last chunk with a choice), and the prompt and completion
token counts FROM THE SERVER'S usage chunk (a request without one counts as failed: nothing is
re-tokenized here). Aggregates: mean / median / std / p99 of TTFT, TPOT ((E2EL - TTFT) /
(completion_tokens - 1), requests of more than one token), ITL (all gaps pooled) and E2EL, in ms;
request throughput, output and total tok/s, and goodput (requests/s meeting every SLO given).

Load: at most `max_concurrency` requests in flight (a semaphore), and/or arrivals at `request_rate`
per second with gamma-distributed gaps (shape = burstiness, scale = 1 / (rate * burstiness): Poisson
at burstiness 1), seeded. Warmup requests run first and are excluded. One asyncio process drives
hundreds of streams (no connection limit).

An unreachable server raises LabError naming the URL before any load. `launch_server` starts the
lab's server as a subprocess and stops it cleanly; `wait_until_ready` polls any server.
"""
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from common.errors import LabError
from common.paths import REPO_ROOT

SLO_METRICS = ("ttft", "tpot", "e2el")
READY_LINE = re.compile(r"ready at (http://\S+)")
STOP_TIMEOUT_S = 15.0


@dataclass
class RequestSpec:
    """One request of a benchmark: a prompt (text or token ids) and how many tokens to generate."""
    prompt: str | list[int]
    max_tokens: int


@dataclass
class RequestResult:
    """What the client saw of one request (times in seconds, counts from the server's usage)."""
    success: bool = False
    error: str = ""
    start_s: float = 0.0              # when it was sent, from the start of the timed run
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2el_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""

    @property
    def tpot_s(self) -> float:
        """(E2EL - TTFT) / (completion_tokens - 1); 0 for a single-token completion (as vLLM)."""
        if self.completion_tokens <= 1:
            return 0.0
        return (self.e2el_s - self.ttft_s) / (self.completion_tokens - 1)


@dataclass
class BenchmarkResult:
    """vllm bench serve's summary (times in ms; rates per second) and every request's result."""
    model: str
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    request_goodput_per_s: float | None        # None: no SLOs given
    mean_ttft_ms: float | None
    median_ttft_ms: float | None
    std_ttft_ms: float | None
    p99_ttft_ms: float | None
    mean_tpot_ms: float | None
    median_tpot_ms: float | None
    std_tpot_ms: float | None
    p99_tpot_ms: float | None
    mean_itl_ms: float | None
    median_itl_ms: float | None
    std_itl_ms: float | None
    p99_itl_ms: float | None
    mean_e2el_ms: float | None
    median_e2el_ms: float | None
    std_e2el_ms: float | None
    p99_e2el_ms: float | None
    max_concurrency: int | None
    request_rate_per_s: float | None           # None: all requests at once (an infinite rate)
    burstiness: float
    num_warmups: int
    slos_ms: dict | None
    errors: list[str]                          # the first few distinct failure messages
    engine_stats: dict | None = None           # the lab server's /v1/engine/stats over the timed run
    requests: list[RequestResult] = field(default_factory=list)

    def to_dict(self, include_requests: bool = False) -> dict:
        out = asdict(self)
        if not include_requests:
            out.pop("requests")
        return out


# ---------------------------------------------------------------------- load shape
def arrival_offsets_s(num_requests: int, request_rate_per_s: float = float("inf"), burstiness: float = 1.0,
                      seed: int = 0) -> list[float]:
    """When each request is sent, from the start: the first at 0, then gaps drawn from
    gamma(shape=burstiness, scale=1/(rate*burstiness)) (mean 1/rate; Poisson at burstiness 1);
    all 0 at an infinite rate. The same seed gives the same schedule."""
    if burstiness <= 0:
        raise LabError(f"burstiness must be > 0, got {burstiness}")
    if request_rate_per_s <= 0:
        raise LabError(f"request_rate must be > 0 (inf: all at once), got {request_rate_per_s}")
    if num_requests <= 0:
        return []
    if request_rate_per_s == float("inf"):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate_per_s * burstiness), size=num_requests - 1)
    return [0.0] + np.cumsum(gaps).tolist()


# ---------------------------------------------------------------------- one request
async def _stream_one(session, url: str, payload: dict) -> RequestResult:
    """Send one streaming completion and time its server-sent events as they arrive."""
    import aiohttp

    result = RequestResult()
    sent = time.perf_counter()
    last_choice_at = None
    pieces = []
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {_error_message(await response.text())}"
                return result
            buffer = b""
            async for chunk in response.content.iter_any():
                now = time.perf_counter()
                buffer += chunk.replace(b"\r\n", b"\n")
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            continue
                        message = json.loads(data)
                        if message.get("error"):
                            result.error = _error_message(json.dumps(message))
                        if message.get("choices"):
                            if last_choice_at is None:
                                result.ttft_s = now - sent
                            else:
                                result.itl_s.append(now - last_choice_at)
                            last_choice_at = now
                            choice = message["choices"][0]
                            pieces.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
                        usage = message.get("usage")
                        if usage:
                            result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                            result.completion_tokens = int(usage.get("completion_tokens") or 0)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.text = "".join(pieces)
    if last_choice_at is None:
        result.error = result.error or "no streamed chunk with a choice arrived"
    elif not result.completion_tokens:
        result.error = result.error or "the server sent no usage (stream_options.include_usage)"
    else:
        result.e2el_s = last_choice_at - sent
        result.success = not result.error
    return result


def _error_message(body: str) -> str:
    try:
        return str(json.loads(body)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return body.strip().replace("\n", " ")[:300]


# ---------------------------------------------------------------------- the benchmark
async def run_benchmark(base_url: str, requests: list[RequestSpec], *, model: str | None = None,
                        max_concurrency: int | None = None, request_rate_per_s: float = float("inf"),
                        burstiness: float = 1.0, seed: int = 0, num_warmups: int = 0,
                        slos_ms: dict | None = None, temperature: float = 0.0, ignore_eos: bool = False,
                        extra_body: dict | None = None, request_timeout_s: float = 600.0,
                        collect_engine_stats: bool = True) -> BenchmarkResult:
    """Drive `requests` against base_url's /v1/completions and summarize them (see the module doc).
    `model` defaults to the first model the server lists; `slos_ms` e.g. {"ttft": 50, "tpot": 20};
    `ignore_eos` asks for exactly max_tokens tokens (vLLM's extension, honoured by the lab's server)."""
    import aiohttp

    if not requests:
        raise LabError("the benchmark needs at least one request")
    if max_concurrency is not None and max_concurrency < 1:
        raise LabError(f"max_concurrency must be >= 1, got {max_concurrency}")
    slos_ms = dict(slos_ms) if slos_ms else None
    unknown = sorted(set(slos_ms or {}) - set(SLO_METRICS))
    if unknown:
        raise LabError(f"unknown SLO metric {unknown[0]!r}; known: {', '.join(SLO_METRICS)}")
    offsets = arrival_offsets_s(len(requests), request_rate_per_s, burstiness, seed)
    base_url = root_url(base_url)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        served = await _check_server(session, base_url)
        if model is not None and model not in served:
            raise LabError(f"the server at {base_url} serves {', '.join(served)}, not {model!r}")
        model = model or served[0]
        url = f"{base_url}/v1/completions"

        def payload(spec: RequestSpec) -> dict:
            body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens,
                    "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
            if ignore_eos:
                body["ignore_eos"] = True
            return {**body, **(extra_body or {})}

        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def send(spec: RequestSpec) -> RequestResult:
            if semaphore is None:
                return await _stream_one(session, url, payload(spec))
            async with semaphore:
                return await _stream_one(session, url, payload(spec))

        if num_warmups:
            warm = await asyncio.gather(*(send(requests[i % len(requests)]) for i in range(num_warmups)))
            failed = [w.error for w in warm if not w.success]
            if failed:
                raise LabError(f"warmup request to {url} failed: {failed[0]}")
        stats_available = collect_engine_stats and await _reset_engine_stats(session, base_url)

        started = time.perf_counter()

        async def scheduled(spec: RequestSpec, offset_s: float) -> RequestResult:
            delay = started + offset_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent_at = time.perf_counter() - started
            result = await send(spec)
            result.start_s = sent_at
            return result

        results = await asyncio.gather(*(scheduled(s, o) for s, o in zip(requests, offsets)))
        duration_s = time.perf_counter() - started
        engine_stats = await _engine_stats(session, base_url) if stats_available else None
    return summarize(results, duration_s, model=model, max_concurrency=max_concurrency,
                     request_rate_per_s=request_rate_per_s, burstiness=burstiness, num_warmups=num_warmups,
                     slos_ms=slos_ms, engine_stats=engine_stats)


def benchmark(base_url: str, requests: list[RequestSpec], **options) -> BenchmarkResult:
    """run_benchmark from synchronous code (its own event loop)."""
    return asyncio.run(run_benchmark(base_url, requests, **options))


def summarize(results: list[RequestResult], duration_s: float, *, model: str = "",
              max_concurrency: int | None = None, request_rate_per_s: float = float("inf"),
              burstiness: float = 1.0, num_warmups: int = 0, slos_ms: dict | None = None,
              engine_stats: dict | None = None) -> BenchmarkResult:
    """vllm bench serve's aggregates over the requests of one timed run."""
    ok = [r for r in results if r.success]
    ttfts = [r.ttft_s for r in ok]
    tpots = [r.tpot_s for r in ok if r.completion_tokens > 1]
    itls = [gap for r in ok for gap in r.itl_s]
    e2els = [r.e2el_s for r in ok]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.completion_tokens for r in ok)
    goodput = None
    if slos_ms:
        def meets(r: RequestResult) -> bool:
            measured_ms = {"ttft": r.ttft_s * 1e3, "tpot": r.tpot_s * 1e3, "e2el": r.e2el_s * 1e3}
            return all(measured_ms[k] <= limit for k, limit in slos_ms.items())
        goodput = sum(meets(r) for r in ok) / duration_s
    metrics = {}
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        ms = np.asarray(values, dtype=float) * 1e3
        empty = ms.size == 0
        metrics[f"mean_{name}_ms"] = None if empty else float(ms.mean())
        metrics[f"median_{name}_ms"] = None if empty else float(np.median(ms))
        metrics[f"std_{name}_ms"] = None if empty else float(ms.std())
        metrics[f"p99_{name}_ms"] = None if empty else float(np.percentile(ms, 99))
    errors = list(dict.fromkeys(r.error for r in results if not r.success))[:5]
    return BenchmarkResult(
        model=model, num_requests=len(results), completed=len(ok), failed=len(results) - len(ok),
        duration_s=duration_s, total_input_tokens=input_tokens, total_output_tokens=output_tokens,
        request_throughput_per_s=len(ok) / duration_s, output_tokens_per_s=output_tokens / duration_s,
        total_tokens_per_s=(input_tokens + output_tokens) / duration_s, request_goodput_per_s=goodput,
        **metrics, max_concurrency=max_concurrency,
        request_rate_per_s=None if request_rate_per_s == float("inf") else request_rate_per_s,
        burstiness=burstiness, num_warmups=num_warmups, slos_ms=slos_ms, errors=errors,
        engine_stats=engine_stats, requests=list(results))


# ---------------------------------------------------------------------- the server's side
def root_url(base_url: str) -> str:
    """The server's root URL: "http://host:port" (a trailing /v1 or / is dropped)."""
    url = base_url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def _check_server(session, base_url: str) -> list[str]:
    """The models the server lists; LabError (one line, naming the URL) when it cannot be asked."""
    import aiohttp

    url = f"{base_url}/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as response:
            if response.status != 200:
                raise LabError(f"{url} answered HTTP {response.status}: {_error_message(await response.text())}")
            listing = await response.json()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        errno, strerror = getattr(exc, "errno", None), getattr(exc, "strerror", None)
        reason = os.strerror(errno).lower() if errno and errno > 0 else (strerror or str(exc) or type(exc).__name__)
        raise LabError(f"no server reachable at {base_url} ({reason})") from None
    try:
        models = [card["id"] for card in listing["data"]]
    except (KeyError, TypeError):
        models = []
    if not models:
        raise LabError(f"{url} lists no model")
    return models


async def _reset_engine_stats(session, base_url: str) -> bool:
    """Start a new window of the lab server's step statistics; False for other servers."""
    import aiohttp

    try:
        async with session.post(f"{base_url}/v1/engine/stats/reset") as response:
            return response.status == 200
    except aiohttp.ClientError:
        return False


async def _engine_stats(session, base_url: str) -> dict | None:
    import aiohttp

    try:
        async with session.get(f"{base_url}/v1/engine/stats") as response:
            return await response.json() if response.status == 200 else None
    except (aiohttp.ClientError, ValueError):
        return None


def wait_until_ready(base_url: str, timeout_s: float = 60.0, poll_s: float = 0.1) -> None:
    """Poll GET /v1/models until it answers 200 (any OpenAI-compatible server); LabError after
    timeout_s, naming the URL and the last reason."""
    url = f"{root_url(base_url)}/v1/models"
    deadline = time.monotonic() + timeout_s
    reason = "no answer"
    while True:
        try:
            with urllib.request.urlopen(url, timeout=max(0.2, min(5.0, deadline - time.monotonic()))) as response:
                if response.status == 200:
                    return
                reason = f"HTTP {response.status}"
        except urllib.error.HTTPError as exc:
            reason = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            reason = str(getattr(exc, "reason", exc))
        if time.monotonic() >= deadline:
            raise LabError(f"server at {root_url(base_url)} not ready after {timeout_s:g} s ({reason})")
        time.sleep(poll_s)


class ServerProcess:
    """A server running as a child process, its output in log files (the error message of a server
    that dies quotes its stderr)."""

    def __init__(self, command: list[str], log_dir: Path, env: dict | None = None):
        self.command = command
        self.log_dir = Path(log_dir)
        self.stdout_path, self.stderr_path = self.log_dir / "stdout.log", self.log_dir / "stderr.log"
        self.base_url: str | None = None
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.process = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                            cwd=REPO_ROOT, env=env)

    def stderr_tail(self, lines: int = 1) -> str:
        text = self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""
        kept = [line.strip() for line in text.splitlines() if line.strip()]
        return " | ".join(kept[-lines:]) if kept else "(no stderr)"

    def check_alive(self, while_doing: str) -> None:
        code = self.process.poll()
        if code is not None:
            raise LabError(f"the server exited with code {code} {while_doing}: {self.stderr_tail()}")

    def wait_for_ready_line(self, timeout_s: float) -> str:
        """The URL the lab's server prints once it is listening."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = READY_LINE.search(self.stdout_path.read_text(errors="replace"))
            if match:
                return match.group(1)
            self.check_alive("before it was ready")
            time.sleep(0.05)
        raise LabError(f"the server printed no ready line within {timeout_s:g} s: {self.stderr_tail()}")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGINT (the server's Ctrl-C path), then SIGTERM, then SIGKILL; the exit code."""
        for send in (lambda: self.process.send_signal(signal.SIGINT), self.process.terminate, self.process.kill):
            if self.process.poll() is not None:
                break
            send()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                continue
        return self.process.wait()


@contextmanager
def launch_command(command: list[str], base_url: str, ready_timeout_s: float = 600.0,
                   env: dict | None = None, log_dir: str | Path | None = None):
    """Start any OpenAI-compatible server (e.g. `vllm serve ...`) and yield its ServerProcess once
    base_url answers /v1/models; stop it on exit."""
    with _log_folder(log_dir) as folder:
        try:
            server = ServerProcess(command, folder, env)
        except OSError as exc:
            raise LabError(f"cannot start {command[0]}: {exc.strerror or exc}") from None
        try:
            server.base_url = root_url(base_url)
            _wait_alive(server, ready_timeout_s)
            yield server
        finally:
            server.stop()


@contextmanager
def launch_server(settings: dict | None = None, *, host: str = "127.0.0.1", port: int = 0,
                  served_model_name: str | None = None, max_queue: int | None = None,
                  ready_timeout_s: float = 600.0, env: dict | None = None, log_dir: str | Path | None = None):
    """Start the lab's server (`python -m phases.phase5_inference.engine.server`) with EngineConfig
    fields from `settings` (e.g. {"model": "tiny", "dtype": "float32", "device": "cpu"}); yield its
    ServerProcess (base_url set) once it answers; stop it (SIGINT, then harder) on exit. A server
    that dies first raises LabError with the last line of its stderr."""
    with launch_command(server_command(settings, host=host, port=port, served_model_name=served_model_name,
                                       max_queue=max_queue), base_url="", ready_timeout_s=ready_timeout_s,
                        env=env, log_dir=log_dir) as server:
        yield server


def server_command(settings: dict | None = None, *, host: str = "127.0.0.1", port: int = 0,
                   served_model_name: str | None = None, max_queue: int | None = None) -> list[str]:
    """The command line of the lab's server: one flag per EngineConfig field given."""
    command = [sys.executable, "-m", "phases.phase5_inference.engine.server", "--host", host, "--port", str(port)]
    for name, value in (settings or {}).items():
        if value is None:
            continue
        if name == "cuda_graphs":
            command += [] if value else ["--no-cuda-graphs"]
        else:
            command += [f"--{name.replace('_', '-')}", str(value)]
    if served_model_name:
        command += ["--served-model-name", served_model_name]
    if max_queue is not None:
        command += ["--max-queue", str(max_queue)]
    return command


def _wait_alive(server: ServerProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    if not server.base_url:                       # the lab's server prints its URL (port 0 picks one)
        server.base_url = root_url(server.wait_for_ready_line(timeout_s))
    while True:
        server.check_alive("before it was ready")
        try:
            wait_until_ready(server.base_url, timeout_s=min(1.0, max(0.0, deadline - time.monotonic())))
            return
        except LabError:
            if time.monotonic() >= deadline:
                raise LabError(f"server at {server.base_url} not ready after {timeout_s:g} s: "
                               f"{server.stderr_tail()}") from None


@contextmanager
def _log_folder(log_dir):
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        yield Path(log_dir)
        return
    folder = Path(tempfile.mkdtemp(prefix="lab-serve-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
