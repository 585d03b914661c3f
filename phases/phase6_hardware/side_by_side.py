"""JAX's rows and torch's rows of one run, made comparable: correctness first, then timing; every
row gets `wall_ms` from the same wall-clock method (wall_timing.py), and the ratios between rows
are taken on it."""
from common.exercise import row, throughput_metrics
from common.paths import scrub_paths

from . import jax_backend, wall_timing


def jax_row(ctx, dev, variant: str, params: dict, *, run, check, flops: float, nbytes: float, dtype: str,
            launches: int = 1, extra: dict | None = None) -> dict:
    """Check `run()`'s result (a 'failed' row without timing if wrong), then time it, then predict."""
    verdict = check()
    if not verdict["passed"]:
        return row(variant, params, "failed", verdict["reason"], check=verdict)
    timing = wall_timing.benchmark(run, wall_timing.jax_wait, quick=ctx.quick)
    metrics = throughput_metrics(timing.median_ms, flops, nbytes, jax_backend.roofs_for(ctx, dev, dtype), dtype,
                                 timing.min_ms)
    metrics.update(wall_ms=timing.median_ms, **jax_backend.describe(dev), **(extra or {}))
    return row(variant, params, check={**verdict, "note": jax_backend.FUNCTIONAL}, timing=timing, metrics=metrics,
               prediction=jax_backend.predict(ctx, dev, flops, nbytes, dtype, timing, launches))


def add_wall(ctx, r: dict, call) -> dict:
    """A torch row (timed by the harness) also timed the way JAX is: `wall_ms`."""
    if r["status"] == "ok":
        timing = wall_timing.benchmark(call, wall_timing.torch_wait(ctx), quick=ctx.quick)
        r["metrics"].update(wall_ms=timing.median_ms, wall_method=timing.method)
    return r


def compare(rows: list[dict], baselines: tuple[str, ...], key: str) -> dict | None:
    """metrics[key] = the fastest baseline row's wall time over each ok row's, x 100 (a percent: above
    100 the row is faster), and metrics[key + '_of'] its name. Returns the baseline row."""
    base = [r for r in rows if r["variant"] in baselines and r["status"] == "ok" and r["metrics"].get("wall_ms")]
    if not base:
        return None
    best = min(base, key=lambda r: r["metrics"]["wall_ms"])
    for r in rows:
        if r["status"] == "ok" and r["metrics"].get("wall_ms"):
            r["metrics"][key] = 100 * best["metrics"]["wall_ms"] / r["metrics"]["wall_ms"]
            r["metrics"][key + "_of"] = best["variant"]
    return best


def scrubbed(rows: list[dict]) -> list[dict]:
    """Rows whose reasons (a library's error message) carry no absolute path: a record may not."""
    for r in rows:
        if r.get("reason"):
            r["reason"] = scrub_paths(r["reason"])
        if (r.get("check") or {}).get("reason"):
            r["check"]["reason"] = scrub_paths(r["check"]["reason"])
    return rows
