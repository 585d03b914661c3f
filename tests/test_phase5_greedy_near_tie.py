"""greedy_near_tie: two runs' greedy tokens compared under batch variance. Equal tokens pass without
a replay; a divergence is accepted only where both runs' tokens are among the replay's best and
within the tolerance of its best logit (a tie of two or of three), and then that sequence's later
tokens are not compared; a divergence with a clear margin, or to a token outside the replay's best,
fails. The tolerance is measured: a replay under the other setting gives the rounding noise at the
divergent position, and the tolerance is max(floor, 2 x noise) (the H200 run's 0.156 margin passes
with a noise of 0.09, fails with 0.01); a noise over the cap (a wrong kernel moving logits by 1)
fails as not rounding however small the margin. Then the same
through a real engine's replay (CPU, fp32, tiny model): a token edited to the runner-up is a clear
divergence at fp32's tolerance and a reported near-tie under a tolerance above its margin; the replay
under chunking and under a cached prefix really runs that setting; and an engine with perturbed weights
under the other setting (a wrong kernel) fails the check as not rounding though the margin is inside the floor."""
import pytest
import torch

from phases.phase5_inference.benchmark.workload import random_prompts
from phases.phase5_inference.engine import EngineConfig, LLMEngine, SamplingParams, named, random_weights
from phases.phase5_inference.greedy_near_tie import (
    NOISE_FACTOR,
    compare_greedy,
    first_difference,
    measured_noise,
    noise_cap,
    tie_tolerance,
)
from phases.phase5_inference.near_tie_replays import (
    cached_settings,
    chunk_tokens,
    chunked_settings,
    replayer,
    replayers,
)

pytestmark = pytest.mark.usefixtures("two_torch_threads")
BF16 = tie_tolerance("bf16")


def never_replayed(tokens):
    raise AssertionError("a replay was asked for where the runs agree")


def fake_replay(top2_after: dict):
    """replay_top2 from a table {length of the replayed tokens: [(id, logprob), (id, logprob)]}, logging calls."""
    calls = []

    def top2(tokens):
        calls.append(list(tokens))
        return top2_after[len(tokens)]
    top2.calls = calls
    return top2


def seq(name, reference, other, prompt=(1, 2, 3)):
    return {"name": name, "prompt": list(prompt), "reference": reference, "other": other}


def test_the_tolerance_is_four_ulps_of_a_logit_in_four_to_eight():
    ulp = BF16 / 4
    assert torch.tensor(4.0 + ulp, dtype=torch.bfloat16).item() == 4.0 + ulp          # representable: one step up
    assert torch.tensor(4.0 + 0.49 * ulp, dtype=torch.bfloat16).item() == 4.0          # nothing between
    assert torch.tensor(7.0 + ulp, dtype=torch.bfloat16).item() == 7.0 + ulp
    assert tie_tolerance("fp32") == pytest.approx(4 * 4 * 2.0 ** -23) and tie_tolerance("fp32") < 1e-5


