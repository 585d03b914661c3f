"""The `lab` command: list, run, report, env, predict, and the commands phases add (serve).

User mistakes end in one line on stderr (`lab: ...`) and a non-zero exit, never a traceback.
Exit codes: 0 ok; 1 an exercise failed its check or crashed; 2 bad input; 3 nothing ran (all skipped).
"""
import argparse
import json
import math
import os
import signal
import sys
import threading

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from .errors import LabError, Terminated
from .phase_discovery import lab_commands, run_command

# Without a terminal (a pipe, a CI log) rich would squeeze tables to 80 columns and wrap them a
# word per line; there the width is unbounded and each row stays on one line.
console = Console(width=None if sys.stdout.isatty() else 100_000)
LISTING_COLUMNS = 120        # `lab list` piped: a table to read, wrapped within its cells, not one line per row
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 100_000)


def _terminate(signum, frame):
    """SIGTERM as an exception in the main thread: `finally` blocks stop child processes and
    remove temporary files before `lab` exits (the default action would skip them)."""
    raise Terminated()


class _Parser(argparse.ArgumentParser):
    def error(self, message):               # one line instead of usage + error
        raise LabError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="lab", description="The AI compute benchmark lab.")
    p.add_argument("--debug", action="store_true", help="show tracebacks of crashing exercises")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    ls = sub.add_parser("list", help="list exercises, what they need, and whether they can run here; "
                                     "with targets, each one's parameters and what they allow")
    ls.add_argument("targets", nargs="*", help="phases or exercises whose parameters to show")

    r = sub.add_parser("run", help="run phases or exercises and write one record each")
    r.add_argument("targets", nargs="+", help="phase number (1), phase1, phase1.elementwise, or all")
    r.add_argument("--variant", action="append", default=[], help="run only this variant (repeatable)")
    r.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="override a parameter, e.g. --param sizes=[1024,2048]")
    r.add_argument("--device", default="auto", help="auto (GPU if present), cuda or cpu")
    r.add_argument("--hardware", help="hardware.yaml key to use for this GPU (for GPUs it does not match)")
    r.add_argument("--results", help="results folder (default: results/ in the repo, or LAB_RESULTS_DIR)")
    r.add_argument("--usd-per-hour", type=float, help="what this machine costs you (or LAB_USD_PER_HOUR)")
    r.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not a benchmark")

    rep = sub.add_parser("report", help="regenerate README tables and plots from results/")
    rep.add_argument("--check", action="store_true", help="fail if README.md is not what results/ gives")
    rep.add_argument("--results", help="results folder")

    e = sub.add_parser("env", help="show the environment a record would capture")
    e.add_argument("--json", action="store_true")

    for command in lab_commands().values():      # a phase's own command parses its own flags
        sub.add_parser(command.name, add_help=False, help=command.help)

    pr = sub.add_parser("predict", help="both predictions (spec sheet, and calibrated from this GPU's ceilings "
                                         "record) for an exercise at any size, or for one op, before running")
    pr.add_argument("op", nargs="?", default="custom",
                    help="an exercise (phase1.elementwise), or matmul, elementwise, copy, custom")
    pr.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                    help="an exercise's parameter, e.g. --param sizes=[1024]")
    pr.add_argument("--results", help="results folder holding the ceilings record (default: results/)")
    pr.add_argument("--n", type=int, help="matmul: N of an N x N x N product; elementwise/copy: elements")
    pr.add_argument("--dtype", default="fp32", help="fp32, tf32, fp16, bf16, fp8, int8")
    pr.add_argument("--flops", type=float, help="custom: floating-point operations")
    pr.add_argument("--bytes", type=float, help="custom: bytes moved through device memory")
    pr.add_argument("--hardware", help="hardware.yaml key, or cpu for this CPU from its ceilings record "
                                        "(default: the GPU in this machine, else this CPU)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _main(argv, debug)
    finally:
        if previous is not None:                   # an in-process caller (a test) gets its own back
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str], debug: bool) -> int:
    try:
        rest = [a for a in argv if a != "--debug"]
        if rest[:1] and rest[0] in lab_commands():      # a phase's command: its own flags, parsed by it
            return run_command(lab_commands()[rest[0]], rest[1:])
        args = build_parser().parse_args(argv)
        if args.command is None:
            build_parser().print_help()
            return 2
        args.argv = ["lab", *argv]                 # recorded as provenance.command
        return {"list": cmd_list, "run": cmd_run, "report": cmd_report, "env": cmd_env,
                "predict": cmd_predict}[args.command](args)
    except LabError as exc:
        err_console.print(f"lab: {exc}", markup=False, highlight=False, soft_wrap=True)
        return exc.exit_code
    except Terminated:
        err_console.print("lab: stopped by SIGTERM; no record was written for the exercise in progress",
                          markup=False)
        return 143
    except KeyboardInterrupt:
        err_console.print("lab: interrupted", markup=False)
        return 130
    except Exception as exc:  # noqa: BLE001 - last resort: still one line unless --debug
        if debug:
            raise
        err_console.print(f"lab: internal error: {type(exc).__name__}: {exc} (rerun with --debug)",
                          markup=False, highlight=False, soft_wrap=True)
        return 1


