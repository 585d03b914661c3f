"""Phase 5's n samples of one prompt on a CPU (float32, tiny model): n samples share the prompt's
KV blocks and prefill it once (each then recomputes only the prompt's tail); their tokens equal
those of n separate requests (greedy, and seeded with sample i's seed); a shared block is never
written; the block pool's counts stay exact through finish, abort and preemption; the server's
`n` routes its choices here."""
import json
import random
import urllib.request

import pytest
import torch

from phases.phase5_inference.engine import EngineConfig, LLMEngine, SamplingParams, named, random_weights
from phases.phase5_inference.engine.sample_groups import sample_seed

BLOCK = 16
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("two_torch_threads")


@pytest.fixture(scope="module")
def weights():
    return random_weights(named("tiny"), seed=0, dtype=torch.float32)


def engine(weights, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu", block_size=BLOCK, **config),
                     weights=weights)


def tokens(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50257) for _ in range(length)]


def tail_of(prompt_len: int) -> int:
    """Prompt tokens a sample after the first recomputes: from the last token's block on."""
    return prompt_len - (prompt_len - 1) // BLOCK * BLOCK


def run(eng: LLMEngine, check_writes: bool = True) -> dict[str, list[int]]:
    """Step to the end; every request's tokens. check_writes: before each step, no sequence's
    block that the step may write (from its first uncomputed token on) is held by another."""
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        if check_writes:
            assert_no_shared_block_is_written(eng)
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def assert_no_shared_block_is_written(eng: LLMEngine) -> None:
    pool = eng.scheduler.block_pool
    for seq in eng.scheduler.running:
        for block in seq.block_table[seq.num_cached_tokens // BLOCK:]:
            assert pool._ref_count[block] == 1, f"{seq} may write block {block}, held by {pool._ref_count[block]}"


def separately(weights, prompt: list[int], params_list: list[SamplingParams], **config) -> list[list[int]]:
    eng = engine(weights, **config)
    return [eng.generate([prompt], p)[0] for p in params_list]


@pytest.mark.parametrize("prompt_len", [33, 41, 48, 10])
def test_greedy_samples_equal_separate_requests_and_prefill_the_prompt_once(weights, prompt_len):
    """33 = 2 blocks + 1 (the tail is one token), 41, 48 (a block multiple: its last block is the
    tail), 10 (shorter than a block: nothing to share, each sample prefills alone)."""
    n, prompt = 4, tokens(prompt_len, seed=prompt_len)
    expected = separately(weights, prompt, [GREEDY])[0]
    eng = engine(weights)
    ids = eng.add_samples(prompt, GREEDY, n, request_id="s")
    assert ids == [f"s-{i}" for i in range(n)]
    out = run(eng)
    assert [out[i] for i in ids] == [expected] * n
    shared = (prompt_len - 1) // BLOCK * BLOCK
    assert eng.telemetry["sibling_prompt_tokens"] == (n - 1) * shared
    assert eng.telemetry["prefill_tokens"] == prompt_len + (n - 1) * tail_of(prompt_len)
    assert eng.telemetry["cached_prompt_tokens"] == 0 and eng.telemetry["prompt_tokens"] == n * prompt_len
    assert eng.num_free_blocks == eng.runner.num_kv_blocks and not eng._sample_groups


def test_the_samples_hold_the_prompts_full_blocks_together(weights):
    eng = engine(weights)
    ids = eng.add_samples(tokens(70, seed=1), GREEDY, 4)
    eng.step()                                          # the first sample's prefill: the others wait
    assert eng.last_step["num_tokens"] == 70 and len(eng.scheduler.running) == 1
    eng.step()                                          # the other three: the tail (6 tokens) each
    assert eng.last_step == {**eng.last_step, "kind": "prefill", "num_seqs": 3, "num_tokens": 3 * 6}
    tables = [eng._requests[i].block_table for i in ids]
    assert all(t[:4] == tables[0][:4] for t in tables) and len({t[4] for t in tables}) == 4
    assert eng.num_free_blocks == eng.runner.num_kv_blocks - (4 + 4)


def test_one_token_tails_run_as_one_decode_step(weights):
    """A prompt of 2 blocks + 1: the other samples' prefill is one token each over the shared
    blocks, which the runner computes as a decode step (batched paged attention), not a prefill.
    The step's token budget counts the tails, not the prompts: 4 x 33 tokens would not fit in 64."""
    eng = engine(weights, max_num_batched_tokens=64, max_model_len=64)
    calls = []
    run_step = eng.runner.run
    eng.runner.run = lambda seqs, is_prefill: calls.append((len(seqs), is_prefill)) or run_step(seqs, is_prefill)
    eng.add_samples(tokens(33, seed=9), GREEDY, 5)
    eng.step()
    eng.step()
    assert calls == [(1, True), (4, False)] and eng.last_step["kind"] == "prefill"
    assert eng.telemetry["prefill_tokens"] == 33 + 4


def test_seeded_sample_i_equals_a_separate_request_with_sample_is_seed(weights):
    prompt, n = tokens(37, seed=2), 5
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=2**63 - 2, ignore_eos=True)
    seeds = [sample_seed(params.seed, i) for i in range(n)]
    assert seeds[:3] == [2**63 - 2, 2**63 - 1, 0]       # wraps inside the valid range
    expected = separately(weights, prompt, [SamplingParams(**{**params.__dict__, "seed": s}) for s in seeds])
    eng = engine(weights)
    ids = eng.add_samples(prompt, params, n)
    out = run(eng)
    assert [out[i] for i in ids] == expected
    assert len({tuple(e) for e in expected}) > 1        # the samples differ: each has its own stream


