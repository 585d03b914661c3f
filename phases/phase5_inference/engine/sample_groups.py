"""n samples of one prompt (OpenAI's and vLLM's `n`): the samples share the prompt's KV blocks.

The first sample admitted prefills the prompt; the others wait while it does, then share its full
prompt blocks (reference counts in kv_cache.BlockPool) and prefill only the prompt's tail: the
tokens from the last token's block on (1 to block_size tokens). The tail is recomputed rather than
its block copied: each sample writes only into blocks it holds alone (a shared block is never
written again), and each computes the logits of the prompt's last token itself, so its first token
comes from its own sampling stream and the runner and sampler know nothing of groups. A prompt of
m * block_size + 1 tokens makes the tail one token.

Sample i of a seeded request draws from seed + i (mod 2**63): vLLM's rule for n, and the server's.
"""
from .sequence import Sequence, SequenceStatus


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample `index` of a request seeded with `seed` (None stays None)."""
    return None if seed is None else (seed + index) % 2**63


class SampleGroup:
    """The live samples of one prompt, named by the caller's key (e.g. a server request and prompt)."""

    def __init__(self, key: str, prompt_token_ids: list[int]):
        self.key = key
        self.prompt = tuple(prompt_token_ids)
        self.members: list[Sequence] = []

    def shared_blocks(self, seq: Sequence, block_size: int) -> list[int] | None:
        """The prompt blocks `seq` may share with a running sibling whose keys and values of them
        are written ([] when no sibling can give them: `seq` prefills alone), or None: wait, a
        sibling is prefilling the prompt now (the blocks are written by the end of its prefill)."""
        full = (seq.num_prompt_tokens - 1) // block_size        # never the last prompt token's block
        if full == 0 or seq.params.prompt_logprobs is not None:  # prompt logprobs need every position
            return []
        prefilling = False
        for sibling in self.members:
            if sibling is seq or sibling.status is not SequenceStatus.RUNNING:
                continue
            if sibling.num_cached_tokens >= full * block_size:
                return sibling.block_table[:full]
            prefilling = True
        return None if prefilling else []
