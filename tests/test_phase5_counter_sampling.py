"""The sampler's counter-based draw (engine/counter_uniform.py, engine/sampler.inverse_cdf): the hash is
SplitMix64's, a draw follows the probabilities and never takes a zero one, a wrong draw fails the
same check, and a request's tokens depend only on its seed (or its engine's seed and its number)."""
import random

import pytest
import torch

from phases.phase5_inference.engine import EngineConfig, LLMEngine, SamplingParams, named, random_weights
from phases.phase5_inference.engine.counter_uniform import row_uniforms
from phases.phase5_inference.engine.sampler import Sampler, inverse_cdf
from phases.phase5_inference.predictions import kernel_lists

MASK = 2**64 - 1


def splitmix64(x: int) -> int:
    """SplitMix64's step in Python integers (Steele, Lea and Flood 2014), the reference for mix64."""
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def test_a_rows_uniform_is_splitmix64_of_its_key_and_counter():
    seeds, streams, counters = [5, None, 2**63 - 1, None], [9, 3, 0, 4], [0, 7, 123456, 0]
    got = row_uniforms(seeds, streams, counters, engine_seed=11)
    for u, seed, stream, counter in zip(got, seeds, streams, counters):
        first, domain, second = (11, 2, stream) if seed is None else (seed, 1, 0)
        key = splitmix64(splitmix64(first ^ domain) ^ second)
        assert u == (splitmix64(key ^ counter) >> 11) * 2.0**-53
    assert ((got >= 0) & (got < 1)).all()


def test_seeded_rows_ignore_the_stream_and_unseeded_ones_depend_on_it_and_the_engine_seed():
    u = row_uniforms([5, 5, None, None, None], [0, 1, 0, 1, 0], [3, 3, 3, 3, 3], engine_seed=5)
    assert u[0] == u[1] and u[2] != u[3] and u[2] != u[0]          # the domains keep seed 5 apart from engine 5
    assert row_uniforms([None], [0], [3], engine_seed=6)[0] != u[2]
    along = row_uniforms([5] * 1000, [0] * 1000, list(range(1000)), 0)
    assert len(set(along.tolist())) == 1000 and abs(along.mean() - 0.5) < 0.05


def frequencies(draw, probs: torch.Tensor, n: int) -> torch.Tensor:
    rows = probs.expand(n, -1)
    uniforms = torch.from_numpy(row_uniforms([None] * n, list(range(n)), [0] * n, 3))
    return torch.bincount(draw(rows, uniforms), minlength=probs.shape[1]).double() / n


def within_sampling_error(freq: torch.Tensor, probs: torch.Tensor, n: int) -> bool:
    """Every token's frequency within 5 standard errors of its probability (rows normalized)."""
    p = (probs / probs.sum()).double()[0]
    return bool(((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-12).all())


def test_draws_follow_the_probabilities_never_a_zero_and_a_wrong_draw_fails_the_check():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0, 0.2]])             # sums to 1.2: rows need not be normalized
    n = 100_000
    freq = frequencies(inverse_cdf, probs, n)
    assert within_sampling_error(freq, probs, n) and freq[1] == 0 and freq[4] == 0

    def one_token_late(rows, uniforms):                                   # an off-by-one search
        return torch.clamp(inverse_cdf(rows, uniforms) + 1, max=rows.shape[1] - 1)
    assert not within_sampling_error(frequencies(one_token_late, probs, n), probs, n)


def test_a_uniform_at_the_top_takes_the_last_token_of_nonzero_probability():
    probs = torch.tensor([[0.2, 0.8, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    top = torch.tensor([1 - 2.0**-53, 1 - 2.0**-53], dtype=torch.float64)
    assert inverse_cdf(probs, top).tolist() == [1, 3]
    assert inverse_cdf(probs, torch.zeros(2, dtype=torch.float64)).tolist() == [0, 3]


@pytest.fixture(scope="module")
def weights():
    return random_weights(named("tiny"), seed=0, dtype=torch.float32)


def engine(weights, seed=0) -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu", max_model_len=256, seed=seed),
                     weights=weights)


def test_unseeded_requests_repeat_on_a_fresh_engine_with_the_same_seed_and_differ_with_another(weights):
    """An unseeded request draws from (engine seed, its number in that engine): two engines given the
    same calls (as tensor-parallel ranks are) make the same tokens, whatever else this process made."""
    rng = random.Random(4)
    prompts = [[rng.randrange(50257) for _ in range(12 + i)] for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    first = engine(weights).generate(prompts, params)
    engine(weights).generate(prompts[:1], params)                        # more sequences made in this process
    assert engine(weights).generate(prompts, params) == first
    assert engine(weights, seed=1).generate(prompts, params) != first


def test_the_engines_draw_is_the_one_the_kernel_list_models():
    assert Sampler.DRAW == kernel_lists.SAMPLER_DRAW
