"""phase5.long_prompt on a CPU (float32, tiny model, small sizes): both kinds of rows run, pass
their token checks and carry sane ITL / TTFT metrics and predictions; with chunking the streams
keep making tokens while the long prompt is prefilled (without it at most the step in flight); bad sizes are
refused with exit 2 and one line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.paths import REPO_ROOT
from phases.phase5_inference import long_prompt
from phases.phase5_inference.benchmark.workload import random_prompts
from phases.phase5_inference.engine import EngineConfig, LLMEngine, named, random_weights
from phases.phase5_inference.greedy_near_tie import compare_greedy, tie_tolerance

LAB = [sys.executable, "-m", "common.cli"]
SMALL = ["--param", "streams=4", "--param", "long_tokens=300", "--param", "token_budget=64",
         "--param", "prefix_tokens=96", "--param", "suffix_tokens=8", "--param", "repeats=2"]

pytestmark = pytest.mark.usefixtures("two_torch_threads")


def lab(*args, timeout=300):
    return subprocess.run([*LAB, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ})


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("long_prompt")
    proc = lab("run", "phase5.long_prompt", "--device", "cpu", "--results", str(out), *SMALL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [path] = sorted((out / "phase5" / "long_prompt").rglob("*.json"))
    return json.loads(Path(path).read_text())


def rows_by_variant(record: dict) -> dict:
    return {r["variant"]: r for r in record["rows"]}


def test_every_row_is_checked_timed_and_predicted(record):
    assert record["status"] == "ok", record.get("reason")
    rows = rows_by_variant(record)
    assert set(rows) == {"chunked", "unchunked", "prefix-cache", "no-prefix-cache"}
    for r in rows.values():
        assert r["status"] == "ok", (r["variant"], r["reason"])
        assert r["check"]["passed"]
        assert r["prediction"]["predicted_ms"] > 0 and r["prediction"]["measured_over_predicted"] > 0
        # fp32: the strict path, no divergence accepted as a near-tie (the tolerance is a few fp32 ulps)
        assert r["check"]["near_tie_divergences"] == 0 and r["metrics"]["near_tie_divergences"] == 0
        assert r["metrics"]["near_tie_margins"] == [] and r["check"]["near_tie_tolerance"] < 1e-5
        assert r["metrics"]["near_tie_noises"] == [] and r["metrics"]["near_tie_tolerances"] == []
        assert r["check"]["near_tie_noise_cap"] < 1e-4


def test_itl_rows_carry_sane_latencies_and_predictions(record):
    rows = rows_by_variant(record)
    for variant in ("chunked", "unchunked"):
        m = rows[variant]["metrics"]
        assert m["itl_max_ms"] >= m["itl_p99_ms"] >= m["itl_median_ms"] > 0
        assert m["itl_p99_over_median"] >= 1 and m["long_ttft_ms"] > 0 and m["itl_count"] > 0
        assert m["steady_itl_median_ms"] > 0 and m["itl_p99_over_steady_median"] > 0
        assert m["predicted_itl_p99_ms"] >= m["predicted_decode_step_ms"] > 0
    on, off = rows["chunked"]["metrics"], rows["unchunked"]["metrics"]
    assert on["chunk_tokens"] == 64 - 4 and off["chunk_tokens"] == 300
    # the roofline: a mixed step of 60 prompt tokens costs less than the whole prefill plus a decode step
    assert on["predicted_itl_p99_ms"] < off["predicted_itl_p99_ms"]
    assert on["itl_max_vs_unchunked"] > 0
    assert "itl_p99_over_median" in record["summary"] and "ttft_a_over_b" in record["summary"]


def test_shared_prefix_rows_find_the_prefix_cached_only_with_caching_on(record):
    rows = rows_by_variant(record)
    on, off = rows["prefix-cache"]["metrics"], rows["no-prefix-cache"]["metrics"]
    assert on["b_cached_prompt_tokens"] == 96 and off["b_cached_prompt_tokens"] == 0
    for m in (on, off):
        assert m["ttft_a_ms"] > 0 and m["ttft_b_ms"] > 0 and m["ttft_a_over_b"] > 0
    assert on["predicted_ttft_a_over_b"] > 1 and off["predicted_ttft_a_over_b"] == pytest.approx(1.0)


def stream_tokens_during_prefill(run: dict) -> list[int]:
    """Tokens each stream made after the long prompt arrived and before its first token."""
    return [sum(run["arrived_s"] < c < run["long_first_s"] for c in clocks) for clocks in run["stream_clocks"]]


def test_chunking_lets_streams_decode_through_the_long_prefill_and_keeps_their_tokens():
    """Deterministic (step counts, not clocks): with a 64-token budget a 300-token prompt is
    prefilled over 5 mixed steps that each carry every stream's decode row; without chunking it is
    one step in which no stream makes a token (a stream may still read
    the decode step in flight when the prompt arrived). The greedy tokens are the same either way."""
    shape = named("tiny")
    weights = random_weights(shape, seed=0, dtype=torch.float32)
    params = {"warm_tokens": 3, "long_output_tokens": 3}
    streams = random_prompts(4, 8, shape.vocab_size, 0)
    long = random_prompts(1, 300, shape.vocab_size, 1)[0]
    runs = {}
    for chunked, budget in ((True, 64), (False, 8192)):
        engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu", max_model_len=320,
                                        enable_chunked_prefill=chunked, max_num_batched_tokens=budget),
                           weights=weights)
        runs[chunked] = long_prompt.streams_with_long_prompt(engine, streams, long, params)
        assert not engine.has_unfinished()
    assert min(stream_tokens_during_prefill(runs[True])) >= 4        # 5 chunks: tokens from the first 4 steps
    assert max(stream_tokens_during_prefill(runs[False])) <= 1      # at most the decode step already in flight
    sequences = long_prompt.itl_sequences(runs[True], runs[False], streams, long)
    check = compare_greedy(sequences, never_replayed, tie_tolerance("fp32"), "chunked on and off")
    assert check["passed"] and check["near_tie_divergences"] == 0 and check["sequences_compared"] == 5
    assert len(long_prompt.window_itls_ms(runs[True])) > len(long_prompt.window_itls_ms(runs[False]))


def never_replayed(tokens):
    raise AssertionError("a replay was asked for where the runs agree")


class CpuContext:
    is_cuda = False

    def synchronize(self):
        pass


def wrong_when(setting: str, weights: dict, made: list):
    """make_engine for the rows: an engine with `setting` on gets perturbed weights (a stand-in for a wrong
    kernel); every engine's settings are logged in `made`."""
    generator = torch.Generator().manual_seed(1)
    wrong = {k: v + 0.02 * torch.randn(v.shape, generator=generator) for k, v in weights.items()}

    def make_engine(max_num_seqs, **settings):
        made.append({"max_num_seqs": max_num_seqs, **settings})
        return LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu", max_num_seqs=max_num_seqs,
                                      **settings), weights=wrong if settings.get(setting) else weights)
    return make_engine


