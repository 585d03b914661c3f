"""The CLI as a curious user meets it on a CPU-only machine: a piped `lab list` that reads at
120 columns and does not promise runs that skip, and `lab predict` for this CPU (issue 33, item 6)."""
import subprocess
import sys

import pytest

from common.records import write_record
from conftest import REPO, assert_one_line_error, clean_env, cpu_only


@cpu_only
def test_a_piped_lab_list_reads_at_120_columns_and_phase4_says_it_skips():
    proc = subprocess.run([sys.executable, "-m", "common.cli", "list"], cwd=REPO, capture_output=True, text=True,
                          env=clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 120
    for ex_id in ("phase4.link_ceilings", "phase4.ddp", "phase4.ring_allreduce", "phase4.interconnect"):
        [first] = [line for line in lines if ex_id in line]
        here = first.split("│")[-2]
        assert "skips" in here and "runs" not in here, first
    assert any("runs" in line.split("│")[-2] for line in lines if "phase1.elementwise" in line)


def test_phase4_declares_why_it_skips_before_running(lab):
    import torch

    from common.exercise import Context
    from phases.phase4_distributed.ddp import EXERCISE
    cpu = Context(torch.device("cpu"), None, "cpu")
    assert "--param backend=gloo" in EXERCISE.skips(cpu, EXERCISE.resolve_params(True, False, {}))
    assert EXERCISE.skips(cpu, EXERCISE.resolve_params(True, False, {"backend": "gloo"})) is None


def _cpu_ceilings_record(make_record, **ceilings):
    return make_record(exercise={"id": "phase1.ceilings", "phase": 1, "name": "ceilings", "title": "t",
                                 "bench_version": 1},
                       summary={"ceilings": {"hbm_gbps": 50.0, "l2_gbps": 200.0, "l2_bytes": 2**25,
                                             "l2_fit_bytes": 2**25, "matmul_tflops": {"fp32": 0.2},
                                             "launch_us": 2.0, **ceilings}})


@cpu_only
@pytest.mark.parametrize("hardware", [[], ["--hardware", "cpu"]])
def test_predict_for_this_cpu_from_its_ceilings_record(lab, make_record, tmp_path, hardware):
    write_record(_cpu_ceilings_record(make_record), tmp_path)
    rc, out, err = lab("predict", "phase1.elementwise", "--param", "sizes=[1000000]", "--results", tmp_path, *hardware)
    assert rc == 0, err
    assert "this CPU" in out and "no GPU here" not in out + err
    assert f"calibrated from {tmp_path.name}/phase1/ceilings/cpu/" in out          # where the record is
    # 8 MB of copy within the cache: 8e6 bytes / 200 GB/s = 0.04 ms, plus the 2 us floor
    assert "0.042" in out.split("copy n=1000000")[1].splitlines()[0]
    rc, out, err = lab("predict", "matmul", "--n", "1000", "--results", tmp_path, *hardware)
    assert rc == 0, err
    [predicted] = [line for line in out.splitlines() if "predicted time (ms)" in line]
    assert predicted.split("│")[2].strip() == "10"             # 2e9 FLOPs at 0.2 TFLOP/s: 10 ms, compute-bound


def test_predict_for_a_cpu_without_a_ceilings_record_says_what_to_run(lab, tmp_path):
    rc, out, err = lab("predict", "phase1.elementwise", "--hardware", "cpu", "--results", tmp_path)
    assert_one_line_error(rc, err)
    assert rc == 2 and "lab run phase1.ceilings" in err


def test_a_smoke_ceilings_record_does_not_predict(lab, make_record, tmp_path):
    rec = _cpu_ceilings_record(make_record)
    rec["provenance"]["quick"] = True
    write_record(rec, tmp_path)
    rc, out, err = lab("predict", "matmul", "--n", "1000", "--hardware", "cpu", "--results", tmp_path)
    assert rc == 2 and "lab run phase1.ceilings" in err
