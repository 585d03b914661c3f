"""The one renderer: a spec (common/spec.py) and the frame in, markdown out.

A table's rows come in groups, one per GPU and run: a bold caption names the GPU and links the
run's record ("**NVIDIA H200 SXM** · run [2026-11-28 abc1234](...)"), and the rows below it carry
only what differs between them. A timed table ends in one prediction column, measured over the
calibrated roofline with its bound ("0.97 (memory)"); the spec-sheet prediction and every column the
README leaves out are in the table's CSV, results/tables/<id>.csv, linked under it. Every goal reads
`met`, `**not met**` or `not measured`. A phase never formats these itself, so a reader learns one
layout and it holds in every README.
"""
import csv
import io
import os
from pathlib import Path

import pandas as pd

from .errors import LabError
from .formats import markdown, missing, num, pct
from .frame import Frame, ok, value
from .spec import OPS, SIGN, Goal, Goals, Plot, Table, Text

NO_RECORDS = "_No records yet: run `lab run {ex}` on a GPU, then `lab report`._"
VERDICTS = ("met", "**not met**", "not measured")
PREDICTION_HEADER = "measured / calibrated (bound)"
CSV_PREDICTION_HEADER = ["predicted ms (spec)", "predicted ms (calibrated)", "bound", "measured/predicted (spec)",
                         "measured/predicted (calibrated)", "prediction note"]
GOAL_HEADER = ["hardware", "goal", "target", "measured", "verdict", "target from"]
MAX_COLUMNS = 10
"""The most columns a README table may have: past that a reader skims instead of reads (and a
laptop screen wraps the row); the rest goes to the CSV (tests/test_report_layer.py holds every README to it)."""


class View:
    """What a block sees: the frame, and links relative to the README it is written into."""

    def __init__(self, frame: Frame, readme: Path, results: Path):
        self.frame, self.readme, self.results = frame, Path(readme), Path(results)

    def latest(self, exercise: str, **kw) -> pd.DataFrame:
        return self.frame.latest(exercise, **kw)

    def record(self, path: str) -> dict:
        return self.frame.record(path)

    def link(self, path: str) -> str:
        return os.path.relpath(self.results / path, self.readme.parent).replace(os.sep, "/")

    def run_label(self, r) -> str:
        day = (value(r, "started") or "")[:10]
        commit = (value(r, "commit") or "")[:7]
        return f"[{day} {commit}]({self.link(r['path'])})"

    def hw(self, r) -> str:
        label = value(r, "hardware_name") or r["hardware"]
        if r["source"] == "measured":
            return label
        origin = (value(r, "citation") or "elsewhere").split(" (")[0]      # the full citation is in the record
        return f"{label} (quoted from the {origin})"

    def caption(self, r) -> str:
        """The bold line above a group's rows: which GPU, which run (its record linked; a quoted
        figure's record, which no run of ours wrote, is called a record)."""
        return f"**{self.hw(r)}** · {'run' if r['source'] == 'measured' else 'record'} {self.run_label(r)}"


def _lesson(r) -> bool:
    return value(r, "excluded", "").startswith("lesson")


def _late(r) -> bool:
    """A calibrated prediction computed at report time (the row predates its ceilings record)."""
    return str(value(r, "calibrated.computed", "")).startswith("at report time")


def prediction_cell(r) -> str:
    """The README's one prediction cell: measured over the calibrated roofline (this machine's
    measured ceilings), then its bound, which may be latency; † marks a prediction computed at
    report time, 'lesson' a row that is not a test of the roofline. The spec sheet's prediction is
    in the CSV (prediction_csv_cells)."""
    ratio = value(r, "calibrated.measured_over_predicted")
    bound = value(r, "calibrated.bound") or value(r, "prediction.bound")
    if missing(ratio) and not bound:
        return "-"
    why = ", ".join(w for w in (bound, "lesson" if _lesson(r) else None) if w)
    return f"{num(ratio)}{'†' if _late(r) else ''}" + (f" ({why})" if why else "")


def prediction_csv_cells(r) -> list[str]:
    """Both predictions in full, one value a column (CSV_PREDICTION_HEADER)."""
    note = "; ".join(w for w in ("lesson" if _lesson(r) else "", "calibrated at report time" if _late(r) else "") if w)
    return [num(value(r, "prediction.predicted_ms")), num(value(r, "calibrated.predicted_ms")),
            value(r, "calibrated.bound") or value(r, "prediction.bound", "-"),
            num(value(r, "prediction.measured_over_predicted")), num(value(r, "calibrated.measured_over_predicted")),
            note or "-"]


