"""Phase 5's chunked prefill on a CPU (float32, tiny model): steps of at most
max_num_batched_tokens tokens that mix prefill chunks with decode rows give the same greedy tokens
as whole prefills, with and without prefix caching, through preemption and abort, and keep the
block pool's count exact; a long prompt no longer stops the streams already decoding."""
import random

import pytest
import torch

from common.errors import LabError
from phases.phase5_inference.engine import EngineConfig, LLMEngine, SamplingParams, named, random_weights

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("two_torch_threads")


@pytest.fixture(scope="module")
def weights():
    return random_weights(named("tiny"), seed=0, dtype=torch.float32)


def engine(weights, **config) -> LLMEngine:
    config = {"max_model_len": 256, "max_num_batched_tokens": 256, **config}
    return LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu", block_size=16, **config),
                     weights=weights)


def chunked(weights, budget_tokens: int, **config) -> LLMEngine:
    """Chunked prefill with a per-step budget below max_model_len (the engine's check that a
    whole prompt fits one step does not apply to chunks)."""
    return engine(weights, enable_chunked_prefill=True, max_num_batched_tokens=budget_tokens, **config)


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(50257) for _ in range(48)]
    lengths = (100, 7, 45, 64, 130, 3)
    return [[rng.randrange(50257) for _ in range(n)] for n in lengths] + [shared + [1, 2, 3], shared + [4] * 20]


@pytest.fixture(scope="module")
def expected(weights):
    return engine(weights, enable_prefix_caching=False).generate(prompts(), GREEDY)


@pytest.mark.parametrize("budget_tokens", [3, 37])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_greedy_tokens_equal_with_chunked_prefill_on_and_off(weights, expected, budget_tokens, prefix_caching):
    eng = chunked(weights, budget_tokens, enable_prefix_caching=prefix_caching)
    steps = []
    ids = [eng.add_request(p, GREEDY) for p in prompts()]
    out = {i: [] for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
        steps.append(eng.last_step["num_tokens"])
    assert [out[i] for i in ids] == expected
    assert max(steps) <= budget_tokens
    assert eng.num_free_blocks == eng.runner.num_kv_blocks


def test_preemption_and_abort_under_chunked_prefill_keep_the_pool_exact(weights, expected):
    eng = chunked(weights, 24, num_kv_blocks=17, max_model_len=272)
    assert eng.generate(prompts(), GREEDY) == expected
    assert eng.num_preemptions > 0 and eng.num_free_blocks == 17
    ids = [eng.add_request(p, GREEDY) for p in prompts()]
    for _ in range(7):                      # mid-prefill and mid-decode
        eng.step()
    for rid in ids:
        eng.abort(rid)
    aborted = [o.request_id for o in eng.step() if o.finish_reason == "abort"]
    assert sorted(aborted) == sorted(ids)
    assert eng.num_free_blocks == 17 and not eng.has_unfinished()


def test_a_long_prompt_does_not_stop_the_running_streams(weights):
    """Two streams decoding; a 200-token prompt arrives. With a 32-token budget every step still
    gives each stream its token while the prompt is prefilled in chunks."""
    eng = chunked(weights, 32)
    rng = random.Random(1)
    streams = [eng.add_request([rng.randrange(50257) for _ in range(10)], SamplingParams(max_tokens=40, ignore_eos=True))
               for _ in range(2)]
    eng.step()                                          # both prefilled together
    eng.add_request([rng.randrange(50257) for _ in range(200)], SamplingParams(max_tokens=2, ignore_eos=True))
    for _ in range(7):                                  # 200 tokens at 30 a step: 7 steps
        got = {o.request_id for o in eng.step() if o.new_token_ids}
        assert set(streams) <= got
        assert eng.last_step["num_tokens"] <= 32


def test_without_chunking_max_model_len_must_fit_one_step(weights):
    with pytest.raises(LabError, match="exceeds max_num_batched_tokens"):
        engine(weights, max_num_batched_tokens=64)
    assert chunked(weights, 64).max_model_len == 256


def test_refusals():
    with pytest.raises(LabError, match="enable_chunked_prefill is not supported with speculative decoding"):
        EngineConfig(enable_chunked_prefill=True, speculative_model="ngram", num_speculative_tokens=2).check()
    with pytest.raises(LabError, match="enable_chunked_prefill must be true or false"):
        EngineConfig(enable_chunked_prefill=1).check()


def test_prompt_logprobs_are_refused_with_chunked_prefill(weights):
    eng = chunked(weights, 32)
    with pytest.raises(ValueError, match="prompt_logprobs is not supported with chunked prefill"):
        eng.add_request([1, 2, 3], SamplingParams(prompt_logprobs=1))


def test_the_serve_flag_reaches_the_config():
    import argparse

    from phases.phase5_inference.engine.server import add_arguments, config_from_args
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--model", "tiny", "--device", "cpu", "--port", "0"]
    assert not config_from_args(parser.parse_args(base)).enable_chunked_prefill
    assert config_from_args(parser.parse_args(base + ["--enable-chunked-prefill"])).enable_chunked_prefill


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_greedy_tokens_equal_with_chunked_prefill_on_and_off():
    """On a GPU with CUDA graphs for the pure decode steps (float32: the comparison is of the
    scheduling, not of rounding)."""
    w = random_weights(named("tiny"), seed=0, dtype=torch.float32, device="cuda")

    def gpu(**config):
        return LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cuda", block_size=16, max_model_len=256,
                                      num_kv_blocks=256, max_num_seqs=8, **config), weights=w)
    expected = gpu(max_num_batched_tokens=256).generate(prompts(), GREEDY)
    assert gpu(enable_chunked_prefill=True, max_num_batched_tokens=37).generate(prompts(), GREEDY) == expected
