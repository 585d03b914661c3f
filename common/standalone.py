"""Running one exercise module on its own: `python -m phases.phase2_cuda.matmul`.

Checks the exercise on small, irregular parameters against its reference and prints a timing
table (timed by common/timing.py through the exercise's own `measure`). No record is written:
this is the quick look a kernel author takes while editing, not a benchmark.
"""
import sys

from .formats import markdown, num


def main(exercise, params: dict, variants: tuple[str, ...] = ()) -> int:
    """Run `exercise` with its quick parameters overridden by `params`; print one line per row;
    exit status 1 when a row failed its check, 3 when nothing could run here."""
    import torch

    from .errors import LabError, Skip
    from .runner import make_context
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        ctx = make_context(device, variants=variants, quick=True)
        checked = exercise.resolve_params(on_cpu=not ctx.is_cuda, quick=True, overrides=params)
        unmet = exercise.needs.unmet(ctx)
        if unmet:
            print(f"{exercise.id}: skipped: {unmet}")
            return 3
        result = exercise.run(ctx, checked)
    except (LabError, Skip) as exc:
        print(f"{exercise.id}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, LabError) else 3
    rows = [[r["variant"], ", ".join(f"{k}={v}" for k, v in r["params"].items() if not isinstance(v, (list, dict))),
             r["status"] if r["status"] == "ok" else f"{r['status']}: {r['reason']}",
             num((r.get("metrics") or {}).get("ms"), 4),
             num(((r.get("prediction") or {}).get("measured_over_predicted")), 3)] for r in result.rows]
    print(f"{exercise.id} on {ctx.hardware_key} (quick timing, no record written)\n")
    print(markdown(rows, ["variant", "params", "check", "ms", "measured/predicted"]))
    return 1 if any(r["status"] == "failed" for r in result.rows) else 0


def run_alone(exercise, params: dict, variants: tuple[str, ...] = ()) -> None:
    sys.exit(main(exercise, params, variants))
