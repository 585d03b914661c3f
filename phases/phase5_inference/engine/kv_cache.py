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
from collections import OrderedDict

from .sequence import Sequence
from .shapes import LlamaShape

# cuBLAS and Triton workspaces, the caching allocator's fragmentation, CUDA graphs' pools
FIXED_RESERVE_BYTES = 1 << 30
# sampling a step's logits: fp32 logits, their softmax, a sort's values and int64 indices
SAMPLING_BYTES_PER_LOGIT = 4 + 4 + 4 + 8


class BlockPool:
    """Fixed-size blocks and a free list. Allocation is all-or-nothing for a prefill (every token
    of the sequence) and one block at a time for decode, when the next token starts a block.

    With prefix caching (nano-vllm's BlockManager): a full block is keyed by the hash of its
    tokens chained with the previous block's key, so one key names a whole prefix. Blocks carry
    reference counts; a block whose count drops to zero stays in the free list with its key and
    is reused by a later prompt with the same prefix until it is evicted, least recently freed
    first, for a new block. The key is Python's hash of a tuple of ints: deterministic across
    processes (ints are not salted, so tensor-parallel ranks agree), fast, and needs no
    dependency (xxhash is not one); a collision cannot give a wrong answer, because a hit is
    accepted only when the block's stored tokens equal the prompt's. Only full blocks are
    shared, and a prompt never matches its last token's block, so a shared block is never
    written again: every sequence writes only blocks it holds alone."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))   # first: evicted first
        self._ref_count = [0] * num_blocks
        self._key: list[int | None] = [None] * num_blocks            # a full, cached block's prefix key
        self._tokens: list[tuple | None] = [None] * num_blocks       # its tokens, to confirm a hit
        self._block_of_key: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached ones among them: they are evictable)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of_key)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -------------------------------------------------------------------------- prefix keys
    def _block_tokens(self, seq: Sequence, index: int) -> tuple:
        return tuple(seq.token_ids[index * self.block_size:(index + 1) * self.block_size])

    def prefix_keys(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The keys of `seq`'s first `num_blocks` full blocks, computed once and kept on the
        sequence (its tokens only grow)."""
        keys = seq.block_hashes
        while len(keys) < num_blocks:
            previous = keys[-1] if keys else -1
            keys.append(hash((previous, *self._block_tokens(seq, len(keys)))))
        return keys[:num_blocks]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding `seq`'s longest cached prefix of full blocks, never the block of
        its last token (that token is computed: its logits give the next one)."""
        if seq.params.prompt_logprobs is not None:
            return []                   # prompt logprobs need every prompt position's logits
        matched = []
        for index, key in enumerate(self.prefix_keys(seq, (seq.num_tokens - 1) // self.block_size)):
            block = self._block_of_key.get(key)
            if block is None or self._tokens[block] != self._block_tokens(seq, index):
                break
            matched.append(block)
        return matched

    def _new_blocks_needed(self, seq: Sequence, matched: list[int]) -> int:
        """Free-list blocks an allocation takes: fresh ones, and matched ones no one holds."""
        held = sum(1 for block in matched if self._ref_count[block] > 0)
        return self.blocks_for(seq.num_tokens) - held

    def _take_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        self._forget_key(block)
        self._ref_count[block] = 1
        return block

    def _forget_key(self, block: int) -> None:
        key = self._key[block]
        if key is not None and self._block_of_key.get(key) == block:
            del self._block_of_key[key]
        self._key[block] = self._tokens[block] = None

    def _register(self, seq: Sequence, index: int) -> None:
        """Key `seq`'s full block `index` (its K and V written this step or before)."""
        block = seq.block_table[index]
        if self._key[block] is None:
            key = self.prefix_keys(seq, index + 1)[index]
            self._key[block], self._tokens[block] = key, self._block_tokens(seq, index)
            self._block_of_key[key] = block

    # -------------------------------------------------------------------------- allocation
    def _matched(self, seq: Sequence, share_prefix: bool, sibling_blocks: list[int]) -> list[int]:
        """The blocks `seq`'s allocation shares: a sample sibling's written prompt blocks
        (sample_groups.py) or its cached prefix, whichever is longer."""
        matched = self.match_prefix(seq) if share_prefix and self.enable_prefix_caching else []
        return list(sibling_blocks) if len(sibling_blocks) > len(matched) else matched

    def can_allocate(self, seq: Sequence, reserve_blocks: int = 0, share_prefix: bool = False,
                     sibling_blocks: list[int] = ()) -> bool:
        """Room for all of `seq`'s tokens with `reserve_blocks` still free afterwards."""
        matched = self._matched(seq, share_prefix, sibling_blocks)
        return self._new_blocks_needed(seq, matched) + reserve_blocks <= len(self._free)

    def allocate(self, seq: Sequence, share_prefix: bool = False, key_blocks: bool = True,
                 sibling_blocks: list[int] = ()) -> None:
        """Blocks for every token of `seq` (a prefill: the prompt, or prompt and output on
        recompute). share_prefix (the scheduler's allocations, whose prefill runs in the same
        step) with prefix caching on: its cached prefix's blocks are shared,
        seq.num_cached_tokens says how many tokens they hold (the prefill computes the rest), and
        its other full blocks are keyed (the prefill about to run writes them; key_blocks=False:
        a chunked prefill keys only its chunk's, through cache_computed_blocks). Without it every
        token gets a fresh block and nothing is keyed (a caller that may not compute them).
        sibling_blocks: full blocks of `seq`'s prompt a running sample of the same prompt holds,
        their keys and values written: shared like a cached prefix, with or without the cache."""
        assert not seq.block_table, f"{seq} already holds blocks"
        matched = self._matched(seq, share_prefix, sibling_blocks)
        share_prefix = share_prefix and self.enable_prefix_caching
        needed = self._new_blocks_needed(seq, matched)
        if needed > len(self._free):
            raise RuntimeError(f"{seq}: needs {needed} blocks, {len(self._free)} free")
        for block in matched:
            if self._ref_count[block] == 0:
                del self._free[block]
            self._ref_count[block] += 1
        seq.block_table = matched + [self._take_free() for _ in range(self.blocks_for(seq.num_tokens) - len(matched))]
        seq.num_cached_tokens = len(matched) * self.block_size
        seq.num_sibling_tokens = seq.num_cached_tokens if sibling_blocks and matched == list(sibling_blocks) else 0
        if share_prefix and key_blocks:
            self.cache_computed_blocks(seq, seq.num_tokens)

    def can_append(self, seq: Sequence, num_tokens: int | None = None) -> bool:
        """Room for the keys and values of `seq`'s last token (a decode step writes them), or of
        its first `num_tokens` (a speculative step writes past the last token)."""
        return self.blocks_for(num_tokens or seq.num_tokens) - len(seq.block_table) <= len(self._free)

    def append(self, seq: Sequence, num_tokens: int | None = None) -> None:
        while len(seq.block_table) < self.blocks_for(num_tokens or seq.num_tokens):
            seq.block_table.append(self._take_free())

    def cache_computed_blocks(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Key `seq`'s full blocks among its first `num_tokens` (default: its num_cached_tokens,
        those whose K and V are written) not keyed yet (prefix caching only); they are keyed in
        order, so the search stops at the first keyed one from the end."""
        if not self.enable_prefix_caching:
            return
        computed = seq.num_cached_tokens if num_tokens is None else num_tokens
        for index in range(computed // self.block_size - 1, -1, -1):
            if self._key[seq.block_table[index]] is not None:
                break
            self._register(seq, index)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks `seq`'s first `num_tokens` need (a speculative step's rejected
        tokens rolled back); the table becomes a new list, so a runner that remembers which table
        it last wrote rewrites it."""
        keep = self.blocks_for(num_tokens)
        if keep < len(seq.block_table):
            self._release(seq.block_table[keep:])
            seq.block_table = seq.block_table[:keep]

    def free(self, seq: Sequence) -> None:
        """Give back all of `seq`'s blocks; its cached tokens are gone from it (a keyed block
        stays in the cache for the next prompt with its prefix until it is evicted)."""
        self._release(seq.block_table)
        seq.block_table = []
        seq.num_cached_tokens = 0

    def _release(self, blocks: list[int]) -> None:
        """Drop one reference to each of `blocks`; those left unheld go to the free list, last
        block first so that a prefix's first blocks (the most shared) are evicted last, and
        unkeyed ones (worth nothing to keep) to the front, to be taken first."""
        for block in reversed(blocks):
            self._ref_count[block] -= 1
            assert self._ref_count[block] >= 0, f"block {block} freed twice"
            if self._ref_count[block] == 0:
                self._free[block] = None
                if self._key[block] is None:
                    self._free.move_to_end(block, last=False)


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
