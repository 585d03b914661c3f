"""Speculative decoding on CPU (fp32, tiny shapes): greedy output identical to the target alone for
every k and proposer, the KV cache after a rollback identical to a run that never saw the rejected
tokens, and rejection sampling's output distributed as the target's (a chi-square test that a
wrong sampler fails)."""
import functools

from dataclasses import replace

import pytest
import torch

from common.errors import LabError
from phases.phase5_inference.engine import EngineConfig, LLMEngine, SamplingParams
from phases.phase5_inference.engine.rejection import greedy_accept, rejection_sample
from phases.phase5_inference.engine.speculator import NgramProposer, ngram_proposal

TARGET = "tiny"


def cpu_engine(**config) -> LLMEngine:
    return LLMEngine(EngineConfig(model=TARGET, dtype="float32", device="cpu", **config))


def prompts() -> list[list[int]]:
    """Irregular lengths; the last repeats itself, so prompt lookup finds n-grams."""
    g = torch.Generator().manual_seed(7)
    out = [torch.randint(0, 50000, (n,), generator=g).tolist() for n in (3, 18, 41)]
    return out + [out[1][:9] * 4]


@functools.lru_cache(maxsize=1)
def speculative_engine() -> LLMEngine:
    return cpu_engine(speculative_model="tiny-tied", num_speculative_tokens=8)


@functools.lru_cache(maxsize=1)
def proposers() -> dict:
    eng = speculative_engine()
    return {"same weights": eng.draft_proposer(TARGET, seed=0),           # the target itself: everything kept
            "other model": eng.speculator.proposer,                        # tiny-tied, random: almost nothing kept
            "ngram": NgramProposer()}


@functools.lru_cache(maxsize=1)
def target_alone() -> list[list[int]]:
    return cpu_engine().generate(prompts(), [SamplingParams(max_tokens=n, ignore_eos=True) for n in (23, 9, 30, 31)])


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("proposer", ["same weights", "other model", "ngram"])
def test_greedy_output_is_the_targets_own(k, proposer):
    eng = speculative_engine()
    eng.speculate(proposers()[proposer], k)
    out = eng.generate(prompts(), [SamplingParams(max_tokens=n, ignore_eos=True) for n in (23, 9, 30, 31)])
    assert out == target_alone()
    stats = eng.speculator.stats
    if proposer == "same weights":
        assert stats["kept"] == stats["proposed"] > 0
    if proposer == "other model":
        assert stats["kept"] < stats["proposed"] / 4
    if proposer == "ngram":
        assert stats["kept"] > 0                       # the repeated prompt is predictable
    assert eng.num_free_blocks == eng.scheduler.block_pool.num_blocks


def test_a_stop_token_inside_the_kept_proposals_ends_the_request_there():
    reference = target_alone()[2]
    stop = reference[11]
    first = reference.index(stop)
    eng = speculative_engine()
    eng.speculate(proposers()["same weights"], 8)
    out = eng.generate([prompts()[2]], SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(stop,)))
    assert out == [reference[:first + 1]]


def kv_of(eng: LLMEngine, seq, positions: int) -> torch.Tensor:
    """K and V of `seq`'s first `positions` tokens in every layer: [2, layers, positions, heads, d]."""
    bs = eng.config.block_size
    slots = torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in range(positions)])
    cache = eng.runner.kv_cache
    return cache.flatten(2, 3)[:, :, slots]


