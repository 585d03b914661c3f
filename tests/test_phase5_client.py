"""Phase 5's benchmark client: its metrics on a real tiny server (token counts from the server's
usage, TTFT <= E2EL, the TPOT formula, goodput under SLOs, warmups excluded, 256 streams from one
process), its arrival schedule (seeded gamma gaps), its one-line error for an unreachable server,
and the server launched as a subprocess (`python -m ...engine.server`) and stopped cleanly."""
import socket
import time

import numpy as np
import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("tokenizers")

from common.errors import LabError  # noqa: E402
from phases.phase5_inference.benchmark.client import (  # noqa: E402
    RequestResult, RequestSpec, arrival_offsets_s, benchmark, launch_server, summarize, wait_until_ready)
from phases.phase5_inference.engine import EngineConfig, LLMEngine, load_tokenizer  # noqa: E402
from phases.phase5_inference.engine.server import ServerThread  # noqa: E402

TINY = dict(model="tiny", dtype="float32", device="cpu", max_model_len=256)


@pytest.fixture(scope="module")
def server():
    with ServerThread(LLMEngine(EngineConfig(**TINY)), load_tokenizer(), "tiny") as running:
        yield running


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- arrivals and arithmetic
def test_arrivals_are_seeded_gamma_gaps():
    first = arrival_offsets_s(2000, request_rate_per_s=50.0, burstiness=1.0, seed=3)
    assert first == arrival_offsets_s(2000, request_rate_per_s=50.0, burstiness=1.0, seed=3)
    assert first != arrival_offsets_s(2000, request_rate_per_s=50.0, burstiness=1.0, seed=4)
    gaps = np.diff(first)
    assert first[0] == 0.0 and np.all(gaps >= 0)
    assert abs(gaps.mean() - 1 / 50) < 0.1 / 50                        # mean gap 1/rate
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.1                    # Poisson: coefficient of variation 1
    bursty = np.diff(arrival_offsets_s(2000, request_rate_per_s=50.0, burstiness=0.25, seed=3))
    assert abs(bursty.mean() - 1 / 50) < 0.2 / 50 and bursty.std() / bursty.mean() > 1.6   # CV = 1/sqrt(0.25)
    assert arrival_offsets_s(4) == [0.0] * 4                            # an infinite rate: all at once
    with pytest.raises(LabError, match="burstiness"):
        arrival_offsets_s(3, 10.0, burstiness=0)


def test_summarize_follows_vllm_definitions():
    fast = RequestResult(success=True, ttft_s=0.010, itl_s=[0.002] * 4, e2el_s=0.018, prompt_tokens=7,
                         completion_tokens=5)
    slow = RequestResult(success=True, ttft_s=0.050, itl_s=[0.010] * 2, e2el_s=0.070, prompt_tokens=3,
                         completion_tokens=3)
    single = RequestResult(success=True, ttft_s=0.020, e2el_s=0.020, prompt_tokens=2, completion_tokens=1)
    failed = RequestResult(error="HTTP 500: boom")
    result = summarize([fast, slow, single, failed], duration_s=2.0, slos_ms={"ttft": 30, "tpot": 5})
    assert (result.completed, result.failed, result.errors) == (3, 1, ["HTTP 500: boom"])
    assert (result.total_input_tokens, result.total_output_tokens) == (12, 9)
    assert result.request_throughput_per_s == 1.5 and result.output_tokens_per_s == 4.5
    assert result.total_tokens_per_s == 10.5
    assert fast.tpot_s == pytest.approx(0.002) and slow.tpot_s == pytest.approx(0.010) and single.tpot_s == 0
    assert result.mean_tpot_ms == pytest.approx(6.0)                    # single-token requests excluded
    assert result.median_ttft_ms == pytest.approx(20.0) and result.mean_itl_ms == pytest.approx(28 / 6)
    assert result.request_goodput_per_s == 1.0                         # fast and single meet both SLOs
    assert result.request_rate_per_s is None and "requests" not in result.to_dict()


