"""A CPU row whose working set fits in the last-level cache is compared with that cache's copy
bandwidth, not the large-copy (DRAM) figure, as a GPU row in L2 is (issue 33, item 5)."""
import pytest
import torch

from common import cpu_cache, exercise, roofline
from common.exercise import Context
from common.timing import summarize

MiB = 2**20


def test_cache_sizes_read_as_linux_publishes_them(tmp_path):
    for i, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"),
                                             (3, "Unified", "32768K")]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    assert cpu_cache.last_level_cache(tmp_path) == (3, 32 * MiB)
    assert cpu_cache.last_level_cache(tmp_path / "absent") is None
    assert cpu_cache.parse_size("1M") == MiB and cpu_cache.parse_size("") is None and cpu_cache.parse_size("x") is None


@pytest.fixture
def cpu_with_a_32_mib_l3(monkeypatch):
    """A CPU context whose copies measure 200 GB/s inside the cache and 50 GB/s beyond it."""
    monkeypatch.setattr(cpu_cache, "last_level_cache", lambda root=None: (3, 32 * MiB))
    copies = []

    def copy_gbps(ctx, nbytes=256 * MiB):
        copies.append(nbytes)
        return 200.0 if 2 * nbytes <= 32 * MiB else 50.0
    monkeypatch.setattr(exercise, "measure_copy_gbps", copy_gbps)
    return Context(torch.device("cpu"), None, "cpu"), copies


def test_a_working_set_in_the_cache_is_compared_with_the_cache(cpu_with_a_32_mib_l3):
    ctx, copies = cpu_with_a_32_mib_l3
    inside = ctx.roofs(None, working_set_bytes=32 * MiB)
    assert inside.bandwidth_gbps == 200.0 and "L3 cache" in inside.bandwidth_source
    beyond = ctx.roofs(None, working_set_bytes=48 * MiB)
    assert beyond.bandwidth_gbps == 50.0 and "cache" not in beyond.bandwidth_source
    assert ctx.roofs(None).bandwidth_gbps == 50.0                       # no working set given: DRAM
    ctx.roofs(None, working_set_bytes=MiB)
    assert copies == [8 * MiB, 256 * MiB]                               # each measured once, the cache at half its size


def test_a_gpu_keeps_its_spec_sheet(specs):
    ctx = Context(torch.device("cpu"), specs["h200_sxm"], "h200_sxm")
    assert ctx.roofs("fp32", working_set_bytes=MiB).bandwidth_gbps == specs["h200_sxm"].figure("memory_bandwidth_gbps").value


def test_measure_compares_a_cached_row_with_the_cache(cpu_with_a_32_mib_l3):
    """A warm copy of 16 MiB that runs at 180 GB/s: 90% of the cache's 200, not 360% of DRAM's 50."""
    ctx, _ = cpu_with_a_32_mib_l3
    ms = 16 * MiB / 180e6
    ctx.time = lambda fn, **kw: summarize([ms] * 5, "test timing", 0, False)
    r = exercise.measure(ctx, "copy", {"working_set_bytes": 16 * MiB}, fn=lambda: None,
                         check=lambda: {"passed": True, "reason": None}, flops=0, bytes_moved=16 * MiB, dtype=None)
    assert r["metrics"]["pct_of_peak_bandwidth"] == pytest.approx(90.0)
    assert r["prediction"]["predicted_ms"] == pytest.approx(16 * MiB / 200e6)


def test_ceilings_on_a_cpu_measure_the_cache_and_the_calibrated_model_uses_it(monkeypatch):
    from phases.phase1_roofline import ceilings
    monkeypatch.setattr(ceilings, "last_level_cache", lambda: (3, 4 * MiB))
    ctx = Context(torch.device("cpu"), None, "cpu", quick=True)
    params = ceilings.EXERCISE.resolve_params(on_cpu=True, quick=True, overrides={"dtypes": ["fp32"]})
    result = ceilings.run(ctx, params)
    llc = next(r for r in result.rows if r["variant"] == "llc_copy")
    assert llc["status"] == "ok" and llc["params"]["working_set_bytes"] == 2 * MiB
    c = result.summary["ceilings"]
    assert c["l2_gbps"] == llc["metrics"]["gbps"] and c["l2_bytes"] == c["l2_fit_bytes"] == 4 * MiB
    warm = roofline.calibrated(0, 4 * MiB, None, c, working_set_bytes=4 * MiB, warm=True)
    cold = roofline.calibrated(0, 8 * MiB, None, c, working_set_bytes=8 * MiB, warm=True)
    assert warm["bandwidth_gbps"] == c["l2_gbps"] and cold["bandwidth_gbps"] == c["hbm_gbps"]


def test_the_cache_sweep_table_says_which_rows_l2_serves():
    """A warm copy above 100% of the HBM roof says why: its working set fits in the L2."""
    import pandas as pd

    from phases.phase1_roofline.report import served_from
    row = lambda ws, l2: pd.Series({"params.working_set_bytes": ws, "summary.l2_bytes": l2})   # noqa: E731
    assert served_from(row(16 * MiB, 50 * MiB)) == "L2 (fits in 50 MiB)"
    assert served_from(row(64 * MiB, 50 * MiB)) == "HBM"
    assert served_from(row(16 * MiB, None)) == "-"