def test_a_wrong_chunked_engine_fails_the_gate_with_a_clear_margin():
    """The chunked engine's weights perturbed: its streams' tokens diverge from the unchunked run's where
    the best two are clearly apart (or the other setting's replay, on the same wrong weights, moves the
    logits by more than rounding), and both ITL rows fail without a timing. The divergences were replayed
    unchunked and then chunked, in chunks of half the shortest prompt (every replay split)."""
    shape = named("tiny")
    made = []
    make_engine = wrong_when("enable_chunked_prefill", random_weights(shape, seed=0, dtype=torch.float32), made)
    params = {"streams": 2, "long_tokens": 100, "stream_prompt_tokens": 8, "warm_tokens": 3, "long_output_tokens": 3,
              "token_budget": 32, "block_size": 16, "seed": 0}
    rows = long_prompt.itl_rows(CpuContext(), params, shape, make_engine, "fp32")
    assert [r["status"] for r in rows] == ["failed", "failed"]
    for r in rows:
        assert r["timing"] is None and not r["check"]["passed"]
        assert "differs between chunked prefill on and off" in r["reason"]
        assert any(words in r["reason"] for words in ("margin", "not both among a replay's best", "not rounding"))
    replays = [m for m in made if m["max_num_seqs"] == 1]
    assert [(m["enable_chunked_prefill"], m["max_num_batched_tokens"]) for m in replays] == [(False, 8192), (True, 4)]


def test_a_wrong_prefix_cached_engine_fails_the_gate_and_is_replayed_with_the_prefix_cached():
    """The caching engine's weights perturbed: A's and B's tokens diverge from the uncached run's and both
    prefix rows fail. The divergences were replayed uncached, then on an engine with caching on."""
    shape = named("tiny")
    made = []
    make_engine = wrong_when("enable_prefix_caching", random_weights(shape, seed=0, dtype=torch.float32), made)
    params = {"prefix_tokens": 48, "suffix_tokens": 8, "output_tokens": 3, "repeats": 1, "block_size": 16, "seed": 0}
    rows = long_prompt.prefix_rows(CpuContext(), params, shape, make_engine, "fp32")
    assert [r["status"] for r in rows] == ["failed", "failed"]
    assert all("differs between prefix caching on and off" in r["reason"] for r in rows)
    replays = [m for m in made if m["max_num_seqs"] == 1 and "enable_chunked_prefill" in m]
    assert [m["enable_prefix_caching"] for m in replays] == [False, True]


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert long_prompt.percentile(values, 50) == 50 and long_prompt.percentile(values, 99) == 99
    assert long_prompt.percentile([7.0], 99) == 7.0


@pytest.mark.parametrize("args, words", [
    (["--param", "streams=64", "--param", "token_budget=32"], "token_budget"),
    (["--param", "prefix_tokens=100", "--param", "suffix_tokens=100"], "suffix_tokens"),
    (["--param", "long_tokens=1"], "long_tokens"),
    (["--param", "kinds=[everything]"], "kinds"),
])
def test_bad_params_exit_2_with_one_line(args, words, tmp_path):
    proc = lab("run", "phase5.long_prompt", "--device", "cpu", "--results", str(tmp_path), *args, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], proc.stderr
