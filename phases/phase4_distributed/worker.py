"""What every rank runs under torchrun: join the group, run one task, hand rank 0's result back.

    python -m torch.distributed.run --standalone --nproc_per_node N \
        -m phases.phase4_distributed.worker <task> '<job json>' <result file>

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK; the job gives the backend, params and a work folder.
With NCCL, rank r drives GPU LOCAL_RANK; the group gets `pg_timeout_s`, so a collective whose peer
never arrives fails instead of waiting forever. Each rank writes `pid.<rank>`, `stage.<rank>` (what
it is doing) and, when it raises, `error.<rank>` in the work folder; rank 0 writes the result file
atomically. Task "ring+sweep" runs several tasks in one group ({name: result}; the CPU tests use
it). Test hook, never set in real runs: LAB_PHASE4_FAULT=crash:R (rank R exits at once with code
3) or hang:R (rank R sleeps).
"""
import datetime
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist


class Rank:
    """This process's place in the group, and the few helpers every task needs."""

    def __init__(self, backend: str, work_dir: str):
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.backend = backend
        self.dir = Path(work_dir)
        self.device = torch.device("cuda", self.local_rank) if backend == "nccl" else torch.device("cpu")

    @property
    def left(self) -> int:
        return (self.rank - 1) % self.world

    @property
    def right(self) -> int:
        return (self.rank + 1) % self.world

    def mark(self, name: str, text: str) -> None:
        path = self.dir / f"{name}.{self.rank}"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    def stage(self, text: str) -> None:
        self.mark("stage", text)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def line_up(self) -> None:
        """Every rank idle and leaving this call together (the barrier's all-reduce ends at the same
        moment on every GPU, and each host waits for it), so what follows starts on all at once."""
        self.sync()
        dist.barrier()
        self.sync()

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def init(self, timeout_s: float, high_priority_stream: bool = False) -> None:
        """Join the group. high_priority_stream: NCCL's kernels go on a high-priority CUDA stream, so
        the GPU schedules their CTAs ahead of queued work from normal-priority streams."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
            opts = dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = high_priority_stream
            dist.init_process_group("nccl", timeout=timeout, device_id=self.device, pg_options=opts)
        else:
            dist.init_process_group("gloo", timeout=timeout)
        dist.barrier()


def _fault(me: Rank) -> None:
    spec = os.environ.get("LAB_PHASE4_FAULT")
    if not spec:
        return
    kind, _, who = spec.partition(":")
    if who and int(who) != me.rank:
        return
    me.stage(f"fault injected: {kind}")
    if kind == "crash":
        os._exit(3)
    if kind == "hang":
        time.sleep(3600)


def _tasks() -> dict:
    from . import ddp, interconnect, ring_allreduce
    return {"ring": ring_allreduce.worker_task, "naive": ring_allreduce.naive_task, "sweep": interconnect.worker_task,
            "probe": interconnect.probe_task, "ddp": ddp.worker_task}


def main(argv: list[str], tasks: dict | None = None) -> int:
    """One rank's life: join, run the task (`tasks`: name -> fn(me, params); phase 4's by default,
    phase 5's tensor-parallel worker passes its own), hand rank 0's result back, leave."""
    tasks = tasks or _tasks()
    task, job_json, result_path = argv[1], argv[2], Path(argv[3])
    job = json.loads(job_json)
    me = Rank(job["backend"], job["work_dir"])
    me.mark("pid", str(os.getpid()))
    try:
        me.stage("init_process_group")
        me.init(job["params"].get("pg_timeout_s", 300), job["params"].get("high_priority_stream", False))
        _fault(me)
        names = task.split("+")
        if len(names) == 1:
            me.stage(task)
            out = tasks[task](me, job["params"])
        else:
            out = {}
            for name in names:
                me.stage(name)
                out[name] = tasks[name](me, job["params"][name])
        if me.rank == 0:
            tmp = result_path.with_name(".result.tmp")
            tmp.write_text(json.dumps(out))
            os.replace(tmp, result_path)
        del out
        gc.collect()                  # DDP wrappers and pending works go before the group does
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        me.stage("done")
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)                   # skip interpreter teardown: background threads of c10d may abort it
    except BaseException as exc:  # noqa: BLE001 - reported in one line, then the rank leaves
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        me.mark("error", f"{type(exc).__name__}" + (f": {first}" if first else ""))
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)                   # no teardown: a peer may be gone, and destroy would wait for it


if __name__ == "__main__":
    sys.exit(main(sys.argv))
