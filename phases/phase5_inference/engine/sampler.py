"""The next token of each sequence from its fp32 logits: greedy (argmax), or a sample after
temperature, top-k and top-p.

A sampled row draws by the inverse CDF: one uniform number u per row, the token the first whose
running sum of probabilities passes u times their total (counter_uniform.py). The uniform is a hash
of the row's counter, (the request's seed, or the engine's seed and the sequence's id when it has
none; the index of the token being drawn), computed on the host for the whole batch at once, so a
request's tokens are the same alone or inside any batch, after a preemption, and ahead of an
overlapped step, with no generator state to keep and a fixed number of launches however many rows
sample (a generator per seeded row cost one launch and its Python loop per row each step).

Logits processing (vLLM's order: repetition, frequency and presence penalties, logit_bias, the
min_tokens mask; then temperature, top-k, top-p, min-p) runs on the host's side of the step, per
row, only for requests that ask for it: the decode graph stays the same, and every other row keeps
the graph's argmax or its own seeded draw.
"""
import torch

from .counter_uniform import row_uniforms
from .sequence import Sequence


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor through pinned memory, without waiting for the GPU
    (a pageable copy would wait for every kernel queued before it)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def categorical(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of probs [n, V] (rows need not sum to 1): the exponential race, argmax of
    p / E with E ~ Exp(1), all on the device (torch.multinomial waits for the host)."""
    return (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax(dim=1)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row of probs [n, V] (rows need not sum to 1; zeros are never drawn) from one
    uniform in [0, 1) per row (float64 [n]): the first token whose running sum (float64) exceeds u
    times the row's total. Where rounding puts u x total at the total itself, the row's last token
    of nonzero probability (the first where the running sum reaches the total)."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:].contiguous()
    drawn = torch.searchsorted(cdf, uniforms[:, None] * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(drawn, last)[:, 0]


class Sampler:
    DRAW = "inverse_cdf"            # how a sampled row is drawn (records name it; kernel_lists models it)

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = torch.device(device)
        self.seed = seed
        self.eos_token_ids: frozenset[int] = frozenset()     # masked with stop_token_ids before min_tokens

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], argmax: torch.Tensor | None = None,
               ahead: int = 0) -> list[int]:
        """logits [batch, vocab] fp32 -> one token id per row (seqs[i]'s). `argmax`: the logits'
        argmax if already computed (a decode graph computes it). Rows whose request asks for no
        logits processing keep exactly the token they would get in any other batch; rows that ask
        for logprobs get them appended to seq.new_logprobs (of the raw logits, as vLLM reports)."""
        params = [s.params for s in seqs]
        wants_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = logits[on_device(wants_logprobs, torch.int64, logits.device)] if wants_logprobs else None
        tokens = self.pick(logits, seqs, argmax, ahead).tolist()
        if wants_logprobs:
            entries = token_logprobs(raw, [tokens[i] for i in wants_logprobs],
                                     [params[i].logprobs for i in wants_logprobs])
            for i, entry in zip(wants_logprobs, entries):
                seqs[i].new_logprobs.append(entry)
        return tokens

    def pick(self, logits: torch.Tensor, seqs: list[Sequence], argmax: torch.Tensor | None = None,
             ahead: int = 0) -> torch.Tensor:
        """`sample`'s token ids left on the device (int64 [batch]), no logprobs: without logits
        processing nothing here waits for the device, so an overlapped step launches the next
        one before reading these (overlap.py). `ahead`: tokens each sequence has drawn that are not
        in it yet (1 for an overlapped step: its pending token), so each draw keeps its own counter."""
        params = [s.params for s in seqs]
        greedy = logits.argmax(dim=-1) if argmax is None else argmax
        processed = [i for i, p in enumerate(params) if p.processes_logits]
        if processed:
            logits = logits.clone()
            for i in processed:
                self._process(logits[i], seqs[i])
            index = on_device(processed, torch.int64, logits.device)
            greedy = greedy.clone()
            greedy[index] = logits[index].argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            greedy = greedy.clone() if not processed else greedy
            greedy[on_device(rows, torch.int64, logits.device)] = self._draw(logits, rows, seqs, ahead)
        return greedy

    def _draw(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence], ahead: int = 0) -> torch.Tensor:
        """Sampled tokens of `rows`: temperature, top-k, top-p, min-p, then the inverse-CDF draw at
        each row's own counter (the index of the token it draws: its output tokens so far, plus `ahead`)."""
        chosen = [seqs[i].params for i in rows]
        index = on_device(rows, torch.int64, logits.device)
        temperature = on_device([p.temperature for p in chosen], logits.dtype, logits.device)
        scaled = logits[index] / temperature[:, None]
        scaled = _top_k_top_p(scaled, [p.top_k for p in chosen], [p.top_p for p in chosen])
        probs = scaled.softmax(dim=-1)
        if any(p.min_p > 0.0 for p in chosen):
            min_p = on_device([p.min_p for p in chosen], probs.dtype, probs.device)
            floor = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            probs = probs.masked_fill(probs < floor, 0.0)
        uniforms = row_uniforms([p.seed for p in chosen], [seqs[i].draw_stream for i in rows],
                                [seqs[i].num_output_tokens + ahead for i in rows], self.seed)
        return inverse_cdf(probs, on_device(uniforms.tolist(), torch.float64, probs.device))

    def _process(self, row: torch.Tensor, seq: Sequence) -> None:
        """One row of logits, in place: repetition penalty (prompt and output tokens), frequency and
        presence penalties (output tokens), logit_bias, and EOS / stop ids masked before min_tokens."""
        p, vocab, device = seq.params, row.shape[0], row.device
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.int64, device=device)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        output = seq.output_token_ids
        if output and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
            counts = torch.bincount(torch.tensor(output, dtype=torch.int64, device=device), minlength=vocab)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=device)
            row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=device)
        if seq.num_output_tokens < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            stops = sorted(t for t in stops if t < vocab)
            if stops:
                row[torch.tensor(stops, dtype=torch.int64, device=device)] = float("-inf")


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top: list[int]) -> list[tuple]:
    """Per row of fp32 logits [n, V]: (log-probability of token_ids[row], [(id, logprob) of the
    row's top[row] most likely tokens, best first]). One log-softmax, one gather, one top-k."""
    if logits.shape[0] == 0:
        return []
    logprobs = logits.float().log_softmax(dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    k = max(top)
    if k == 0:
        return [(c, []) for c in chosen]
    values, indices = logprobs.topk(k, dim=-1)
    values, indices = values.tolist(), indices.tolist()
    return [(c, list(zip(indices[r][:top[r]], values[r][:top[r]]))) for r, c in enumerate(chosen)]


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Logits outside each row's top-k, and outside the smallest set whose probability reaches
    top_p, set to -inf (k = 0 and p = 1 leave a row alone)."""
    use_k = any(k > 0 for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    if not (use_k or use_p):
        return logits
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1)                     # ascending
    if use_k:
        k = on_device([min(k, vocab) if k > 0 else vocab for k in top_k], torch.int64, logits.device)
        kth_largest = sorted_logits.gather(1, (vocab - k)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if use_p:
        p = on_device(top_p, logits.dtype, logits.device)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative <= 1 - p[:, None]
        outside[:, -1] = False                                     # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
