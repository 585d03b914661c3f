"""The one renderer: a spec (common/spec.py) and the frame in, markdown out.

Every table starts with the hardware and ends with the run link; every timed table carries the
roofline's prediction columns; every goal reads `met`, `**not met**` or `not measured`. A phase
never formats these itself, so a reader learns one layout and it holds in every README.
"""
import csv
import io
import os
from pathlib import Path

import pandas as pd

from .formats import markdown, missing, num, pct
from .frame import Frame, ok, value
from .spec import OPS, SIGN, Goal, Goals, Plot, Table, Text

NO_RECORDS = "_No records yet: run `lab run {ex}` on a GPU, then `lab report`._"
VERDICTS = ("met", "**not met**", "not measured")
PREDICTION_HEADER = ["predicted ms (spec / calibrated)", "bound", "measured/predicted (spec / calibrated)"]
GOAL_HEADER = ["hardware", "goal", "target", "measured", "verdict", "target from"]


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


def prediction_cells(r) -> list[str]:
    """Both predictions beside each other: the spec sheet's roofline, then the one from this
    machine's measured ceilings (its bound, which may be latency); † marks a calibrated prediction
    computed at report time (the row predates its ceilings record). A lesson row says so."""
    cal = value(r, "calibrated.predicted_ms")
    ratio = f"{num(value(r, 'prediction.measured_over_predicted'))} / {num(value(r, 'calibrated.measured_over_predicted'))}"
    if value(r, "excluded", "").startswith("lesson"):
        ratio += " (lesson)"
    late = "†" if str(value(r, "calibrated.computed", "")).startswith("at report time") else ""
    return [f"{num(value(r, 'prediction.predicted_ms'))} / {num(cal)}{late}",
            value(r, "calibrated.bound") or value(r, "prediction.bound", "-"), ratio]


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
    """Every row of a `brief` table as CSV (the README shows the brief part), or None."""
    rows = table_rows(view, spec)
    if spec.brief is None or not len(rows):
        return None
    header, lines = _lines(view, spec, rows, link=False, columns=spec.columns + spec.more)
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows([header, *lines])
    return out.getvalue()


def table(view: View, spec: Table) -> str:
    rows = table_rows(view, spec)
    if not len(rows):
        return NO_RECORDS.format(ex=spec.exercise)
    if spec.brief is not None:
        shown = spec.brief(rows)
        target = os.path.relpath(csv_path(view, spec), view.readme.parent).replace(os.sep, "/")
        out = markdown(*reversed(_lines(view, spec, shown)))
        out += f"\n\n{len(shown)} of {len(rows)} rows shown; every row: [{csv_path(view, spec).name}]({target})."
    else:
        out = markdown(*reversed(_lines(view, spec, rows)))
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


def _lines(view: View, spec: Table, rows: pd.DataFrame, link: bool = True,
           columns: tuple = ()) -> tuple[list[str], list[list[str]]]:
    columns = columns or spec.columns
    header = ["hardware", *(c.header for c in columns), *(PREDICTION_HEADER if spec.prediction else []),
              "run" if link else "record"]
    lines = []
    for r in _narrow(rows):
        if r["status"] == "ok":
            cells = [_cell(c, r) for c in columns]
            pred = prediction_cells(r) if spec.prediction else []
        else:
            cells = [_cell(c, r) if c.identity else "-" for c in columns]
            first = next((i for i, c in enumerate(columns) if not c.identity), None)
            if first is not None:
                cells[first] = f"{r['status']}: {value(r, 'reason', '-')}"
            pred = ["-"] * len(PREDICTION_HEADER) if spec.prediction else []
        lines.append([view.hw(r), *cells, *pred, view.run_label(r) if link else f"results/{r['path']}"])
    return header, lines


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
