"""No row of the committed records passes 100% of the roof it is compared with unless it says
why: a lesson row excluded with its reason, or a working set the record shows inside the L2
with warm calls (issue 33, goal 4)."""
import pandas as pd
import pytest

from common import report
from common.above_roof import bandwidth_pct, why_above_roof
from common.records import load_records
from conftest import REPO

MiB = 2**20


def _row(**kw):
    base = {"l2_bytes": 50 * MiB, "params.working_set_bytes": 12 * MiB, "timing.flush_l2": True,
            "timing.graph_reps": 20, "metrics.pct_of_peak_bandwidth": 115.5}
    return pd.Series({**base, **kw})


def test_a_warm_working_set_inside_the_l2_is_the_reason():
    assert why_above_roof(_row()) == "in the 50 MiB L2: a graph replay of 20 calls, flushed once"
    assert why_above_roof(_row(**{"timing.graph_reps": None, "timing.flush_l2": False})) == "in the 50 MiB L2: warm caches"
    assert bandwidth_pct(_row()) == "115.5% (in the 50 MiB L2: a graph replay of 20 calls, flushed once)"


@pytest.mark.parametrize("change", [
    {"timing.graph_reps": None},                          # flushed before every call: cold
    {"params.working_set_bytes": 64 * MiB},               # larger than the L2
    {"l2_bytes": None},                                   # L2 size not captured (a CPU)
])
def test_no_reason_is_made_up(change):
    r = _row(**change)
    assert why_above_roof(r) is None
    assert bandwidth_pct(r) == "115.5%"                   # shown as it is, unexcused


def test_every_committed_row_above_its_roof_says_why():
    frame = report.frame_of(load_records(REPO / "results"))
    unexplained = []
    for ex in sorted(set(frame.df["exercise"])):
        rows = frame.latest(ex, measured_only=True)
        for _, r in rows.iterrows():
            over = [k for k in ("metrics.pct_of_peak_bandwidth", "metrics.pct_of_peak_tflops")
                    if isinstance(r.get(k), (int, float)) and r.get(k) > 100]
            if not over or isinstance(r.get("excluded"), str):
                continue
            if over == ["metrics.pct_of_peak_bandwidth"] and why_above_roof(r):
                continue
            unexplained.append(f"{r['hardware']} {ex} {r['variant']} {over}")
    assert unexplained == []