# ------------------------------------------------------------------------------------ list
def cmd_list(args) -> int:
    import torch

    from .registry import all_exercises, select
    from .runner import make_context
    if args.targets:
        return _list_params(select(args.targets))
    ctx = make_context("cpu") if not torch.cuda.is_available() else None
    table = Table(title="Exercises", width=None if sys.stdout.isatty() else LISTING_COLUMNS)
    table.add_column("id", no_wrap=True)
    for col in ("title", "variants", "needs", "here"):
        table.add_column(col)
    for ex in all_exercises():
        needs = []
        if ex.needs.cuda:
            needs.append(("NVIDIA CUDA" if ex.needs.nvidia else "CUDA") + (f" x{ex.needs.gpus}" if ex.needs.gpus > 1 else ""))
        needs += list(ex.needs.tools) + list(ex.needs.modules) + list(ex.needs.env)
        reason = ex.needs.unmet(ctx) if ctx else _unmet_on_gpu(ex)
        if reason is None and ex.skips is not None:   # a skip its parameters decide (phase 4's backend)
            here = ctx or _gpu_context()
            reason = ex.skips(here, ex.resolve_params(not here.is_cuda, False, {}))
        table.add_row(ex.id, ex.title, ", ".join(ex.variants) or "-", ", ".join(needs) or "-",
                      "[green]runs[/]" if reason is None else f"[yellow]skips[/]: {reason}")
    console.print(table)
    return 0


def _list_params(exercises) -> int:
    """Each exercise's declared parameters: default (GPU, and CPU where it differs) and what is allowed."""
    for ex in exercises:
        table = Table(title=f"{ex.id}: {ex.title}")
        for col in ("parameter", "default", "on a CPU", "allowed"):
            table.add_column(col, no_wrap=col == "parameter")
        for name, spec in ex.schema.items():
            cpu = ex.cpu_params.get(name, spec.default)
            table.add_row(name, json.dumps(spec.default), json.dumps(cpu) if cpu != spec.default else "",
                          spec.allowed(), end_section=False)
        if not ex.schema:
            table.add_row("-", "", "", "no parameters")
        console.print(table, markup=False)
    return 0


def _gpu_context():
    import torch

    from .exercise import Context
    return Context(torch.device("cuda", 0), None, "gpu")


def _unmet_on_gpu(ex):
    return ex.needs.unmet(_gpu_context())


