"""All rows of all records as one DataFrame, built once per report, and the queries on it.

A frame row is one result row with its record's identity beside it: `exercise`, `phase`,
`bench_version`, `hardware`, `hardware_name`, `source` (measured or quoted), `path` (relative to
results/), `order` (oldest record first), `record_status`, `l2_bytes` (the GPU's, if captured); the row's own `variant`, `status`,
`reason`; and its blocks flattened as `params.*`, `metrics.*`, `prediction.*`, `timing.*`, plus the
record's `summary.*`. Reports select with `Frame.latest()`, never by walking records.
"""
from dataclasses import dataclass

import pandas as pd

ROW_BLOCKS = ("params", "metrics", "prediction", "timing")
# Columns every exercise's rows keep even when empty (the rest of a wide frame is dropped per exercise).
ALWAYS = {"order", "exercise", "phase", "bench_version", "hardware", "hardware_name", "source", "citation", "started",
          "commit", "path", "record_status", "variant", "status", "reason", "excluded", "metrics.ms",
          "prediction.predicted_ms", "prediction.bound", "prediction.measured_over_predicted", "prediction.flops",
          "prediction.bytes", "prediction.dtype", "prediction.measured_ms", "prediction.launches"}


def _meta(order: int, rec: dict) -> dict:
    hardware = rec["hardware"]
    exercise = rec["exercise"]
    return {
        "order": order,
        "exercise": exercise["id"],
        "phase": exercise.get("phase", int(exercise["id"].split(".")[0].removeprefix("phase"))),
        "bench_version": exercise.get("bench_version", 1),
        "hardware": hardware["key"],
        "hardware_name": (hardware.get("spec") or {}).get("name") or hardware.get("name") or hardware["key"],
        "source": rec.get("source", {}).get("kind", "measured"),
        "citation": rec.get("source", {}).get("citation"),
        "started": rec["provenance"].get("started_utc"),
        "commit": rec["provenance"].get("commit"),
        "path": rec["_path"],
        "record_status": rec["status"],
        "l2_bytes": l2_bytes(hardware),
        **{f"summary.{k}": v for k, v in (rec.get("summary") or {}).items()},
    }


def l2_bytes(hardware: dict) -> float | None:
    """The GPU's L2 size as its record captured it (None on a CPU, or where not captured)."""
    mib = (hardware.get("gpu") or {}).get("l2_mib")
    return mib * 2**20 if isinstance(mib, (int, float)) else None


def build(records: list[dict]) -> pd.DataFrame:
    """One row per result row (records oldest first, as `records.load_records` gives them)."""
    flat = []
    for order, rec in enumerate(records):
        meta = _meta(order, rec)
        for r in rec["rows"]:
            item = dict(meta, variant=r["variant"], status=r["status"], reason=r.get("reason"))
            for block in ROW_BLOCKS:
                for k, v in (r.get(block) or {}).items():
                    item[f"{block}.{k}"] = v
            flat.append(item)
    return pd.DataFrame(flat)


