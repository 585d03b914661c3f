"""The next token of each sequence from its fp32 logits: greedy (argmax), or a sample after
temperature, top-k and top-p.

Sampling uses the exponential-race form of a categorical draw (argmax of p / E with E ~ Exp(1)),
one row of noise per sequence. A request with a seed draws its noise from its own generator, so its
tokens are the same alone or inside any batch, and after a preemption (the generator lives as long
as the request); requests without a seed share the engine's generator.
"""
import torch

from .sequence import SamplingParams


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor through pinned memory, without waiting for the GPU
    (a pageable copy would wait for every kernel queued before it)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def categorical(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of probs [n, V] (rows need not sum to 1): the exponential race, argmax of
    p / E with E ~ Exp(1), all on the device (torch.multinomial waits for the host)."""
    return (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax(dim=1)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = torch.device(device)
        self._shared = torch.Generator(device=self.device).manual_seed(seed)
        self._seeded: dict[int, torch.Generator] = {}

    def release(self, seq_id: int) -> None:
        """Forget a finished request's generator."""
        self._seeded.pop(seq_id, None)

    def _generator(self, seq_id: int, seed: int) -> torch.Generator:
        generator = self._seeded.get(seq_id)
        if generator is None:
            generator = self._seeded[seq_id] = torch.Generator(device=self.device).manual_seed(seed)
        return generator

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int],
               argmax: torch.Tensor | None = None) -> list[int]:
        """logits [batch, vocab] fp32 -> one token id per row. `argmax`: the logits' argmax if
        already computed (a decode graph computes it)."""
        greedy = logits.argmax(dim=-1) if argmax is None else argmax
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return greedy.tolist()
        greedy = greedy.clone()
        chosen = [params[i] for i in rows]
        index = on_device(rows, torch.int64, logits.device)
        temperature = on_device([p.temperature for p in chosen], logits.dtype, logits.device)
        scaled = logits[index] / temperature[:, None]
        scaled = _top_k_top_p(scaled, [p.top_k for p in chosen], [p.top_p for p in chosen])
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs)
        unseeded = []
        for row, (i, p) in enumerate(zip(rows, chosen)):
            if p.seed is None:
                unseeded.append(row)
            else:
                noise[row].exponential_(generator=self._generator(seq_ids[i], p.seed))
        if unseeded:
            shared = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(generator=self._shared)
            noise[on_device(unseeded, torch.int64, probs.device)] = shared
        greedy[index] = (probs / noise).argmax(dim=-1)
        return greedy.tolist()


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
        k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=logits.device)
        kth_largest = sorted_logits.gather(1, (vocab - k)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if use_p:
        p = torch.tensor(top_p, device=logits.device, dtype=logits.dtype)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative <= 1 - p[:, None]
        outside[:, -1] = False                                     # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
