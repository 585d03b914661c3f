"""Bad input through `lab run`: refused in one line with exit 2 before any work and without a record;
what this machine cannot do is skipped with its reason, never 'failed'; no absolute path, in any
spelling, reaches a record."""
import json
import subprocess

import pytest

from common.env import command_line
from common.paths import absolute_paths
from common.records import problems
from conftest import assert_one_line_error, cpu_only, json_files, lab_cmd, clean_env, REPO


def read(path):
    return json.loads(path.read_text())


# ------------------------------------------------------------------------------ parameter values
@pytest.mark.parametrize("target, param, words", [
    ("phase1.matmul_fp16", "n=0", "n=0: must be an integer from 1"),
    ("phase1.matmul_fp16", "n=-1", "n=-1: must be an integer from 1"),
    ("phase1.matmul_fp16", "dtype=fp99", "dtype=fp99: must be one of fp16, bf16, fp32"),
    ("phase1.elementwise", "sizes=[-5]", "sizes=[-5]: must be"),
    ("phase1.elementwise", "sizes=[]", "sizes=[]: needs at least one value"),
    ("phase1.elementwise", "sizes=[1.5]", "(1.5 is not)"),
    ("phase1.cache_sweep", "working_sets=big", "working_sets=big: must be"),
    ("phase4.interconnect", "backend=mpi", "backend=mpi: must be one of auto, nccl, gloo"),
    ("phase4.interconnect", "world_sizes=[1]", "world_sizes=[1]: must be"),
    ("phase4.ring_allreduce", "world_sizes=1", "world_sizes=1: must be"),
    ("phase7.model", "data_dir=/does/not/exist", "data_dir=/does/not/exist: no such folder"),
])
def test_a_bad_value_is_one_line_exit_2_and_no_record(lab, tmp_path, target, param, words):
    results = tmp_path / "results"
    rc, out, err = lab("run", target, "--device", "cpu", "--param", param, "--results", results)
    assert rc == 2
    assert_one_line_error(rc, err, results)
    assert words in err, err


def test_values_are_checked_before_the_first_exercise_runs(lab, tmp_path):
    """phase0.gates would run first; a bad value for a later exercise stops the run before it."""
    results = tmp_path / "results"
    rc, out, err = lab("run", "phase0.gates", "phase1.matmul_fp16", "--param", "n=0", "--results", results)
    assert_one_line_error(rc, err, results)
    assert "phase0.gates" not in out


def test_a_single_size_is_a_list_of_one(lab, tmp_path):
    rc, out, err = lab("run", "phase1.elementwise", "--quick", "--param", "sizes=1024", "--results", tmp_path)
    assert rc == 0, err
    [f] = json_files(tmp_path)
    rec = read(f)
    assert rec["status"] == "ok" and rec["params"]["sizes"] == [1024]
    assert {r["params"]["n"] for r in rec["rows"]} == {1024}


@cpu_only
def test_a_problem_larger_than_memory_is_refused_up_front(lab, tmp_path):
    results = tmp_path / "results"
    rc, out, err = lab("run", "phase1.elementwise", "--param", "sizes=[10000000000000]", "--results", results)
    assert_one_line_error(rc, err, results)
    assert "need about" in err and "GiB of host memory" in err and "available" in err


# ------------------------------------------------------------------------------ skipped, not failed
def test_missing_data_is_skipped_with_its_reason_and_the_rest_still_runs(lab, tmp_path):
    empty = tmp_path / "empty-data"
    empty.mkdir()
    results = tmp_path / "results"
    rc, out, err = lab("run", "phase0.gates", "phase7.data_prep", "--param", f"data_dir={empty}",
                       "--results", results)
    assert rc == 0, out + err                                   # gates ran; data_prep skipped
    recs = {read(f)["exercise"]["id"]: read(f) for f in json_files(results)}
    assert recs["phase0.gates"]["status"] == "ok"
    dp = recs["phase7.data_prep"]
    assert dp["status"] == "skipped" and "has no" in dp["reason"]
    assert dp["params"]["data_dir"].startswith("empty-data@sha256:")
    for rec in recs.values():
        assert problems(rec) == []
        assert str(tmp_path) not in json.dumps(rec)
        assert "data_dir=<path>/empty-data" in rec["provenance"]["command"]


@cpu_only
def test_nccl_on_a_cpu_machine_is_skipped_not_failed(lab, tmp_path):
    rc, out, err = lab("run", "phase4.interconnect", "--device", "cpu", "--param", "backend=nccl",
                       "--results", tmp_path)
    assert rc == 3, out + err                                   # nothing ran
    [f] = json_files(tmp_path)
    rec = read(f)
    assert rec["status"] == "skipped" and "CUDA GPUs" in rec["reason"]


# ------------------------------------------------------------------------------ absolute paths
@pytest.mark.parametrize("argv", [
    ["lab", "run", "7", "--param", "data_dir=/abs/place/data"],
    ["lab", "run", "7", "--param=data_dir=/abs/place/data"],
    ["lab", "run", "7", "--results", "/abs/place/results"],
    ["lab", "run", "7", "--results=/abs/place/results"],
    ["lab", "run", "7", "--param", "data_dir=~/place/data"],
    ["/usr/local/bin/lab", "run", "7", "--param", "data_dir=file:///abs/place/data"],
])
def test_no_absolute_path_reaches_the_command_in_any_spelling(argv):
    cmd = command_line(argv)
    assert absolute_paths(cmd) == [] and "/abs/" not in cmd and cmd.startswith("lab run 7")


def test_the_validator_finds_absolute_paths_inside_any_string(make_record):
    for where in ("command", "data_dir"):
        rec = make_record()
        if where == "command":
            rec["provenance"]["command"] = "lab run 7 --param data_dir=/abs/data"
        else:
            rec["rows"][0]["params"]["data_dir"] = "KEY=/abs/data"
        assert any("absolute path" in p for p in problems(rec)), where
    rec = make_record()
    rec["summary"] = {"/abs/key": 1}
    assert any("absolute path" in p for p in problems(rec))
    rec = make_record()
    rec["summary"] = {"units": "GB/s", "ratio": "measured/predicted", "url": "https://example.org/a/b",
                      "label": "<repo>/data"}
    assert problems(rec) == []


# ------------------------------------------------------------------------------ output without a terminal
def test_lab_list_through_a_pipe_reads_at_120_columns():
    """Piped (a CI log, `| less`) the table is 120 columns wide, each cell wrapped inside its
    column (issue 33); an exercise's first line names it, starts its title and says whether it runs."""
    proc = subprocess.run([*lab_cmd(), "list"], capture_output=True, text=True, cwd=REPO, env=clean_env(),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(ln) for ln in lines) <= 120
    from common.registry import all_exercises
    for ex in all_exercises():
        line = next((ln for ln in lines if f" {ex.id} " in ln), None)
        assert line is not None, ex.id
        cells = [c.strip() for c in line.split("│")[1:-1]]
        assert cells[1] and ex.title.startswith(cells[1]), (ex.id, cells)
        assert cells[-1].startswith(("runs", "skips")), (ex.id, cells)