@dataclass
class Frame:
    """The frame and the records it came from (for the few blocks that read a whole record).
    `latest()` answers are cached: treat what it returns as read-only (filter, or .copy() first)."""
    df: pd.DataFrame
    records: list[dict]

    def __post_init__(self):
        self._exercise_rows: dict | None = None
        self._latest: dict = {}

    def rows_of(self, exercise: str) -> pd.DataFrame:
        """Every row of one exercise, with the columns it has (split once: filtering the whole, wide
        frame is the slow part). A column no row of the exercise holds is absent, not NaN."""
        if self._exercise_rows is None:             # each exercise's columns only: the frame has hundreds
            self._exercise_rows = {}
            if len(self.df):
                held = self.df.notna().groupby(self.df["exercise"], sort=False).any()   # exercise x column, at once
                keep = {c for c in self.df if c in ALWAYS or c.startswith("calibrated.")}
                for ex, rows in self.df.groupby("exercise", sort=False):
                    has = held.loc[ex]
                    self._exercise_rows[ex] = rows[[c for c in rows if c in keep or has[c]]]
        return self._exercise_rows.get(exercise, self.df.iloc[0:0])

    @classmethod
    def of(cls, records: list[dict], excluded: dict | None = None, calibrators: dict | None = None) -> "Frame":
        """The frame with each timed row's calibrated prediction (common/calibration.py). Smoke
        records (`lab run --quick`) are left out here, the one door every report block goes through."""
        from .calibration import add_columns
        from .records import is_smoke
        records = [rec for rec in records if not is_smoke(rec)]
        return cls(add_columns(build(records), records, excluded, calibrators), records)

    def latest(self, exercise: str, *, since_version: int = 1, measured_only: bool = False) -> pd.DataFrame:
        """Rows of the newest non-skipped record of `exercise` per hardware and source, among records
        of bench_version >= `since_version` (a method change bumps the version; older records stay in
        results/ and drop out of the tables that need the new method), and for a named model no
        newer record measured, its newest record's rows (`newest_per_problem`). Sorted by source,
        hardware, newest record first, each record's rows in their own order."""
        key = (exercise, since_version, measured_only)
        if key not in self._latest:
            sub = self.rows_of(exercise)
            if len(sub):
                keep = (sub["record_status"] != "skipped") & (sub["bench_version"] >= since_version)
                sub = sub[keep & (sub["source"] == "measured")] if measured_only else sub[keep]
            if len(sub):
                sub = sub[newest_per_problem(sub)].sort_values(["source", "hardware", "order"],
                                                               ascending=[True, True, False], kind="stable")
            self._latest[key] = sub
        return self._latest[key]

    def record(self, path: str) -> dict:
        return next(rec for rec in self.records if rec["_path"] == path)

    def hardware_keys(self, prefix: str) -> list[str]:
        """Hardware with a measured, non-skipped record of an exercise whose id starts with `prefix`."""
        df = self.df
        if not len(df):
            return []
        sub = df[df["exercise"].str.startswith(prefix) & (df["record_status"] != "skipped") & (df["source"] == "measured")]
        return sorted(set(sub["hardware"]))


PROBLEM_KEY = "params.model"


def newest_per_problem(sub: pd.DataFrame) -> pd.Series:
    """Which rows a report keeps, per hardware and source: a row whose `params.model` names a model
    (a string: the problem it measured) comes from the newest record that measured that model, so a
    later run of fewer models leaves the others' older rows standing; every other row (a sweep's, a
    model given as a config rather than a name) from the newest record of all, as before."""
    newest = sub.groupby(["hardware", "source"])["order"].transform("max")
    if PROBLEM_KEY not in sub:
        return sub["order"] == newest
    named = sub[PROBLEM_KEY].map(lambda v: v if isinstance(v, str) else None)
    per_model = sub.assign(_model=named).groupby(["hardware", "source", "_model"])["order"].transform("max")
    return named.isna() & (sub["order"] == newest) | named.notna() & (sub["order"] == per_model)


def value(r, key: str, default=None):
    """r[key], or `default` where the row lacks it or holds NaN/None."""
    v = r.get(key, default) if hasattr(r, "get") else default
    if v is None or (isinstance(v, float) and v != v):
        return default
    return v


def ok(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"] if len(df) else df


def per_hardware(df: pd.DataFrame):
    """(hardware key, its rows) in key order."""
    if not len(df):
        return []
    return [(hw, df[df["hardware"] == hw]) for hw in sorted(set(df["hardware"]))]


def find(rows: pd.DataFrame | None, variant: str | None = None, **params):
    """The first ok row of `rows` with that variant and those params.* values, or None."""
    if rows is None or not len(rows):
        return None
    for _, r in rows.iterrows():
        if r["status"] == "ok" and (variant is None or r["variant"] == variant) and \
                all(r.get(f"params.{k}") == v for k, v in params.items()):
            return r
    return None


def by_hardware(frame: Frame, exercises: list[str]) -> dict:
    """hardware key -> {exercise: its newest measured rows}, for findings written per GPU."""
    out: dict = {}
    for ex in exercises:
        for hw, rows in per_hardware(frame.latest(ex, measured_only=True)):
            out.setdefault(hw, {})[ex] = rows
    return out
