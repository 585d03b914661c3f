"""Phase 7 scaling-law fit: it recovers a known exponent, and its bootstrap interval covers it."""
import numpy as np
import pytest

from phases.phase7_gpt.fit import bootstrap_alpha, fit_power_law, scaling_fit


def test_exact_power_law_is_recovered():
    n = np.array([98_944, 333_120, 788_736, 2_659_200, 10_626_816])
    loss = 7.5929 * n ** -0.0321
    fit = fit_power_law(n, loss)
    assert fit["alpha"] == pytest.approx(0.0321, rel=1e-9)
    assert fit["a"] == pytest.approx(7.5929, rel=1e-9)
    assert fit["r2"] == pytest.approx(1.0)
    assert max(abs(e) for e in fit["error_pct"]) < 1e-9


def test_noisy_points_interval_contains_the_true_exponent():
    rng = np.random.default_rng(3)
    n = np.geomspace(1e5, 1e7, 6)
    true_alpha = 0.076
    loss = 12.0 * n ** -true_alpha * np.exp(rng.normal(0, 0.01, len(n)))
    fit = scaling_fit(n, loss, resamples=2000, seed=0)
    assert fit["alpha"] == pytest.approx(true_alpha, abs=0.01)
    bs = fit["bootstrap"]
    assert bs["low"] < true_alpha < bs["high"]
    assert bs["high"] - bs["low"] < 0.05
    assert bs["used"] <= 2000 and bs["used"] > 1900            # resamples of one repeated point are skipped
    # per-point error is (fit - measured) / measured, in percent
    assert fit["error_pct"][0] == pytest.approx(100 * (fit["fitted"][0] - loss[0]) / loss[0])


def test_bootstrap_is_seeded():
    n, loss = [1e5, 1e6, 1e7, 3e7], [5.3, 4.9, 4.8, 4.82]
    assert bootstrap_alpha(n, loss, 500, seed=1) == bootstrap_alpha(n, loss, 500, seed=1)


def test_a_fit_needs_two_distinct_sizes():
    with pytest.raises(ValueError):
        fit_power_law([1e6, 1e6], [4.0, 4.1])
