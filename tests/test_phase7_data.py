"""Phase 7 data: offline tokenization of the TinyShakespeare that ships in data/, hashes, the split,
the data path. Nothing here reads outside the repository."""
import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

from common.errors import LabError, Skip
from common.paths import absolute_paths
from phases.phase7_gpt import data as D

SHIPPED = Path(__file__).resolve().parent.parent / "data"
HAS_TIKTOKEN = importlib.util.find_spec("tiktoken") is not None
needs_tiktoken = pytest.mark.skipif(not HAS_TIKTOKEN, reason="tiktoken is not installed (pip install tiktoken): "
                                                             "it belongs in the test extras")


@pytest.fixture(scope="module")
def shared() -> Path:
    """The repository's own data/ folder: it must be there (it is committed), never skipped."""
    assert all((SHIPPED / name).is_file() for name in D.FILES), "data/ is missing files: restore it with git"
    return SHIPPED


@needs_tiktoken
def test_offline_tokenization_gives_the_seeds_count(shared):
    enc = D.encoding(shared)
    text = D.read_text(shared)
    ids = enc.encode_ordinary(text)
    assert len(text) == 1_115_394
    assert len(ids) == 338_025
    assert max(ids) == 50_255 and enc.n_vocab == 50_257
    assert enc.decode(ids) == text


@needs_tiktoken
def test_stored_split_is_the_token_stream_split_of_a_fresh_tokenization(shared):
    ids = np.asarray(D.encoding(shared).encode_ordinary(D.read_text(shared)))
    train, val = D.split(ids)
    assert (len(train), len(val)) == (304_222, 33_803)
    stored_train, stored_val = D.load_splits(shared)
    assert stored_train.dtype == np.dtype("<u2")
    assert np.array_equal(stored_train, train) and np.array_equal(stored_val, val)


def test_pure_python_decoder_inverts_the_split(shared):
    train, val = D.load_splits(shared)
    text = D.read_text(shared)
    assert D.decode(np.concatenate([train, val]), shared) == text      # no tokenizer library involved


def test_uint16_round_trip_and_range():
    ids = [0, 1, 50_256, 65_535]
    assert D.to_u16(ids).tobytes() == np.array(ids, dtype="<u2").tobytes()
    with pytest.raises(ValueError):
        D.to_u16([65_536])


def test_every_file_matches_its_hash(shared):
    assert set(D.verify(shared)) == set(D.FILES)


def test_a_damaged_file_is_refused(shared, tmp_path):
    shutil.copytree(shared, tmp_path / "data")
    target = tmp_path / "data" / D.VAL
    target.chmod(0o644)
    blob = bytearray(target.read_bytes())
    blob[10] ^= 1
    target.write_bytes(bytes(blob))
    with pytest.raises(LabError, match="sha256"):
        D.verify(tmp_path / "data", (D.VAL,))


def test_data_dir_precedence(shared, tmp_path, monkeypatch):
    monkeypatch.delenv("LAB_DATA_DIR", raising=False)
    explicit = tmp_path / "explicit"
    shutil.copytree(shared, explicit)
    monkeypatch.setenv("LAB_DATA_DIR", str(shared))
    assert D.resolve_data_dir(str(explicit)) == explicit                 # --param beats the environment
    assert D.resolve_data_dir(None) == shared                            # then LAB_DATA_DIR
    monkeypatch.setenv("LAB_DATA_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(LabError, match="LAB_DATA_DIR"):                   # named but empty: no fall-through
        D.resolve_data_dir(None)
    with pytest.raises(LabError, match="data_dir"):
        D.resolve_data_dir(str(tmp_path / "nowhere"))


def test_missing_data_is_a_reason_to_skip(tmp_path, monkeypatch):
    monkeypatch.delenv("LAB_DATA_DIR", raising=False)
    monkeypatch.setattr(D, "SHIPPED", tmp_path / "repo" / "data")
    with pytest.raises(Skip) as exc:
        D.resolve_data_dir(None)
    msg = str(exc.value)
    assert "\n" not in msg and "<repo>/data has no" in msg and "data_dir" in msg


def test_labels_never_hold_absolute_paths(tmp_path):
    for p in (tmp_path, D.REPO_ROOT / "data", tmp_path / "elsewhere" / "data"):
        assert not absolute_paths(D.label_of(p))


@needs_tiktoken
def test_download_checks_hashes_and_derives_the_split(shared, tmp_path, monkeypatch):
    """The download path with the network replaced by the shared files (no socket is opened)."""
    by_url = {url: (shared / name).read_bytes() for name, url in D.URLS.items()}
    monkeypatch.setattr(D, "_fetch", lambda url, timeout=60.0: by_url[url])
    dest = D.download(tmp_path / "fresh")
    assert set(D.verify(dest)) == set(D.FILES)                          # including the derived .u16 split

    by_url[D.URLS[D.TEXT]] = b"not shakespeare"
    with pytest.raises(LabError, match="sha256"):
        D.download(tmp_path / "other")
