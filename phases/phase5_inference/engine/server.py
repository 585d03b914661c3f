"""An OpenAI-compatible HTTP server over the lab's engine, on aiohttp.web: POST /v1/completions and
/v1/chat/completions (streaming as server-sent events, with stream_options.include_usage), GET
/v1/models, /v1/models/{id}, /health and /metrics (Prometheus), and GET /v1/engine/stats (the
engine's step times beside what a client measures; POST /v1/engine/stats/reset starts a new window).

The request fields follow OpenAI's, with vLLM's semantics where OpenAI's are silent: `stop` strings
(held back while streaming until they cannot match; include_stop_str_in_output), stop_token_ids
(the stop token's text is not output), logprobs (completions: an int; chat: logprobs + top_logprobs;
of the raw logits, the chosen token among the top), `echo` with prompt logprobs (max_tokens 0 with
echo returns the prompt alone: lm-evaluation-harness's loglikelihood), `n` (choice j of a seeded
request draws from seed + j; each choice is its own engine request, prefilled on its own), a batch
of prompts, presence / frequency / repetition penalties, logit_bias, min_p, min_tokens, top_k,
ignore_eos, return_token_ids. Any other field with a value is a 400 naming it.

Errors have OpenAI's body, {"error": {"message", "type", "param", "code"}}: 400 for malformed JSON or
bad parameters (including a prompt that leaves no room in the context), 401 without the --api-key,
404 for an unknown model or route, 413 for a body larger than the longest prompt could need, 503
when `max_queue` requests are already in flight. A client that disconnects cancels its handler
(handler_cancellation), which aborts the request and frees its KV blocks.

Nothing slow runs on the event loop: large bodies are parsed, prompts tokenized and echo answers
serialized on worker threads, and a text prompt that cannot fit (more characters than
max_model_len x the longest token) is refused before it is tokenized.

Each SSE event is written as soon as its token exists: aiohttp sets TCP_NODELAY on every connection,
so no Nagle delay holds small events back. Run it with `python -m phases.phase5_inference.engine.server`
(or `lab serve`), which checks every option, prints one line with the URL once the model is loaded
and the port is open, and exits 130 on SIGINT, 143 on SIGTERM.
"""
import argparse
import asyncio
import json
import hmac
import signal
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from aiohttp import web

from common.errors import LabError, Terminated

from .async_engine import AsyncEngine, EngineStopped, QueueFull
from .decode_attention import BACKENDS as ATTENTION_BACKENDS
from .metrics import ServerMetrics
from .sequence import MAX_LOGPROBS, SamplingParams
from .stop_strings import StopStrings

DEFAULT_MAX_QUEUE = 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16        # OpenAI's default for /v1/completions
SHUTDOWN_TIMEOUT_S = 5.0
WORKER_THREADS = 2                        # parsing, tokenizing and serializing large bodies
JSON_ESCAPE_BYTES_PER_CHAR = 12           # the most bytes JSON spends on one character (an escaped surrogate pair)
ENGINE_KEY = web.AppKey("async_engine", AsyncEngine)
SERVING_KEY = web.AppKey("serving", object)


class ApiError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 error_type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.error_type = error_type or ("invalid_request_error" if status < 500 else "server_error")

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}
        response = web.json_response(body, status=self.status)
        if self.status == 413:
            response.force_close()      # no lingering to drain the unread body on the event loop
        return response


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


