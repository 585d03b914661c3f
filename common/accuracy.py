"""How well the roofline predicts: measured/predicted over the rows that test it, per GPU and bound.

The roofline bounds the best implementation, not every candidate: for each problem (one record's
rows with the same dtype, FLOPs and shape parameters; for work without FLOPs, the same bytes) only
the fastest variant is counted; slower ones show
their own measured/calibrated (how far from the roof they are) but do not enter the figures.
Lesson and calibration rows (`excluded`) never count. Spec and calibrated are summarised side by
side: median, p10 and p90 of measured/predicted, and the median of |measured/calibrated - 1|;
beside them the summed model's (common/workload.py: a workload as the sum of its kernels' rooflines;
common/workload_rows.py: a recorded row's) median |measured/predicted - 1| over the same rows: the
sum where a row's exercise has a kernel list, its one-roof prediction where not (`RATIO`).
"""
import pandas as pd

from . import workload_rows
from .formats import markdown, num, pct

KEY = ["path", "prediction.dtype", "_size", "_what"]
# What makes two rows the same problem besides FLOPs and dtype: the shape parameters the lab's
# exercises use (variant-specific ones, a layout, a thread count, a bucket size, stay out).
WHAT = tuple(f"params.{k}" for k in ("m", "n", "k", "rows", "cols", "batch", "heads", "head_dim", "causal", "group",
                                     "model", "kernel", "op", "world_size", "size_bytes", "numel"))
HEADER = ["hardware", "rows", "bound", "spec: median", "spec: p10 - p90", "calibrated: median",
          "calibrated: p10 - p90", "median abs(measured/calibrated - 1)",
          "summed: median abs(measured/predicted - 1) (rows with a kernel list)"]
RATIO = "summed.or_one_roof"            # measured/predicted: the summed model's, else the one-roof one


def counted(view, phases: tuple[int, ...] | None = None) -> pd.DataFrame:
    """The fastest non-excluded ok row of every problem in the newest measured record of each
    exercise and GPU (phases limited to `phases` when given). Cached on the frame."""
    cache = view.frame.__dict__.setdefault("_counted", {})
    if None not in cache:
        cache[None] = _counted(view)
    if phases not in cache:
        every = cache[None]
        cache[phases] = every[every["phase"].isin(phases)] if len(every) else every
    return cache[phases]


def _counted(view):
    df = view.frame.df
    if not len(df) or "calibrated.measured_over_predicted" not in df:
        return df.iloc[0:0]
    exercises = sorted(set(df["exercise"]))
    parts = [view.latest(ex, measured_only=True) for ex in exercises]
    rows = pd.concat([p for p in parts if len(p)]) if any(len(p) for p in parts) else df.iloc[0:0]
    if not len(rows):
        return rows
    rows = rows[(rows["status"] == "ok") & rows["excluded"].isna() & rows["calibrated.measured_over_predicted"].notna()
                & rows["prediction.measured_over_predicted"].notna()]
    if not len(rows):
        return rows
    ms = rows["prediction.measured_ms"].fillna(rows["metrics.ms"]) if "prediction.measured_ms" in rows else rows["metrics.ms"]
    flops, nbytes = rows["prediction.flops"].fillna(0).astype(float), rows["prediction.bytes"].fillna(0).astype(float)
    what = rows[[c for c in WHAT if c in rows]].map(str).agg("|".join, axis=1) if any(c in rows for c in WHAT) else ""
    rows = rows.copy().assign(_ms=ms.astype(float), _size=flops.where(flops > 0, -nbytes), _what=what,
                       **{"prediction.dtype": rows["prediction.dtype"].fillna("-")})
    fastest = rows.loc[rows.groupby(KEY, dropna=False)["_ms"].idxmin()]
    fastest = workload_rows.add_columns(fastest, view.frame.records)
    summed = fastest["summed.measured_over_predicted"]
    fastest[RATIO] = summed.where(summed.notna(), fastest["calibrated.measured_over_predicted"]).astype(float)
    return fastest.sort_values(["hardware", "phase", "exercise"], kind="stable")


def summary(rows: pd.DataFrame) -> dict:
    spec = rows["prediction.measured_over_predicted"].astype(float)
    cal = rows["calibrated.measured_over_predicted"].astype(float)
    return {"rows": len(rows), "spec_median": spec.median(), "spec_p10": spec.quantile(0.1), "spec_p90": spec.quantile(0.9),
            "cal_median": cal.median(), "cal_p10": cal.quantile(0.1), "cal_p90": cal.quantile(0.9),
            "cal_abs_err_pct": 100 * (cal - 1).abs().median(),
            "sum_abs_err_pct": 100 * (rows[RATIO] - 1).abs().median(),
            "sum_rows": int(rows["summed.measured_over_predicted"].notna().sum()),
            "sum_worst_ratio": float(rows[RATIO].map(lambda x: max(x, 1 / x)).max())}


def _line(label: str, bound: str, s: dict) -> list[str]:
    return [label, str(s["rows"]), bound, num(s["spec_median"]), f"{num(s['spec_p10'])} - {num(s['spec_p90'])}",
            num(s["cal_median"]), f"{num(s['cal_p10'])} - {num(s['cal_p90'])}", pct(s["cal_abs_err_pct"]),
            f"{pct(s['sum_abs_err_pct'])} ({s['sum_rows']})"]


