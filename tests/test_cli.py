"""The `lab` command: every path and every user mistake (one line on stderr, never a traceback)."""
import json
import shutil

import pytest
import torch

from common.paths import REPO_ROOT
from common.registry import select
from conftest import assert_one_line_error, cpu_only, json_files, read_json, run_lab


# ------------------------------------------------------------------------------ the console script
def test_console_script_is_installed():
    assert shutil.which("lab"), "`pip install -e .` should put `lab` on PATH"


def test_lab_list_through_the_console_script():
    proc = run_lab("list")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    for ex_id in ("phase0.gates", "phase0.matmul_baseline", "phase0.synchronize", "phase0.timer_check",
                  "phase1.elementwise", "phase1.matmul_fp16", "phase1.regime_sweep",
                  "phase1.cache_sweep", "phase1.nsight"):
        assert ex_id in proc.stdout


def test_lab_error_through_the_console_script(tmp_path):
    proc = run_lab("run", "9", "--quick", "--results", tmp_path / "r")
    assert_one_line_error(proc.returncode, proc.stderr, tmp_path / "r")
    assert "phase 9" in proc.stderr


def test_lab_predict_through_the_console_script():
    proc = run_lab("predict", "matmul", "--n", "8192", "--dtype", "fp16", "--hardware", "h200_sxm")
    assert proc.returncode == 0, proc.stderr
    assert "compute" in proc.stdout and "memory" not in proc.stdout.split("bound")[-1]
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------ the quick run
@cpu_only
def test_quick_run_exit_and_output(quick_run):
    assert quick_run["rc"] == 0, quick_run["stdout"] + quick_run["stderr"]
    assert "Traceback" not in quick_run["stdout"] + quick_run["stderr"]
    out = quick_run["stdout"]
    for ex_id in ("phase0.timer_check", "phase1.nsight"):
        [line] = [ln for ln in out.splitlines() if ln.startswith(f"skip {ex_id}:")]
        assert "needs a CUDA GPU" in line


@cpu_only
def test_quick_run_writes_one_valid_record_per_exercise(quick_run, quick_records):
    files = json_files(quick_run["results"])
    assert len(files) == len(quick_records)
    # One record per exercise the registry lists for phases 0 and 1 (not a count that changes when
    # an exercise is added), and these among them.
    assert sorted(r["exercise"]["id"] for r in quick_records) == sorted(ex.id for ex in select(["0", "1"]))
    assert {"phase0.gates", "phase0.matmul_baseline", "phase0.synchronize", "phase0.timer_check", "phase1.ceilings",
            "phase1.elementwise", "phase1.matmul_fp16", "phase1.regime_sweep", "phase1.cache_sweep",
            "phase1.nsight"} <= {r["exercise"]["id"] for r in quick_records}
    for f in files:
        assert f.parent.name == "cpu" and f.parent.parent.parent.name.startswith("phase")
    statuses = {r["exercise"]["id"]: r["status"] for r in quick_records}
    assert statuses.pop("phase0.timer_check") == statuses.pop("phase1.nsight") == "skipped"
    assert set(statuses.values()) == {"ok"}


@cpu_only
def test_quick_run_records_are_complete(quick_run, quick_records):
    timed = 0
    for rec in quick_records:
        assert rec["hardware"]["key"] == "cpu" and rec["hardware"]["device"] == "cpu"
        assert rec["software"]["torch"] == torch.__version__
        prov = rec["provenance"]
        assert prov["command"].startswith("lab run 0 1 --quick --results ")
        assert prov["quick"] is True and prov["started_utc"].endswith("Z")
        assert rec["cost"]["seconds"] >= 0 and rec["cost"]["usd"] is None     # no rate known for a CPU
        for row in rec["rows"]:
            if row["status"] == "ok" and row["timing"]:
                timed += 1
                p = row["prediction"]
                assert p is not None, (rec["exercise"]["id"], row["variant"])
                assert p["predicted_ms"] > 0 and p["measured_over_predicted"] > 0
                assert p["measured_ms"] == pytest.approx(row["metrics"]["ms"])
                assert row["check"]["passed"] is True                 # checked before it was timed
        if rec["status"] == "skipped":
            assert rec["reason"] and "\n" not in rec["reason"]
    assert timed >= 6


@cpu_only
def test_quick_run_records_hold_no_absolute_path(quick_run):
    for f in json_files(quick_run["results"]):
        text = f.read_text()
        assert str(quick_run["results"]) not in text and str(REPO_ROOT) not in text, f


# ------------------------------------------------------------------------------ run
@cpu_only
def test_nsight_alone_on_cpu_ran_nothing(lab, tmp_path):
    rc, out, err = lab("run", "phase1.nsight", "--results", tmp_path)
    assert rc == 3
    assert_one_line_error(rc, err)
    assert "nothing ran" in err
    assert "skip phase1.nsight: needs a CUDA GPU" in out
    [f] = json_files(tmp_path)                               # the skip itself is recorded
    assert read_json(f)["status"] == "skipped"