def _cell(column, r) -> str:
    v = column.key(r) if callable(column.key) else value(r, column.key)
    return column.fmt(v)


def table_rows(view: View, spec: Table) -> pd.DataFrame:
    """The rows a table shows (cached per frame: the README and the CSV read the same rows)."""
    cache = view.frame.__dict__.setdefault("_table_rows", {})
    if spec.id not in cache:
        cache[spec.id] = _table_rows(view, spec)
    return cache[spec.id]


def _table_rows(view: View, spec: Table) -> pd.DataFrame:
    rows = spec.rows(view) if spec.rows else view.latest(spec.exercise, since_version=spec.since_version)
    if len(rows) and spec.where is not None:
        rows = spec.where(rows)
    return ok(rows) if spec.hide_failed else rows


def csv_path(view: View, spec: Table) -> Path:
    return view.results / "tables" / f"{spec.id}.csv"


def table_csv(view: View, spec: Table) -> str | None:
    """Every row and every column of a table as CSV (the hardware and record on each row, both
    predictions in full, the `more` columns), or None where it has no rows."""
    rows = table_rows(view, spec)
    if not len(rows):
        return None
    columns = spec.columns + spec.more
    header = ["hardware", *(c.header for c in columns), *(CSV_PREDICTION_HEADER if spec.prediction else []), "record"]
    lines = [[view.hw(r), *_cells(columns, r), *(_csv_prediction(r) if spec.prediction else []),
              f"results/{r['path']}"] for r in _narrow(rows)]
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows([header, *lines])
    return out.getvalue()


def table(view: View, spec: Table) -> str:
    """The table in groups of one GPU and run each, and a line linking its CSV (saying how many
    rows the README shows, for a `brief` table)."""
    rows = table_rows(view, spec)
    if not len(rows):
        return NO_RECORDS.format(ex=spec.exercise)
    shown = spec.brief(rows) if spec.brief is not None else rows
    target = os.path.relpath(csv_path(view, spec), view.readme.parent).replace(os.sep, "/")
    link = f"[{csv_path(view, spec).name}]({target})"
    spec_too = ", the spec-sheet prediction included" if spec.prediction else ""
    out = "\n\n".join(f"{caption}\n\n{markdown(lines, header)}" for caption, header, lines in grouped(view, spec, shown))
    if len(shown) < len(rows):
        out += f"\n\n{len(shown)} of {len(rows)} rows shown; every row and column{spec_too}: {link}."
    else:
        out += f"\n\nEvery column{spec_too}: {link}."
    if spec.note:
        note = spec.note(view, rows)
        if note:
            out += "\n\n" + note
    return out


class _Row(dict):
    """A row as a dict of its non-missing values; a column it lacks reads as NaN, as in the frame."""
    def __missing__(self, key):
        return float("nan")


def _narrow(rows: pd.DataFrame) -> list:
    """Rows without the frame's hundreds of empty columns (iterating the wide frame is the slow part)."""
    return [_Row(r) for r in rows.dropna(axis=1, how="all").to_dict("records")]


def _cells(columns: tuple, r) -> list[str]:
    """A row's cells; a row whose status is not ok shows its identity columns and `status: reason`."""
    if r["status"] == "ok":
        return [_cell(c, r) for c in columns]
    cells = [_cell(c, r) if c.identity else "-" for c in columns]
    first = next((i for i, c in enumerate(columns) if not c.identity), None)
    if first is not None:
        cells[first] = f"{r['status']}: {value(r, 'reason', '-')}"
    return cells


def _csv_prediction(r) -> list[str]:
    return prediction_csv_cells(r) if r["status"] == "ok" else ["-"] * len(CSV_PREDICTION_HEADER)


def grouped(view: View, spec: Table, rows: pd.DataFrame) -> list[tuple[str, list[str], list[list[str]]]]:
    """(caption, header, lines) per GPU and run, in the rows' order: the README's layout of a table."""
    header = [c.header for c in spec.columns] + ([PREDICTION_HEADER] if spec.prediction else [])
    if len(header) > MAX_COLUMNS:
        raise LabError(f"table '{spec.id}' has {len(header)} columns, more than the {MAX_COLUMNS} a README table "
                       "may have: move the rest to its `more` columns (they stay in its CSV)")
    groups: dict[tuple[str, str], tuple[str, list]] = {}
    for r in _narrow(rows):
        pred = [prediction_cell(r) if r["status"] == "ok" else "-"] if spec.prediction else []
        caption, lines = groups.setdefault((view.hw(r), r["path"]), (view.caption(r), []))
        lines.append([*_cells(spec.columns, r), *pred])
    return [(caption, header, lines) for caption, lines in groups.values()]


