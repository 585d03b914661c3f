"""LLMEngine: requests in, tokens out, one scheduler step at a time.

    engine = LLMEngine(EngineConfig(model="llama-3.1-8b"))
    engine.add_request(prompt_token_ids, SamplingParams(max_tokens=200))
    while engine.has_unfinished():
        for out in engine.step(): ...

Requests may be added and aborted between any two steps (continuous batching). A request stops
with "stop" at an EOS token (unless ignore_eos) or one of its stop_token_ids, with "length" at
max_tokens or when its sequence fills max_model_len, with "abort" when aborted.
Not thread-safe: call it from one thread.

With tensor_parallel N > 1 the engine is one of N processes started by torchrun (tp_ranks.py):
each holds its shards and makes the same calls as the others (or follows rank 0's, behind the server).
"""
import dataclasses
import itertools
import operator
import time
from dataclasses import dataclass

import torch

from common.errors import LabError

from . import overlap
from .config import DEFAULT_MAX_MODEL_LEN, EngineConfig, draft_config, quantization_of, settled
from .runner import ModelRunner
from .scheduler import ScheduledBatch, Scheduler
from .sample_groups import SampleGroup, sample_seed
from .sequence import SamplingParams, Sequence
from .speculator import DraftProposer, NgramProposer, Speculator
from .shapes import LlamaShape
from .weights import iter_weights_for, resolve, weights_for


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]        # tokens produced this step (one, normally)
    finished: bool
    finish_reason: str | None       # "stop" (EOS / stop token), "length" (max_tokens or max_model_len), "abort"
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list | None = None         # per new token (params.logprobs): (logprob, [(top id, logprob), ...])
    prompt_logprobs: list | None = None  # first output only (params.prompt_logprobs): per prompt token after the first
    num_cached_prompt_tokens: int = 0    # prompt tokens its first prefill read from the prefix cache


