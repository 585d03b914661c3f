"""How well the summed prediction (common/workload.py) does against the one-roof one, from records:
the figures per GPU and phase and the rows the sum misses most, with the kernels it thinks dominate.

The rows are the accuracy tables' own (`accuracy.counted`: the fastest ok variant per problem in the
newest measured record of each exercise and GPU, lessons excluded, with common/workload_rows.py's
`summed.*` columns). The README's accuracy tables show the same figures (`lab report`).

    python -m common.workload_accuracy [--results DIR] [--worst N] [--launch-as-roof]

Torch-free, like the report.
"""
import argparse
from pathlib import Path

import pandas as pd

from . import accuracy, render
from .paths import results_dir
from .records import is_smoke, load_records
from .report import frame_of
from .workload_rows import add_columns

CODE_ROOT = Path(__file__).resolve().parents[1]


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


def misses(rows: pd.DataFrame, worst: int = 8, phase: int | None = None) -> pd.DataFrame:
    """The rows the summed model misses most (factor max(r, 1/r)), per GPU (of one phase when
    given), with the kernels the sum puts the time in."""
    got = rows[rows["summed.measured_over_predicted"].notna()].copy()
    if phase is not None:
        got = got[got["phase"] == phase]
    got["factor"] = got["summed.measured_over_predicted"].astype(float).map(lambda x: max(x, 1 / x))
    got["top"] = got["summed.top"].map(lambda top: "; ".join(
        f"{t['kernel']} {100 * t['share']:.0f}% ({t['bound']})" for t in top) if isinstance(top, list) else "-")
    got = got.sort_values("factor", ascending=False)
    return got.groupby("hardware", sort=True).head(worst)[
        ["hardware", "exercise", "variant", "_ms", "calibrated.predicted_ms", "summed.predicted_ms",
         "summed.measured_over_predicted", "summed.bound", "top"]]


def counted_rows(results: str | None = None, launch_adds: bool = True) -> pd.DataFrame:
    """The accuracy's counted rows of the committed records, with `summed.*` columns (recomputed
    with each launch floor as a third roof when `launch_adds` is False)."""
    folder = results_dir(results)
    records = [r for r in load_records(folder) if not is_smoke(r)]
    view = render.View(frame_of(records), CODE_ROOT / "README.md", folder)
    rows = accuracy.counted(view)
    if launch_adds or not len(rows):
        return rows
    return add_columns(rows.drop(columns=[c for c in rows if c.startswith("summed.")]), records, launch_adds=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m common.workload_accuracy", description=__doc__.split("\n")[0])
    p.add_argument("--results", help="results folder (default: results/)")
    p.add_argument("--launch-as-roof", action="store_true",
                   help="each kernel's launch floor as a third roof (max) instead of added to its work")
    p.add_argument("--worst", type=int, default=8, help="rows the sum misses most, per GPU (default 8)")
    p.add_argument("--phase", type=int, help="the worst rows of this phase only")
    args = p.parse_args(argv)
    rows = counted_rows(args.results, launch_adds=not args.launch_as_roof)
    pd.set_option("display.width", 250)
    pd.set_option("display.max_columns", 20)
    print(figures(rows).to_string(index=False, float_format=lambda x: f"{100 * x:.1f}%"))
    print()
    print(misses(rows, args.worst, args.phase).to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
