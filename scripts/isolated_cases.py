"""Run a list of GPU test cases in child processes, so that one bad kernel ends one case, not the run.

A kernel fault poisons the CUDA context of its process, and a hung kernel holds it until killed. So
the smoke scripts run their cases in a child (`python script.py --child ... --start i`), which
announces each case before it runs it and reports it when done, one tagged JSON line each
(`report`). When a child dies or times out, the parent (`run_in_children`) blames the case it had
started and not finished, and starts a fresh child at the next case.
"""
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
TAG = "@@case "


def report(i: int, **fields) -> None:
    """Child side: one line about case i (status "started", then "ok" or a failure with details)."""
    print(TAG + json.dumps({"i": i, **fields}), flush=True)


def context_alive(device) -> bool:
    """Child side, after a case failed: whether this process's CUDA context still works. A fault
    poisons it, and then every later case would fail too: the child should exit, and the parent
    starts a fresh one at the next case."""
    import torch
    try:
        torch.ones(1, device=device).add_(1)
        torch.cuda.synchronize()
        return True
    except Exception:                                  # noqa: BLE001 - any error means a dead context
        return False


def run_in_children(todo: list, child_cmd: Callable[[int], list[str]], timeout_s: float,
                    show: Callable[[dict, str, dict], None], describe: Callable[[dict], str],
                    max_restarts: int = 8) -> int:
    """Parent side: run cases todo[i:] in `child_cmd(i)` until all ran; return how many failed.
    `show(case, status, fields)` prints one finished case."""
    start, failures, restarts = 0, 0, 0
    while start < len(todo):
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(child_cmd(start), capture_output=True, text=True, timeout=timeout_s, cwd=ROOT,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
            out, err, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            rc = f"killed after {timeout_s} s"
        last_started, finished = None, set()
        for line in out.splitlines():
            if not line.startswith(TAG):
                continue
            fields = json.loads(line[len(TAG):])
            i, status = fields.pop("i"), fields.pop("status")
            if status == "started":
                last_started = i
                continue
            finished.add(i)
            failures += status != "ok"
            show(todo[i], status, fields)
        if rc == 0:
            break
        tail = " | ".join(ln.strip() for ln in err.strip().splitlines()[-3:])[:400]
        if last_started is not None and last_started not in finished:     # died inside a case
            failures += 1
            print(f"[DIED ] {describe(todo[last_started])}: child rc={rc} after {time.perf_counter() - t0:.1f} s; {tail}")
            start = last_started + 1
        elif finished:                                                    # stopped after reporting an error
            start = max(finished) + 1
        else:                        # before its first case (import, build, no GPU): a restart would do the same
            failures += 1
            print(f"[DIED ] child rc={rc} before its first case: {tail}")
            break
        restarts += 1
        if restarts > max_restarts:
            print(f"(more than {max_restarts} child deaths: the remaining cases are skipped)")
            failures += len(todo) - start
            break
    return failures
