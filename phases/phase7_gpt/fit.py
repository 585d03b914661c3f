"""The scaling-law fit: L(N) = a N^(-alpha), a straight line in log-log space.

    log L = log a - alpha log N        least squares over the points (N, best validation loss)

With four or five points the exponent's uncertainty matters as much as its value, so it comes
with a bootstrap interval: resample the points with replacement, refit, and take the middle 95%
of the exponents (resamples whose points all share one N cannot define a line and are skipped).
"""
import math

import numpy as np

KAPLAN_ALPHA_N = 0.076      # Kaplan et al. 2020, "Scaling Laws for Neural Language Models", L(N) exponent
CHINCHILLA_TOKENS_PER_PARAM = 20.0   # Hoffmann et al. 2022: compute-optimal training tokens per parameter


def fit_power_law(n, loss) -> dict:
    """a, alpha, R^2 and each point's fit error in percent ((fit - measured) / measured)."""
    x, y = np.log(np.asarray(n, float)), np.log(np.asarray(loss, float))
    if len(x) < 2 or np.ptp(x) == 0:
        raise ValueError("a power-law fit needs at least two distinct N")
    slope, intercept = np.polyfit(x, y, 1)
    pred = intercept + slope * x
    ss_res, ss_tot = float(np.sum((y - pred) ** 2)), float(np.sum((y - y.mean()) ** 2))
    fitted = np.exp(pred)
    return {"a": float(math.exp(intercept)), "alpha": float(-slope),
            "r2": 1 - ss_res / ss_tot if ss_tot > 0 else None,
            "fitted": fitted.tolist(),
            "error_pct": (100 * (fitted - np.exp(y)) / np.exp(y)).tolist(),
            "max_abs_error_pct": float(np.max(np.abs(100 * (fitted - np.exp(y)) / np.exp(y))))}


def bootstrap_alpha(n, loss, resamples: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """Percentile bootstrap interval of alpha (resampling the points, seeded)."""
    n, loss = np.asarray(n, float), np.asarray(loss, float)
    rng = np.random.default_rng(seed)
    alphas = []
    for _ in range(resamples):
        i = rng.integers(0, len(n), len(n))
        if np.ptp(np.log(n[i])) == 0:
            continue
        alphas.append(-np.polyfit(np.log(n[i]), np.log(loss[i]), 1)[0])
    if not alphas:
        return {"low": None, "high": None, "level": level, "resamples": resamples, "used": 0}
    lo, hi = np.quantile(alphas, [(1 - level) / 2, 1 - (1 - level) / 2])
    return {"low": float(lo), "high": float(hi), "level": level, "resamples": resamples,
            "used": len(alphas), "std": float(np.std(alphas))}


def scaling_fit(n, loss, resamples: int = 2000, seed: int = 0) -> dict:
    fit = fit_power_law(n, loss)
    fit["bootstrap"] = bootstrap_alpha(n, loss, resamples, seed)
    fit["points"] = len(n)
    return fit
