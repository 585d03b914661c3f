"""Overlapped scheduling (vLLM's async scheduling, SGLang's overlap scheduler): the host prepares
decode step n+1 while the device runs step n.

Step n's sampled token ids stay on the device; step n+1's input ids are gathered from them by row
(runner.launch_decode), so launching n+1 does not wait for the host to read n's tokens. Those are
copied to pinned host memory behind an event (TokensInFlight) and appended, checked for stop
conditions and streamed after n+1 is launched. So stop conditions apply one step late: a sequence
that finished at step n has computed one more token in step n+1, which is discarded (never
emitted; the block reserved for it is freed with the sequence's others). Scheduling n+1 ahead
reserves each sequence's slot for its pending token (`batch_ahead`).

Every step the overlap cannot run ahead of is run synchronously, and why is said here, once:
`sync_reason` (a step that needs the host between steps) and `batch_ahead` (what stops the engine
from scheduling before it has read the step in flight). Both are counted in OverlapStats.
"""
import time
from dataclasses import dataclass, field

import torch

from .sequence import Sequence

# why a step runs synchronously (the host reads its tokens before anything else is scheduled)
SYNC_PREFILL = "prefill"                           # prompts (and chunks) are scheduled from host token lists
SYNC_SPECULATIVE = "speculative decoding"          # the verify step's acceptance is read on the host
SYNC_LOGITS_PROCESSING = "logits processing"       # penalties, logit_bias, min_tokens read generated tokens
SYNC_LOGPROBS = "logprobs"                         # read back per step with the token
# why scheduling ahead stopped: the step in flight is read first, then the scheduler runs as usual
DRAIN_WAITING = "waiting requests"                 # one can be admitted: a prefill (arrival, preempted recompute)
DRAIN_PREEMPTION = "preemption"                    # the pending tokens' slots do not fit the free blocks
DRAIN_NOT_IN_FLIGHT = "running sequence not in flight"   # a guard: a decode step holds every running one
DRAIN_ALL_DONE = "every sequence finishes"         # all in flight stop by length: nothing to launch


def sync_reason(seqs: list[Sequence], is_prefill: bool, speculating: bool) -> str | None:
    """Why a scheduled step cannot leave its tokens on the device for the next one, or None."""
    if is_prefill:
        return SYNC_PREFILL
    if speculating:
        return SYNC_SPECULATIVE
    if any(s.params.processes_logits for s in seqs):
        return SYNC_LOGITS_PROCESSING
    if any(s.params.logprobs is not None for s in seqs):
        return SYNC_LOGPROBS
    return None


def finishes_by_length(seq: Sequence, max_model_len: int) -> bool:
    """Whether `seq`'s pending token (sampled, not yet appended) surely ends it: max_tokens or a
    full context. Known before the token is read, so such a sequence is left out of the next step."""
    return seq.num_output_tokens + 1 >= seq.params.max_tokens or seq.num_tokens + 1 >= max_model_len


def batch_ahead(scheduler, in_flight: "InFlightStep", max_model_len: int) -> tuple[list[Sequence], str | None]:
    """The next decode batch, scheduled before the step in flight is read: every running sequence
    whose pending token may not end it, each with a block for that token's slot (position
    num_tokens). ([], reason) where the scheduler must see the tokens first (the caller drains)."""
    running, pool = scheduler.running, scheduler.block_pool
    if scheduler.waiting and len(running) < scheduler.max_num_seqs and pool.can_allocate(
            scheduler.waiting[0], scheduler.watermark_blocks if running else 0, share_prefix=True):
        return [], DRAIN_WAITING                  # as the scheduler's admission test (Scheduler._schedule_prefill)
    if any(id(s) not in in_flight.row_of for s in running):
        return [], DRAIN_NOT_IN_FLIGHT
    batch = [s for s in running if not finishes_by_length(s, max_model_len)]
    if not batch:
        return [], DRAIN_ALL_DONE
    needed = sum(pool.blocks_for(s.num_tokens + 1) - len(s.block_table) for s in batch)
    if needed > pool.num_free_blocks:
        return [], DRAIN_PREEMPTION
    for seq in batch:
        pool.append(seq, seq.num_tokens + 1)
    return batch, None