class LLMEngine:
    def __init__(self, config: EngineConfig, weights: dict | None = None):
        """weights: a Hugging Face-named dict (left as given); None: weights_for(config.model, ...)."""
        start = time.perf_counter()
        config = settled(config)
        self.device = torch.device(config.device)
        self.tp = self._tensor_parallel(config)
        dtype = config.torch_dtype
        if self.tp is not None:             # this rank's shards only, cut as each tensor is made or read
            if weights is None:
                self.shape, items = iter_weights_for(config.model, config.seed, dtype, self.device)
            else:
                self.shape, items = resolve(config.model)[0], weights.items()
            weights, owned = self.tp.shard(self.shape, items), True
            del items
        elif weights is None:
            self.shape, weights = weights_for(config.model, config.seed, dtype, self.device)
            owned = True
        else:
            self.shape, owned = resolve(config.model)[0], False
        self.max_speculative_tokens = config.speculative_tokens
        self._draft_shape(config.speculative_model)
        step_tokens = 1 << 62 if config.enable_chunked_prefill else config.max_num_batched_tokens   # chunks fit any step
        requested_len = config.max_model_len or min(self.shape.max_position_embeddings, DEFAULT_MAX_MODEL_LEN,
                                                    step_tokens)
        if requested_len > self.shape.max_position_embeddings:
            raise LabError(f"max_model_len {requested_len} exceeds {self.shape.name}'s "
                           f"max_position_embeddings {self.shape.max_position_embeddings}")
        if requested_len > step_tokens:
            raise LabError(f"max_model_len {requested_len} exceeds max_num_batched_tokens "
                           f"{config.max_num_batched_tokens}: a preempted sequence could never be prefilled again")
        self.runner = ModelRunner(config, self.shape, weights, quantization=quantization_of(config), tp=self.tp,
                                  consume_weights=owned)
        del weights
        capacity = self.runner.num_kv_blocks * config.block_size
        if capacity < requested_len and config.max_model_len is not None:
            raise LabError(f"the KV pool holds {capacity} tokens, fewer than max_model_len {requested_len}; "
                           "lower max_model_len or give the pool more blocks")
        self.max_model_len = min(requested_len, capacity)
        load_s = time.perf_counter() - start
        self.runner.prepare(self.max_model_len)
        # the pool as sized: what the scheduler and a draft's runner read from here on
        self.config = config = dataclasses.replace(config, num_kv_blocks=self.runner.num_kv_blocks,
                                                   max_model_len=self.max_model_len)
        eos = self.shape.eos_token_id
        self._eos_ids = frozenset(() if eos is None else (eos,) if isinstance(eos, int) else eos)
        self.runner.sampler.eos_token_ids = self._eos_ids
        self.scheduler = Scheduler(config, self._eos_ids)
        self.speculator: Speculator | None = None
        if config.speculative_model == "ngram":
            self.speculator = Speculator(NgramProposer(), config.num_speculative_tokens, self.device, config.seed)
        elif config.speculative_model != "none":
            self.speculator = Speculator(self.draft_proposer(config.speculative_model), config.num_speculative_tokens,
                                         self.device, config.seed)
        self._requests: dict[str, Sequence] = {}
        self._request_counter = itertools.count()
        self._draw_streams = itertools.count()     # unseeded requests' sampling streams: the same on every TP rank
        self._abort_outputs: list[StepOutput] = []
        self.last_step: dict = {}
        self._telemetry = {
            "model": config.model, "shape": self.shape.name, "dtype": config.dtype, "device": str(self.device),
            "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            **self.runner.telemetry, **(self.tp.describe() if self.tp is not None else {}),
            "max_model_len": self.max_model_len, "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens, "load_s": load_s,
            "startup_s": time.perf_counter() - start, "steps": 0,
            "prefix_caching": config.prefix_caching, "prompt_tokens": 0, "cached_prompt_tokens": 0,
            "sibling_prompt_tokens": 0, "prefill_tokens": 0,
        }
        self._cached_prompt_tokens: dict[str, int] = {}     # per request, from its first prefill
        self._sample_groups: dict[str, SampleGroup] = {}    # live n-sample groups by key
        # overlapped scheduling (overlap.py): on unless off in the config or speculating / tensor parallel
        self.overlap = config.async_scheduling is not False and config.speculative_model == "none" and self.tp is None
        self.overlap_stats = overlap.OverlapStats()
        self._in_flight: overlap.InFlightStep | None = None
        self._telemetry["async_scheduling"] = self.overlap

    @property
    def telemetry(self) -> dict:
        """The engine's counters and settings. The overlap's summary is derived from its stats when
        this is read, not rebuilt on every step."""
        if self.overlap:
            self._telemetry["overlap"] = self.overlap_stats.summary()
        return self._telemetry

    def _tensor_parallel(self, config: EngineConfig):
        """This rank's TensorParallel (tensor_parallel > 1) on the device torchrun's LOCAL_RANK
        was given (config.settled picked it), or None."""
        if config.tensor_parallel == 1:
            return None
        from .tp_ranks import TensorParallel
        from .tp_shards import unsplittable
        why = unsplittable(resolve(config.model)[0], config.tensor_parallel)
        if why:
            raise LabError(why)
        return TensorParallel(config.tensor_parallel, self.device, config.torch_dtype, config.allreduce)

    # -------------------------------------------------------------------------- speculative decoding
    def _draft_shape(self, model: str) -> LlamaShape | None:
        if model in ("none", "ngram"):
            return None
        shape = resolve(model)[0]
        if shape.vocab_size != self.shape.vocab_size:
            raise LabError(f"draft {shape.name} has a vocabulary of {shape.vocab_size}, the target "
                           f"{self.shape.name} {self.shape.vocab_size}: a draft must share the target's vocabulary")
        return shape

    def draft_proposer(self, model: str, seed: int | None = None) -> DraftProposer:
        """A draft model (named shape with seeded random weights, or checkpoint folder) on its own
        runner (config.draft_config: it follows the target's block tables)."""
        shape = self._draft_shape(model)
        seed = self.config.seed + 1 if seed is None else seed
        config = draft_config(self.config, model, seed)
        _, weights = weights_for(model, seed, config.torch_dtype, self.device)
        runner = ModelRunner(config, shape, weights)
        del weights
        runner.prepare(self.max_model_len)
        return DraftProposer(runner, torch.Generator(device=self.device).manual_seed(seed))

    def speculate(self, proposer: "DraftProposer | NgramProposer | None", k: int = 0) -> None:
        """Switch speculative decoding (a proposer and k up to the configured num_speculative_tokens)
        or turn it off (None), between runs: no request may be unfinished."""
        if self.has_unfinished():
            raise LabError("speculate() between runs only: requests are still unfinished")
        self._drop_in_flight()
        if proposer is None:
            self.speculator = None
            return
        if not 1 <= k <= self.max_speculative_tokens:
            raise LabError(f"k must be in [1, {self.max_speculative_tokens}] (the engine's num_speculative_tokens)")
        self.speculator = Speculator(proposer, k, self.device, self.config.seed)

    def set_async_scheduling(self, on: bool) -> None:
        """Overlapped scheduling on or off between runs (an A/B in one process, one set of CUDA
        graphs), its stats started again: no request may be unfinished; on is refused where the
        engine cannot overlap."""
        if self.has_unfinished():
            raise LabError("set_async_scheduling() between runs only: requests are still unfinished")
        if on and (self.speculator is not None or self.tp is not None):
            raise LabError("async_scheduling is not supported with speculative decoding or tensor_parallel > 1")
        self._drop_in_flight()
        self.overlap = self._telemetry["async_scheduling"] = bool(on)
        self.overlap_stats = overlap.OverlapStats()
        self._telemetry.pop("overlap", None)

    def _drop_in_flight(self) -> None:
        """With no request unfinished, a step still in flight (launched for sequences that turned
        out to have finished) is waited for and its tokens dropped."""
        if self._in_flight is not None and not self.scheduler.has_unfinished():
            self.runner.tokens_in_flight.wait(self._in_flight.ticket)
            self._in_flight = None

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.block_pool.num_free_blocks

    # -------------------------------------------------------------------------- requests
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    sample_group: str | None = None) -> str:
        """Queue a request; ValueError (one line) for anything it cannot run with. sample_group: a
        key naming the n samples of one prompt (add_samples): they share the prompt's KV blocks
        (sample_groups.py), and every request of one key must have the same prompt."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        self._check_logits_features(params)
        prompt = self._checked_prompt(prompt_token_ids)
        if request_id is None:
            request_id = f"req-{next(self._request_counter)}"
            while request_id in self._requests:
                request_id = f"req-{next(self._request_counter)}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        elif request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        seq = Sequence(request_id, prompt, params)
        seq.draw_stream = next(self._draw_streams)
        if sample_group is not None:
            seq.sample_group = self._sample_group(sample_group, prompt)
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def add_samples(self, prompt_token_ids: list[int], params: SamplingParams, n: int,
                    request_id: str | None = None) -> list[str]:
        """n samples of one prompt (OpenAI's n), sharing its KV blocks: one prefill of the prompt,
        then each sample recomputes only its tail (sample_groups.py). Sample i draws from
        params.seed + i when seeded. Request ids: request_id-i (request_id None: generated)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        if request_id is None:
            request_id = f"samples-{next(self._request_counter)}"
        ids = [f"{request_id}-{i}" for i in range(n)]
        taken = next((i for i in ids if i in self._requests), None)
        if taken is not None:
            raise ValueError(f"request_id {taken!r} is already in use by an unfinished request")
        # the samples differ only in their seeds, each valid: a request refused is refused at the first
        return [self.add_request(prompt_token_ids, dataclasses.replace(params, seed=sample_seed(params.seed, i)),
                                 sample_id, sample_group=request_id) for i, sample_id in enumerate(ids)]

    def _sample_group(self, key: str, prompt: list[int]) -> SampleGroup | None:
        """The live group `key` names (made on its first sample), or None under speculative
        decoding: the draft's cache is not shared, so each sample prefills alone."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"sample_group must be a non-empty string, got {key!r}")
        if self.speculator is not None:
            return None
        group = self._sample_groups.get(key)
        if group is None:
            group = self._sample_groups[key] = SampleGroup(key, prompt)
        elif group.prompt != tuple(prompt):
            raise ValueError(f"sample_group {key!r} holds samples of another prompt: one group, one prompt")
        return group

    def _check_logits_features(self, params: SamplingParams) -> None:
        """ValueError naming what this engine cannot honour: logits features under speculative
        decoding (its verify step picks tokens on the device, past the sampler), token ids outside
        the vocabulary in logit_bias."""
        if self.speculator is not None:
            asked = [name for name, on in (("logprobs", params.logprobs is not None),
                                           ("prompt_logprobs", params.prompt_logprobs is not None),
                                           ("logits processing (penalties, logit_bias, min_p, min_tokens)",
                                            params.processes_logits)) if on]
            if asked:
                raise ValueError(f"{asked[0]} is not supported with speculative decoding")
        if self.config.enable_chunked_prefill and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported with chunked prefill")
        if params.logit_bias:
            bad = [t for t in params.logit_bias if t >= self.shape.vocab_size]
            if bad:
                raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {self.shape.vocab_size})")

    def _checked_prompt(self, prompt_token_ids) -> list[int]:
        vocab = self.shape.vocab_size
        try:
            if any(isinstance(t, bool) for t in prompt_token_ids):
                raise TypeError
            prompt = [operator.index(t) for t in prompt_token_ids]
        except TypeError:
            raise ValueError("prompt_token_ids must be a list of integer token ids") from None
        if not prompt:
            raise ValueError("the prompt is empty: at least one token is needed")
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt)} tokens, but the context holds {self.max_model_len} "
                             f"(max_model_len) with room for one generated token: at most {self.max_model_len - 1}")
        return prompt

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks; a no-op for unknown or finished requests. The
        next step() reports it with finish_reason "abort"."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.abort(seq)
        self._forget(seq)
        self._abort_outputs.append(StepOutput(request_id, [], True, "abort", seq.num_prompt_tokens,
                                              seq.num_output_tokens))

    def has_unfinished(self) -> bool:
        """Requests left. A step may still be in flight without any (launched for sequences that
        turned out to have finished): the next step() reads it and drops its tokens."""
        return self.scheduler.has_unfinished()

    # -------------------------------------------------------------------------- a step
    def step(self) -> list[StepOutput]:
        """One scheduler step: a prefill batch or a decode batch, one new token per sequence in it
        (with speculative decoding, a decode step gives each sequence 1 to k + 1 tokens). With
        async scheduling a decode step's tokens are read after the next step is launched
        (`_step_ahead`): each call still reads one step's tokens."""
        start = time.perf_counter()
        outputs, self._abort_outputs = self._abort_outputs, []
        if self._in_flight is None:
            batch = self.scheduler.schedule()
            if batch is None:
                return outputs
            if not self.overlap:
                return outputs + self._step_sync(batch, start)
            reason = overlap.sync_reason(batch.seqs, batch.is_prefill, self.speculator is not None)
            if reason is not None:
                self.overlap_stats.count(self.overlap_stats.sync_steps, reason)
                return outputs + self._step_sync(batch, start)
            self._in_flight = self._launch(batch.seqs, None)
        return outputs + self._step_ahead(start)

    def _step_sync(self, batch: ScheduledBatch, start: float) -> list[StepOutput]:
        if batch.is_prefill:
            self._count_cached_prompt(batch.seqs)
        new_tokens = self._run(batch)
        emitted = self.scheduler.postprocess(batch.seqs, new_tokens)
        outputs = [self._output(seq, tokens) for seq, tokens in zip(batch.seqs, emitted)
                   if tokens or seq.is_finished]            # a prefill chunk short of the prompt's end: nothing yet
        for seq in [s for s in batch.seqs if s.is_finished]:
            self._forget(seq)
        self._record_step(batch, start)
        return outputs

    def _launch(self, seqs: list[Sequence], previous: "overlap.InFlightStep | None") -> overlap.InFlightStep:
        """Queue a decode step of `seqs` (their input: each one's pending token in `previous`, if
        given) and the copy of its tokens to the host; nothing waits for the device."""
        pending = None if previous is None else (previous.tokens, previous.rows_of(seqs))
        tokens = self.runner.launch_decode(seqs, pending)
        return overlap.InFlightStep(seqs, tokens, self.runner.tokens_in_flight.start(tokens))

    def _step_ahead(self, start: float) -> list[StepOutput]:
        """Launch the next decode step from the one in flight (if the scheduler need not see its
        tokens first: overlap.batch_ahead), then read the one in flight: append its tokens, stop
        the finished (a token for a sequence that finished or was aborted meanwhile is dropped)."""
        current, stats = self._in_flight, self.overlap_stats
        seqs, reason = overlap.batch_ahead(self.scheduler, current, self.max_model_len)
        if seqs:
            self._in_flight = self._launch(seqs, current)
            stats.steps_ahead += 1
        else:
            self._in_flight = None
            stats.count(stats.drains, reason)
        tokens, wait_ms, busy = overlap.timed_wait(self.runner.tokens_in_flight, current.ticket)
        live = [(seq, [token]) for seq, token in zip(current.seqs, tokens) if not seq.is_finished]
        emitted = self.scheduler.postprocess([seq for seq, _ in live], [new for _, new in live])
        outputs = [self._output(seq, new) for (seq, _), new in zip(live, emitted)]
        for seq, _ in live:
            if seq.is_finished:
                self._forget(seq)
        self._record_step(ScheduledBatch(current.seqs, False, len(current.seqs)), start, (wait_ms, busy, bool(seqs)))
        return outputs

    def _run(self, batch: ScheduledBatch) -> list[list[int]]:
        """Each scheduled sequence's new tokens: a speculative decode step's, or the runner's one."""
        if self.speculator is not None and not batch.is_prefill:
            return self.speculator.decode_step(self.runner, batch.seqs, [self._budget(s) for s in batch.seqs])
        new_tokens = [[] if token is None else [token]
                      for token in self.runner.run(batch.seqs, batch.is_prefill and not batch.as_decode)]
        if self.speculator is not None:
            self.speculator.proposer.prefill(batch.seqs)
        return new_tokens

    def _count_cached_prompt(self, seqs: list[Sequence]) -> None:
        """Telemetry of a request's first prefill: its prompt tokens, those the prefix cache
        served and those a sibling sample's blocks served (a recompute after preemption is not
        counted again)."""
        for seq in seqs:
            if seq.num_output_tokens == 0 and seq.request_id not in self._cached_prompt_tokens:
                self._cached_prompt_tokens[seq.request_id] = seq.num_cached_tokens
                self._telemetry["prompt_tokens"] += seq.num_prompt_tokens
                self._telemetry["cached_prompt_tokens"] += seq.num_cached_tokens - seq.num_sibling_tokens
                self._telemetry["sibling_prompt_tokens"] += seq.num_sibling_tokens

    def _output(self, seq: Sequence, emitted: list[int]) -> StepOutput:
        out = StepOutput(seq.request_id, emitted, seq.is_finished, seq.finish_reason, seq.num_prompt_tokens,
                         seq.num_output_tokens, num_cached_prompt_tokens=self._cached_prompt_tokens.get(seq.request_id, 0))
        if seq.params.logprobs is not None:
            out.logprobs, seq.new_logprobs = seq.new_logprobs, []
        if seq.params.prompt_logprobs is not None and seq.num_output_tokens == len(emitted):
            out.prompt_logprobs = seq.prompt_logprobs
        return out

    def _record_step(self, batch: ScheduledBatch, start: float, read: tuple | None = None) -> None:
        """last_step and the step count; read (gpu wait ms, device still busy, next step launched
        ahead): an overlapped step's readback, its host and wait time into the overlap stats."""
        self._telemetry["steps"] += 1
        if batch.is_prefill:
            self._telemetry["prefill_tokens"] += batch.num_tokens     # tokens the model computed (chunked: decode rows too)
        ms = (time.perf_counter() - start) * 1e3
        self.last_step = {"kind": "prefill" if batch.is_prefill else "decode", "num_seqs": len(batch.seqs),
                          "num_tokens": batch.num_tokens, "ms": ms}
        if read is not None:
            wait_ms, busy, ahead = read
            self.overlap_stats.read(ms, wait_ms, busy)
            self.last_step.update(host_ms=ms - wait_ms, gpu_wait_ms=wait_ms, launched_ahead=ahead)

    def _budget(self, seq: Sequence) -> int:
        """Tokens `seq` may still emit before max_tokens or max_model_len stops it."""
        return min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)

    def _forget(self, seq: Sequence) -> None:
        """A finished or aborted request leaves the engine: its draft state (the sampler keeps none)."""
        if self.speculator is not None:
            self.speculator.proposer.forget(seq)
        self._requests.pop(seq.request_id, None)
        self._cached_prompt_tokens.pop(seq.request_id, None)
        group = seq.sample_group
        if group is not None and not group.members and self._sample_groups.get(group.key) is group:
            del self._sample_groups[group.key]

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Offline: add every prompt, step until they are all done; output token ids in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams")
        seqs = [self._requests[self.add_request(prompt, p)] for prompt, p in zip(prompts, params_list)]
        while not all(seq.is_finished for seq in seqs):
            self.step()
        self._drop_in_flight()
        return [seq.output_token_ids for seq in seqs]

