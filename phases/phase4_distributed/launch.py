"""From one `lab run` process to N ranks and back: backend choice, torchrun, failures, the link roof.

A phase-4 run() starts its ranks itself, once per world size, with torchrun (which also spans nodes):

    python -m torch.distributed.run --standalone --nproc_per_node N \
        -m phases.phase4_distributed.worker <task> '<job json>' <result file>

Every rank measures; rank 0 writes the raw measurements as JSON; run() turns them into rows here,
where the spec sheet is. Backend `auto`: NCCL on 2+ GPUs, else skipped with one line (nothing falls
back to the CPU unless asked: `gloo` is the CPU version). World sizes `auto`: [2, every GPU]; gloo [2, 4].
Failures never hang the lab: a rank that raises writes `error.<rank>`; one that dies silently is
named from torchrun's report; a job past `timeout_s` is killed and the error says what each rank
was doing (`stage.<rank>`). Interrupted (Ctrl-C, SIGTERM), the job is stopped within about a
second (SIGTERM to torchrun's group and every rank, then SIGKILL) and its folder removed.
"""
import json
import os
import re
import shutil
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
from common.params import Choice, Int
from common.paths import REPO_ROOT

BACKENDS = ("auto", "nccl", "gloo")
INTERRUPT_GRACE_S = 1.0          # interrupted: how long the ranks get to go before SIGKILL
TIMEOUT_GRACE_S = 5.0            # out of time: a little longer, so ranks can write what they were doing
NO_GPU = "no GPU in this run: needs 2 CUDA GPUs for NCCL (the CPU version runs only when asked: --param backend=gloo)"


def launch_params(timeout_s: int) -> dict:
    """The parameters every phase-4 exercise takes: how its ranks are launched and how long they get."""
    return {
        "backend": Choice("auto", BACKENDS, help="auto: NCCL on 2+ GPUs, else skipped; gloo: the CPU version"),
        "world_sizes": Int("auto", min=2, unit="ranks", many=True, also=("auto",),
                           help="auto: [2, every GPU] with NCCL, [2, 4] with gloo"),
        "pg_timeout_s": Int(120, min=1, unit="s", help="a collective whose peer never arrives fails after this"),
        "timeout_s": Int(timeout_s, min=1, unit="s", help="a job with no result after this is killed"),
    }


def alone(params: dict) -> dict:
    """Parameters for running one exercise module alone (`python -m ...`): 2 ranks, NCCL where this
    machine has 2 GPUs, else gloo on CPU processes, plus the exercise's small irregular sizes."""
    import torch
    return {"backend": "auto" if torch.cuda.device_count() >= 2 else "gloo", "world_sizes": [2], **params}


def work_world_sizes(params: dict) -> list[int]:
    """The world sizes `lab predict` lists rows for (before any launch): those asked for; for
    'auto', [2, 4] with gloo, else 2 and every GPU this machine has (2 where it has none: pass
    --param world_sizes=[2,8] to see others)."""
    sizes = params.get("world_sizes", "auto")
    if sizes != "auto":
        return sorted(set([sizes] if isinstance(sizes, int) else sizes))
    if params.get("backend") == "gloo":
        return [2, 4]
    import torch
    return sorted({2, max(2, torch.cuda.device_count())})


def ranks_sharing_memory(params: dict) -> int:
    """How many ranks share the memory a footprint is compared with: with gloo every rank is a CPU
    process on this host (the largest world size; auto: 4); with NCCL each rank has its own GPU."""
    if params.get("backend") != "gloo":
        return 1
    sizes = params.get("world_sizes", "auto")
    return 4 if sizes == "auto" else max([sizes] if isinstance(sizes, int) else sizes)


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


def whole_run_skipped(ctx, params: dict) -> str | None:
    """Why a run with these parameters would skip every world size here (`Exercise.skips`), or None."""
    pl = plan(ctx, params)
    return pl.skipped[0][1] if pl.skipped and not pl.world_sizes else None


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
WORKER = "phases.phase4_distributed.worker"


def worker_command(task: str, n: int, job: dict, result: Path, module: str = WORKER) -> list[str]:
    # --log-dir: torchrun's own folder (otherwise a torchelastic_* left in TMPDIR) goes inside the
    # job's folder and is removed with it
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc_per_node", str(n), "--max_restarts", "0", "--log-dir", str(result.parent / "torchelastic"),
            "-m", module, task, json.dumps(job), str(result)]


