"""Phase 5's steps as workloads (common/workload.py): the kernels the lab's engine launches for a
decode step and a prefill, read off engine/model.py's forward. Torch-free (`lab predict`, report).

A decode step of batch B over C cached tokens a sequence, per layer (engine/model.py), each kernel
replayed from a CUDA graph:

    QKV    RMSNorm (with the residual add) + QKV projection: one Triton GEMV kernel at B = 1,
           a Triton norm and a cuBLAS matmul above
    RoPE   rotary embedding of q and k, fused with the store of K and V into the paged cache
    attn   paged decode attention over C tokens (Triton; a combine kernel when the context is split):
           4 x heads x head_dim FLOPs and one exponential per cached token and head, K and V read once
    O      output projection (GEMV at B = 1, cuBLAS above)
    MLP    RMSNorm + gate_up (one GEMV at B = 1), then SiLU(gate) * up + down (one GEMV at B = 1;
           a SiLU-and-multiply kernel and a cuBLAS matmul above)

plus the embedding gather, the final norm + LM head (+ half the argmax: one GEMV at B = 1) and the
argmax kernel; greedy sampling is the argmax, inside the graph. The projections of a decode step
are GEMVs (common/workload.py's GEMV kind: the weight at the measured GEMV bandwidth); a one-row
GEMV runs on the CUDA cores, and is memory-bound at any rate.

The host is on the critical path once a step: the engine copies the step's inputs to the device,
launches the graph and waits for the sampled tokens (a synchronize) before it schedules the next
step. Those three are counted from the ceilings (a launch each, a synchronize); the scheduler's own
Python and the writing of the step's inputs from predictions/host_step.py's ceiling where the
record measured it (batching's summary), else said to be unmeasured; the sampler's copy-back and,
for a served run, the HTTP streaming are not (no ceiling measures them: the residual shows them).
"""
import math
from dataclasses import replace

from common.errors import LabError
from common.workload import ELEMENTWISE, GEMV, GRAPH, MATMUL, TORCH, TRITON, Kernel, Workload

from .analysis import mean_decode_context
from ..benchmark.workload import random_lengths, random_prompts
from ..engine.shapes import BF16_BYTES, LlamaShape, named

ACT = BF16_BYTES                               # activations and the KV cache: bf16
STEP_HOST = (("input copy to the device", "launch_us", 1), ("graph launch", "launch_us", 1),
             ("synchronize on the sampled tokens", "sync_us", 1))


def _projection(name: str, batch: int, n_in: int, n_out: int, wbytes: float, launch: str, *, norm: bool = False,
                silu: bool = False, kind: str = GEMV, fused: bool | None = None) -> list[Kernel]:
    """One projection x @ W^T, W n_out x n_in of `wbytes` a weight: a fused GEMV at batch 1 (its
    norm or SiLU-and-multiply inside), else the norm / SiLU kernel and a cuBLAS matmul (a decode
    step's few rows: the GEMV regime, its weight read at the measured GEMV bandwidth; a prefill's:
    MATMUL). `fused` None: fused exactly at batch 1 with bf16 weights (a quantized weight runs its
    own kernel after a separate norm or SiLU kernel: fused_ops._gemv_fits)."""
    act_in = n_in * (2 if silu else 1)
    mm_bytes = n_in * n_out * wbytes + batch * (act_in + n_out) * ACT
    if fused is None:
        fused = batch == 1 and wbytes == BF16_BYTES
    if fused:
        return [Kernel(name + (" (+ RMSNorm)" if norm else " (+ SiLU * up)" if silu else ""), GEMV,
                       2 * n_in * n_out, mm_bytes, None, launch=launch)]
    pre = []
    if norm:
        pre = [Kernel(f"RMSNorm before {name}", ELEMENTWISE, 4 * batch * n_in, 3 * batch * n_in * ACT, None,
                      launch=launch)]
    if silu:
        pre = [Kernel(f"SiLU(gate) * up before {name}", ELEMENTWISE, 5 * batch * n_in, 3 * batch * n_in * ACT, None,
                      launch=launch)]
    return pre + [Kernel(name, kind, 2 * batch * n_in * n_out, mm_bytes, "bf16" if batch > 1 else None, launch=launch)]


