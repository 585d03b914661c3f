"""Phase 5's predictions, torch-free: what a decode step, a prefill and a serving run should cost by
the roofline, from the model's shape alone. The exercises record them beside what they measure;
`lab predict` and the report use the same functions.

A decode step of a batch reads every weight once (shared by the batch) plus each sequence's cached
K and V, and does 2 FLOPs per weight per sequence: memory-bound until the batch reaches the ridge
(peak FLOP/s over bandwidth, in tokens), compute-bound after. Its two parts run one after the other
(the weight matmuls, then attention over the cache, layer by layer), so a step is predicted as the
sum of their rooflines, not one roofline over the totals (decode_parts).
"""
import math

from common.roofline import compute_ms, memory_ms

from ..engine import LlamaShape


def decode_step_bytes(shape: LlamaShape, batch: int, mean_context: float) -> float:
    """Weights once, plus K and V of `mean_context` tokens for each of `batch` sequences."""
    return shape.decode_weight_bytes() + batch * mean_context * shape.kv_bytes_per_token()


def decode_step_flops(shape: LlamaShape, batch: int, mean_context: float) -> float:
    return batch * shape.flops_per_token(int(mean_context))


def decode_parts(shape: LlamaShape, batch: int, mean_context: float) -> list[tuple[float, float]]:
    """(FLOPs, bytes) of a decode step's weight matmuls and of its attention over the cache."""
    matmul_flops = batch * shape.flops_per_token(0)
    attention_flops = batch * shape.flops_per_token(int(mean_context)) - matmul_flops
    return [(matmul_flops, shape.decode_weight_bytes()),
            (attention_flops, batch * mean_context * shape.kv_bytes_per_token())]


def decode_step_ms(shape: LlamaShape, batch: int, mean_context: float, bandwidth_gbps: float,
                   peak_tflops: float) -> float:
    return sum(step_ms(f, b, bandwidth_gbps, peak_tflops) for f, b in decode_parts(shape, batch, mean_context))


def prefill_bytes(shape: LlamaShape, prompt_tokens: int) -> float:
    """A prefill reads the weights once and writes the prompt's K and V."""
    return shape.decode_weight_bytes() + prompt_tokens * shape.kv_bytes_per_token()


def prefill_flops(shape: LlamaShape, prompt_tokens: int) -> float:
    """Each token attends to the ones before it: half the prompt on average."""
    return prompt_tokens * shape.flops_per_token(prompt_tokens // 2)


def step_ms(flops: float, nbytes: float, bandwidth_gbps: float, peak_tflops: float) -> float:
    return max(memory_ms(nbytes, bandwidth_gbps), compute_ms(flops, peak_tflops))


def ridge_batch(shape: LlamaShape, bandwidth_gbps: float, peak_tflops: float) -> float:
    """The decode batch at which the weights' FLOPs take as long as reading them (attention aside):
    above it a step is compute-bound, and adding sequences no longer comes for free."""
    flops_per_seq = shape.flops_per_token(0)
    return memory_ms(shape.decode_weight_bytes(), bandwidth_gbps) / compute_ms(flops_per_seq, peak_tflops)


def mean_decode_context(prompt_tokens: int, output_tokens: int) -> float:
    """Tokens a decode step attends to, averaged over a request's decode steps."""
    return prompt_tokens + output_tokens / 2


def serving_prediction(shape: LlamaShape, concurrency: int, prompt_tokens: int, output_tokens: int,
                       bandwidth_gbps: float, peak_tflops: float, max_batched_tokens: int = 8192) -> dict:
    """A closed loop of `concurrency` requests, each a prefill of `prompt_tokens` then
    `output_tokens - 1` decode steps shared with the others. Per round of `concurrency` requests:
    their prefills (batched up to `max_batched_tokens` a step) plus the decode steps. Returns the
    decode step time (the TPOT a client should see), the round time and the output tok/s."""
    context = mean_decode_context(prompt_tokens, output_tokens)
    decode_ms = decode_step_ms(shape, concurrency, context, bandwidth_gbps, peak_tflops)
    per_step = max(1, max_batched_tokens // max(1, prompt_tokens))
    prefill_steps = math.ceil(concurrency / per_step)
    batch_tokens = min(concurrency, per_step) * prompt_tokens
    prefill_ms = prefill_steps * step_ms(prefill_flops(shape, prompt_tokens) * batch_tokens / prompt_tokens,
                                         prefill_bytes(shape, batch_tokens), bandwidth_gbps, peak_tflops)
    round_ms = prefill_ms + (output_tokens - 1) * decode_ms
    return {"decode_step_ms": decode_ms, "prefill_ms": prefill_ms, "round_ms": round_ms,
            "output_tok_s": concurrency * output_tokens / (round_ms / 1e3),
            "decode_bytes": decode_step_bytes(shape, concurrency, context),
            "decode_flops": decode_step_flops(shape, concurrency, context),
            "bound": "compute" if concurrency > ridge_batch(shape, bandwidth_gbps, peak_tflops) else "memory"}


def offline_steps(shape: LlamaShape, prompt_lens: list[int], output_lens: list[int], max_num_seqs: int,
                  max_batched_tokens: int) -> list[list[tuple[float, float]]]:
    """The parts, (FLOPs, bytes) each, of every step an offline run takes (a prefill is one part, a
    decode step its two decode_parts) when every request arrives at once and the KV pool holds them all: prefills first, packed up to the token and sequence limits (each yields
    its sequence's first token), then decode steps while any sequence still has tokens to make.
    Requests beyond `max_num_seqs` wait for a slot: modelled as the next wave."""
    steps = []
    order = list(zip(prompt_lens, output_lens))
    for wave_start in range(0, len(order), max_num_seqs):
        wave = order[wave_start: wave_start + max_num_seqs]
        batch_tokens, batch_flops = 0, 0.0
        for p, _ in wave:
            if batch_tokens and batch_tokens + p > max_batched_tokens:
                steps.append([(batch_flops, prefill_bytes(shape, batch_tokens))])
                batch_tokens, batch_flops = 0, 0.0
            batch_tokens += p
            batch_flops += prefill_flops(shape, p)
        if batch_tokens:
            steps.append([(batch_flops, prefill_bytes(shape, batch_tokens))])
        for s in range(1, max(o for _, o in wave)):
            active = [p + s for p, o in wave if o > s]
            mean_context = sum(active) / len(active)
            steps.append(decode_parts(shape, len(active), mean_context))
    return steps
