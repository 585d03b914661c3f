"""`lab run`: pick the device, match its spec sheet, run exercises, write one record each."""
import datetime as dt
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch

from . import env
from .cost import cost_block
from .errors import LabError, Skip
from .exercise import Context, Exercise, Result
from .hardware import get_spec, load_hardware, match_gpu
from .records import SCHEMA_VERSION


def make_context(device: str = "auto", hardware: str | None = None, variants=(), quick=False,
                 progress=None, results=None) -> Context:
    """Choose the device and its spec sheet. A GPU missing from hardware.yaml is an error (its
    roofline could not be drawn) unless --hardware names the entry to use."""
    if device not in ("auto", "cpu", "cuda"):
        raise LabError(f"--device must be auto, cpu or cuda, not '{device}'")
    if device == "cuda" and not torch.cuda.is_available():
        raise LabError("--device cuda: no CUDA GPU is visible on this machine")
    use_cuda = torch.cuda.is_available() and device != "cpu"
    specs = load_hardware()
    if not use_cuda:
        spec = get_spec(hardware, specs) if hardware else None
        if spec is not None and spec.kind != "cpu":
            raise LabError(f"--hardware {hardware} names a {spec.kind}, but this run is on the CPU")
        return Context(torch.device("cpu"), None, "cpu", tuple(variants), quick, progress, results)
    name = torch.cuda.get_device_name(0)
    spec = get_spec(hardware, specs) if hardware else match_gpu(name, specs)
    if spec is None:
        raise LabError(f"GPU '{name}' is not in hardware.yaml: add an entry for it "
                       f"(see the file's header) or pass --hardware KEY to use an existing one")
    return Context(torch.device("cuda", 0), spec, spec.key, tuple(variants), quick, progress, results)


def check_writable(results: Path) -> None:
    """Fail before any work if records could not be written."""
    try:
        results.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=results, prefix=".probe-"):
            pass
    except OSError as exc:
        raise LabError(f"results folder '{results}' is not writable: {exc.strerror}") from None


def hardware_block(ctx: Context, gpu: dict | None) -> dict:
    return {
        "key": ctx.hardware_key,
        "device": ctx.device.type,
        "name": gpu["name"] if (gpu and ctx.is_cuda) else (env.host_info()["cpu"] or "cpu"),
        "spec": ctx.spec.summary() if ctx.spec else None,
        "spec_matched": ctx.spec is not None,
        "gpu": gpu if ctx.is_cuda else None,
        "host": env.host_info(),
    }


def _status(rows: list[dict]) -> str:
    statuses = {r["status"] for r in rows}
    if "failed" in statuses:
        return "failed"
    return "ok" if "ok" in statuses else "skipped"


def device_memory_bytes(ctx: Context) -> int | None:
    """What one problem may hold at once: the GPU's memory, or the RAM the host has available."""
    return memory_bytes(ctx.device)


