"""common/records.py: the schema, append-only atomic writes, loading and filtering."""
import json
import os

import pytest

from common import records
from common.errors import RecordError
from common.records import file_stem, load_records, problems, record_dir, validate, write_record
from common.registry import select

SECRET = "gsk_" + "abcdefghijklmnopqrstuvwx"          # looks like a Groq key: gsk_ + 24 letters


def listing(folder):
    return sorted(os.listdir(folder)) if folder.exists() else []


# ------------------------------------------------------------------------------ validation
def test_hand_built_record_is_valid(make_record):
    rec = make_record()
    assert problems(rec) == []
    validate(rec)


def test_records_of_a_real_quick_run_are_valid(quick_records):
    assert sorted(r["exercise"]["id"] for r in quick_records) == sorted(ex.id for ex in select(["0", "1"]))
    for rec in quick_records:
        rec = {k: v for k, v in rec.items() if k != "_path"}
        assert problems(rec) == [], rec["exercise"]["id"]


@pytest.mark.parametrize("key", sorted(records.REQUIRED))
def test_missing_key(make_record, key):
    rec = make_record()
    del rec[key]
    assert f"missing '{key}'" in problems(rec)
    with pytest.raises(RecordError, match=key):
        validate(rec)


def test_wrong_type(make_record):
    assert "'rows' has type dict" in problems(make_record(rows={}))


def test_bad_status(make_record):
    assert any("status 'great'" in p for p in problems(make_record(status="great")))
    rec = make_record()
    rec["rows"][0]["status"] = "passed"
    assert any("rows[0].status 'passed'" in p for p in problems(rec))


def test_bad_schema_version_exercise_id_and_hardware_key(make_record):
    assert any("schema_version" in p for p in problems(make_record(schema_version=99)))
    rec = make_record()
    rec["exercise"]["id"] = "Elementwise"
    assert any("exercise.id" in p for p in problems(rec))
    rec = make_record()
    rec["hardware"]["key"] = None
    assert "hardware.key missing" in problems(rec)


def test_row_missing_key(make_record):
    rec = make_record()
    del rec["rows"][0]["prediction"]
    assert "rows[0] missing 'prediction'" in problems(rec)


def test_empty_string_is_rejected(make_record):
    rec = make_record()
    rec["software"]["torch"] = ""
    assert any("empty string" in p and "software.torch" in p for p in problems(rec))


@pytest.mark.parametrize("path", ["/home/someone/lab/results", "C:\\Users\\someone\\lab"])
def test_absolute_path_is_rejected(make_record, path):
    rec = make_record()
    rec["provenance"]["command"] = path
    assert any("absolute path" in p for p in problems(rec))


@pytest.mark.parametrize("value", [SECRET, "sk-" + "A1" * 12, "hf_" + "x" * 30,
                                   f"called with key {SECRET} inside"])
def test_secret_looking_value_is_rejected(make_record, value):
    rec = make_record()
    rec["summary"]["note"] = value
    assert any("looks like a secret" in p for p in problems(rec))


@pytest.mark.parametrize("key", ["api_key", "GROQ_API_KEY", "apikey", "hf_token", "password", "client_secret"])
def test_secret_named_key_is_rejected(make_record, key):
    rec = make_record()
    rec["summary"][key] = "anything"
    assert any("may hold a secret" in p for p in problems(rec))


def test_no_false_secret_alarm_on_ordinary_fields(make_record):
    rec = make_record()
    rec["summary"].update({"tokens_per_s": 123.0, "max_tokens": 64, "unit": "GB/s",
                           "api_key": None, "task": "skim the tokens"})
    assert problems(rec) == []


def test_timed_ok_row_needs_a_prediction(make_record):
    rec = make_record()
    rec["rows"][0]["prediction"] = None
    assert "rows[0] is timed but has no prediction" in problems(rec)
    rec["rows"][0]["timing"] = None                     # an untimed ok row (a gate) needs none
    assert problems(rec) == []


def test_failed_row_must_not_carry_timing(make_record):
    rec = make_record()
    rec["rows"][0]["status"] = "failed"
    rec["rows"][0]["reason"] = "relative error 1e-2 > tolerance 5e-5"
    assert "rows[0] failed its check but carries a timing" in problems(rec)


# ------------------------------------------------------------------------------ writing
def test_write_record_layout_and_content(make_record, tmp_path):
    rec = make_record()
    path = write_record(rec, tmp_path)
    assert path.parent == tmp_path / "phase1" / "elementwise" / "cpu" == record_dir(tmp_path, rec)
    assert path.name == "20261121T120000Z_0123456.json"
    assert json.loads(path.read_text()) == rec
    assert listing(path.parent) == [path.name]             # no temporary file left


def test_file_stem_dirty_and_no_git(make_record):
    rec = make_record()
    rec["provenance"].update(dirty=True)
    assert file_stem(rec) == "20261121T120000Z_0123456-dirty"
    rec["provenance"].update(commit=None, dirty=None)
    assert file_stem(rec) == "20261121T120000Z_nogit"


def test_write_is_append_only(make_record, tmp_path):
    rec = make_record()
    first = write_record(rec, tmp_path)
    before = first.read_bytes()
    rec2 = make_record(summary={"second": True})        # same stamp and commit, other content
    second = write_record(rec2, tmp_path)
    third = write_record(rec2, tmp_path)
    assert len({first, second, third}) == 3
    assert first.read_bytes() == before                  # never rewritten
    assert json.loads(second.read_text())["summary"] == {"second": True}
    assert len(listing(first.parent)) == 3


