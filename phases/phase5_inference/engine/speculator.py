"""Speculative decoding: a cheap proposer guesses up to k tokens per sequence, the target checks
them all in one forward pass over the paged cache, and the tokens it would not have produced are
rolled back.

A decode step of a sequence with L verified tokens (the last not yet cached by the target):
  1. propose: the proposer appends k guesses to seq.token_ids (positions L .. L + k - 1);
  2. verify: one target forward of k + 1 rows, positions L - 1 .. L + k - 1 (runner.rows_logits):
     each row writes its K and V, and row j's logits are the target's prediction for position L + j;
  3. accept (rejection.py): greedy agreement, or Leviathan et al.'s rejection sampling;
  4. roll back: seq.token_ids is cut back to L, the kept proposals and the next token are returned
     (the engine appends them), and blocks past what the kept tokens need are freed. Cache slots
     past the verified tokens hold the rejected tokens' K and V until overwritten: nothing attends
     there, since a row attends only over positions before it.

Proposers:
  DraftProposer  a small model of the same vocabulary on its own runner, sharing the target's block
                 tables (its own pool of the same number of blocks, its own K and V): it prefills
                 what the target prefills and catches up on the tokens it has not cached (the last
                 verified one, and the last proposal when all k were kept) in its first row.
  NgramProposer  prompt lookup: the tokens that followed the latest earlier occurrence of the
                 sequence's last n tokens (n from NGRAM_MAX down to NGRAM_MIN); no model, no cache,
                 fixed proposals (q = one-hot).
"""
import itertools
import time

import numpy as np
import torch

from .draft_chain import DraftChain
from .rejection import greedy_accept, rejection_sample
from .sampler import _top_k_top_p, categorical, on_device
from .sequence import SamplingParams, Sequence

NGRAM_MAX = 3
NGRAM_MIN = 1
MAX_SPECULATIVE_TOKENS = 8


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """fp32 logits [rows, V] -> the distribution each row's request samples from (temperature,
    top-k, top-p applied); greedy rows get a one-hot on their argmax."""
    temperature = on_device([p.temperature if not p.greedy else 1.0 for p in params], logits.dtype, logits.device)
    scaled = _top_k_top_p(logits / temperature[:, None], [p.top_k for p in params], [p.top_p for p in params])
    probs = scaled.softmax(dim=-1)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        index = on_device(greedy, torch.int64, logits.device)
        probs[index] = torch.zeros_like(probs[index]).scatter_(1, logits[index].argmax(dim=1, keepdim=True), 1.0)
    return probs


def chainable(params: list[SamplingParams]) -> bool:
    """Whether a draft's k steps can run chained on the device: every request greedy, or every
    one sampling at a temperature alone (top-k and top-p take the step-by-step path)."""
    if all(p.greedy for p in params):
        return True
    return all(not p.greedy and p.top_k == 0 and p.top_p == 1.0 for p in params)