# ------------------------------------------------------------------------------ goals
def target_text(goal: Goal) -> str:
    out = f"{SIGN[goal.op]} {goal.fmt(goal.target)}"
    return out + (f" (stretch {goal.fmt(goal.stretch)})" if goal.stretch is not None else "")


def verdict(measured, goal: Goal) -> str:
    if missing(measured):
        return VERDICTS[2]
    return VERDICTS[0] if OPS[goal.op](float(measured), goal.target) else VERDICTS[1]


def pick(rows: pd.DataFrame, goal: Goal):
    """The row the goal is judged on (None where the metric is missing), or False where no row is
    one the goal is about (another size, another GPU count): then the goal does not apply."""
    rows = ok(rows)
    if len(rows) and goal.where is not None:
        rows = goal.where(rows)
    if not len(rows):
        return False
    if goal.metric not in rows or rows[goal.metric].isna().all():
        return None
    metric = rows[goal.metric].astype(float)
    return rows.loc[metric.idxmax() if goal.pick == "max" else metric.idxmin()]


def goal_line(goal: Goal, label: str, rows: pd.DataFrame) -> list[str] | None:
    """One goals-table line for the rows of one GPU (or setup), or None if the goal does not apply."""
    r = pick(rows, goal)
    if r is False:
        return None
    measured = None if r is None else r[goal.metric]
    shown = "-" if r is None else goal.fmt(measured) + (f" ({goal.detail(r)})" if goal.detail else "")
    return [label, goal.text, target_text(goal), shown, verdict(measured, goal), goal.anchor]


def goal_candidates(view: View, spec: Goals, goal: Goal) -> pd.DataFrame:
    if spec.rows is not None:
        return spec.rows(view, goal)
    return view.latest(goal.exercise, since_version=goal.since_version, measured_only=True)


def goals(view: View, spec: Goals) -> str:
    """One table for the phase: per GPU (or per setup a phase's `rows` labels, e.g. '2 x H200'),
    every goal that applies to it, in declaration order."""
    candidates = [(g, goal_candidates(view, spec, g)) for g in spec.goals]
    labels = sorted({label for _, rows in candidates if len(rows) for label in set(rows["hardware_name"])})
    lines = [line for label in labels for g, rows in candidates if len(rows)
             for line in [goal_line(g, label, rows[rows["hardware_name"] == label])] if line is not None]
    if spec.list_unmeasured:
        judged = {line[1] for line in lines}
        lines += [["-", g.text, target_text(g), "-", VERDICTS[2], g.anchor] for g in spec.goals if g.text not in judged]
    if not lines:
        return spec.empty or NO_RECORDS.format(ex=spec.goals[0].exercise if spec.goals else "it")
    return markdown(lines, GOAL_HEADER)


# ------------------------------------------------------------------------------ plots
def plot_hardware(view: View, spec: Plot) -> list[str]:
    if spec.hardware:
        return spec.hardware(view)
    keys = set()
    for ex in spec.exercises:
        latest = view.latest(ex, measured_only=True)
        keys |= set(latest["hardware"]) if len(latest) else set()
    return sorted(keys)


def plot_path(view: View, spec: Plot, hw: str) -> Path:
    return view.results / "plots" / f"{spec.stem}_{hw}.png"


def plot(view: View, spec: Plot) -> str:
    lines = []
    for hw in plot_hardware(view, spec):
        names = view.frame.df
        named = names[names["hardware"] == hw]["hardware_name"] if len(names) else names
        name = named.iloc[-1] if len(named) else hw          # a plot of no one GPU (all of them) keeps its key
        caption = spec.caption.format(name=name)
        lines.append(f"![{caption}]({os.path.relpath(plot_path(view, spec, hw), view.readme.parent).replace(os.sep, '/')})")
    return "\n\n".join(lines) or NO_RECORDS.format(ex=spec.exercises[0])


def text(view: View, spec: Text) -> str:
    return spec.write(view) or spec.empty


def block(view: View, spec) -> str:
    kind = {Table: table, Goals: goals, Plot: plot, Text: text}[type(spec)]
    return kind(view, spec).rstrip()


def verdict_of(measured, target: float, op: str = ">=") -> str:
    """The verdict wording for a figure checked in prose (a Text block), the same as in goal tables."""
    return verdict(measured, Goal("", "", "", target, "", op=op))


__all__ = ["View", "NO_RECORDS", "VERDICTS", "block", "table", "goals", "plot", "text", "pct", "verdict_of"]
