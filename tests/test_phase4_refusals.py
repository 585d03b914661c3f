"""Phase 4 refuses what it cannot run before any rank starts, and stops at once when it is told to.

- Declared parameters: a world size of 1, an unknown backend, an unknown operation or comm hook
  end with one line (ParamError, exit 2) before any work; NCCL asked for on a CPU run gives
  skipped rows, never failed ones.
- SIGTERM (a job scheduler's stop) to a `lab run` whose gloo ranks are busy: the lab exits within
  seconds, no torchrun or rank of it is left alive, and no `lab-phase4-*` folder stays in TMPDIR.
"""
import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, assert_one_line_error, clean_env, json_files

from common.errors import LabError
from common.params import ParamError

ring = importlib.import_module("phases.phase4_distributed.ring_allreduce")
ddp = importlib.import_module("phases.phase4_distributed.ddp")
sweep = importlib.import_module("phases.phase4_distributed.interconnect")
link = importlib.import_module("phases.phase4_distributed.link_ceilings")
MODULES = {"phase4.ring_allreduce": ring, "phase4.interconnect": sweep, "phase4.ddp": ddp,
           "phase4.link_ceilings": link}


# ------------------------------------------------------------------------------ declared parameters
@pytest.mark.parametrize("ex_id", sorted(MODULES))
@pytest.mark.parametrize("overrides, says", [
    ({"world_sizes": [1]}, "--param world_sizes=[1]: must be a list of values, each an integer >= 2"),
    ({"world_sizes": [2, 1]}, "(1 is not)"),
    ({"world_sizes": 0}, "--param world_sizes=0: must be"),
    ({"world_sizes": "all"}, "or 'auto'"),
    ({"backend": "mpi"}, "--param backend=mpi: must be one of auto, nccl, gloo"),
    ({"pg_timeout_s": 0}, "--param pg_timeout_s=0: must be an integer >= 1"),
])
def test_launch_params_are_refused_in_one_line(ex_id, overrides, says):
    ex = MODULES[ex_id].EXERCISE
    for on_cpu in (False, True):
        with pytest.raises(ParamError) as err:
            ex.resolve_params(on_cpu, False, overrides)
        assert says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("mod, overrides, says", [
    (sweep, {"ops": ["bogus"]}, "--param ops=[bogus]: must be a list of values, each one of all_reduce, all_gather, "
                                "reduce_scatter, sendrecv (bogus is not)"),
    (sweep, {"ops": []}, "needs at least one value"),
    (sweep, {"sizes_bytes": [2]}, "each an integer >= 4 (bytes) (2 is not)"),
    (sweep, {"ring_directions": 3}, "must be one of 1, 2"),
    (ring, {"directions": [1, 3]}, "(3 is not)"),
    (ring, {"lanes": [0]}, "from 1 to 4"),
    (ring, {"graphs": ["yes"]}, "true or false"),
    (ddp, {"comm_hooks": ["bogus"]}, "--param comm_hooks=[bogus]: must be a list of values, each one of builtin, avg, "
                                     "copy_engine (bogus is not)"),
    (ddp, {"nccl_max_channels": [None, 0]}, "each an integer from 1 to 64, or null (0 is not)"),
    (ddp, {"bucket_caps_mb": [0]}, "--param bucket_caps_mb=[0]: must be"),
    (ddp, {"dtype": "fp16"}, "must be one of bf16, fp32"),
])
def test_exercise_params_are_refused_in_one_line(mod, overrides, says):
    with pytest.raises(ParamError) as err:
        mod.EXERCISE.resolve_params(True, False, overrides)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_declarations_keep_every_recorded_default():
    """Declaring the parameters changed no value and no type (5 stays 5: the variant is bucket_5mb)."""
    for mod in MODULES.values():
        ex = mod.EXERCISE
        for on_cpu, quick in ((False, False), (True, False), (True, True)):
            want = {**ex.params, **(ex.cpu_params if on_cpu else {}), **(ex.quick_params if quick else {})}
            got = ex.resolve_params(on_cpu, quick, {})
            assert got == want and repr(got) == repr(want)
    p = ddp.EXERCISE.resolve_params(False, False, {"bucket_caps_mb": 25, "nccl_max_channels": [None, 8]})
    assert p["bucket_caps_mb"] == [25] and type(p["bucket_caps_mb"][0]) is int
    assert p["nccl_max_channels"] == [None, 8]
    assert ddp.EXERCISE.resolve_params(False, False, {"sm_carveouts": None})["sm_carveouts"] == [None]
    assert ddp.EXERCISE.resolve_params(False, False, {"world_sizes": 4})["world_sizes"] == [4]


def test_a_world_size_of_1_ends_lab_run_before_any_work(lab, tmp_path):
    rc, out, err = lab("run", "phase4.ddp", "--device", "cpu", "--param", "backend=gloo",
                       "--param", "world_sizes=[1]", "--results", tmp_path)
    assert rc == 2
    assert_one_line_error(rc, err, tmp_path)
    assert "world_sizes=[1]" in err and "lab run" not in out


@pytest.mark.parametrize("ex_id", sorted(MODULES))
def test_nccl_on_a_cpu_run_is_skipped_not_failed(ex_id, spec_ctx, static_for):
    from common.runner import checked_params, run_one
    ex, ctx = MODULES[ex_id].EXERCISE, spec_ctx()
    params = checked_params([ex], ctx, {"backend": "nccl"})[ex.id]
    rows = MODULES[ex_id].run(ctx, params).rows
    assert [r["status"] for r in rows] == ["skipped"] and "needs CUDA GPUs" in rows[0]["reason"]
    rec = run_one(ex, ctx, params, static_for(ctx), None, None)
    assert rec["status"] == "skipped" and "needs CUDA GPUs" in rec["reason"]


