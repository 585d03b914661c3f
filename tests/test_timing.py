"""common/timing.py: statistics on known samples, the CPU harness, sample-count sizing."""
import math
import statistics
import time

import pytest

from common.timing import Timing, _sample_count, benchmark, quantile, summarize


def test_quantile_interpolates_linearly():
    s = [float(x) for x in range(1, 11)]           # 1..10
    assert quantile(s, 0.0) == 1.0
    assert quantile(s, 1.0) == 10.0
    assert quantile(s, 0.5) == pytest.approx(5.5)
    assert quantile(s, 0.10) == pytest.approx(1.9)   # position 0.9 between 1 and 2
    assert quantile(s, 0.90) == pytest.approx(9.1)   # position 8.1 between 9 and 10
    assert quantile([7.0], 0.9) == 7.0


def test_quantile_of_nothing_is_an_error():
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_summarize_known_samples_in_any_order():
    samples = [10.0, 1.0, 9.0, 2.0, 8.0, 3.0, 7.0, 4.0, 6.0, 5.0]
    t = summarize(samples, "cpu perf_counter", warmup_calls=3, flush_l2=False)
    assert t.samples == 10
    assert t.median_ms == pytest.approx(5.5)
    assert t.p10_ms == pytest.approx(1.9)
    assert t.p90_ms == pytest.approx(9.1)
    assert (t.min_ms, t.max_ms) == (1.0, 10.0)
    assert t.mean_ms == pytest.approx(5.5)
    assert t.std_ms == pytest.approx(statistics.pstdev(range(1, 11)))   # population std: 2.8723
    assert t.std_ms == pytest.approx(2.8722813, rel=1e-6)
    assert t.spread_pct == pytest.approx(100 * (9.1 - 1.9) / 5.5)
    assert t.warmup_calls == 3 and t.method == "cpu perf_counter" and t.flush_l2 is False


def test_median_not_mean_of_a_skewed_tail():
    t = summarize([1.0] * 9 + [1000.0], "x", 0, False)
    assert t.median_ms == 1.0
    assert t.mean_ms == pytest.approx(100.9)
    assert t.max_ms == 1000.0


def test_single_sample_has_zero_std_and_zero_spread():
    t = summarize([2.5], "x", 0, False)
    assert (t.median_ms, t.p10_ms, t.p90_ms, t.std_ms) == (2.5, 2.5, 2.5, 0.0)
    assert t.spread_pct == 0.0


def test_as_dict_carries_spread_and_every_field():
    t = summarize([1.0, 2.0, 3.0], "x", 1, True, graph_reps=4)
    d = t.as_dict()
    assert d["spread_pct"] == pytest.approx(t.spread_pct)
    assert d["graph_reps"] == 4 and d["flush_l2"] is True
    assert set(d) >= {"method", "warmup_calls", "samples", "median_ms", "p10_ms", "p90_ms",
                      "min_ms", "max_ms", "mean_ms", "std_ms"}


def test_spread_of_zero_median_is_nan_not_a_crash():
    t = Timing("x", 0, 1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, False)
    assert math.isnan(t.spread_pct)


@pytest.mark.parametrize("estimate, target, lo, hi, expected", [
    (1.0, 200.0, 10, 1000, 200),      # target / estimate
    (100.0, 200.0, 10, 1000, 10),     # at least min_samples
    (0.001, 200.0, 10, 1000, 1000),   # at most max_samples
    (0.0, 200.0, 10, 1000, 1000),     # an unmeasurably fast call: max_samples
    (-1.0, 200.0, 10, 1000, 1000),
    (3.0, 10.0, 2, 50, 3),            # int(3.33)
])
def test_sample_count(estimate, target, lo, hi, expected):
    assert _sample_count(estimate, target, lo, hi) == expected


def test_benchmark_cpu_times_a_sleep():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    t = benchmark(fn, "cpu", warmup_ms=5, target_ms=40, min_samples=5)
    assert t.method == "cpu perf_counter"
    assert 1.5 <= t.median_ms <= 20.0            # generous: a test, not a benchmark
    assert t.min_ms <= t.p10_ms <= t.median_ms <= t.p90_ms <= t.max_ms
    assert t.samples >= 5
    # every timed sample is a call, plus the first call, the estimate and the warm-up
    assert len(calls) == t.samples + t.warmup_calls
    assert t.flush_l2 is False and t.graph_reps is None


def test_benchmark_respects_min_and_max_samples():
    sleep = lambda: time.sleep(0.001)  # noqa: E731
    t = benchmark(sleep, "cpu", warmup_ms=0, target_ms=0.01, min_samples=7)
    assert t.samples == 7                                   # target alone would ask for ~0
    t = benchmark(lambda: None, "cpu", warmup_ms=0, target_ms=10_000, min_samples=2, max_samples=4)
    assert t.samples == 4                                   # target alone would ask for millions
