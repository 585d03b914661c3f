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
import os
import signal
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from common.errors import LabError, Terminated

from .async_engine import AsyncEngine
from .paged_attention import BACKENDS as ATTENTION_BACKENDS
from .metrics import ServerMetrics
from .openai_choice import Choice, choice_body
from .openai_request import ApiError, GenerationRequest, bad_request, parse_request

DEFAULT_MAX_QUEUE = 1024
SHUTDOWN_TIMEOUT_S = 5.0
API_KEY_ENV = "LAB_API_KEY"
WORKER_THREADS = 2                        # parsing, tokenizing and serializing large bodies
JSON_ESCAPE_BYTES_PER_CHAR = 12           # the most bytes JSON spends on one character (an escaped surrogate pair)
ENGINE_KEY = web.AppKey("async_engine", AsyncEngine)
SERVING_KEY = web.AppKey("serving", object)


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


async def _start_choices(serving, parsed, request_id: str, arrived: float) -> list[tuple[Choice, object]]:
    """Every choice's request in the engine and its first output, or ApiError with none left running."""
    choices = [Choice(serving, parsed, index, p, params, arrived) for index, p, params in parsed.choices()]
    suffix = len(choices) > 1

    def group_of(choice):       # n > 1: the choices of one prompt share its KV blocks (sample_groups.py)
        return f"{request_id}-prompt{choice.prompt_index}" if parsed.n > 1 else None
    firsts = await asyncio.gather(*(c.start(f"{request_id}-{c.index}" if suffix else request_id, group_of(c))
                                    for c in choices), return_exceptions=True)
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
            return await serving.off_loop(choice_body, *build)
        return choice_body(*build)
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
                events.put_nowait(choice_body(choice, chat, text, entries, choice.finish_reason, stream=True,
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
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"require `Authorization: Bearer KEY` on /v1/ routes (401 otherwise); default: "
                             f"${API_KEY_ENV} (which keeps the key out of the process list)")
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
    parser.add_argument("--enable-chunked-prefill", action="store_true",
                        help="steps of at most --max-num-batched-tokens tokens mixing prefill chunks with decode "
                             "rows, so a long prompt does not stop the running streams")
    parser.add_argument("--enable-prefix-caching", default=False, action=argparse.BooleanOptionalAction,
                        help="share the cached KV blocks of a prompt prefix seen before (default: off; refused "
                             "with speculative decoding)")
    parser.add_argument("--async-scheduling", default=None, action=argparse.BooleanOptionalAction,
                        help="launch each decode step before the last one's tokens are read (default: on where it "
                             "can run, not with speculative decoding or --tensor-parallel > 1; asked for there: refused)")


ENGINE_FIELDS = ("model", "seed", "dtype", "device", "block_size", "gpu_memory_utilization", "num_kv_blocks",
                 "max_num_seqs", "max_num_batched_tokens", "max_model_len", "cuda_graphs", "attention_backend",
                 "quantization", "quant_path", "quant_group_size", "speculative_model", "num_speculative_tokens",
                 "tensor_parallel", "allreduce", "enable_chunked_prefill", "enable_prefix_caching",
                 "async_scheduling")


def config_from_args(args: argparse.Namespace):
    """The EngineConfig the flags ask for, checked before anything is loaded: a bad value, an unknown
    model, a missing GPU or a port already taken ends in one line (LabError), not after minutes of
    loading weights."""
    import socket

    from .config import DTYPES, EngineConfig, backend_unavailable, fused_path_unavailable, pick_device, resolve_quant_path
    from .weights import resolve

    config = EngineConfig(**{f: getattr(args, f) for f in ENGINE_FIELDS if f != "dtype"})
    device = pick_device(config.device)
    config.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    config.check()
    config.quant_path = resolve_quant_path(config, device)
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
    from ..models.model_choice import refuse_unless_it_fits      # too large in the dtype it loads: refused now
    refuse_unless_it_fits(shape, DTYPES[config.dtype].itemsize, device, config.tensor_parallel)
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

    from .tp_shards import unsplittable
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
        from .config import pick_device
        if tp_serve.inside_torchrun():
            return tp_serve.rank_main(config, serve, kwargs)
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