def decode_step(shape: LlamaShape, batch: int, context: float, *, weight_bytes: float = BF16_BYTES,
                splits: int = 1, graphed: bool = True, norm_in_quant_kernel: bool = False) -> Workload:
    """One decode step: `batch` sequences of `context` cached tokens each. `weight_bytes` per weight of
    the layers' projections (bf16 2; int4 with a bf16 scale per group g: 0.5 + 2 / g); the embedding
    and the LM head stay bf16. norm_in_quant_kernel: the quantized projections after an RMSNorm run it
    inside their own kernel at batch 1 (the CUDA int4 kernel's staged prologue, fused_ops)."""
    s, L, B, C = shape, shape.num_hidden_layers, batch, context
    norm_fused = (B == 1) if norm_in_quant_kernel and weight_bytes != BF16_BYTES else None
    h, q, kv, i = s.hidden_size, s.q_size, s.kv_size, s.intermediate_size
    launch = GRAPH if graphed else TRITON
    per_layer = [
        *_projection("QKV", B, h, q + 2 * kv, weight_bytes, launch, norm=True, fused=norm_fused),
        Kernel("RoPE + K, V store", ELEMENTWISE, 3 * B * (q + kv), 2 * B * (q + 2 * kv) * ACT, None, launch=launch),
        Kernel(f"decode attention over {C:.0f} tokens", ELEMENTWISE, 4 * B * q * C,
               B * (2 * C * kv + 2 * q) * ACT, None, exps=B * s.num_attention_heads * C, launch=launch),
        *([Kernel("combine the splits", ELEMENTWISE, 0, B * q * (splits + 1) * 4, None, launch=launch)]
          if splits > 1 else []),
        *_projection("O", B, q, h, weight_bytes, launch),
        *_projection("gate_up", B, h, 2 * i, weight_bytes, launch, norm=True, fused=norm_fused),
        *_projection("down", B, i, h, weight_bytes, launch, silu=True),
    ]
    kernels = [Kernel("embedding gather", ELEMENTWISE, 0, 2 * B * h * ACT, None, launch=launch),
               *[Kernel(k.name, k.kind, k.flops, k.bytes, k.dtype, k.exps, k.launch, count=L) for k in per_layer],
               *_projection("LM head", B, h, s.vocab_size, BF16_BYTES, launch, norm=True),
               Kernel("argmax (greedy sampling)", ELEMENTWISE, B * s.vocab_size, B * s.vocab_size * 4, None,
                      launch=launch)]
    return Workload(f"{s.name} decode step, batch {B}, {C:.0f} cached tokens", tuple(kernels), STEP_HOST)


def with_host_step(step: Workload, host_step_us: dict | None, batch: int) -> Workload:
    """The step with the host's scheduler step at this batch (predictions/host_step.py: measured on
    the CPU of the same run, before its timed rows, stored in its summary), or a note that it is
    unmeasured (a record from before that ceiling) and left out."""
    us = (host_step_us or {}).get(str(batch))
    if us is None:
        return replace(step, notes=(*step.notes, "the host's scheduler step: unmeasured in this record, left out"))
    return replace(step, host=(*step.host, (f"scheduler step and input writing, {batch} sequences", us / 1e3, 1)))


PREFILL_BUCKETS = tuple(16 * 2 ** k for k in range(6))        # 16 ... 512 tokens: graphs (engine/runner.py)


def prefill(shape: LlamaShape, prompt_tokens: int) -> Workload:
    """One sequence's prefill: its tokens padded up to the graph bucket (16, 32, ..., 512; eager
    beyond), causal flash attention over them (products and exponentials added, as phase 3's), the
    LM head for the last token only."""
    s, L = shape, shape.num_hidden_layers
    bucket = next((b for b in PREFILL_BUCKETS if b >= prompt_tokens), None)
    T, launch = (bucket, GRAPH) if bucket else (prompt_tokens, TORCH)
    h, q, kv, i, nh = s.hidden_size, s.q_size, s.kv_size, s.intermediate_size, s.num_attention_heads
    tiles = math.ceil(T / 128)
    scores = nh * T * T * (tiles + 1) / (2 * tiles)
    per_layer = [
        *_projection("QKV", T, h, q + 2 * kv, BF16_BYTES, launch, norm=True, kind=MATMUL),
        Kernel("RoPE + K, V store", ELEMENTWISE, 3 * T * (q + kv), 2 * T * (q + 2 * kv) * ACT, None, launch=launch),
        Kernel(f"causal flash attention over {T} tokens", MATMUL, 4 * scores * s.head_dim, 2 * T * (q + kv) * ACT,
               "bf16", exps=scores, launch=launch),
        *_projection("O", T, q, h, BF16_BYTES, launch, kind=MATMUL),
        *_projection("gate_up", T, h, 2 * i, BF16_BYTES, launch, norm=True, kind=MATMUL),
        *_projection("down", T, i, h, BF16_BYTES, launch, silu=True, kind=MATMUL),
    ]
    kernels = [Kernel("embedding gather", ELEMENTWISE, 0, 2 * T * h * ACT, None, launch=launch),
               *[Kernel(k.name, k.kind, k.flops, k.bytes, k.dtype, k.exps, k.launch, count=L) for k in per_layer],
               *_projection("LM head (last token)", 1, h, s.vocab_size, BF16_BYTES, launch, norm=True, kind=MATMUL),
               Kernel("argmax", ELEMENTWISE, s.vocab_size, s.vocab_size * 4, None, launch=launch)]
    return Workload(f"{s.name} prefill of {prompt_tokens} tokens ({T} computed)", tuple(kernels), STEP_HOST)


