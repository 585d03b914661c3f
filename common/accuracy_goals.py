"""The lab's goals for its own predictions, as Goal specs over the accuracy summary.

Each goal's candidates are one summary row per GPU (common/accuracy.py), so they render like every
other goal: hardware, goal, target, measured, verdict, and where the target comes from. The model
held to account is the summed one (a workload as the sum of its kernels' rooflines, common/
workload.py) where a row's exercise has a kernel list, else the one-roof calibrated one; each
line's detail gives the one-roof figure over the same rows beside it. Every phase that records
predictions counts, 1 to 7; a phase with no counted row on a GPU has no line for it.
"""
from .accuracy import goal_rows
from .formats import num, pct
from .spec import Goal, Goals

ANCHOR = "the lab's bar for a roofline that predicts (calibrated on the same machine)"
ISSUE = "published simulators with profiled operator models reach 4-12% end to end (LLMCompass, Vidur, KernelSight-LM)"
PHASES = (1, 2, 3, 4, 5, 6, 7)
SCOPES = {"accuracy.all": (PHASES, None), **{f"accuracy.p{n}": ((n,), None) for n in PHASES},
          "accuracy.latency": ((0, *PHASES), ("latency",))}


def rows(view, goal):
    phases, bounds = SCOPES[goal.exercise]
    return goal_rows(view, phases, bounds, goal.exercise)


def _n(r) -> str:
    return (f"{int(r['metrics.rows'])} rows, {int(r['metrics.sum_rows'])} summed; "
            f"one roof: {pct(r['metrics.cal_abs_err_pct'])}")


EMPTY = "_No calibrated predictions yet: run `lab run phase1.ceilings` on a GPU, then `lab report`._"
GOALS = Goals("accuracy.goals", rows=rows, empty=EMPTY, goals=(
    Goal("every row of phases 1-7 (fastest variant per problem): median abs(measured/predicted - 1)",
         "accuracy.all", "metrics.sum_abs_err_pct", 10, ISSUE, op="<=", pick="max", fmt=pct, detail=_n),
    *(Goal(f"phase {n} alone: median abs(measured/predicted - 1)", f"accuracy.p{n}", "metrics.sum_abs_err_pct", 15,
           ANCHOR, op="<=", pick="max", fmt=pct, detail=_n) for n in PHASES),
    Goal("latency-bound rows: the worst factor between measured and predicted", "accuracy.latency",
         "metrics.sum_worst_ratio", 2, ANCHOR, op="<=", pick="max", fmt=lambda x: "-" if x != x else f"{x:.2f}x",
         detail=lambda r: f"{int(r['metrics.rows'])} rows; one roof: {num(r['metrics.worst_ratio'])}x"),
))
