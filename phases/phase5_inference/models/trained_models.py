"""The lab's own trained Llama models for speculative decoding: a target and two drafts, their
corpora, and the checkpoint folders they are trained into once and then read from the cache.

    shakespeare-target   ~669M parameters (hidden 2048, 12 layers, GQA 16/8 heads of 128): big
                         enough that a batch-1 decode step on an H200 is bound by reading its weights
    shakespeare-draft    ~22.5M parameters (hidden 384, 2 layers, GQA 6/2 heads of 64; 19.3M of them
                         the tied embedding), same corpus: a draft that has learnt what the target
                         learnt, two layers so that its step costs a few launches
    shakespeare-distilled  the draft's shape and corpus, taught the target's distribution (the
                         target is its teacher: llama_training's distillation), as the seed's
                         matched draft (Llama 3.2 1B) learnt from its family's larger models' logits
    python-draft         the draft's shape trained on Python source: a draft that shares only the
                         vocabulary, whose proposals the target should mostly reject

All three share GPT-2's BPE (the repository ships it: data/gpt2), padded to a multiple of 64 rows
(VOCAB_SIZE; the padded ids are never a target), with <|endoftext|> as end of sequence and no BOS;
plain RoPE (theta 10,000), 2048 positions, the LM head tied to the embedding. A tied head keeps the
drafts small: their embedding is most of their weights.

Corpora: "shakespeare" is phase 7's TinyShakespeare split (data/, sha256-checked); "python" is the
top-level modules of the standard library of the interpreter running this (sources every Python
install ships, so nothing is downloaded), cut at PYTHON_CORPUS_BYTES and split 90/10 like phase 7.
The python corpus therefore depends on the Python version: its sha256 is in the cache key.

Checkpoints live in <repo>/.lab_cache/speculative/<name>-<key>/ (git-ignored), a Hugging Face folder
(config.json, model.safetensors) plus train.json (what the run measured). The key is a hash of the
shape, the training settings, the corpus's sha256 and the device type (bf16 on CUDA and fp32 on a
CPU train different weights), so a changed setting trains a new model instead of reusing an old one.

Built on phase 7: its TinyShakespeare corpus and splits (data.py).
"""
import functools
import hashlib
import json
import sys
import sysconfig
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from common.errors import LabError
from common.paths import REPO_ROOT, relative_to_repo
from phases.phase7_gpt import data as D

from ..engine import LlamaShape, tensor_shapes
from .llama_training import CONFIG, TRAIN_INFO, WEIGHTS, LlamaForTraining, TrainSettings, save_checkpoint, train_llama

VOCAB_SIZE = 50304                 # GPT-2's 50,257 ids padded to a multiple of 64
MAX_POSITIONS = 2048
ROPE_THETA = 10_000.0
PYTHON_CORPUS_BYTES = 4 * 1024 * 1024
PYTHON_SMALL_CORPUS_BYTES = 256 * 1024      # "python-small": the test-sized models' corpus
CACHE_DIR = REPO_ROOT / ".lab_cache" / "speculative"
CACHE_VERSION = 1                           # raised when training changes what a cached checkpoint holds
CORPORA = ("shakespeare", "python", "python-small")


@dataclass(frozen=True)
class TrainedModel:
    name: str
    shape: LlamaShape
    corpus: str
    settings: TrainSettings
    role: str
    teacher: str | None = None          # a MODELS name whose distribution the model is taught


def gpt2_llama(name: str, hidden: int, intermediate: int, layers: int, heads: int, head_dim: int,
               kv_heads: int) -> LlamaShape:
    """A Llama shape over the GPT-2 vocabulary, with the trained models' common settings."""
    return LlamaShape(name=name, vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=MAX_POSITIONS, rope_theta=ROPE_THETA,
                      tie_word_embeddings=True, rope_scaling=None, bos_token_id=None, eos_token_id=D.EOT)


TARGET_SHAPE = gpt2_llama("shakespeare-target", hidden=2048, intermediate=5632, layers=12, heads=16, head_dim=128,
                          kv_heads=8)
DRAFT_SHAPE = gpt2_llama("shakespeare-draft", hidden=384, intermediate=1056, layers=2, heads=6, head_dim=64,
                         kv_heads=2)
DRAFT_SETTINGS = TrainSettings(steps=300, batch_size=32, seq_len=256, lr=2e-3, warmup_steps=30)
DISTILL_SETTINGS = replace(DRAFT_SETTINGS, distill_weight=1.0)
# Test-sized models (CPU runs of phase5.speculative): the same roles, seconds to train.
TINY_TARGET = gpt2_llama("tiny-target", hidden=64, intermediate=176, layers=2, heads=2, head_dim=32, kv_heads=1)
TINY_DRAFT = gpt2_llama("tiny-draft", hidden=32, intermediate=88, layers=1, heads=1, head_dim=32, kv_heads=1)
TINY_SETTINGS = TrainSettings(steps=20, batch_size=8, seq_len=64, lr=3e-3, warmup_steps=2, eval_tokens=4096)
TINY_DISTILL_SETTINGS = replace(TINY_SETTINGS, distill_weight=1.0)

