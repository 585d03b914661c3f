"""Phase 5's async scheduling (engine/overlap.py) on a CPU: with decode step n+1 launched before step
n's tokens are read, every request's tokens equal those of the synchronous engine, token for
token (greedy and seeded sampling; batch 1 and mixed batches; stop tokens, arrivals mid-run,
preemption, abort, chunked prefill with prefix caching), the free-block count is exact afterwards,
each token is streamed once and in order, and the steps that must run synchronously are counted
under their reason. The CUDA-graph variant replays through a separate device-side input twin, so
the device-side gather of the previous step's tokens is what feeds each step.
"""
import asyncio
import functools
import json
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, clean_env

from common.errors import LabError
from phases.phase5_inference.engine import EngineConfig, LLMEngine, SamplingParams, named, random_weights
from phases.phase5_inference.engine import overlap
from phases.phase5_inference.engine.async_engine import AsyncEngine
from phases.phase5_inference.engine.cuda_graphs import CudaGraphs, graph_batch_sizes

pytestmark = pytest.mark.usefixtures("two_torch_threads")


@pytest.fixture(scope="module")
def weights():
    return random_weights(named("tiny"), seed=0, dtype=torch.float32)


def engine(weights, async_scheduling: bool, graphs: bool = False, **config) -> LLMEngine:
    eng = LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu", async_scheduling=async_scheduling,
                                 **config), weights=weights)
    if graphs:
        graph_stand_in(eng)
    return eng


def graph_stand_in(eng: LLMEngine) -> None:
    """The CUDA-graph bookkeeping on a CPU (as test_phase5_engine's padded-bucket test): inputs
    copied into a separate device-side twin, padded to a bucket, tokens from the graphs' shared
    argmax buffer (rewritten by every replay); a stand-in replays the graph's step eagerly."""
    runner = eng.runner
    sizes = graph_batch_sizes(runner.max_num_seqs)
    graphs = runner.graphs = CudaGraphs(runner, eng.max_model_len)
    graphs.decode_buffers(sizes)
    graphs.decode_graphs = {key: SimpleNamespace(replay=functools.partial(graphs.decode_step, *key))
                            for key in graphs.decode_keys(sizes)}
    inputs = runner.decode_inputs
    inputs.tensor = inputs._host.clone()
    inputs.is_cuda = True


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50257) for _ in range(length)]


def drive(eng: LLMEngine, requests: dict, arrivals: dict | None = None, aborts: dict | None = None) -> dict:
    """Step `eng` until done: `requests` {id: (prompt, params)} added at the step `arrivals` gives
    them (default 0), aborted at the step `aborts` gives. Checks the stream as it goes (each
    request's outputs: tokens once, in order, one finished output, last) and the pool after.
    {id: (tokens, finish reason)}."""
    arrivals, aborts = arrivals or {}, aborts or {}
    streamed = {rid: [] for rid in requests}
    finished = {}
    call = 0
    while len(finished) < len(requests):
        for rid, (prompt, params) in requests.items():
            if arrivals.get(rid, 0) == call:
                eng.add_request(prompt, params, request_id=rid)
        for rid, at in aborts.items():
            if at == call:
                eng.abort(rid)
        for out in eng.step():
            assert out.request_id not in finished, f"{out.request_id}: an output after its finished one"
            streamed[out.request_id] += out.new_token_ids
            assert out.num_output_tokens == len(streamed[out.request_id])
            if out.finished:
                finished[out.request_id] = out.finish_reason
        call += 1
        assert call < 10_000
    assert not eng.has_unfinished()
    eng.step()                                                   # a step still in flight: read and dropped
    assert eng.num_free_blocks == eng.scheduler.block_pool.num_blocks
    return {rid: (streamed[rid], finished[rid]) for rid in requests}


def both(weights, requests, arrivals=None, aborts=None, graphs=False, **config):
    """(synchronous result, overlapped result, the overlapped engine)."""
    sync = drive(engine(weights, False, graphs, **config), requests, arrivals, aborts)
    eng = engine(weights, True, graphs, **config)
    return sync, drive(eng, requests, arrivals, aborts), eng


def mixed_requests(count: int, seed: int, **params) -> dict:
    rng = random.Random(seed)
    return {f"r{i}": (prompt_of(rng.randrange(3, 120), seed=seed * 100 + i),
                      SamplingParams(max_tokens=rng.randrange(4, 30), ignore_eos=True, **params))
            for i in range(count)}