# ------------------------------------------------------------------------------------- run
def cmd_run(args) -> int:
    from .cost import hourly_rate
    from .paths import run_results_dir, shown_path
    from .records import write_record
    from .registry import select
    from .runner import (check_writable, checked_params, make_context, parse_overrides, run_one,
                         static_blocks, validate_selection)

    exercises = select(args.targets)
    overrides = parse_overrides(args.param)
    variants = tuple(args.variant)
    validate_selection(exercises, overrides, variants)
    if variants:                                   # --variant picks exercises too: those that have one
        exercises = [ex for ex in exercises if set(variants) & set(ex.variants)]
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=True)
    ctx = make_context(args.device, args.hardware, variants, args.quick, progress)
    local = args.quick or not ctx.is_cuda          # not results: kept out of results/ and the report
    ctx.results = results = run_results_dir(args.results, local=local)
    check_writable(results)
    params = checked_params(exercises, ctx, overrides)         # every value, before any work
    usd_rate, rate_source = hourly_rate(ctx.spec, args.usd_per_hour)
    where = f"{ctx.spec.name} ({ctx.hardware_key})" if ctx.spec else "CPU (roofs measured on this machine)"
    console.print(f"[bold]lab run[/] on {where}: {len(exercises)} exercise(s)" + (r" \[quick]" if args.quick else ""))
    if local and not (args.results or os.environ.get("LAB_RESULTS_DIR")):
        why = "a --quick smoke run" if args.quick else "a CPU run"
        console.print(f"records go to {shown_path(results, results)}/ ({why}: git-ignored, never in the READMEs; "
                      "--results results to keep them with the lab's)", markup=False, highlight=False)
    static = static_blocks(ctx, args.argv)

    summary = Table(title="Results")
    for col in ("exercise", "status", "rows", "seconds", "record / reason"):
        summary.add_column(col)
    failed = ran = 0
    with progress:
        overall = progress.add_task("exercises", total=len(exercises))
        for ex in exercises:
            progress.update(overall, description=f"{ex.id}")
            record = run_one(ex, ctx, params[ex.id], static, usd_rate, rate_source, debug=args.debug)
            path = write_record(record, results)
            progress.advance(overall)
            style = {"ok": "green", "failed": "red", "skipped": "yellow"}[record["status"]]
            if record["status"] == "skipped":
                console.print(f"skip {ex.id}: {record['reason']}", markup=False, highlight=False)
            else:
                ran += 1
            failed += record["status"] == "failed"
            note = shown_path(path, results) if record["status"] != "skipped" else record["reason"]
            if record["status"] == "failed":
                note = f"{shown_path(path, results)}: {record['reason']}"
            summary.add_row(ex.id, f"[{style}]{record['status']}[/]", str(len(record["rows"])),
                            f"{record['provenance']['duration_s']:.1f}", Text(note))     # as written, no markup
    console.print(summary)
    if failed:
        return 1
    if ran == 0:
        err_console.print("lab: nothing ran: every selected exercise was skipped (reasons above)",
                          markup=False)
        return 3
    return 0


# ---------------------------------------------------------------------------------- report
def cmd_report(args) -> int:
    from .report import regenerate
    return regenerate(check=args.check, results=args.results, echo=console.print)


# ------------------------------------------------------------------------------------- env
def cmd_env(args) -> int:
    from . import env
    info = {"software": env.software_info(), "gpu": env.gpu_info(), "host": env.host_info(),
            "git": env.git_info()}
    import torch

    from .hardware import load_hardware, match_gpu
    if info["gpu"]:
        spec = match_gpu(info["gpu"]["name"], load_hardware())
        info["hardware_yaml_entry"] = spec.key if spec else None
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    table = Table(title="Environment")
    table.add_column("block")
    table.add_column("field")
    table.add_column("value")
    for block, values in info.items():
        if isinstance(values, dict):
            for k, v in values.items():
                table.add_row(block, k, str(v))
        else:
            table.add_row(block, "", str(values) if values is not None else
                          ("no CUDA GPU visible" if not torch.cuda.is_available() else "-"))
    console.print(table)
    if info["gpu"] and info.get("hardware_yaml_entry") is None:
        err_console.print(f"lab: GPU '{info['gpu']['name']}' is not in hardware.yaml", markup=False)
    return 0


# --------------------------------------------------------------------------------- predict
def _predict_spec(args):
    import torch

    from .hardware import get_spec, load_hardware, match_gpu
    specs = load_hardware()
    if args.hardware:
        return get_spec(args.hardware, specs)
    if torch.cuda.is_available():
        spec = match_gpu(torch.cuda.get_device_name(0), specs)
        if spec is None:
            raise LabError(f"GPU '{torch.cuda.get_device_name(0)}' is not in hardware.yaml; pass --hardware KEY")
        return spec
    raise LabError("no GPU here to predict for; pass --hardware KEY (e.g. --hardware h200_sxm)")


def _predicts_for_cpu(args) -> bool:
    """`--hardware cpu`, or no --hardware on a machine without a GPU: predict for this CPU."""
    import torch
    return args.hardware == "cpu" or (not args.hardware and not torch.cuda.is_available())


def _cpu_ceilings(args) -> dict:
    """The newest full (not --quick) phase1.ceilings record of this CPU: from --results, else
    local-results/ (where a CPU run writes), else results/. A CPU has no spec sheet: its roofs are
    measured, so without that record there is nothing to predict from."""
    from .calibration import ceilings_by_hardware
    from .paths import results_dir, run_results_dir, shown_path
    from .records import is_smoke, load_records
    for folder in dict.fromkeys([run_results_dir(args.results, local=True), results_dir(args.results)]):
        found = ceilings_by_hardware([r for r in load_records(folder, exercise="phase1.ceilings", hardware="cpu")
                                      if not is_smoke(r)]).get("cpu")
        if found:                                  # named by the folder it is in, not always results/
            return {**found, "record": shown_path(folder / found["record"].removeprefix("results/"), folder)}
    raise LabError("no phase1.ceilings record for this CPU yet (a CPU has no spec sheet: its roofs are "
                   "measured): run `lab run phase1.ceilings` first, or pass --hardware KEY for a GPU's spec sheet")