@pytest.mark.parametrize("config", [{"enable_chunked_prefill": True, "max_num_batched_tokens": 24},
                                    {"enable_prefix_caching": True}], ids=["chunked", "prefix-cache"])
def test_samples_equal_separate_requests_with_chunked_prefill_and_prefix_caching(weights, config):
    prompt, n = tokens(57, seed=3), 3
    expected = separately(weights, prompt, [GREEDY])[0]
    eng = engine(weights, max_model_len=128, **config)
    other = eng.add_request(tokens(20, seed=4), GREEDY)          # another request beside the group
    ids = eng.add_samples(prompt, GREEDY, n)
    out = run(eng)
    assert [out[i] for i in ids] == [expected] * n
    assert out[other] == separately(weights, tokens(20, seed=4), [GREEDY])[0]
    assert eng.telemetry["sibling_prompt_tokens"] == (n - 1) * 48
    assert eng.num_free_blocks == eng.runner.num_kv_blocks


def test_free_blocks_exact_after_preemption_and_abort(weights):
    """12 blocks for 4 samples of 40 tokens decoding 30: preemptions; a preempted sample shares
    again from a running sibling or prefills alone. Then an abort of the first sample (the others
    keep their shared blocks) and of the rest."""
    prompt, params = tokens(40, seed=5), SamplingParams(max_tokens=30, ignore_eos=True)
    expected = separately(weights, prompt, [params])[0]
    eng = engine(weights, num_kv_blocks=12)
    ids = eng.add_samples(prompt, params, 4)
    out = run(eng)
    assert eng.num_preemptions > 0
    assert [out[i] for i in ids] == [expected] * 4
    pool = eng.scheduler.block_pool
    assert eng.num_free_blocks == 12 and sorted(pool._ref_count) == [0] * 12
    ids = eng.add_samples(prompt, params, 3)
    for _ in range(4):
        eng.step()
    eng.abort(ids[0])
    assert all(pool._ref_count[b] == 2 for b in eng._requests[ids[1]].block_table[:2])
    for _ in range(3):
        assert_no_shared_block_is_written(eng)
        eng.step()
    for rid in ids[1:]:
        eng.abort(rid)
    eng.step()
    assert eng.num_free_blocks == 12 and sorted(pool._ref_count) == [0] * 12 and not eng._sample_groups


def test_bad_n_and_a_group_of_two_prompts_are_refused(weights):
    eng = engine(weights)
    for n in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n must be an integer >= 1"):
            eng.add_samples([1, 2, 3], GREEDY, n)
    eng.add_request([1, 2, 3], GREEDY, "a", sample_group="g")
    with pytest.raises(ValueError, match="sample_group 'g' holds samples of another prompt"):
        eng.add_request([1, 2, 4], GREEDY, "b", sample_group="g")
    eng.add_request([5], GREEDY, "s-1")
    with pytest.raises(ValueError, match="request_id 's-1' is already in use"):
        eng.add_samples([1, 2, 3], GREEDY, 2, request_id="s")
    assert "s-0" not in eng._requests                          # nothing queued


# ---------------------------------------------------------------------- the exercise (phase5.samples)
def lab(*args, timeout=300):
    import os
    import subprocess
    import sys

    from common.paths import REPO_ROOT
    return subprocess.run([sys.executable, "-m", "common.cli", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ})


