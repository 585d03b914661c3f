"""From one `lab run` process to N ranks and back: backend choice, torchrun, failures, the link roof.

`lab run` runs an exercise in one process and writes one record. A phase-4 exercise's run() starts
its ranks itself, once per world size, with torchrun (the launcher that also spans nodes):

    python -m torch.distributed.run --standalone --nproc_per_node N \
        -m phases.phase4_distributed.worker <task> '<job json>' <result file>

Every rank measures; rank 0 gathers and writes the raw measurements as JSON; run() reads them and
turns them into rows (checks, timings, predictions) here in the parent, where the spec sheet is.

Backend (param `backend`):
- auto: NCCL on GPUs when this machine has at least 2; otherwise the exercise is skipped with one
  line saying why. Nothing silently falls back to the CPU.
- nccl: the same, stated explicitly.
- gloo: the CPU version (small sizes, CPU processes): for CI and laptops; on a GPU machine add
  --device cpu so the CPU sizes apply.
World sizes (param `world_sizes`): auto = [2, every visible GPU] without duplicates ([2, 4] on four
GPUs, [2] on two); with gloo, [2, 4]. An explicit list runs what fits and skips the rest.

Failures never hang the lab: a rank that raises writes one line to `error.<rank>` and exits; a
rank that dies without a word (segfault, os._exit, OOM-kill) is reported by torchrun, which stops
the others (its "Root Cause" block names the rank); a job that is still running after `timeout_s`
is killed (torchrun's process group, then any rank still alive, by the pids the ranks wrote) and
the error names what each rank was doing last (`stage.<rank>`).
"""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import roofline
from common.errors import LabError
from common.exercise import row
from common.paths import REPO_ROOT

BACKENDS = ("auto", "nccl", "gloo")
NO_GPU = "no GPU in this run: needs 2 CUDA GPUs for NCCL (the CPU version runs only when asked: --param backend=gloo)"


@dataclass
class Plan:
    backend: str | None
    world_sizes: list[int] = field(default_factory=list)
    skipped: list[tuple[int | None, str]] = field(default_factory=list)   # (world size, why)

    def skip_rows(self) -> list[dict]:
        return [row("launch", {"world_size": n, "backend": self.backend}, "skipped", why)
                for n, why in self.skipped]


def plan(ctx, params: dict) -> Plan:
    """Which backend and which world sizes this machine can run; what it cannot, and why."""
    backend = params.get("backend", "auto")
    if backend not in BACKENDS:
        raise LabError(f"--param backend must be one of {', '.join(BACKENDS)}, not '{backend}'")
    if backend == "auto":
        if not ctx.is_cuda:
            return Plan(None, skipped=[(None, NO_GPU)])
        backend = "nccl"
    gpus = ctx.gpu_count
    if backend == "nccl":
        if not ctx.is_cuda:
            return Plan("nccl", skipped=[(None, "--param backend=nccl needs CUDA GPUs; this run is on the CPU "
                                                "(--param backend=gloo runs the CPU version)")])
        if gpus < 2:
            return Plan("nccl", skipped=[(None, f"needs 2 GPUs for NCCL; this machine has {gpus} "
                                                "(--device cpu --param backend=gloo runs the CPU version)")])
    if backend == "gloo" and ctx.is_cuda:
        return Plan("gloo", skipped=[(None, "--param backend=gloo runs the CPU version: add --device cpu "
                                            "so its CPU sizes apply")])
    asked = params.get("world_sizes", "auto")
    if asked == "auto":
        sizes = sorted({2, gpus}) if backend == "nccl" else [2, 4]
    else:
        asked = [asked] if isinstance(asked, int) else list(asked)
        if not asked or any(not isinstance(n, int) or n < 2 for n in asked):
            raise LabError(f"--param world_sizes must be 'auto' or a list of integers >= 2, not {asked}")
        sizes = sorted(set(asked))
    p = Plan(backend)
    for n in sizes:
        if backend == "nccl" and n > gpus:
            p.skipped.append((n, f"{n} ranks need {n} GPUs; this machine has {gpus}"))
        else:
            p.world_sizes.append(n)
    return p


# ------------------------------------------------------------------------------ the link as a roof
def link_roofs(ctx, backend: str, dtype: str | None = None) -> roofline.Roofs:
    """The roofline for communication: bandwidth = the per-GPU one-way link bandwidth from
    hardware.yaml (interconnect_one_way_gbps), so predict(flops, wire_bytes, ...) gives the
    fastest the link allows, and measured/predicted is how far from it we landed. The peaks (for
    the DDP step's compute) are the GPU's. On CPU processes (gloo on one host) the bytes move
    through memory: the roof is this machine's measured copy bandwidth."""
    base = ctx.roofs(dtype)
    fig = ctx.spec.figure("interconnect_one_way_gbps") if ctx.spec is not None else None
    if backend == "nccl" or (fig is not None and fig.value):
        if fig is None or not fig.value:
            raise LabError(f"hardware.yaml has no interconnect_one_way_gbps for {ctx.hardware_key}: "
                           "the link roof cannot be drawn")
        return roofline.Roofs(
            bandwidth_gbps=fig.value, peak_tflops=base.peak_tflops,
            source=f"hardware.yaml:{ctx.spec.key} interconnect_one_way_gbps as the bandwidth roof "
                   f"(the link, not HBM); peaks from the same entry",
            bandwidth_source=ctx.spec.cite(fig), peak_sources=base.peak_sources)
    return roofline.Roofs(
        bandwidth_gbps=base.bandwidth_gbps, peak_tflops=base.peak_tflops,
        source="measured on this machine: gloo ranks on one host move bytes through memory, so the "
               "copy bandwidth is the bandwidth roof (no link on a spec sheet)",
        bandwidth_source="measured: torch copy", peak_sources=base.peak_sources)