def table(view, phases: tuple[int, ...] | None = None) -> str:
    """Per GPU: one line per bound and one for all bounds together."""
    rows = counted(view, phases)
    if not len(rows):
        return ("_No calibrated predictions yet: run `lab run phase1.ceilings` on the GPU, then `lab report` "
                "(rows recorded before it get their calibrated prediction at report time)._")
    lines = []
    for hw, mine in rows.groupby("hardware", sort=True):
        label = mine.iloc[0]["hardware_name"]
        for bound, part in mine.groupby("calibrated.bound", sort=True):
            lines.append(_line(label, bound, summary(part)))
        lines.append(_line(label, "all", summary(mine)))
    return markdown(lines, HEADER)


def goal_rows(view, phases: tuple[int, ...], bounds: tuple[str, ...] | None, label: str) -> pd.DataFrame:
    """One summary row per GPU, shaped like a frame row, for Goal specs over the accuracy (rows of
    the one-roof model's `bounds`, every bound when None): metrics.cal_abs_err_pct,
    metrics.cal_median, metrics.rows, metrics.worst_ratio, and the summed model's
    metrics.sum_abs_err_pct, metrics.sum_rows (those with a kernel list), metrics.sum_worst_ratio."""
    rows = counted(view, phases)
    rows = rows[rows["calibrated.bound"].isin(bounds)] if len(rows) and bounds else rows
    out = []
    for hw, mine in (rows.groupby("hardware", sort=True) if len(rows) else []):
        s = summary(mine)
        out.append({"hardware": hw, "hardware_name": mine.iloc[0]["hardware_name"], "status": "ok", "variant": label,
                    **{f"metrics.{k}": v for k, v in s.items()},
                    "metrics.worst_ratio": float(mine["calibrated.measured_over_predicted"].astype(float).map(
                        lambda x: max(x, 1 / x)).max())})
    return pd.DataFrame(out)


SHAPE_KEYS = ("m", "n", "k", "rows", "cols", "batch", "heads", "head_dim", "causal", "model", "kernel", "size_bytes")


def _reached(r) -> str:
    """What the row reached against the ceiling its bound names, from the record's own numbers."""
    bound, ms = r["calibrated.bound"], float(r["_ms"])
    if bound == "compute" and r.get("metrics.tflops") == r.get("metrics.tflops") and r.get("metrics.tflops"):
        ceiling = float(r["calibrated.predicted_ms"]) and r["prediction.flops"] / (1e9 * float(r["calibrated.predicted_ms"]))
        return f"{num(r['metrics.tflops'])} TFLOP/s where the model allowed {num(ceiling)} ({r['prediction.dtype']} matmul ceiling)"
    if bound == "memory" and r.get("prediction.bytes"):
        return f"{num(r['prediction.bytes'] / (ms * 1e6))} GB/s of counted bytes"
    launches = r.get("prediction.launches")
    return f"{num(ms * 1e3)} µs against a floor of {num(1e3 * float(r['calibrated.predicted_ms']))} µs" + (
        f" ({int(launches)} launches)" if launches == launches and launches else "")


def _scalar(v):
    """A parameter as a short word, or None (missing, or a structure such as a model's shape)."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, str):
        return v
    if isinstance(v, (int, float)) and v == v:
        return num(v)
    return None


def _top(r) -> str:
    """Where the summed model puts the row's time: its largest kernels with their share and bound."""
    top = r.get("summed.top")
    if not isinstance(top, list) or not top:
        return "- (no kernel list)"
    return "; ".join(f"{t['kernel']} {100 * t['share']:.0f}% ({t['bound']})" for t in top[:2] if t.get("share"))


def misses(view, worst: int = 5) -> str:
    """Per GPU, the counted rows the lab's model misses most (the summed one where a row has a
    kernel list, else the one-roof one), with what each reached and where the sum puts its time."""
    rows = counted(view)
    if not len(rows):
        return "_No calibrated predictions yet._"
    lines = []
    for _, mine in rows.groupby("hardware", sort=True):
        err = mine[RATIO].map(lambda x: max(x, 1 / x))
        for _, r in mine.loc[err.sort_values(ascending=False).index[:worst]].iterrows():
            shape = ", ".join(f"{k}={_scalar(r[f'params.{k}'])}" for k in SHAPE_KEYS
                              if f"params.{k}" in r and _scalar(r[f"params.{k}"]) is not None)
            has_sum = r["summed.measured_over_predicted"] == r["summed.measured_over_predicted"] \
                and r["summed.measured_over_predicted"] is not None
            lines.append([r["hardware_name"], r["exercise"], r["variant"], shape or "-", num(r["_ms"]),
                          f"{num(r['calibrated.predicted_ms'])} ({r['calibrated.bound']})",
                          num(r["summed.predicted_ms"]) if has_sum else "-",
                          num(r[RATIO]) + ("" if has_sum else " (one roof)"), _top(r), _reached(r)])
    return markdown(lines, ["hardware", "exercise", "variant", "shape", "measured ms", "one roof ms (bound)",
                            "summed ms", "measured/predicted", "where the sum puts the time", "what it reached"])