def test_rollback_leaves_the_cache_of_a_run_that_never_saw_the_rejected_tokens():
    eng = speculative_engine()
    eng.speculate(proposers()["other model"], 6)
    prompt = prompts()[2]
    request = eng.add_request(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    seq = eng._requests[request]
    eng.step()                                                   # prefill
    held_before = eng.scheduler.block_pool.num_blocks - eng.num_free_blocks
    for _ in range(3):
        eng.step()
    assert eng.speculator.stats["kept"] < eng.speculator.stats["proposed"]       # something was rolled back
    tokens = list(seq.token_ids)
    plain = cpu_engine()
    twin_id = plain.add_request(prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    twin = plain._requests[twin_id]
    while twin.num_tokens < len(tokens):
        plain.step()
    assert twin.token_ids == tokens
    cached = len(tokens) - 1                                     # the last token is not cached yet
    assert seq.num_cached_tokens == twin.num_cached_tokens == cached
    torch.testing.assert_close(kv_of(eng, seq, cached), kv_of(plain, twin, cached), rtol=1e-5, atol=1e-6)
    bs = eng.config.block_size
    assert len(twin.block_table) == -(-len(tokens) // bs)
    assert len(seq.block_table) == -(-(len(tokens) + 6) // bs)          # the next step's k = 6 lookahead slots kept
    assert held_before <= len(seq.block_table)
    eng.abort(request)
    eng.step()
    assert eng.num_free_blocks == eng.scheduler.block_pool.num_blocks


# ------------------------------------------------------------------------------ the distribution
def chi_square_p_value(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of integer samples against probs; categories expecting fewer than 5 pooled."""
    observed = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    statistic = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


@functools.lru_cache(maxsize=1)
def tiny_distributions() -> tuple[torch.Tensor, torch.Tensor]:
    """(target p, draft q) of the next token after a prompt: the tiny models' logits over the
    tokens either ranks in its top 24, sharpened (random weights give nearly flat logits)."""
    eng = speculative_engine()
    prompt = prompts()[1]

    def last_logits(runner):
        from phases.phase5_inference.engine import Sequence
        seq = Sequence("probe", prompt, SamplingParams())
        seq.block_table = list(range(-(-len(prompt) // eng.config.block_size)))
        return runner.prefill_logits([seq])[0]

    p_logits = last_logits(eng.runner)
    q_logits = last_logits(proposers()["other model"].runner)
    support = torch.unique(torch.cat([p_logits.topk(24).indices, q_logits.topk(24).indices]))
    sharpen = 1 / (4 * p_logits[support].std())
    return (p_logits[support] * sharpen).softmax(0), (q_logits[support] * sharpen).softmax(0)


def first_tokens(p, q, k: int, n: int, sampler) -> torch.Tensor:
    """The first emitted token of n independent speculative steps with k proposals drawn from q
    (later proposals from the same q: only the first token's marginal is tested)."""
    g = torch.Generator().manual_seed(1234 + k)
    draft = torch.multinomial(q, n * k, replacement=True, generator=g).view(n, k)
    return sampler(draft, p, q, g)


def leviathan(draft, p, q, g):
    n, k = draft.shape
    kept, token = rejection_sample(draft, torch.full((n,), k), q.expand(n, k, -1), p.expand(n, k + 1, -1), g)
    return torch.where(kept > 0, draft[:, 0], token)


def fixed_proposals(draft, p, q, g):          # prompt lookup: q is a one-hot on the proposed token
    n, k = draft.shape
    kept, token = rejection_sample(draft, torch.full((n,), k), None, p.expand(n, k + 1, -1), g)
    return torch.where(kept > 0, draft[:, 0], token)


def accept_everything(draft, p, q, g):        # wrong: the draft's distribution
    return draft[:, 0]


def resample_from_target(draft, p, q, g):     # wrong: on rejection p instead of norm(max(0, p - q))
    n, k = draft.shape
    accept = torch.rand(n, generator=g) < (p[draft[:, 0]] / q[draft[:, 0]])
    return torch.where(accept, draft[:, 0], torch.multinomial(p, n, replacement=True, generator=g))


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("sampler", [leviathan, fixed_proposals])
def test_rejection_sampling_keeps_the_targets_distribution(k, sampler):
    p, q = tiny_distributions()
    assert 0.2 < (p - q).abs().sum() / 2 < 0.95              # the draft really differs from the target
    assert chi_square_p_value(first_tokens(p, q, k, 40_000, sampler), p) > 1e-3


@pytest.mark.parametrize("sampler", [accept_everything, resample_from_target])
def test_the_chi_square_test_rejects_a_wrong_sampler(sampler):
    p, q = tiny_distributions()
    assert chi_square_p_value(first_tokens(p, q, 1, 40_000, sampler), p) < 1e-6


def test_sampled_requests_run_and_a_draft_equal_to_the_target_is_always_kept():
    eng = speculative_engine()
    eng.speculate(proposers()["same weights"], 4)
    params = [SamplingParams(max_tokens=15, temperature=0.8, ignore_eos=True),
              SamplingParams(max_tokens=15, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.0, top_k=50, top_p=0.9, ignore_eos=True)]
    out = eng.generate(prompts()[:3], params)
    assert [len(o) for o in out] == [15, 15, 6]
    assert out[1][:9] == target_alone()[1]                  # greedy in a sampled batch: still the target's
    stats = eng.speculator.stats
    assert stats["kept"] == stats["proposed"] > 0          # p == q: min(1, p/q) = 1


# ------------------------------------------------------------------------------ the pieces
def test_greedy_accept_keeps_the_agreeing_prefix():
    assert greedy_accept([5, 6, 7], [5, 6, 9, 4]) == (2, 9)
    assert greedy_accept([5, 6], [5, 6, 8]) == (2, 8)
    assert greedy_accept([1], [2, 3]) == (0, 2)
    assert greedy_accept([], [4]) == (0, 4)


def test_ngram_proposal_follows_the_latest_match_of_the_longest_suffix():
    assert ngram_proposal([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]
    assert ngram_proposal([4, 5, 6, 1, 2, 5, 6], 3) == [1, 2, 5]
    assert ngram_proposal([4, 5, 6, 7], 3) == []
    assert ngram_proposal([3, 3], 4) == [3]


def test_bad_speculative_settings_are_refused_in_one_line():
    with pytest.raises(LabError, match="num_speculative_tokens"):
        cpu_engine(speculative_model="ngram", num_speculative_tokens=9)
    with pytest.raises(LabError, match="num_speculative_tokens"):
        cpu_engine(speculative_model="ngram")
    with pytest.raises(LabError, match="vocabulary"):
        cpu_engine(speculative_model="llama-3.2-1b", num_speculative_tokens=2)
    eng = speculative_engine()
    with pytest.raises(LabError, match="k must be"):
        eng.speculate(NgramProposer(), 9)


def test_a_draft_sampling_at_temperature_alone_chains_its_steps_on_the_device(monkeypatch):
    eng = speculative_engine()
    same = proposers()["same weights"]
    calls = []
    chain = same.chain.tokens
    monkeypatch.setattr(same.chain, "tokens", lambda *a, **k: calls.append(1) or chain(*a, **k))
    eng.speculate(same, 3)
    out = eng.generate(prompts()[:3], SamplingParams(max_tokens=14, temperature=0.7, ignore_eos=True))
    assert [len(o) for o in out] == [14, 14, 14] and calls
    stats = eng.speculator.stats
    assert stats["kept"] == stats["proposed"] > 0          # the draft's q is the target's p
    eng.speculate(proposers()["other model"], 3)
    eng.generate(prompts()[:3], SamplingParams(max_tokens=14, temperature=0.7, ignore_eos=True))
    assert eng.speculator.stats["kept"] < eng.speculator.stats["proposed"]


def test_exercise_runs_end_to_end_on_a_cpu(spec_ctx, monkeypatch, tmp_path):
    """The tiny trained models (cached in a throwaway folder), every variant at k = 1 and 3: greedy
    rows pass their gate, every row carries its predicted speedup, the summary each draft's
    agreement with the target."""
    from phases.phase5_inference import speculative as ex
    from phases.phase5_inference.models import trained_models as tm
    monkeypatch.setattr(tm, "CACHE_DIR", tmp_path / "cache")
    for name in ("tiny-target", "tiny-draft", "tiny-distilled", "tiny-python-draft"):    # seconds, not a minute
        monkeypatch.setitem(tm.MODELS, name, replace(tm.MODELS[name], settings=replace(tm.MODELS[name].settings, steps=4)))
    params = ex.EXERCISE.resolve_params(on_cpu=True, quick=False, overrides={"concurrency": [2], "ks": [1, 3],
                                                                              "output_tokens": 8})
    res = ex.run(spec_ctx(), params)
    rows = {(r["variant"], r["params"]["temperature"], r["params"]["k"]): r for r in res.rows}
    assert set(rows) == {("target", t, 0) for t in (0.0, 0.8)} | {(v, t, k) for v in ex.DRAFTS
                                                                   for t in (0.0, 0.8) for k in (1, 3)}
    for (variant, temperature, k), r in rows.items():
        assert r["status"] == "ok", r["reason"]
        assert r["metrics"]["decode_tok_s"] > 0 and r["prediction"]["predicted_ms"] > 0
        if variant != "target":
            m = r["metrics"]
            assert m["predicted_speedup"] > 0 and m["speedup_measured_over_predicted"] > 0
            assert 1.0 <= m["tokens_per_verify"] <= k + 1
            if temperature == 0:
                assert r["check"]["passed"]
    agreement = res.summary["agreement_with_target"]
    assert set(agreement) == {"matched", "distilled", "mismatched"}
    assert all(0.0 <= a["val_top1_agreement"] <= 1.0 for a in agreement.values())
    assert res.summary["models"]["distilled"]["teacher"] == "tiny-target"
