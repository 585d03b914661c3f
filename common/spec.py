"""What a phase's README shows, declared: tables, goals, plots and findings, rendered by `render`.

A phase's `report.py` builds one `Phase` from these specs and imports nothing heavier than pandas
(no torch, no exercise modules), so `lab report` stays fast and runs anywhere. Each spec names the
README block it fills (`<!-- lab:begin ID -->`). Numbers come from records; a spec only chooses
rows, columns and formats, so every phase's tables look and read the same way.
"""
from dataclasses import dataclass, field
from typing import Callable

import pandas as pd

from .formats import pct, text

Key = str | Callable[[pd.Series], object]      # a frame column, or a function of one row


@dataclass(frozen=True)
class Column:
    """One column: its header, where its value comes from, how it is written. `identity` columns
    say which problem a row is (variant, size, dtype) and are still shown on a failed row."""
    header: str
    key: Key
    fmt: Callable[[object], str] = text
    identity: bool = False


def col(header: str, key: Key, fmt: Callable[[object], str] = text, identity: bool = False) -> Column:
    return Column(header, key, fmt, identity)


def ident(header: str, key: Key, fmt: Callable[[object], str] = text) -> Column:
    return Column(header, key, fmt, identity=True)


@dataclass(frozen=True)
class Table:
    """Rows of the newest record of `exercise` per GPU, one line each, grouped under a caption per
    GPU and run (the renderer writes the hardware and the run link there, not in a column) and
    ending, when `prediction`, in one column: measured over the calibrated roofline, with its bound.
    `where` narrows the rows (a function of the DataFrame); a row whose status is not ok shows its
    identity columns and `status: reason`. `note` adds sentences under the table (a template over
    the rows' stored values). At most 10 columns in all (render.MAX_COLUMNS)."""
    id: str
    exercise: str
    columns: tuple[Column, ...]
    where: Callable[[pd.DataFrame], pd.DataFrame] | None = None
    prediction: bool = True
    hide_failed: bool = False
    since_version: int = 1
    note: Callable[["object", pd.DataFrame], str] | None = None
    rows: Callable[["object"], pd.DataFrame] | None = None    # rows built from several records (rare)
    brief: Callable[[pd.DataFrame], pd.DataFrame] | None = None
    more: tuple[Column, ...] = ()
    """`lab report` writes every row and column of every table to results/tables/<id>.csv, linked
    under the table: the hardware and record of each row, both predictions in full (spec sheet and
    calibrated) and the `more` columns, which the README leaves out to stay readable. With
    `brief`, the README shows only brief(rows) (long sweeps: a reader sees the shape, a script the rest)."""


OPS = {">=": lambda v, t: v >= t, ">": lambda v, t: v > t, "<=": lambda v, t: v <= t, "<": lambda v, t: v < t}
SIGN = {">=": "≥", ">": ">", "<=": "≤", "<": "<"}


@dataclass(frozen=True)
class Goal:
    """A target the phase set itself: on each GPU, among the newest rows of `exercise` that `where`
    keeps, the row with the `pick` (max or min) of `metric` is compared with `target` by `op`.
    `anchor` says where the target comes from, in words a reader of the repository can check;
    `detail(row)` says which row was picked (variant, size)."""
    text: str
    exercise: str
    metric: str
    target: float
    anchor: str
    op: str = ">="
    pick: str = "max"
    where: Callable[[pd.DataFrame], pd.DataFrame] | None = None
    fmt: Callable[[object], str] = pct
    detail: Callable[[pd.Series], str] | None = None
    stretch: float | None = None
    since_version: int = 1

    def __post_init__(self):
        if self.op not in OPS or self.pick not in ("max", "min"):
            raise ValueError(f"goal '{self.text}': op must be one of {sorted(OPS)}, pick max or min")


@dataclass(frozen=True)
class Goals:
    """A phase's goals, one table. `rows(view, goal)` replaces the default candidates (the newest
    measured rows per GPU) where a phase groups finer, labelling each group in `hardware_name`
    (phase 4: one group per GPU count)."""
    id: str
    goals: tuple[Goal, ...]
    rows: Callable[["object", Goal], pd.DataFrame] | None = None
    empty: str | None = None                 # what the block says before any record (default: run the exercise)
    list_unmeasured: bool = False            # a goal no GPU has measured yet: one line, hardware '-', not measured


@dataclass(frozen=True)
class Plot:
    """One PNG per GPU that has a measured record of any of `exercises`:
    results/plots/<stem>_<hardware>.png, drawn by `draw(view, hardware, path)`. The block shows
    the images with `caption` (which may use {name}, the GPU's name)."""
    id: str
    stem: str
    exercises: tuple[str, ...]
    draw: Callable[["object", str, "object"], None]
    caption: str
    hardware: Callable[["object"], list[str]] | None = None     # which plots exist (default: above)


@dataclass(frozen=True)
class Text:
    """Findings: sentences whose every number is filled in from records by `write(view)`."""
    id: str
    write: Callable[["object"], str]
    empty: str = "_No records yet._"


Block = Table | Goals | Plot | Text


@dataclass(frozen=True)
class Phase:
    """A phase's report: its number, title, README folder, blocks, and the one line per GPU the top
    README's phase table shows (`headline(view) -> [str]`)."""
    number: int
    title: str
    folder: str
    blocks: tuple[Block, ...] = ()
    headline: Callable[["object"], list[str]] | None = None
    exercises: tuple[str, ...] = field(default=())
    excluded: dict = field(default_factory=dict)
    """(exercise, variant) -> why the row is not a test of the roofline ('lesson: ...'), for records
    written before rows said so themselves in `prediction.excluded`."""
    calibrators: dict = field(default_factory=dict)
    """exercise -> fn(row as a dict, records) -> calibrated block or None, for rows the roofline's terms do
    not describe (collectives: alpha-beta); the rest get common.roofline.calibrated."""

    def block_ids(self) -> list[str]:
        return [b.id for b in self.blocks]

