"""Phase 5's prefix caching on a CPU (float32, tiny model): greedy tokens with the cache on equal
those with it off for prompts sharing prefixes of every kind of length; the block pool's counts
stay exact through finish, abort and preemption; cached blocks are evicted least recently used;
a request sharing a long prefix prefills only the rest (the engine's telemetry says how much)."""
import random

import pytest
import torch

from common.errors import LabError
from phases.phase5_inference.engine import EngineConfig, LLMEngine, SamplingParams, Sequence, named, random_weights
from phases.phase5_inference.engine.kv_cache import BlockPool

BLOCK = 16
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("two_torch_threads")


@pytest.fixture(scope="module")
def weights():
    return random_weights(named("tiny"), seed=0, dtype=torch.float32)


def engine(weights, **config) -> LLMEngine:
    """A tiny CPU engine with prefix caching on unless the test says otherwise."""
    config = {"enable_prefix_caching": True, **config}
    return LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu", block_size=BLOCK, **config),
                     weights=weights)


def tokens(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50257) for _ in range(length)]


def sharing_prompts() -> list[list[int]]:
    """A base prompt and prompts sharing 2 full blocks exactly, 40 tokens (not a block multiple),
    the whole base prompt (a block multiple: its last block is recomputed, never shared), and the
    base prompt itself again."""
    base = tokens(64, seed=1)
    return [base, base[:32] + tokens(20, seed=2), base[:40] + tokens(9, seed=3), base + tokens(5, seed=4),
            list(base), base[:32]]