@dataclass
class InFlightStep:
    """A decode step launched but not read: its sequences in row order, its tokens on the device
    and their copy to the host."""
    seqs: list[Sequence]
    tokens: torch.Tensor            # int64 [len(seqs)] on the device
    ticket: tuple[int, int]         # TokensInFlight.start's: which host buffer, how many tokens
    row_of: dict[int, int] = field(default_factory=dict)     # id(seq) -> row

    def __post_init__(self):
        self.row_of = {id(s): row for row, s in enumerate(self.seqs)}

    def rows_of(self, seqs: list[Sequence]) -> list[int]:
        return [self.row_of[id(s)] for s in seqs]


class TokensInFlight:
    """Device token ids to host lists without stalling the next launch: `start` queues the copy
    into one of two pinned buffers and records an event, `wait` blocks on that event alone. Two
    buffers, because step n+1's copy is queued before step n's buffer has been read. On a CPU the
    copy is done at once, into the same two buffers (so the CPU tests hold the alternation too)."""

    def __init__(self, size: int, device: torch.device):
        self.is_cuda = device.type == "cuda"
        self._hosts = [torch.zeros(size, dtype=torch.int64, pin_memory=self.is_cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if self.is_cuda else None
        self._next = 0

    @torch.inference_mode()          # the buffers are made under inference mode (runner.prepare)
    def start(self, tokens: torch.Tensor) -> tuple[int, int]:
        i, n = self._next, tokens.shape[0]
        self._next ^= 1
        self._hosts[i][:n].copy_(tokens, non_blocking=self.is_cuda)
        if self.is_cuda:
            self._events[i].record(torch.cuda.current_stream(tokens.device))
        return i, n

    def wait(self, ticket: tuple[int, int]) -> tuple[list[int], bool]:
        """(the token ids, whether the device was still busy when the host came to read them)."""
        i, n = ticket
        busy = False
        if self.is_cuda:
            busy = not self._events[i].query()
            self._events[i].synchronize()
        return self._hosts[i][:n].tolist(), busy


@dataclass
class OverlapStats:
    """What the overlap did: steps launched ahead of the previous one's readback, steps run
    synchronously and drains by reason, and the host's time per overlapped step: `host_ms` (not
    blocked on the device) and `wait_ms` (blocked). A step whose device was still busy when the
    host came to read it had its host work hidden behind the device (`steps_hidden`)."""
    steps_ahead: int = 0
    steps_hidden: int = 0
    steps_read: int = 0
    host_ms: float = 0.0
    wait_ms: float = 0.0
    sync_steps: dict = field(default_factory=dict)
    drains: dict = field(default_factory=dict)

    def count(self, table: dict, reason: str) -> None:
        table[reason] = table.get(reason, 0) + 1

    def read(self, wall_ms: float, wait_ms: float, busy: bool) -> None:
        self.steps_read += 1
        self.steps_hidden += busy
        self.wait_ms += wait_ms
        self.host_ms += wall_ms - wait_ms

    def summary(self) -> dict:
        read = max(self.steps_read, 1)
        return {"steps_ahead": self.steps_ahead, "steps_read": self.steps_read,
                "steps_host_hidden": self.steps_hidden, "host_ms_per_step": self.host_ms / read,
                "gpu_wait_ms_per_step": self.wait_ms / read,
                "sync_steps": dict(self.sync_steps), "drains": dict(self.drains)}


def timed_wait(readback: TokensInFlight, ticket: tuple) -> tuple[list[int], float, bool]:
    """(tokens, ms the host was blocked, whether the device was still busy)."""
    start = time.perf_counter()
    tokens, busy = readback.wait(ticket)
    return tokens, (time.perf_counter() - start) * 1e3, busy
