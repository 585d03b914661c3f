"""ModelRunner: the engine's tensors. It owns the model, the KV cache, the decode input buffers and
the CUDA graphs (cuda_graphs.py), turns a scheduled batch of sequences into input tensors, runs the
prefill or decode forward and samples one token per sequence. It never decides who runs (that is
the scheduler's job) and reads its settings from the engine's one EngineConfig.

Decode inputs (token ids, positions, slot mapping, context lengths, block tables) live in one
preallocated device buffer, filled from a pinned host twin with one copy per step, so a CUDA graph
captured once per batch-size bucket replays any batch padded up to its bucket (padded rows write
nowhere, slot -1, and attend over one token of block 0).

With tensor parallelism (tp) the runner holds one rank's shards and its KV heads; every rank runs
the same steps.
"""
import itertools

import numpy as np
import torch

from common.errors import LabError

from . import paged_attention
from .config import EngineConfig
from .cuda_graphs import CudaGraphs, decode_splits
from .kv_cache import activation_reserve_bytes, allocate_kv_cache, kv_block_bytes, kv_pool_blocks
from .decode_inputs import DecodeInputs
from .overlap import TokensInFlight
from .model import AttentionMetadata, LlamaModel, QuantizationConfig
from .sampler import Sampler, on_device, token_logprobs
from .sequence import Sequence
from .shapes import LlamaShape

CPU_KV_POOL_BYTES = 64 << 20       # without a GPU the pool is a fixed, test-sized budget
# the naive quantized path dequantizes a whole projection per call: int32 nibbles, the float copy
# and its scaled result live at once (4 + 4 + 2 bytes per weight, the widest case, int4)
NAIVE_DEQUANTIZE_BYTES_PER_WEIGHT = 10


class TokenReadback:
    """Device token ids to a list through one pinned buffer and one event: no allocation per
    step, and the host waits for the copy alone."""

    def __init__(self, size: int, pinned: bool):
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=pinned)
        self._host_np = self._host.numpy()
        self._copied = torch.cuda.Event() if pinned else None

    def __call__(self, tokens: torch.Tensor) -> list[int]:
        if not tokens.is_cuda:
            return tokens.tolist()
        n = tokens.shape[0]
        self._host[:n].copy_(tokens, non_blocking=True)
        self._copied.record()
        self._copied.synchronize()
        return self._host_np[:n].tolist()