MODELS: dict[str, TrainedModel] = {m.name: m for m in (
    TrainedModel("shakespeare-target", TARGET_SHAPE, "shakespeare",
                 TrainSettings(steps=250, batch_size=16, seq_len=256, lr=3e-4, warmup_steps=25), role="target"),
    TrainedModel("shakespeare-draft", DRAFT_SHAPE, "shakespeare", DRAFT_SETTINGS, role="draft"),
    TrainedModel("shakespeare-distilled", replace(DRAFT_SHAPE, name="shakespeare-distilled"), "shakespeare",
                 DISTILL_SETTINGS, role="distilled draft", teacher="shakespeare-target"),
    TrainedModel("python-draft", replace(DRAFT_SHAPE, name="python-draft"), "python", DRAFT_SETTINGS,
                 role="off-domain draft"),
    TrainedModel("tiny-target", TINY_TARGET, "shakespeare", TINY_SETTINGS, role="target"),
    TrainedModel("tiny-draft", TINY_DRAFT, "shakespeare", TINY_SETTINGS, role="draft"),
    TrainedModel("tiny-distilled", replace(TINY_DRAFT, name="tiny-distilled"), "shakespeare", TINY_DISTILL_SETTINGS,
                 role="distilled draft", teacher="tiny-target"),
    TrainedModel("tiny-python-draft", replace(TINY_DRAFT, name="tiny-python-draft"), "python-small", TINY_SETTINGS,
                 role="off-domain draft"),
)}


# ------------------------------------------------------------------------------ corpora
def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=4)
def _python_ids(stdlib: str, max_bytes: int, data_dir: str) -> tuple[np.ndarray, np.ndarray, dict]:
    """Read, cut, encode and split the stdlib sources (seconds for 4 MiB: done once per process)."""
    files = sorted((p for p in Path(stdlib).glob("*.py") if p.is_file()), key=lambda p: p.name)
    parts, size, used = [], 0, 0
    for path in files:
        if size >= max_bytes:
            break
        blob = path.read_text(encoding="utf-8", errors="replace").encode("utf-8")
        parts.append(blob)
        size += len(blob) + (1 if used else 0)              # "\n" between files
        used += 1
    if not parts:
        raise LabError("corpus python: this interpreter's standard library has no top-level .py sources")
    raw = b"\n".join(parts)[:max_bytes]
    text = raw.decode("utf-8", errors="ignore")             # a cut inside a character drops its bytes
    raw = text.encode("utf-8")
    ids = D.to_u16(D.encoding(Path(data_dir)).encode_ordinary(text))
    train, val = D.split(ids)
    info = {"name": "python stdlib sources", "python": f"{sys.version_info.major}.{sys.version_info.minor}",
            "files": used, "bytes": len(raw), "tokens": int(len(ids)), "train_tokens": int(len(train)),
            "val_tokens": int(len(val)), "sha256": hashlib.sha256(raw).hexdigest()}
    return train, val, info


def corpus_ids(corpus: str, data_dir: str | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train, val) uint16 GPT-2 ids of a corpus and what it is (no absolute path in it).
    "shakespeare": phase 7's split; "python": the stdlib sources (module docstring)."""
    if corpus == "shakespeare":
        folder = D.resolve_data_dir(data_dir)
        hashes = D.verify(folder, (D.TRAIN, D.VAL))
        train, val = D.load_splits(folder)
        return train, val, {"name": "tinyshakespeare", "tokens": int(len(train) + len(val)),
                            "train_tokens": int(len(train)), "val_tokens": int(len(val)), "sha256": hashes}
    if corpus in ("python", "python-small"):
        folder = D.resolve_data_dir(data_dir, need=(D.ENCODER,))
        budget = PYTHON_CORPUS_BYTES if corpus == "python" else PYTHON_SMALL_CORPUS_BYTES
        train, val, info = _python_ids(str(_stdlib()), int(budget), str(folder))
        return train, val, dict(info)
    raise LabError(f"unknown corpus {corpus!r}; known: {', '.join(CORPORA)}")


# ------------------------------------------------------------------------------ the cache
def cache_key(shape: LlamaShape, settings: TrainSettings, corpus_sha256, device_type: str,
              teacher_key: str | None = None) -> str:
    blob = {"shape": shape.to_dict(), "settings": asdict(settings), "corpus": corpus_sha256, "device": device_type,
            "version": CACHE_VERSION}
    if teacher_key is not None:
        blob["teacher"] = teacher_key
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:12]