class Serving:
    """What the handlers share: the engine wrapper, the tokenizer, the model's name and limits, the
    metrics, and the worker threads that parse, tokenize and serialize large bodies."""

    def __init__(self, async_engine: AsyncEngine, tokenizer, served_model_name: str,
                 max_model_len: int | None = None, vocab_size: int | None = None, api_key: str | None = None):
        engine = async_engine.engine
        telemetry = getattr(engine, "telemetry", {}) or {}
        self.async_engine = async_engine
        self.tokenizer = tokenizer
        self.model_name = served_model_name
        self.max_model_len = int(max_model_len or telemetry.get("max_model_len")
                                 or getattr(getattr(engine, "config", None), "max_model_len", None) or 2**31)
        self.vocab_size = int(vocab_size or engine.shape.vocab_size)
        self.max_token_chars = tokenizer.max_token_chars
        self.api_key = api_key
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        self._workers = ThreadPoolExecutor(max_workers=WORKER_THREADS, thread_name_prefix="lab-serve-parse")

    @property
    def max_body_bytes(self) -> int:
        """A body that could hold the longest prompt this model takes, JSON-escaped, and room for the rest."""
        return 2**20 + JSON_ESCAPE_BYTES_PER_CHAR * self.max_model_len * self.max_token_chars

    async def off_loop(self, fn, *args):
        """fn(*args) on a worker thread: the event loop keeps serving other streams meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._workers, fn, *args)

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------- request parsing
COMMON_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop", "seed", "user",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "min_tokens",
    "ignore_eos", "stop_token_ids", "include_stop_str_in_output", "return_token_ids"})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "logprobs", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
# fields this server does not implement, at the one value that asks for nothing (what it does anyway)
NO_OP_VALUES = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "suffix": "",
                "parallel_tool_calls": False}
MAX_N = 64                      # choices per prompt
MAX_PROMPTS = 256               # prompts in one completions request
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024           # one stop string
MAX_LOGIT_BIAS = 1024           # entries


class GenerationRequest:
    """A validated completions or chat request: its prompts (ids, and text for echo), one
    SamplingParams per choice (n per prompt), stop strings, and what the answer carries."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.prompts: list[list[int]] = []
        self.prompt_texts: list[str | None] = []      # a string prompt as sent (echo), else None
        self.n = 1
        self.params = None                            # the SamplingParams every choice starts from
        self.max_tokens = 1                           # as asked (0: echo only; the engine still runs one token)
        self.stop: list[str] = []
        self.include_stop_str = False
        self.echo = False
        self.logprobs: int | None = None              # top logprobs per token (completions' int, chat's top_logprobs)
        self.stream = self.include_usage = self.return_token_ids = False

    def choices(self):
        """(choice index, prompt index, SamplingParams) of every choice: prompt-major, as OpenAI numbers them;
        choice j of a seeded request draws from seed + j."""
        for p in range(len(self.prompts)):
            for j in range(self.n):
                seed = None if self.params.seed is None else (self.params.seed + j) % 2**63
                yield p * self.n + j, p, replace(self.params, seed=seed)


