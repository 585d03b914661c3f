"""CudaGraphs: the runner's captured steps, their buckets and their static output buffers.

Decode: one graph per batch-size bucket (1, 2, 4, 8, 16, 24, ...) and attention split count. The
runner pads a batch up to its bucket in its decode input buffer (padded rows write nowhere, slot -1,
and attend over one token of block 0); the longest context in the batch picks a tier (up to 256,
512, 1024, ... tokens), the tier the split count, so a short context is not cut into splits that
only add partials and a combine. Each graph also takes the argmax of the logits, so a greedy batch
needs no kernel launched outside it.

Prefill: one graph per token bucket (16, 32, ..., 512) for a prefill of one sequence (the common
serving case): its tokens are padded at the tail up to the bucket (causal attention keeps the real
tokens from seeing the padding, whose slot is -1), and the logits row is gathered at the last real
token through a device index. Batches of several sequences prefill eagerly.

With tensor parallelism the graphs hold the all-reduces, captured in thread-local mode (NCCL's
watchdog thread queries events while a graph is captured). All graphs share one memory pool.
"""
import time

import numpy as np
import torch

from common.timing import count_kernels

from . import paged_attention
from .model import AttentionMetadata
from .sequence import Sequence

PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512)
SPLIT_TIER_BASE_TOKENS = 256       # decode graphs' context tiers: this, twice it, ...
DECODE_TOKENS_PER_SPLIT = 64       # a split shorter than one tile of the kernel only adds partials
DECODE_PROGRAMS_PER_SM = 4


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


