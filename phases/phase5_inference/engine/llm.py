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
import sys
import time
from dataclasses import dataclass

import torch

from common.errors import LabError
from common.triton_shim import interpreting

from .kv_cache import BlockPool, activation_reserve_bytes, kv_block_bytes
from .model import QuantizationConfig
from .quantize import GROUP_SIZES
from .quantize import PATHS as QUANT_PATHS
from .runner import ModelRunner
from .scheduler import Scheduler
from .sequence import SamplingParams, Sequence
from .speculator import MAX_SPECULATIVE_TOKENS, DraftProposer, NgramProposer, Speculator
from .shapes import LlamaShape
from .weights import iter_weights_for, resolve, weights_for

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
QUANTIZATIONS = ("none", "int8", "int4")
DEFAULT_MAX_MODEL_LEN = 8192


@dataclass
class EngineConfig:
    model: str = "tiny"             # a named shape (seeded random weights) or a HF checkpoint folder
    seed: int = 0
    dtype: str = "bfloat16"         # CPU tests use "float32"
    device: str = "auto"            # "auto": cuda if available else cpu
    block_size: int = 16
    gpu_memory_utilization: float = 0.90   # fraction of total GPU memory weights + KV pool + activations may use
    num_kv_blocks: int | None = None       # overrides pool sizing (tests force preemption with few blocks)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None       # default: min(shape.max_position_embeddings, 8192)
    cuda_graphs: bool = True               # decode CUDA graphs at bucketed batch sizes (CUDA only)
    attention_backend: str = "auto"
    quantization: str = "none"             # weight-only: "int8" (per output row), "int4" (group-wise), "none"
    quant_path: str = "auto"               # how quantized projections multiply: auto, naive, fused, library, cuda
    quant_group_size: int = 128            # int4 inputs per (scale, zero point)
    speculative_model: str = "none"        # "none", "ngram" (prompt lookup), or a draft: named shape or checkpoint folder
    num_speculative_tokens: int = 0        # k: tokens proposed per step (1 .. MAX_SPECULATIVE_TOKENS when speculating)
    tensor_parallel: int = 1               # ranks the model is split over (processes started by torchrun)
    allreduce: str = "auto"                # tensor parallel: auto (the faster per size), nccl, one-shot

    def check(self) -> None:
        """LabError for settings no engine can run with."""
        if self.dtype not in DTYPES:
            raise LabError(f"dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.quantization not in QUANTIZATIONS:
            raise LabError(f"quantization {self.quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
        if self.quant_path not in ("auto", *QUANT_PATHS):
            raise LabError(f"quant_path {self.quant_path!r}: choose one of auto, {', '.join(QUANT_PATHS)}")
        if self.quantization == "int4" and self.quant_group_size not in GROUP_SIZES:
            raise LabError(f"quant_group_size must be one of {GROUP_SIZES}, got {self.quant_group_size!r}")
        from .paged_attention import BACKENDS
        if self.attention_backend not in BACKENDS:
            raise LabError(f"attention_backend {self.attention_backend!r}: choose one of {', '.join(BACKENDS)}")
        from .tp_ranks import ALLREDUCE_MODES
        if self.allreduce not in ALLREDUCE_MODES:
            raise LabError(f"allreduce {self.allreduce!r}: choose one of {', '.join(ALLREDUCE_MODES)}")
        tp = self.tensor_parallel
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise LabError(f"tensor_parallel must be a positive integer, got {tp!r}")
        if tp > 1 and self.quantization != "none":
            raise LabError("quantization with tensor_parallel > 1 is not supported: quantize on one GPU")
        if tp > 1 and self.speculative_model != "none":
            raise LabError("speculative decoding with tensor_parallel > 1 is not supported")
        if self.speculative_model != "none":
            k = self.num_speculative_tokens
            if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
                raise LabError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}] "
                               f"with speculative_model {self.speculative_model!r}, got {k!r}")
        positive = {"block_size": self.block_size, "max_num_seqs": self.max_num_seqs,
                    "max_num_batched_tokens": self.max_num_batched_tokens}
        if self.num_kv_blocks is not None:
            positive["num_kv_blocks"] = self.num_kv_blocks
        if self.max_model_len is not None:
            positive["max_model_len"] = self.max_model_len
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise LabError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise LabError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


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