# ------------------------------------------------------------------------------ greedy, token for token
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-stand-in"])
def test_batch_1_greedy_equal_and_steps_run_ahead(weights, graphs):
    requests = {"one": (prompt_of(40, seed=1), SamplingParams(max_tokens=48, ignore_eos=True))}
    sync, ahead, eng = both(weights, requests, graphs=graphs)
    assert ahead == sync and len(sync["one"][0]) == 48 and sync["one"][1] == "length"
    stats = eng.telemetry["overlap"]
    # the prefill's token, one decode launched from the host's tokens, 46 launched ahead of the
    # previous one's readback; the 48th token is known to end the request: nothing launched past it
    assert stats["sync_steps"] == {"prefill": 1}
    assert stats["steps_ahead"] == 46 and stats["steps_read"] == 47
    assert stats["drains"] == {overlap.DRAIN_ALL_DONE: 1}
    assert stats["host_ms_per_step"] > 0


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-stand-in"])
def test_mixed_batch_with_stop_tokens_equal(weights, graphs):
    """Stop tokens end requests one step late under overlap: the extra token computed for them
    is dropped, never streamed; finish reasons and counts are the synchronous engine's."""
    requests = mixed_requests(8, seed=2)
    free_run = drive(engine(weights, False), requests)
    for i, rid in enumerate(list(requests)[:5]):       # five stop at a token they will meet
        prompt, params = requests[rid]
        tokens = free_run[rid][0]
        stop = tokens[min(i + 1, len(tokens) - 1)]
        requests[rid] = (prompt, SamplingParams(max_tokens=params.max_tokens, ignore_eos=True,
                                                stop_token_ids=(stop,)))
    sync, ahead, eng = both(weights, requests, graphs=graphs, max_num_seqs=8)
    assert ahead == sync
    assert sum(reason == "stop" for _, reason in sync.values()) >= 4
    assert eng.telemetry["overlap"]["steps_ahead"] > 10


def test_arrivals_mid_run_equal(weights):
    requests = mixed_requests(10, seed=3)
    arrivals = {rid: 3 * i for i, rid in enumerate(requests)}
    sync, ahead, eng = both(weights, requests, arrivals)
    assert ahead == sync
    stats = eng.telemetry["overlap"]
    assert stats["drains"].get(overlap.DRAIN_WAITING, 0) > 0 and stats["sync_steps"]["prefill"] >= 10


def test_preemption_under_a_small_pool_equal(weights):
    requests = mixed_requests(16, seed=4)
    sync, ahead, eng = both(weights, requests, num_kv_blocks=24, block_size=16)
    assert ahead == sync
    assert eng.num_preemptions > 0


def test_running_sequences_outgrowing_the_pool_drain_to_preempt(weights):
    """Nothing waits, but the pending tokens' slots do not fit: the step in flight is read and the
    scheduler preempts as usual; a preempted sequence that cannot be admitted back does not stop
    the others from running ahead."""
    requests = {f"g{i}": (prompt_of(20 + 3 * i, seed=40 + i), SamplingParams(max_tokens=60 + 5 * i, ignore_eos=True))
                for i in range(4)}
    sync, ahead, eng = both(weights, requests, num_kv_blocks=10, block_size=16)
    assert ahead == sync
    stats = eng.telemetry["overlap"]
    assert eng.num_preemptions > 0 and stats["drains"].get(overlap.DRAIN_PREEMPTION, 0) > 0
    assert stats["steps_ahead"] > 100


def test_abort_mid_run(weights):
    """An aborted request's streamed tokens are a prefix of its full run (the overlapped engine
    has read one step fewer when the abort comes), the others' are unchanged, the pool is whole."""
    requests = mixed_requests(6, seed=5)
    full = drive(engine(weights, False), requests)
    aborts = {"r1": 6, "r4": 9}
    sync, ahead, _ = both(weights, requests, aborts=aborts)
    for rid in requests:
        if rid in aborts:
            for run in (sync, ahead):
                tokens, reason = run[rid]
                assert reason == "abort" and tokens == full[rid][0][:len(tokens)]
        else:
            assert ahead[rid] == sync[rid] == full[rid]


