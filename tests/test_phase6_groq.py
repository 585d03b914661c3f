"""Phase 6's Groq exercise, offline: Groq's official SDK pointed at the lab's own OpenAI-compatible
server on loopback (the tiny engine on the CPU). The seed's method end to end, a record that holds
no key, a missing key and an unreachable host as skips with one-line reasons, a stream that breaks
mid-way as a failed row, and the key kept out of error messages."""
import json
import socket

import pytest
import torch

pytest.importorskip("groq")
pytest.importorskip("aiohttp")
pytest.importorskip("tokenizers")

from common.exercise import Context  # noqa: E402
from common.records import problems  # noqa: E402
from common.registry import select  # noqa: E402
from common.runner import run_one  # noqa: E402
from phases.phase5_inference.engine import EngineConfig, LLMEngine, load_tokenizer  # noqa: E402
from phases.phase5_inference.engine.server import ServerThread  # noqa: E402
from phases.phase6_hardware import groq_client  # noqa: E402

TINY = dict(model="tiny", dtype="float32", device="cpu", max_model_len=256)
KEY = "gsk_" + "k3y" * 12                      # looks like a Groq key: the record validator would flag it


@pytest.fixture(scope="module")
def server():
    with ServerThread(LLMEngine(EngineConfig(**TINY)), load_tokenizer(), "tiny") as running:
        yield running


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv("GROQ_API_KEY", KEY)
    monkeypatch.delenv("GROQ_BASE_URL", raising=False)


def groq_record(base_url: str, static_for, **overrides) -> dict:
    [ex] = select(["phase6.groq_api"])
    ctx = Context(torch.device("cpu"), None, "cpu", (), True)
    params = ex.resolve_params(True, True, {"base_url": base_url, "models": ["tiny"], "hardware": None,
                                            "ignore_eos": True, "output_tokens": 6, "runs": 2, **overrides})
    return run_one(ex, ctx, params, static_for(ctx), None, None)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_seed_method_through_the_sdk_on_loopback(server, key, static_for):
    rec = groq_record(server.base_url + "/v1", static_for)
    assert rec["status"] == "ok", rec["reason"]
    [r] = rec["rows"]
    m = r["metrics"]
    assert r["check"]["passed"] and r["timing"]["samples"] == 2 and r["timing"]["warmup_calls"] == 1
    assert m["completion_tokens_mean"] == 6 and m["prompt_tokens"] > 60           # from the server's usage
    assert 0 < m["network_rtt_ms"] < m["ttft_mean_ms"] and m["decode_tok_s"] == pytest.approx(1e3 / m["tpot_ms"], rel=0.3)
    assert m["api_queue_ms"] is None and m["ttft_rest_ms"] == pytest.approx(m["ttft_mean_ms"] - m["network_rtt_ms"])
    assert m["served_by"].startswith("OpenAI-compatible server at 127.0.0.1:") and m["sdk"].startswith("groq ")
    assert r["prediction"]["excluded"].startswith("a remote API")
    text = json.dumps(rec)
    assert KEY not in text and problems(json.loads(text)) == []


def test_groq_times_are_read_from_x_groq(monkeypatch):
    """Groq's final chunk carries its own times; they land in the split of TTFT."""
    from types import SimpleNamespace as NS
    usage = NS(prompt_tokens=97, completion_tokens=200, queue_time=0.02, prompt_time=0.004, completion_time=0.3)
    assert groq_client.usage_of(NS(x_groq=NS(usage=usage), usage=None)) is usage
    runs = [groq_client.Run(None, {"queue_time": 0.02, "prompt_time": 0.004}), groq_client.Run(None, {"queue_time": 0.04})]
    assert groq_client.api_ms(runs, "queue_time") == pytest.approx(30.0)
    assert groq_client.api_ms(runs, "completion_time") is None


def test_missing_key_is_a_skip_with_one_line(server, monkeypatch, static_for):
    monkeypatch.delenv("GROQ_API_KEY", raising=False)
    rec = groq_record(server.base_url + "/v1", static_for)
    assert rec["status"] == "skipped" and rec["reason"] == "needs the environment variable GROQ_API_KEY; not set"


def test_unreachable_base_url_is_a_parameter_error_and_the_default_api_a_skip(key, static_for, monkeypatch):
    """A base_url the user gave that does not answer is their mistake (exit 2, as phase 5's base_url);
    the default endpoint out of reach (no network here) is a skip."""
    from common.params import ParamError
    url = f"http://127.0.0.1:{closed_port()}/v1"
    with pytest.raises(ParamError, match=f"--param base_url={url}: no route to {url}"):
        groq_record(url, static_for)
    monkeypatch.setenv("GROQ_BASE_URL", url)
    rec = groq_record(None, static_for)
    assert rec["status"] == "skipped" and rec["rows"] == []
    assert rec["reason"].startswith(f"no route to the API at {url}") and "\n" not in rec["reason"]


def test_a_stream_that_breaks_mid_way_fails_its_row(key, static_for):
    engine = LLMEngine(EngineConfig(**TINY))
    real_step, steps = engine.step, []

    def failing_step():                          # prefill and a few decode steps, then the engine dies
        steps.append(1)
        if len(steps) > 4:
            raise RuntimeError("simulated device fault")
        return real_step()
    engine.step = failing_step
    with ServerThread(engine, load_tokenizer(), "tiny") as running:
        rec = groq_record(running.base_url + "/v1", static_for, warmups=0, output_tokens=50)
    assert rec["status"] == "failed"
    [r] = rec["rows"]
    assert r["status"] == "failed" and r["timing"] is None
    assert "simulated device fault" in r["reason"] and "\n" not in r["reason"]


def test_error_messages_never_carry_the_key(key):
    class Leaky(Exception):
        status_code = 401
        body = {"error": {"message": f"Invalid API Key {KEY}"}}
    assert groq_client.one_line(Leaky()) == "HTTP 401: Invalid API Key ***"


def test_base_urls(monkeypatch):
    groq = groq_client.endpoint(None)
    assert (groq.base_url, groq.openai_root, groq.port, groq.is_groq, groq.label) == \
        ("https://api.groq.com", False, 443, True, "api.groq.com")
    monkeypatch.setenv("GROQ_BASE_URL", "http://127.0.0.1:8000/v1/")
    local = groq_client.endpoint(None)
    assert (local.openai_root, local.port, local.is_groq, local.label) == (True, 8000, False, "127.0.0.1:8000")
    assert groq_client.safe_url("https://u:p@host.example/v1?k=s") == "https://host.example/v1"
    with pytest.raises(ValueError, match="not an http"):
        groq_client.endpoint("ftp://x")
