"""Phase 5's OpenAI-compatible server on loopback, over the real tiny engine (CPU, fp32): the
official `openai` client (completions and chat, streaming and not, usage, include_usage), raw HTTP
for the error paths (400, 404, 503), a disconnect mid-stream (blocks freed, others keep being
served), the engine-stats endpoint, the tokenizer and its incremental detokenizer."""
import asyncio
import json
import time

import pytest

aiohttp = pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")
pytest.importorskip("tokenizers")

from phases.phase5_inference.engine import EngineConfig, LLMEngine, SamplingParams, load_tokenizer  # noqa: E402
from phases.phase5_inference.engine.server import ServerThread  # noqa: E402

TINY = dict(model="tiny", dtype="float32", device="cpu", max_model_len=256)
HTTP_TIMEOUT_S = 30


def tiny_engine(**overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(**{**TINY, **overrides}))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def server(tokenizer):
    with ServerThread(tiny_engine(), tokenizer, "tiny") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)


def post(url: str, body, raw: bool = False) -> tuple[int, dict]:
    """One POST with aiohttp (its own loop): status and JSON body."""
    async def go():
        timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            data = body if raw else json.dumps(body)
            async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as response:
                return response.status, await response.json(content_type=None)
    return asyncio.run(go())


def get_json(url: str) -> dict:
    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)) as session:
            async with session.get(url) as response:
                assert response.status == 200, await response.text()
                return await response.json()
    return asyncio.run(go())


