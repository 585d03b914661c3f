"""The lab's goals for its own predictions, as Goal specs over the accuracy summary.

Each goal's candidates are one summary row per GPU (common/accuracy.py), so they render like every
other goal: hardware, goal, target, measured, verdict, and where the target comes from.
"""
from .accuracy import goal_rows
from .formats import num, pct
from .spec import Goal, Goals

ANCHOR = "the lab's bar for a roofline that predicts (calibrated on the same machine)"
SCOPES = {"accuracy.p1237": ((1, 2, 3, 7), ("memory", "compute")),
          "accuracy.p1": ((1,), ("memory", "compute")), "accuracy.p2": ((2,), ("memory", "compute")),
          "accuracy.p3": ((3,), ("memory", "compute")), "accuracy.p7": ((7,), ("memory", "compute")),
          "accuracy.latency": ((0, 1, 2, 3, 7), ("latency",))}


def rows(view, goal):
    phases, bounds = SCOPES[goal.exercise]
    return goal_rows(view, phases, bounds, goal.exercise)


def _n(r) -> str:
    return f"{int(r['metrics.rows'])} rows, median measured/calibrated {num(r['metrics.cal_median'])}"


EMPTY = "_No calibrated predictions yet: run `lab run phase1.ceilings` on a GPU, then `lab report`._"
GOALS = Goals("accuracy.goals", rows=rows, empty=EMPTY, goals=(
    Goal("memory- and compute-bound rows of phases 1, 2, 3, 7 (fastest variant per problem): median abs(measured/calibrated - 1)",
         "accuracy.p1237", "metrics.cal_abs_err_pct", 15, ANCHOR, op="<=", pick="max", fmt=pct, detail=_n),
    *(Goal(f"phase {n} alone: median abs(measured/calibrated - 1)", f"accuracy.p{n}", "metrics.cal_abs_err_pct", 25,
           ANCHOR, op="<=", pick="max", fmt=pct, detail=_n) for n in (1, 2, 3, 7)),
    Goal("latency-bound rows: the worst factor between measured and calibrated", "accuracy.latency",
         "metrics.worst_ratio", 2, ANCHOR, op="<=", pick="max", fmt=lambda x: "-" if x != x else f"{x:.2f}x",
         detail=lambda r: f"{int(r['metrics.rows'])} rows"),
))
