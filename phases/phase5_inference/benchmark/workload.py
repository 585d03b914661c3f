"""Prompts for the serving and throughput exercises: random token ids of chosen lengths, seeded, as
vLLM's `random` dataset and nano-vllm's benchmark make them (no dataset, no tokenizer in the loop)."""
import random


def random_prompts(count: int, lengths: int | tuple[int, int], vocab_size: int, seed: int) -> list[list[int]]:
    """`count` prompts of `lengths` tokens (or uniform in [lo, hi]), ids drawn away from the
    vocabulary's ends (special tokens sit there in Llama 3's)."""
    rng = random.Random(seed)
    lo, hi = (lengths, lengths) if isinstance(lengths, int) else lengths
    top = max(2, vocab_size - 300)
    return [[rng.randrange(1, top) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def random_lengths(count: int, lo: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(count)]
