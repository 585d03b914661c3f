"""Result records: one JSON file per run of an exercise, validated, written atomically, never rewritten.

Layout: results/phaseN/<exercise>/<hardware-key>/<UTC stamp>_<commit7>[-dirty].json

A record holds the run's rows (one per variant and size), each with its correctness check, timing,
metrics (units in the names) and roofline prediction; and, once per run, the hardware, software,
provenance and cost blocks.
"""
import json
import os
import re
import tempfile
from pathlib import Path

from .errors import RecordError
from .paths import absolute_paths

# 2: provenance.commit is a full 40-character id (or null), computed from the lab's own checkout.
# Records of version 1 stay valid under version 1's rules: records are never rewritten.
SCHEMA_VERSION = 2
SCHEMA_VERSIONS = (1, 2)
STATUSES = ("ok", "failed", "skipped")
REQUIRED = {
    "schema_version": int, "exercise": dict, "status": str, "reason": (str, type(None)),
    "params": dict, "rows": list, "summary": dict, "source": dict, "hardware": dict,
    "software": dict, "provenance": dict, "cost": dict,
}
ROW_REQUIRED = {"variant": str, "params": dict, "status": str, "reason": (str, type(None)),
                "check": (dict, type(None)), "timing": (dict, type(None)), "metrics": dict,
                "prediction": (dict, type(None))}
SECRET_PATTERNS = [re.compile(p) for p in (r"gsk_[A-Za-z0-9]{20,}", r"sk-[A-Za-z0-9]{20,}",
                                             r"hf_[A-Za-z0-9]{20,}")]
SECRET_KEYS = re.compile(r"(api_?key|token|secret|password)$", re.IGNORECASE)


def _walk(value, where=("record",)):
    """Yield (where, key, value) for every key and item, `where` the path to its container as a
    tuple (spelled out by _where only for a problem: building every path string is the slow part)."""
    stack = [(where, value)]
    while stack:
        where, value = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(v, (dict, list)):
                stack.append(((*where, k), v))
            yield where, k, v


def _where(path: tuple) -> str:
    return "".join(p if i == 0 else (f"[{p}]" if isinstance(p, int) else f".{p}") for i, p in enumerate(path))