def test_variant_filter_through_the_cli(lab, tmp_path):
    rc, out, err = lab("run", "phase1.elementwise", "--variant", "mul", "--param", "sizes=[4099]",
                       "--quick", "--results", tmp_path)
    assert rc == 0, err
    [f] = json_files(tmp_path)
    rec = read_json(f)
    assert [r["variant"] for r in rec["rows"]] == ["mul"]
    assert rec["params"]["sizes"] == [4099] and rec["rows"][0]["params"]["n"] == 4099


def test_usd_per_hour_flag_prices_the_run(lab, tmp_path):
    rc, out, err = lab("run", "phase0.gates", "--usd-per-hour", "3.6", "--results", tmp_path)
    assert rc == 0, err
    [f] = json_files(tmp_path)
    cost = read_json(f)["cost"]
    assert cost["usd_per_hour"] == 3.6 and cost["rate_source"] == "--usd-per-hour flag" and cost["gpus"] == 1
    assert cost["usd"] == pytest.approx(3.6 * cost["seconds"] / 3600, abs=1e-6)


def test_usd_per_hour_from_the_environment(lab, tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_USD_PER_HOUR", "1.5")
    rc, out, err = lab("run", "phase0.gates", "--results", tmp_path)
    assert rc == 0, err
    [f] = json_files(tmp_path)
    assert read_json(f)["cost"]["rate_source"] == "LAB_USD_PER_HOUR environment variable"


def test_a_crashing_exercise_exits_1_with_a_record(lab, tmp_path, monkeypatch):
    from common.registry import select
    [ex] = select(["phase0.gates"])

    def boom(ctx, params):
        raise RuntimeError("simulated crash")

    import dataclasses
    crashing = dataclasses.replace(ex, run=boom)
    monkeypatch.setattr("common.registry.select", lambda targets: [crashing])
    rc, out, err = lab("run", "phase0.gates", "--results", tmp_path)
    assert rc == 1
    assert "Traceback" not in out + err
    [f] = json_files(tmp_path)
    rec = read_json(f)
    assert rec["status"] == "failed" and rec["reason"] == "RuntimeError: simulated crash"


@pytest.mark.parametrize("args, words", [
    (["run", "9"], "phase 9"),
    (["run", "nope"], "unknown phase or exercise 'nope'"),
    (["run", "1", "--bogus"], "unrecognized arguments: --bogus"),
    (["run", "1", "--param", "nokey"], "KEY=VALUE"),
    (["run", "1", "--param", "unknownkey=3"], "unknownkey"),
    (["run", "1", "--param", "sizes=[1,"], "cannot parse"),
    (["run", "1", "--variant", "nope"], "--variant nope"),
    (["run", "1", "--usd-per-hour", "-1"], "--usd-per-hour"),
    (["run", "1", "--usd-per-hour", "cheap"], "--usd-per-hour"),
    (["run", "1", "--device", "tpu"], "--device"),
    (["run"], "targets"),
    (["frobnicate"], "invalid choice"),
])
def test_user_mistakes_are_one_line(lab, tmp_path, args, words):
    results = tmp_path / "results"
    rc, out, err = lab(*args, "--quick", "--results", results) if args[0] == "run" and len(args) > 1 \
        else lab(*args)
    assert rc == 2
    assert_one_line_error(rc, err, results)
    assert words in err


@cpu_only
@pytest.mark.parametrize("args, words", [
    (["--device", "cuda"], "no CUDA GPU"),
    (["--hardware", "nope"], "unknown hardware key 'nope'"),
])
def test_cpu_machine_mistakes_are_one_line(lab, tmp_path, args, words):
    results = tmp_path / "results"
    rc, out, err = lab("run", "1", "--quick", *args, "--results", results)
    assert_one_line_error(rc, err, results)
    assert words in err


def test_unwritable_results_folder(lab, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    rc, out, err = lab("run", "1", "--quick", "--results", blocker / "sub")
    assert_one_line_error(rc, err)
    assert "not writable" in err
    assert blocker.read_text() == "x" and json_files(tmp_path) == []


def test_unknown_gpu_through_the_cli(lab, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA Foo 9000")
    rc, out, err = lab("run", "phase1.elementwise", "--quick", "--results", tmp_path / "r")
    assert_one_line_error(rc, err, tmp_path / "r")
    assert "NVIDIA Foo 9000" in err and "--hardware" in err


def test_no_command_prints_help(lab):
    rc, out, err = lab()
    assert rc == 2 and "usage" in out.lower() and "Traceback" not in err


# ------------------------------------------------------------------------------ env
def test_lab_env(lab):
    rc, out, err = lab("env")
    assert rc == 0 and "Traceback" not in err
    assert "torch" in out and torch.__version__ in out


def test_lab_env_json(lab):
    rc, out, err = lab("env", "--json")
    assert rc == 0
    info = json.loads(out)
    assert set(info) >= {"software", "gpu", "host", "git"}
    assert info["software"]["torch"] == torch.__version__
    if not torch.cuda.is_available():
        assert info["gpu"] is None


# ------------------------------------------------------------------------------ predict
@pytest.mark.parametrize("args, bound", [
    (["matmul", "--n", "8192", "--dtype", "fp16", "--hardware", "h200_sxm"], "compute"),
    (["matmul", "--n", "64", "--dtype", "fp16", "--hardware", "h200_sxm"], "memory"),   # N/3 < 206
    (["elementwise", "--n", "33554432", "--hardware", "a100_sxm_40gb"], "memory"),
    (["copy", "--n", "1000000", "--hardware", "rtx_4090"], "memory"),
    (["custom", "--flops", "1e12", "--bytes", "1e6", "--hardware", "mi300x"], "compute"),
    (["custom", "--flops", "1e12", "--bytes", "1e6", "--dtype", "fp32", "--hardware", "tpu_v5e"],
     "compute peak unknown"),
])
def test_predict(lab, args, bound):
    rc, out, err = lab("predict", *args)
    assert rc == 0, err
    [line] = [ln for ln in out.splitlines() if "bound" in ln and "│" in ln]
    assert bound in line


def test_predict_numbers(lab):
    rc, out, err = lab("predict", "matmul", "--n", "8192", "--dtype", "fp16", "--hardware", "h200_sxm")
    assert rc == 0
    assert "2731" in out.replace(",", "") or "2,731" in out        # intensity N/3
    assert "206.1" in out                                           # ridge 989.5 / 4.8


@cpu_only
def test_predict_without_hardware_on_cpu(lab):
    rc, out, err = lab("predict", "matmul", "--n", "8192")
    assert_one_line_error(rc, err)
    assert "--hardware" in err


@pytest.mark.parametrize("args, words", [
    (["custom", "--flops", "1e9", "--hardware", "h200_sxm"], "--bytes"),
    (["matmul", "--hardware", "h200_sxm"], "--n"),
    (["matmul", "--n", "-4096", "--hardware", "h200_sxm"], "--n must be a positive integer"),
    (["copy", "--n", "0", "--hardware", "h200_sxm"], "--n must be a positive integer"),
    (["custom", "--flops", "-1", "--bytes", "5", "--hardware", "h200_sxm"], "--flops must be a finite number"),
    (["custom", "--flops", "1", "--bytes", "nan", "--hardware", "h200_sxm"], "--bytes must be a finite number"),
    (["matmul", "--n", "8", "--dtype", "fp64", "--hardware", "h200_sxm"], "--dtype"),
    (["matmul", "--n", "8", "--hardware", "nope"], "unknown hardware key"),
    (["transpose", "--n", "8", "--hardware", "h200_sxm"], "unknown phase or exercise 'transpose'"),
    (["phase1", "--hardware", "h200_sxm"], "takes one exercise"),
    (["phase1.elementwise", "--param", "nope=1", "--hardware", "h200_sxm"], "--param nope"),
    (["phase1.elementwise", "--param", "sizes=[0]", "--hardware", "h200_sxm"], "sizes"),
    (["matmul", "--n", "8", "--param", "sizes=[1]", "--hardware", "h200_sxm"], "--param goes with an exercise"),
])
def test_predict_mistakes(lab, args, words):
    rc, out, err = lab("predict", *args)
    assert_one_line_error(rc, err)
    assert words in err


def test_predict_an_exercise_before_running_it(lab):
    """Every row the exercise would time at these sizes, with the spec prediction (and the
    calibrated one once a ceilings record of that GPU exists)."""
    rc, out, err = lab("predict", "phase1.elementwise", "--param", "sizes=[1000003]", "--hardware", "h200_sxm")
    assert rc == 0, err
    assert "copy n=1000003" in out and "mul n=1000003" in out and "1.2e+07" in out    # 12 bytes per multiply
    assert "spec sheet only" in out


@cpu_only
def test_predict_custom_without_bytes_or_hardware(lab):
    rc, out, err = lab("predict", "custom", "--flops", "1e9")
    assert_one_line_error(rc, err)


# ------------------------------------------------------------------------------ regressions (bugs found and fixed)
def test_record_command_is_the_command_main_was_given(lab, tmp_path):
    rc, out, err = lab("run", "phase0.gates", "--results", tmp_path)
    assert rc == 0
    [f] = json_files(tmp_path)
    assert "run phase0.gates" in read_json(f)["provenance"]["command"]


def test_lab_list_shows_an_exercises_declared_parameters(lab):
    rc, out, err = lab("list", "phase1.elementwise", "phase1.matmul_fp16")
    assert rc == 0, err
    assert "sizes" in out and "[33554432, 1073741824]" in out and "each an integer >= 1 (fp32 elements)" in out
    assert "dtype" in out and "one of fp16, bf16, fp32" in out
    rc, out, err = lab("list", "nope")
    assert rc == 2 and "unknown phase or exercise" in err


def test_an_in_process_call_gives_the_sigterm_handler_back(lab):
    import signal
    before = signal.getsignal(signal.SIGTERM)
    lab("list", "phase1.elementwise")
    assert signal.getsignal(signal.SIGTERM) is before