def test_chunked_prefill_and_prefix_caching_equal(weights):
    shared = prompt_of(64, seed=6)
    requests = {f"p{i}": (shared + prompt_of(5 + 9 * i, seed=60 + i), SamplingParams(max_tokens=12 + i, ignore_eos=True))
                for i in range(6)}
    arrivals = {rid: 2 * i for i, rid in enumerate(requests)}
    sync, ahead, eng = both(weights, requests, arrivals, enable_chunked_prefill=True, enable_prefix_caching=True,
                            max_num_batched_tokens=48)
    assert ahead == sync
    assert eng.telemetry["cached_prompt_tokens"] > 0 and eng.telemetry["overlap"]["steps_ahead"] > 0


# ------------------------------------------------------------------------------ sampling
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-stand-in"])
def test_seeded_sampling_equal(weights, graphs):
    requests = {f"s{i}": (prompt_of(20 + 7 * i, seed=70 + i),
                          SamplingParams(max_tokens=10 + 3 * i, temperature=0.7 + 0.1 * i, top_k=[0, 50, 500][i % 3],
                                         top_p=[1.0, 0.9][i % 2], seed=1000 + i, ignore_eos=True))
                for i in range(5)}
    requests["g"] = (prompt_of(33, seed=79), SamplingParams(max_tokens=20, ignore_eos=True))
    sync, ahead, eng = both(weights, requests, graphs=graphs)
    assert ahead == sync
    assert len({tuple(t) for t, _ in sync.values()}) == len(requests)
    assert eng.telemetry["overlap"]["steps_ahead"] > 10


def test_host_bound_sampling_runs_synchronously_and_is_counted(weights):
    """Logprobs and logits processing read the host between steps: those steps run synchronously
    (counted by reason) and their results are the synchronous engine's."""
    requests = {"plain": (prompt_of(30, seed=80), SamplingParams(max_tokens=12, ignore_eos=True)),
                "logprobs": (prompt_of(25, seed=81), SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)),
                "penalty": (prompt_of(20, seed=82), SamplingParams(max_tokens=9, ignore_eos=True,
                                                                   repetition_penalty=1.3))}
    arrivals = {"plain": 0, "logprobs": 0, "penalty": 0}
    sync, ahead, eng = both(weights, requests, arrivals)
    assert ahead == sync
    counted = eng.telemetry["overlap"]["sync_steps"]
    assert counted.get(overlap.SYNC_LOGITS_PROCESSING, 0) > 0
    # alone, a logprobs request is counted under its own reason
    eng = engine(weights, True)
    drive(eng, {"lp": requests["logprobs"]})
    assert eng.telemetry["overlap"]["sync_steps"] == {"prefill": 1, overlap.SYNC_LOGPROBS: 5}


# ------------------------------------------------------------------------------ streaming through AsyncEngine
def test_async_engine_streams_each_token_once_in_order(weights):
    requests = mixed_requests(6, seed=9)
    expected = drive(engine(weights, False), requests)

    async def run():
        server = AsyncEngine(engine(weights, True))

        async def one(prompt, params):
            tokens, finals = [], 0
            async for out in server.generate(prompt, params):
                tokens += out.new_token_ids
                finals += out.finished
                assert out.num_output_tokens == len(tokens)
            return tokens, finals

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(p, sp) for p, sp in requests.values())), 120)
        finally:
            server.shutdown()

    results = asyncio.run(run())
    for rid, (tokens, finals) in zip(requests, results):
        assert finals == 1 and tokens == expected[rid][0]


# ------------------------------------------------------------------------------ the option
def test_option_is_refused_where_it_cannot_run(weights):
    with pytest.raises(LabError, match="async_scheduling is not supported with speculative decoding"):
        EngineConfig(async_scheduling=True, speculative_model="ngram", num_speculative_tokens=2).check()
    with pytest.raises(LabError, match="async_scheduling must be true, false or unset"):
        EngineConfig(async_scheduling="yes").check()
    assert LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu"), weights=weights).overlap
    speculating = LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu", speculative_model="ngram",
                                         num_speculative_tokens=2), weights=weights)
    assert not speculating.overlap and speculating.telemetry["async_scheduling"] is False


