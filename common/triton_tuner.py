"""The autotuner for Triton kernels: the fastest of a kernel's candidate configs that compiles and
computes the right answer, timed with the lab's own harness, and every candidate's fate kept for
the record."""
from .errors import LabError
from .triton_shim import interpreting


def launch_options(cfg: dict) -> dict:
    """The launch-time options of a config (the rest are the kernel's constexpr arguments)."""
    return {"num_warps": cfg.get("num_warps", 4), "num_stages": cfg.get("num_stages", 3)}


def label(cfg: dict) -> str:
    """'BLOCK_M=128 BLOCK_N=64 num_warps=8 num_stages=3 tma=True': one config, readable in a table."""
    return " ".join(f"{k}={v}" for k, v in cfg.items())


_TUNED: dict = {}


def tune(ctx, key, candidates: list[dict], launch, check, first_good: bool = False) -> tuple[dict, list[dict]]:
    """The fastest of `candidates` that compiles and passes `check(cfg)`, timed with the lab's own
    harness (short runs, L2 flushed). Returns (config, trials); trials list every candidate with
    its time or the reason it was dropped, so a record shows what the tuner saw.

    A config that fails to compile (too much shared memory, an unsupported feature on this Triton)
    or computes a wrong answer is dropped, not fatal: correctness gates tuning as it gates timing.
    Under the interpreter, or with first_good (a config already chosen elsewhere, with fallbacks),
    nothing is timed: the first candidate that passes is taken. A --quick run (a smoke test) tries
    only the first two candidates.
    """
    if key in _TUNED:
        return _TUNED[key]
    if getattr(ctx, "quick", False):
        candidates = candidates[:2]
    trials, passed = [], []                          # passed: (ms or None, cfg)
    for cfg in candidates:
        try:
            verdict = check(cfg)                     # compiles, runs on a poisoned output, compares
            if not verdict["passed"]:
                trials.append({"config": label(cfg), "ms": None, "error": f"check: {verdict['reason']}"})
                continue
            ms = None
            if not interpreting() and not first_good and len(candidates) > 1:
                ms = ctx.time(lambda: launch(cfg), warmup_ms=5.0, target_ms=25.0, min_samples=5,
                              max_samples=50).median_ms
            trials.append({"config": label(cfg), "ms": ms, "error": None})
            passed.append((ms, cfg))
            if interpreting() or first_good:
                break
        except Exception as exc:  # noqa: BLE001 - a config that cannot run is dropped, with why
            msg = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
            trials.append({"config": label(cfg), "ms": None,
                           "error": f"{type(exc).__name__}: {msg[-1][:200] if msg else ''}".strip()})
    if not passed:
        raise LabError(f"no candidate config ran correctly for {key}: "
                       + "; ".join(f"[{t['config']}] {t['error']}" for t in trials)[:800])
    timed = [p for p in passed if p[0] is not None]
    best = min(timed, key=lambda p: p[0])[1] if timed else passed[0][1]
    _TUNED[key] = (best, trials)
    return best, trials


def tuning_summary(trials: list[dict]) -> dict:
    """Compact form for a record's summary: config -> ms (or the error)."""
    return {t["config"]: (round(t["ms"], 5) if t["ms"] is not None else t["error"]) for t in trials}