@pytest.mark.parametrize("victim", ["link", "fsync"])
def test_write_is_atomic_on_failure(make_record, tmp_path, monkeypatch, victim):
    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, victim, broken)
    rec = make_record()
    with pytest.raises(RecordError, match="No space left"):
        write_record(rec, tmp_path)
    folder = record_dir(tmp_path, rec)
    assert listing(folder) == []                         # neither a record nor a .tmp file


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), object()])
def test_unserializable_value_is_rejected_and_nothing_written(make_record, tmp_path, bad):
    rec = make_record()
    rec["rows"][0]["metrics"]["gbps"] = bad
    with pytest.raises(RecordError, match="not serializable"):
        write_record(rec, tmp_path)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_invalid_record_is_not_written(make_record, tmp_path):
    with pytest.raises(RecordError, match="invalid record"):
        write_record(make_record(status="great"), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_unwritable_results_folder(make_record, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(RecordError, match="cannot write to results folder"):
        write_record(make_record(), blocker / "sub")
    assert blocker.read_text() == "not a folder"


# ------------------------------------------------------------------------------ loading
def _rec(make_record, ex_id, hw, stamp):
    phase, name = ex_id.split(".")
    rec = make_record()
    rec["exercise"].update(id=ex_id, phase=int(phase[-1]), name=name)
    rec["hardware"]["key"] = hw
    rec["provenance"]["started_utc"] = stamp
    return rec


def test_load_records_filters_and_orders(make_record, tmp_path):
    write_record(_rec(make_record, "phase1.elementwise", "cpu", "2026-11-21T12:00:02Z"), tmp_path)
    write_record(_rec(make_record, "phase1.elementwise", "h200_sxm", "2026-11-21T12:00:01Z"), tmp_path)
    write_record(_rec(make_record, "phase1.cache_sweep", "h200_sxm", "2026-11-21T12:00:03Z"), tmp_path)
    write_record(_rec(make_record, "phase0.gates", "cpu", "2026-11-21T12:00:00Z"), tmp_path)

    every = load_records(tmp_path)
    assert [r["provenance"]["started_utc"][-3:-1] for r in every] == ["00", "01", "02", "03"]  # oldest first
    assert all(not r["_path"].startswith("/") and r["_path"].startswith("phase") for r in every)
    assert (tmp_path / every[0]["_path"]).is_file()

    assert {r["exercise"]["id"] for r in load_records(tmp_path, phase=1)} == {"phase1.elementwise",
                                                                              "phase1.cache_sweep"}
    assert [r["exercise"]["id"] for r in load_records(tmp_path, phase=0)] == ["phase0.gates"]
    assert len(load_records(tmp_path, exercise="phase1.elementwise")) == 2
    assert {r["exercise"]["id"] for r in load_records(tmp_path, hardware="h200_sxm")} == {
        "phase1.elementwise", "phase1.cache_sweep"}
    got = load_records(tmp_path, phase=1, exercise="phase1.elementwise", hardware="cpu")
    assert len(got) == 1 and got[0]["hardware"]["key"] == "cpu"
    assert load_records(tmp_path, hardware="mi300x") == []
    assert load_records(tmp_path / "nothing-here") == []


def test_load_records_ignores_corrupt_files(make_record, tmp_path):
    good = write_record(make_record(), tmp_path)
    (good.parent / "20261121T130000Z_truncated.json").write_text(good.read_text()[:100])
    (good.parent / "20261121T130001Z_list.json").write_text("[1, 2, 3]")
    (good.parent / "20261121T130002Z_other.json").write_text('{"hello": "world"}')
    (good.parent / "20261121T130003Z_empty.json").write_text("")
    got = load_records(tmp_path)
    assert [r["_path"] for r in got] == [good.relative_to(tmp_path).as_posix()]


# ------------------------------------------------------------------------------ regressions (bugs found and fixed)
@pytest.mark.parametrize("value", ["/home/someone/.ssh/id_rsa", SECRET, ""])
def test_strings_inside_lists_are_checked(make_record, value):
    rec = make_record()
    rec["rows"][0]["metrics"]["kernel_names"] = ["ok_kernel", value]
    assert problems(rec) != []


def test_a_row_that_is_not_a_dict_is_reported_not_a_crash(make_record):
    rec = make_record(rows=["not a row"])
    assert any("rows[0]" in p for p in problems(rec))


@pytest.mark.parametrize("content", [b"\xff\xfe\x00garbage", b'{"exercise": "phase1.elementwise"}'])
def test_load_records_ignores_other_corrupt_files(make_record, tmp_path, content):
    good = write_record(make_record(), tmp_path)
    (good.parent / "20261121T130003Z_corrupt.json").write_bytes(content)
    assert [r["_path"] for r in load_records(tmp_path)] == [good.relative_to(tmp_path).as_posix()]


def test_load_records_skips_temporary_files(make_record, tmp_path):
    path = write_record(make_record(), tmp_path)
    (path.parent / ".tmp-abc123.json").write_text(path.read_text())   # staged or orphaned
    assert len(load_records(tmp_path)) == 1


def test_same_second_records_load_oldest_first(make_record, tmp_path):
    write_record(make_record(summary={"run": 1}), tmp_path)
    write_record(make_record(summary={"run": 2}), tmp_path)
    assert [r["summary"]["run"] for r in load_records(tmp_path)] == [1, 2]
