"""Check a workload's kernel list against what the GPU runs: torch.profiler over a few steps of one
exercise's workload, its kernels grouped by kind beside the summed model's (common/kernel_trace.py).

    python -m common.kernel_trace_check --exercise phase5.ttft_decode [--param model=llama-3.1-8b]
        [--steps 5] [--hardware h200_sxm] [--out kernel_trace.json]

Prints a table (launches and time per step, and each side's share, per group) and the largest
traced kernels, and writes the whole comparison as JSON. The steps a phase can trace are its
`TRACE_STEPS` (`phases/<phase>/trace_steps.py` or one folder down): exercise id ->
step(params, device) returning (a callable running one step, the model's Workload for it, a label).
The model's times are at this machine's newest phase1.ceilings record. Needs a CUDA GPU; bad
input gets one line and exit 2 before any work.
"""
import argparse
import importlib
import json
import sys
from pathlib import Path

from . import kernel_trace
from .errors import LabError

CODE_ROOT = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 3


def trace_steps() -> dict:
    """exercise id -> its step builder, from every phase's trace_steps.py."""
    out = {}
    phases = CODE_ROOT / "phases"
    for path in sorted([*phases.glob("phase*/trace_steps.py"), *phases.glob("phase*/*/trace_steps.py")]):
        mod = importlib.import_module(".".join(path.relative_to(CODE_ROOT).with_suffix("").parts))
        out.update(getattr(mod, "TRACE_STEPS", {}))
    return out


def parse_params(pairs: list[str]) -> dict:
    """--param key=value pairs; a value is read as JSON where it parses (numbers, lists), else text."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise LabError(f"--param '{pair}' is not key=value")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def kernels_of(events) -> list[tuple[str, float, int]]:
    """(name, total device µs, calls) of every device-side event (kernels, copies, memsets) of a
    profiler's event list, summed by name."""
    totals: dict = {}
    for e in events:
        if str(getattr(e, "device_type", "")).split(".")[-1] != "CUDA":
            continue
        span = getattr(e, "time_range", None)          # a device event's own start and end
        us = span.elapsed_us() if span is not None else getattr(e, "device_time_total", 0.0)
        t, n = totals.get(e.name, (0.0, 0))
        totals[e.name] = (t + float(us), n + 1)
    return [(name, t, n) for name, (t, n) in totals.items()]


def profile(step, steps: int, device):
    """The device events of `steps` calls of `step` after WARMUP_STEPS unprofiled ones."""
    import torch
    from torch.profiler import ProfilerActivity
    for _ in range(WARMUP_STEPS):
        step()
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
    return kernels_of(prof.events())


def _setup(args):
    """(step builder, spec, ceilings) or a LabError, before any GPU work."""
    known = trace_steps()
    if args.exercise not in known:
        raise LabError(f"no trace step for '{args.exercise}'; known: {', '.join(sorted(known)) or 'none'}")
    if args.steps < 1:
        raise LabError(f"--steps must be at least 1, not {args.steps}")
    import torch
    if not torch.cuda.is_available():
        raise LabError("kernel_trace_check needs a CUDA GPU (the profiler traces its kernels)")
    from .calibration import ceilings_by_hardware
    from .hardware import get_spec, load_hardware, match_gpu
    from .paths import results_dir
    from .records import is_smoke, load_records
    specs = load_hardware()
    spec = get_spec(args.hardware, specs) if args.hardware else match_gpu(torch.cuda.get_device_name(0), specs)
    if spec is None:
        raise LabError(f"GPU '{torch.cuda.get_device_name(0)}' is not in hardware.yaml; pass --hardware KEY")
    records = [r for r in load_records(results_dir(args.results)) if not is_smoke(r)]
    ceilings = ceilings_by_hardware(records).get(spec.key)
    if not ceilings:
        raise LabError(f"no phase1.ceilings record for {spec.key}: run `lab run phase1.ceilings` first")
    return known[args.exercise], spec, ceilings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m common.kernel_trace_check", description=__doc__.split("\n")[0])
    p.add_argument("--exercise", required=True, help="an exercise with a trace step (e.g. phase5.ttft_decode)")
    p.add_argument("--param", action="append", default=[], help="key=value for the step (repeatable)")
    p.add_argument("--steps", type=int, default=5, help="profiled steps (default 5, after 3 unprofiled)")
    p.add_argument("--hardware", help="hardware.yaml key (default: matched from the GPU's name)")
    p.add_argument("--results", help="results folder holding the ceilings record (default: results/)")
    p.add_argument("--out", default="kernel_trace.json", help="where the JSON goes (default kernel_trace.json)")
    args = p.parse_args(argv)
    try:
        params = parse_params(args.param)
        build, spec, ceilings = _setup(args)
        import torch
        device = torch.device("cuda")
        step, w, label = build(params, device)
        result = kernel_trace.compare(profile(step, args.steps, device), args.steps, w, ceilings,
                                      spec.peak("fp32").value)
    except LabError as exc:
        print(f"kernel_trace_check: {exc}", file=sys.stderr)
        return 2
    result.update(exercise=args.exercise, label=label, params=params, hardware=spec.key)
    print(f"{args.exercise}: {label} ({result['workload']}), {args.steps} steps on {spec.key}")
    print(kernel_trace.table(result))
    print("\nlargest traced kernels (ms / step):")
    for t in result["trace_top"]:
        print(f"  {t['ms_per_step']:9.4f}  x{t['calls_per_step']:<6g} {t['group']:9s} {t['kernel'][:110]}")
    for f in result["fallbacks"]:
        print(f"fallback: {f}")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
