"""A request as the engine tracks it: its sampling parameters, its tokens, its KV blocks and where
it stands (waiting, running, finished).

Pure Python: the scheduler and the block pool work on these without touching tensors.
"""
import itertools
import math
from dataclasses import dataclass
from enum import Enum

MAX_LOGPROBS = 20                   # OpenAI's limit on top_logprobs (and vLLM's default max_logprobs)


@dataclass
class SamplingParams:
    """How one request's tokens are chosen and when it stops."""
    max_tokens: int = 16
    temperature: float = 0.0        # 0 = greedy (argmax)
    top_k: int = 0                  # 0 = off
    top_p: float = 1.0
    seed: int | None = None         # its own sampling stream: the same tokens alone or in a batch
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # logits processing (vLLM's semantics): penalties over the output tokens (repetition: prompt and output)
    presence_penalty: float = 0.0   # [-2, 2]: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # [-2, 2]: subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # > 0: seen tokens' positive logits divided by it, negative multiplied
    logit_bias: dict | None = None  # {token id: bias in [-100, 100]} added to the logits
    min_p: float = 0.0              # [0, 1]: tokens below min_p * the top token's probability dropped
    min_tokens: int = 0             # EOS and stop_token_ids masked until this many tokens are out
    # log-probabilities of the model's raw logits (before penalties and temperature, as vLLM reports them)
    logprobs: int | None = None     # per generated token: its logprob and the top `logprobs` (0: only its own)
    prompt_logprobs: int | None = None  # per prompt token after the first, the same

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """Whether the logits change before the pick (penalties, bias, min_tokens, min_p)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias) or self.min_tokens > 0 or self.min_p > 0.0)

    @property
    def needs_sampler(self) -> bool:
        """False when the argmax a decode graph computes is this request's token and nothing else is asked."""
        return not self.greedy or self.processes_logits or self.logprobs is not None

    def validate(self) -> None:
        """ValueError with one line naming the field, for anything the sampler cannot honour."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if not isinstance(self.stop_token_ids, (tuple, list)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        bad = [t for t in self.stop_token_ids if not _is_int(t) or t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be non-negative integers, got {bad[0]!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0 \
                or not math.isfinite(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be a number in (0, 100], got {self.repetition_penalty!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or token < 0:
                    raise ValueError(f"logit_bias keys must be token ids, got {token!r}")
                if not _is_number(bias) or not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request: prompt and generated tokens in one list, the KV blocks that hold their keys and
    values, and how many of those tokens are cached.

    After a preemption its blocks are gone (num_cached_tokens = 0) and its next prefill recomputes
    the prompt and the tokens generated so far; the generated tokens themselves are kept."""
    _ids = itertools.count()

    __slots__ = ("seq_id", "request_id", "params", "token_ids", "num_prompt_tokens", "status",
                 "block_table", "block_hashes", "num_cached_tokens", "num_new_tokens", "finish_reason", "new_logprobs", "prompt_logprobs",
                 "sample_group", "num_sibling_tokens", "draw_stream")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self.seq_id = next(Sequence._ids)
        self.draw_stream = self.seq_id          # an unseeded request's sampling stream (the engine numbers its own)
        self.request_id = request_id
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []       # prefix keys of its full blocks (kv_cache.BlockPool)
        self.num_cached_tokens = 0
        self.num_new_tokens: int | None = None  # a chunked prefill's tokens this step; None: all uncached
        self.finish_reason: str | None = None
        # the sampler's log-probabilities (params.logprobs / prompt_logprobs), each entry
        # (logprob of the token, [(top token id, logprob), ...]); the engine hands them out per step
        self.new_logprobs: list = []
        self.prompt_logprobs: list | None = None
        self.sample_group = None                # a sample_groups.SampleGroup when it is one of n samples
        self.num_sibling_tokens = 0             # of num_cached_tokens, those read from a sibling sample's blocks

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prefill_end(self) -> int:
        """Where this step's prefill stops: after its chunk (chunked prefill), else at the end."""
        return self.num_tokens if self.num_new_tokens is None else self.num_cached_tokens + self.num_new_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"cached={self.num_cached_tokens}, blocks={len(self.block_table)})")
