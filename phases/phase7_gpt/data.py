"""TinyShakespeare and the GPT-2 tokenizer, offline: find the files, check their hashes, tokenize.

The files ship in `data/` (sources and licences in data/README.md). Where they are read from,
first match wins:  --param data_dir=PATH  >  $LAB_DATA_DIR  >  <repo>/data

A folder holds `tinyshakespeare/` (input.txt and the pre-tokenized split gpt2_train.u16 /
gpt2_val.u16) and `gpt2/` (OpenAI's encoder.json and vocab.bpe). Every file is checked against
its sha256 before use, so a truncated copy or a different tokenizer cannot slip into a record;
a folder without the files is a reason to skip an exercise, not a failure.

`lab run phase7.data_prep --param download=true` (or `python -m phases.phase7_gpt.data DEST`)
fetches the source files, checks the same hashes and writes the split with tiktoken: how data/
itself can be rebuilt. Training needs numpy alone (samples decode through encoder.json).
"""
import functools
import hashlib
import json
import os
import sys
import urllib.request
from pathlib import Path

import numpy as np

from common.errors import LabError, Skip
from common.paths import REPO_ROOT

# name under the data folder -> (bytes, sha256); data/README.md says where each comes from
FILES = {
    "tinyshakespeare/input.txt": (1_115_394, "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"),
    "gpt2/encoder.json": (1_042_301, "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
    "gpt2/vocab.bpe": (456_318, "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
    "tinyshakespeare/gpt2_train.u16": (608_444, "5ddd668367cf5387dc831cc9354ee854952d1cc7bfe7c56d35c0dc9f6cc4a62b"),
    "tinyshakespeare/gpt2_val.u16": (67_606, "ab74d1163cff36109ffa273552ec7ec0abfe03b81bf12a70908d36da8ee1cb54"),
}
# The canonical sources (the .u16 split is derived here, not downloaded).
URLS = {
    "tinyshakespeare/input.txt": "https://raw.githubusercontent.com/karpathy/char-rnn/"
                                 "6f9487a6fe5b420b7ca9afb0d7c078e37c1d1b4e/data/tinyshakespeare/input.txt",
    "gpt2/encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
    "gpt2/vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
}
TEXT, ENCODER, MERGES = "tinyshakespeare/input.txt", "gpt2/encoder.json", "gpt2/vocab.bpe"
TRAIN, VAL = "tinyshakespeare/gpt2_train.u16", "tinyshakespeare/gpt2_val.u16"

VOCAB_SIZE = 50257                 # GPT-2: 50,000 merges + 256 byte tokens + <|endoftext|>
EOT = 50256
TRAIN_FRACTION = 0.9               # split the *token stream* 90/10, as the seed did
# tiktoken's gpt2 (r50k) pre-tokenizer pattern; tiktoken < 0.8 cannot compile its possessive
# quantifiers and gets GPT-2's original pattern instead (both give the same ids)
PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
PATTERN_ORIGINAL = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


# ------------------------------------------------------------------------------ where
SHIPPED = REPO_ROOT / "data"


def candidates(data_dir: str | None = None) -> list[tuple[str, Path]]:
    out = []
    if data_dir:
        out.append(("--param data_dir", Path(data_dir).expanduser()))
    if os.environ.get("LAB_DATA_DIR"):
        out.append(("LAB_DATA_DIR", Path(os.environ["LAB_DATA_DIR"]).expanduser()))
    out.append(("<repo>/data", SHIPPED))
    return out


def resolve_data_dir(data_dir: str | None = None, need: tuple[str, ...] = (TRAIN, VAL)) -> Path:
    """The first folder holding the files in `need`. A folder the user named explicitly must have
    them: falling through to another copy would silently use data they did not ask for. Missing
    data is a reason to skip (Skip), never a failed run."""
    for label, path in candidates(data_dir):
        if all((path / n).is_file() for n in need):
            return path
        missing = next(n for n in need if not (path / n).is_file())
        if label != "<repo>/data":
            raise Skip(f"phase 7 data: {label} points at {label_of(path)}, which has no {missing}")
        raise Skip(f"phase 7 data: <repo>/data has no {missing} (it ships with the repository: restore it "
                   f"with git, pass --param data_dir=PATH, or fetch it with --param download=true)")
    raise AssertionError("unreachable: <repo>/data is always a candidate")


def label_of(path: Path) -> str:
    """How a data folder may appear in a record: never an absolute path."""
    path = Path(path).resolve()
    try:
        return f"<repo>/{path.relative_to(REPO_ROOT).as_posix()}"
    except ValueError:
        return f"<data_dir>/{path.name}"


# ------------------------------------------------------------------------------ hashes
@functools.lru_cache(maxsize=64)
def _sha256(path: str, size: int, mtime: float) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256(path: Path) -> str:
    st = Path(path).stat()
    return _sha256(str(path), st.st_size, st.st_mtime)


def verify(data_dir: Path, names=tuple(FILES)) -> dict:
    """name -> sha256 for each file, after checking size and hash; Skip (the data, not the code,
    is at fault) on a missing or different file."""
    out = {}
    for name in names:
        size, want = FILES[name]
        path = Path(data_dir) / name
        if not path.is_file():
            raise Skip(f"phase 7 data: {label_of(data_dir)} has no {name}")
        got = sha256(path)
        if path.stat().st_size != size or got != want:
            raise Skip(f"phase 7 data: {name} in {label_of(data_dir)} has sha256 {got[:12]}..., "
                           f"expected {want[:12]}... ({size:,} bytes): a different or damaged file")
        out[name] = got
    return out


# ------------------------------------------------------------------------------ tokenizer
def _bytes_of_unicode() -> dict[str, int]:
    """GPT-2 writes each byte as a printable character: printable bytes stand for themselves,
    the other 68 (controls, space, ...) are shifted to code points 256+ in byte order."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    table, n = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + n)] = b
            n += 1
    return table


@functools.lru_cache(maxsize=4)
def _token_bytes(data_dir: str) -> tuple[bytes, ...]:
    """id -> the bytes it stands for, from encoder.json (verified)."""
    verify(Path(data_dir), (ENCODER,))
    u2b = _bytes_of_unicode()
    table = json.loads((Path(data_dir) / ENCODER).read_text(encoding="utf-8"))
    out = [b""] * len(table)
    for tok, i in table.items():
        out[i] = tok.encode() if tok == "<|endoftext|>" else bytes(u2b[c] for c in tok)
    return tuple(out)


def decode(ids, data_dir: Path) -> str:
    """Token ids -> text, with no tokenizer library: concatenate each id's bytes, then UTF-8."""
    table = _token_bytes(str(data_dir))
    return b"".join(table[int(i)] for i in ids).decode("utf-8", errors="replace")


def encoding(data_dir: Path):
    """tiktoken's GPT-2 BPE built from the local encoder.json (README recipe C): no network,
    no cache, any tiktoken version. The BPE ranks are the encoder ids of the merged byte strings."""
    import tiktoken
    ranks = {b: i for i, b in enumerate(_token_bytes(str(data_dir))) if i != EOT}
    for pattern in (PATTERN, PATTERN_ORIGINAL):
        try:
            return tiktoken.Encoding(name="gpt2", pat_str=pattern, mergeable_ranks=ranks,
                                     special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=VOCAB_SIZE)
        except ValueError:                       # the regex did not compile in this tiktoken
            continue
    raise LabError("tiktoken could not compile the GPT-2 pre-tokenizer pattern")


def read_text(data_dir: Path) -> str:
    verify(data_dir, (TEXT,))
    return (Path(data_dir) / TEXT).read_text(encoding="utf-8")


def split(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n_train = int(TRAIN_FRACTION * len(ids))
    return ids[:n_train], ids[n_train:]


def to_u16(ids) -> np.ndarray:
    """GPT-2 ids are < 50,257 < 2^16: two bytes per token instead of four (int32) or eight (int64)."""
    arr = np.asarray(ids, dtype=np.int64)
    if len(arr) and (arr.min() < 0 or arr.max() >= 2**16):
        raise ValueError("token id outside uint16")
    return arr.astype("<u2")


# ------------------------------------------------------------------------------ the split
@functools.lru_cache(maxsize=4)
def _splits(data_dir: str) -> tuple[np.ndarray, np.ndarray]:
    verify(Path(data_dir), (TRAIN, VAL))
    train = np.fromfile(Path(data_dir) / TRAIN, dtype="<u2")
    val = np.fromfile(Path(data_dir) / VAL, dtype="<u2")
    return train, val


def load_splits(data_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) token ids as uint16 arrays (verified; cached per process)."""
    return _splits(str(data_dir))


@functools.lru_cache(maxsize=4)
def train_text(data_dir: str) -> str:
    """The characters the train split stands for: what a memorized sample would be copied from."""
    return decode(load_splits(Path(data_dir))[0], Path(data_dir))


@functools.lru_cache(maxsize=4)
def train_ngrams(data_dir: str, n: int = 8) -> frozenset:
    """Every run of n consecutive train token ids (as bytes, 2n each), for memorization checks."""
    raw = load_splits(Path(data_dir))[0].tobytes()
    return frozenset(raw[2 * i: 2 * i + 2 * n] for i in range(len(raw) // 2 - n + 1))


# ------------------------------------------------------------------------------ download
def _fetch(url: str, timeout: float = 60.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:       # noqa: S310 - fixed https URLs
        return resp.read()


def download(dest: Path) -> Path:
    """Fetch the three source files into dest (hash-checked), then derive the .u16 split.
    Files already present with the right hash are kept."""
    dest = Path(dest)
    for name, url in URLS.items():
        path = dest / name
        if path.is_file() and sha256(path) == FILES[name][1]:
            continue
        try:
            blob = _fetch(url)
        except OSError as exc:
            raise Skip(f"phase 7 data: could not download {url}: {exc}") from None
        got = hashlib.sha256(blob).hexdigest()
        if got != FILES[name][1]:
            raise LabError(f"phase 7 data: {url} gave sha256 {got[:12]}..., expected {FILES[name][1][:12]}...")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".part")
        tmp.write_bytes(blob)
        tmp.replace(path)
    write_split(dest)
    return dest


def write_split(data_dir: Path) -> None:
    """Tokenize input.txt and write the 90/10 token split as raw little-endian uint16."""
    ids = encoding(data_dir).encode_ordinary(read_text(data_dir))
    for name, part in zip((TRAIN, VAL), split(np.asarray(ids))):
        path = Path(data_dir) / name
        tmp = path.with_suffix(".part")
        to_u16(part).tofile(tmp)
        tmp.replace(path)
    verify(data_dir, (TRAIN, VAL))


if __name__ == "__main__":          # python -m phases.phase7_gpt.data DEST
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else SHIPPED
    print(f"data in {download(target)}")