def cmd_predict_exercise(args) -> int:
    """Every row an exercise would time with these parameters, with both predictions."""
    from . import roofline
    from .calibration import ceilings_by_hardware
    from .hardware import DTYPES
    from .paths import results_dir
    from .records import is_smoke, load_records
    from .registry import select
    from .runner import parse_overrides, validate_selection
    chosen = select([args.op])
    if len(chosen) != 1:
        raise LabError(f"`lab predict` takes one exercise, not '{args.op}' ({len(chosen)} exercises)")
    ex = chosen[0]
    if ex.work is None:
        raise LabError(f"{ex.id} declares no work(params) (its rows' FLOPs and bytes are known only once it runs)")
    on_cpu = _predicts_for_cpu(args)
    spec = None if on_cpu else _predict_spec(args)
    overrides = parse_overrides(args.param)
    validate_selection([ex], overrides, ())
    params = ex.resolve_params(on_cpu=on_cpu, quick=False, overrides=overrides)
    if on_cpu:                                     # no spec sheet: the calibrated model alone
        ceilings, roofs, name = _cpu_ceilings(args), None, "this CPU (from its ceilings record; no spec sheet)"
    else:
        ceilings = ceilings_by_hardware([r for r in load_records(results_dir(args.results), exercise="phase1.ceilings",
                                                                 hardware=spec.key) if not is_smoke(r)]).get(spec.key)
        roofs = roofline.Roofs(spec.figure("memory_bandwidth_gbps").value, {d: spec.peak(d).value for d in DTYPES},
                               f"hardware.yaml:{spec.key}")
        name = spec.name
    table = Table(title=f"{ex.id} on {name}: predicted before running"
                        + ("" if ceilings else " (no phase1.ceilings record for it yet: spec sheet only)"))
    for col in ("row", "FLOPs", "bytes", "dtype", "spec ms", "spec bound", "calibrated ms", "calibrated bound"):
        table.add_column(col, justify="left" if col in ("row", "dtype") or "bound" in col else "right")
    for w in ex.work(params):
        p = roofline.predict(w.flops, w.bytes, roofs, w.dtype) if roofs else {"predicted_ms": None, "bound": "-"}
        c = roofline.calibrated(w.flops, w.bytes, w.dtype, ceilings, working_set_bytes=w.working_set_bytes or w.bytes,
                                warm=w.warm or on_cpu, graph_reps=w.graph_reps,     # nothing flushes a CPU's caches
                                launches=w.launches) if ceilings else {}
        table.add_row(w.label, f"{w.flops:.4g}", f"{w.bytes:.4g}", w.dtype or "-", _fmt(p["predicted_ms"]), p["bound"],
                      _fmt(c.get("predicted_ms")), c.get("bound", "-"))
    console.print(table)
    if ceilings:
        console.print(f"calibrated from {ceilings['record']}")
    if ex.workloads is not None:
        _print_summed(ex, params, ceilings, None if on_cpu else spec, args.results)
    return 0


def _print_summed(ex, params: dict, ceilings: dict | None, spec, results=None) -> None:
    """The summed prediction of each row (common/workload.py) and the kernels it thinks dominate. A
    workloads function that takes `results` and `hardware` also gets the results folder and the GPU's
    key (to read what it needs of committed records: tensor_parallel's measured all-reduces)."""
    import inspect
    from . import workload
    if not ceilings or spec is None:
        why = "none for this GPU yet" if spec else "a CPU has no spec sheet for the exp rate"
        console.print(f"summed prediction: needs a GPU's phase1.ceilings record ({why}); "
                      "pass --hardware h200_sxm or h100_sxm")
        return
    table = Table(title=f"{ex.id}: summed prediction (each kernel's calibrated roofline, plus host), before running")
    for col in ("row", "kernels", "launches", "summed ms", "one roof of its totals ms", "bound", "top kernels (share)"):
        table.add_column(col, justify="right" if "ms" in col or col in ("kernels", "launches") else "left")
    fallbacks, notes = [], set()
    extra = {}
    if "results" in inspect.signature(ex.workloads).parameters:
        from .paths import results_dir
        extra = {"results": results_dir(results), "hardware": spec.key}
    rows = ex.workloads(params, **extra)
    if not rows:
        console.print(f"summed prediction: {ex.id} models no rows with these parameters (its kernel lists cover "
                      "the full-size models)")
        return
    for label, w in rows:
        p = workload.predict(w, ceilings, spec.peak("fp32").value)
        fallbacks += [f for f in p["fallbacks"] + p["notes"] if f not in fallbacks]
        notes.update(p["notes"])
        top = ", ".join(f"{t['kernel']} {100 * t['share']:.0f}%" for t in p["top"])
        table.add_row(label, str(p["kernels"]), str(p["launches"]), _fmt(p["predicted_ms"]), _fmt(p["one_roof_ms"]),
                      p["bound"] or "-", top)
    console.print(table)
    for f in fallbacks:
        console.print(f"{'note' if f in notes else 'fallback'}: {f}", markup=False, highlight=False, soft_wrap=True)