def quantization_of(config: EngineConfig) -> QuantizationConfig | None:
    from .int4_checkpoints import checkpoint_quantization
    if (prequantized := checkpoint_quantization(config)) is not None:     # an AWQ / GPTQ folder's own int4
        return prequantized
    if config.quantization == "none":
        return None
    return QuantizationConfig(bits=int(config.quantization[3:]), path=config.quant_path,
                              group_size=config.quant_group_size)


def resolve_quant_path(config: EngineConfig, device: torch.device) -> str:
    """The path quant_path 'auto' stands for here: int4 (asked for, or an AWQ / GPTQ folder's own)
    through the CUDA kernel where it can run, else the Triton kernel (saying why in one line on
    stderr); int8 through the Triton kernel; on a CPU without the interpreter, naive."""
    if config.quant_path != "auto":
        return config.quant_path
    triton_here = device.type == "cuda" or interpreting()
    from .int4_checkpoints import checkpoint_quantization
    int4 = config.quantization == "int4" or (config.quantization == "none" and checkpoint_quantization(config) is not None)
    if not int4 or config.dtype != "bfloat16":
        return "fused" if triton_here else "naive"
    from .int4_mma import device_unavailable
    why = device_unavailable(device)
    if why is None:
        return "cuda"
    if device.type == "cuda":
        print(f"int4: {why}; using the Triton kernel (quant_path fused)", file=sys.stderr)
    return "fused" if triton_here else "naive"


def fused_path_unavailable(config: EngineConfig, device: torch.device) -> str | None:
    """Why the quantized fused path cannot run on this device (its Triton kernels need a GPU or
    the interpreter; the CUDA path a GPU, bf16 and nvcc), or None."""
    if config.quantization != "none" and config.quant_path == "cuda":
        from .int4_mma import device_unavailable
        if config.quantization != "int4":
            return "quant_path 'cuda' is the int4 kernel; int8 runs quant_path fused"
        if config.dtype != "bfloat16":
            return f"quant_path 'cuda' takes bf16 activations; this engine's dtype is {config.dtype}"
        return device_unavailable(device)
    if config.quantization != "none" and config.quant_path == "fused" and device.type != "cuda" and not interpreting():
        return ("quant_path 'fused' runs Triton kernels: it needs a CUDA GPU (or TRITON_INTERPRET=1); "
                "on a CPU use quant_path naive or library")
    return None