def test_first_difference_over_the_common_length():
    assert first_difference([1, 2, 3], [1, 2, 3, 4]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([], [7]) is None


def test_identical_runs_pass_without_a_replay():
    check = compare_greedy([seq("stream 0", [5, 6, 7], [5, 6, 7]), seq("stream 1", [8, 9], [8, 9, 10])],
                           never_replayed, BF16, "on and off")
    assert check["passed"] and check["reason"] is None
    assert check["near_tie_divergences"] == 0 and check["near_ties"] == [] and check["sequences_compared"] == 2


def test_a_divergence_at_a_near_tie_passes_is_reported_and_ends_that_sequence():
    # at position 2 the replay's best two are 7 (-1.50) and 70 (-1.51): a margin of 0.01; later tokens differ freely
    replay = fake_replay({3 + 2: [(7, -1.50), (70, -1.51)]})
    check = compare_greedy([seq("stream 0", [5, 6, 7, 8, 9], [5, 6, 70, 11, 12]), seq("stream 1", [4], [4])],
                           replay, BF16, "on and off")
    assert check["passed"], check["reason"]
    assert check["near_tie_divergences"] == 1
    [tie] = check["near_ties"]
    assert tie["name"] == "stream 0" and tie["position"] == 2 and tie["tokens"] == [7, 70]
    assert tie["margin"] == pytest.approx(0.01)
    assert replay.calls == [[1, 2, 3, 5, 6]]           # the prompt and the reference's tokens before the divergence


def test_a_divergence_with_a_clear_margin_fails_with_its_margin():
    replay = fake_replay({3 + 1: [(6, -0.5), (60, -2.5)]})
    check = compare_greedy([seq("stream 3", [5, 6, 7], [5, 60, 7])], replay, BF16, "on and off")
    assert not check["passed"]
    assert "stream 3's greedy token 1 differs between on and off" in check["reason"]
    assert "margin of 2" in check["reason"] and check["near_tie_divergences"] == 0


def test_a_divergence_to_a_token_outside_the_replays_best_fails_even_when_tied():
    replay = fake_replay({3: [(5, -1.0), (50, -1.0)]})
    check = compare_greedy([seq("the long prompt", [5, 6], [51, 6])], replay, BF16, "on and off")
    assert not check["passed"] and "not both among a replay's best 2" in check["reason"]


def test_a_three_way_tie_passes_a_flip_to_the_third_and_fails_one_past_the_tolerance():
    # an H200 run flipped to the replay's third token, tied with the best two
    replay = fake_replay({3 + 1: [(6, -2.0), (60, -2.0), (61, -2.01), (62, -2.5)]})
    check = compare_greedy([seq("stream 6", [5, 6, 7], [5, 61, 9])], replay, BF16, "on and off")
    assert check["passed"], check["reason"]
    assert check["near_ties"][0]["tokens"] == [6, 61] and check["near_ties"][0]["margin"] == pytest.approx(0.01)
    far = compare_greedy([seq("stream 6", [5, 6, 7], [5, 62, 9])], replay, BF16, "on and off")
    assert not far["passed"] and "margin of 0.5 below the best" in far["reason"]


def test_a_clear_divergence_after_a_near_tie_elsewhere_still_fails():
    replay = fake_replay({3 + 1: [(6, -1.0), (60, -1.001)], 3 + 0: [(5, -0.1), (50, -3.0)]})
    check = compare_greedy([seq("stream 0", [5, 6], [5, 60]), seq("stream 1", [5, 6], [50, 6])],
                           replay, BF16, "on and off")
    assert not check["passed"] and check["reason"].startswith("stream 1's greedy token 0")
    assert check["near_tie_divergences"] == 1


# ------------------------------------------------------------------ the measured tolerance
# The H200 run's failure: stream 7 flipped at a margin of 0.156 (5 bf16 ulps at a logit in [4, 8)), over the floor.
H200_TOP = [(7687, -2.0), (33212, -2.15625), (500, -2.5)]


def shifted(top, by: dict):
    """The same candidates, each logprob moved by by.get(id, 0): a replay under the other setting."""
    return [(t, lp + by.get(t, 0.0)) for t, lp in top]


def h200_divergence(replay_other):
    """Stream 7's divergence at position 3, the replay under the other setting from `replay_other`."""
    return compare_greedy([seq("stream 7", [5, 6, 7, 7687, 9], [5, 6, 7, 33212, 8])],
                          fake_replay({3 + 3: H200_TOP}), BF16, "chunked prefill on and off", replay_other=replay_other)


def test_the_measured_noise_is_the_largest_logprob_move_over_shared_candidates():
    assert measured_noise([(1, -1.0), (2, -1.5), (3, -2.0)], [(2, -1.4), (1, -1.05), (9, -0.1)]) == pytest.approx(0.1)
    assert measured_noise([(1, -1.0)], [(2, -1.0)]) == float("inf")
    assert NOISE_FACTOR == 2 and noise_cap(BF16) == pytest.approx(0.5)


def test_the_h200_margin_passes_when_the_two_settings_measure_rounding_that_large():
    replay_other = fake_replay({3 + 3: shifted(H200_TOP, {33212: 0.09})})
    check = h200_divergence(replay_other)
    assert check["passed"], check["reason"]
    [tie] = check["near_ties"]
    assert tie["margin"] == pytest.approx(0.15625) and tie["noise"] == pytest.approx(0.09)
    assert tie["tolerance"] == pytest.approx(0.18) and tie["tokens"] == [7687, 33212]
    assert check["near_tie_tolerance"] == BF16 and check["near_tie_noise_cap"] == pytest.approx(0.5)
    assert replay_other.calls == [[1, 2, 3, 5, 6, 7]]           # the same prefix, under the other setting


def test_the_h200_margin_fails_when_the_two_settings_measure_little_noise():
    check = h200_divergence(fake_replay({3 + 3: shifted(H200_TOP, {7687: 0.01})}))
    assert not check["passed"]
    assert "margin of 0.1562 below the best (over the near-tie tolerance 0.125" in check["reason"]
    assert "the measured noise 0.01" in check["reason"]


def test_the_h200_margin_fails_under_the_floor_alone_without_a_second_replay():
    check = compare_greedy([seq("stream 7", [5, 6, 7, 7687], [5, 6, 7, 33212])], fake_replay({3 + 3: H200_TOP}),
                           BF16, "chunked prefill on and off")
    assert not check["passed"] and "over the near-tie tolerance 0.125" in check["reason"]


def test_a_wrong_kernel_moving_the_logits_by_one_fails_as_not_rounding_even_at_a_small_margin():
    # margin 0.01, well inside any tolerance; but the other setting moves a candidate by 1.0
    top = [(7, -1.50), (70, -1.51), (71, -3.0)]
    check = compare_greedy([seq("stream 0", [5, 6, 7], [5, 6, 70])], fake_replay({3 + 2: top}), BF16,
                           "chunked prefill on and off", replay_other=fake_replay({3 + 2: shifted(top, {71: 1.0})}))
    assert not check["passed"] and check["near_tie_divergences"] == 0
    assert check["reason"] == ("stream 0's greedy token 2 differs between chunked prefill on and off (7 vs 70): "
                               "a replay under each setting moves the logits by 1 at this position, over the 0.5 "
                               "rounding can explain: not rounding")


def test_replays_sharing_no_candidate_fail_as_not_rounding():
    check = compare_greedy([seq("stream 0", [5, 6], [5, 60])], fake_replay({3 + 1: [(6, -1.0), (60, -1.0)]}), BF16,
                           "on and off", replay_other=fake_replay({3 + 1: [(8, -1.0), (80, -1.1)]}))
    assert not check["passed"] and "no token of their best 2 is shared" in check["reason"]


def test_every_divergence_is_replayed_under_the_reference_first_then_under_the_other():
    order = []

    def logged(name, top):
        def replay(tokens):
            order.append((name, len(tokens)))
            return top
        return replay
    top = [(6, -1.0), (60, -1.01), (5, -1.02), (50, -1.03)]
    check = compare_greedy([seq("stream 0", [5, 6], [5, 60]), seq("stream 1", [5, 6], [50, 6])],
                           logged("reference", top), BF16, "on and off", replay_other=logged("other", top))
    assert check["passed"] and [t["noise"] for t in check["near_ties"]] == [0.0, 0.0]
    assert [t["tolerance"] for t in check["near_ties"]] == [BF16, BF16]          # no noise: the floor
    assert order == [("reference", 4), ("reference", 3), ("other", 4), ("other", 3)]


def test_fp32_stays_strict_under_a_measured_noise():
    fp32 = tie_tolerance("fp32")
    top = [(6, -1.0), (60, -1.0 - 1e-4)]
    check = compare_greedy([seq("stream 0", [5, 6], [5, 60])], fake_replay({3 + 1: top}), fp32, "on and off",
                           replay_other=fake_replay({3 + 1: shifted(top, {6: 1e-4})}))
    assert not check["passed"] and "not rounding" in check["reason"]       # 1e-4 is no fp32 rounding
    assert noise_cap(fp32) < 1e-5


class CpuContext:
    is_cuda = False


@pytest.fixture(scope="module")
def tiny():
    shape = named("tiny")
    weights = random_weights(shape, seed=0, dtype=torch.float32)

    def make_engine(**settings):
        return LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu", **settings), weights=weights)
    make_engine.weights = weights
    prompt = random_prompts(1, 20, shape.vocab_size, 3)[0]
    engine = make_engine(max_model_len=64)
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
    return make_engine, prompt, tokens


def test_a_real_replay_agrees_with_the_run_and_an_edited_token_is_a_clear_divergence_at_fp32(tiny):
    make_engine, prompt, tokens = tiny
    k = 4
    with replayer(CpuContext(), make_engine, 64) as top2:
        (best, best_lp), (second, second_lp) = top2(prompt + tokens[:k])[:2]
        assert best == tokens[k] and best_lp > second_lp              # the replay's greedy token is the run's
        edited = tokens[:k] + [second] + tokens[k + 1:]
        sequences = [{"name": "stream 0", "prompt": prompt, "reference": tokens, "other": edited}]
        strict = compare_greedy(sequences, top2, tie_tolerance("fp32"), "the run and its edit")
        loose = compare_greedy(sequences, top2, (best_lp - second_lp) * 1.01, "the run and its edit")
    assert not strict["passed"] and "stream 0's greedy token 4 differs" in strict["reason"]
    assert loose["passed"] and loose["near_ties"][0]["position"] == k
    assert loose["near_ties"][0]["margin"] == pytest.approx(best_lp - second_lp)


def edited_at_runner_up(tiny, k: int, top: list) -> list[dict]:
    """The run's tokens against the same with token k edited to the replay's runner-up."""
    _, prompt, tokens = tiny
    edited = tokens[:k] + [top[1][0]] + tokens[k + 1:]
    return [{"name": "stream 0", "prompt": prompt, "reference": tokens, "other": edited}]


@pytest.mark.parametrize("setting", ["chunked", "cached"])
def test_real_replays_under_each_setting_measure_the_noise_and_the_tolerance_follows_it(tiny, setting):
    """The replay under the other setting really runs that setting (chunks of 10 tokens; the prompt's first
    block read from the prefix cache), measures a noise (fp32 on a CPU: none, within the cap) and the
    tolerance is the floor; at fp32's floor the edited token is a clear divergence, the measured noise in its
    reason; under a floor above its margin it is a near-tie recording margin, noise and tolerance."""
    make_engine, prompt, tokens = tiny
    k = 4
    sequences = [{"name": "stream 0", "prompt": prompt, "reference": tokens, "other": tokens}]
    other, cached_prefix = ((chunked_settings(chunk_tokens(sequences, 64)), 0) if setting == "chunked"
                            else (cached_settings(64), 16))
    assert chunk_tokens(sequences, 64) == len(prompt) // 2 == 10
    with replayers(CpuContext(), make_engine, 64, other, cached_prefix_tokens=cached_prefix) as (reference, replay):
        top = reference(prompt + tokens[:k])
        sequences = edited_at_runner_up(tiny, k, top)
        margin = top[0][1] - top[1][1]
        strict = compare_greedy(sequences, reference, tie_tolerance("fp32"), "the edit", replay_other=replay)
        loose = compare_greedy(sequences, reference, margin * 1.01, "the edit", replay_other=replay)
    assert replay.cached_prompt_tokens == ([16, 16] if setting == "cached" else [0, 0])      # one per compare
    assert reference.cached_prompt_tokens == [0, 0, 0]
    assert not strict["passed"] and "the measured noise" in strict["reason"]
    assert loose["passed"], loose["reason"]
    [tie] = loose["near_ties"]
    assert tie["margin"] == pytest.approx(margin) and tie["noise"] <= noise_cap(tie_tolerance("fp32"))
    assert tie["tolerance"] == margin * 1.01


def test_a_wrong_engine_under_the_other_setting_fails_as_not_rounding_though_its_margin_is_in_the_floor(tiny):
    """The checker shown failing on a wrong kernel: the chunked replay's engine has perturbed weights (a
    stand-in for chunked prefill corrupting the KV), which moves the logits at the divergent position by
    more than the cap; the edited token's margin is inside the floor, and still the check fails."""
    make_engine, prompt, tokens = tiny
    generator = torch.Generator().manual_seed(1)
    wrong = {n: w + 0.003 * torch.randn(w.shape, generator=generator) for n, w in make_engine.weights.items()}

    def wrong_when_chunked(**settings):
        return LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu", **settings),
                         weights=wrong if settings["enable_chunked_prefill"] else make_engine.weights)
    k = 4
    with replayers(CpuContext(), wrong_when_chunked, 64, chunked_settings(10)) as (reference, chunked):
        top = reference(prompt + tokens[:k])
        sequences = edited_at_runner_up(tiny, k, top)
        floor = (top[0][1] - top[1][1]) * 1.01
        noise = measured_noise(top, chunked(prompt + tokens[:k]))
        check = compare_greedy(sequences, reference, floor, "chunked prefill on and off", replay_other=chunked)
    assert noise > noise_cap(floor)
    assert not check["passed"] and check["near_tie_divergences"] == 0
    assert check["reason"].endswith("rounding can explain: not rounding"), check["reason"]
    assert f"moves the logits by {noise:.4g} at this position" in check["reason"]
