"""How well the summed prediction (common/workload.py) does against the one-roof one, from records.

The rows are the accuracy tables' own (`accuracy.counted`: the fastest ok variant per problem in the
newest measured record of each exercise and GPU, lessons excluded). A row whose exercise has a
kernel list (`phases/<phase>/kernel_lists.py`'s `row_workload(row)`) gets `summed.*` columns: the
sum of its kernels at the ceilings of the same machine recorded no later than it (`ceilings_for`),
never fitted to it. Rows without one keep only their one-roof prediction.

    python -m common.workload_accuracy [--results DIR]    prints the figures per GPU and phase

Torch-free, like the report.
"""
import argparse
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
    return predicted(r, build, ceilings, specs, measured, launch_adds) if build and ceilings and measured else None


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


def attach(exercise_id: str, rows: list[dict], ceilings: dict | None, spec) -> None:
    """At run time (common/runner.py): `prediction.summed` on every ok row of an exercise with a
    kernel list, from this machine's ceilings record; nothing when there is none (the report then
    computes it from the row's params, as it does the calibrated one). A GPU only: the exp rate's
    fallback is a GPU's spec sheet."""
    build = builders().get(exercise_id)
    if build is None or not ceilings or spec is None:
        return
    for row in rows:
        if row.get("status") != "ok" or not isinstance(row.get("prediction"), dict):
            continue
        flat = {"exercise": exercise_id, "variant": row["variant"], "hardware": spec.key}
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


def _err(x) -> float:
    return abs(float(x) - 1)


def figures(rows: pd.DataFrame) -> pd.DataFrame:
    """Per GPU and phase: rows, rows with a kernel list, and median abs(measured / predicted - 1) of
    the one-roof prediction and of the summed one (one-roof where a row has no kernel list), over
    all rows and over the rows the sum covers."""
    out = []
    for (hw, phase), g in rows.groupby(["hardware", "phase"], sort=True):
        one = g["calibrated.measured_over_predicted"].map(_err)
        has = g["summed.measured_over_predicted"].notna()
        after = g["summed.measured_over_predicted"].where(has, g["calibrated.measured_over_predicted"]).map(_err)
        out.append({"hardware": hw, "phase": phase, "rows": len(g), "covered": int(has.sum()),
                    "one_roof_err": one.median(), "summed_err": after.median(),
                    "covered_one_roof_err": one[has].median() if has.any() else None,
                    "covered_summed_err": after[has].median() if has.any() else None})
    return pd.DataFrame(out)


def misses(rows: pd.DataFrame, worst: int = 8) -> pd.DataFrame:
    """The rows the summed model misses most (factor max(r, 1/r)), per GPU."""
    got = rows[rows["summed.measured_over_predicted"].notna()].copy()
    got["factor"] = got["summed.measured_over_predicted"].astype(float).map(lambda x: max(x, 1 / x))
    got = got.sort_values("factor", ascending=False)
    return got.groupby("hardware", sort=True).head(worst)[
        ["hardware", "exercise", "variant", "_ms", "calibrated.predicted_ms", "summed.predicted_ms",
         "summed.measured_over_predicted", "summed.bound"]]


def counted(view, phases: tuple[int, ...] | None = None) -> pd.DataFrame:
    """accuracy.counted(view, phases) with `summed.*` columns: what a README table or goal reads
    (cached on the frame, as accuracy.counted is)."""
    from . import accuracy
    cache = view.frame.__dict__.setdefault("_counted_summed", {})
    if phases not in cache:
        rows = accuracy.counted(view, phases)
        cache[phases] = add_columns(rows, view.frame.records) if len(rows) else rows
    return cache[phases]


def goal_rows(view, phases: tuple[int, ...], label: str) -> pd.DataFrame:
    """One row per GPU, shaped like accuracy.goal_rows (metrics.*), for a Goal over the summed
    model: metrics.summed_abs_err_pct (the sum where a row has a kernel list, else its one-roof
    prediction), metrics.one_roof_abs_err_pct beside it, metrics.rows, metrics.covered_rows."""
    rows = counted(view, phases)
    if not len(rows):
        return pd.DataFrame()
    out = []
    for hw, mine in rows.groupby("hardware", sort=True):
        one = mine["calibrated.measured_over_predicted"].astype(float)
        after = mine["summed.measured_over_predicted"].where(mine["summed.measured_over_predicted"].notna(), one)
        after = after.astype(float)
        out.append({"hardware": hw, "hardware_name": mine.iloc[0]["hardware_name"], "status": "ok", "variant": label,
                    "metrics.rows": len(mine),
                    "metrics.covered_rows": int(mine["summed.measured_over_predicted"].notna().sum()),
                    "metrics.summed_abs_err_pct": 100 * (after - 1).abs().median(),
                    "metrics.one_roof_abs_err_pct": 100 * (one - 1).abs().median(),
                    "metrics.summed_worst_ratio": float(after.map(lambda x: max(x, 1 / x)).max())})
    return pd.DataFrame(out)


def counted_rows(results: str | None = None, launch_adds: bool = True) -> tuple[pd.DataFrame, list[dict]]:
    """The accuracy's counted rows of the committed records, with `summed.*` columns."""
    from . import accuracy, render
    from .paths import results_dir
    from .records import is_smoke, load_records
    from .report import frame_of
    folder = results_dir(results)
    records = [r for r in load_records(folder) if not is_smoke(r)]
    view = render.View(frame_of(records), CODE_ROOT / "README.md", folder)
    return add_columns(accuracy.counted(view), records, launch_adds), records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m common.workload_accuracy", description=__doc__.split("\n")[0])
    p.add_argument("--results", help="results folder (default: results/)")
    p.add_argument("--launch-as-roof", action="store_true",
                   help="each kernel's launch floor as a third roof (max) instead of added to its work")
    args = p.parse_args(argv)
    rows, _ = counted_rows(args.results, launch_adds=not args.launch_as_roof)
    pd.set_option("display.width", 250)
    pd.set_option("display.max_columns", 20)
    print(figures(rows).to_string(index=False, float_format=lambda x: f"{100 * x:.1f}%"))
    print()
    print(misses(rows).to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