def packed_prefill(shape: LlamaShape, prompt_lens: list[int]) -> Workload:
    """One prefill step of several prompts packed into one batch of tokens (an offline run's first
    steps: beyond the graphs' buckets, so eager PyTorch launches): the projections over all their
    tokens, causal flash attention over each prompt alone (varlen), the LM head for each prompt's
    last token."""
    s, L, T = shape, shape.num_hidden_layers, sum(prompt_lens)
    h, q, kv, i, nh = s.hidden_size, s.q_size, s.kv_size, s.intermediate_size, s.num_attention_heads
    scores = sum(nh * n * n * (math.ceil(n / 128) + 1) / (2 * math.ceil(n / 128)) for n in prompt_lens)
    per_layer = [
        *_projection("QKV", T, h, q + 2 * kv, BF16_BYTES, TORCH, norm=True, kind=MATMUL),
        Kernel("RoPE + K, V store", ELEMENTWISE, 3 * T * (q + kv), 2 * T * (q + 2 * kv) * ACT, None, launch=TORCH),
        Kernel(f"causal flash attention over {len(prompt_lens)} prompts", MATMUL, 4 * scores * s.head_dim,
               2 * T * (q + kv) * ACT, "bf16", exps=scores, launch=TORCH),
        *_projection("O", T, q, h, BF16_BYTES, TORCH, kind=MATMUL),
        *_projection("gate_up", T, h, 2 * i, BF16_BYTES, TORCH, norm=True, kind=MATMUL),
        *_projection("down", T, i, h, BF16_BYTES, TORCH, silu=True, kind=MATMUL),
    ]
    B = len(prompt_lens)
    kernels = [Kernel("embedding gather", ELEMENTWISE, 0, 2 * T * h * ACT, None, launch=TORCH),
               *[Kernel(k.name, k.kind, k.flops, k.bytes, k.dtype, k.exps, k.launch, count=L) for k in per_layer],
               *_projection("LM head (last tokens)", B, h, s.vocab_size, BF16_BYTES, TORCH, norm=True, kind=MATMUL),
               Kernel("argmax", ELEMENTWISE, B * s.vocab_size, B * s.vocab_size * 4, None, launch=TORCH)]
    return Workload(f"{s.name} packed prefill of {B} prompts, {T} tokens", tuple(kernels), STEP_HOST)


OFFLINE_MAX_BATCHED_TOKENS = 16384        # offline.py's MAX_BATCHED_TOKENS (a test holds the two equal)


def offline_run(shape: LlamaShape, prompt_lens: list[int], output_lens: list[int], max_num_seqs: int,
                max_batched_tokens: int = OFFLINE_MAX_BATCHED_TOKENS) -> Workload:
    """An offline run (every request at once, EOS ignored) as the sum of the steps the scheduler
    takes: per wave of `max_num_seqs` requests, prefills packed up to `max_batched_tokens` (each
    gives its prompts' first tokens), then decode steps of the sequences still running over their
    mean context (analysis.offline_steps' schedule, each step its own kernel list)."""
    kernels, host, steps = [], [], 0
    order = list(zip(prompt_lens, output_lens))
    for start in range(0, len(order), max_num_seqs):
        wave, pack = order[start: start + max_num_seqs], []
        for p, _ in wave:
            if pack and sum(pack) + p > max_batched_tokens:
                w = packed_prefill(shape, pack)
                kernels += w.kernels
                host += w.host
                steps, pack = steps + 1, []
            pack.append(p)
        w = packed_prefill(shape, pack)
        kernels, host, steps = kernels + list(w.kernels), host + list(w.host), steps + 1
        for t in range(1, max(o for _, o in wave)):
            active = [p + t for p, o in wave if o > t]
            w = decode_step(shape, len(active), sum(active) / len(active))
            kernels, host, steps = kernels + list(w.kernels), host + list(w.host), steps + 1
    return Workload(f"{shape.name} offline run: {len(order)} requests in {steps} steps", tuple(kernels), tuple(host))


