"""A recorded row's summed prediction (common/workload.py): its workload from its phase's kernel
list, timed as the harness timed it, at the ceilings of the same machine recorded no later than it.

A row whose exercise has a kernel list (`phases/<phase>/kernel_lists.py`'s `row_workload(row)`,
`EXERCISES` naming the exercises) gets `summed.*` columns: the sum of its kernels, never fitted to
it. Rows without one keep only their one-roof prediction. `attach` stores the block in a row at
run time; the accuracy tables (common/accuracy.py) read `add_columns`.

Torch-free, like the report.
"""
import importlib
import math
from dataclasses import replace
from pathlib import Path

import pandas as pd

from . import workload
from .calibration import ceilings_for
from .hardware import load_hardware

CODE_ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("predicted_ms", "measured_over_predicted", "bound", "top", "launches", "fallbacks", "ceilings_record")


def builders() -> dict:
    """exercise id -> row_workload(row) from every phase's kernel_lists.py, at the phase's top or in
    one of its folders (EXERCISES declares which)."""
    out = {}
    phases = CODE_ROOT / "phases"
    for path in sorted([*phases.glob("phase*/kernel_lists.py"), *phases.glob("phase*/*/kernel_lists.py")]):
        mod = importlib.import_module(".".join(path.relative_to(CODE_ROOT).with_suffix("").parts))
        out.update({ex: mod.row_workload for ex in getattr(mod, "EXERCISES", ())})
    return out


def _value(r: dict, key: str):
    v = r.get(key)
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def params_of(r: dict) -> dict:
    return {k[len("params."):]: v for k, v in r.items() if k.startswith("params.") and _value(r, k) is not None}


def summed(r: dict, records: list[dict], build=None, specs=None, launch_adds: bool = True) -> dict | None:
    """The summed prediction block of one frame row (a dict), or None (no kernel list, no ceilings):
    the one the row stored at run time (`prediction.summed`), else computed now from its params."""
    if launch_adds and isinstance(r.get("prediction.summed"), dict):
        return r["prediction.summed"]
    build = build or builders().get(r["exercise"])
    measured = _value(r, "prediction.measured_ms") or _value(r, "metrics.ms")
    ceilings = ceilings_for(records, r["hardware"], _value(r, "started"))
    if not (build and ceilings and measured):
        return None
    return predicted(with_record_params(r, records), build, ceilings, specs, measured, launch_adds)


_BY_PATH: list = [None, None]          # [the records list it was built from, path -> record]


def with_record_params(r: dict, records: list[dict]) -> dict:
    """The row with its record's whole run parameters as `record.params.*` (a seed, a limit the
    row's own params leave out, that a kernel list may need to rebuild the run) and its sibling
    rows as `record.rows` (a collective an exercise timed beside its workload rows)."""
    if _BY_PATH[0] is not records:
        _BY_PATH[:] = [records, {rec.get("_path"): rec for rec in records}]
    rec = _BY_PATH[1].get(r.get("path"))
    if not rec or not isinstance(rec.get("params"), dict):
        return r
    return {**r, **{f"record.params.{k}": v for k, v in rec["params"].items()}, "record.rows": rec.get("rows")}


def predicted(r: dict, build, ceilings: dict, specs, measured: float | None, launch_adds: bool = True) -> dict | None:
    """The summed prediction of a row (frame form: "params.n", "timing.graph_reps", ...) from these
    ceilings, or None when its builder has no workload for it."""
    w = build(r)
    if w is None:
        return None
    if str(_value(r, "timing.method") or "").startswith("cuda events"):      # the harness timed it (timing.py)
        w = as_timed(w, r, ceilings)
    spec = (specs if specs is not None else load_hardware()).get(r["hardware"])
    fp32 = spec.peak("fp32").value if spec else None
    return workload.predict(w, ceilings, fp32, measured, launch_adds=launch_adds)


def attach(exercise_id: str, rows: list[dict], ceilings: dict | None, spec, summary: dict | None = None,
           params: dict | None = None) -> None:
    """At run time (common/runner.py): `prediction.summed` on every ok row of an exercise with a
    kernel list, from this machine's ceilings record; nothing when there is none (the report then
    computes it from the row's params, as it does the calibrated one). The run's summary and whole
    parameters reach the kernel list as they do at report time (`summary.*`, `record.params.*`,
    `record.rows`: a ceiling the exercise measured before its rows, a seed). A GPU only: the exp
    rate's fallback is a GPU's spec sheet."""
    build = builders().get(exercise_id)
    if build is None or not ceilings or spec is None:
        return
    run = {**{f"summary.{k}": v for k, v in (summary or {}).items()},
           **{f"record.params.{k}": v for k, v in (params or {}).items()}, "record.rows": rows}
    for row in rows:
        if row.get("status") != "ok" or not isinstance(row.get("prediction"), dict):
            continue
        flat = {"exercise": exercise_id, "variant": row["variant"], "hardware": spec.key, **run}
        for block in ("params", "metrics", "prediction", "timing"):
            flat.update({f"{block}.{k}": v for k, v in (row.get(block) or {}).items()})
        measured = _value(flat, "prediction.measured_ms") or _value(flat, "metrics.ms")
        try:
            block = predicted(flat, build, ceilings, {spec.key: spec}, measured)
        except (KeyError, ValueError, TypeError):
            block = None                       # a row its kernel list cannot read: the report says none either
        if block is not None:
            row["prediction"]["summed"] = {**block, "computed": "at run time"}


def as_timed(w: workload.Workload, r: dict, ceilings: dict) -> workload.Workload:
    """The workload as the harness timed the row: every kernel at the graph floor under a graph replay
    (and the graph's own launch once a call when it holds one call), in L2 when the caches stayed
    warm and the working set fits (as roofline.calibrated decides)."""
    graph_reps, flush = _value(r, "timing.graph_reps"), _value(r, "timing.flush_l2")
    warm = (flush is not None and not flush) or bool(graph_reps and graph_reps > 1)
    working_set = _value(r, "params.working_set_bytes") or w.totals()["bytes"]
    w = w.timed_as(graph=bool(graph_reps), in_l2=warm and working_set <= ceilings["l2_fit_bytes"])
    if graph_reps == 1:
        w = replace(w, host=(*w.host, ("the graph's launch (one call a replay)", "launch_us", 1)))
    return w


def add_columns(rows: pd.DataFrame, records: list[dict], launch_adds: bool = True) -> pd.DataFrame:
    """`summed.*` columns for these frame rows (the accuracy's counted rows, say)."""
    build, specs = builders(), load_hardware()
    values = [summed(r, records, build.get(r["exercise"]), specs, launch_adds) if r["exercise"] in build else None
              for r in rows.to_dict("records")]
    extra = pd.DataFrame([{f"summed.{k}": (v or {}).get(k) for k in COLUMNS} for v in values], index=rows.index)
    return pd.concat([rows, extra], axis=1)