def ngram_proposal(token_ids: list[int], k: int, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens, for the
    longest n in [n_min, n_max] that occurred; [] when none did."""
    if k < 1 or len(token_ids) < n_min + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)      # starts before the suffix's own
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    name = "ngram"

    def prefill(self, seqs: list[Sequence]) -> None:
        pass

    def propose(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[int], None]:
        """Append each sequence's proposals (at most ks[i]); (how many each got, no distribution)."""
        counts = []
        for seq, k in zip(seqs, ks):
            proposal = ngram_proposal(seq.token_ids, k)
            seq.token_ids.extend(proposal)
            counts.append(len(proposal))
        return counts, None

    def verified(self, seq: Sequence, num_verified: int, proposed: int, kept: int) -> None:
        pass

    def forget(self, seq: Sequence) -> None:
        pass


class DraftProposer:
    """A draft model on its own ModelRunner (the target's block size and number of blocks; rows
    for two tokens per sequence, its catch-up)."""
    name = "draft"

    def __init__(self, runner, generator: torch.Generator):
        self.runner = runner
        self.chain = DraftChain(runner)
        self.generator = generator
        self._cached: dict[int, int] = {}          # seq_id -> tokens whose draft K and V are written
        self._q_buffer: torch.Tensor | None = None

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> None:
        """Cache every token of `seqs` (called with the target's prefill, before its token is appended)."""
        self.runner.prefill(seqs)
        for seq in seqs:
            self._cached[seq.seq_id] = seq.num_tokens

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """Append ks[i] draft tokens to each sequence, sampled from the draft as its request samples
        (argmax when greedy); (ks, the draft's distributions [n, K, V] when any request samples)."""
        active = [i for i, k in enumerate(ks) if k > 0]
        if not active:
            return list(ks), None
        width = max(ks)
        params = [seqs[i].params for i in active]
        sampling = not all(p.greedy for p in params)
        q = self._distributions(len(seqs), width) if sampling else None
        if chainable(params):
            self._propose_chained(seqs, ks, active, q)
            return list(ks), q
        rows, positions, last_rows = [], [], []
        for i in active:                                       # step 0: catch up, guess position L
            seq = seqs[i]
            for p in range(self._cached[seq.seq_id], seq.num_tokens):
                rows.append(seq)
                positions.append(p)
            last_rows.append(len(rows) - 1)
        for step in range(width):
            logits, argmax = self.runner.rows_logits(rows, positions)
            picked = last_rows if len(last_rows) != len(rows) else None
            tokens = self._choose(logits, argmax, picked, params, q, active, step, sampling)
            for i, token in zip(active, tokens):
                seqs[i].token_ids.append(token)
            active = [i for i in active if ks[i] > step + 1]
            params = [seqs[i].params for i in active]
            rows = [seqs[i] for i in active]
            positions = [seqs[i].num_tokens - 1 for i in active]
            last_rows = list(range(len(rows)))
        return list(ks), q

    def _distributions(self, n: int, k: int) -> torch.Tensor:
        """A [n, k, V] view of one buffer kept across steps (allocating and zeroing it each step cost
        more host time than the draft's forward); entries a step does not write are never read."""
        buffer = self._q_buffer
        if buffer is None or buffer.shape[0] < n or buffer.shape[1] < k:
            rows = max(n, 0 if buffer is None else buffer.shape[0])
            buffer = self._q_buffer = torch.empty(rows, MAX_SPECULATIVE_TOKENS, self.runner.shape.vocab_size,
                                                  device=self.runner.device)
        return buffer[:n, :k]

    def _propose_chained(self, seqs: list[Sequence], ks: list[int], active: list[int], q: torch.Tensor | None) -> None:
        """ks[i] proposals for each active sequence, the draft steps chained on the device (greedy,
        or sampled at each request's temperature with the distributions written into q); a
        sequence wanting fewer than the most rides along without writing its cache."""
        rows, positions, last_rows = [], [], []
        for i in active:
            seq = seqs[i]
            for p in range(self._cached[seq.seq_id], seq.num_tokens):
                rows.append(seq)
                positions.append(p)
            last_rows.append(len(rows) - 1)
        lengths = [ks[i] for i in active]
        chained_q = q if q is None or len(active) == len(seqs) else torch.empty_like(q[:len(active)])
        temperatures = None if q is None else [seqs[i].params.temperature for i in active]
        chained = self.chain.tokens(rows, positions, last_rows, max(lengths), temperatures, chained_q,
                                   self.generator, lengths=lengths)
        for i, tokens in zip(active, chained):
            seqs[i].token_ids.extend(tokens[:ks[i]])
        if chained_q is not q:
            q[on_device(active, torch.int64, q.device)] = chained_q

    def _choose(self, logits, argmax, picked, params, q, active, step, sampling) -> list[int]:
        if picked is not None:
            index = on_device(picked, torch.int64, logits.device)
            logits = logits[index]
            argmax = None if argmax is None else argmax[index]
        if not sampling:
            return self.runner.read_tokens(logits.argmax(dim=1) if argmax is None else argmax)
        probs = probabilities(logits, params)
        q[on_device(active, torch.int64, q.device), step] = probs
        return categorical(probs, self.generator).tolist()

    def verified(self, seq: Sequence, num_verified: int, proposed: int, kept: int) -> None:
        """The target kept `kept` of the `proposed` tokens after position num_verified - 1: the
        draft's cache is valid up to the last kept proposal it wrote."""
        if proposed:
            self._cached[seq.seq_id] = min(num_verified + proposed - 1, num_verified + kept)

    def forget(self, seq: Sequence) -> None:
        self._cached.pop(seq.seq_id, None)


class Speculator:
    """A proposer and k, and the verify-and-accept half of a speculative decode step."""

    def __init__(self, proposer, k: int, device: torch.device, seed: int = 0):
        self.proposer = proposer
        self.k = k
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {"verify_passes": 0, "proposed": 0, "kept": 0, "emitted": 0, "propose_s": 0.0,
                      "verify_s": 0.0}

    @torch.inference_mode()
    def decode_step(self, runner, seqs: list[Sequence], budgets: list[int]) -> list[list[int]]:
        """One speculative step over `seqs` (each may still emit budgets[i] >= 1 tokens): the
        tokens each sequence gains, in order; seq.token_ids is left as it came in."""
        lengths = [seq.num_tokens for seq in seqs]
        start = time.perf_counter()
        ks = [min(self.k, budget - 1) for budget in budgets]
        proposed, q = self.proposer.propose(seqs, ks)
        middle = time.perf_counter()
        rows, positions = [], []
        for seq, n, length in zip(seqs, proposed, lengths):
            rows += [seq] * (n + 1)
            positions += range(length - 1, length + n)
        logits, argmax = runner.rows_logits(rows, positions)
        out = self._accept(runner, seqs, lengths, proposed, q, logits, argmax)
        for seq, length, n, new in zip(seqs, lengths, proposed, out):
            self.proposer.verified(seq, length, n, len(new) - 1)
            del seq.token_ids[length:]
        s = self.stats
        s["verify_passes"] += len(seqs)
        s["proposed"] += sum(proposed)
        s["kept"] += sum(len(new) - 1 for new in out)
        s["emitted"] += sum(len(new) for new in out)
        s["propose_s"] += middle - start
        s["verify_s"] += time.perf_counter() - middle
        return out

    def _accept(self, runner, seqs, lengths, proposed, q, logits, argmax) -> list[list[int]]:
        """Each sequence's kept proposals and next token."""
        offsets = [0, *itertools.accumulate(n + 1 for n in proposed)]          # Python ints: torch.tensor is slow on numpy's
        sampled = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        out: list[list[int] | None] = [None] * len(seqs)
        greedy = [i for i, seq in enumerate(seqs) if seq.params.greedy]
        if greedy:
            best = runner.read_tokens(logits.argmax(dim=1) if argmax is None else argmax)
            for i in greedy:
                guesses = seqs[i].token_ids[lengths[i]:lengths[i] + proposed[i]]
                kept, token = greedy_accept(guesses, best[offsets[i]:offsets[i + 1]])
                out[i] = guesses[:kept] + [token]
        if sampled:
            out_sampled = self._rejection(seqs, lengths, proposed, q, logits, offsets, sampled)
            for i, new in zip(sampled, out_sampled):
                out[i] = new
        return out

    def _rejection(self, seqs, lengths, proposed, q, logits, offsets, sampled) -> list[list[int]]:
        """Rejection sampling for the sampled sequences: every index moved to the device in one
        pinned copy, one read back at the end."""
        width = max(proposed[i] for i in sampled)
        device = logits.device
        n = len(sampled)
        rows = [offsets[i] + min(j, proposed[i]) for i in sampled for j in range(width + 1)]
        tokens = [t for i in sampled for t in seqs[i].token_ids[lengths[i]:lengths[i] + proposed[i]]
                  + [-1] * (width - proposed[i])]
        packed = on_device(rows + tokens + [proposed[i] for i in sampled] + sampled, torch.int64, device)
        row_index, draft_tokens, counts, which = packed.split([len(rows), len(tokens), n, n])
        params = [seqs[i].params for i in sampled for _ in range(width + 1)]
        target = probabilities(logits.index_select(0, row_index), params).view(n, width + 1, -1)
        draft = None if q is None else q.index_select(0, which)[:, :width]
        kept, token = rejection_sample(draft_tokens.view(n, width), counts, draft, target, self.generator)
        kept, token = torch.stack([kept, token]).tolist()
        return [seqs[i].token_ids[lengths[i]:lengths[i] + kept[row]] + [token[row]] for row, i in enumerate(sampled)]
