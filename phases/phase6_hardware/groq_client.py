"""Phase 5's streaming method through Groq's official SDK: one chat request at a time, streamed,
TTFT to the first chunk that carries text, the gaps between later ones, token counts from the
server's own usage; then the same aggregates as phase 5's client (its `summarize`).

TTFT is split three ways: the network round trip (measured: the median time to open a TCP
connection to the API's host, one round trip), what the API reports of its own work (Groq's final
chunk carries `x_groq.usage` with queue_time, prompt_time and completion_time in seconds), and the
rest (the API's infrastructure: routing, batching, the HTTP and TLS path). A server that reports no
times (the lab's own) leaves those parts empty.

The base URL is Groq's (https://api.groq.com, or GROQ_BASE_URL) or any OpenAI-compatible server
given as its /v1 root (http://127.0.0.1:8000/v1): the SDK's /openai/v1/... paths are then mapped
onto it, and usage is asked for with stream_options, as that API wants. The API key is read from
GROQ_API_KEY by the SDK and is never copied into a result, a message or a log line.

Built on phase 5: its benchmark client's RequestResult and summarize.
"""
import os
import socket
import statistics
import time
import urllib.parse
from dataclasses import dataclass, field

from common.paths import scrub_paths
from phases.phase5_inference.benchmark.client import RequestResult

GROQ_URL = "https://api.groq.com"
API_TIMES = ("queue_time", "prompt_time", "completion_time")

# About 100 tokens with a chat template around it; any text works, this asks for a long answer.
PROMPT = ("You are helping an engineer reason about hardware. In plain sentences and without lists, explain how "
          "a large language model produces text one token at a time on an accelerator: where the weights live, "
          "what has to be read from memory for every new token, why the first token of an answer takes longer "
          "than the ones after it, and why serving many users at once changes the cost of each token. Keep "
          "going until you have covered each of these points carefully.")


@dataclass(frozen=True)
class Endpoint:
    base_url: str                 # what the SDK is given
    openai_root: bool             # an OpenAI-compatible /v1 root, not Groq's own API
    host: str
    port: int

    @property
    def label(self) -> str:
        """Where the requests went, as a record may say it: host (and port when not the default)."""
        default = 443 if self.base_url.startswith("https") else 80
        return self.host if self.port == default else f"{self.host}:{self.port}"

    @property
    def is_groq(self) -> bool:
        return self.host == "groq.com" or self.host.endswith(".groq.com")


def endpoint(base_url: str | None) -> Endpoint:
    url = (base_url or os.environ.get("GROQ_BASE_URL") or GROQ_URL).rstrip("/")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {safe_url(url)}")
    return Endpoint(url, parts.path.endswith("/v1"), parts.hostname,
                    parts.port or (443 if parts.scheme == "https" else 80))


def safe_url(url: str) -> str:
    """The URL without user, password, query or fragment (what may appear in a message)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    return urllib.parse.urlunsplit((parts.scheme, host + (f":{parts.port}" if parts.port else ""), parts.path, "", ""))


def round_trips_ms(ep: Endpoint, samples: int = 5, timeout_s: float = 5.0) -> list[float]:
    """Time to open a TCP connection to the API's host, `samples` times (name resolved once, outside
    the timing): each is one network round trip. OSError when the host cannot be reached."""
    family, kind, proto, _, address = socket.getaddrinfo(ep.host, ep.port, type=socket.SOCK_STREAM)[0]
    out = []
    for _ in range(samples):
        with socket.socket(family, kind, proto) as s:
            s.settimeout(timeout_s)
            t0 = time.perf_counter()
            s.connect(address)
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def _onto_openai_root(request) -> None:
    """httpx request hook: the SDK's '<root>/openai/v1/chat/completions' becomes '<root>/chat/completions'."""
    path = request.url.path
    if "/openai/v1/" in path:
        request.url = request.url.copy_with(path=path.replace("/openai/v1/", "/", 1))


def make_client(ep: Endpoint, timeout_s: float):
    """Groq's SDK client: no retries (a benchmark counts what failed), the key from GROQ_API_KEY."""
    import groq
    http = groq.DefaultHttpxClient(event_hooks={"request": [_onto_openai_root]} if ep.openai_root else {})
    return groq.Groq(base_url=ep.base_url, max_retries=0, timeout=timeout_s, http_client=http)


@dataclass
class Run:
    """One streamed request: phase 5's per-request result and the API's own times (seconds)."""
    result: RequestResult
    api: dict = field(default_factory=dict)


def one_line(exc: BaseException) -> str:
    """An SDK error as one line, with the API key (if it appears at all) blanked out."""
    status = getattr(exc, "status_code", None)
    body = getattr(exc, "body", None)
    message = body.get("message") if isinstance(body, dict) and body.get("message") else str(exc)
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = body["error"].get("message") or message
    text = scrub_paths(" ".join(str(message).split())[:300])
    key = os.environ.get("GROQ_API_KEY")
    if key:
        text = text.replace(key, "***")
    return (f"HTTP {status}: " if status else f"{type(exc).__name__}: ") + text


def usage_of(chunk):
    """The usage a chunk carries: Groq's x_groq.usage (final chunk) or the OpenAI usage field."""
    x_groq = getattr(chunk, "x_groq", None)
    return getattr(x_groq, "usage", None) or getattr(chunk, "usage", None)


def stream_once(client, ep: Endpoint, model: str, max_tokens: int, temperature: float = 0.0,
                ignore_eos: bool = False, prompt: str = PROMPT) -> Run:
    import groq
    extra = {"stream_options": {"include_usage": True}} if ep.openai_root else {}
    if ignore_eos:
        extra["ignore_eos"] = True
    result, api, pieces, last = RequestResult(), {}, [], None
    sent = time.perf_counter()
    try:
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_completion_tokens=max_tokens, temperature=temperature,
                                                stream=True, extra_body=extra or None)
        for chunk in stream:
            now = time.perf_counter()
            text = "".join((c.delta.content or "") for c in chunk.choices if c.delta is not None)
            if text:
                if last is None:
                    result.ttft_s = now - sent
                else:
                    result.itl_s.append(now - last)
                last = now
                pieces.append(text)
            usage = usage_of(chunk)
            if usage is not None:
                result.prompt_tokens = int(usage.prompt_tokens or 0)
                result.completion_tokens = int(usage.completion_tokens or 0)
                api = {k: getattr(usage, k, None) for k in API_TIMES}
    except groq.GroqError as exc:
        result.error = one_line(exc)
        return Run(result, api)
    result.text = "".join(pieces)
    if last is None:
        result.error = "no streamed chunk carried text"
    elif not result.completion_tokens:
        result.error = "the API reported no usage for the stream"
    else:
        result.e2el_s = last - sent
        result.success = True
    return Run(result, api)


def api_ms(runs: list[Run], key: str) -> float | None:
    """The mean of what the API reported for `key` over the runs, in ms (None if it never did)."""
    values = [r.api.get(key) for r in runs if r.api.get(key) is not None]
    return 1e3 * statistics.fmean(values) if values else None
