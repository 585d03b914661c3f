"""ModelRunner: the engine's tensors. It owns the model, the KV cache and the CUDA graphs, turns
a scheduled batch of sequences into input tensors, runs the prefill or decode forward and samples
one token per sequence. It never decides who runs (that is the scheduler's job).

Decode inputs (token ids, positions, slot mapping, context lengths, block tables) live in one
preallocated device buffer, filled from a pinned host twin with one copy per step, so a CUDA graph
captured once per batch-size bucket (1, 2, 4, 8, 16, 24, ...) replays any batch padded up to its
bucket. Padded rows write nowhere (slot -1) and attend over one token of block 0. Each bucket has
one graph per attention split count its batch can want: the longest context in the batch picks a
tier (up to 256, 512, 1024, ... tokens), the tier the split count, so a short context is not cut
into splits that only add partials and a combine. The graph also takes the argmax of the logits, so a greedy batch needs no kernel
launched outside it.

With tensor parallelism (tp) the runner holds one rank's shards and its KV heads; every rank runs
the same steps, and the graphs hold the all-reduces (captured in thread-local mode: NCCL's watchdog
thread queries events while a graph is captured).

A prefill of one sequence (the common serving case) of at most the largest prefill bucket
(16, 32, ..., 512 tokens) replays a graph too: its tokens are padded at the tail up to the bucket
(causal attention keeps the real tokens from seeing the padding, whose slot is -1), and the
logits row is gathered at the last real token through a device index. Batches of several
sequences prefill eagerly.
"""
import itertools
import time

import numpy as np
import torch

from common.errors import LabError

from . import paged_attention
from .kv_cache import activation_reserve_bytes, allocate_kv_cache, kv_block_bytes, kv_pool_blocks
from .model import AttentionMetadata, LlamaModel
from .sampler import Sampler, categorical, token_logprobs
from .sequence import Sequence
from .shapes import LlamaShape

CPU_KV_POOL_BYTES = 64 << 20       # without a GPU the pool is a fixed, test-sized budget
PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512)
SPLIT_TIER_BASE_TOKENS = 256       # decode graphs' context tiers: this, twice it, ...
DECODE_TOKENS_PER_SPLIT = 64       # a split shorter than one tile of the kernel only adds partials
DECODE_PROGRAMS_PER_SM = 4
# the naive quantized path dequantizes a whole projection per call: int32 nibbles, the float copy
# and its scaled result live at once (4 + 4 + 2 bytes per weight, the widest case, int4)
NAIVE_DEQUANTIZE_BYTES_PER_WEIGHT = 10


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode buckets: 1, 2, 4, 8, then every multiple of 8, and max_num_seqs itself."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def prefill_graph_sizes(max_num_batched_tokens: int, max_model_len: int) -> list[int]:
    """The one-sequence prefill buckets: PREFILL_GRAPH_TOKENS up to max_num_batched_tokens and
    max_model_len (a bucket longer than the context would index RoPE's tables past their end; the
    limit itself is the last bucket when it falls below the largest)."""
    largest = min(max_num_batched_tokens, max_model_len, PREFILL_GRAPH_TOKENS[-1])
    return [s for s in PREFILL_GRAPH_TOKENS if s < largest] + [largest]


def context_tiers(max_model_len: int) -> list[int]:
    """Longest-context tiers of the decode graphs: SPLIT_TIER_BASE_TOKENS doubled until it covers
    max_model_len (the last tier is max_model_len itself)."""
    tiers = [SPLIT_TIER_BASE_TOKENS]
    while tiers[-1] < max_model_len:
        tiers.append(tiers[-1] * 2)
    tiers[-1] = max_model_len
    return tiers