class CudaGraphs:
    """The graphs of one runner (made by its `prepare`, captured only on a CUDA device with
    cuda_graphs on): `decode` replays a padded decode batch, `prefill` a one-sequence prefill;
    both return views of the shared (logits, argmax) output buffers, valid until the next replay."""

    def __init__(self, runner, max_model_len: int):
        self.runner = runner
        self.tiers = context_tiers(max_model_len)
        self.capture_error_mode = "global" if runner.tp is None else "thread_local"
        self.decode_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}   # (batch bucket, splits)
        self.splits_of: dict[int, list[int]] = {}                              # bucket -> splits per tier
        self.bucket_of: list[int] = []
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}              # token bucket -> graph
        self.prefill_sizes: list[int] = []
        self.pool = None
        self.logits = self.argmax = None

    def __bool__(self) -> bool:
        return bool(self.decode_graphs)

    # -------------------------------------------------------------------------- replay
    def decode_key(self, n: int, max_context: int) -> tuple[int, int]:
        """(bucket, split count) of the graph a batch of n rows, longest context `max_context`, replays."""
        padded = self.bucket_of[n]
        return padded, self.splits_of[padded][tier_of(max_context, len(self.tiers))]

    def decode(self, n: int, max_context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the graph of n rows (the runner's decode inputs already padded to its bucket)."""
        self.decode_graphs[self.decode_key(n, max_context)].replay()
        return self.logits[:n], self.argmax[:n]

    def fits_prefill(self, seqs: list[Sequence]) -> bool:
        return len(seqs) == 1 and bool(self.prefill_graphs) and seqs[0].num_tokens <= self.prefill_sizes[-1]

    def prefill(self, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, argmax) of `seq`'s last token after a graph prefill of all its tokens, padded
        at the tail to the smallest bucket holding them."""
        n = seq.num_tokens
        size = next(s for s in self.prefill_sizes if s >= n)
        ids, positions, slots, last_row = self._prefill_host_columns
        ids[:n] = seq.token_ids
        positions[:n] = np.arange(n, dtype=np.int32)
        slots[:n] = self.runner.prefill_slots(seq)
        ids[n:size] = 0                                        # padding: token 0 at position 0, no K/V write
        positions[n:size] = 0
        slots[n:size] = -1
        last_row[0] = n - 1
        self._prefill_inputs.copy_(self._prefill_host_inputs, non_blocking=True)
        self.prefill_graphs[size].replay()
        return self.logits[:1], self.argmax[:1]

    # -------------------------------------------------------------------------- capture
    def capture(self) -> None:
        """Every decode graph, then every prefill graph; what they took goes into runner.telemetry."""
        self._capture_decode()
        self._capture_prefill()

    def decode_step(self, size: int, num_splits: int) -> None:
        """What a decode graph of `size` rows replays: forward, logits into the buffer, their argmax."""
        self.runner.decode_forward(size, num_splits, out=self.logits[:size], argmax_out=self.argmax[:size])

    def capture_decode_step(self, size: int, num_splits: int) -> torch.cuda.CUDAGraph:
        """One decode graph (after a warm-up call: Triton JIT, cuBLAS), in the shared pool."""
        self.decode_step(size, num_splits)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=self.capture_error_mode):
            self.decode_step(size, num_splits)
        self.pool = graph.pool() if self.pool is None else self.pool
        return graph

    def decode_buffers(self, sizes: list[int]) -> None:
        """The bucket of every batch size, each bucket's split count per context tier, and the
        fp32 logits and argmax buffers the decode graphs write (the prefill graphs row 0 of them)."""
        runner = self.runner
        self.bucket_of = [0] + [next(s for s in sizes if s >= n) for n in range(1, runner.max_num_seqs + 1)]
        sms = paged_attention.sm_count(runner.device)
        self.splits_of = {size: splits_by_tier(size, runner.shape.num_key_value_heads, self.tiers, sms)
                          for size in sizes}
        self.logits = torch.empty(runner.max_num_seqs, runner.shape.vocab_size, dtype=torch.float32,
                                  device=runner.device)
        self.argmax = torch.empty(runner.max_num_seqs, dtype=torch.int64, device=runner.device)

    def decode_keys(self, sizes: list[int]) -> list[tuple[int, int]]:
        """(bucket, split count) of every decode graph, smallest first."""
        return [(size, splits) for size in sizes for splits in sorted(set(self.splits_of[size]))]

    def _capture_decode(self) -> None:
        """One graph per (bucket, split count), largest first, sharing one memory pool."""
        runner = self.runner
        sizes = graph_batch_sizes(runner.max_num_seqs)
        self.decode_buffers(sizes)
        # GPU kernels of one batch-1 decode step at the shortest tier (what its graph replays); not
        # under tensor parallelism: a profiler failing on one rank alone would hang the others
        runner.telemetry["kernels_per_decode_step"] = None if runner.tp is not None else count_kernels(
            lambda: self.decode_step(1, self.splits_of[1][0]), runner.device)
        torch.cuda.synchronize(runner.device)
        start = time.perf_counter()
        reserved = torch.cuda.memory_reserved(runner.device)
        for size, splits in reversed(self.decode_keys(sizes)):
            self.decode_graphs[size, splits] = self.capture_decode_step(size, splits)
        torch.cuda.synchronize(runner.device)
        runner.telemetry.update(graph_capture_s=time.perf_counter() - start, graph_batch_sizes=sizes,
                                decode_graphs=len(self.decode_graphs), splits_by_bucket_and_tier=self.splits_of,
                                context_tiers=self.tiers,
                                decode_graph_extra_bytes=torch.cuda.memory_reserved(runner.device) - reserved)

    def prefill_buffers(self, sizes: list[int]) -> None:
        """The pinned host and device input buffers of the prefill graphs (token ids, positions,
        slots, each as long as the largest bucket, then the last real row), and each bucket's fixed
        sequence offsets [0, bucket]."""
        largest, device = sizes[-1], self.runner.device
        self.prefill_sizes = sizes
        self._prefill_host_inputs = torch.zeros(3 * largest + 1, dtype=torch.int32, pin_memory=self.runner.is_cuda)
        host = self._prefill_host_inputs.numpy()
        host[2 * largest:3 * largest] = -1
        self._prefill_host_columns = [host[:largest], host[largest:2 * largest], host[2 * largest:3 * largest],
                                      host[3 * largest:]]
        self._prefill_inputs = self._prefill_host_inputs.to(device, copy=True)
        self._prefill_cu_seqlens = {size: torch.tensor([0, size], dtype=torch.int32, device=device) for size in sizes}

    def prefill_step(self, size: int) -> None:
        """What a prefill graph of `size` tokens replays: forward, the last real row's logits into
        row 0 of the logits buffer, its argmax."""
        largest = self.prefill_sizes[-1]
        inputs = self._prefill_inputs
        meta = AttentionMetadata(is_prefill=True, slot_mapping=inputs[2 * largest:2 * largest + size],
                                 seq_lens=[size], cu_seqlens=self._prefill_cu_seqlens[size], max_seq_len=size,
                                 logits_indices=inputs[3 * largest:])
        self.runner.model.forward_logits(inputs[:size], inputs[largest:largest + size], meta,
                                         out=self.logits[:1], argmax_out=self.argmax[:1])

    def _capture_prefill(self) -> None:
        """One graph per prefill bucket, largest first, in the decode graphs' memory pool."""
        runner = self.runner
        sizes = prefill_graph_sizes(runner.max_num_batched_tokens, self.tiers[-1])
        self.prefill_buffers(sizes)
        torch.cuda.synchronize(runner.device)
        start = time.perf_counter()
        reserved = torch.cuda.memory_reserved(runner.device)
        for size in reversed(sizes):
            self.prefill_step(size)                             # warm-up: flash, cuBLAS at this shape
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=self.capture_error_mode):
                self.prefill_step(size)
            self.prefill_graphs[size] = graph
        torch.cuda.synchronize(runner.device)
        runner.telemetry.update(prefill_graph_capture_s=time.perf_counter() - start, prefill_graph_tokens=sizes,
                                prefill_graph_extra_bytes=torch.cuda.memory_reserved(runner.device) - reserved)