# ---------------------------------------------------------------------- against a real tiny server
def test_benchmark_metrics_on_tiny_server(server):
    prompts = [[3 + i, 40 + i, 500 + i, 7 * i + 1][: 2 + i % 3] for i in range(8)]
    requests = [RequestSpec(p, max_tokens=4 + i) for i, p in enumerate(prompts)]
    result = benchmark(server.base_url, requests, max_concurrency=4, num_warmups=2, ignore_eos=True,
                       slos_ms={"ttft": 60_000, "e2el": 60_000})
    assert result.model == "tiny" and result.num_requests == 8 and result.completed == 8, result.errors
    assert result.total_output_tokens == sum(r.max_tokens for r in requests)       # from usage
    assert result.total_input_tokens == sum(len(p) for p in prompts)
    for spec, r in zip(requests, result.requests):
        assert r.completion_tokens == spec.max_tokens and r.prompt_tokens == len(spec.prompt)
        assert 0 < r.ttft_s <= r.e2el_s
        assert len(r.itl_s) == r.completion_tokens - 1                 # one event per token
        assert r.tpot_s == pytest.approx((r.e2el_s - r.ttft_s) / (r.completion_tokens - 1))
        assert sum(r.itl_s) == pytest.approx(r.e2el_s - r.ttft_s)
    assert result.request_goodput_per_s == pytest.approx(result.request_throughput_per_s)
    assert result.mean_ttft_ms <= result.mean_e2el_ms and result.p99_itl_ms >= result.median_itl_ms
    # the engine's own step times over the timed run only (the warmups' steps were reset away)
    stats = result.engine_stats
    assert stats["decode_steps"] >= max(r.max_tokens for r in requests) - 1
    assert stats["decode_step_ms"]["median"] > 0
    strict = summarize(result.requests, result.duration_s, slos_ms={"ttft": 1e-6})
    assert strict.request_goodput_per_s == 0


def test_text_prompts_counts_come_from_usage(server):
    tokenizer = load_tokenizer()
    prompt = "To be, or not to be, that is the question"
    result = benchmark(server.base_url + "/v1", [RequestSpec(prompt, 5)], ignore_eos=True)
    assert result.completed == 1 and result.requests[0].prompt_tokens == len(tokenizer.encode(prompt))
    assert result.requests[0].text == tokenizer.decode(tokenizer.encode(result.requests[0].text))


def test_rate_limited_arrivals_follow_the_schedule(server):
    requests = [RequestSpec([1, 2, 3], 2) for _ in range(6)]
    result = benchmark(server.base_url, requests, request_rate_per_s=20.0, seed=11, ignore_eos=True)
    offsets = arrival_offsets_s(6, 20.0, 1.0, seed=11)
    assert result.completed == 6 and result.request_rate_per_s == 20.0
    for r, planned in zip(result.requests, offsets):
        assert planned - 0.001 <= r.start_s <= planned + 0.25


def test_one_process_drives_256_streams(server):
    requests = [RequestSpec([100 + i % 50, 7, 9], 2) for i in range(256)]
    result = benchmark(server.base_url, requests, ignore_eos=True)
    assert result.completed == 256 and result.total_output_tokens == 512, result.errors
    assert result.engine_stats["decode_step_mean_seqs"] > 16                # they were batched together


def test_failed_requests_are_counted_not_raised(server):
    result = benchmark(server.base_url, [RequestSpec([1, 2], 2), RequestSpec([1] * 300, 2)], ignore_eos=True)
    assert result.completed == 1 and result.failed == 1
    assert result.errors[0].startswith("HTTP 400") and "context length" in result.errors[0]


def test_unreachable_server_or_wrong_model_is_one_line_error(server):
    url = f"http://127.0.0.1:{closed_port()}"
    started = time.monotonic()
    with pytest.raises(LabError) as caught:
        benchmark(url, [RequestSpec([1, 2], 2)])
    message = str(caught.value)
    assert url in message and "\n" not in message and time.monotonic() - started < 10
    with pytest.raises(LabError, match="serves tiny, not 'llama'"):
        benchmark(server.base_url, [RequestSpec([1, 2], 2)], model="llama")
    with pytest.raises(LabError, match="not ready after 0.3 s"):
        wait_until_ready(url, timeout_s=0.3)


# ---------------------------------------------------------------------- the server as a subprocess
def test_launch_server_subprocess_serves_and_stops_cleanly(tmp_path):
    with launch_server({**TINY, "seed": 1}, ready_timeout_s=120, log_dir=tmp_path) as launched:
        assert launched.base_url.startswith("http://127.0.0.1:")
        result = benchmark(launched.base_url, [RequestSpec([1, 2, 3], 3)] * 2, ignore_eos=True)
        assert result.completed == 2 and result.total_output_tokens == 6
    assert launched.process.returncode == 130                           # Ctrl-C path: a clean stop, 128 + SIGINT
    assert "ready at" in (tmp_path / "stdout.log").read_text()


def test_launch_server_that_dies_reports_its_stderr():
    with pytest.raises(LabError, match="exited with code 2.*unknown model shape 'no-such-shape'"):
        with launch_server({"model": "no-such-shape", "device": "cpu"}, ready_timeout_s=120):
            pass
