"""Continuous batching: which sequences run in the next step.

Each step is either a prefill batch (waiting sequences admitted while blocks, `max_num_seqs` and
`max_num_batched_tokens` allow; prefills go first, so a new request's first token is not held up
behind decodes) or, when nothing can be admitted, a decode batch of every running sequence.
When a decode sequence needs a new block and none is free, the most recently admitted running
sequence is preempted: its blocks are freed and it goes back to the front of the waiting queue,
to recompute its prompt and generated tokens in a later prefill (vLLM's recompute preemption).

With prefix caching a prefill computes only the tokens after the cached prefix it shares
(kv_cache.BlockPool); n samples of one prompt share its blocks the same way (sample_groups.py).
With chunked prefill (enable_chunked_prefill) a step while anything is
waiting or part-prefilled mixes, within max_num_batched_tokens, the running sequences' decode rows
and prefill chunks with the first chunks of newly admitted ones (_schedule_chunked).

The scheduler owns a sequence's life from admission to finish: after each step `postprocess`
appends the new tokens, stops a sequence at EOS (unless ignore_eos) or a stop token ("stop"), at
max_tokens or a full context ("length"), and frees a finished sequence's blocks (nano-vllm's
Scheduler.postprocess). It owns sequences and blocks and never touches tensors.
"""
from collections import deque
from dataclasses import dataclass

from .config import EngineConfig
from .kv_cache import BlockPool
from .sequence import Sequence, SequenceStatus

# vLLM's admission watermark: a prefill leaves this fraction of the pool free for running decodes
ADMISSION_WATERMARK = 0.01


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    is_prefill: bool
    num_tokens: int          # tokens the model processes this step (a cached prefix's not counted)
    # a prefill in which every sequence computes one token after a cached prefix (n samples' one-token
    # tails): the same computation as a decode step, which the runner does in one batched call
    as_decode: bool = False