def test_switching_between_runs(weights):
    """set_async_scheduling flips the overlap between runs of one engine (the GPU A/B's way), with
    its stats started again; refused while a request is unfinished, and on under speculation."""
    eng = engine(weights, True)
    prompt = prompt_of(30, seed=90)
    ahead = eng.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))
    eng.set_async_scheduling(False)
    assert not eng.overlap and "overlap" not in eng.telemetry
    assert eng.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True)) == ahead
    eng.set_async_scheduling(True)
    assert eng.telemetry["overlap"]["steps_read"] == 0
    eng.add_request(prompt, SamplingParams(max_tokens=10))
    with pytest.raises(LabError, match="between runs only"):
        eng.set_async_scheduling(False)
    speculating = LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu", speculative_model="ngram",
                                         num_speculative_tokens=2), weights=weights)
    with pytest.raises(LabError, match="async_scheduling is not supported"):
        speculating.set_async_scheduling(True)


# ------------------------------------------------------------------------------ the GPU A/B script, on a CPU
def test_ab_script_runs_small_on_a_cpu_and_refuses_bad_input():
    script = [sys.executable, str(REPO / "scripts" / "overlap_ab.py")]
    bad = subprocess.run(script + ["--decode-tokens", "0"], capture_output=True, text=True, env=clean_env(), timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --decode-tokens must be >= 1"
    run = subprocess.run(script + ["--model", "tiny", "--device", "cpu", "--decode-tokens", "6", "--concurrency", "3",
                                   "--output-tokens", "4", "--offline-seqs", "3", "--offline-max-tokens", "12"],
                         capture_output=True, text=True, env=clean_env(), timeout=300)
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout)["results"]
    assert [r["workload"] for r in results] == ["batch-1 decode", "3 concurrent", "nano-vllm offline"]
    assert all(r["tokens_equal"] and r["on"]["overlap"]["steps_ahead"] > 0 for r in results)


# ------------------------------------------------------------------------------ on a GPU: real graphs, events, pinned buffers
def gpu_ab(dtype: str, requests: dict, arrivals=None, **config):
    """One GPU engine (its own seeded tiny weights, CUDA graphs), the requests run synchronously
    then overlapped (set_async_scheduling between the runs): (sync, ahead, engine)."""
    config = {"num_kv_blocks": 512, **config}           # a test-sized pool, not 90% of the GPU
    eng = LLMEngine(EngineConfig(model="tiny", dtype=dtype, device="cuda", max_num_seqs=16, **config))
    eng.set_async_scheduling(False)
    sync = drive(eng, requests, arrivals)
    eng.set_async_scheduling(True)
    return sync, drive(eng, requests, arrivals), eng


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_overlap_equals_sync_where_the_batches_are_the_same(dtype):
    """EOS ignored and lengths known: every step's batch is the synchronous one's, so the tokens
    are equal in bf16 too (greedy through the graphs' argmax, and seeded sampling)."""
    requests = mixed_requests(12, seed=20)
    requests["seeded"] = (prompt_of(40, seed=21), SamplingParams(max_tokens=25, temperature=0.9, top_p=0.9, seed=7,
                                                                  ignore_eos=True))
    sync, ahead, eng = gpu_ab(dtype, requests)
    assert ahead == sync
    stats = eng.telemetry["overlap"]
    assert stats["steps_ahead"] > 20 and stats["gpu_wait_ms_per_step"] >= 0
    one = {"one": (prompt_of(50, seed=22), SamplingParams(max_tokens=40, ignore_eos=True))}
    sync, ahead, _ = gpu_ab(dtype, one)
    assert ahead == sync


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_overlap_equals_sync_with_stops_arrivals_and_preemption():
    """fp32 (batch-invariant here, as test_phase5_engine's GPU tests hold it): stop tokens met one
    step late, requests arriving mid-run, and a pool small enough to preempt."""
    requests = mixed_requests(10, seed=23)
    free_run, _, _ = gpu_ab("float32", requests)
    for i, rid in enumerate(list(requests)[:4]):
        prompt, params = requests[rid]
        requests[rid] = (prompt, SamplingParams(max_tokens=params.max_tokens, ignore_eos=True,
                                                stop_token_ids=(free_run[rid][0][min(i + 1, 3)],)))
    arrivals = {rid: 2 * i for i, rid in enumerate(requests)}
    sync, ahead, _ = gpu_ab("float32", requests, arrivals)
    assert ahead == sync
    sync, ahead, eng = gpu_ab("float32", mixed_requests(16, seed=24), num_kv_blocks=24, block_size=16)
    assert ahead == sync and eng.num_preemptions > 0