def tp_local_shape(shape: LlamaShape, tp: int) -> LlamaShape:
    """What one rank of `tp` computes (engine/tp_shards.local_shape, torch-free here): its heads,
    KV heads and intermediate slice; hidden size and vocabulary whole."""
    if tp == 1:
        return shape
    return replace(shape, num_attention_heads=shape.num_attention_heads // tp,
                   num_key_value_heads=max(1, shape.num_key_value_heads // tp),
                   intermediate_size=shape.intermediate_size // tp)


def tp_decode_step(shape: LlamaShape, tp: int, batch: int, context: float,
                   all_reduce_ms=None) -> Workload:
    """One decode step on one rank of `tp` (engine/tp_ranks.py): its shard's kernels (the LM head
    its slice of the vocabulary), one all-reduce of the hidden state after attention and one after
    the MLP in every layer, and the fp32 logits all-gathered. `all_reduce_ms(nbytes)`: the measured
    time of one all-reduce of that many bytes on this machine; None: the collectives are left out
    and the workload says so (unmeasured)."""
    if tp == 1:
        return decode_step(shape, batch, context)
    local = tp_local_shape(shape, tp)
    step = decode_step(replace(local, vocab_size=-(-shape.vocab_size // tp)), batch, context)
    hidden_bytes, logits_bytes = batch * shape.hidden_size * ACT, batch * shape.vocab_size * 4
    if all_reduce_ms is None:
        return replace(step, name=f"{step.name}, rank of {tp}",
                       notes=(*step.notes, "collectives unmeasured: no all-reduce timed on this machine; left out"))
    comm = (("all-reduce of the hidden state", all_reduce_ms(hidden_bytes), 2 * shape.num_hidden_layers),
            ("all-gather of the logits (timed as an all-reduce of its bytes)", all_reduce_ms(logits_bytes), 1))
    return replace(step, name=f"{step.name}, rank of {tp}", collectives=comm)


def all_reduce_from_rows(rows: list[dict], tp: int):
    """ms of one all-reduce of n bytes as tensor_parallel's own rows measured it (`allreduce_nccl`,
    `allreduce_one_shot` at sizes from 2 KiB; the engine's `auto` takes the faster per size): the
    faster at the smallest measured size >= n. None when the record has no such rows for `tp`."""
    best: dict = {}
    for r in rows or []:
        p, m = r.get("params") or {}, r.get("metrics") or {}
        if r.get("status") == "ok" and str(r.get("variant", "")).startswith("allreduce_") \
                and p.get("world_size") == tp and m.get("us"):
            best[p["size_bytes"]] = min(best.get(p["size_bytes"], float("inf")), m["us"])
    if not best:
        return None
    sizes = sorted(best)

    def ms(nbytes: float) -> float:
        size = next((x for x in sizes if x >= nbytes), sizes[-1])
        return best[size] * (max(1.0, nbytes / size)) / 1e3      # beyond the largest: its rate, scaled
    return ms


def _trained(name: str, hidden: int, intermediate: int, layers: int, heads: int, head_dim: int,
             kv_heads: int) -> LlamaShape:
    """A trained model's counts (models/trained_models.py builds them with torch: GPT-2's vocabulary
    padded to 50,304, tied embeddings; a test holds these equal to its shapes)."""
    return LlamaShape(name=name, vocab_size=50304, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=2048, tie_word_embeddings=True)


SPECULATIVE_TARGET = _trained("shakespeare-target", 2048, 5632, 12, 16, 128, 8)
SPECULATIVE_DRAFT = _trained("shakespeare-draft", 384, 1056, 2, 6, 64, 2)
SPECULATIVE_SHAPES = {"target": SPECULATIVE_TARGET, "matched": SPECULATIVE_DRAFT, "distilled": SPECULATIVE_DRAFT,
                      "mismatched": SPECULATIVE_DRAFT}          # speculative.py's "lab" model set


def draft_chain(draft: LlamaShape, batch: int, k: int, context: float) -> Workload:
    """A draft's k forwards chained on the device (engine/draft_chain.py): k decode steps, their
    inputs copied up front, k graph launches, the host waiting once."""
    one = decode_step(draft, batch, context)
    return Workload(f"{draft.name} draft chain of {k} at batch {batch}",
                    tuple(replace(x, count=x.count * k) for x in one.kernels),
                    (("draft inputs copied to the device", "launch_us", 1), ("draft graph launches", "launch_us", k),
                     ("synchronize on the drafted tokens", "sync_us", 1)))


def speculative_step(target: LlamaShape, draft: LlamaShape | None, batch: int, k: int, context: float,
                     proposed_per_verify: float | None = None) -> Workload:
    """One speculative decode step: the draft's chain of k forwards (none for prompt lookup, whose
    proposals are host work with no ceiling: left out, said so), then the target's verify pass, a
    decode-shaped forward of k + 1 rows a sequence (proposed_per_verify + 1 for prompt lookup). The
    host's acceptance (comparing tokens, the rejection sampling's draws) has no ceiling: left out."""
    rows = batch * (1 + (k if proposed_per_verify is None else proposed_per_verify))
    verify = decode_step(target, max(batch, round(rows)), context)
    kernels, host = list(verify.kernels), list(verify.host)
    notes = ["the host's acceptance: unmeasured (no ceiling times it), left out"]
    if draft is not None:
        chain = draft_chain(draft, batch, k, context)
        kernels, host = list(chain.kernels) + kernels, list(chain.host) + host
    else:
        notes.append("prompt lookup's proposals (host work): unmeasured, left out")
    return Workload(f"speculative step: {'draft x ' + str(k) if draft else 'prompt lookup'} + verify of "
                    f"{rows:.3g} rows", tuple(kernels), tuple(host), tuple(notes))


def expected_tokens_per_verify(acceptance: float, proposed: float) -> float:
    """Tokens a verify pass yields: the proposals it keeps and the target's own token, 1 + a x p,
    where a is the measured acceptance rate as speculative.py records it (kept over proposed, all
    verifies together: not a per-position probability, so no independence is assumed) and p the
    proposals per verify (k for a draft). The acceptance is measured: an input, as the draft's
    quality is; the model predicts what each step costs, not what it accepts."""
    return 1 + acceptance * proposed


def int4_weight_bytes(group_size: int) -> float:
    """A 4-bit weight and its share of one bf16 scale per group."""
    return 0.5 + BF16_BYTES / group_size


# how engine/sampler.py draws a sampled row (Sampler.DRAW; a test holds them equal). Records name the
# draw that measured them (summary.sampler_draw); those written before it was named drew per row
PER_ROW_GENERATOR, INVERSE_CDF = "per_row_generator", "inverse_cdf"
SAMPLER_DRAW = INVERSE_CDF


def sampling_kernels(vocab: int, batch: int, seeded: bool, draw: str = SAMPLER_DRAW) -> tuple[Kernel, ...]:
    """The sampler's eager kernels after the decode graph when `batch` rows sample at temperature > 0
    with no top-k, top-p or min-p (engine/sampler.py's pick and _draw, in launch order): the rows'
    indices and temperatures copied up, their fp32 logits gathered, scaled and softmaxed, the draw,
    the draws scattered into the graph's argmax.

    The draw, `inverse_cdf` (today's): one uniform per row, hashed on the host from the row's
    counter (its few vectorized host operations are left out: no ceiling times them) and copied up
    with the indices; a float64 running sum over each row, its total made contiguous, u x total, two
    binary searches (the draw; the last token of nonzero probability) and their minimum: the same
    launches whatever the batch, seeded or not. `per_row_generator` (the sampler before it): the
    exponential race, argmax of p / E; a seeded request drew its noise row alone from its own
    generator (one launch per row, from a Python loop: each at the PyTorch op's floor, the loop's
    own indexing has no ceiling and is left out); unseeded rows shared one draw and its scatter."""
    B, V, F = batch, vocab, 4
    if draw == INVERSE_CDF:
        searches = 2 * B * max(1, math.ceil(math.log2(V))) * 8
        race = (Kernel("running sums of the probabilities (float64)", ELEMENTWISE, B * V, B * V * (F + 8), None),
                Kernel("the rows' totals made contiguous", ELEMENTWISE, 0, 2 * B * 8, None),
                Kernel("u x total", ELEMENTWISE, B, 3 * B * 8, None),
                Kernel("binary search of each row's running sums", ELEMENTWISE, 0, searches / 2, None, count=2),
                Kernel("minimum of the two searches", ELEMENTWISE, B, 3 * B * 8, None))
        uploads = 4                                   # pick's rows, _draw's rows, temperatures, uniforms
    elif draw == PER_ROW_GENERATOR:
        noise = ((Kernel("exponential noise, one row from its own generator", ELEMENTWISE, 0, V * F, None, exps=V,
                         count=B),) if seeded else
                 (Kernel("exponential noise, shared generator", ELEMENTWISE, 0, B * V * F, None, exps=B * V),
                  Kernel("unseeded rows' indices to the device", ELEMENTWISE, 0, B * 8, None),
                  Kernel("scatter the shared noise", ELEMENTWISE, 0, 2 * B * V * F, None)))
        race = (*noise, Kernel("probabilities / noise", ELEMENTWISE, B * V, 3 * B * V * F, None),
                Kernel("argmax of the race", ELEMENTWISE, B * V, B * V * F, None))
        uploads = 3
    else:
        raise ValueError(f"unknown sampler draw {draw!r}: {INVERSE_CDF} or {PER_ROW_GENERATOR}")
    return (Kernel("sampled rows' indices and temperatures to the device", ELEMENTWISE, 0, uploads * B * 8, None,
                   count=uploads),
            Kernel("copy the graph's argmax", ELEMENTWISE, 0, 2 * B * 8, None),
            Kernel("gather the sampled rows' logits", ELEMENTWISE, 0, 2 * B * V * F, None),
            Kernel("divide by the temperature", ELEMENTWISE, B * V, 2 * B * V * F, None),
            Kernel("softmax", ELEMENTWISE, 5 * B * V, 2 * B * V * F, None, exps=B * V),
            *race,
            Kernel("scatter the draws into the tokens", ELEMENTWISE, 0, 3 * B * 8, None))


def sampled_decode_step(shape: LlamaShape, batch: int, context: float, temperature: float, seeded: bool,
                        draw: str = SAMPLER_DRAW) -> Workload:
    """A decode step whose tokens are sampled: the graph (its argmax kept for greedy rows) and, at
    temperature > 0, the sampler's eager kernels (drawn by `draw`) on the critical path before the
    synchronize."""
    step = decode_step(shape, batch, context)
    if temperature <= 0:
        return step
    return replace(step, name=f"{step.name}, sampled at temperature {temperature:g}" + (", seeded" if seeded else ""),
                   kernels=(*step.kernels, *sampling_kernels(shape.vocab_size, batch, seeded, draw)))


ARITHMETIC_VOCAB, ARITHMETIC_POSITIONS = 64, 128     # models/arithmetic.py's (a test holds them equal)


def arithmetic_shape(hidden: int, layers: int, heads: int) -> LlamaShape:
    """best_of_n's model (best_of_n.model_shape via models/arithmetic.py, which imports torch):
    the same counts, torch-free."""
    return LlamaShape(name=f"arithmetic-{hidden}x{layers}", vocab_size=ARITHMETIC_VOCAB, hidden_size=hidden,
                      intermediate_size=hidden * 11 // 4, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads, head_dim=hidden // heads, max_position_embeddings=ARITHMETIC_POSITIONS,
                      rope_theta=10_000.0, tie_word_embeddings=True, rope_scaling=None, bos_token_id=None,
                      eos_token_id=12)


# ------------------------------------------------------------------------------ recorded rows
EXERCISES = ("phase5.batching", "phase5.ttft_decode", "phase5.quant_engine", "phase5.decode_attention",
             "phase5.quant_kernels", "phase5.offline", "phase5.tensor_parallel",
             "phase5.speculative", "phase5.samples", "phase5.best_of_n")


def _v(r: dict, key: str, default=None):
    v = r.get(key)
    return default if v is None or (isinstance(v, float) and v != v) else v


def row_workload(r: dict) -> Workload | None:
    """A frame row's workload from its params (None: a row this module does not model)."""
    ex = r["exercise"]
    try:
        if ex == "phase5.decode_attention":
            return _decode_attention(r)
        if ex == "phase5.quant_kernels":
            return _stored_gemv(r)
        if ex == "phase5.offline":
            return _offline(r)
        if ex == "phase5.tensor_parallel":
            return _tensor_parallel(r)
        if ex == "phase5.speculative":
            return _speculative(r)
        if ex == "phase5.best_of_n":
            return _best_of_n(r)
        shape = named(_v(r, "params.model"))
        prompt, output = int(_v(r, "params.prompt_tokens")), int(_v(r, "params.output_tokens"))
    except (LabError, TypeError, ValueError):     # a checkpoint's shape, a missing field: not modelled here
        return None
    context = mean_decode_context(prompt, output)
    if ex == "phase5.batching" and r["variant"] == "lab-engine":
        batch = int(_v(r, "params.concurrency"))
        return with_host_step(decode_step(shape, batch, context), _v(r, "summary.host_step_us"), batch)
    if ex == "phase5.ttft_decode" and r["variant"].startswith("lab-engine"):
        return prefill(shape, prompt) if _v(r, "params.stage") == "prefill" else decode_step(shape, 1, context)
    if ex == "phase5.samples" and r["variant"] == "lab-engine":
        batch = int(_v(r, "params.n"))
        step = sampled_decode_step(shape, batch, context, float(_v(r, "params.temperature")),
                                   bool(_v(r, "params.seeded", False)), _v(r, "summary.sampler_draw", PER_ROW_GENERATOR))
        return with_host_step(step, _v(r, "summary.host_step_us"), batch)
    if ex == "phase5.quant_engine":
        fmt = _v(r, "params.format")
        if fmt not in ("bf16", "int4"):
            return None                      # int8's path has no kernel list here
        wb = BF16_BYTES if fmt == "bf16" else int4_weight_bytes(int(_v(r, "params.group_size")))
        return decode_step(shape, int(_v(r, "params.batch")), context, weight_bytes=wb,
                           norm_in_quant_kernel=r["variant"] == "int4_cuda")
    return None


def _offline(r: dict) -> Workload | None:
    """The offline row's run: its prompts' and outputs' lengths drawn again from the record's seed
    (offline.py draws them with benchmark/workload.py's generators), scheduled as the engine does.
    None without the record's seed and max_num_seqs (`record.params.*`, which workload_rows adds)."""
    seed, max_num_seqs = _v(r, "record.params.seed"), _v(r, "record.params.max_num_seqs")
    if r["variant"] != "lab-engine" or seed is None or max_num_seqs is None:
        return None
    shape = named(_v(r, "params.model"))
    (lo_in, hi_in), (lo_out, hi_out) = _v(r, "params.input_tokens"), _v(r, "params.output_tokens")
    n = int(_v(r, "params.num_seqs"))
    prompts = random_prompts(n, (lo_in, hi_in), shape.vocab_size, int(seed))
    return offline_run(shape, [len(p) for p in prompts], random_lengths(n, lo_out, hi_out, int(seed) + 1),
                       int(max_num_seqs))


def _tensor_parallel(r: dict) -> Workload | None:
    """A tensor-parallel engine row (batch 1: max_num_seqs 1): one rank's decode step with its
    collectives at the all-reduce times the same record measured (`record.rows`)."""
    if r["variant"] != "engine" or _v(r, "params.max_num_seqs") != 1:
        return None
    shape, tp = named(_v(r, "params.model")), int(_v(r, "params.tp"))
    context = mean_decode_context(int(_v(r, "params.prompt_tokens")), int(_v(r, "params.output_tokens")))
    return tp_decode_step(shape, tp, 1, context, all_reduce_from_rows(_v(r, "record.rows"), tp))


def _speculative(r: dict) -> Workload | None:
    """A speculative row of the "lab" model set: the target's decode step (k = 0) or a speculative
    step of the row's k (prompt lookup at its measured proposals per verify)."""
    if _v(r, "record.params.models", "lab") != "lab" or r["variant"] not in (*SPECULATIVE_SHAPES, "ngram"):
        return None
    c, k = int(_v(r, "params.concurrency")), int(_v(r, "params.k"))
    context = mean_decode_context(int(_v(r, "params.prompt_tokens")), int(_v(r, "params.output_tokens")))
    if r["variant"] == "target":
        return decode_step(SPECULATIVE_TARGET, c, context)
    if r["variant"] == "ngram":
        return speculative_step(SPECULATIVE_TARGET, None, c, k, context, _v(r, "metrics.proposed_per_verify"))
    return speculative_step(SPECULATIVE_TARGET, SPECULATIVE_SHAPES[r["variant"]], c, k, context)


def _best_of_n(r: dict) -> Workload | None:
    """A best_of_n row: the trained arithmetic model's decode step at the row's measured batch
    (`metrics.decode_batch`: every question's samples in flight, up to max_num_seqs) over a
    question's prompt ("\\na+b=", 2 x digits + 3 tokens) and half its answer (max_tokens), each sample
    seeded (best_of_n.answer_all: sample i of question q from seed + q x MAX_N + i), drawn as the
    record says its sampler drew (summary.sampler_draw; older records: one noise row per sample). The model is tiny: its kernels are at their launch floors, and
    the step is the host's (launches, the per-row draws, the scheduler: unmeasured here)."""
    hidden, layers, heads = _v(r, "record.params.hidden"), _v(r, "record.params.layers"), _v(r, "record.params.heads")
    batch, digits = _v(r, "metrics.decode_batch"), _v(r, "params.digits")
    if None in (hidden, layers, heads, batch, digits):
        return None
    shape = arithmetic_shape(int(hidden), int(layers), int(heads))
    context = mean_decode_context(2 * int(digits) + 3, int(_v(r, "params.max_tokens", int(digits) + 2)))
    temperature = float(_v(r, "params.temperature", 0.0))
    return with_host_step(sampled_decode_step(shape, int(batch), context, temperature, seeded=True,
                                              draw=_v(r, "summary.sampler_draw", PER_ROW_GENERATOR)),
                          _v(r, "summary.host_step_us"), int(batch))


def _decode_attention(r: dict) -> Workload | None:
    """One timed call of the paged decode attention, from the row's own stored counts: the kernel
    (one exponential per cached token and head) and the combine when split."""
    if r["variant"] != "triton":
        return None
    flops, nbytes = _v(r, "prediction.flops"), _v(r, "prediction.bytes")
    launches, hd = int(_v(r, "prediction.launches", 1)), _v(r, "params.head_dim")
    if not flops or not nbytes or not hd:
        return None
    main = Kernel("paged decode attention", ELEMENTWISE, flops, nbytes, None, exps=flops / (4 * hd), launch=TRITON)
    combine = Kernel("combine the splits", ELEMENTWISE, 0, 0, None, launch=TRITON, count=launches - 1)
    return Workload("paged decode attention", (main, combine) if launches > 1 else (main,))


# ------------------------------------------------------------------------------ `lab predict`
def decode_workloads(shape: LlamaShape, batches, prompt_tokens: int, output_tokens: int,
                     weight_bytes: float = BF16_BYTES, what: str = "") -> list[tuple[str, Workload]]:
    context = mean_decode_context(prompt_tokens, output_tokens)
    return [(f"{shape.name}{what} decode step at batch {b}", decode_step(shape, b, context, weight_bytes=weight_bytes))
            for b in batches]


def speculative_workloads(p: dict) -> list[tuple[str, Workload]]:
    """speculative's rows before running, for the "lab" model set (the test-sized "tiny" set: none):
    at each concurrency the target's decode step and, at each k, a draft step (the three drafts share
    one shape) and a prompt-lookup step, the latter at k proposals per verify (how many it finds is
    known only once it runs: its measured rows use the record's proposals)."""
    if p["models"] != "lab":
        return []
    context = mean_decode_context(p["prompt_tokens"], p["output_tokens"])
    out = []
    for c in p["concurrency"]:
        out.append((f"target decode step at {c} at once", decode_step(SPECULATIVE_TARGET, c, context)))
        for k in p["ks"]:
            out.append((f"draft x {k} + verify at {c} at once",
                        speculative_step(SPECULATIVE_TARGET, SPECULATIVE_DRAFT, c, k, context)))
            out.append((f"prompt lookup of up to {k} + verify at {c} at once",
                        speculative_step(SPECULATIVE_TARGET, None, c, k, context, float(k))))
    return out


def all_reduce_from_link_ceilings(link_ceilings: dict | None, hardware: str | None, tp: int):
    """ms of one all-reduce of n bytes on `tp` GPUs from phase4.link_ceilings' alpha-beta constants of
    this hardware (NCCL's all-reduce: phase4/calibration.index's keys), or None where none was measured."""
    entry = (link_ceilings or {}).get((hardware, "nccl", "all_reduce", tp))
    if entry is None:
        return None
    factor = 2 * (tp - 1) / tp                        # nccl-tests' all-reduce bus factor

    def ms(nbytes: float) -> float:
        return entry["alpha_us"] / 1e3 + nbytes * factor / (entry["beta_busbw_gbps"] * 1e6)
    return ms


def tensor_parallel_workloads(p: dict, link_ceilings: dict | None = None, hardware: str | None = None,
                              committed_rows: list[dict] | None = None) -> list[tuple[str, Workload]]:
    """tensor_parallel's batch-1 engine rows before running: one rank's decode step at each TP size,
    its all-reduces timed as the run itself will time them where this hardware has a committed
    tensor_parallel record with all-reduce rows at that world size (`committed_rows`: the engine's
    `auto` takes the faster of NCCL and the one-shot per size, so NCCL's constants alone would
    overstate them), else at phase4.link_ceilings' NCCL alpha-beta (said so), else left out (said so)."""
    if p["max_num_seqs"] != 1:
        return []
    context = mean_decode_context(p["prompt_tokens"], p["output_tokens"])
    out = []
    for m in p["models"]:
        if m == "tiny":
            continue
        for tp in p["tp_sizes"]:
            measured = all_reduce_from_rows(committed_rows, tp)
            step = tp_decode_step(named(m), tp, 1, context,
                                  measured or all_reduce_from_link_ceilings(link_ceilings, hardware, tp))
            if tp > 1 and measured is None and step.collectives:
                step = replace(step, notes=(*step.notes, f"TP={tp}: all-reduces at phase4.link_ceilings' NCCL "
                                            "alpha-beta (no committed one-shot all-reduce rows at this size)"))
            out.append((f"{m} at TP={tp}: one rank's decode step", step))
    return out


def ttft_workloads(shape: LlamaShape, prompt_tokens: int, output_tokens: int) -> list[tuple[str, Workload]]:
    """ttft_decode's two rows per model: the batch-1 decode step (TPOT) and the prefill (TTFT)."""
    return [*decode_workloads(shape, [1], prompt_tokens, output_tokens),
            (f"{shape.name} prefill of {prompt_tokens} tokens", prefill(shape, prompt_tokens))]


def samples_workloads(shape: LlamaShape, ns, prompt_tokens: int, output_tokens: int, temperature: float,
                      seeded: bool) -> list[tuple[str, Workload]]:
    """samples' decode step at each n: the graph and, sampling, the sampler's kernels."""
    context = mean_decode_context(prompt_tokens, output_tokens)
    return [(f"{shape.name} decode step of {n} samples", sampled_decode_step(shape, n, context, temperature, seeded))
            for n in ns]


def best_of_n_workloads(p: dict) -> list[tuple[str, Workload]]:
    """best_of_n's greedy step and each n's sampled, seeded step at its batch (every question's
    samples in flight, up to max_num_seqs)."""
    shape = arithmetic_shape(p["hidden"], p["layers"], p["heads"])
    context = mean_decode_context(2 * p["digits"] + 3, p["digits"] + 2)
    batch = {n: min(p["questions"] * n, p["max_num_seqs"]) for n in p["n"]}
    greedy = min(p["questions"], p["max_num_seqs"])
    return [(f"greedy decode step at batch {greedy}", sampled_decode_step(shape, greedy, context, 0.0, seeded=True)),
            *[(f"n {n}: sampled decode step at batch {b}",
               sampled_decode_step(shape, b, context, p["temperature"], seeded=True)) for n, b in batch.items()]]


def quant_workloads(shape: LlamaShape, batches, prompt_tokens: int, output_tokens: int,
                    group_size: int) -> list[tuple[str, Workload]]:
    """quant_engine's bf16 and int4 decode steps (int8 has no kernel list here)."""
    return [*decode_workloads(shape, batches, prompt_tokens, output_tokens, what=" bf16"),
            *decode_workloads(shape, batches, prompt_tokens, output_tokens, int4_weight_bytes(group_size), " int4")]


def stored_count_workloads(exercise: str, works) -> list[tuple[str, Workload]]:
    """`lab predict`'s rows of an exercise whose kernel list reads a row's own stored counts
    (decode_attention, quant_kernels): each (Work, its problem's params) as the row it will
    record; the variants the kernel list does not model are left out."""
    out = []
    for w, params in works:
        r = {"exercise": exercise, "variant": w.label.split()[0], "prediction.flops": w.flops,
             "prediction.bytes": w.bytes, "prediction.launches": w.launches,
             **{f"params.{k}": v for k, v in params.items()}}
        built = row_workload(r)
        if built is not None:
            out.append((w.label, built))
    return out


def _stored_gemv(r: dict) -> Workload | None:
    """One quant_kernels call (a projection of a few rows in a weight format), from the row's own
    stored counts: its weight and scales read at the GEMV bandwidth, the rest of its launches (a
    dequantize, a cast) at their floor."""
    flops, nbytes = _v(r, "prediction.flops"), _v(r, "prediction.bytes")
    launches = int(_v(r, "prediction.launches", 1))
    if not flops or not nbytes:
        return None
    main = Kernel(f"{r['variant']} projection", GEMV, flops, nbytes, "bf16", launch=TORCH)
    rest = Kernel("its other launches", ELEMENTWISE, 0, 0, None, launch=TORCH, count=launches - 1)
    return Workload(f"{r['variant']} projection", (main, rest) if launches > 1 else (main,))
