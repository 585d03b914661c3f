"""Which of a draft's proposed tokens the target keeps, and the token that follows them.

Greedy (temperature 0): proposal j is kept while it equals the target's argmax after the tokens
before it; the first disagreement is replaced by the target's argmax, and when all k are kept the
target's argmax after them is a free (bonus) token. The output is then token for token the
target's own greedy output.

Sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"):
proposal x drawn from the draft's q is kept with probability min(1, p(x) / q(x)); the first one
rejected is replaced by a draw from norm(max(0, p - q)); when all are kept, the bonus is drawn from
the target's p after them. Every emitted token is then distributed exactly as the target alone
would have drawn it. A draft without a distribution (prompt lookup proposes fixed tokens) is the
case q = one-hot(x): kept with probability p(x), replaced from p with x removed.

Rows of a batch may carry fewer proposals than others (padding: token -1, never kept).
"""
import torch

from .sampler import categorical


def greedy_accept(proposals: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """proposals [k], target_argmax [k + 1] (the target's argmax after the last verified token and
    after each proposal) -> (proposals kept, the token that follows them)."""
    kept = 0
    while kept < len(proposals) and proposals[kept] == target_argmax[kept]:
        kept += 1
    return kept, target_argmax[kept]


def rejection_sample(draft_tokens: torch.Tensor, num_proposed: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor, generator: torch.Generator | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens [n, K] int64, num_proposed [n], draft_probs [n, K, V] (None: fixed proposals),
    target_probs [n, K + 1, V] -> (kept proposals [n], next token [n]): the target's distribution
    exactly, whatever the draft's."""
    n, k = draft_tokens.shape
    device = draft_tokens.device
    tokens = draft_tokens.clamp(min=0)
    p_of_x = target_probs[:, :k].gather(2, tokens[:, :, None]).squeeze(2)
    if draft_probs is None:
        ratio = p_of_x
    else:
        q_of_x = draft_probs.gather(2, tokens[:, :, None]).squeeze(2)
        ratio = p_of_x / q_of_x.clamp(min=torch.finfo(q_of_x.dtype).tiny)
    uniform = torch.rand(n, k, device=device, generator=generator)
    positions = torch.arange(k, device=device)
    keep = (uniform < ratio) & (positions < num_proposed[:, None])
    kept = keep.int().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(n, device=device)
    p_next = target_probs[rows, kept]                              # [n, V]: after the kept proposals
    rejected = kept < num_proposed
    if k > 0:                                                      # no test on `rejected`: that would wait for the GPU
        at = kept.clamp(max=k - 1)
        if draft_probs is None:
            q_next = torch.zeros_like(p_next).scatter_(1, tokens[rows, at][:, None], 1.0)
        else:
            q_next = draft_probs[rows, at]
        residual = (p_next - q_next).clamp(min=0)
        mass = residual.sum(dim=1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), p_next)
        p_next = torch.where(rejected[:, None], residual, p_next)
    return kept, categorical(p_next, generator)