def test_the_exercise_runs_on_cpu_with_checked_and_predicted_rows(tmp_path):
    proc = lab("run", "phase5.samples", "--device", "cpu", "--results", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [path] = (tmp_path / "phase5" / "samples").rglob("*.json")
    rec = json.loads(path.read_text())
    assert [r["params"]["n"] for r in rec["rows"]] == [1, 2, 4]
    for r in rec["rows"]:
        n, m = r["params"]["n"], r["metrics"]
        assert r["status"] == "ok" and r["check"]["passed"]
        assert r["check"]["prefill_tokens"] == 17 + (n - 1) * 1          # 17 = one block + 1: a 1-token tail
        assert m["output_tokens"] == 8 * n and m["output_tok_s"] > 0 and m["tpot_median_ms"] > 0
        assert r["prediction"]["predicted_ms"] > 0 and m["predicted_decode_tok_s"] > 0
        assert "below_ridge" in m and m["tpot_vs_1"] > 0
    assert rec["summary"]["ridge_batch_spec"] > 0 and rec["summary"]["best_n"] in (1, 2, 4)
    assert set(rec["summary"]["host_step_us"]) == {"1", "2", "4"} and min(rec["summary"]["host_step_us"].values()) > 0


def test_the_exercise_check_fails_when_the_prompt_is_prefilled_more_than_once():
    from phases.phase5_inference.samples import check_samples
    run = {"tokens": [[1, 2], [3, 4]], "prefill_tokens": 2 * 17}
    assert check_samples({**run, "prefill_tokens": 18}, 2, 17, 2, BLOCK, 100)["passed"]
    failed = check_samples(run, 2, 17, 2, BLOCK, 100)
    assert not failed["passed"] and "prefilled 34 tokens, 18 expected" in failed["reason"]
    assert "made 1 tokens" in check_samples({**run, "tokens": [[1], [3, 4]]}, 2, 17, 2, BLOCK, 100)["reason"]


def test_the_exercise_refuses_n_below_one(tmp_path):
    proc = lab("run", "phase5.samples", "--device", "cpu", "--param", "n=[0,4]", "--results", str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "--param n=[0,4]" in out and "Traceback" not in out
    assert not list(tmp_path.rglob("*.json"))


# ---------------------------------------------------------------------- the first request's TTFT (ttft_decode)
def test_the_first_requests_ttft_is_set_beside_the_steady_state_with_the_reason():
    from phases.phase5_inference.ttft_decode import first_request_metrics
    first = {"ttft_ms": 42.0, "tpot_ms": 5.0, "engine_stats": {"prefill_step_ms": {"median": 30.0}}}
    m = first_request_metrics(first, [18.0, 17.0, 19.0], {"prefill_step_ms": {"median": 10.0}},
                              {"graph_capture_s": 2.5, "startup_s": 30.0})
    assert m["first_over_steady_ttft"] == pytest.approx(42 / 18)
    assert m["first_request_why"] == (
        "first request TTFT 42.0 ms against 18.0 ms steady (+24.0 ms); CUDA graphs were captured at start-up "
        "(2.50 s, before any request), so it does not pay for them; the engine's prefill step took 30.0 ms against "
        "10.0 ms (+20.0 ms: the first prefill of this shape, its kernels' selection and loading and its allocations, "
        "which start-up did not warm); +4.0 ms lies outside the engine step (server, tokenizer, first connection)")
    failed = first_request_metrics({"ttft_ms": None, "engine_stats": {}}, [18.0], {}, {})
    assert failed["first_request_ttft_ms"] is None and "first_request_why" not in failed


# ---------------------------------------------------------------------- best-of-n (phase5.best_of_n)
def test_the_arithmetic_checker_grades_pass_at_n_and_the_majority_vote():
    from phases.phase5_inference.models import arithmetic as ar
    right, wrong, unfinished = ar.encode("57\n"), ar.encode("56\n"), ar.encode("57")
    assert ar.prompt_ids(12, 45) == ar.encode("\n12+45=") and ar.decode(right) == "57\n"
    assert ar.answer_of(right) == "57" and ar.answer_of(unfinished) is None and ar.answer_of(ar.encode("+\n")) is None
    assert ar.grade(12, 45, [wrong, right, wrong]) == {"correct": 1, "pass": True, "majority": False}
    assert ar.grade(12, 45, [right, wrong, unfinished, unfinished]) == {"correct": 1, "pass": True, "majority": True}
    assert ar.grade(12, 45, [unfinished]) == {"correct": 0, "pass": False, "majority": False}


def test_the_arithmetic_split_holds_its_questions_out_of_training():
    from phases.phase5_inference.models import arithmetic as ar
    questions, train, val = ar.split(digits=1, questions=10, train_lines=500, val_lines=50, seed=3)
    lines = set(ar.decode(train.tolist()).split("\n"))
    assert len(questions) == 10 and not any(f"{a}+{b}={a + b}" in lines for a, b in questions)
    assert ar.split(1, 10, 500, 50, seed=3)[0] == questions and train.max() <= ar.NEWLINE


def test_a_smaller_ns_samples_are_the_first_of_a_larger_ns(weights):
    """Sample i of question q draws from seed + q * MAX_N + i, whatever n: pass@n cannot fall with n."""
    from phases.phase5_inference.best_of_n import answer_all
    eng = engine(weights)
    questions, sampling = [(3, 4), (12, 9)], SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    two = answer_all(eng, questions, 2, sampling, seed=7)["samples"]
    four = answer_all(eng, questions, 4, sampling, seed=7)["samples"]
    assert [per[:2] for per in four] == two and two[0] != two[1]


def test_best_of_n_trains_and_samples_on_cpu(tmp_path):
    proc = lab("run", "phase5.best_of_n", "--device", "cpu", "--results", str(tmp_path), "--quick")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [path] = (tmp_path / "phase5" / "best_of_n").rglob("*.json")
    rec = json.loads(path.read_text())
    assert [(r["variant"], r["params"]["n"]) for r in rec["rows"]] == [("greedy", 1), ("sampled", 1), ("sampled", 4)]
    for r in rec["rows"]:
        m = r["metrics"]
        assert r["status"] == "ok" and r["check"]["passed"] and r["prediction"]["predicted_ms"] > 0
        assert m["questions"] == 4 and m["samples"] == 4 * r["params"]["n"] and 0 <= m["pass_at_n"] <= 1
    one, four = (r["metrics"] for r in rec["rows"][1:])
    assert four["pass_at_n"] >= one["pass_at_n"]
    assert rec["summary"]["train_steps"] == 10 and rec["summary"]["held_out_questions"] == 4
    assert set(rec["summary"]["host_step_us"]) == {"4", "16"}       # the batches: 4 questions x n = 1, 4


def test_tensor_parallel_ranks_replay_the_sample_group(weights):
    """Rank 0's DrivenEngine sends each add with its sample group; a following rank applies them
    and shares the prompt's blocks the same way (the channel replaced by a list)."""
    from phases.phase5_inference.engine.tp_ranks import DrivenEngine, follow

    class Recorded:
        def __init__(self):
            self.sent = []

        def send(self, commands):
            self.sent.append(commands)

        def recv(self):
            return self.sent.pop(0)

    channel, prompt = Recorded(), tokens(40, seed=11)
    lead, other = engine(weights), engine(weights)
    driven = DrivenEngine(lead, channel)
    for i in range(3):
        driven.add_request(prompt, GREEDY, f"a-{i}", sample_group="a")
    while driven.has_unfinished():
        driven.step()
    driven.stop()
    follow(other, channel)
    assert other.telemetry["sibling_prompt_tokens"] == lead.telemetry["sibling_prompt_tokens"] == 2 * 32
    assert other.telemetry["prefill_tokens"] == lead.telemetry["prefill_tokens"] == 40 + 2 * 8
    assert not other.has_unfinished() and other.num_free_blocks == other.runner.num_kv_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("prompt_len", [33, 41])
def test_gpu_samples_equal_separate_requests(prompt_len):
    """On a GPU with CUDA graphs (float32: the comparison is of the sharing, not of rounding): a
    one-token tail (its samples' prefill runs as a decode step) and a longer one; greedy and seeded."""
    w = random_weights(named("tiny"), seed=0, dtype=torch.float32, device="cuda")

    def gpu():
        return LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cuda", block_size=BLOCK,
                                      num_kv_blocks=256, max_num_seqs=16), weights=w)
    prompt = tokens(prompt_len, seed=prompt_len)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    for params, n in ((GREEDY, 8), (seeded, 4)):
        alone = gpu()
        expected = [alone.generate([prompt], SamplingParams(**{**params.__dict__, "seed": sample_seed(params.seed, i)}))[0]
                    for i in range(n)]
        eng = gpu()
        ids = eng.add_samples(prompt, params, n)
        out = run(eng)
        assert [out[i] for i in ids] == expected
        assert eng.telemetry["prefill_tokens"] == prompt_len + (n - 1) * tail_of(prompt_len)
        assert eng.num_free_blocks == 256
