"""An OpenAI-compatible HTTP server over the lab's engine, on aiohttp.web: POST /v1/completions and
/v1/chat/completions (streaming as server-sent events, with stream_options.include_usage), GET
/v1/models and /health, and GET /v1/engine/stats (the engine's step times beside what a client
measures; POST /v1/engine/stats/reset starts a new window).

Errors have OpenAI's body, {"error": {"message", "type", "param", "code"}}: 400 for malformed JSON or
bad parameters (including a prompt that leaves no room in the context), 404 for an unknown model or
route, 503 when `max_queue` requests are already in flight. A client that disconnects cancels its
handler (handler_cancellation), which aborts the request and frees its KV blocks.

Each SSE event is written as soon as its token exists: aiohttp sets TCP_NODELAY on every connection,
so no Nagle delay holds small events back. Run it with `python -m phases.phase5_inference.engine.server`
(or `lab serve`), which prints one line with the URL once the model is loaded and the port is open.
"""
import argparse
import asyncio
import json
import signal
import sys
import threading
import time
import uuid
from contextlib import aclosing

from aiohttp import web

from common.errors import LabError

from .async_engine import AsyncEngine, EngineStopped, QueueFull

DEFAULT_MAX_QUEUE = 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16        # OpenAI's default for /v1/completions
SHUTDOWN_TIMEOUT_S = 5.0
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
        return web.json_response(body, status=self.status)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


class Serving:
    """What the handlers share: the engine wrapper, the tokenizer, the model's name and limits."""

    def __init__(self, async_engine: AsyncEngine, tokenizer, served_model_name: str,
                 max_model_len: int | None = None, vocab_size: int | None = None):
        engine = async_engine.engine
        telemetry = getattr(engine, "telemetry", {}) or {}
        self.async_engine = async_engine
        self.tokenizer = tokenizer
        self.model_name = served_model_name
        self.max_model_len = int(max_model_len or telemetry.get("max_model_len")
                                 or getattr(getattr(engine, "config", None), "max_model_len", None) or 2**31)
        self.vocab_size = int(vocab_size or engine.shape.vocab_size)
        self.created = int(time.time())


# ---------------------------------------------------------------------- request parsing
class GenerationRequest:
    """A validated completions or chat request: prompt ids, sampling parameters, streaming flags."""

    def __init__(self, prompt_ids: list[int], params, stream: bool, include_usage: bool, return_token_ids: bool = False):
        self.prompt_ids, self.params, self.stream, self.include_usage = prompt_ids, params, stream, include_usage
        self.return_token_ids = return_token_ids        # vLLM's extension: each choice carries its token ids


