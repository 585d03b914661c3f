"""Exercise 7.1: from characters to GPT-2 tokens, the 90/10 split, and why two bytes hold an id.

    lab run phase7.data_prep                       # the local copy (data.py says where it looks)
    lab run phase7.data_prep --param download=true # with internet: fetch, check hashes, split

Attention costs grow with the square of the sequence length, so characters per token matters
twice: the record stores the ratio and its square. The split is 90/10 on the *token stream* (the
seed's choice); nanoGPT's split of the *characters* is recorded beside it. Every id is below
2^16, so uint16 stores it: half the bytes of int32, a quarter of int64.

Checks (gating the `tokenize` row): the token count equals the seed write-up's; decoding gives
back the text byte for byte; the stored .u16 split equals a fresh tokenization.
"""
import time
from pathlib import Path

import numpy as np

from common.exercise import Exercise, Needs, Result, row
from common.params import Bool, Folder
from common.standalone import run_alone

from . import data as D
from . import seed
from .train import clean


def _check(passed: bool, reference: str, reason: str | None, err=None) -> dict:
    return {"reference": reference, "metric": "exact", "precision": None, "tolerance": 0,
            "rel_l2_error": None, "max_abs_error": err, "passed": passed, "reason": None if passed else reason}


def run(ctx, params):
    if params.get("download"):
        data_dir = D.download(Path(params["data_dir"]).expanduser() if params.get("data_dir") else D.SHIPPED)
    else:
        data_dir = D.resolve_data_dir(params.get("data_dir"), need=(D.TEXT, D.ENCODER, D.MERGES, D.TRAIN, D.VAL))
    hashes = D.verify(data_dir)
    text = D.read_text(data_dir)
    enc = D.encoding(data_dir)
    rows = []

    t0 = time.perf_counter()
    ids = np.asarray(enc.encode_ordinary(text), dtype=np.int64)
    tokenize_s = time.perf_counter() - t0
    train, val = D.split(ids)
    stored_train, stored_val = D.load_splits(data_dir)
    roundtrip = D.decode(ids, data_dir) == text and enc.decode(ids.tolist()) == text
    # nanoGPT's way: split the characters 90/10, then tokenize each half
    cut = int(D.TRAIN_FRACTION * len(text))
    char_split = (len(enc.encode_ordinary(text[:cut])), len(enc.encode_ordinary(text[cut:])))
    same_split = np.array_equal(train, stored_train) and np.array_equal(val, stored_val)

    if ctx.wants("tokenize"):
        problems = []
        if len(ids) != seed.DATA["tokens"]:
            problems.append(f"{len(ids):,} tokens, the seed counted {seed.DATA['tokens']:,}")
        if not roundtrip:
            problems.append("decode(encode(text)) != text")
        if not same_split:
            problems.append("the stored .u16 split differs from a fresh tokenization")
        check = _check(not problems, "the seed's 338,025 tokens; the text itself; the stored split",
                       "; ".join(problems), err=abs(len(ids) - seed.DATA["tokens"]))
        metrics = {
            "chars": len(text), "bytes": len(text.encode()), "distinct_chars": len(set(text)),
            "tokens": int(len(ids)), "vocab_size": enc.n_vocab, "distinct_tokens_used": int(len(np.unique(ids))),
            "max_token_id": int(ids.max()), "chars_per_token": len(text) / len(ids),
            # attention is O(T^2): the same text as tokens instead of characters
            "attention_cost_ratio_chars_over_tokens": (len(text) / len(ids)) ** 2,
            "split": "token stream, first 90% train (as the seed)",
            "train_tokens": int(len(train)), "val_tokens": int(len(val)),
            "char_split_train_tokens": char_split[0], "char_split_val_tokens": char_split[1],
            "roundtrip_exact": roundtrip, "stored_split_matches": same_split,
            "tokenize_s": tokenize_s, "tokenizer_tokens_per_s": len(ids) / tokenize_s,
            "tokenizer": "tiktoken GPT-2 BPE built from the local encoder.json (no network)",
        }
        rows.append(row("tokenize", {"data_dir": D.label_of(data_dir)}, "ok" if check["passed"] else "failed",
                        check["reason"], check=check, metrics=metrics))

    if ctx.wants("storage"):
        n = len(stored_train) + len(stored_val)
        fits = int(max(stored_train.max(), stored_val.max())) < 2**16
        on_disk = sum((data_dir / name).stat().st_size for name in (D.TRAIN, D.VAL))
        check = _check(fits and on_disk == 2 * n, "2 bytes per token id, every id < 65,536",
                       f"{on_disk} bytes on disk for {n} tokens")
        metrics = {"tokens": n, "bytes_uint16": 2 * n, "bytes_int32": 4 * n, "bytes_int64": 8 * n,
                   "bytes_on_disk": on_disk, "uint16_over_int32": 0.5, "uint16_over_int64": 0.25,
                   "max_token_id": int(max(stored_train.max(), stored_val.max())), "uint16_max": 2**16 - 1,
                   "headroom_ids": 2**16 - D.VOCAB_SIZE}
        rows.append(row("storage", {"format": "raw little-endian uint16"}, "ok" if check["passed"] else "failed",
                        check["reason"], check=check, metrics=metrics))
    summary = {"sha256": hashes, "data_dir": D.label_of(data_dir), "seed": seed.DATA, "seed_citation": seed.CITATION}
    return Result(clean(rows), clean(summary))


def footprint_bytes(p: dict) -> int:
    """No device tensors: tokenizing and splitting run on the host; a few MB as a margin."""
    return 4 * 2**20


EXERCISE = Exercise(
    id="phase7.data_prep", title="TinyShakespeare -> GPT-2 BPE tokens: counts, split, uint16 storage",
    run=run, needs=Needs(modules=("tiktoken",)), params={"data_dir": Folder(None, must_exist=False), "download": Bool(False)},
    variants=("tokenize", "storage"), footprint_bytes=footprint_bytes)


if __name__ == "__main__":
    run_alone(EXERCISE, {})