def test_a_size_too_small_to_split_is_refused_before_launching(spec_ctx, monkeypatch):
    monkeypatch.setattr(sweep, "launch", lambda *a, **k: pytest.fail("launched"))
    params = sweep.EXERCISE.resolve_params(True, True, {"backend": "gloo", "world_sizes": [2, 4], "sizes_bytes": [8]})
    with pytest.raises(LabError, match="8 bytes is too small for all_gather on 4 ranks"):
        sweep.run(spec_ctx(), params)


def test_link_ceilings_refuse_bad_sizes_before_launching(spec_ctx, monkeypatch):
    monkeypatch.setattr(link, "launch", lambda *a, **k: pytest.fail("launched"))
    params = link.EXERCISE.resolve_params(True, True, {"backend": "gloo", "world_sizes": [4], "small_sizes_bytes": [8]})
    with pytest.raises(LabError, match=r"--param small_sizes_bytes: 8 bytes is too small for all_gather on 4 ranks"):
        link.run(spec_ctx(), params)
    params = link.EXERCISE.resolve_params(True, True, {"backend": "gloo", "large_sizes_bytes": [2**15]})
    with pytest.raises(LabError, match=r"small_sizes_bytes must all be below large_sizes_bytes: 65536 bytes"):
        link.run(spec_ctx(), params)


def test_footprints_at_gpu_defaults():
    gib = 2**30
    got = {ex_id: mod.EXERCISE.footprint_bytes(mod.EXERCISE.resolve_params(False, False, {})) / gib
           for ex_id, mod in MODULES.items()}
    assert 9 < got["phase4.interconnect"] < 12          # 4 GiB sendrecv: 8 GiB of buffers + the check's scratch
    assert got["phase4.link_ceilings"] == got["phase4.interconnect"]     # the same largest message
    assert 3 < got["phase4.ring_allreduce"] < 5         # 1 GiB buffer, its scratch, the check's scratch
    assert 8 < got["phase4.ddp"] < 14                   # 201M fp32 weights x ~7.5 + activations
    # with gloo every rank is a process on this host: the footprint counts them all
    p = sweep.EXERCISE.resolve_params(True, False, {"backend": "gloo", "world_sizes": [2, 3]})
    assert sweep.EXERCISE.footprint_bytes(p) == 3 * sweep.EXERCISE.footprint_bytes({**p, "backend": "nccl"})


# ------------------------------------------------------------------------------ SIGTERM
DRIVER = """
import signal, sys
from common.errors import Terminated

def _terminate(signum, frame):
    raise Terminated()

signal.signal(signal.SIGTERM, _terminate)   # what `lab` does; set here too so the test stands alone
from common.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _ours(marker: str) -> dict[int, bytes]:
    """{pid: cmdline} of live (not zombie) processes whose command line contains `marker`."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes()
            stat = (d / "stat").read_text()
        except OSError:
            continue
        if marker.encode() in cmdline and stat[stat.rindex(")") + 2:][:1] != "Z":
            out[int(d.name)] = cmdline
    return out


def _busy_ranks(tmp: Path) -> bool:
    """Both ranks past init_process_group, at work in the sweep."""
    stages = [p.read_text() for p in tmp.glob("lab-phase4-*/stage.*") if p.is_file()]
    return len(stages) == 2 and all("bytes" in s for s in stages)


def test_sigterm_stops_the_ranks_and_removes_the_job_folder(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    results = tmp_path / "results"
    marker = str(tmp)                                   # every job's command line names its folder under TMPDIR
    cmd = [sys.executable, "-c", DRIVER, "run", "phase4.interconnect", "--quick", "--device", "cpu",
           "--param", "backend=gloo", "--param", "world_sizes=[2]", "--param", "probe_algorithms=false",
           # busy for minutes: a million timed calls per size
           "--param", "min_iters=1000000", "--param", "max_iters=1000000", "--results", str(results)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(TMPDIR=str(tmp), PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not _busy_ranks(tmp):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the ranks did not start within 90 s"
            time.sleep(0.2)
        ranks = [pid for pid, c in _ours(marker).items() if b"phases.phase4_distributed.worker" in c]
        assert len(ranks) >= 2 and any(b"torch.distributed.run" in c for c in _ours(marker).values())

        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            pytest.fail("lab was still running 5 s after SIGTERM")
        took = time.monotonic() - t0
        print(f"lab exited {took:.2f} s after SIGTERM")
        assert proc.returncode != 0 and "Traceback" not in err, err
        assert [ln for ln in err.splitlines() if ln.strip()][-1].startswith("lab: "), err

        time.sleep(1.0)
        left = {pid: c for pid, c in _ours(marker).items()
                if b"phases.phase4_distributed.worker" in c or b"torch.distributed.run" in c}
        assert left == {}, f"still alive after SIGTERM: {sorted(left)}"
        assert sorted(p.name for p in tmp.glob("lab-phase4-*")) == []
        assert sorted(p.name for p in tmp.glob("torchelastic_*")) == []     # torchrun's logs live in the job's folder
        assert json_files(results) == []                # an interrupted exercise writes no record
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in _ours(marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
