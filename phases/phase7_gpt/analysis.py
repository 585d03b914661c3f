"""Phase 7's verdicts and derived numbers, torch-free: the exercises store what these return in
their records, and the report calls the same functions on committed records that predate a field.

Inputs are plain values from a record (metrics, curves as [step, train, val] lists), so one code
path serves a fresh run and a record read back from results/.
"""
GOAL_TOKENS_PER_S = 1_000_000        # the lab's throughput bar for the 30M model on one GPU
ROSE_BY = 0.01                       # nats: a final validation loss this far above the best has climbed back


def compiled(train: dict, compile_error) -> bool:
    """Whether the step really ran compiled (asked for, and the compiler did not fall back)."""
    return bool(train.get("compile")) and not compile_error


def overfit_verdict(best_val, final_val) -> dict:
    """How far the final validation loss sits above the best one, and whether it climbed back."""
    if best_val is None or final_val is None:
        return {"val_rise": None, "val_rose": None}
    return {"val_rise": final_val - best_val, "val_rose": final_val > best_val + ROSE_BY}


def overfit_summary(by: dict, seed_tokens_per_s: float, goal_tokens_per_s: float = GOAL_TOKENS_PER_S) -> dict:
    """Ratios across the overfit exercise's ok rows (variant -> metrics)."""
    out = {}
    if "large" in by and "small" in by:
        out["small_over_large_tokens_per_s"] = by["small"]["tokens_per_s"] / by["large"]["tokens_per_s"]
    if "throughput" in by and "throughput_eager" in by:
        out["compile_speedup"] = by["throughput"]["tokens_per_s"] / by["throughput_eager"]["tokens_per_s"]
    if "throughput" in by:
        tps = by["throughput"]["tokens_per_s"]
        out.update(throughput_tokens_per_s=tps, throughput_over_seed_30m=tps / seed_tokens_per_s,
                   goal_tokens_per_s=goal_tokens_per_s, goal_met=tps >= goal_tokens_per_s)
    return out


def scaling_span(points: list[tuple[str, int, float]]) -> dict:
    """From (size, non-embedding N, best validation loss) points: the smallest and largest size,
    how many times larger the largest is, and the sizes that did worse than the next smaller one."""
    if not points:
        return {}
    order = sorted(points, key=lambda p: p[1])
    lo, hi = order[0], order[-1]
    return {"smallest": lo[0], "largest": hi[0], "n_ratio": hi[1] / lo[1],
            "loss_smallest": lo[2], "loss_largest": hi[2],
            "non_monotonic": [b[0] for a, b in zip(order, order[1:]) if b[2] > a[2]]}


def outcome(m: dict, control: dict | None, frozen_below: float) -> dict:
    """What a failure run did, in one phrase, and its gap to the control (percent of the control's loss)."""
    first = m["curve"][0][2] if m.get("curve") else None
    best = m.get("best_val_loss")
    out = {"outcome": None, "val_drop": (first - best) if (first is not None and best is not None) else None}
    if m.get("first_nonfinite_step") is not None:
        out["outcome"] = f"diverged: non-finite loss at step {m['first_nonfinite_step']}"
    elif out["val_drop"] is not None and abs(out["val_drop"]) < frozen_below:
        out["outcome"] = f"frozen: best validation loss within {frozen_below} of its initial {first:.3f}"
    elif out["val_drop"] is not None and out["val_drop"] < 0:
        out["outcome"] = "got worse than at initialization"
    else:
        out["outcome"] = "learned"
    if control and best is not None and control.get("best_val_loss"):
        out["best_val_vs_control_pct"] = 100 * (best - control["best_val_loss"]) / control["best_val_loss"]
    fin, cfin = m.get("final_val_loss"), (control or {}).get("final_val_loss")
    if fin is not None and cfin:
        out["final_val_vs_control_pct"] = 100 * (fin - cfin) / cfin
    return out
