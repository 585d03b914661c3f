"""Rows for variants that may not run here, and our rows set beside the library's: a variant that
cannot run becomes a 'skipped' or 'failed' row saying why (never the loss of the whole record),
and each of our rows gets the fastest library row of the same size as its yardstick."""
from .errors import LabError
from .exercise import against_baseline, row


def skipped(variant: str, params: dict, reason: str) -> dict:
    """A variant that cannot run here (a library backend that rejects these inputs)."""
    return row(variant, params, "skipped", reason)


def compare_to_library(rows: list[dict], ours: str, libraries: tuple[str, ...], metric: str) -> None:
    """For each of our rows, the fastest library row with the same params: its name and ms, and
    our `metric` (a rate) as a percent of its rate (`pct_of_library`; above 100% we are faster)."""
    for r in rows:
        if r["variant"] != ours or r["status"] != "ok":
            continue
        libs = [x for x in rows if x["variant"] in libraries and x["status"] == "ok" and x["params"] == r["params"]]
        if libs:
            best = min(libs, key=lambda x: x["metrics"]["ms"])
            r["metrics"].update(library=best["variant"], library_ms=best["metrics"]["ms"])
            against_baseline([r], best, metric, "pct_of_library")


def attempt(variant: str, params: dict, make_row) -> dict:
    """`make_row()`, or a 'failed' row saying why it raised: one variant that cannot run (no config
    compiled, a library error, out of memory) must not cost the record every other row."""
    try:
        return make_row()
    except LabError as exc:
        return row(variant, params, "failed", str(exc))
    except Exception as exc:  # noqa: BLE001 - recorded in the row, not raised
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        return row(variant, params, "failed", f"{type(exc).__name__}: {lines[0][:300] if lines else ''}".strip())