class Job:
    """One torchrun launch: started, watched, killed if need be, diagnosed."""

    def __init__(self, task: str, n: int, backend: str, params: dict, label: str, nccl_debug: bool = False,
                 extra_env: dict | None = None, module: str = WORKER):
        """module: the worker the ranks run (phase 5's tensor-parallel worker uses the same launcher)."""
        self.task, self.n, self.label, self.module = task, n, label, module
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
        try:
            self.proc = subprocess.Popen(worker_command(task, n, job, self.result, module), cwd=REPO_ROOT, env=env,
                                         stdout=self._out, stderr=self._err, start_new_session=True)
        except BaseException:                  # nothing started: leave no folder behind
            self.close()
            raise

    def markers(self, name: str) -> dict[int, str]:
        """{rank: content} of the files `<name>.<rank>` the ranks wrote."""
        out = {}
        for p in self.dir.glob(f"{name}.*"):
            try:
                out[int(p.suffix[1:])] = p.read_text().strip()
            except (ValueError, OSError):
                continue
        return out

    def rank_pids(self) -> set[int]:
        """The ranks still alive: the pids they wrote, and torchrun's children (a rank that has not
        written its pid yet), each confirmed by its command line."""
        pids = set()
        for pid in self.markers("pid").values():
            try:
                pids.add(int(pid))
            except ValueError:
                continue
        pids |= _children(self.proc.pid)
        return {pid for pid in pids if _is_rank(pid, self.module)}

    def stop(self, grace_s: float | None = None) -> None:
        """Stop the job now (the lab was interrupted, or the job ran out of time): SIGTERM to
        torchrun's group and to every rank at once (each rank runs in a session of its own, so the
        group signal alone does not reach it), up to `grace_s` (INTERRUPT_GRACE_S) for them to go,
        then SIGKILL whatever is left. torchrun alone would give its ranks 30 s."""
        grace_s = INTERRUPT_GRACE_S if grace_s is None else grace_s
        ranks = self.rank_pids()
        deadline = time.monotonic() + grace_s
        self._signal_all(ranks, signal.SIGTERM)
        while time.monotonic() < deadline:
            ranks |= self.rank_pids()
            if self.proc.poll() is not None and not any(_is_rank(pid, self.module) for pid in ranks):
                break
            time.sleep(0.05)
        ranks |= self.rank_pids()
        self._signal_all(ranks, signal.SIGKILL)
        try:
            self.proc.wait(timeout=2.0)             # reap torchrun
        except subprocess.TimeoutExpired:
            pass
        end = time.monotonic() + 1.0                # a SIGKILLed rank is gone within milliseconds
        while any(_is_rank(pid, self.module) for pid in ranks) and time.monotonic() < end:
            time.sleep(0.02)

    def _signal_all(self, ranks: set[int], sig) -> None:
        """`sig` to torchrun's process group and to each rank."""
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in ranks:
            _signal(pid, sig, self.module)

    def finish(self) -> None:
        """The end of every job, however it ends: one still running (the lab was interrupted, or
        raised) is stopped at once, then the folder goes."""
        try:
            if self.proc.poll() is None or self.rank_pids():
                self.stop()
        except KeyboardInterrupt:              # a second interrupt while stopping: no more grace
            self.stop(grace_s=0.0)
            raise
        finally:
            self.close()

    def close(self) -> None:
        """Close the log files and remove the job's folder (retried once: a rank killed a moment
        ago may still have been writing its stage file into it)."""
        for fh in (self._out, self._err):
            fh.close()
        for _ in range(3):
            shutil.rmtree(self.dir, ignore_errors=True)
            if not self.dir.exists():
                break
            time.sleep(0.1)
        try:
            self._tmp.cleanup()                     # nothing left to remove; keeps the object quiet
        except OSError:
            pass

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
           nccl_debug: bool = False, extra_env: dict | None = None, module: str = WORKER) -> dict:
    """Run `task` on n ranks; return rank 0's result, or raise LabError with one clear line.
    Interrupted (KeyboardInterrupt, common.errors.Terminated), the job is stopped within ~1 s and
    its folder removed before the interrupt goes on."""
    job = Job(task, n, backend, params, label, nccl_debug, extra_env, module)
    try:
        try:
            rc = job.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            where = job.stages()
            job.stop(grace_s=TIMEOUT_GRACE_S)
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
        job.finish()


# ------------------------------------------------------------------------------ processes
def _children(pid: int) -> set[int]:
    """The pids whose parent is `pid` (from /proc)."""
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()       # after "pid (comm) ": state, ppid, ...
        if len(fields) > 1 and fields[1] == str(pid):
            out.add(int(d.name))
    return out


def _is_rank(pid: int, module: str = WORKER) -> bool:
    """Whether `pid` is alive and one of our ranks (not a zombie, not a reused pid)."""
    try:
        cmdline = Path(f"/proc/{int(pid)}/cmdline").read_bytes()
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
    except (OSError, ValueError):
        return False
    return module.encode() in cmdline and stat[stat.rindex(")") + 2:][:1] != "Z"


def _signal(pid: int, sig, module: str = WORKER) -> None:
    if _is_rank(pid, module):
        try:
            os.kill(int(pid), sig)
        except (ProcessLookupError, PermissionError):
            pass