def tier_of(max_context_tokens: int, num_tiers: int) -> int:
    """The index of the smallest tier holding `max_context_tokens` (tiers double from the base)."""
    return min(num_tiers - 1, ((max_context_tokens - 1) // SPLIT_TIER_BASE_TOKENS).bit_length())


def decode_splits(batch: int, num_kv_heads: int, max_context_tokens: int, sms: int) -> int:
    """Decode attention splits per (sequence, KV head) for a batch whose longest context is
    `max_context_tokens`: up to DECODE_PROGRAMS_PER_SM programs per SM, no split shorter than
    DECODE_TOKENS_PER_SPLIT, at most the kernel's MAX_SPLITS; a power of two (fewer kernels to
    compile). One split launches no combine kernel."""
    wanted = max(1, DECODE_PROGRAMS_PER_SM * sms // max(1, batch * num_kv_heads))
    by_length = max(1, max_context_tokens // DECODE_TOKENS_PER_SPLIT)
    chosen = min(wanted, by_length, paged_attention.MAX_SPLITS)
    return 1 << (chosen.bit_length() - 1)


def splits_by_tier(batch: int, num_kv_heads: int, tiers: list[int], sms: int) -> list[int]:
    """The decode attention split count of a batch bucket at each context tier."""
    return [decode_splits(batch, num_kv_heads, tier, sms) for tier in tiers]


class ModelRunner:
    """Built in two stages: __init__ loads the weights and sizes the KV pool (so the engine can
    settle max_model_len against the pool's capacity), `prepare(max_model_len)` allocates the cache
    and input buffers and captures the decode graphs."""

    def __init__(self, shape: LlamaShape, weights: dict, *, dtype: torch.dtype, device: torch.device,
                 block_size: int, num_kv_blocks: int | None, gpu_memory_utilization: float,
                 max_num_seqs: int, max_num_batched_tokens: int, cuda_graphs: bool,
                 attention_backend: str, seed: int, consume_weights: bool, quantization=None,
                 companion_bytes: int = 0, companion_block_bytes: int = 0, tp=None):
        """companion_bytes, companion_block_bytes: what a second model sharing this pool's block
        tables (a speculative draft, loaded later) needs beside it, counted out of the pool.
        tp: a tensor_parallel.TensorParallel; `weights` are then this rank's shards."""
        self.tp = tp
        self.shape = shape if tp is None else tp.local_shape(shape)       # this rank's heads and MLP slice
        self._capture_error_mode = "global" if tp is None else "thread_local"
        self.companion_bytes = companion_bytes
        self.companion_block_bytes = companion_block_bytes
        self.dtype = dtype
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.use_graphs = cuda_graphs and self.is_cuda
        self.quantization = quantization
        self.model = LlamaModel(shape, dtype, device, decode_backend=attention_backend, quantization=quantization,
                                tp=tp)
        self.model.load(weights, consume=consume_weights)
        self.sampler = Sampler(device, seed)
        self.telemetry: dict = {"weights_bytes": self.model.weight_bytes(), "block_size": block_size,
                                "prefill_attention": "flash varlen" if self.model.prefill_varlen is not None else "sdpa per sequence",
                                "decode_attention_backend": attention_backend,
                                "quantization": quantization.label() if quantization else "none"}
        if self.is_cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        self.num_kv_blocks = num_kv_blocks or self._pool_blocks(gpu_memory_utilization, max_num_batched_tokens)
        if tp is not None:                  # the scheduler's block numbers must mean the same on every rank
            self.num_kv_blocks = tp.min_int(self.num_kv_blocks)
        if self.num_kv_blocks < 1:
            raise LabError(f"no room for a KV cache: {self._memory_summary()}; lower max_num_batched_tokens "
                           "or max_num_seqs, or raise gpu_memory_utilization")

    def _pool_blocks(self, gpu_memory_utilization: float, max_num_batched_tokens: int) -> int:
        block_bytes = kv_block_bytes(self.shape, self.block_size, self.dtype.itemsize) + self.companion_block_bytes
        if not self.is_cuda:
            return max(1, CPU_KV_POOL_BYTES // block_bytes)
        free_bytes, total_bytes = torch.cuda.mem_get_info(self.device)
        resident_bytes = torch.cuda.memory_reserved(self.device)        # the weights, as allocated
        other_bytes = (total_bytes - free_bytes) - resident_bytes        # CUDA context, other processes
        reserve = (activation_reserve_bytes(self.shape, max_num_batched_tokens, self.max_num_seqs, self.dtype.itemsize)
                   + self.companion_bytes)
        if self.quantization is not None and self.quantization.path == "naive":
            reserve += NAIVE_DEQUANTIZE_BYTES_PER_WEIGHT * max(self._largest_projection_weights(), 1)
        self.telemetry.update(gpu_total_bytes=total_bytes, gpu_memory_utilization=gpu_memory_utilization,
                              activation_reserve_bytes=reserve, other_gpu_bytes=other_bytes)
        return kv_pool_blocks(total_bytes, gpu_memory_utilization, resident_bytes, reserve, block_bytes, other_bytes)

    def _largest_projection_weights(self) -> int:
        """Weights of the widest projection, fused gate_up (every layer has the same shapes)."""
        gate_up = self.model.layers[0].gate_up
        return gate_up.out_features * gate_up.in_features

    def _memory_summary(self) -> str:
        t = self.telemetry
        gib = 1 << 30
        if "gpu_total_bytes" not in t:
            return f"weights {t['weights_bytes'] / gib:.2f} GiB"
        return (f"weights {t['weights_bytes'] / gib:.2f} GiB, activation reserve "
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
        # Decode inputs, int32, in one flat buffer: token ids, positions, slots and context lengths
        # (max_num_seqs each), then the block tables row by row. A batch of b rows needs a prefix
        # of it, so one copy from the pinned host twin moves a step's inputs.
        n, width = self.max_num_seqs, self.max_blocks_per_seq
        self._host_inputs = torch.zeros(4 * n + n * width, dtype=torch.int32, pin_memory=self.is_cuda)
        self._host_inputs_np = self._host_inputs.numpy()
        self._inputs = torch.zeros_like(self._host_inputs, device=device) if self.is_cuda else self._host_inputs
        self._host_inputs_np[2 * n:3 * n] = -1            # padding rows write no K/V ...
        self._host_inputs_np[3 * n:4 * n] = 1             # ... and attend over one token of block 0
        self._inputs.copy_(self._host_inputs)
        self._host_columns = [self._host_inputs_np[i * n:(i + 1) * n] for i in range(4)]
        self._host_words = memoryview(self._host_inputs_np)
        self._input_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._host_block_tables = self._host_inputs_np[4 * n:].reshape(n, width)
        # Per row, the block table list last written there and how many of its entries: a decode
        # step writes only the blocks a row's sequence gained (lists only grow; a new allocation is
        # a new list, kept alive here so its identity cannot be reused).
        self._written_tables: list[tuple[list[int] | None, int]] = [(None, 0)] * n
        # The sampled tokens come back through one pinned buffer and one event: no allocation, and
        # the host waits for the copy alone.
        self._host_tokens = torch.zeros(n, dtype=torch.int64, pin_memory=self.is_cuda)
        self._host_tokens_np = self._host_tokens.numpy()
        self._tokens_copied = torch.cuda.Event() if self.is_cuda else None
        self._context_tiers = context_tiers(max_model_len)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}      # (batch bucket, splits)
        self._splits_of: dict[int, list[int]] = {}                          # bucket -> splits per tier
        self._bucket_of: list[int] = []
        self._graph_logits = self._graph_argmax = None
        self._prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}         # token bucket -> graph
        self._prefill_sizes: list[int] = []
        self.telemetry.update(num_kv_blocks=self.num_kv_blocks,
                              kv_pool_bytes=self.kv_cache.numel() * self.kv_cache.element_size(),
                              kv_capacity_tokens=self.num_kv_blocks * self.block_size,
                              graph_capture_s=0.0, graph_batch_sizes=[], prefill_graph_tokens=[])
        if self.use_graphs:
            self._capture_graphs()
            self._capture_prefill_graphs()

    # -------------------------------------------------------------------------- a step
    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        """One forward over `seqs` (prefill: every uncached token; decode: the last token of each)
        and one sampled token per sequence."""
        if is_prefill and any(s.params.prompt_logprobs is not None and s.prompt_logprobs is None for s in seqs):
            logits, greedy = self._prefill_with_prompt_logprobs(seqs), None
        elif is_prefill and self._prefill_graph_fits(seqs):
            logits, greedy = self._prefill_replay(seqs[0])
        elif is_prefill:
            logits, greedy = self.prefill_logits(seqs), None
        else:
            logits, greedy = self._decode(seqs)
        if greedy is not None and not any(s.params.needs_sampler for s in seqs):
            return self._read_tokens(greedy)
        return self.sampler.sample(logits, seqs, greedy)

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
            rows.append(start + seq.num_tokens - 1)
            start += seq.num_tokens
        logits = self.prefill_logits(seqs, rows=rows)
        for seq, (first, end, wants) in zip(seqs, spans):
            if wants:
                n = seq.num_prompt_tokens
                seq.prompt_logprobs = token_logprobs(logits[first:end], seq.token_ids[1:n],
                                                     [seq.params.prompt_logprobs] * (n - 1))
        return logits[torch.tensor([end for _, end, _ in spans], device=logits.device)]

    @torch.inference_mode()
    def _read_tokens(self, tokens: torch.Tensor) -> list[int]:
        """A device tensor of token ids as a list: one non-blocking copy into the pinned buffer,
        waited for through an event."""
        if not tokens.is_cuda:
            return tokens.tolist()
        n = tokens.shape[0]
        self._host_tokens[:n].copy_(tokens, non_blocking=True)
        self._tokens_copied.record()
        self._tokens_copied.synchronize()
        return self._host_tokens_np[:n].tolist()

    def release(self, seq: Sequence) -> None:
        self.sampler.release(seq.seq_id)

    @torch.inference_mode()
    def prefill_logits(self, seqs: list[Sequence], all_positions: bool = False,
                       rows: list[int] | None = None) -> torch.Tensor:
        """fp32 logits after an eager prefill of every token of `seqs` (their blocks allocated): of
        each sequence's last token, of every position (the correctness check's view), or of the
        packed positions `rows`."""
        seq_lens = [s.num_tokens for s in seqs]
        offsets = np.zeros(len(seqs) + 1, dtype=np.int32)
        np.cumsum(seq_lens, out=offsets[1:])
        total = int(offsets[-1])
        packed = np.concatenate([
            np.fromiter(itertools.chain.from_iterable(s.token_ids for s in seqs), dtype=np.int32, count=total),
            np.concatenate([np.arange(n, dtype=np.int32) for n in seq_lens]),
            *[self._prefill_slots(s) for s in seqs], offsets[1:] - 1, offsets])
        on_device = torch.from_numpy(packed).to(self.device)
        input_ids, positions, slot_mapping, last_rows, cu_seqlens = on_device.split(
            [total, total, total, len(seqs), len(seqs) + 1])
        if rows is not None:
            last_rows = torch.tensor(rows, dtype=torch.int64).to(self.device)
        meta = AttentionMetadata(is_prefill=True, slot_mapping=slot_mapping, seq_lens=seq_lens,
                                 cu_seqlens=cu_seqlens, max_seq_len=max(seq_lens),
                                 logits_indices=None if all_positions else last_rows)
        return self.model.forward_logits(input_ids, positions, meta)

    def _prefill_slots(self, seq: Sequence) -> np.ndarray:
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

    def _decode(self, seqs: list[Sequence], positions: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, their argmax where a graph computed it) of each sequence's last token (or of
        the token at positions[row]). The caller synchronizes (sampling does) before the next call
        rewrites the host buffer."""
        n, m, bs = len(seqs), self.max_num_seqs, self.block_size
        if n > m:
            raise LabError(f"{n} decode rows exceed the runner's {m}")
        words = self._host_words                               # the columns, written one int at a time
        tables, written_tables = self._host_block_tables, self._written_tables
        max_context = 0
        for row, s in enumerate(seqs):
            token_ids, table = s.token_ids, s.block_table
            p = len(token_ids) - 1 if positions is None else positions[row]
            words[row] = token_ids[p]
            words[m + row] = p
            words[2 * m + row] = table[p // bs] * bs + p % bs
            words[3 * m + row] = p + 1
            max_context = max(max_context, p + 1)
            written, count = written_tables[row]
            if written is not table:
                tables[row, :len(table)] = table
                written_tables[row] = (table, len(table))
            elif count != len(table):
                tables[row, count:len(table)] = table[count:]
                written_tables[row] = (table, len(table))
        padded = self._bucket_of[n] if self._graphs else n
        if self.is_cuda:
            if padded > n:
                _, positions, slots, context_lens = self._host_columns
                positions[n:padded] = 0                        # padding rows: position 0, no K/V write
                slots[n:padded] = -1
                context_lens[n:padded] = 1
            views = self._input_views.get(padded)
            if views is None:                                  # the prefix a batch of `padded` rows uses
                used = 4 * m + padded * self.max_blocks_per_seq
                views = self._input_views[padded] = (self._inputs[:used], self._host_inputs[:used])
            views[0].copy_(views[1], non_blocking=True)
        if self._graphs:
            splits = self._splits_of[padded][tier_of(max_context, len(self._context_tiers))]
            self._graphs[padded, splits].replay()
            return self._graph_logits[:n], self._graph_argmax[:n]
        splits = decode_splits(n, self.shape.num_key_value_heads, max_context, paged_attention.sm_count(self.device))
        return self._decode_forward(n, splits), None

    @torch.inference_mode()
    def chain_tokens(self, seqs: list[Sequence], positions: list[int], last_rows: list[int], steps: int,
                     temperatures: list[float] | None = None, probs_out: torch.Tensor | None = None,
                     generator: torch.Generator | None = None, lengths: list[int] | None = None) -> list[list[int]]:
        """Tokens of `steps` forwards chained on the device, the host waiting once at the end (a
        draft proposing k tokens). The first forward is rows_logits(seqs, positions); row
        last_rows[i] gives sequence i (seqs[last_rows[i]]) its first token; each later forward
        feeds every sequence its previous token at the next position, copied on the device.
        Tokens are argmaxes, or with `temperatures` (one per sequence, > 0) draws from
        softmax(logits / T) by the exponential race, each distribution written to
        probs_out[i, step]. Every position a later step writes must have its block already.
        lengths[i]: steps sequence i needs (all when None); past them its row repeats its last
        position and writes no K or V (its tokens there are meaningless). [sequence][step] token ids."""
        m, width = self.max_num_seqs, self.max_blocks_per_seq
        n = len(last_rows)
        owners = [seqs[r] for r in last_rows]
        first = [positions[r] for r in last_rows]
        host = self._chain_staging(steps)
        columns, tables, index = host["columns"], host["tables"], host["index"]
        for j in range(1, steps):                              # every later step's inputs, written up front
            tokens, at, slots, context = columns[j].reshape(4, m)
            tokens[:] = 0
            at[:] = 0
            slots[:] = -1
            context[:] = 1
            for i, seq in enumerate(owners):
                if lengths is not None and j >= lengths[i]:
                    at[i] = first[i] + lengths[i] - 1
                    context[i] = at[i] + 1                     # slot stays -1: nothing written
                    continue
                p = first[i] + j
                at[i] = p
                slots[i] = seq.block_table[p // self.block_size] * self.block_size + p % self.block_size
                context[i] = p + 1
        for i, seq in enumerate(owners):
            tables[i, :len(seq.block_table)] = seq.block_table
        index[:n] = last_rows
        scale = None
        if temperatures is not None:
            host["inverse_temperatures"][:n] = [1.0 / t for t in temperatures]
            scale = self._chain_scale[:n]
            scale.copy_(self._chain_scale_host[:n], non_blocking=True)
        out = self._chain_tokens
        logits, argmax = self._decode(seqs, positions)
        if last_rows != list(range(len(seqs))):
            self._chain_index[:n].copy_(self._chain_index_host[:n], non_blocking=True)
            logits = logits.index_select(0, self._chain_index[:n])
            argmax = None if argmax is None else argmax.index_select(0, self._chain_index[:n])
        out[0, :n].copy_(self._chain_pick(logits, argmax, scale, probs_out, 0, generator))
        for j in range(1, steps):
            self._inputs[:4 * m].copy_(self._chain_columns[j], non_blocking=True)
            if j == 1:
                self._inputs[4 * m:4 * m + n * width].copy_(self._chain_tables[:n * width], non_blocking=True)
            self._inputs[:n].copy_(out[j - 1, :n])
            max_context = max(first) + j + 1
            if self._graphs:
                padded = self._bucket_of[n]
                self._graphs[padded, self._splits_of[padded][tier_of(max_context, len(self._context_tiers))]].replay()
                logits, argmax = self._graph_logits[:n], self._graph_argmax[:n]
            else:
                splits = decode_splits(n, self.shape.num_key_value_heads, max_context,
                                       paged_attention.sm_count(self.device))
                logits, argmax = self._decode_forward(n, splits), None
            out[j, :n].copy_(self._chain_pick(logits, argmax, scale, probs_out, j, generator))
        if not self.is_cuda:                                   # on a CPU the inputs are the host buffer itself
            self._written_tables = [(None, 0)] * m
        flat = self._read_tokens(out[:steps, :n].reshape(-1))           # step by step
        return [flat[i::n] for i in range(n)]

    @staticmethod
    def _chain_pick(logits, argmax, inverse_temperature, probs_out, step, generator) -> torch.Tensor:
        if inverse_temperature is None:
            return logits.argmax(dim=1) if argmax is None else argmax
        probs = (logits * inverse_temperature[:, None]).softmax(dim=1)
        probs_out[:, step] = probs
        return categorical(probs, generator)

    def _chain_staging(self, steps: int) -> dict:
        """Pinned host buffers of chain_tokens (each later step's four columns, the block tables,
        the first step's gather index) and its device buffers, made on first use."""
        m, width = self.max_num_seqs, self.max_blocks_per_seq
        if getattr(self, "_chain_columns", None) is None or self._chain_columns.shape[0] < steps:
            size = max(steps, 8)
            self._chain_columns = torch.zeros(size, 4 * m, dtype=torch.int32, pin_memory=self.is_cuda)
            self._chain_tables = torch.zeros(m * width, dtype=torch.int32, pin_memory=self.is_cuda)
            self._chain_index_host = torch.zeros(m, dtype=torch.int64, pin_memory=self.is_cuda)
            self._chain_index = torch.zeros(m, dtype=torch.int64, device=self.device)
            self._chain_tokens = torch.zeros(size, m, dtype=torch.int64, device=self.device)
            self._chain_scale_host = torch.zeros(m, dtype=torch.float32, pin_memory=self.is_cuda)
            self._chain_scale = torch.zeros(m, dtype=torch.float32, device=self.device)
        if self.is_cuda and self._host_tokens.numel() < steps * m:
            self._host_tokens = torch.zeros(steps * m, dtype=torch.int64, pin_memory=True)
            self._host_tokens_np = self._host_tokens.numpy()
        return {"columns": self._chain_columns.numpy(), "tables": self._chain_tables.numpy().reshape(m, width),
                "index": self._chain_index_host.numpy(), "inverse_temperatures": self._chain_scale_host.numpy()}

    def _decode_forward(self, n: int, num_splits: int | None = None, out: torch.Tensor | None = None,
                        argmax_out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits of the first n rows of the device input buffer (model.forward_logits)."""
        m = self.max_num_seqs
        inputs = self._inputs
        meta = AttentionMetadata(is_prefill=False, slot_mapping=inputs[2 * m:2 * m + n],
                                 block_tables=inputs[4 * m:].view(m, self.max_blocks_per_seq)[:n],
                                 context_lens=inputs[3 * m:3 * m + n], num_splits=num_splits)
        return self.model.forward_logits(inputs[:n], inputs[m:m + n], meta, out=out, argmax_out=argmax_out)

    # -------------------------------------------------------------------------- one-sequence prefill graphs
    def _prefill_graph_fits(self, seqs: list[Sequence]) -> bool:
        return (len(seqs) == 1 and bool(self._prefill_graphs)
                and seqs[0].num_tokens <= self._prefill_sizes[-1])

    def _prefill_replay(self, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, argmax) of `seq`'s last token after a graph prefill of all its tokens, padded
        at the tail to the smallest bucket holding them. Views of the graphs' output buffers."""
        n = seq.num_tokens
        size = next(s for s in self._prefill_sizes if s >= n)
        ids, positions, slots, last_row = self._prefill_host_columns
        ids[:n] = seq.token_ids
        positions[:n] = np.arange(n, dtype=np.int32)
        slots[:n] = self._prefill_slots(seq)
        ids[n:size] = 0                                        # padding: token 0 at position 0, no K/V write
        positions[n:size] = 0
        slots[n:size] = -1
        last_row[0] = n - 1
        self._prefill_inputs.copy_(self._prefill_host_inputs, non_blocking=True)
        self._prefill_graphs[size].replay()
        return self._graph_logits[:1], self._graph_argmax[:1]

    def _prefill_buffers(self, sizes: list[int]) -> None:
        """The pinned host and device input buffers of the prefill graphs (token ids, positions,
        slots, each as long as the largest bucket, then the last real row), and each bucket's fixed
        sequence offsets [0, bucket]."""
        largest = sizes[-1]
        self._prefill_sizes = sizes
        self._prefill_host_inputs = torch.zeros(3 * largest + 1, dtype=torch.int32, pin_memory=self.is_cuda)
        host = self._prefill_host_inputs.numpy()
        host[2 * largest:3 * largest] = -1
        self._prefill_host_columns = [host[:largest], host[largest:2 * largest], host[2 * largest:3 * largest],
                                      host[3 * largest:]]
        self._prefill_inputs = self._prefill_host_inputs.to(self.device, copy=True)
        self._prefill_cu_seqlens = {size: torch.tensor([0, size], dtype=torch.int32, device=self.device)
                                    for size in sizes}

    def _prefill_graph_step(self, size: int) -> None:
        """What a prefill graph of `size` tokens replays: forward, the last real row's logits into
        row 0 of the graphs' logits buffer, its argmax."""
        largest = self._prefill_sizes[-1]
        inputs = self._prefill_inputs
        meta = AttentionMetadata(is_prefill=True, slot_mapping=inputs[2 * largest:2 * largest + size],
                                 seq_lens=[size], cu_seqlens=self._prefill_cu_seqlens[size], max_seq_len=size,
                                 logits_indices=inputs[3 * largest:])
        self.model.forward_logits(inputs[:size], inputs[largest:largest + size], meta,
                                  out=self._graph_logits[:1], argmax_out=self._graph_argmax[:1])

    def _capture_prefill_graphs(self) -> None:
        """One graph per prefill bucket, largest first, in the decode graphs' memory pool."""
        sizes = prefill_graph_sizes(self.max_num_batched_tokens, self._context_tiers[-1])
        self._prefill_buffers(sizes)
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device)
        for size in reversed(sizes):
            self._prefill_graph_step(size)                       # warm-up: flash, cuBLAS at this shape
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode=self._capture_error_mode):
                self._prefill_graph_step(size)
            self._prefill_graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.telemetry.update(prefill_graph_capture_s=time.perf_counter() - start, prefill_graph_tokens=sizes,
                              prefill_graph_extra_bytes=torch.cuda.memory_reserved(self.device) - reserved)

    # -------------------------------------------------------------------------- decode graphs
    def _capture_graphs(self) -> None:
        """One graph per (bucket, split count), largest first, sharing one memory pool; each writes
        its rows of one fp32 logits buffer and of one argmax buffer (the greedy tokens, sampled in
        the graph)."""
        sizes = graph_batch_sizes(self.max_num_seqs)
        self._graph_buffers(sizes)
        self.telemetry["kernels_per_decode_step"] = self._count_decode_kernels()
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device)
        self._graph_pool = None
        for size, splits in reversed(self._graph_keys(sizes)):
            self._graph_step(size, splits)                       # warm-up: Triton JIT, cuBLAS
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode=self._capture_error_mode):
                self._graph_step(size, splits)
            self._graph_pool = graph.pool() if self._graph_pool is None else self._graph_pool
            self._graphs[size, splits] = graph
        torch.cuda.synchronize(self.device)
        self.telemetry.update(graph_capture_s=time.perf_counter() - start, graph_batch_sizes=sizes,
                              decode_graphs=len(self._graphs), splits_by_bucket_and_tier=self._splits_of,
                              context_tiers=self._context_tiers,
                              decode_graph_extra_bytes=torch.cuda.memory_reserved(self.device) - reserved)

    def _graph_buffers(self, sizes: list[int]) -> None:
        """The bucket of every batch size, each bucket's split count per context tier, and the
        output buffers the graphs write."""
        self._bucket_of = [0] + [next(s for s in sizes if s >= n) for n in range(1, self.max_num_seqs + 1)]
        sms = paged_attention.sm_count(self.device)
        self._splits_of = {size: splits_by_tier(size, self.shape.num_key_value_heads, self._context_tiers, sms)
                           for size in sizes}
        self._graph_logits = torch.empty(self.max_num_seqs, self.shape.vocab_size, dtype=torch.float32,
                                         device=self.device)
        self._graph_argmax = torch.empty(self.max_num_seqs, dtype=torch.int64, device=self.device)

    def _graph_keys(self, sizes: list[int]) -> list[tuple[int, int]]:
        """(bucket, split count) of every decode graph, smallest first."""
        return [(size, splits) for size in sizes for splits in sorted(set(self._splits_of[size]))]

    def _graph_step(self, size: int, num_splits: int | None = None) -> None:
        """What a graph of `size` rows replays: forward, logits into the buffer, their argmax."""
        self._decode_forward(size, num_splits, out=self._graph_logits[:size], argmax_out=self._graph_argmax[:size])

    # -------------------------------------------------------------------------- one step, timed alone
    @torch.inference_mode()
    def time_decode_step(self, context_tokens: int, reps: int = 20, allreduce: bool = True) -> float:
        """Milliseconds of one batch-1 decode step whose token attends over `context_tokens` cached
        tokens (blocks 0, 1, ... of the pool; it writes no K or V): its CUDA graph replayed `reps`
        times back to back and timed by CUDA events (no host work between steps), or eager forwards
        timed by perf_counter without graphs. allreduce=False: the tensor-parallel all-reduces are
        skipped (a graph captured for the purpose: its numbers are wrong, its time is the rest of
        the step). With tensor parallelism every rank calls it at once, between requests."""
        m, bs = self.max_num_seqs, self.block_size
        blocks = -(-context_tokens // bs)
        if blocks > min(self.max_blocks_per_seq, self.num_kv_blocks):
            raise LabError(f"a decode step over {context_tokens} tokens needs {blocks} KV blocks; "
                           f"the runner has {min(self.max_blocks_per_seq, self.num_kv_blocks)} for a sequence")
        host = self._host_inputs_np
        host[0], host[m], host[2 * m], host[3 * m] = 1, context_tokens - 1, -1, context_tokens
        self._host_block_tables[0, :blocks] = np.arange(blocks, dtype=np.int32)
        self._written_tables[0] = (None, 0)                 # the next real step rewrites row 0's table
        if self.is_cuda:
            self._inputs.copy_(self._host_inputs)
        skip = self.tp is not None and not allreduce
        if skip:
            self.tp.noop = True
        try:
            if self._graphs:
                bucket = self._bucket_of[1]
                splits = self._splits_of[bucket][tier_of(context_tokens, len(self._context_tiers))]
                graph = self._graphs[bucket, splits]
                if skip:
                    self._graph_step(bucket, splits)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode=self._capture_error_mode):
                        self._graph_step(bucket, splits)
                return self._time(graph.replay, reps)
            splits = decode_splits(1, self.shape.num_key_value_heads, context_tokens,
                                   paged_attention.sm_count(self.device))
            return self._time(lambda: self._decode_forward(1, splits), reps)
        finally:
            if skip:
                self.tp.noop = False

    def _time(self, fn, reps: int) -> float:
        """ms per call of `fn`, `reps` calls back to back after one, every rank starting together."""
        fn()
        if self.tp is not None:
            self.tp.line_up()
        elif self.is_cuda:
            torch.cuda.synchronize(self.device)
        if not self.is_cuda:
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - start) * 1e3 / reps
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / reps

    def _count_decode_kernels(self) -> int | None:
        """GPU kernels one batch-1 decode step launches (what its graph replays, at the shortest
        context tier), counted by the profiler on an eager step; None where the profiler cannot
        see the GPU, and under tensor parallelism (a profiler failing on one rank alone would leave
        the others waiting in the step's collectives)."""
        if self.tp is not None:
            return None
        try:
            from torch.autograd import DeviceType
            from torch.profiler import ProfilerActivity, profile
            splits = self._splits_of[1][0]
            self._graph_step(1, splits)                                          # compile and warm first
            torch.cuda.synchronize(self.device)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                self._graph_step(1, splits)
                torch.cuda.synchronize(self.device)
            count = sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
            return count or None
        except Exception:                    # a profiler unavailable here: the count is optional
            return None