def parse_request(body: dict, serving: Serving, chat: bool) -> GenerationRequest:
    """Turn a request body into a GenerationRequest, or raise ApiError (400 / 404)."""
    from .sequence import SamplingParams

    model = body.get("model")
    if model is not None and model != serving.model_name:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{serving.model_name}`.",
                       "model", "model_not_found")
    _reject_unsupported(body, chat)
    prompt_ids = _chat_prompt(body, serving) if chat else _completion_prompt(body, serving)
    if len(prompt_ids) >= serving.max_model_len:
        raise bad_request(f"The prompt is {len(prompt_ids)} tokens; this model's maximum context length "
                          f"is {serving.max_model_len} tokens, which leaves no room to generate.",
                          "messages" if chat else "prompt")
    max_tokens_field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    default_max = serving.max_model_len - len(prompt_ids) if chat else DEFAULT_COMPLETION_MAX_TOKENS
    max_tokens = _integer(body, max_tokens_field, default_max, minimum=1)
    if len(prompt_ids) + max_tokens > serving.max_model_len:
        raise bad_request(f"This model's maximum context length is {serving.max_model_len} tokens. However, "
                          f"you requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the "
                          f"prompt, {max_tokens} in the completion).", max_tokens_field)
    stream = _boolean(body, "stream", False)
    stream_options = body.get("stream_options")
    if stream_options is not None and (not stream or not isinstance(stream_options, dict)):
        raise bad_request("stream_options must be an object, and only with stream=true", "stream_options")
    include_usage = bool((stream_options or {}).get("include_usage", False))
    ignore_eos = _boolean(body, "ignore_eos", False)
    stop_ids = _token_list(body.get("stop_token_ids") or [], serving.vocab_size, "stop_token_ids")
    if chat and not ignore_eos:
        stop_ids += [i for i in serving.tokenizer.eos_token_ids if i not in stop_ids]
    top_k = _integer(body, "top_k", 0, minimum=-1)
    params = SamplingParams(max_tokens=max_tokens,
                            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                            top_k=max(top_k, 0),             # vLLM's -1 means off, as 0 does here
                            top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
                            seed=_integer(body, "seed", None),
                            ignore_eos=ignore_eos, stop_token_ids=tuple(stop_ids))
    if params.top_p <= 0.0:
        raise bad_request("top_p must be in (0, 1]", "top_p")
    try:
        params.validate()
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return GenerationRequest(prompt_ids, params, stream, include_usage, _boolean(body, "return_token_ids", False))


def _reject_unsupported(body: dict, chat: bool) -> None:
    """Fields whose non-default values this server cannot honour: a 400, never silent ignoring."""
    if body.get("n") not in (None, 1):
        raise bad_request("only n=1 is supported", "n")
    if body.get("best_of") not in (None, 1):
        raise bad_request("only best_of=1 is supported", "best_of")
    if body.get("echo"):
        raise bad_request("echo is not supported", "echo")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise bad_request("logprobs are not supported", "logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise bad_request(f"{name} is not supported", name)
    if body.get("stop") not in (None, "", []):
        raise bad_request("stop strings are not supported; pass token ids as stop_token_ids", "stop")
    if chat and body.get("tools"):
        raise bad_request("tools are not supported", "tools")


def _completion_prompt(body: dict, serving: Serving) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                             # a batch of one prompt
    if isinstance(prompt, str):
        ids = serving.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = _token_list(prompt, serving.vocab_size, "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("one prompt per request is supported, not a batch of prompts", "prompt")
    else:
        raise bad_request("prompt must be a string or a list of token ids", "prompt")
    if not ids:
        raise bad_request("prompt must not be empty", "prompt")
    return ids


def _chat_prompt(body: dict, serving: Serving) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
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


def _integer(body: dict, name: str, default, minimum: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got {value!r}", name)
    if minimum is not None and value < minimum:
        raise bad_request(f"{name} must be >= {minimum}, got {value}", name)
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
async def _json_body(request: web.Request) -> dict:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the JSON body must be an object")
    return body


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(obj) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    serving: Serving = request.app[SERVING_KEY]
    body = await _json_body(request)
    parsed = parse_request(body, serving, chat)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    outputs = serving.async_engine.generate(parsed.prompt_ids, parsed.params, request_id)
    async with aclosing(outputs):
        try:
            first = await anext(outputs)
        except QueueFull as exc:
            raise ApiError(503, f"server busy: {exc}; retry later", code="queue_full") from None
        except EngineStopped as exc:
            raise ApiError(503, str(exc), code="engine_stopped") from None
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        head = {"id": request_id, "created": int(time.time()), "model": serving.model_name}
        if parsed.stream:
            return await _stream(request, serving, parsed, chat, head, first, outputs)
        return await _complete(serving, parsed, chat, head, first, outputs)


async def _complete(serving, parsed, chat, head, first, outputs) -> web.Response:
    detokenizer = serving.tokenizer.detokenizer(parsed.prompt_ids)
    text, out, token_ids = detokenizer.add(first.new_token_ids), first, list(first.new_token_ids)
    try:
        while not out.finished:
            out = await anext(outputs)
            text += detokenizer.add(out.new_token_ids)
            token_ids += out.new_token_ids
    except EngineStopped as exc:
        raise ApiError(503, str(exc), code="engine_stopped") from None
    text += detokenizer.flush()
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": out.finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": out.finish_reason}
    if parsed.return_token_ids:
        choice["token_ids"] = token_ids
    body = {**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
            "usage": _usage(out.num_prompt_tokens, out.num_output_tokens)}
    return web.json_response(body)


async def _stream(request, serving, parsed, chat, head, first, outputs) -> web.StreamResponse:
    """One SSE event per engine step of this request, then the usage chunk if asked, then [DONE].
    A write to a closed connection ends the handler; closing `outputs` aborts the request."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    usage_field = {"usage": None} if parsed.include_usage else {}
    detokenizer = serving.tokenizer.detokenizer(parsed.prompt_ids)
    out, first_event = first, True
    try:
        while True:
            text = detokenizer.add(out.new_token_ids) + (detokenizer.flush() if out.finished else "")
            if chat:
                delta = {"role": "assistant", "content": text} if first_event else {"content": text}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": out.finish_reason}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": out.finish_reason}
            if parsed.return_token_ids:
                choice["token_ids"] = list(out.new_token_ids)
            await response.write(_sse({**head, "choices": [choice], **usage_field}))
            first_event = False
            if out.finished:
                break
            out = await anext(outputs)
        if parsed.include_usage:
            await response.write(_sse({**head, "choices": [],
                                       "usage": _usage(out.num_prompt_tokens, out.num_output_tokens)}))
    except EngineStopped as exc:
        await response.write(_sse({"error": {"message": str(exc), "type": "server_error", "param": None,
                                             "code": "engine_stopped"}}))
    except ConnectionResetError:            # the client left: `outputs` is closed by the caller
        return response
    await response.write(_sse("[DONE]"))
    await response.write_eof()
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def models(request: web.Request) -> web.Response:
    serving: Serving = request.app[SERVING_KEY]
    card = {"id": serving.model_name, "object": "model", "created": serving.created, "owned_by": "lab",
            "max_model_len": serving.max_model_len}
    return web.json_response({"object": "list", "data": [card]})


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
    """Every error as OpenAI's JSON body: ours, aiohttp's (404 route, 405 method), and bugs (500)."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return ApiError(exc.status, exc.reason or "error", code=str(exc.status)).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:
        print(f"lab serve: internal error on {request.path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error").response()


def make_app(async_engine: AsyncEngine, tokenizer, served_model_name: str, max_model_len: int | None = None,
             vocab_size: int | None = None) -> web.Application:
    """The aiohttp application. `max_model_len` and `vocab_size` default to the engine's."""
    app = web.Application(middlewares=[openai_errors], client_max_size=64 * 2**20)
    app[ENGINE_KEY] = async_engine
    app[SERVING_KEY] = Serving(async_engine, tokenizer, served_model_name, max_model_len, vocab_size)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/engine/stats", engine_stats)
    app.router.add_post("/v1/engine/stats/reset", reset_engine_stats)
    return app


# ---------------------------------------------------------------------- running it
async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Listen on host:port (0: a free port); returns the runner and the base URL."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
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
                 max_queue: int = DEFAULT_MAX_QUEUE):
        self.async_engine = AsyncEngine(engine, max_queue=max_queue)
        self.app = make_app(self.async_engine, tokenizer, served_model_name)
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
          max_queue: int = DEFAULT_MAX_QUEUE, engine=None) -> None:
    """Load the engine (EngineConfig), listen, print one ready line with the URL, and serve until
    Ctrl-C or SIGTERM; then stop the engine and close the port. Blocks. `engine`: one built
    already (rank 0's DrivenEngine under tensor parallelism)."""
    from .llm import LLMEngine
    from .tokenizer import load_tokenizer
    from .weights import resolve

    _, folder = resolve(config.model)
    tokenizer = load_tokenizer(folder)
    engine = LLMEngine(config) if engine is None else engine
    name = served_model_name or (folder.name if folder is not None else config.model)
    asyncio.run(_serve_until_signal(engine, tokenizer, name, host, port, max_queue))


async def _serve_until_signal(engine, tokenizer, name, host, port, max_queue) -> None:
    async_engine = AsyncEngine(engine, max_queue=max_queue)
    async_engine.start()
    runner, base_url = await start_site(make_app(async_engine, tokenizer, name), host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.getsignal(sig)
            loop.add_signal_handler(sig, stop.set)
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


# ---------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`lab serve`'s flags: EngineConfig's fields (dashes for underscores) and the server's own."""
    parser.add_argument("--model", default="tiny", help="a named shape (seeded random weights) or a checkpoint folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed in the ready line)")
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    parser.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                        help="requests in flight beyond which new ones get 503")
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
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "int4"),
                        help="weight-only quantization of every layer's projections")
    parser.add_argument("--quant-path", default="auto", choices=("auto", "naive", "fused", "library", "cuda"),
                        help="how quantized projections multiply: auto (int4: the CUDA kernel where it runs, else "
                             "Triton), dequantize then cuBLAS, the Triton kernels, torch's tinygemm, or the CUDA "
                             "int4 kernel")
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

    from .llm import DTYPES, EngineConfig, fused_path_unavailable, pick_device, resolve_quant_path
    from .weights import resolve

    config = EngineConfig(**{f: getattr(args, f) for f in ENGINE_FIELDS if f != "dtype"})
    device = pick_device(config.device)
    config.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    config.check()
    config.quant_path = resolve_quant_path(config, device)
    refused = fused_path_unavailable(config, device)
    if refused:
        raise LabError(refused)
    shape, _ = resolve(config.model)
    if config.speculative_model not in ("none", "ngram"):
        resolve(config.speculative_model)
    if config.tensor_parallel > 1:
        _check_tensor_parallel(config, shape, device)
    from ..model_choice import refuse_unless_it_fits      # too large in the dtype it loads: refused now
    refuse_unless_it_fits(shape, DTYPES[config.dtype].itemsize, device, config.tensor_parallel)
    if not 0 <= args.port <= 65535:
        raise LabError(f"--port {args.port}: not a TCP port (0 picks a free one)")
    if args.max_queue < 1:
        raise LabError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.port:
        with socket.socket() as probe:
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
              "max_queue": args.max_queue}
    if config.tensor_parallel > 1:
        from . import tp_serve
        from .llm import pick_device
        if tp_serve.inside_torchrun():
            return tp_serve.rank_main(config, kwargs)
        return tp_serve.relaunch(list(sys.argv[1:] if argv is None else argv), config.tensor_parallel,
                                 pick_device(config.device).type)
    serve(config, **kwargs)
    return 0


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
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
