"""A toy arithmetic task the lab trains a small model on, and its checker: "a+b=" answered by the
digits of a + b and a newline, a and b below 10**digits (no leading zeros).

Tokens are characters: the digits 0-9 are ids 0-9, "+" 10, "=" 11, the newline 12 (the model's
EOS: an answer ends there). The vocabulary is padded to VOCAB_SIZE ids, a width every kernel of
the engine handles. Questions held out of training are drawn first, from a seeded generator, so
the training lines never contain one of them.
"""
import random

import numpy as np

from ..engine import LlamaShape

PLUS, EQUALS, NEWLINE = 10, 11, 12
VOCAB_SIZE = 64
CHARS = {**{str(d): d for d in range(10)}, "+": PLUS, "=": EQUALS, "\n": NEWLINE}
MAX_POSITIONS = 128


def encode(text: str) -> list[int]:
    return [CHARS[c] for c in text]


def decode(ids: list[int]) -> str:
    names = {v: k for k, v in CHARS.items()}
    return "".join(names.get(i, "?") for i in ids)


def arithmetic_llama(name: str, hidden: int, layers: int, heads: int, head_dim: int, kv_heads: int) -> LlamaShape:
    """A Llama shape over the task's vocabulary, EOS the newline."""
    return LlamaShape(name=name, vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=MAX_POSITIONS, rope_theta=10_000.0,
                      tie_word_embeddings=True, rope_scaling=None, bos_token_id=None, eos_token_id=NEWLINE)


def line(a: int, b: int) -> str:
    return f"{a}+{b}={a + b}\n"


def prompt_ids(a: int, b: int) -> list[int]:
    """The question as the model sees it in training: after a newline, "a+b="."""
    return encode(f"\n{a}+{b}=")


def split(digits: int, questions: int, train_lines: int, val_lines: int, seed: int):
    """(held-out questions [(a, b)], train ids, validation ids): the questions first, then lines of
    other pairs (uint16 token streams, the layout train_llama reads)."""
    rng = random.Random(seed)
    top = 10 ** digits
    held = set()
    while len(held) < min(questions, top * top // 2):
        held.add((rng.randrange(top), rng.randrange(top)))

    def lines(count: int) -> np.ndarray:
        out = []
        while len(out) < count:
            a, b = rng.randrange(top), rng.randrange(top)
            if (a, b) not in held:
                out.append(line(a, b))
        return np.array(encode("".join(out)), dtype=np.uint16)

    return sorted(held), lines(train_lines), lines(val_lines)


def answer_of(output_ids: list[int]) -> str | None:
    """The answer a sample gave: its digits up to the newline, or None (no newline, or not digits)."""
    if NEWLINE not in output_ids:
        return None
    text = decode(output_ids[:output_ids.index(NEWLINE)])
    return text if text.isdigit() else None


def grade(a: int, b: int, samples: list[list[int]]) -> dict:
    """The checker over one question's samples: how many are right, pass@n (any right) and the
    majority vote (the most frequent answer among those given, ties to the first given)."""
    right = str(a + b)
    answers = [answer_of(s) for s in samples]
    given = [x for x in answers if x is not None]
    votes = {}
    for x in given:
        votes[x] = votes.get(x, 0) + 1
    majority = max(votes, key=votes.get) if votes else None      # dicts keep order: ties go to the first given
    return {"correct": sum(x == right for x in answers), "pass": right in answers, "majority": majority == right}
