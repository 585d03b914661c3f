"""Phase 5's plain-PyTorch baseline on a CPU (fp32): the same greedy tokens and logits as
transformers' LlamaForCausalLM with the same weights, the caller's tensors used without a copy,
a model with the rope scaling left out caught by the same check, and the compiled decode path
traced as one graph."""
import dataclasses

import pytest
import torch

from common.errors import LabError
from phases.phase5_inference.benchmark.baseline import PlainLlama
from phases.phase5_inference.engine.rope import inverse_frequencies
from phases.phase5_inference.engine import hf_config, named, random_weights

transformers = pytest.importorskip("transformers")

PROMPT_TOKENS = 80            # longer than tiny's original rope context (64): the scaling matters
NEW_TOKENS = 64
MAX_SEQ_LEN = 160
LOGIT_ATOL = 1e-4


def _prompt(shape, length=PROMPT_TOKENS, seed=1) -> list[int]:
    return torch.randint(0, shape.vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["tiny", "tiny-tied"])
def reference(request):
    """Shape, weights, a prompt, and transformers' greedy continuation and logits over it."""
    shape = named(request.param)
    weights = random_weights(shape, seed=0, dtype=torch.float32)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(shape)))
    result = hf.load_state_dict(weights, strict=False)
    assert not result.unexpected_keys
    assert result.missing_keys == (["lm_head.weight"] if shape.tie_word_embeddings else [])
    hf.eval()
    hf.generation_config.eos_token_id = None          # always NEW_TOKENS tokens, as the baseline
    prompt = _prompt(shape)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        assert out.shape[1] == PROMPT_TOKENS + NEW_TOKENS
        logits = hf(out[:, :-1]).logits[0]               # every position the baseline computes
    return shape, weights, prompt, out[0, PROMPT_TOKENS:].tolist(), logits


def _mismatch(model, reference) -> tuple[bool, float]:
    """The check: (greedy tokens identical, max |logit difference| over prompt and decode steps)."""
    _, _, prompt, tokens_ref, logits_ref = reference
    tokens, _ = model.generate(prompt, NEW_TOKENS)
    sequence = prompt + tokens_ref
    prefill = model.prefill_logits(sequence[:PROMPT_TOKENS])[0]
    worst = (prefill - logits_ref[:PROMPT_TOKENS]).abs().max().item()
    for pos in range(PROMPT_TOKENS, len(sequence) - 1):
        step = model.decode_logits(torch.tensor([sequence[pos]]), pos)[0]
        worst = max(worst, (step - logits_ref[pos]).abs().max().item())
    return tokens == tokens_ref, worst


def test_greedy_tokens_and_logits_match_transformers(reference):
    shape, weights = reference[0], reference[1]
    model = PlainLlama(shape, MAX_SEQ_LEN, torch.float32, "cpu").load(weights)
    same_tokens, worst = _mismatch(model, reference)
    assert same_tokens
    assert worst < LOGIT_ATOL


def test_ignoring_rope_scaling_fails_the_check(reference):
    shape, weights = reference[0], reference[1]
    if shape.rope_scaling is None:
        pytest.skip(f"{shape.name} has no rope scaling to leave out")
    wrong = PlainLlama(dataclasses.replace(shape, rope_scaling=None), MAX_SEQ_LEN, torch.float32, "cpu").load(weights)
    same_tokens, worst = _mismatch(wrong, reference)
    assert not same_tokens
    assert worst > 100 * LOGIT_ATOL


def test_compiled_decode_is_one_graph_with_the_same_tokens(reference):
    """fullgraph=True fails on any graph break; aot_eager traces exactly as Inductor would see it
    without needing a C++ compiler (Inductor on a CPU takes tens of seconds cold)."""
    shape, weights, prompt, tokens_ref, _ = reference
    model = PlainLlama(shape, MAX_SEQ_LEN, torch.float32, "cpu").load(weights)
    tokens, timings = model.generate(prompt, 16, mode="compile",
                                     compile_options={"backend": "aot_eager", "fullgraph": True})
    assert tokens == tokens_ref[:16]
    assert timings["compile_s"] > 0 and timings["warmup_s"] >= timings["compile_s"]


@pytest.mark.parametrize("name", ["tiny", "llama-3.1-8b", "llama-3.2-1b", "tiny-tied"])
def test_rope_frequencies_are_transformers_own(name):
    shape = named(name)
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(
        config=transformers.LlamaConfig(**hf_config(shape)))
    expected = rotary.inv_freq
    assert torch.equal(inverse_frequencies(shape), expected)
    if shape.rope_scaling:
        assert not torch.equal(inverse_frequencies(dataclasses.replace(shape, rope_scaling=None)), expected)


def test_parameters_are_the_callers_tensors():
    shape = named("tiny-tied")
    weights = random_weights(shape, seed=0, dtype=torch.float32)
    model = PlainLlama(shape, 32, torch.float32, "cpu").load(weights)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, tensor in weights.items():
        assert params[name].data_ptr() == tensor.data_ptr(), name
    assert params["lm_head.weight"].data_ptr() == weights["model.embed_tokens.weight"].data_ptr()


def test_a_batch_gives_each_prompts_own_tokens():
    shape = named("tiny")
    weights = random_weights(shape, seed=0, dtype=torch.float32)
    model = PlainLlama(shape, 64, torch.float32, "cpu", max_batch_size=2).load(weights)
    prompts = [_prompt(shape, 40, seed=2), _prompt(shape, 40, seed=3)]
    batched, timings = model.generate(prompts, 12)
    alone = [model.generate(p, 12)[0] for p in prompts]
    assert batched == alone
    assert timings["batch_size"] == 2 and len(timings["decode_ms_per_token"]) == 11
    assert timings["prefill_ms"] > 0 and all(ms > 0 for ms in timings["decode_ms_per_token"])
    assert timings["decode_tokens_per_s"] > 0


def test_user_mistakes_are_one_line_errors():
    shape = named("tiny")
    weights = random_weights(shape, seed=0, dtype=torch.float32)
    model = PlainLlama(shape, 32, torch.float32, "cpu")
    with pytest.raises(LabError, match="load"):
        model.prefill([1, 2, 3])
    with pytest.raises(LabError, match="convert the dict first"):
        model.load({**weights, "model.norm.weight": weights["model.norm.weight"].double()})
    with pytest.raises(LabError, match="lack"):
        model.load({k: v for k, v in weights.items() if k != "lm_head.weight"})
    model.load(weights)
    with pytest.raises(LabError, match="max_seq_len"):
        model.generate(list(range(30)), 8)
    with pytest.raises(LabError, match="mode"):
        model.generate([1, 2], 2, mode="jit")
    with pytest.raises(LabError, match="token ids"):
        model.prefill([shape.vocab_size])
    with pytest.raises(LabError, match="max_seq_len"):
        PlainLlama(shape, shape.max_position_embeddings + 1, torch.float32, "cpu")
