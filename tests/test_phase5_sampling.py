"""Phase 5's logits features on a CPU (float32, the tiny shape): penalties, logit_bias, min_p,
min_tokens, logprobs of generated tokens and of the prompt against transformers' log-softmax, and
the rule that a request not using them keeps its greedy / seeded tokens in a batch that mixes them."""
import random

import pytest
import torch
from conftest import tiny_transformers_llama

from phases.phase5_inference.engine import EngineConfig, LLMEngine, SamplingParams, named, random_weights

LOGPROB_ATOL = 1e-3          # fp32 engine against fp32 transformers


@pytest.fixture(scope="module")
def weights():
    return random_weights(named("tiny"), seed=0, dtype=torch.float32)


def engine(weights, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu", max_model_len=256, **config),
                     weights=weights)


@pytest.fixture(scope="module")
def hf(weights):
    return tiny_transformers_llama(weights)


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50257) for _ in range(length)]


def run_one(eng, prompt, params):
    request_id = eng.add_request(prompt, params)
    outputs = []
    while eng.has_unfinished():
        outputs += [o for o in eng.step() if o.request_id == request_id]
    return outputs


def test_plain_requests_keep_their_tokens_beside_processed_ones(weights):
    prompts = [prompt_of(n, seed=n) for n in (5, 17, 33, 9, 12, 40)]
    plain = [SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=12, ignore_eos=True,
                                                                          temperature=0.8, seed=7)]
    eng = engine(weights)
    alone = [eng.generate([prompts[0]], plain[0])[0], eng.generate([prompts[1]], plain[1])[0]]
    busy = [SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.3, logprobs=3),
            SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, min_p=0.2, presence_penalty=1.0),
            SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=2.0, logit_bias={5: 100.0}),
            SamplingParams(max_tokens=12, ignore_eos=True, min_tokens=4, prompt_logprobs=2)]
    mixed = eng.generate(prompts, plain + busy)
    assert mixed[:2] == alone


def test_logit_bias_forces_a_token(weights):
    eng = engine(weights)
    prompt = prompt_of(10, seed=1)
    assert eng.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True, logit_bias={1234: 100.0}))[0] \
        == [1234] * 5
    # frequency penalty 2 per use against a bias of 5 over the runner-up: it wins a few times, then loses
    alternating = eng.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=2.0,
                                                        logit_bias={1234: 100.0, 4321: 95.0}))[0]
    assert alternating[:3] == [1234, 1234, 1234] and 4321 in alternating


def test_penalties_follow_vllm_formulas():
    from phases.phase5_inference.engine.sampler import Sampler
    from phases.phase5_inference.engine import Sequence
    seq = Sequence("r", [1, 2], SamplingParams(max_tokens=8, repetition_penalty=2.0, frequency_penalty=0.5,
                                               presence_penalty=0.25, logit_bias={4: -1.0}, min_tokens=5,
                                               stop_token_ids=(6,)))
    for token in (3, 3, 5):
        seq.append_token(token)
    sampler = Sampler(torch.device("cpu"))
    sampler.eos_token_ids = frozenset({7})
    row = torch.tensor([1.0, -1.0, 2.0, 4.0, 0.5, 3.0, 9.0, 9.0])
    sampler._process(row, seq)
    # token 1, 2: seen in the prompt (repetition only); 3: twice in the output; 5: once; 4: bias; 6, 7: masked
    expected = torch.tensor([1.0, -2.0, 1.0, 2.0 - 0.5 * 2 - 0.25, -0.5, 1.5 - 0.5 - 0.25,
                             float("-inf"), float("-inf")])
    assert torch.equal(row, expected)


def test_min_tokens_masks_eos_and_stop_ids(weights):
    eng = engine(weights)
    prompt = prompt_of(10, seed=2)
    first = eng.generate([prompt], SamplingParams(max_tokens=1))[0][0]
    stopped = run_one(eng, prompt, SamplingParams(max_tokens=8, stop_token_ids=(first,)))
    assert stopped[-1].finish_reason == "stop" and stopped[-1].num_output_tokens == 1
    held = run_one(eng, prompt, SamplingParams(max_tokens=8, stop_token_ids=(first,), min_tokens=3))
    tokens = [t for o in held for t in o.new_token_ids]
    assert len(tokens) >= 3 and first not in tokens[:3]


def test_min_p_one_is_greedy(weights):
    eng = engine(weights)
    prompt = prompt_of(12, seed=3)
    greedy = eng.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert eng.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.5, min_p=1.0,
                                                 seed=3))[0] == greedy


