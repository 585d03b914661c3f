"""Replays for greedy_near_tie: a sequence's best next tokens under the reference's setting and the other run's.

compare_greedy replays each divergent sequence twice, to measure the rounding noise between the two
settings at the divergent position. A replay is one request (the tokens, max_tokens=1,
REPLAY_CANDIDATES logprobs) on an engine with max_num_seqs=1; the reference setting has chunked
prefill and prefix caching off. The other setting is the one the compared run used:

- chunked prefill: chunks of chunk_tokens(...) = min(token_budget, the shortest prompt // 2), so every
  replay is split. At the run's budget a stream's replay (its short prompt and a few tokens) would be
  one step, round exactly as the reference replay and measure a noise of 0, though in the runs the
  streams' rows were batched differently (the H200 run's 0.156 flip was a stream's).
- prefix caching: caching on, and before each replay a request of its first `cached_prefix_tokens`
  tokens alone, so the replay finds their full blocks in the cache and computes only the rest over
  them, as B did over A's prefix.

One engine is held at a time: on a GPU an engine's KV pool takes the memory up to
gpu_memory_utilization, and a second engine made beside it would find none. An engine is made on
the first call for its setting and dropped (its memory released) when the other setting is asked
for; compare_greedy asks for every reference replay before any other, so each is made once, and
runs that agree make none.
"""
from contextlib import contextmanager

from .greedy_near_tie import REPLAY_CANDIDATES
from .models.model_choice import release_memory

UNCHUNKED_STEP_TOKENS = 8192          # the engine's default max_num_batched_tokens


def unchunked_step_tokens(max_model_len: int) -> int:
    """max_num_batched_tokens for an engine without chunking: one step must hold a whole prompt."""
    return max(UNCHUNKED_STEP_TOKENS, max_model_len)


def reference_settings(max_model_len: int) -> dict:
    """Chunked prefill and prefix caching off: every replay is one prefill of all its tokens."""
    return {"enable_chunked_prefill": False, "enable_prefix_caching": False,
            "max_num_batched_tokens": unchunked_step_tokens(max_model_len)}


def chunked_settings(chunk_tokens: int) -> dict:
    """Chunked prefill on, chunk_tokens per step, caching off."""
    return {"enable_chunked_prefill": True, "enable_prefix_caching": False, "max_num_batched_tokens": chunk_tokens}


def cached_settings(max_model_len: int) -> dict:
    """Prefix caching on, chunking off."""
    return {"enable_chunked_prefill": False, "enable_prefix_caching": True,
            "max_num_batched_tokens": unchunked_step_tokens(max_model_len)}


def chunk_tokens(sequences: list[dict], token_budget: int) -> int:
    """The chunked replay's step: the run's budget, or less, so that even the shortest prompt is split in two."""
    return max(1, min(token_budget, min(len(s["prompt"]) for s in sequences) // 2))


class OneEngineAtATime:
    """Engines of one max_model_len and max_num_seqs=1, keyed by setting; making one drops the one held."""

    def __init__(self, ctx, make_engine, max_model_len: int):
        self.ctx, self.make_engine, self.max_model_len = ctx, make_engine, max_model_len
        self.name, self.engine = None, None

    def get(self, name: str, settings: dict):
        if self.name != name:
            self.drop()
            self.engine = self.make_engine(max_model_len=self.max_model_len, max_num_seqs=1, **settings)
            self.name = name
        return self.engine

    def drop(self) -> None:
        if self.engine is not None:
            self.name, self.engine = None, None
            release_memory(self.ctx)


def run_request(engine, tokens: list[int], logprobs: int | None) -> tuple[list, int]:
    """One request of one token after `tokens`, to its end: its logprobs entries and the prompt tokens it
    found in the prefix cache."""
    from .engine import SamplingParams
    request_id = engine.add_request(tokens, SamplingParams(max_tokens=1, ignore_eos=True, logprobs=logprobs))
    entries, cached = [], 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                entries += out.logprobs or []
                cached = max(cached, out.num_cached_prompt_tokens)
    return entries, cached


def replay_function(engines: OneEngineAtATime, name: str, settings: dict, cached_prefix_tokens: int = 0):
    """top(tokens) -> the best REPLAY_CANDIDATES (id, logprob) after `tokens` on the `settings` engine;
    with cached_prefix_tokens, a request of those first tokens alone runs first so that the replay reads
    them from the prefix cache. top.cached_prompt_tokens lists what each replay found cached."""
    def top(tokens: list[int]) -> list[tuple[int, float]]:
        engine = engines.get(name, settings)
        if cached_prefix_tokens:
            run_request(engine, list(tokens[:cached_prefix_tokens]), None)
        entries, cached = run_request(engine, list(tokens), REPLAY_CANDIDATES)
        top.cached_prompt_tokens.append(cached)
        return entries[0][1]
    top.cached_prompt_tokens = []
    return top


@contextmanager
def replayers(ctx, make_engine, max_model_len: int, other_settings: dict, cached_prefix_tokens: int = 0):
    """(reference top, other top) for compare_greedy's replay_top and replay_other: the reference setting
    and `other_settings` (chunked_settings / cached_settings; with cached_settings pass the prefix length
    the run found cached), one engine held at a time, the last let go on exit."""
    engines = OneEngineAtATime(ctx, make_engine, max_model_len)
    try:
        yield (replay_function(engines, "reference", reference_settings(max_model_len)),
               replay_function(engines, "other", other_settings, cached_prefix_tokens))
    finally:
        engines.drop()


@contextmanager
def replayer(ctx, make_engine, max_model_len: int):
    """The reference top(tokens) alone (no noise measured: compare_greedy applies the floor)."""
    with replayers(ctx, make_engine, max_model_len, reference_settings(max_model_len)) as (reference, _):
        yield reference


def replay_length(sequences: list[dict], block_size: int) -> int:
    """A max_model_len that holds any replay of `sequences` (prompt plus all but the last reference token)."""
    return max(len(s["prompt"]) + len(s["reference"]) for s in sequences) + block_size