def memory_bytes(device: torch.device) -> int | None:
    """A CUDA device's total memory, or the RAM the host has available now (None if unknown)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def checked_params(exercises: list[Exercise], ctx: Context, overrides: dict) -> dict[str, dict]:
    """Every selected exercise's parameters, each value checked against its declaration, and the
    predicted memory of each runnable problem against the device's, before any work starts: a
    bad value or a problem that cannot fit ends the run with one line (exit 2), no record."""
    memory = device_memory_bytes(ctx)
    out = {}
    for ex in exercises:
        params = ex.resolve_params(ctx.device.type == "cpu", ctx.quick, overrides)
        footprint = ex.cpu_footprint_bytes if (not ctx.is_cuda and ex.cpu_footprint_bytes) else ex.footprint_bytes
        if footprint is not None and memory and ex.needs.unmet(ctx) is None:
            need = footprint(params)
            if need > memory:
                where = (f"this GPU has {memory / 2**30:.1f} GiB" if ctx.is_cuda
                         else f"this machine has {memory / 2**30:.1f} GiB of RAM available")
                raise LabError(f"{ex.id}: these parameters need about {need / 2**30:,.1f} GiB of "
                               f"{'GPU' if ctx.is_cuda else 'host'} memory at once (predicted from their sizes); "
                               f"{where}: choose smaller sizes with --param")
        out[ex.id] = params
    return out


def run_one(ex: Exercise, ctx: Context, params: dict, static: dict, usd_rate, rate_source,
            debug: bool = False) -> dict:
    """Run (or skip) one exercise with its checked parameters; return its record, not yet written."""
    recorded = ex.recorded_params(params)          # as given, before run() could touch the dict
    params = dict(params)
    started = dt.datetime.now(dt.timezone.utc)
    t0 = time.perf_counter()
    rows, summary, reason = [], {}, ex.needs.unmet(ctx)
    if reason is None:
        try:
            result = ex.run(ctx, params)
            if not isinstance(result, Result):
                raise TypeError(f"{ex.id}: run() must return a common.exercise.Result, not {type(result).__name__}")
            rows, summary = result.rows, result.summary
            if not rows:
                reason = "no variant selected" if ctx.variants else "produced no rows"
        except Skip as exc:                     # this machine cannot run it: a reason, not a failure
            rows, reason, summary = [], str(exc), {}
        except LabError as exc:
            rows, reason = [], str(exc)
            summary = {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - an exercise bug is recorded, not a crash
            if debug:
                traceback.print_exc()
            reason = type(exc).__name__ + (f": {str(exc).splitlines()[0]}" if str(exc).strip() else "")
            summary = {"error": reason}
            rows = []
    seconds = time.perf_counter() - t0
    if rows and ctx.is_cuda:                    # the summed workload prediction beside the one-roof one
        from .workload_rows import attach
        attach(ex.id, rows, ctx.ceilings(), ctx.spec, summary, recorded)
    conditions = {"gpu_after_run": env.gpu_conditions(0) if ctx.is_cuda and rows else None}
    if reason is not None and not rows:
        status = "failed" if "error" in summary else "skipped"
    else:
        status = _status(rows)
        if status == "skipped" and reason is None:
            reason = next((r["reason"] for r in rows if r.get("reason")), "every row was skipped")
        if status == "failed":
            bad = [r for r in rows if r["status"] == "failed"]
            reason = f"{len(bad)} of {len(rows)} rows failed; first: {bad[0]['variant']}: {bad[0]['reason']}"
    gpus = max(1, ctx.gpu_count) if ctx.is_cuda else 1
    return {
        "schema_version": SCHEMA_VERSION,
        "exercise": {"id": ex.id, "phase": ex.phase, "name": ex.name, "title": ex.title,
                     "bench_version": ex.bench_version},
        "status": status,
        "reason": reason,
        "params": recorded,
        "rows": rows,
        "summary": summary,
        "source": {"kind": "measured", "citation": None},
        "conditions": conditions,
        "hardware": static["hardware"],
        "software": static["software"],
        "provenance": {**static["git"], "command": static["command"],
                       "started_utc": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
                       "duration_s": round(seconds, 3), "quick": ctx.quick,
                       "variants": list(ctx.variants) or None},
        "cost": cost_block(usd_rate, rate_source, seconds, gpus),
    }


def static_blocks(ctx: Context, argv=None) -> dict:
    """Captured once per `lab run`: they do not change between exercises."""
    gpu = env.gpu_info() if ctx.is_cuda else None
    return {"hardware": hardware_block(ctx, gpu), "software": env.software_info(),
            "git": env.git_info(), "command": env.command_line(argv)}


def parse_overrides(pairs: list[str]) -> dict:
    import yaml
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise LabError(f"--param takes KEY=VALUE, got '{pair}'")
        key, value = pair.split("=", 1)
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise LabError(f"--param {key}: cannot parse value '{value}'") from None
    return out


def validate_selection(exercises: list[Exercise], overrides: dict, variants: tuple) -> None:
    for key in overrides:
        if not any(key in ex.params for ex in exercises):
            raise LabError(f"--param {key}: no selected exercise takes it")
    for v in variants:
        if not any(v in ex.variants for ex in exercises):
            known = sorted({x for ex in exercises for x in ex.variants})
            raise LabError(f"--variant {v}: no selected exercise has it (known: {', '.join(known) or 'none'})")
