"""Prefill attention over a cached prefix (model._prefill_attention_over_cache): each sequence's new
tokens attend over its whole context read from the paged cache, query r of a sequence with c
cached tokens seeing keys 0 .. c + r. Checked against attention written out in float64 for a
packed batch of sequences with different cached and new lengths (a fresh prompt, a mixed step's
one-token decode row, a chunk over a long prefix) on scattered blocks: the CPU's per-sequence
SDPA path; the Flash varlen call's arguments through a CPU stand-in with Flash's documented
bottom-right causal alignment; and on a GPU the real Flash varlen call in bf16."""
from types import SimpleNamespace

import pytest
import torch

from phases.phase5_inference.engine.model import AttentionMetadata, LlamaModel, varlen_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 64, 16
CACHED = [0, 40, 203]          # a fresh prompt, a decode row, a chunk over a long prefix
NEW = [7, 1, 33]


def expected(q, k_cache, v_cache, tables, scale) -> torch.Tensor:
    """float64 attention, one query at a time: query r of sequence i at position CACHED[i] + r."""
    out = torch.empty(q.shape, dtype=torch.float64)
    k_flat, v_flat = k_cache.double().flatten(0, 1), v_cache.double().flatten(0, 1)
    row = 0
    for cached, new, table in zip(CACHED, NEW, tables):
        for r in range(new):
            visible = cached + r + 1
            slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(visible)])
            for h in range(HEADS):
                kv = h // (HEADS // KV_HEADS)
                weights = (k_flat[slots, kv] @ q[row, h].double() * scale).softmax(dim=0)
                out[row, h] = weights @ v_flat[slots, kv]
            row += 1
    return out


def case(device, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    contexts = [c + n for c, n in zip(CACHED, NEW)]
    num_blocks = sum(-(-c // BLOCK) for c in contexts) + 5
    order = torch.randperm(num_blocks, generator=generator).tolist()       # scattered blocks
    tables, taken = [], 0
    for context in contexts:
        n = -(-context // BLOCK)
        tables.append(order[taken:taken + n])
        taken += n
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    q = torch.randn(sum(NEW), HEADS, HEAD_DIM, generator=generator).to(dtype)
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for table, context in zip(tables, contexts) for p in range(context)]
    cumulative = lambda lengths: torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.empty(0), seq_lens=NEW, cu_seqlens=cumulative(NEW).to(device),
                             max_seq_len=max(NEW), cached_lens=CACHED,
                             context_slots=torch.tensor(slots, dtype=torch.int32).to(device),
                             cu_context_lens=cumulative(contexts).to(device), max_context_len=max(contexts))
    return q.to(device), k_cache.to(device), v_cache.to(device), tables, meta


def model_stub(prefill_varlen):
    shape = SimpleNamespace(num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)
    return SimpleNamespace(shape=shape, prefill_varlen=prefill_varlen, scale=HEAD_DIM ** -0.5, gqa=True)


def flash_semantics_on_cpu(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """Flash varlen's documented causal mask where queries are fewer than keys: aligned to the
    bottom right (query r of n sees keys 0 .. len_k - n + r)."""
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        n, m = qs.stop - qs.start, ks.stop - ks.start
        assert n <= max_q and m <= max_k
        visible = torch.ones(n, m, dtype=torch.bool).tril(diagonal=m - n)
        out[qs] = torch.nn.functional.scaled_dot_product_attention(
            q[qs].transpose(0, 1), k[ks].transpose(0, 1), v[ks].transpose(0, 1), attn_mask=visible, scale=scale,
            enable_gqa=True).transpose(0, 1)
    return out


@pytest.mark.parametrize("path", ["sdpa per sequence", "varlen arguments"])
def test_attention_over_the_cache_matches_float64_on_cpu(path):
    q, k_cache, v_cache, tables, meta = case("cpu", torch.float32)
    stub = model_stub(None if path == "sdpa per sequence" else flash_semantics_on_cpu)
    out = LlamaModel._prefill_attention_over_cache(stub, q, k_cache, v_cache, meta)
    torch.testing.assert_close(out.double(), expected(q, k_cache, v_cache, tables, stub.scale), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flash_varlen_over_the_cache_matches_float64_on_a_gpu():
    varlen = varlen_attention(torch.device("cuda"), torch.bfloat16, True)
    if varlen is None:
        pytest.skip("this torch has no Flash varlen attention")
    q, k_cache, v_cache, tables, meta = case("cuda", torch.bfloat16)
    stub = model_stub(varlen)
    out = LlamaModel._prefill_attention_over_cache(stub, q, k_cache, v_cache, meta)
    reference = expected(q.cpu(), k_cache.cpu(), v_cache.cpu(), tables, stub.scale)
    torch.testing.assert_close(out.double().cpu(), reference, atol=2e-2, rtol=2e-2)   # bf16 inputs and output


def test_an_engine_through_the_varlen_path_makes_the_same_tokens_on_cpu():
    """The runner's packed context slots and offsets, end to end: with the Flash stand-in as the
    model's varlen attention, chunked prefill (mixed steps whose decode rows attend over the
    cache) and a cached shared prefix give the same greedy tokens as the SDPA path."""
    from phases.phase5_inference.benchmark.workload import random_prompts
    from phases.phase5_inference.engine import EngineConfig, LLMEngine, SamplingParams, named, random_weights

    shape = named("tiny")
    weights = random_weights(shape, seed=0, dtype=torch.float32)
    shared = random_prompts(1, 70, shape.vocab_size, 1)[0]
    prompts = [shared + [5, 6], shared + [7] * 9, *random_prompts(3, 45, shape.vocab_size, 2)]
    outputs = []
    for stand_in in (None, flash_semantics_on_cpu):
        engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu", block_size=16, max_model_len=256,
                                        enable_chunked_prefill=True, max_num_batched_tokens=40,
                                        enable_prefix_caching=True), weights=weights)
        engine.runner.model.prefill_varlen = stand_in
        tokens = {}
        ids = [engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts[:1]]
        while engine.has_unfinished():              # the first prompt alone: its blocks cached for the second
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        ids += [engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts[1:]]
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert engine.telemetry["cached_prompt_tokens"] >= 64
        outputs.append([tokens[i] for i in ids])
    assert outputs[0] == outputs[1] and all(len(t) == 6 for t in outputs[0])