def run_one_by_one(eng: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    """Each prompt to the end before the next: later ones find the earlier ones' blocks cached."""
    return [eng.generate([p], params)[0] for p in prompts]


def test_greedy_tokens_equal_with_the_cache_on_and_off(weights):
    prompts = sharing_prompts()
    off = engine(weights, enable_prefix_caching=False)
    expected = run_one_by_one(off, prompts)
    assert off.telemetry["cached_prompt_tokens"] == 0
    on = engine(weights, enable_prefix_caching=True)
    assert run_one_by_one(on, prompts) == expected
    # 0, 32, 32 (40 shared: 2 full blocks), 64, 48 (the whole prompt: its last block is recomputed), 16
    assert on.telemetry["cached_prompt_tokens"] == 32 + 32 + 64 + 48 + 16
    assert on.telemetry["prompt_tokens"] == sum(map(len, prompts))
    assert on.num_free_blocks == on.runner.num_kv_blocks
    # all at once: prompts admitted in one prefill share the blocks another computes in it
    batched = engine(weights, enable_prefix_caching=True)
    assert batched.generate(prompts, GREEDY) == expected
    assert batched.telemetry["cached_prompt_tokens"] > 0


def test_it_is_off_by_default_and_refused_under_speculative_decoding():
    assert not EngineConfig().prefix_caching                # opt-in until its GPU path is checked on a GPU
    assert EngineConfig(enable_prefix_caching=True).prefix_caching
    assert not EngineConfig(speculative_model="ngram", num_speculative_tokens=2).prefix_caching
    with pytest.raises(LabError, match="enable_prefix_caching"):
        EngineConfig(speculative_model="ngram", num_speculative_tokens=2, enable_prefix_caching=True).check()
    with pytest.raises(LabError, match="enable_prefix_caching"):
        EngineConfig(enable_prefix_caching="yes").check()


def test_n_samples_share_the_prompts_blocks(weights):
    """Four sampled choices of one 70-token prompt in one step: the 4 full blocks are computed
    once and held by all four; each has its own last block."""
    eng = engine(weights)
    prompt = tokens(70, seed=5)
    ids = [eng.add_request(prompt, SamplingParams(max_tokens=3, temperature=1.0, seed=s)) for s in range(4)]
    outputs = eng.step()
    assert {o.request_id: o.num_cached_prompt_tokens for o in outputs} == {ids[0]: 0, **{i: 64 for i in ids[1:]}}
    tables = [eng._requests[i].block_table for i in ids]
    assert all(t[:4] == tables[0][:4] for t in tables) and len({t[4] for t in tables}) == 4
    assert eng.num_free_blocks == eng.runner.num_kv_blocks - (4 + 4)
    assert eng.last_step["num_tokens"] == 70 + 3 * 6
    while eng.has_unfinished():
        eng.step()
    assert eng.num_free_blocks == eng.runner.num_kv_blocks


def test_a_second_request_sharing_a_long_prefix_prefills_fewer_tokens(weights):
    eng = engine(weights)
    prefix = tokens(200, seed=6)
    first = eng.generate([prefix + tokens(10, seed=7)], SamplingParams(max_tokens=2, ignore_eos=True))
    assert first and eng.last_step["kind"] == "decode"
    rid = eng.add_request(prefix + tokens(10, seed=8), SamplingParams(max_tokens=2, ignore_eos=True))
    (out,) = eng.step()
    assert out.request_id == rid and out.num_cached_prompt_tokens == 192            # 12 full blocks
    assert eng.last_step == {**eng.last_step, "kind": "prefill", "num_tokens": 210 - 192}


def test_free_blocks_exact_after_finish_abort_and_preemption(weights):
    prompts = [tokens(40, seed=10)[:32] + tokens(8 + s, seed=20 + s) for s in range(6)]
    off = engine(weights, enable_prefix_caching=False, num_kv_blocks=12)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    expected = off.generate(prompts, params)
    on = engine(weights, num_kv_blocks=12)
    assert on.generate(prompts, params) == expected
    assert on.num_preemptions > 0 and on.num_free_blocks == 12
    pool = on.scheduler.block_pool
    assert sorted(pool._ref_count) == [0] * 12
    # abort: a running and a waiting request, sharing a cached prefix
    ids = [on.add_request(p, params) for p in prompts]
    for _ in range(3):
        on.step()
    for rid in ids:
        on.abort(rid)
        on.abort(rid)                                                   # idempotent
    on.step()
    assert on.num_free_blocks == 12 and not on.has_unfinished() and sorted(pool._ref_count) == [0] * 12


def seq_of(token_ids: list[int]) -> Sequence:
    return Sequence("r", token_ids, SamplingParams())


def test_lru_eviction_keeps_the_most_recently_used_prefix():
    """4 blocks of 4 tokens, prompts of 9 (3 blocks, 2 full and keyed). Unkeyed free blocks go
    first, then keyed ones least recently freed first, a prompt's last blocks before its first."""
    pool = BlockPool(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a, b, c = (seq_of(list(range(start, start + 9))) for start in (0, 100, 200))
    pool.allocate(a, share_prefix=True)
    assert pool.num_cached_blocks == 2
    a_blocks = a.block_table[:2]
    pool.free(a)
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2         # free, still cached
    again = seq_of(list(range(9)))
    pool.allocate(again, share_prefix=True)
    assert again.num_cached_tokens == 8 and again.block_table[:2] == a_blocks
    assert pool.num_free_blocks == 1
    pool.free(again)
    pool.allocate(b, share_prefix=True)            # two unkeyed blocks, then a's second (its last freed)
    assert pool.match_prefix(seq_of(list(range(9)))) == a_blocks[:1]
    assert pool.num_cached_blocks == 3
    b_first = b.block_table[0]
    pool.free(b)
    pool.allocate(c, share_prefix=True)            # b's unkeyed block, a's first (least recent), b's second
    assert pool.match_prefix(seq_of(list(range(9)))) == []
    assert pool.match_prefix(seq_of(list(range(100, 109)))) == [b_first]        # b's first block survives
    assert pool.num_free_blocks == 1 and pool.num_cached_blocks == 3


def test_a_hash_collision_is_not_a_hit():
    pool = BlockPool(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = seq_of([1, 2, 3, 4, 5])
    pool.allocate(a, share_prefix=True)
    pool.free(a)
    impostor = seq_of([9, 9, 9, 9, 5])
    impostor.block_hashes = list(a.block_hashes)       # the same key, other tokens
    assert pool.match_prefix(impostor) == []


def test_a_block_filled_by_decode_is_cached(weights):
    """A 20-token prompt decoding 14 tokens fills its second block: a later prompt with the same
    33 tokens shares both blocks."""
    eng = engine(weights)
    prompt = tokens(20, seed=30)
    out = eng.generate([prompt], SamplingParams(max_tokens=14, ignore_eos=True))[0]
    rid = eng.add_request(prompt + out[:13], SamplingParams(max_tokens=1, ignore_eos=True))
    (o,) = eng.step()
    assert o.request_id == rid and o.num_cached_prompt_tokens == 32
    assert o.new_token_ids == out[13:14]


def test_the_serve_flag_reaches_the_config_and_is_refused_with_speculation():
    import argparse

    from phases.phase5_inference.engine.server import add_arguments, config_from_args
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--model", "tiny", "--device", "cpu", "--port", "0"]
    assert not config_from_args(parser.parse_args(base)).prefix_caching
    assert config_from_args(parser.parse_args(base + ["--enable-prefix-caching"])).prefix_caching
    assert not config_from_args(parser.parse_args(base + ["--no-enable-prefix-caching"])).prefix_caching
    with pytest.raises(LabError, match="enable_prefix_caching is not supported with speculative decoding"):
        config_from_args(parser.parse_args(base + ["--enable-prefix-caching", "--speculative-model", "ngram",
                                                   "--num-speculative-tokens", "2"]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_greedy_tokens_equal_with_the_cache_on_and_off():
    """On a GPU with CUDA graphs (float32: the comparison is of the cache, not of rounding)."""
    w = random_weights(named("tiny"), seed=0, dtype=torch.float32, device="cuda")

    def gpu(**config):
        return LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cuda", block_size=BLOCK,
                                      num_kv_blocks=256, max_num_seqs=8, **config), weights=w)
    expected = run_one_by_one(gpu(enable_prefix_caching=False), sharing_prompts())
    on = gpu(enable_prefix_caching=True)
    assert run_one_by_one(on, sharing_prompts()) == expected
    assert on.telemetry["cached_prompt_tokens"] == 32 + 32 + 64 + 48 + 16
    assert on.generate(sharing_prompts(), GREEDY) == expected
