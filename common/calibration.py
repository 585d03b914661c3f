"""The calibrated prediction of every timed row in the frame, and which rows the accuracy counts.

A row recorded after its machine's `phase1.ceilings` record carries `prediction.calibrated` from
run time. An older row gets the same model at report time, from its stored FLOPs, bytes, dtype and
timing and the ceilings record of the same hardware nearest before it (`ceilings_for`); `calibrated.computed` says which. Rows
that exist as lessons or that measure a ceiling carry `prediction.excluded` (older records: the
phase's `Phase.excluded`), stay out of the accuracy figures and get no report-time prediction.
"""
import pandas as pd

from . import roofline

NEEDED = ("exercise", "started", "status", "hardware", "source", "prediction.measured_ms", "metrics.ms", "prediction.flops", "prediction.bytes",
          "prediction.dtype", "prediction.launches", "timing.flush_l2", "timing.graph_reps", "params.working_set_bytes")
COLUMNS = ("predicted_ms", "bound", "measured_over_predicted", "ceilings_record", "computed")


_HISTORY: list = [None, None]          # [the records list it was built from, the history]


def ceilings_history(records: list[dict]) -> dict:
    """hardware key -> [(started, ceilings)] of every measured ceilings record, oldest first."""
    if _HISTORY[0] is not records:           # held, so a new list can never pass for the old one
        out: dict = {}
        for rec in records:
            c = (rec.get("summary") or {}).get("ceilings") or {}
            if rec["exercise"]["id"] == "phase1.ceilings" and rec["status"] != "skipped" and c.get("hbm_gbps") \
                    and rec.get("source", {}).get("kind", "measured") == "measured":
                out.setdefault(rec["hardware"]["key"], []).append(
                    ((rec.get("provenance") or {}).get("started_utc") or "", {**c, "record": f"results/{rec.get('_path')}"}))
        _HISTORY[:] = [records, {hw: sorted(v, key=lambda x: x[0]) for hw, v in out.items()}]
    return _HISTORY[1]


def ceilings_by_hardware(records: list[dict]) -> dict:
    """hardware key -> the newest measured ceilings summary (with its record path)."""
    return {hw: history[-1][1] for hw, history in ceilings_history(records).items()}


def ceilings_for(records: list[dict], hardware: str, started: str | None) -> dict | None:
    """The ceilings a row recorded without them is predicted from: the newest ceilings record of
    the same hardware started no later than the row (the same session's, when it ran first), else
    the oldest one after it. A later ceilings run does not move an older row's prediction."""
    history = ceilings_history(records).get(hardware)
    if not history:
        return None
    before = [c for t, c in history if started and t <= started]
    return before[-1] if before else history[0][1]


def _num(r, key):
    v = r.get(key)
    return None if v is None or (isinstance(v, float) and v != v) else v


def _at_report_time(r, ceilings: dict) -> dict | None:
    measured = _num(r, "prediction.measured_ms") or _num(r, "metrics.ms")
    flops, nbytes = _num(r, "prediction.flops"), _num(r, "prediction.bytes")
    if not measured or (flops is None and nbytes is None):
        return None
    flush = _num(r, "timing.flush_l2")
    out = roofline.calibrated(flops or 0.0, nbytes or 0.0, _num(r, "prediction.dtype"), ceilings, measured,
                              working_set_bytes=_num(r, "params.working_set_bytes") or nbytes,
                              warm=flush is not None and not flush, graph_reps=_num(r, "timing.graph_reps"),
                              launches=int(_num(r, "prediction.launches") or 1))
    return {**out, "computed": "at report time, from the row's stored FLOPs and bytes"}


def add_columns(df: pd.DataFrame, records: list[dict], excluded: dict | None = None,
                calibrators: dict | None = None) -> pd.DataFrame:
    """`calibrated.*` columns for every ok row with a prediction, and `excluded` (why a row is not
    counted, or None). `excluded` maps (exercise, variant) to the reason, for records that predate
    `prediction.excluded`; `calibrators` maps an exercise to its own model (see spec.Phase)."""
    if not len(df):
        return df
    history = ceilings_history(records)
    stored = df["prediction.calibrated"] if "prediction.calibrated" in df else pd.Series([None] * len(df), index=df.index)
    reasons = df["prediction.excluded"] if "prediction.excluded" in df else pd.Series([None] * len(df), index=df.index)
    lookup = excluded or {}
    declared = [lookup.get((e, v)) for e, v in zip(df["exercise"], df["variant"])]
    why = [x if isinstance(x, str) else d for x, d in zip(reasons, declared)]
    calibrators = calibrators or {}
    own = df["exercise"].isin(list(calibrators))
    narrow = df[[c for c in NEEDED if c in df]].to_dict("records")     # iterating the wide frame is slow
    values = []
    whole = {}                                       # the full rows an own calibrator reads, per exercise
    for ex in calibrators:
        sub = df[df["exercise"] == ex]
        whole.update(zip(sub.index, sub.dropna(axis=1, how="all").to_dict("records")))
    for (i, r), cal, mine, skip in zip(enumerate(narrow), stored, own, why):
        if isinstance(cal, dict):
            values.append(cal)
        elif mine:
            values.append(calibrators[r["exercise"]](whole[df.index[i]], records)      # the row as a dict: no Series per row
                          if r["status"] == "ok" else None)
        elif r["status"] == "ok" and r["hardware"] in history and r["source"] == "measured" and not skip:
            values.append(_at_report_time(r, ceilings_for(records, r["hardware"], r.get("started"))))
        else:
            values.append(None)
    cal = pd.DataFrame([{f"calibrated.{k}": (v or {}).get(k) for k in COLUMNS} for v in values], index=df.index)
    cal["excluded"] = why
    return pd.concat([df, cal], axis=1)
