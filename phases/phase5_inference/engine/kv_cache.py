"""The paged KV cache: a pool of fixed-size blocks, each holding the keys and values of
`block_size` consecutive tokens of one sequence in every layer, handed out from a free list.

A sequence's block table (Sequence.block_table) lists its blocks in token order: token p lives in
block block_table[p // block_size] at offset p % block_size, i.e. at slot
block_table[p // block_size] * block_size + p % block_size of the flattened pool.

The pool's size follows vLLM: of `gpu_memory_utilization` x the device's memory, what the weights,
the activations of the largest step and everything else on the device leave over.

Sizing and the block pool are torch-free (the scheduler and `lab predict` use them without a GPU);
only `allocate_kv_cache` makes tensors.
"""
import math
from collections import deque

from .sequence import Sequence
from .shapes import LlamaShape

# cuBLAS and Triton workspaces, the caching allocator's fragmentation, CUDA graphs' pools
FIXED_RESERVE_BYTES = 1 << 30
# sampling a step's logits: fp32 logits, their softmax, a sort's values and int64 indices
SAMPLING_BYTES_PER_LOGIT = 4 + 4 + 4 + 8


class BlockPool:
    """Fixed-size blocks and a free list. Allocation is all-or-nothing for a prefill (every token
    of the sequence) and one block at a time for decode, when the next token starts a block."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence, reserve_blocks: int = 0) -> bool:
        """Room for all of `seq`'s tokens with `reserve_blocks` still free afterwards."""
        return self.blocks_for(seq.num_tokens) + reserve_blocks <= len(self._free)

    def allocate(self, seq: Sequence) -> None:
        """Blocks for every token of `seq` (a prefill: the prompt, or prompt and output on recompute)."""
        assert not seq.block_table, f"{seq} already holds blocks"
        needed = self.blocks_for(seq.num_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"{seq}: needs {needed} blocks, {len(self._free)} free")
        seq.block_table = [self._free.popleft() for _ in range(needed)]

    def can_append(self, seq: Sequence, num_tokens: int | None = None) -> bool:
        """Room for the keys and values of `seq`'s last token (a decode step writes them), or of
        its first `num_tokens` (a speculative step writes past the last token)."""
        return self.blocks_for(num_tokens or seq.num_tokens) - len(seq.block_table) <= len(self._free)

    def append(self, seq: Sequence, num_tokens: int | None = None) -> None:
        while len(seq.block_table) < self.blocks_for(num_tokens or seq.num_tokens):
            seq.block_table.append(self._free.popleft())

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks `seq`'s first `num_tokens` need (a speculative step's rejected
        tokens rolled back); the table becomes a new list, so a runner that remembers which table
        it last wrote rewrites it."""
        keep = self.blocks_for(num_tokens)
        if keep < len(seq.block_table):
            self._free.extend(seq.block_table[keep:])
            seq.block_table = seq.block_table[:keep]

    def free(self, seq: Sequence) -> None:
        """Give back all of `seq`'s blocks; its cached tokens are gone."""
        self._free.extend(seq.block_table)
        seq.block_table = []
        seq.num_cached_tokens = 0


# ------------------------------------------------------------------------------ sizing (torch-free)
def kv_block_bytes(shape: LlamaShape, block_size: int, bytes_per_element: int) -> int:
    """One block: K and V of `block_size` tokens in every layer."""
    return int(shape.kv_bytes_per_token(bytes_per_element)) * block_size


def activation_reserve_bytes(shape: LlamaShape, max_num_batched_tokens: int, max_num_seqs: int,
                             bytes_per_element: int) -> int:
    """Memory the largest step needs beyond weights and KV cache: a prefill of
    `max_num_batched_tokens` tokens at its widest point (the MLP holds the residual stream, the
    normed input, gate_up, the activation and the output at once), the logits of `max_num_seqs`
    sequences and what sampling them takes, plus a fixed allowance for workspaces."""
    h, i = shape.hidden_size, shape.intermediate_size
    prefill = max_num_batched_tokens * (4 * h + 3 * i) * bytes_per_element
    sampling = max_num_seqs * shape.vocab_size * (bytes_per_element + SAMPLING_BYTES_PER_LOGIT)
    return prefill + sampling + FIXED_RESERVE_BYTES


def kv_pool_blocks(total_bytes: int, gpu_memory_utilization: float, weights_bytes: int,
                   activation_reserve_bytes: int, block_bytes: int, other_bytes: int = 0) -> int:
    """How many KV blocks fit in gpu_memory_utilization x total_bytes once the weights, the
    activation reserve and `other_bytes` (the CUDA context, other processes) are counted out."""
    budget = gpu_memory_utilization * total_bytes - weights_bytes - activation_reserve_bytes - other_bytes
    return max(0, math.floor(budget / block_bytes))


# ------------------------------------------------------------------------------ the tensors
def allocate_kv_cache(shape: LlamaShape, num_blocks: int, block_size: int, dtype, device):
    """One zeroed tensor [2, layers, num_blocks, block_size, kv_heads, head_dim] and its per-layer
    (k_cache, v_cache) views, each [num_blocks, block_size, kv_heads, head_dim] and contiguous
    (paged_attention.py's layout). Zeroed so that a padded CUDA-graph row that reads a block
    nothing was written to still reads finite numbers."""
    import torch

    cache = torch.zeros(2, shape.num_hidden_layers, num_blocks, block_size, shape.num_key_value_heads,
                        shape.head_dim, dtype=dtype, device=device)
    return cache, [(cache[0, layer], cache[1, layer]) for layer in range(shape.num_hidden_layers)]