def test_logprobs_equal_transformers_log_softmax(weights, hf):
    eng = engine(weights)
    prompt = prompt_of(20, seed=4)
    outputs = run_one(eng, prompt, SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2))
    generated = [t for o in outputs for t in o.new_token_ids]
    entries = [e for o in outputs for e in o.logprobs]
    prompt_entries = outputs[0].prompt_logprobs
    assert len(entries) == 4 and len(prompt_entries) == len(prompt) - 1
    assert all(o.prompt_logprobs is None for o in outputs[1:])
    with torch.no_grad():
        reference = hf(torch.tensor([prompt + generated])).logits[0].float().log_softmax(-1)
    sequence = prompt + generated
    for position, (logprob, top) in enumerate(prompt_entries + entries):
        row = reference[position]
        assert logprob == pytest.approx(float(row[sequence[position + 1]]), abs=LOGPROB_ATOL)
        want = min(len(top), 3)
        assert [t for t, _ in top] == row.topk(want).indices.tolist()
        assert [v for _, v in top] == pytest.approx(row.topk(want).values.tolist(), abs=LOGPROB_ATOL)
    assert all(len(top) == 2 for _, top in prompt_entries) and all(len(top) == 3 for _, top in entries)


@pytest.mark.parametrize("params, match", [
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(min_tokens=99), "min_tokens"), (dict(logit_bias={3: 500}), "logit_bias"),
    (dict(logit_bias={10**6: 1.0}), "logit_bias"), (dict(logprobs=21), "logprobs"),
])
def test_bad_logits_settings_are_refused_by_name(weights, params, match):
    eng = engine(weights)
    with pytest.raises(ValueError, match=match):
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=8, **params))


def test_logits_features_refused_under_speculative_decoding(weights):
    eng = LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu", max_model_len=256,
                                 speculative_model="ngram", num_speculative_tokens=2), weights=weights)
    with pytest.raises(ValueError, match="logprobs is not supported with speculative decoding"):
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=8, logprobs=1))


def test_sampler_with_a_graphs_argmax_leaves_it_untouched_and_plain_rows_as_they_were():
    """The decode graph hands the sampler its argmax buffer: rows that ask for nothing keep it, rows
    that ask for processing or logprobs get their own, and the buffer itself is never written."""
    from phases.phase5_inference.engine.sampler import Sampler
    from phases.phase5_inference.engine import Sequence
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    argmax = logits.argmax(dim=-1)
    buffer = argmax.clone()
    biased = logits[1].argmin().item()
    seqs = [Sequence("a", [1, 2], SamplingParams(max_tokens=4)),
            Sequence("b", [1, 2], SamplingParams(max_tokens=4, logit_bias={biased: 100.0})),
            Sequence("c", [1, 2], SamplingParams(max_tokens=4, logprobs=2)),
            Sequence("d", [1, 2], SamplingParams(max_tokens=4, temperature=0.7, seed=3, min_p=0.5))]
    tokens = Sampler(torch.device("cpu")).sample(logits, seqs, argmax)
    assert torch.equal(argmax, buffer)
    assert tokens[0] == buffer[0] and tokens[1] == biased and tokens[2] == buffer[2]
    probs = (logits[3] / 0.7).softmax(-1)
    assert probs[tokens[3]] >= 0.5 * probs.max()                          # min_p kept it
    [(logprob, top)] = seqs[2].new_logprobs
    reference = logits[2].log_softmax(-1)
    assert logprob == pytest.approx(float(reference[tokens[2]]), abs=1e-6)
    assert [t for t, _ in top] == reference.topk(2).indices.tolist()
    assert seqs[0].new_logprobs == [] and seqs[1].new_logprobs == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_logits_features_beside_graph_decodes(weights, hf):
    """On the GPU (decode CUDA graphs, the prefill graph, pinned copies): plain requests keep their
    tokens in a batch that mixes every feature, and logprobs of the prompt and of generated tokens
    equal transformers' (fp32)."""
    cuda_weights = {k: v.to("cuda") for k, v in weights.items()}
    eng = LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cuda", max_model_len=256, num_kv_blocks=256,
                                 max_num_seqs=8), weights=cuda_weights)
    prompts = [prompt_of(n, seed=n) for n in (5, 17, 33, 9, 12, 40)]
    plain = [SamplingParams(max_tokens=12, ignore_eos=True),
             SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=7)]
    alone = [eng.generate([prompts[0]], plain[0])[0], eng.generate([prompts[1]], plain[1])[0]]
    busy = [SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.3, logprobs=3),
            SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, min_p=0.2, presence_penalty=1.0),
            SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=2.0, logit_bias={5: 100.0}),
            SamplingParams(max_tokens=12, ignore_eos=True, min_tokens=4, prompt_logprobs=2)]
    assert eng.generate(prompts, plain + busy)[:2] == alone
    prompt = prompt_of(20, seed=4)
    outputs = run_one(eng, prompt, SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2))
    generated = [t for o in outputs for t in o.new_token_ids]
    entries = outputs[0].prompt_logprobs + [e for o in outputs for e in o.logprobs]
    with torch.no_grad():
        reference = hf(torch.tensor([prompt + generated])).logits[0].float().log_softmax(-1)
    sequence = prompt + generated
    for position, (logprob, _) in enumerate(entries):
        assert logprob == pytest.approx(float(reference[position, sequence[position + 1]]), abs=LOGPROB_ATOL)