def cached_run(folder: Path, shape: LlamaShape) -> dict:
    """train.json of a complete cache folder, after checking its weights' names and sizes from the
    safetensors header (no tensor is read). FileNotFoundError for an incomplete folder; any other
    exception for a damaged one."""
    from safetensors import safe_open

    for name in (TRAIN_INFO, CONFIG, WEIGHTS):
        if not (folder / name).is_file():
            raise FileNotFoundError(name)
    stored = json.loads((folder / TRAIN_INFO).read_text())
    config = json.loads((folder / CONFIG).read_text())
    if config.get("hidden_size") != shape.hidden_size or config.get("vocab_size") != shape.vocab_size:
        raise ValueError("config.json does not match the shape")
    expected = tensor_shapes(shape)
    with safe_open(str(folder / WEIGHTS), framework="pt") as f:
        sizes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    if sizes != expected:
        raise ValueError("weights do not match the shape")
    return stored


def checkpoint(name: str, device: str | torch.device, *, data_dir: str | None = None, use_cache: bool = True,
               steps: int | None = None, progress=None) -> tuple[Path, dict]:
    """The checkpoint folder of MODELS[name] and its info: the training info (train_llama's, from
    train.json on a hit) plus model, role, params, corpus, cache_key, cache_dir (relative to the
    repository), from_cache, and cache_error when a cached folder was incomplete or unreadable and
    the model trained again. `steps` overrides the settings' (a quick run: its own cache entry).
    use_cache=False trains again even when the cache holds the run, and overwrites it (the folder
    is where the checkpoint lives). Weights are saved in bf16 on CUDA, fp32 on a CPU. A model with
    a teacher gets the teacher's checkpoint first (from the cache when there, whatever use_cache
    says: the exercise has just made it), and its key is part of the student's."""
    if name not in MODELS:
        raise LabError(f"unknown trained model {name!r}; known: {', '.join(MODELS)}")
    entry = MODELS[name]
    device = torch.device(device)
    settings = entry.settings
    if steps is not None:
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise LabError(f"steps must be a positive integer, got {steps!r}")
        settings = replace(settings, steps=steps)
    train_ids, val_ids, corpus = corpus_ids(entry.corpus, data_dir)
    teacher_folder, teacher_key = None, None
    if entry.teacher is not None:
        teacher_folder, teacher_info = checkpoint(entry.teacher, device, data_dir=data_dir, progress=progress)
        teacher_key = teacher_info["cache_key"]
    key = cache_key(entry.shape, settings, corpus["sha256"], device.type, teacher_key)
    folder = CACHE_DIR / f"{name}-{key}"
    about = {"model": name, "role": entry.role, "params": entry.shape.params(), "corpus": corpus,
             "cache_key": key, "cache_dir": relative_to_repo(folder), "teacher": entry.teacher}
    cache_error = None
    if use_cache and folder.is_dir():
        try:
            stored = cached_run(folder, entry.shape)
            return folder, {**stored, **about, "from_cache": True}
        except FileNotFoundError as exc:          # its name is a file name, never a path
            cache_error = f"incomplete (no {exc.args[0] if exc.args else 'file'}): trained again"
        except Exception as exc:  # noqa: BLE001 - a damaged cache: train again, and say so
            cache_error = f"unreadable ({type(exc).__name__}): trained again"   # no message: it may hold a path
    teacher = load_trained(teacher_folder, MODELS[entry.teacher].shape, device) if teacher_folder else None
    model, trained = train_llama(entry.shape, train_ids, val_ids, settings, device, progress=progress, teacher=teacher)
    del teacher
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    stored = {**trained, "settings": asdict(settings), "torch_dtype": str(dtype).removeprefix("torch.")}
    try:
        save_checkpoint(model, entry.shape, folder, dtype=dtype, extra={**stored, **about})
    except OSError as exc:
        raise LabError(f"{name}: could not write its checkpoint under {relative_to_repo(CACHE_DIR)} "
                       f"({exc.strerror or type(exc).__name__})") from None
    info = {**stored, **about, "from_cache": False}
    if cache_error:
        info["cache_error"] = cache_error
    return folder, info


def load_trained(folder: Path, shape: LlamaShape, device: str | torch.device) -> LlamaForTraining:
    """A checkpoint folder back in a LlamaForTraining (fp32, eval mode, on `device`): a teacher for
    distillation."""
    from safetensors.torch import load_file

    device = torch.device(device)
    with torch.device("meta"):                         # no initialization of weights about to be replaced
        model = LlamaForTraining(shape, seed=None)
    model = model.to_empty(device=device)
    model.load_state_dict({k: v.float() for k, v in load_file(str(Path(folder) / WEIGHTS), device=str(device)).items()})
    model.rope_cos, model.rope_sin = model.rope_tables(device)
    return model.eval()