def parse_request(body: dict, serving: "Serving", chat: bool) -> GenerationRequest:
    """Turn a request body into a GenerationRequest, or raise ApiError (400 / 404). Runs off the
    event loop (it tokenizes); cheap checks go first so an oversized prompt costs no tokenizing."""
    model = body.get("model")
    if model is not None and model != serving.model_name:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{serving.model_name}`.",
                       "model", "model_not_found")
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name, value in body.items():
        if name not in known and value is not None and (name not in NO_OP_VALUES or value != NO_OP_VALUES[name]):
            raise bad_request(f"unsupported field '{name}': this server does not implement it", name)
    parsed = GenerationRequest(chat)
    parsed.stream = _boolean(body, "stream", False)
    stream_options = body.get("stream_options")
    if stream_options is not None and (not parsed.stream or not isinstance(stream_options, dict)
                                       or set(stream_options) - {"include_usage"}):
        raise bad_request("stream_options must be an object with include_usage, and only with stream=true",
                          "stream_options")
    parsed.include_usage = _boolean(stream_options or {}, "include_usage", False)
    parsed.return_token_ids = _boolean(body, "return_token_ids", False)
    parsed.n = _integer(body, "n", 1, minimum=1, maximum=MAX_N)
    if body.get("best_of") is not None and body["best_of"] != parsed.n:
        raise bad_request("best_of other than n is not supported", "best_of")
    parsed.stop = _stop_strings(body.get("stop"))
    parsed.include_stop_str = _boolean(body, "include_stop_str_in_output", False)
    parsed.echo = _boolean(body, "echo", False)
    parsed.logprobs = _chat_logprobs(body) if chat else _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    if chat:
        parsed.prompts, parsed.prompt_texts = [_chat_prompt(body, serving)], [None]
    else:
        parsed.prompts, parsed.prompt_texts = _completion_prompts(body, serving)
    longest = max(len(p) for p in parsed.prompts)
    param = "messages" if chat else "prompt"
    if longest >= serving.max_model_len:
        raise bad_request(f"The prompt is {longest} tokens; this model's maximum context length is "
                          f"{serving.max_model_len} tokens, which leaves no room to generate.", param)
    max_field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    default_max = serving.max_model_len - longest if chat else DEFAULT_COMPLETION_MAX_TOKENS
    parsed.max_tokens = _integer(body, max_field, default_max, minimum=0 if parsed.echo else 1)
    if longest + max(parsed.max_tokens, 1) > serving.max_model_len:
        raise bad_request(f"This model's maximum context length is {serving.max_model_len} tokens. However, "
                          f"you requested {longest + parsed.max_tokens} tokens ({longest} in the "
                          f"prompt, {parsed.max_tokens} in the completion).", max_field)
    ignore_eos = _boolean(body, "ignore_eos", False)
    stop_ids = _token_list(body.get("stop_token_ids") or [], serving.vocab_size, "stop_token_ids")
    if chat and not ignore_eos:
        stop_ids += [i for i in serving.tokenizer.eos_token_ids if i not in stop_ids]
    top_k = _integer(body, "top_k", 0, minimum=-1)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0.0:
        raise bad_request("top_p must be in (0, 1]", "top_p")
    params = SamplingParams(max_tokens=max(parsed.max_tokens, 1),
                            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                            top_k=max(top_k, 0),             # vLLM's -1 means off, as 0 does here
                            top_p=top_p, seed=_integer(body, "seed", None),
                            ignore_eos=ignore_eos, stop_token_ids=tuple(stop_ids),
                            presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
                            frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
                            repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 100.0),
                            logit_bias=_logit_bias(body.get("logit_bias"), serving.vocab_size),
                            min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
                            min_tokens=_integer(body, "min_tokens", 0, minimum=0),
                            logprobs=parsed.logprobs,
                            prompt_logprobs=parsed.logprobs if parsed.echo and parsed.logprobs is not None else None)
    try:
        params.validate()
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), field if field in known else None) from None
    parsed.params = params
    return parsed


def _chat_logprobs(body: dict) -> int | None:
    """Chat's logprobs (true / false) and top_logprobs (0..20, only with logprobs) as one count."""
    wanted = _boolean(body, "logprobs", False)
    top = _integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not wanted:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    return (top or 0) if wanted else None


def _stop_strings(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS}", "stop")
    for s in stops:
        if len(s) > MAX_STOP_CHARS:
            raise bad_request(f"a stop string has {len(s)} characters; at most {MAX_STOP_CHARS}", "stop")
        _utf8(s, "stop")
    return [s for s in stops if s]


def _logit_bias(bias, vocab_size: int) -> dict | None:
    """OpenAI's {"token id as a string": bias}: ids in the vocabulary, biases in [-100, 100]."""
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to numbers", "logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request(f"logit_bias values must be numbers in [-100, 100], got {value!r}", "logit_bias")
        out[token] = float(value)
    return out


def _utf8(text: str, param: str) -> str:
    """`text`, or a 400 if it holds a lone surrogate (JSON's "\\ud800" parses, but is no text)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{param} is not valid Unicode: {exc.reason} at character {exc.start}", param) from None
    return text


def _check_text_length(chars: int, serving: "Serving", param: str) -> None:
    """A text of `chars` characters is at least chars / max_token_chars tokens: refuse one that cannot
    fit before tokenizing it."""
    at_least = chars // serving.max_token_chars
    if at_least >= serving.max_model_len:
        raise bad_request(f"The prompt is {chars} characters, at least {at_least} tokens; this model's maximum "
                          f"context length is {serving.max_model_len} tokens.", param)


def _completion_prompts(body: dict, serving: "Serving") -> tuple[list[list[int]], list[str | None]]:
    """A string, a list of token ids, or a batch of either."""
    prompt = body.get("prompt")
    is_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    batch = prompt if isinstance(prompt, list) and not is_ids else [prompt]
    if not batch or len(batch) > MAX_PROMPTS:
        raise bad_request(f"prompt must be a string, a list of token ids, or a batch of 1 to {MAX_PROMPTS} of them",
                          "prompt")
    texts = []
    for item in batch:
        if isinstance(item, str):
            _check_text_length(len(item), serving, "prompt")
            texts.append(_utf8(item, "prompt"))
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            texts.append(None)
        else:
            raise bad_request("prompt must be a string, a list of token ids, or a batch of either", "prompt")
    encoded = iter(serving.tokenizer.encode_batch([t for t in texts if t is not None]))
    ids = [next(encoded) if text is not None else _token_list(item, serving.vocab_size, "prompt")
           for item, text in zip(batch, texts)]
    if any(not p for p in ids):
        raise bad_request("prompt must not be empty", "prompt")
    return ids, texts


def _chat_prompt(body: dict, serving: "Serving") -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    chars = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        parts = [content] if isinstance(content, str) else \
            [p.get("text") for p in content if isinstance(p, dict)] if isinstance(content, list) else []
        for part in parts:
            if isinstance(part, str):
                chars += len(part)
                _utf8(part, "messages")
    _check_text_length(chars, serving, "messages")
    try:
        return serving.tokenizer.encode_chat(messages)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None


def _token_list(ids, vocab_size: int, param: str) -> list[int]:
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad_request(f"{param} must be a list of token ids", param)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} in {param} is outside the vocabulary [0, {vocab_size})", param)
    return list(ids)


def _integer(body: dict, name: str, default, minimum: int | None = None, maximum: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got {value!r}", name)
    if minimum is not None and value < minimum:
        raise bad_request(f"{name} must be >= {minimum}, got {value}", name)
    if maximum is not None and value > maximum:
        raise bad_request(f"{name} must be <= {maximum}, got {value}", name)
    return value


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise bad_request(f"{name} must be a number in [{lo}, {hi}], got {value!r}", name)
    return float(value)


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {value!r}", name)
    return value


# ---------------------------------------------------------------------- handlers
OFF_LOOP_BODY_BYTES = 64 * 1024          # bodies larger than this are parsed on a worker thread


async def _json_body(request: web.Request, serving: "Serving") -> dict:
    """The body as a JSON object; a large one is parsed off the event loop. Malformed, too deeply
    nested or not an object: 400; over the size cap: 413 (aiohttp's, before it is all read)."""
    if request.content_length is not None and request.content_length > serving.max_body_bytes:
        raise ApiError(413, f"the request body is {request.content_length} bytes; this server takes at most "
                            f"{serving.max_body_bytes} (the longest prompt {serving.model_name} can take)",
                       code="413")       # said before reading any of it
    raw = await request.read()
    try:
        body = await serving.off_loop(json.loads, raw) if len(raw) > OFF_LOOP_BODY_BYTES else json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise bad_request("malformed JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request("the JSON body must be an object")
    return body


def _sse(obj) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


# ---------------------------------------------------------------------- generating
class Choice:
    """One choice of a request: its engine outputs turned into text (stop strings and stop tokens
    applied), token ids and logprobs entries, piece by piece."""

    def __init__(self, serving: "Serving", parsed: GenerationRequest, index: int, prompt_index: int, params,
                 arrived: float):
        self.serving, self.parsed, self.index, self.params = serving, parsed, index, params
        self.prompt_ids = parsed.prompts[prompt_index]
        self.prompt_text = parsed.prompt_texts[prompt_index]
        self.detokenizer = serving.tokenizer.detokenizer(self.prompt_ids)
        self.stops = StopStrings(parsed.stop, parsed.include_stop_str)
        self.ends_at_stop_token = set(params.stop_token_ids) | (set() if params.ignore_eos else
                                                                 set(serving.tokenizer.eos_token_ids))
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list = []                 # (token id, entry) per returned token
        self.finish_reason: str | None = None
        self.num_prompt_tokens = len(self.prompt_ids)
        self.num_output_tokens = 0
        self.prompt_logprobs = None
        self.outputs = None
        self.started = arrived                  # the request's arrival (perf_counter): TTFT counts its parsing
        self.first_token_s: float | None = None

    async def start(self, request_id: str):
        """The engine's first output (ApiError if the request cannot run)."""
        self.outputs = self.serving.async_engine.generate(self.prompt_ids, self.params, request_id)
        try:
            return await anext(self.outputs)
        except QueueFull as exc:
            raise ApiError(503, f"server busy: {exc}; retry later", code="queue_full") from None
        except EngineStopped as exc:
            raise ApiError(503, str(exc), code="engine_stopped") from None
        except ValueError as exc:
            raise bad_request(str(exc)) from None

    async def pieces(self, first):
        """(text, token ids, logprobs entries) of each engine output, from `first` on; the choice's
        finish_reason is set on the last. Ends early (aborting the engine's request) at a stop string."""
        out = first
        try:
            while True:
                piece = self._piece(out)
                yield piece
                if self.finish_reason is not None:
                    return
                out = await anext(self.outputs)
        except EngineStopped as exc:
            raise ApiError(503, str(exc), code="engine_stopped") from None
        finally:
            await self.outputs.aclose()
            self._record()

    def _piece(self, out) -> tuple[str, list[int], list]:
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.started
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        ids = list(out.new_token_ids)
        entries = list(out.logprobs or [])
        if self.parsed.max_tokens == 0:                  # echo only: the engine's one token is not returned
            ids, entries = [], []
            self.finish_reason = "length"
        self.num_output_tokens = len(self.token_ids) + len(ids)
        shown = ids
        if out.finish_reason == "stop" and ids and ids[-1] in self.ends_at_stop_token:
            shown = ids[:-1]                             # a stop token's own text is not output
        text, stopped = self.stops.add(self.detokenizer.add(shown))
        if out.finished and not stopped:
            more, stopped = self.stops.add(self.detokenizer.flush())
            text += more + ("" if stopped else self.stops.flush())
        self.token_ids += ids
        self.logprobs += list(zip(ids, entries))
        self.text += text
        if stopped:
            self.finish_reason = "stop"
        elif out.finished:
            self.finish_reason = self.finish_reason or out.finish_reason
        return text, ids, list(zip(ids, entries))

    def _record(self) -> None:
        reason = self.finish_reason or "abort"
        decode_s = time.perf_counter() - self.started - (self.first_token_s or 0.0)
        self.serving.metrics.finished(reason, self.num_prompt_tokens, self.num_output_tokens, self.first_token_s,
                                      decode_s if self.first_token_s is not None else None)

    # ------------------------------------------------------------------ echo and logprobs
    def echo_text(self) -> str:
        if self.prompt_text is not None:
            return self.prompt_text
        return self.serving.tokenizer.decode(self.prompt_ids)

    def completion_logprobs(self, entries, with_prompt: bool, offset: int) -> dict:
        """The legacy completions form: tokens, token_logprobs, top_logprobs (token text ->
        logprob, the chosen token among them as vLLM does), text_offset."""
        tokenizer = self.serving.tokenizer
        rows = []
        if with_prompt:
            rows.append((self.prompt_ids[0], None))
            rows += list(zip(self.prompt_ids[1:], self.prompt_logprobs or [None] * (len(self.prompt_ids) - 1)))
        rows += entries
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in rows:
            text = tokenizer.token_text(token)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            logprob, top = entry
            out["token_logprobs"].append(logprob)
            tops = {tokenizer.token_text(t): v for t, v in top}
            tops.setdefault(text, logprob)
            out["top_logprobs"].append(tops)
        return out

    def chat_logprobs(self, entries) -> dict:
        """Chat's form: content, one {token, logprob, bytes, top_logprobs} per token."""
        tokenizer = self.serving.tokenizer

        def item(token, logprob):
            text = tokenizer.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}
        return {"content": [{**item(token, logprob), "top_logprobs": [item(t, v) for t, v in top]}
                            for token, (logprob, top) in entries]}


def _choice_body(choice: Choice, chat: bool, text: str, entries, finish_reason, stream: bool,
                 first_event: bool = False, token_ids=None, echo: bool = False) -> dict:
    parsed = choice.parsed
    body = {"index": choice.index}
    logprobs = None
    if chat:
        body["delta" if stream else "message"] = (
            {"role": "assistant", "content": text} if first_event or not stream else {"content": text})
        if parsed.logprobs is not None:
            logprobs = choice.chat_logprobs(entries)
    else:
        shown = (choice.echo_text() + text) if echo else text
        body["text"] = shown
        if parsed.logprobs is not None:
            logprobs = choice.completion_logprobs(entries, echo, 0)
    body["logprobs"] = logprobs
    body["finish_reason"] = finish_reason
    if parsed.return_token_ids:
        body["token_ids"] = list(token_ids or [])
        if echo:
            body["prompt_token_ids"] = list(choice.prompt_ids)
    return body


async def _start_choices(serving, parsed, request_id: str, arrived: float) -> list[tuple[Choice, object]]:
    """Every choice's request in the engine and its first output, or ApiError with none left running."""
    choices = [Choice(serving, parsed, index, p, params, arrived) for index, p, params in parsed.choices()]
    suffix = len(choices) > 1
    firsts = await asyncio.gather(*(c.start(f"{request_id}-{c.index}" if suffix else request_id) for c in choices),
                                  return_exceptions=True)
    failed = next((f for f in firsts if isinstance(f, BaseException)), None)
    if failed is not None:
        for choice in choices:
            await choice.outputs.aclose()
        raise failed
    return list(zip(choices, firsts))


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    arrived = time.perf_counter()
    serving: Serving = request.app[SERVING_KEY]
    body = await _json_body(request, serving)
    parsed = await serving.off_loop(parse_request, body, serving, chat)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    started = await _start_choices(serving, parsed, request_id, arrived)
    head = {"id": request_id, "created": int(time.time()), "model": serving.model_name}
    try:
        if parsed.stream:
            return await _stream(request, serving, parsed, chat, head, started)
        return await _complete(serving, parsed, chat, head, started)
    finally:
        for choice, _ in started:
            await choice.outputs.aclose()


def _usage_of(choices: list[Choice], parsed: GenerationRequest) -> dict:
    prompt_tokens = sum(len(p) for p in parsed.prompts)
    completion = sum(c.num_output_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


async def _complete(serving, parsed, chat, head, started) -> web.Response:
    async def run(choice, first):
        entries, ids = [], []
        async for _, new_ids, new_entries in choice.pieces(first):
            ids += new_ids
            entries += new_entries
        build = (choice, chat, choice.text, entries, choice.finish_reason, False, False, ids, parsed.echo)
        if parsed.echo or parsed.logprobs is not None:      # a token's text per prompt or output token
            return await serving.off_loop(_choice_body, *build)
        return _choice_body(*build)
    bodies = await asyncio.gather(*(run(c, f) for c, f in started))
    body = {**head, "object": "chat.completion" if chat else "text_completion", "choices": list(bodies),
            "usage": _usage_of([c for c, _ in started], parsed)}
    text = await serving.off_loop(json.dumps, body) if parsed.echo else json.dumps(body)
    return web.Response(text=text, content_type="application/json")


async def _stream(request, serving, parsed, chat, head, started) -> web.StreamResponse:
    """One SSE event per engine step of each choice (choices interleaved as their tokens come), then
    the usage chunk if asked, then [DONE]. A write to a closed connection ends the handler; the
    caller closes every choice, which aborts what is unfinished."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    usage_field = {"usage": None} if parsed.include_usage else {}
    events: asyncio.Queue = asyncio.Queue()

    async def pump(choice, first):
        first_event = True
        try:
            async for text, ids, entries in choice.pieces(first):
                echo = parsed.echo and first_event and not chat
                events.put_nowait(_choice_body(choice, chat, text, entries, choice.finish_reason, stream=True,
                                               first_event=first_event, token_ids=ids, echo=echo))
                first_event = False
        except ApiError as exc:
            events.put_nowait(exc)
        events.put_nowait(None)

    tasks = [asyncio.create_task(pump(c, f)) for c, f in started]
    try:
        remaining = len(tasks)
        while remaining:
            event = await events.get()
            if event is None:
                remaining -= 1
            elif isinstance(event, ApiError):
                await response.write(_sse({"error": {"message": event.message, "type": event.error_type,
                                                     "param": None, "code": event.code}}))
            else:
                await response.write(_sse({**head, "choices": [event], **usage_field}))
        if parsed.include_usage:
            await response.write(_sse({**head, "choices": [], "usage": _usage_of([c for c, _ in started], parsed)}))
        await response.write(_sse("[DONE]"))
        await response.write_eof()
    except ConnectionResetError:            # the client left: the choices are closed by the caller
        pass
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


def _model_card(serving: Serving) -> dict:
    return {"id": serving.model_name, "object": "model", "created": serving.created, "owned_by": "lab",
            "max_model_len": serving.max_model_len}


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app[SERVING_KEY])]})


async def model(request: web.Request) -> web.Response:
    serving: Serving = request.app[SERVING_KEY]
    if request.match_info["model_id"] != serving.model_name:
        raise ApiError(404, f"The model `{request.match_info['model_id']}` does not exist; this server serves "
                            f"`{serving.model_name}`.", "model", "model_not_found")
    return web.json_response(_model_card(serving))


async def metrics(request: web.Request) -> web.Response:
    """Prometheus' text format (version 0.0.4)."""
    serving: Serving = request.app[SERVING_KEY]
    text = serving.metrics.render(serving.async_engine.engine, serving.async_engine.num_in_flight)
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if engine.error is not None:
        raise ApiError(503, f"engine failed: {engine.error!r}", code="engine_stopped")
    return web.json_response({"status": "ok"})


async def engine_stats(request: web.Request) -> web.Response:
    include_steps = request.query.get("steps", "0") not in ("0", "false", "")
    stats = request.app[ENGINE_KEY].stats(include_steps=include_steps)
    return web.Response(text=json.dumps(stats, default=str), content_type="application/json")


async def reset_engine_stats(request: web.Request) -> web.Response:
    request.app[ENGINE_KEY].reset_stats()
    return web.json_response({"status": "ok"})


@web.middleware
async def openai_errors(request: web.Request, handler):
    """Every error as OpenAI's JSON body: ours, aiohttp's (404 route, 405 method, 413 body too
    large), and bugs (500); with --api-key, /v1/ routes need `Authorization: Bearer <key>` (401)."""
    try:
        _check_api_key(request)
        return await handler(request)
    except ApiError as exc:
        request.app[SERVING_KEY].metrics.refused(exc.status)
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        request.app[SERVING_KEY].metrics.refused(exc.status)
        message = exc.text if exc.status == 413 and exc.text else exc.reason or "error"
        return ApiError(exc.status, message, code=str(exc.status)).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:
        print(f"lab serve: internal error on {request.path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error").response()


def _check_api_key(request: web.Request) -> None:
    key = request.app[SERVING_KEY].api_key
    if key is None or not request.path.startswith("/v1/"):
        return
    sent = request.headers.get("Authorization", "")
    if not hmac.compare_digest(sent.encode(), f"Bearer {key}".encode()):
        raise ApiError(401, "missing or wrong API key: send `Authorization: Bearer <key>`",
                       code="invalid_api_key", error_type="authentication_error")


def make_app(async_engine: AsyncEngine, tokenizer, served_model_name: str, max_model_len: int | None = None,
             vocab_size: int | None = None, api_key: str | None = None) -> web.Application:
    """The aiohttp application. `max_model_len` and `vocab_size` default to the engine's; bodies
    are capped at what the longest prompt could need (Serving.max_body_bytes)."""
    serving = Serving(async_engine, tokenizer, served_model_name, max_model_len, vocab_size, api_key)
    app = web.Application(middlewares=[openai_errors], client_max_size=serving.max_body_bytes)
    app[ENGINE_KEY] = async_engine
    app[SERVING_KEY] = serving
    app.on_cleanup.append(_close_serving)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model_id}", model)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/engine/stats", engine_stats)
    app.router.add_post("/v1/engine/stats/reset", reset_engine_stats)
    return app


async def _close_serving(app: web.Application) -> None:
    app[SERVING_KEY].close()


# ---------------------------------------------------------------------- running it
async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Listen on host:port (0: a free port); returns the runner and the base URL."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)     # a restart need not wait out TIME_WAIT
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise LabError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    bound_host, bound_port = runner.addresses[0][:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    return runner, f"http://{shown}:{bound_port}"


async def stop_site(runner: web.AppRunner, async_engine: AsyncEngine) -> None:
    """Stop the engine first (in-flight streams end at once with an error event), then the site."""
    await asyncio.to_thread(async_engine.shutdown)
    await runner.cleanup()


class ServerThread:
    """The server on its own event loop in a daemon thread (tests, notebooks): `base_url` once
    started; `stop()` (or leaving the `with`) shuts the engine and the site down."""

    def __init__(self, engine, tokenizer, served_model_name: str, host: str = "127.0.0.1", port: int = 0,
                 max_queue: int = DEFAULT_MAX_QUEUE, api_key: str | None = None):
        self.async_engine = AsyncEngine(engine, max_queue=max_queue)
        self.app = make_app(self.async_engine, tokenizer, served_model_name, api_key=api_key)
        self.host, self.port = host, port
        self.base_url: str | None = None
        self._loop = asyncio.new_event_loop()
        self._runner = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="lab-server", daemon=True)

    def start(self, timeout_s: float = 30.0) -> "ServerThread":
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        self._runner, self.base_url = future.result(timeout_s)
        return self

    async def _start(self):
        self.async_engine.start()
        return await start_site(self.app, self.host, self.port)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(stop_site(self._runner, self.async_engine), self._loop).result(timeout_s)
            self._runner = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(config, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          max_queue: int = DEFAULT_MAX_QUEUE, engine=None, api_key: str | None = None) -> int:
    """Load the engine (EngineConfig), listen, print one ready line with the URL, and serve until
    Ctrl-C or SIGTERM; then stop the engine and close the port. Blocks; returns the exit code the
    signal asks for (130 for SIGINT, 143 for SIGTERM). `engine`: one built already (rank 0's
    DrivenEngine under tensor parallelism)."""
    from .llm import LLMEngine
    from .tokenizer import load_tokenizer
    from .weights import resolve

    _, folder = resolve(config.model)
    tokenizer = load_tokenizer(folder)
    engine = LLMEngine(config) if engine is None else engine
    name = served_model_name or (folder.name if folder is not None else config.model)
    return asyncio.run(_serve_until_signal(engine, tokenizer, name, host, port, max_queue, api_key))


EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}        # 128 + the signal's number, as a shell reports it


async def _serve_until_signal(engine, tokenizer, name, host, port, max_queue, api_key=None) -> int:
    async_engine = AsyncEngine(engine, max_queue=max_queue)
    async_engine.start()
    runner, base_url = await start_site(make_app(async_engine, tokenizer, name, api_key=api_key), host, port)
    stop = asyncio.Event()
    received = []
    loop = asyncio.get_running_loop()
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.getsignal(sig)
            loop.add_signal_handler(sig, lambda sig=sig: (received.append(sig), stop.set()))
        except (NotImplementedError, RuntimeError, ValueError):     # not the main thread, or Windows
            previous.pop(sig, None)
    print(f"lab serve: {name} ready at {base_url} (OpenAI API under {base_url}/v1; Ctrl-C stops)", flush=True)
    try:
        await stop.wait()
    finally:
        for sig, handler in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler)
        await stop_site(runner, async_engine)
        print("lab serve: stopped", file=sys.stderr, flush=True)
    return EXIT_CODES[received[0]] if received else 0


# ---------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`lab serve`'s flags: EngineConfig's fields (dashes for underscores) and the server's own."""
    parser.add_argument("--model", default="tiny", help="a named shape (seeded random weights) or a checkpoint folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed in the ready line)")
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    parser.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                        help="requests in flight beyond which new ones get 503")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on /v1/ routes (401 otherwise)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                        help="default: bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                        help="decode eagerly (vLLM's --enforce-eager)")
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                        help="decode attention: auto (Triton on a GPU, the reference on a CPU), triton, flex, "
                             "reference")
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "int4"),
                        help="weight-only quantization of every layer's projections")
    parser.add_argument("--quant-path", default="fused", choices=("naive", "fused", "library"),
                        help="how quantized projections multiply: dequantize then cuBLAS, the Triton kernels, "
                             "or torch's tinygemm")
    parser.add_argument("--quant-group-size", type=int, default=128, help="int4 inputs per scale and zero point")
    parser.add_argument("--speculative-model", default="none",
                        help="speculative decoding: 'ngram' (prompt lookup), or a draft sharing the target's "
                             "vocabulary (a named shape or a checkpoint folder)")
    parser.add_argument("--num-speculative-tokens", type=int, default=0, help="k: tokens proposed per step (1..8)")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="split the model over N GPUs (N processes under torchrun; rank 0 serves)")
    parser.add_argument("--allreduce", default="auto", choices=("auto", "nccl", "one-shot"),
                        help="tensor parallel all-reduce: the faster of NCCL and a one-shot through symmetric "
                             "memory per size, or one of them")


ENGINE_FIELDS = ("model", "seed", "dtype", "device", "block_size", "gpu_memory_utilization", "num_kv_blocks",
                 "max_num_seqs", "max_num_batched_tokens", "max_model_len", "cuda_graphs", "attention_backend",
                 "quantization", "quant_path", "quant_group_size", "speculative_model", "num_speculative_tokens",
                 "tensor_parallel", "allreduce")


def config_from_args(args: argparse.Namespace):
    """The EngineConfig the flags ask for, checked before anything is loaded: a bad value, an unknown
    model, a missing GPU or a port already taken ends in one line (LabError), not after minutes of
    loading weights."""
    import socket

    from .llm import EngineConfig, backend_unavailable, fused_path_unavailable, pick_device
    from .weights import resolve

    config = EngineConfig(**{f: getattr(args, f) for f in ENGINE_FIELDS if f != "dtype"})
    device = pick_device(config.device)
    config.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    config.check()
    refused = fused_path_unavailable(config, device) or backend_unavailable(config, device)
    if refused:
        raise LabError(refused)
    if args.api_key is not None and not args.api_key.strip():
        raise LabError("--api-key must not be empty")
    shape, _ = resolve(config.model)
    if config.speculative_model not in ("none", "ngram"):
        resolve(config.speculative_model)
    if config.tensor_parallel > 1:
        _check_tensor_parallel(config, shape, device)
    if not 0 <= args.port <= 65535:
        raise LabError(f"--port {args.port}: not a TCP port (0 picks a free one)")
    if args.max_queue < 1:
        raise LabError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.port:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as the server binds: TIME_WAIT is no conflict
            try:
                probe.bind((args.host, args.port))
            except OSError as exc:
                raise LabError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    return config


def _check_tensor_parallel(config, shape, device) -> None:
    """--tensor-parallel N: the shape splits over N, and N GPUs are there (before torchrun starts)."""
    import os

    import torch

    from .tensor_parallel import unsplittable
    why = unsplittable(shape, config.tensor_parallel)
    if why:
        raise LabError(f"--tensor-parallel {config.tensor_parallel}: {why}")
    if device.type == "cuda" and "RANK" not in os.environ and torch.cuda.device_count() < config.tensor_parallel:
        raise LabError(f"--tensor-parallel {config.tensor_parallel} needs {config.tensor_parallel} GPUs; "
                       f"this machine has {torch.cuda.device_count()}")


def serve_from_args(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    config = config_from_args(args)
    kwargs = {"host": args.host, "port": args.port, "served_model_name": args.served_model_name,
              "max_queue": args.max_queue, "api_key": args.api_key}
    if config.tensor_parallel > 1:
        from . import tp_serve
        from .llm import pick_device
        if tp_serve.inside_torchrun():
            return tp_serve.rank_main(config, kwargs)
        return tp_serve.relaunch(list(sys.argv[1:] if argv is None else argv), config.tensor_parallel,
                                 pick_device(config.device).type)
    return serve(config, **kwargs)


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        raise LabError(f"{message} (see `{self.prog} --help`)")


def main(argv: list[str] | None = None) -> int:
    """`lab serve` and `python -m phases.phase5_inference.engine.server`: exit 2 with one line on bad input."""
    parser = _OneLineParser(prog="lab serve", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    try:
        return serve_from_args(parser.parse_args(argv), argv)
    except LabError as exc:
        print(f"lab serve: {exc}", file=sys.stderr)
        return exc.exit_code
    except Terminated:                  # SIGTERM while loading (`lab serve` turns it into this)
        print("lab serve: stopped by SIGTERM", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("lab serve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