class ModelRunner:
    """Built in two stages: __init__ loads the weights and sizes the KV pool (so the engine can
    settle max_model_len against the pool's capacity), `prepare(max_model_len)` allocates the cache
    and input buffers and captures the CUDA graphs."""

    def __init__(self, config: EngineConfig, shape: LlamaShape, weights: dict, *,
                 quantization: QuantizationConfig | None = None, tp=None, consume_weights: bool = True):
        """`config`: settled (config.settled); its speculative draft, if any, is counted out of the
        pool (the draft's runner shares this one's block tables). tp: a
        tensor_parallel.TensorParallel; `weights` are then this rank's shards."""
        self.config = config
        self.tp = tp
        self.shape = shape if tp is None else tp.local_shape(shape)       # this rank's heads and MLP slice
        self.dtype, self.device = config.torch_dtype, torch.device(config.device)
        self.is_cuda = self.device.type == "cuda"
        self.block_size = config.block_size
        self.max_num_seqs = config.decode_rows
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.quantization = quantization
        self.model = LlamaModel(shape, self.dtype, self.device, decode_backend=config.attention_backend,
                                quantization=quantization, tp=tp)
        self.model.load(weights, consume=consume_weights)
        self.sampler = Sampler(self.device, config.seed)
        self.graphs: CudaGraphs | None = None
        self.telemetry: dict = {"weights_bytes": self.model.weight_bytes(), "block_size": config.block_size,
                                "prefill_attention": "flash varlen" if self.model.prefill_varlen is not None else "sdpa per sequence",
                                "decode_attention_backend": config.attention_backend,
                                "quantization": quantization.label() if quantization else "none"}
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        self.num_kv_blocks = config.num_kv_blocks or self._pool_blocks()
        if tp is not None:                  # the scheduler's block numbers must mean the same on every rank
            self.num_kv_blocks = tp.min_int(self.num_kv_blocks)
        if self.num_kv_blocks < 1:
            raise LabError(f"no room for a KV cache: {self._memory_summary()}; lower max_num_batched_tokens "
                           "or max_num_seqs, or raise gpu_memory_utilization")

    @property
    def sms(self) -> int:
        return paged_attention.sm_count(self.device)

    def _pool_blocks(self) -> int:
        config, size = self.config, self.dtype.itemsize
        draft_bytes = draft_block_bytes = 0
        if config.speculative_model not in ("none", "ngram"):      # the draft's weights, activations, K and V
            from .weights import resolve
            draft = resolve(config.speculative_model)[0]
            draft_bytes = int(draft.weight_bytes(size)) + activation_reserve_bytes(
                draft, config.max_num_batched_tokens, 2 * config.max_num_seqs, size)
            draft_block_bytes = kv_block_bytes(draft, config.block_size, size)
        block_bytes = kv_block_bytes(self.shape, self.block_size, size) + draft_block_bytes
        if not self.is_cuda:
            return max(1, CPU_KV_POOL_BYTES // block_bytes)
        free_bytes, total_bytes = torch.cuda.mem_get_info(self.device)
        resident_bytes = torch.cuda.memory_reserved(self.device)        # the weights, as allocated
        other_bytes = (total_bytes - free_bytes) - resident_bytes        # CUDA context, other processes
        reserve = activation_reserve_bytes(self.shape, self.max_num_batched_tokens, self.max_num_seqs, size) + draft_bytes
        if self.quantization is not None and self.quantization.path == "naive":
            gate_up = self.model.layers[0].gate_up                      # the widest projection, every layer alike
            reserve += NAIVE_DEQUANTIZE_BYTES_PER_WEIGHT * max(gate_up.out_features * gate_up.in_features, 1)
        self.telemetry.update(gpu_total_bytes=total_bytes, gpu_memory_utilization=config.gpu_memory_utilization,
                              activation_reserve_bytes=reserve, other_gpu_bytes=other_bytes,
                              resident_gpu_bytes=resident_bytes)
        return kv_pool_blocks(total_bytes, config.gpu_memory_utilization, resident_bytes, reserve, block_bytes,
                              other_bytes)

    def _memory_summary(self) -> str:
        t = self.telemetry
        gib = 1 << 30
        if "gpu_total_bytes" not in t:
            return f"weights {t['weights_bytes'] / gib:.2f} GiB"
        return (f"weights {t['weights_bytes'] / gib:.2f} GiB (this process holds "
                f"{t['resident_gpu_bytes'] / gib:.2f} GiB in all), activation reserve "
                f"{t['activation_reserve_bytes'] / gib:.2f} GiB, other {t['other_gpu_bytes'] / gib:.2f} GiB, "
                f"of {t['gpu_memory_utilization']} x {t['gpu_total_bytes'] / gib:.2f} GiB")

    # -------------------------------------------------------------------------- stage 2
    @torch.inference_mode()
    def prepare(self, max_model_len: int) -> None:
        shape, device = self.shape, self.device
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.model.set_rope(shape, max_model_len)
        self.kv_cache, self.model.kv_caches = allocate_kv_cache(shape, self.num_kv_blocks, self.block_size,
                                                                self.dtype, device)
        self.decode_inputs = DecodeInputs(self.max_num_seqs, self.max_blocks_per_seq, device)
        self.read_tokens = self.token_readback(self.max_num_seqs)
        self.tokens_in_flight = TokensInFlight(self.max_num_seqs, device)
        self.telemetry.update(num_kv_blocks=self.num_kv_blocks,
                              kv_pool_bytes=self.kv_cache.numel() * self.kv_cache.element_size(),
                              kv_capacity_tokens=self.num_kv_blocks * self.block_size,
                              graph_capture_s=0.0, graph_batch_sizes=[], prefill_graph_tokens=[])
        if self.config.cuda_graphs and self.is_cuda:
            self.graphs = CudaGraphs(self, max_model_len)
            self.graphs.capture()

    def token_readback(self, size: int) -> TokenReadback:
        return TokenReadback(size, pinned=self.is_cuda)

    # -------------------------------------------------------------------------- a step
    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        """One forward over `seqs` (prefill: every uncached token; decode: the last token of each)
        and one sampled token per sequence."""
        if is_prefill:
            partial = [i for i, s in enumerate(seqs) if s.prefill_end < s.num_tokens]
            if partial:
                return self._run_chunks(seqs, partial)
        if is_prefill and any(s.params.prompt_logprobs is not None and s.prompt_logprobs is None for s in seqs):
            logits, greedy = self._prefill_with_prompt_logprobs(seqs), None
        elif is_prefill:
            logits, greedy = self.prefill(seqs)
        else:
            logits, greedy = self._decode(seqs)
        if greedy is not None and not any(s.params.needs_sampler for s in seqs):
            return self.read_tokens(greedy)
        return self.sampler.sample(logits, seqs, greedy)

    def _run_chunks(self, seqs: list[Sequence], partial: list[int]) -> list[int | None]:
        """A chunked-prefill step: every sequence's chunk (a decode row is a chunk of one token)
        in one eager forward; a token sampled only for those whose chunk reaches their last token
        (None for the rest: no draw is made for a chunk)."""
        logits = self.prefill_logits(seqs)
        unfinished = set(partial)
        done = [i for i in range(len(seqs)) if i not in unfinished]
        tokens: list[int | None] = [None] * len(seqs)
        if done:
            picked = self.sampler.sample(logits[torch.tensor(done, device=logits.device)], [seqs[i] for i in done])
            for i, token in zip(done, picked):
                tokens[i] = token
        return tokens

    @torch.inference_mode()
    def launch_decode(self, seqs: list[Sequence], pending: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
        """One decode step queued without waiting for the device: each sequence's sampled token,
        int64 on the device (overlap.py reads them later). pending (tokens, rows): row r's input
        is instead seqs[r]'s pending token, tokens[rows[r]] from the step before (still on the
        device, not in seq.token_ids), at position num_tokens; its blocks cover that slot. Only for
        steps whose sampling needs nothing from the host (overlap.sync_reason)."""
        if pending is None:
            logits, greedy = self._decode(seqs)
        else:
            tokens, rows = pending
            same_rows = all(row == r for r, row in enumerate(rows))       # the common step: nobody left
            index = None if same_rows else on_device(rows, torch.int64, tokens.device)
            logits, greedy = self._decode(seqs, pending=(tokens, index))
        if greedy is not None and not any(s.params.needs_sampler for s in seqs):
            return greedy
        return self.sampler.pick(logits, seqs, greedy, ahead=0 if pending is None else 1)

    def prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, their argmax where a graph computed it) of each sequence's last token after a
        prefill of all its tokens: a graph replay for one sequence that fits a bucket, else eager."""
        if (self.graphs is not None and not seqs[0].num_cached_tokens and seqs[0].num_new_tokens is None
                and self.graphs.fits_prefill(seqs)):
            return self.graphs.prefill(seqs[0])
        return self.prefill_logits(seqs), None

    def _prefill_with_prompt_logprobs(self, seqs: list[Sequence]) -> torch.Tensor:
        """An eager prefill keeping every position's logits: each sequence that asks for prompt
        logprobs (on its first prefill only) gets seq.prompt_logprobs, one entry per prompt token
        after the first; returns the last rows' logits, to sample from."""
        rows, spans, start = [], [], 0             # logits only where needed: V floats a row
        for seq in seqs:
            wants = seq.params.prompt_logprobs is not None and seq.prompt_logprobs is None
            first = len(rows)
            if wants:
                rows += range(start, start + seq.num_prompt_tokens - 1)
            spans.append((first, len(rows), wants))
            computed = seq.num_tokens - seq.num_cached_tokens      # rows this prefill packs
            rows.append(start + computed - 1)
            start += computed
        logits = self.prefill_logits(seqs, rows=rows)
        for seq, (first, end, wants) in zip(seqs, spans):
            if wants:
                n = seq.num_prompt_tokens
                seq.prompt_logprobs = token_logprobs(logits[first:end], seq.token_ids[1:n],
                                                     [seq.params.prompt_logprobs] * (n - 1))
        return logits[torch.tensor([end for _, end, _ in spans], device=logits.device)]

    @torch.inference_mode()
    def prefill_logits(self, seqs: list[Sequence], all_positions: bool = False,
                       rows: list[int] | None = None) -> torch.Tensor:
        """fp32 logits after an eager prefill of every uncached token of `seqs` (their blocks
        allocated; a sequence's first num_cached_tokens are in the cache already, a shared
        prefix): of each sequence's last token, of every computed position (the correctness
        check's view), or of the packed positions `rows`."""
        cached_lens = [s.num_cached_tokens for s in seqs]
        ends = [s.prefill_end for s in seqs]
        seq_lens = [e - c for e, c in zip(ends, cached_lens)]                # the tokens computed now
        offsets = np.zeros(len(seqs) + 1, dtype=np.int32)
        np.cumsum(seq_lens, out=offsets[1:])
        total = int(offsets[-1])
        over_cache = any(cached_lens)   # attention over each whole context (cached prefix, new tokens): its slots
        context = []
        if over_cache:
            cu_context = np.zeros(len(seqs) + 1, dtype=np.int32)
            np.cumsum(ends, out=cu_context[1:])
            context = [*[self.prefill_slots(s)[:e] for s, e in zip(seqs, ends)], cu_context]
        packed = np.concatenate([
            np.fromiter(itertools.chain.from_iterable(s.token_ids[c:e] for s, c, e in zip(seqs, cached_lens, ends)),
                        dtype=np.int32, count=total),
            np.concatenate([np.arange(c, e, dtype=np.int32) for c, e in zip(cached_lens, ends)]),
            *[self.prefill_slots(s)[c:e] for s, c, e in zip(seqs, cached_lens, ends)], offsets[1:] - 1, offsets,
            *context])
        on_device = torch.from_numpy(packed).to(self.device)    # one copy for every input of the step
        parts = on_device.split([total, total, total, len(seqs), len(seqs) + 1]
                                + ([sum(ends), len(seqs) + 1] if over_cache else []))
        input_ids, positions, slot_mapping, last_rows, cu_seqlens = parts[:5]
        if rows is not None:
            last_rows = torch.tensor(rows, dtype=torch.int64).to(self.device)
        meta = AttentionMetadata(is_prefill=True, slot_mapping=slot_mapping, seq_lens=seq_lens,
                                 cu_seqlens=cu_seqlens, max_seq_len=max(seq_lens),
                                 logits_indices=None if all_positions else last_rows)
        if over_cache:
            meta.cached_lens = cached_lens
            meta.context_slots, meta.cu_context_lens, meta.max_context_len = parts[5], parts[6], max(ends)
        return self.model.forward_logits(input_ids, positions, meta)

    def prefill_slots(self, seq: Sequence) -> np.ndarray:
        """The cache slot of each of `seq`'s tokens, int32."""
        bs = self.block_size
        table = np.asarray(seq.block_table, dtype=np.int32)
        return (table[:, None] * bs + np.arange(bs, dtype=np.int32)).reshape(-1)[:seq.num_tokens]

    @torch.inference_mode()
    def decode_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """fp32 logits of the last token of each of `seqs`, whose earlier tokens are cached and
        whose blocks cover the last token. Under CUDA graphs a view of the graphs' output buffer:
        valid until the next decode."""
        logits, _ = self._decode(seqs)
        if self.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()      # the host buffer is free again
        return logits

    @torch.inference_mode()
    def rows_logits(self, seqs: list[Sequence], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(fp32 logits, their argmax where a graph computed it) of one decode-shaped forward whose
        row r feeds token seqs[r].token_ids[positions[r]] at that position and attends over the
        positions before it and itself: a sequence may fill several rows (speculative decoding's
        verify pass, k + 1 tokens at once; its catching-up draft). Each row writes its K and V
        before any row attends, so a later row of the same sequence sees the earlier ones. The
        caller synchronizes before the next call (views of the graphs' buffers under graphs)."""
        return self._decode(seqs, positions)

    def _decode(self, seqs: list[Sequence], positions: list[int] | None = None,
                pending: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, their argmax where a graph computed it) of each sequence's last token (or of
        the token at positions[row], or of its pending token gathered on the device from
        pending = (tokens, rows): launch_decode). Views of the graphs' buffers under graphs:
        valid until the next replay."""
        n = len(seqs)
        max_context = self.decode_inputs.write(seqs, positions, self.block_size, pending=pending is not None)
        self.decode_inputs.send(n, self.graphs.bucket_of[n] if self.graphs else n)
        if pending is not None:
            self.decode_inputs.gather_ids(n, *pending)
        if self.graphs:
            return self.graphs.decode(n, max_context)
        return self.decode_forward(n, decode_splits(n, self.shape.num_key_value_heads, max_context, self.sms)), None

    def decode_forward(self, n: int, num_splits: int | None = None, out: torch.Tensor | None = None,
                       argmax_out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits of the first n rows of the device input buffer (model.forward_logits)."""
        ids, positions, meta = self.decode_inputs.forward_args(n, num_splits)
        return self.model.forward_logits(ids, positions, meta, out=out, argmax_out=argmax_out)

    # -------------------------------------------------------------------------- a probe for the exercises
    @torch.inference_mode()
    def decode_probe(self, context_tokens: int, allreduce: bool = True):
        """A callable running one batch-1 decode step whose token attends over `context_tokens`
        cached tokens (blocks 0, 1, ... of the pool; it writes no K or V), for the exercise side to
        time: its CUDA graph's replay, or an eager forward without graphs. allreduce=False: the
        tensor-parallel all-reduces skipped (a graph captured for the purpose: its numbers are
        wrong, its time is the rest of the step). With tensor parallelism every rank calls it at
        once, between requests."""
        blocks = -(-context_tokens // self.block_size)
        if blocks > min(self.max_blocks_per_seq, self.num_kv_blocks):
            raise LabError(f"a decode step over {context_tokens} tokens needs {blocks} KV blocks; "
                           f"the runner has {min(self.max_blocks_per_seq, self.num_kv_blocks)} for a sequence")
        self.decode_inputs.write_probe_row(context_tokens, self.block_size)
        skip = self.tp is not None and not allreduce
        if self.graphs:
            key = self.graphs.decode_key(1, context_tokens)
            if not skip:
                return self.graphs.decode_graphs[key].replay
            self.tp.noop = True
            try:
                return self.graphs.capture_decode_step(*key).replay
            finally:
                self.tp.noop = False
        splits = decode_splits(1, self.shape.num_key_value_heads, context_tokens, self.sms)

        @torch.inference_mode()
        def eager_step():
            if skip:
                self.tp.noop = True
            try:
                self.decode_forward(1, splits)
            finally:
                if skip:
                    self.tp.noop = False
        return eager_step