def cmd_predict(args) -> int:
    from . import roofline
    from .checks import BYTES_PER_ELEMENT
    if args.op not in ("matmul", "elementwise", "copy", "custom"):
        return cmd_predict_exercise(args)
    if args.param:
        raise LabError("--param goes with an exercise (lab predict phase1.elementwise --param sizes=[1024])")
    on_cpu = _predicts_for_cpu(args)
    spec = None if on_cpu else _predict_spec(args)
    if args.dtype not in BYTES_PER_ELEMENT or args.dtype == "fp64":
        raise LabError(f"--dtype must be one of fp32, tf32, fp16, bf16, fp8, int8, not '{args.dtype}'")
    size = BYTES_PER_ELEMENT[args.dtype]
    if args.op != "custom" and args.n is None:
        raise LabError(f"`lab predict {args.op}` needs --n")
    if args.op != "custom" and args.n < 1:
        raise LabError(f"--n must be a positive integer, got {args.n}")
    for name in ("flops", "bytes"):
        value = getattr(args, name)
        if value is not None and not (value >= 0 and math.isfinite(value)):
            raise LabError(f"--{name} must be a finite number >= 0, got {value}")
    if args.op == "matmul":      # C = A @ B, all N x N: 2N^3 FLOPs; read A and B, write C once
        flops, nbytes = 2 * args.n**3, 3 * args.n**2 * size
    elif args.op == "elementwise":  # c = a * b: 1 FLOP per element; read 2, write 1
        flops, nbytes = args.n, 3 * args.n * size
    elif args.op == "copy":
        flops, nbytes = 0, 2 * args.n * size
    else:
        if args.flops is None or args.bytes is None:
            raise LabError("`lab predict` needs an op (matmul, elementwise, copy) or both --flops and --bytes")
        flops, nbytes = args.flops, args.bytes
    if on_cpu:                                     # the CPU's measured ceilings stand in for a spec sheet
        ceilings = _cpu_ceilings(args)
        roofs = roofline.Roofs(ceilings["hbm_gbps"], dict(ceilings.get("matmul_tflops") or {}), ceilings["record"])
        name = "this CPU (its ceilings record: DRAM copy bandwidth, library matmul rate)"
        if flops and roofs.peak(args.dtype) is None:
            raise LabError(f"this CPU's ceilings record has no {args.dtype} matmul rate; it measured "
                           f"{', '.join(roofs.peak_tflops) or 'none'}")
    else:
        bw = spec.figure("memory_bandwidth_gbps")
        if bw.value is None:
            raise LabError(f"hardware.yaml has no memory bandwidth for {spec.key}")
        roofs = roofline.Roofs(bw.value, {args.dtype: spec.peak(args.dtype).value}, f"hardware.yaml:{spec.key}")
        name = spec.name
    p = roofline.predict(flops, nbytes, roofs, args.dtype)
    table = Table(title=f"Roofline prediction on {name} ({args.op}, {args.dtype})")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    rows = [("FLOPs", f"{flops:.4g}"), ("bytes moved", f"{nbytes:.4g}"),
            ("intensity (FLOP/byte)", _fmt(p["intensity_flop_per_byte"])),
            ("ridge point (FLOP/byte)", _fmt(p["ridge_flop_per_byte"])),
            ("memory time (ms)", _fmt(p["memory_ms"])), ("compute time (ms)", _fmt(p["compute_ms"])),
            ("predicted time (ms)", _fmt(p["predicted_ms"])), ("bound", p["bound"])]
    if flops and p["predicted_ms"]:
        rows.append(("attainable TFLOP/s", _fmt(flops / (p["predicted_ms"] * 1e9))))
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    return 0


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4g}"


if __name__ == "__main__":
    sys.exit(main())