def backend_unavailable(config: EngineConfig, device: torch.device) -> str | None:
    """Why the decode attention backend cannot run on this device (Triton needs a GPU, or the
    interpreter), or None: said at startup, not by the first request."""
    from common.triton_shim import HAVE_TRITON
    if config.attention_backend == "triton" and (not HAVE_TRITON or (device.type != "cuda" and not interpreting())):
        return ("attention_backend 'triton' runs a Triton kernel: it needs a CUDA GPU with triton installed "
                "(or TRITON_INTERPRET=1); on a CPU use reference or auto")
    return None


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise LabError(f"device {name!r}: not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LabError(f"device {name!r}: no CUDA GPU is visible")
    if device.type not in ("cuda", "cpu"):
        raise LabError(f"device {name!r}: the engine runs on cuda or cpu")
    return device


class LLMEngine:
    def __init__(self, config: EngineConfig, weights: dict | None = None):
        """weights: a Hugging Face-named dict (left as given); None: weights_for(config.model, ...)."""
        start = time.perf_counter()
        config.check()
        self.config = config
        self.device = pick_device(config.device)
        if config.quant_path == "auto":
            config = dataclasses.replace(config, quant_path=resolve_quant_path(config, self.device))
            self.config = config
        refused = fused_path_unavailable(config, self.device) or backend_unavailable(config, self.device)
        if refused:
            raise LabError(refused)
        dtype = DTYPES[config.dtype]
        self.tp = self._tensor_parallel(config, dtype)
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
        self.max_speculative_tokens = config.num_speculative_tokens if config.speculative_model != "none" else 0
        draft_shape = self._draft_shape(config.speculative_model)
        requested_len = config.max_model_len or min(self.shape.max_position_embeddings, DEFAULT_MAX_MODEL_LEN,
                                                    config.max_num_batched_tokens)
        if requested_len > self.shape.max_position_embeddings:
            raise LabError(f"max_model_len {requested_len} exceeds {self.shape.name}'s "
                           f"max_position_embeddings {self.shape.max_position_embeddings}")
        if requested_len > config.max_num_batched_tokens:
            raise LabError(f"max_model_len {requested_len} exceeds max_num_batched_tokens "
                           f"{config.max_num_batched_tokens}: a preempted sequence could never be prefilled again")
        self.runner = ModelRunner(
            self.shape, weights, dtype=dtype, device=self.device, block_size=config.block_size,
            num_kv_blocks=config.num_kv_blocks, gpu_memory_utilization=config.gpu_memory_utilization,
            max_num_seqs=config.max_num_seqs * (self.max_speculative_tokens + 1),
            max_num_batched_tokens=config.max_num_batched_tokens,
            cuda_graphs=config.cuda_graphs, attention_backend=config.attention_backend, seed=config.seed,
            consume_weights=owned, quantization=quantization_of(config),
            **self._companion(draft_shape, dtype), tp=self.tp)
        del weights
        capacity = self.runner.num_kv_blocks * config.block_size
        if capacity < requested_len and config.max_model_len is not None:
            raise LabError(f"the KV pool holds {capacity} tokens, fewer than max_model_len {requested_len}; "
                           "lower max_model_len or give the pool more blocks")
        self.max_model_len = min(requested_len, capacity)
        load_s = time.perf_counter() - start
        self.runner.prepare(self.max_model_len)
        self.scheduler = Scheduler(BlockPool(self.runner.num_kv_blocks, config.block_size),
                                   config.max_num_seqs, config.max_num_batched_tokens,
                                   lookahead_slots=self.max_speculative_tokens, max_model_len=self.max_model_len)
        self.speculator: Speculator | None = None
        if config.speculative_model == "ngram":
            self.speculator = Speculator(NgramProposer(), config.num_speculative_tokens, self.device, config.seed)
        elif draft_shape is not None:
            self.speculator = Speculator(self.draft_proposer(config.speculative_model), config.num_speculative_tokens,
                                         self.device, config.seed)
        eos = self.shape.eos_token_id
        self._eos_ids = frozenset(() if eos is None else (eos,) if isinstance(eos, int) else eos)
        self.runner.sampler.eos_token_ids = self._eos_ids
        self._requests: dict[str, Sequence] = {}
        self._request_counter = itertools.count()
        self._abort_outputs: list[StepOutput] = []
        self.last_step: dict = {}
        self.telemetry = {
            "model": config.model, "shape": self.shape.name, "dtype": config.dtype, "device": str(self.device),
            "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            **self.runner.telemetry, **(self.tp.describe() if self.tp is not None else {}),
            "max_model_len": self.max_model_len, "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens, "load_s": load_s,
            "startup_s": time.perf_counter() - start, "steps": 0,
        }

    def _tensor_parallel(self, config: EngineConfig, dtype: torch.dtype):
        """This rank's TensorParallel (tensor_parallel > 1), its device the one torchrun's
        LOCAL_RANK was given (torch.cuda.set_device), or None."""
        if config.tensor_parallel == 1:
            return None
        from .tp_ranks import TensorParallel, unsplittable
        why = unsplittable(resolve(config.model)[0], config.tensor_parallel)
        if why:
            raise LabError(why)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        return TensorParallel(config.tensor_parallel, self.device, dtype, config.allreduce)

    # -------------------------------------------------------------------------- speculative decoding
    def _draft_shape(self, model: str) -> LlamaShape | None:
        if model in ("none", "ngram"):
            return None
        shape = resolve(model)[0]
        if shape.vocab_size != self.shape.vocab_size:
            raise LabError(f"draft {shape.name} has a vocabulary of {shape.vocab_size}, the target "
                           f"{self.shape.name} {self.shape.vocab_size}: a draft must share the target's vocabulary")
        return shape

    def _companion(self, draft_shape: LlamaShape | None, dtype: torch.dtype) -> dict:
        """What the draft needs beside the target's pool (its weights, activations, its K and V per block)."""
        if draft_shape is None:
            return {}
        size = dtype.itemsize
        rows = 2 * self.config.max_num_seqs
        return {"companion_bytes": int(draft_shape.weight_bytes(size))
                + activation_reserve_bytes(draft_shape, self.config.max_num_batched_tokens, rows, size),
                "companion_block_bytes": kv_block_bytes(draft_shape, self.config.block_size, size)}

    def draft_proposer(self, model: str, seed: int | None = None) -> DraftProposer:
        """A draft model (named shape with seeded random weights, or checkpoint folder) on its own
        runner: this engine's block size and number of blocks (it follows the target's block
        tables), rows for two tokens per sequence."""
        config = self.config
        shape = self._draft_shape(model)
        dtype = DTYPES[config.dtype]
        seed = config.seed + 1 if seed is None else seed
        _, weights = weights_for(model, seed, dtype, self.device)
        runner = ModelRunner(
            shape, weights, dtype=dtype, device=self.device, block_size=config.block_size,
            num_kv_blocks=self.runner.num_kv_blocks, gpu_memory_utilization=config.gpu_memory_utilization,
            max_num_seqs=2 * config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            cuda_graphs=config.cuda_graphs, attention_backend=config.attention_backend, seed=seed,
            consume_weights=True)
        del weights
        runner.prepare(self.max_model_len)
        return DraftProposer(runner, torch.Generator(device=self.device).manual_seed(seed))

    def speculate(self, proposer: "DraftProposer | NgramProposer | None", k: int = 0) -> None:
        """Switch speculative decoding (a proposer and k up to the configured num_speculative_tokens)
        or turn it off (None), between runs: no request may be unfinished."""
        if self.has_unfinished():
            raise LabError("speculate() between runs only: requests are still unfinished")
        if proposer is None:
            self.speculator = None
            return
        if not 1 <= k <= self.max_speculative_tokens:
            raise LabError(f"k must be in [1, {self.max_speculative_tokens}] (the engine's num_speculative_tokens)")
        self.speculator = Speculator(proposer, k, self.device, self.config.seed)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.block_pool.num_free_blocks

    # -------------------------------------------------------------------------- requests
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request; ValueError (one line) for anything it cannot run with."""
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
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

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
        self.runner.release(seq)
        if self.speculator is not None:
            self.speculator.proposer.forget(seq)
        self._abort_outputs.append(StepOutput(request_id, [], True, "abort", seq.num_prompt_tokens,
                                              seq.num_output_tokens))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -------------------------------------------------------------------------- a step
    def step(self) -> list[StepOutput]:
        """One scheduler step: a prefill batch or a decode batch, one new token per sequence in it
        (with speculative decoding, a decode step gives each sequence 1 to k + 1 tokens)."""
        start = time.perf_counter()
        outputs, self._abort_outputs = self._abort_outputs, []
        batch = self.scheduler.schedule()
        if batch is None:
            return outputs
        if self.speculator is not None and not batch.is_prefill:
            new_tokens = self.speculator.decode_step(self.runner, batch.seqs, [self._budget(s) for s in batch.seqs])
        else:
            new_tokens = [[token] for token in self.runner.run(batch.seqs, batch.is_prefill)]
            if self.speculator is not None:
                self.speculator.proposer.prefill(batch.seqs)
        for seq, tokens in zip(batch.seqs, new_tokens):
            emitted, reason = [], None
            for token in tokens:
                seq.num_cached_tokens = seq.num_tokens
                seq.append_token(token)
                emitted.append(token)
                reason = self._finish_reason(seq, token)
                if reason is not None:
                    break
            if reason is not None:
                self._retire(seq, reason)
            elif self.speculator is not None:
                self.scheduler.block_pool.truncate(seq, self.scheduler.slots_needed(seq))   # rejected tokens' blocks
            out = StepOutput(seq.request_id, emitted, reason is not None, reason, seq.num_prompt_tokens,
                             seq.num_output_tokens)
            if seq.params.logprobs is not None:
                out.logprobs, seq.new_logprobs = seq.new_logprobs, []
            if seq.params.prompt_logprobs is not None and seq.num_output_tokens == len(emitted):
                out.prompt_logprobs = seq.prompt_logprobs
            outputs.append(out)
        self.telemetry["steps"] += 1
        self.last_step = {"kind": "prefill" if batch.is_prefill else "decode", "num_seqs": len(batch.seqs),
                          "num_tokens": batch.num_tokens, "ms": (time.perf_counter() - start) * 1e3}
        return outputs

    def _budget(self, seq: Sequence) -> int:
        """Tokens `seq` may still emit before max_tokens or max_model_len stops it."""
        return min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)

    def _retire(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.runner.release(seq)
        if self.speculator is not None:
            self.speculator.proposer.forget(seq)
        del self._requests[seq.request_id]

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if (token in self._eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Offline: add every prompt, step until they are all done; output token ids in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams")
        seqs = [self._requests[self.add_request(prompt, p)] for prompt, p in zip(prompts, params_list)]
        while not all(seq.is_finished for seq in seqs):
            self.step()
        return [seq.output_token_ids for seq in seqs]

