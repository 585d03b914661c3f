"""`lab serve --tensor-parallel N`: the same server, in front of rank 0 of N engine processes.

`lab serve` itself starts torchrun (N processes, NCCL on GPUs, gloo with --device cpu) running the
server module again; inside it each rank joins the process group, takes its GPU (LOCAL_RANK) and
builds its shard of the engine. Rank 0 serves HTTP through a DrivenEngine, which sends each step's
adds and aborts to the other ranks; they run `follow()` (tp_ranks.py) until rank 0 stops.
Ctrl-C or SIGTERM to `lab serve` reaches rank 0 as SIGINT (its graceful stop: it writes its pid
where `lab serve` finds it), which tells the others to leave; torchrun stops them all if any rank
fails.
"""
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.errors import LabError

from .tp_ranks import NO_MULTICAST_ENV

STOP_GRACE_S = 60.0
PID_FILE_ENV = "LAB_TP_SERVE_RANK0_PID"


def inside_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def relaunch(argv: list[str], n: int, device_type: str) -> int:
    """Run the server module under torchrun with n processes; forward SIGINT and SIGTERM to it
    as one SIGINT (rank 0's graceful stop); its exit code."""
    from common.paths import REPO_ROOT
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc_per_node", str(n), "--max_restarts", "0", "-m", "phases.phase5_inference.engine.server", *argv]
    folder = tempfile.TemporaryDirectory(prefix="lab-serve-tp-")
    pid_file = Path(folder.name) / "rank0.pid"
    env = {**os.environ, **NO_MULTICAST_ENV, PID_FILE_ENV: str(pid_file)}
    if device_type == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, start_new_session=True)
    stopping = []

    def forward(signum, frame):
        if stopping:
            return
        stopping.append(time.monotonic())
        try:                                    # rank 0's own Ctrl-C path, else torchrun's shutdown
            os.kill(int(pid_file.read_text()), signal.SIGINT)
        except (OSError, ValueError):
            try:
                proc.send_signal(signal.SIGINT)
            except ProcessLookupError:
                pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                return proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                if stopping and time.monotonic() - stopping[0] > STOP_GRACE_S:
                    os.killpg(proc.pid, signal.SIGKILL)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        folder.cleanup()


def rank_main(config, serve, serve_kwargs: dict) -> int:
    """One rank inside torchrun: join the group, build this rank's engine; rank 0 serves it with
    `serve` (server.py's, passed in: the server imports this module, not the other way), the
    others follow it."""
    import torch
    import torch.distributed as dist

    from .config import pick_device
    from .llm import LLMEngine
    from .tp_ranks import Channel, DrivenEngine, follow

    world = int(os.environ["WORLD_SIZE"])
    if world != config.tensor_parallel:
        raise LabError(f"--tensor-parallel {config.tensor_parallel}, but torchrun started {world} processes")
    device = pick_device(config.device)
    if device.type == "cuda":
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=local)
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)        # rank 0's stop message ends follow()
    elif os.environ.get(PID_FILE_ENV):
        Path(os.environ[PID_FILE_ENV]).write_text(str(os.getpid()))
    engine = LLMEngine(config)
    channel = Channel()
    if rank == 0:
        driven = DrivenEngine(engine, channel)
        try:
            serve(config, engine=driven, **serve_kwargs)
        finally:
            try:
                driven.stop()
            except Exception:                                # noqa: BLE001 - another rank already gone
                pass
    else:
        follow(engine, channel)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)                   # skip interpreter teardown: c10d's background threads may abort it