def wait_for(condition, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# ---------------------------------------------------------------------- tokenizer
def test_gpt2_tokenizer_ids_and_round_trip(tokenizer):
    assert tokenizer.encode("Hello world") == [15496, 995]          # GPT-2's ids (tiktoken's `gpt2`)
    text = "Héllo, 日本語 — naïve café\n  spaces"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.eos_token_id == 50256 and tokenizer.chat_template == "plain"
    assert tokenizer.decode([15496, 50300]) == "Hello"                # ids beyond the vocabulary: nothing


def test_incremental_detokenizer_emits_only_complete_characters(tokenizer):
    ids = tokenizer.encode("Hello 日本語 🙂 end")
    assert any(tokenizer.decode([i]) == "\ufffd" for i in ids)       # characters split across tokens
    detokenizer = tokenizer.detokenizer(prompt_ids=tokenizer.encode("prompt"))
    pieces = [detokenizer.add([i]) for i in ids] + [detokenizer.flush()]
    assert "".join(pieces) == "Hello 日本語 🙂 end"
    assert not any("\ufffd" in p for p in pieces)


def test_chat_templates(tokenizer, tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert tokenizer.render_chat(messages) == "system: Be brief.\nuser: Hi\nassistant:"
    with pytest.raises(ValueError, match="role"):
        tokenizer.render_chat([{"content": "no role"}])
    # A checkpoint folder with Llama 3's special tokens gets the Llama 3 template and its EOS ids.
    from tokenizers import Tokenizer, models, pre_tokenizers
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "Hi": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                "<|end_header_id|>", "<|eot_id|>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 3, "bos_token_id": 2}))
    llama = load_tokenizer(tmp_path)
    assert llama.chat_template == "llama-3" and llama.eos_token_ids == (3, 6) and llama.bos_token_id == 2
    assert llama.render_chat([{"role": "user", "content": "Hi"}]) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert llama.encode_chat([{"role": "user", "content": "Hi"}]) == [2, 4, 0, 5, 1, 6, 4, 0, 5]


# ---------------------------------------------------------------------- the openai client
def test_completion_matches_offline_engine(client, tokenizer):
    prompt = "The quick brown fox"
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.object == "text_completion" and reply.model == "tiny"
    assert reply.choices[0].finish_reason == "length"
    prompt_ids = tokenizer.encode(prompt)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == \
        (len(prompt_ids), 12, len(prompt_ids) + 12)
    offline = tiny_engine().generate([prompt_ids], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert reply.choices[0].text == tokenizer.decode(offline)


def test_streaming_equals_non_streaming_and_reports_usage(client):
    ids = [464, 2068, 7586, 21831, 18045]
    whole = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    token_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert len(token_chunks) == 10                                  # one event per generated token
    assert "".join(c.choices[0].text for c in token_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in token_chunks] == [None] * 9 + ["length"]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 10
    assert usage_chunk.usage.prompt_tokens == 5 and usage_chunk.usage.total_tokens == 15
    plain = list(client.completions.create(model="tiny", prompt=ids, max_tokens=3, stream=True))
    assert all(c.choices for c in plain) and len(plain) == 3       # no usage chunk unless asked


def test_chat_completions_streaming_and_not(client, tokenizer):
    messages = [{"role": "user", "content": "Say hello"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(tokenizer.encode("user: Say hello\nassistant:"))
    assert reply.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model="tiny", prompt=[1, 2, 3], max_tokens=8, temperature=1.0, top_p=0.9, seed=7,
                  extra_body={"ignore_eos": True, "top_k": 50})
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first


def test_models_health_and_stats(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert get_json(server.base_url + "/health") == {"status": "ok"}
    client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, extra_body={"ignore_eos": True})
    stats = get_json(server.base_url + "/v1/engine/stats?steps=1")
    assert stats["prefill_steps"] >= 1 and stats["decode_steps"] >= 3
    assert stats["decode_step_ms"]["median"] > 0 and stats["telemetry"]["max_model_len"] == 256
    assert stats["recent_steps"][-1]["kind"] in ("prefill", "decode")
    post(server.base_url + "/v1/engine/stats/reset", {})
    assert get_json(server.base_url + "/v1/engine/stats")["steps"] == 0


def test_idle_engine_thread_sleeps(client, server, monkeypatch):
    engine = server.async_engine.engine
    calls = []
    real_step = engine.step
    monkeypatch.setattr(engine, "step", lambda: calls.append(1) or real_step())
    client.completions.create(model="tiny", prompt=[1, 2], max_tokens=3, extra_body={"ignore_eos": True})
    busy_calls = len(calls)
    time.sleep(0.3)
    assert busy_calls >= 3 and len(calls) == busy_calls               # no step() without work


# ---------------------------------------------------------------------- error paths
@pytest.mark.parametrize("body, status, param, match", [
    ("{not json", 400, None, "malformed JSON"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": -3}, 400, "max_tokens", ">= 1"),
    ({"model": "tiny", "prompt": [7] * 300, "max_tokens": 1}, 400, "prompt", "maximum context length"),
    ({"model": "tiny", "prompt": [7] * 250, "max_tokens": 10}, 400, "max_tokens", "maximum context length"),
    ({"model": "gpt-nothing", "prompt": "hi"}, 404, "model", "does not exist"),
    ({"model": "tiny", "prompt": "hi", "temperature": -1}, 400, "temperature", "temperature"),
    ({"model": "tiny", "prompt": "hi", "n": 100}, 400, "n", "n must be <= 64"),
    ({"model": "tiny", "prompt": "hi", "response_format": {"type": "json_object"}}, 400, "response_format",
     "unsupported field 'response_format'"),
    ({"model": "tiny", "prompt": "hi", "suffix": "x"}, 400, "suffix", "unsupported field 'suffix'"),
    ({"model": "tiny", "prompt": "hi", "best_of": 3}, 400, "best_of", "best_of"),
    ({"model": "tiny", "prompt": "hi", "stop": ["x"] * 1000}, 400, "stop", "at most 64"),
    ({"model": "tiny", "prompt": "hi", "stop": ["x"] * 1_000_000}, 413, None, "this server takes at most"),
    ({"model": "tiny", "prompt": "x" * 16 * 2**20}, 413, None, "this server takes at most"),
    ({"model": "tiny", "prompt": "hi", "stop": "\ud800"}, 400, "stop", "not valid Unicode"),
    ({"model": "tiny", "prompt": "a\ud800b"}, 400, "prompt", "not valid Unicode"),
    ({"model": "tiny", "prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias", "outside the vocabulary"),
    ({"model": "tiny", "prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias", "[-100, 100]"),
    ({"model": "tiny", "prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty", "presence_penalty"),
    ({"model": "tiny", "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty", "repetition_penalty"),
    ({"model": "tiny", "prompt": "hi", "min_p": 1.5}, 400, "min_p", "min_p"),
    ({"model": "tiny", "prompt": "hi", "min_tokens": 50, "max_tokens": 5}, 400, "min_tokens", "min_tokens"),
    ({"model": "tiny", "prompt": "hi", "logprobs": 21}, 400, "logprobs", "logprobs must be <= 20"),
    ({"model": "tiny", "prompt": "x" * 300 * 128}, 400, "prompt", "at least 300 tokens"),
    ("[" * 100_000 + "]" * 100_000, 400, None, "malformed JSON"),
    ({"model": "tiny", "prompt": [1, 10**6]}, 400, "prompt", "outside the vocabulary"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt", "empty"),
    ({"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
])
def test_completion_errors_are_openai_shaped(server, body, status, param, match):
    code, reply = post(server.base_url + "/v1/completions", body, raw=isinstance(body, str))
    assert code == status
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"} and match in error["message"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_unimplemented_fields_pass_only_at_their_no_op_value(server):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for field, value in (("tools", []), ("tool_choice", "none"), ("response_format", {"type": "text"})):
        code, reply = post(server.base_url + "/v1/chat/completions", {**chat, field: value})
        assert code == 200, reply
    for field, value in (("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
                         ("response_format", {"type": "json_object"}), ("functions", [{"name": "f"}])):
        code, reply = post(server.base_url + "/v1/chat/completions", {**chat, field: value})
        assert code == 400 and reply["error"]["param"] == field and f"unsupported field '{field}'" in \
            reply["error"]["message"]


def test_chat_errors_and_unknown_route(server):
    code, reply = post(server.base_url + "/v1/chat/completions", {"model": "tiny", "messages": []})
    assert code == 400 and reply["error"]["param"] == "messages"
    code, reply = post(server.base_url + "/v1/nothing-here", {})
    assert code == 404 and "error" in reply


def test_openai_client_raises_on_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=0)


async def _open_stream(session, url: str, max_tokens: int):
    """Start a streaming request and return its response once the first event has arrived."""
    body = {"model": "tiny", "prompt": [11, 12, 13], "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    response = await session.post(url, json=body)
    assert response.status == 200, await response.text()
    assert (await response.content.readuntil(b"\n\n")).startswith(b"data: ")
    return response


def test_queue_full_answers_503(tokenizer):
    with ServerThread(tiny_engine(), tokenizer, "tiny", max_queue=1) as small:
        url = small.base_url + "/v1/completions"

        async def go():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)) as session:
                holder = await _open_stream(session, url, max_tokens=200)
                async with session.post(url, json={"model": "tiny", "prompt": "hi", "max_tokens": 2}) as busy:
                    status, reply = busy.status, await busy.json()
                holder.close()
                return status, reply
        status, reply = asyncio.run(go())
        assert status == 503 and reply["error"]["code"] == "queue_full"
        wait_for(lambda: small.async_engine.num_in_flight == 0, what="the held request to be aborted")
        assert small.async_engine.num_aborted == 1
        assert post(url, {"model": "tiny", "prompt": "hi", "max_tokens": 2})[0] == 200


def test_disconnect_mid_stream_frees_blocks_and_others_continue(tokenizer):
    engine = tiny_engine()
    total_blocks = engine.telemetry["num_kv_blocks"]
    with ServerThread(engine, tokenizer, "tiny") as running:
        url = running.base_url + "/v1/completions"

        async def go():
            timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
            async with aiohttp.ClientSession(timeout=timeout) as leaver, aiohttp.ClientSession(timeout=timeout) as stayer:
                other = asyncio.ensure_future(stayer.post(url, json={
                    "model": "tiny", "prompt": [21, 22, 23, 24], "max_tokens": 150, "ignore_eos": True}))
                body = {"model": "tiny", "prompt": [9] * 200, "max_tokens": 50, "stream": True, "ignore_eos": True}
                doomed = await leaver.post(url, json=body)          # 200 prompt tokens: 13 blocks
                assert (await doomed.content.readuntil(b"\n\n")).startswith(b"data: ")
                doomed.connection.transport.abort()                # the client vanishes mid-stream
                doomed.close()
                await asyncio.to_thread(wait_for, lambda: running.async_engine.num_in_flight <= 1,
                                        10.0, "the disconnected request to be aborted")
                # the loop forgets the request at once; the engine thread frees its blocks at its next
                # step. The other request holds at most ceil(154 / 16) = 10 blocks; the aborted one's come back
                await asyncio.to_thread(wait_for, lambda: engine.num_free_blocks >= total_blocks - 10,
                                        10.0, "the aborted request's blocks back in the pool")
                free_after_abort = engine.num_free_blocks
                still_running = not other.done()
                response = await other
                return free_after_abort, still_running, response.status, await response.json()
        free_after_abort, still_running, status, reply = asyncio.run(go())
        assert running.async_engine.num_aborted == 1 and free_after_abort >= total_blocks - 10
        print(f"the other request was {'still' if still_running else 'no longer'} running when the blocks came back")
        assert status == 200 and reply["usage"]["completion_tokens"] == 150
        assert reply["choices"][0]["finish_reason"] == "length"
        wait_for(lambda: engine.num_free_blocks == total_blocks, what="every KV block back in the pool")
        assert not engine.has_unfinished()
        assert post(url, {"model": "tiny", "prompt": "again", "max_tokens": 3})[0] == 200


def test_disconnect_while_waiting_for_a_whole_completion_aborts_it(tokenizer):
    with ServerThread(tiny_engine(), tokenizer, "tiny") as running:
        async def go():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as session:
                with pytest.raises(asyncio.TimeoutError):       # the client gives up and closes the socket
                    await session.post(running.base_url + "/v1/completions", json={
                        "model": "tiny", "prompt": [5, 6], "max_tokens": 250, "ignore_eos": True})
        asyncio.run(go())
        wait_for(lambda: running.async_engine.num_aborted == 1, what="the abandoned request to be aborted")
        wait_for(lambda: not running.async_engine.engine.has_unfinished(), what="the engine to be idle")


def test_shutdown_ends_open_streams(tokenizer):
    running = ServerThread(tiny_engine(), tokenizer, "tiny").start()
    url = running.base_url + "/v1/completions"

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)) as session:
            response = await _open_stream(session, url, max_tokens=200)
            stopping = asyncio.get_running_loop().run_in_executor(None, running.stop)
            rest = await response.content.read()
            await stopping
            return rest
    started = time.monotonic()
    rest = asyncio.run(go())
    assert time.monotonic() - started < 10
    assert b"engine_stopped" in rest and not running.async_engine.alive