def problems(record: dict) -> list[str]:
    """Everything wrong with a record; empty when it is valid."""
    out = []
    for key, typ in REQUIRED.items():
        if key not in record:
            out.append(f"missing '{key}'")
        elif not isinstance(record[key], typ):
            out.append(f"'{key}' has type {type(record[key]).__name__}")
    if out:
        return out
    if record["schema_version"] not in SCHEMA_VERSIONS:
        out.append(f"schema_version {record['schema_version']} not in {SCHEMA_VERSIONS}")
    if record["status"] not in STATUSES:
        out.append(f"status '{record['status']}' not in {STATUSES}")
    ex = record["exercise"]
    if not isinstance(ex.get("id"), str) or not re.fullmatch(r"phase\d\.[a-z0-9_]+", ex.get("id", "")):
        out.append("exercise.id must look like 'phase1.elementwise'")
    if not record["hardware"].get("key"):
        out.append("hardware.key missing")
    for i, row in enumerate(record["rows"]):
        if not isinstance(row, dict):
            out.append(f"rows[{i}] is a {type(row).__name__}, not an object")
            continue
        for key, typ in ROW_REQUIRED.items():
            if key not in row:
                out.append(f"rows[{i}] missing '{key}'")
            elif not isinstance(row[key], typ):
                out.append(f"rows[{i}].{key} has type {type(row[key]).__name__}")
        if row.get("status") not in STATUSES:
            out.append(f"rows[{i}].status '{row.get('status')}' not in {STATUSES}")
        if row.get("status") == "ok" and row.get("timing") and not row.get("prediction"):
            out.append(f"rows[{i}] is timed but has no prediction")
        if row.get("status") == "failed" and row.get("timing"):
            out.append(f"rows[{i}] failed its check but carries a timing")
    commit = record["provenance"].get("commit")
    if record["schema_version"] >= 2 and commit is not None and not (isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{40}", commit)):
        out.append(f"provenance.commit '{commit}' is not a full 40-character commit id")
    for path, key, value in _walk(record):
        if isinstance(key, str) and absolute_paths(key):
            out.append(f"{_where(path)} has a key holding an absolute path")
        if isinstance(value, str):
            if value == "":
                out.append(f"{_where((*path, key))} is an empty string (use null)")
            elif absolute_paths(value):
                out.append(f"{_where((*path, key))} holds an absolute path")
            elif any(p.search(value) for p in SECRET_PATTERNS):
                out.append(f"{_where((*path, key))} looks like a secret")
            if SECRET_KEYS.search(str(key)) and value:
                out.append(f"{_where((*path, key))} may hold a secret")
    return out


def validate(record: dict) -> None:
    found = problems(record)
    if found:
        raise RecordError("invalid record: " + "; ".join(found[:5]))


def record_dir(results: Path, record: dict) -> Path:
    phase, name = record["exercise"]["id"].split(".", 1)
    return Path(results) / phase / name / record["hardware"]["key"]


def file_stem(record: dict) -> str:
    prov = record["provenance"]
    stamp = prov["started_utc"].replace("-", "").replace(":", "").split(".")[0]
    commit = (prov.get("commit") or "nogit")[:7]
    return f"{stamp}_{commit}" + ("-dirty" if prov.get("dirty") else "")


def write_record(record: dict, results: Path) -> Path:
    """Validate, then write atomically and append-only.

    The JSON goes to a temporary file in the target folder, is flushed to disk, and is then
    hard-linked to its final name: link() fails rather than replace an existing file, so a record
    is never overwritten, and a reader never sees a half-written one. On any failure the temporary
    file is removed and no record is left behind.
    """
    validate(record)
    try:
        text = json.dumps(record, indent=2, sort_keys=False, allow_nan=False) + "\n"
    except (TypeError, ValueError) as exc:
        raise RecordError(f"record is not serializable: {exc}") from None
    folder = record_dir(results, record)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)        # mkstemp makes 0600; records are ordinary files
    except OSError as exc:
        raise RecordError(f"cannot write to results folder {results}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        stem = file_stem(record)
        for n in range(1, 1000):
            final = folder / (f"{stem}.json" if n == 1 else f"{stem}-{n}.json")
            try:
                os.link(tmp, final)
                return final
            except FileExistsError:
                continue
        raise RecordError(f"too many records named {stem} in {folder}")
    except OSError as exc:
        raise RecordError(f"could not write record in {folder}: {exc.strerror}") from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def load_records(results: Path, phase: int | None = None, exercise: str | None = None,
                 hardware: str | None = None, strict: bool = False) -> list[dict]:
    """All records under results/ (oldest first), optionally filtered. Each gets a `_path` key
    (relative to results/) for linking; it is not part of the stored record.

    strict (what `lab report` uses): a file that is not valid JSON, or a record that fails the
    validator `lab run` writes with, raises RecordError naming the file; otherwise such files
    are passed over (an exercise looking up an earlier ceiling must not die on a stray file)."""
    results = Path(results)
    out = []
    for path in sorted(results.glob("phase*/*/*/*.json")):
        if path.name.startswith("."):               # a write in progress (or killed mid-way)
            continue
        rel = path.relative_to(results).as_posix()
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            if strict:
                why = (f"not valid JSON ({exc.msg} at line {exc.lineno})" if isinstance(exc, json.JSONDecodeError)
                       else exc.strerror if isinstance(exc, OSError) else "not UTF-8 text")
                raise RecordError(f"record {results.name}/{rel}: {why}") from None
            continue
        if strict:
            found = problems(rec) if isinstance(rec, dict) else ["not a JSON object"]
            if found:
                raise RecordError(f"record {results.name}/{rel} is invalid: {'; '.join(found[:3])}")
        if not isinstance(rec, dict) or not isinstance(rec.get("exercise"), dict):
            continue
        ex_id = rec["exercise"].get("id", "")
        if phase is not None and rec["exercise"].get("phase") != phase:
            continue
        if exercise is not None and ex_id != exercise:
            continue
        if hardware is not None and rec.get("hardware", {}).get("key") != hardware:
            continue
        rec["_path"] = rel
        out.append(rec)
    out.sort(key=order_key)
    return out


def is_smoke(record: dict) -> bool:
    """A `lab run --quick` record: tiny sizes and short timing, a test of the code path. It may be
    read back by the run that wrote it, but never counts as a result (no table, headline, goal,
    plot or calibration of the report uses it)."""
    return bool((record.get("provenance") or {}).get("quick"))


def order_key(record: dict) -> tuple:
    """Oldest first: by start time, then by the -N suffix a same-second record gets."""
    stem = Path(record["_path"]).stem
    m = re.search(r"-(\d+)$", stem)
    suffix = int(m.group(1)) if m and not stem.endswith("-dirty") else 1
    base = stem[: m.start()] if m and not stem.endswith("-dirty") else stem
    return ((record.get("provenance") or {}).get("started_utc") or "", Path(record["_path"]).parent.as_posix(),
            base, suffix)