# ------------------------------------------------------------------------------ torchrun
def worker_command(task: str, n: int, job: dict, result: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc_per_node", str(n), "--max_restarts", "0",
            "-m", "phases.phase4_distributed.worker", task, json.dumps(job), str(result)]


class Job:
    """One torchrun launch: started, watched, killed if need be, diagnosed."""

    def __init__(self, task: str, n: int, backend: str, params: dict, label: str, nccl_debug: bool = False,
                 extra_env: dict | None = None):
        self.task, self.n, self.label = task, n, label
        self._tmp = tempfile.TemporaryDirectory(prefix="lab-phase4-")
        self.dir = Path(self._tmp.name)
        self.result = self.dir / "result.json"
        job = {"backend": backend, "params": params, "work_dir": str(self.dir)}
        env = dict(os.environ)                 # NCCL_* and TORCH_* settings of the machine pass through
        env.update(extra_env or {})            # an experiment's own settings (never NVLS/multicast ones)
        if nccl_debug:                         # rank 0 logs NCCL's algorithm choice for every collective
            env.update({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "TUNING",
                        "NCCL_DEBUG_FILE": str(self.dir / "nccl.%h.%p.log")})
        self._out = open(self.dir / "torchrun.out", "w")
        self._err = open(self.dir / "torchrun.err", "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(worker_command(task, n, job, self.result), cwd=REPO_ROOT, env=env,
                                     stdout=self._out, stderr=self._err, start_new_session=True)

    def markers(self, name: str) -> dict[int, str]:
        """{rank: content} of the files `<name>.<rank>` the ranks wrote."""
        out = {}
        for p in self.dir.glob(f"{name}.*"):
            try:
                out[int(p.suffix[1:])] = p.read_text().strip()
            except (ValueError, OSError):
                continue
        return out

    def kill(self) -> None:
        """SIGTERM torchrun's process group (its agent then stops the ranks), SIGKILL it after a
        grace period, then SIGKILL any rank still alive by the pid it wrote: each rank runs in a
        session of its own, so the group signal alone does not reach it."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                self.proc.wait(timeout=5.0)
                break
            except subprocess.TimeoutExpired:
                continue
        for pid in self.markers("pid").values():
            try:
                cmdline = Path(f"/proc/{int(pid)}/cmdline").read_bytes()
            except (OSError, ValueError):
                continue                            # already gone
            if b"phases.phase4_distributed.worker" in cmdline:      # still one of our ranks
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def close(self) -> None:
        for fh in (self._out, self._err):
            fh.close()
        self._tmp.cleanup()

    def stages(self) -> str:
        st = self.markers("stage")
        return "; ".join(f"rank {r} at '{st[r]}'" for r in sorted(st)) or "no rank reported any progress"

    def diagnose(self, rc: int) -> str:
        return diagnose((self.dir / "torchrun.err").read_text(errors="replace"), self.markers("error"),
                        self.n, self.label, rc)


def diagnose(torchrun_err: str, errors: dict[int, str], n: int, label: str, rc: int) -> str:
    """One line naming the rank that failed and what happened to it. torchrun lists every failed
    rank (exit code, signal); a rank that raised also wrote error.<rank>. The culprit is a rank that
    died without a Python error (a crash: its peers only raise "connection reset" after it), else
    torchrun's root cause if it raised, else the lowest rank that raised."""
    died = {}
    for m in re.finditer(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)[^\n]*?(?:\((SIG\w+)\))?[ \t]*$",
                         torchrun_err, re.M):
        died[int(m.group(1))] = (int(m.group(2)), m.group(3))
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", torchrun_err, re.S)
    head = f"{label}: "
    silent = sorted(r for r, (_, sig) in died.items() if r not in errors and sig != "SIGTERM")
    if silent:
        r = silent[0]
        code, sig = died[r]
        then = "".join(f"; rank {k} then raised {v[:120]}" for k, v in sorted(errors.items())[:1])
        return head + (f"rank {r} of {n} died with exit code {code}{', ' + sig if sig else ''} and no "
                       f"Python error (crashed or killed); torchrun stopped the other ranks{then}")
    r = int(root.group(1)) if root and int(root.group(1)) in errors else (min(errors) if errors else None)
    if r is not None:
        return head + f"rank {r} of {n} raised {errors[r]}; torchrun stopped the other ranks"
    tail = [ln.strip() for ln in torchrun_err.splitlines() if ln.strip()]
    return head + f"torchrun exited with code {rc}" + (f": {tail[-1][:300]}" if tail else "")


def launch(task: str, n: int, backend: str, params: dict, timeout_s: float, label: str,
           nccl_debug: bool = False, extra_env: dict | None = None) -> dict:
    """Run `task` on n ranks; return rank 0's result, or raise LabError with one clear line."""
    job = Job(task, n, backend, params, label, nccl_debug, extra_env)
    try:
        try:
            rc = job.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            where = job.stages()
            job.kill()
            raise LabError(f"{label}: no result after {timeout_s:.0f} s, so the {n} ranks were killed; "
                           f"last progress: {where}") from None
        if rc != 0:
            raise LabError(job.diagnose(rc))
        if not job.result.is_file():
            raise LabError(f"{label}: the ranks exited cleanly but rank 0 wrote no result")
        out = json.loads(job.result.read_text())
        out["_launch_s"] = round(time.monotonic() - job.started, 2)
        out["_nccl_logs"] = [p.read_text(errors="replace") for p in sorted(job.dir.glob("nccl.*.log"))]
        return out
    finally:
        if job.proc.poll() is None:
            job.kill()
        job.close()