class Scheduler:
    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int] = frozenset()):
        """`config`: settled, its num_kv_blocks and max_model_len those of the sized pool. A decode
        step allocates config.speculative_tokens cache slots past each sequence's last token (a
        speculative step's proposals), never past max_model_len."""
        self.block_pool = BlockPool(config.num_kv_blocks, config.block_size, config.prefix_caching)
        self.lookahead_slots = config.speculative_tokens
        self.max_model_len = config.max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.eos_token_ids = eos_token_ids
        self.watermark_blocks = int(ADMISSION_WATERMARK * self.block_pool.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()      # in admission order: the last is the newest
        self.num_preemptions = 0
        self.chunked_prefill = config.enable_chunked_prefill

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        if seq.sample_group is not None:
            seq.sample_group.members.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        if self.chunked_prefill and (self.waiting or any(s.num_tokens - s.num_cached_tokens > 1 for s in self.running)):
            return self._schedule_chunked()
        return (self.waiting and self._schedule_prefill()) or self._schedule_decode()

    def _schedule_chunked(self) -> ScheduledBatch | None:
        """Chunked prefill (vLLM's): one step of at most max_num_batched_tokens tokens, the running
        sequences first in admission order (a decode row is one token, a prefill in progress its
        next chunk), then waiting ones admitted with a first chunk while tokens, blocks and
        max_num_seqs allow. A sequence's blocks are all allocated when it is admitted; a running
        one whose next token needs a block preempts the newest, as in a decode step."""
        budget = self.max_num_batched_tokens
        scheduled: list[Sequence] = []
        while self.running and budget:
            seq = self.running.popleft()
            if self._room_for(seq):
                seq.num_new_tokens = min(seq.num_tokens - seq.num_cached_tokens, budget)
                budget -= seq.num_new_tokens
                scheduled.append(seq)
        unscheduled = list(self.running)
        self.running.clear()
        self.running.extend(scheduled)
        self.running.extend(unscheduled)          # admission order kept: the newest last
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            reserve = self.watermark_blocks if self.running else 0
            siblings = self._sibling_blocks(seq)
            if siblings is None or not self.block_pool.can_allocate(seq, reserve, True, siblings):
                break
            self.waiting.popleft()
            self.block_pool.allocate(seq, share_prefix=True, key_blocks=False, sibling_blocks=siblings)
            seq.num_new_tokens = min(seq.num_tokens - seq.num_cached_tokens, budget)
            self.block_pool.cache_computed_blocks(seq, seq.prefill_end)     # written by this step
            budget -= seq.num_new_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(seq)
        num_tokens = self.max_num_batched_tokens - budget
        return ScheduledBatch(scheduled, True, num_tokens) if scheduled else None

    def _schedule_prefill(self) -> ScheduledBatch | None:
        admitted, num_tokens = [], 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            reserve = self.watermark_blocks if self.running else 0
            siblings = self._sibling_blocks(seq)
            if siblings is None:
                break
            computed = seq.num_tokens - len(siblings) * self.block_pool.block_size    # at most: a cache hit saves more
            if (num_tokens + computed > self.max_num_batched_tokens
                    or not self.block_pool.can_allocate(seq, reserve, True, siblings)):
                break
            self.waiting.popleft()
            self.block_pool.allocate(seq, share_prefix=True, sibling_blocks=siblings)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            num_tokens += seq.num_tokens - seq.num_cached_tokens
        if not admitted:
            return None
        return ScheduledBatch(admitted, True, num_tokens, as_decode=num_tokens == len(admitted)
                              and all(s.num_cached_tokens for s in admitted))

    def _sibling_blocks(self, seq: Sequence) -> list[int] | None:
        """The prompt blocks `seq` shares with a running sample of its prompt, or None: wait, one
        is prefilling it this step (sample_groups.py)."""
        return [] if seq.sample_group is None else seq.sample_group.shared_blocks(seq, self.block_pool.block_size)

    def slots_needed(self, seq: Sequence) -> int:
        """Cache slots `seq`'s next decode step writes into: its tokens and the lookahead."""
        if not self.lookahead_slots:
            return len(seq.token_ids)
        return min(len(seq.token_ids) + self.lookahead_slots, self.max_model_len or 1 << 62)

    def _schedule_decode(self) -> ScheduledBatch | None:
        block_size = self.block_pool.block_size
        if all(len(seq.block_table) * block_size >= self.slots_needed(seq) for seq in self.running):
            scheduled = list(self.running)               # the common step: every last token has its slot
            return ScheduledBatch(scheduled, False, len(scheduled)) if scheduled else None
        scheduled: list[Sequence] = []
        while self.running:
            seq = self.running.popleft()
            if self._room_for(seq, self.slots_needed(seq)):
                scheduled.append(seq)
        self.running.extend(scheduled)
        return ScheduledBatch(scheduled, False, len(scheduled)) if scheduled else None

    def _room_for(self, seq: Sequence, num_tokens: int | None = None) -> bool:
        """Blocks for `seq`'s next slots (its first `num_tokens`, default all its tokens), preempting
        the newest running sequences first and `seq` itself last (then False)."""
        while not self.block_pool.can_append(seq, num_tokens):
            if not self.running:
                self.preempt(seq)
                return False
            self.preempt(self.running.pop())
        self.block_pool.append(seq, num_tokens)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and put it first in line; its tokens are kept for the recompute."""
        self.block_pool.free(seq)
        seq.num_new_tokens = None
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], new_tokens: list[list[int]]) -> list[list[int]]:
        """Append each sequence's new tokens (one, or up to k + 1 from a speculative step) up to the
        first that finishes it; retire the finished ones. The tokens each sequence emitted."""
        emitted_by_seq = []
        for seq, tokens in zip(seqs, new_tokens):
            if seq.num_new_tokens is not None:               # a chunked prefill step
                end, seq.num_new_tokens = seq.prefill_end, None
                if end < seq.num_tokens:                     # a chunk short of the last token: no token yet
                    seq.num_cached_tokens = end
                    self.block_pool.cache_computed_blocks(seq)
                    emitted_by_seq.append([])
                    continue
            emitted, reason = [], None
            for token in tokens:
                seq.num_cached_tokens = seq.num_tokens
                seq.append_token(token)
                emitted.append(token)
                reason = self._finish_reason(seq, token)
                if reason is not None:
                    break
            if reason is not None:
                self.running.remove(seq)
                self._retire(seq, reason)
            elif self.lookahead_slots:                     # a speculative step's rejected tokens' blocks
                self.block_pool.truncate(seq, self.slots_needed(seq))
            else:
                self.block_pool.cache_computed_blocks(seq)
            emitted_by_seq.append(emitted)
        return emitted_by_seq

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def abort(self, seq: Sequence) -> None:
        """Remove `seq` wherever it is; its blocks are free at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if not seq.is_finished:
            self._retire(seq, "abort")

    def _retire(self, seq: Sequence, reason: str) -> None:
        self.block_pool.free(seq)
        if seq.sample_group is not None:
            seq.sample_group.members.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
