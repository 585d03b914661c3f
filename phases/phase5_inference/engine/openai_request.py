"""An OpenAI request body, checked and turned into what the engine runs: prompts (token ids),
one SamplingParams per choice, stop strings and what the answer carries; ApiError, the HTTP error
with OpenAI's body, for everything refused.

Runs on a worker thread (it tokenizes), cheap checks first: a text prompt longer than
max_model_len x the vocabulary's longest token cannot fit and is refused before it is tokenized.
Fields follow OpenAI's, with vLLM's meaning where OpenAI's is silent; a field this server does not
implement is refused by name, never ignored (NO_OP_VALUES: the one value of such a field that asks
for nothing).
"""
from dataclasses import replace
from typing import TYPE_CHECKING

from aiohttp import web

from .sample_groups import sample_seed
from .sequence import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from .server import Serving

DEFAULT_COMPLETION_MAX_TOKENS = 16        # OpenAI's default for /v1/completions


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
                yield p * self.n + j, p, replace(self.params, seed=sample_seed(self.params.seed, j))


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
