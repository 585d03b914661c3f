"""Phase 5's exercises end to end on the CPU (tiny shape, the real server on loopback), the vLLM
exercise's launch and skip paths with a stand-in `vllm` executable, the refusals, and the
predictions and checks the records rely on."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from common.paths import REPO_ROOT
from phases.phase5_inference.predictions import analysis
from phases.phase5_inference.benchmark import serving
from phases.phase5_inference.engine import named

LAB = [sys.executable, "-m", "common.cli"]


def lab(*args, env=None, timeout=300):
    return subprocess.run([*LAB, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def records(folder: Path, exercise: str) -> list[dict]:
    phase, name = exercise.split(".")
    return [json.loads(p.read_text()) for p in sorted((folder / phase / name).rglob("*.json"))]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("phase5")
    proc = lab("run", "5", "--device", "cpu", "--results", str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_phase5_runs_on_cpu_and_every_timed_row_is_checked_and_predicted(cpu_run):
    for exercise in ("phase5.startup", "phase5.ttft_decode", "phase5.batching", "phase5.offline"):
        [rec] = records(cpu_run, exercise)
        assert rec["status"] == "ok", (exercise, rec["reason"])
        for row in rec["rows"]:
            assert row["status"] == "ok", (exercise, row["variant"], row["reason"])
            if row["timing"]:
                assert row["check"]["passed"]
                assert row["prediction"]["predicted_ms"] > 0 and row["prediction"]["measured_over_predicted"] > 0
    [skipped] = records(cpu_run, "phase5.vllm_serve")
    assert skipped["status"] == "skipped" and "vllm" in skipped["reason"]


def test_batching_rows_carry_the_sweep_and_its_ratios(cpu_run):
    [rec] = records(cpu_run, "phase5.batching")
    levels = [r["params"]["concurrency"] for r in rec["rows"]]
    assert levels == [1, 2, 4]
    for r in rec["rows"]:
        m = r["metrics"]
        assert m["completed"] >= 2 and m["output_tok_s"] > 0 and m["predicted_output_tok_s"] > 0
        assert m["ttft_median_ms"] <= m["e2el_median_ms"]
        assert m["engine_decode_step_ms"] > 0
    assert rec["rows"][0]["metrics"]["x_output_tok_s_vs_1"] == 1.0
    assert rec["summary"]["best_concurrency"] in levels
    # the host's scheduler step at each level, timed on the CPU before the rows (the summed model's ceiling)
    assert set(rec["summary"]["host_step_us"]) == {"1", "2", "4"} and all(v > 0 for v in rec["summary"]["host_step_us"].values())


def test_ttft_decode_checks_the_engine_against_the_plain_model(cpu_run):
    [rec] = records(cpu_run, "phase5.ttft_decode")
    by = {r["variant"]: r for r in rec["rows"]}
    assert set(by) == {"lab-engine", "lab-engine-prefill", "pytorch-eager"}
    check = by["lab-engine"]["check"]
    assert check["passed"] and check["tokens_checked"] == 8 and check["max_logit_gap"] <= check["tolerance"]
    assert by["lab-engine"]["metrics"]["serving_overhead"] > 0
    assert by["pytorch-eager"]["metrics"]["agrees_with_engine_tokens"] == 1.0   # fp32: the same greedy tokens


def test_ttft_decode_records_the_first_requests_ttft_beside_the_steady_state(cpu_run):
    [rec] = records(cpu_run, "phase5.ttft_decode")
    m = next(r for r in rec["rows"] if r["variant"] == "lab-engine-prefill")["metrics"]
    assert m["first_request_ttft_ms"] > 0 and m["first_over_steady_ttft"] > 0
    assert m["first_engine_prefill_step_ms"] > 0 and m["steady_engine_prefill_step_ms"] > 0
    assert m["graph_capture_s"] == 0.0 and "no CUDA graphs were captured" in m["first_request_why"]
    assert f"{m['first_request_ttft_ms']:.1f} ms against {m['ttft_p50_ms']:.1f} ms steady" in m["first_request_why"]


def test_teacher_forced_check_fails_on_tokens_the_model_would_not_choose():
    from phases.phase5_inference.benchmark.baseline import PlainLlama
    from phases.phase5_inference.engine import random_weights
    from phases.phase5_inference.ttft_decode import engine_check, teacher_forced_check, teacher_forced_logits

    shape = named("tiny")
    weights = random_weights(shape, 0, torch.float32)
    plain = PlainLlama(shape, max_seq_len=64, dtype=torch.float32).load(weights)
    prompt = list(range(100, 110))
    tokens, _ = plain.generate(prompt, 6)
    verdict = engine_check(plain, weights, shape, prompt, tokens, torch.device("cpu"))
    assert verdict["passed"] and verdict["plain_max_logit_gap"] == 0 and verdict["tolerance"] == 1e-3
    truth = teacher_forced_logits(plain, prompt, tokens)
    worst = int(truth[3].argmin())
    wrong = tokens[:3] + [worst] + tokens[4:]
    verdict = teacher_forced_check(teacher_forced_logits(plain, prompt, wrong), wrong, 1e-3)
    assert not verdict["passed"] and "below the reference's best logit" in verdict["reason"]


def test_the_tolerance_is_what_the_plain_model_strays_in_bf16():
    """In bf16 the plain model's own greedy choices fall below the fp32 model's best by some margin
    (its rounding noise); the engine is allowed twice that, and a wrong token still fails."""
    from phases.phase5_inference.benchmark.baseline import PlainLlama
    from phases.phase5_inference.engine import random_weights
    from phases.phase5_inference.ttft_decode import NOISE_MARGIN, engine_check

    shape = named("tiny")
    weights = random_weights(shape, 0, torch.float32)
    prompt = list(range(200, 240))
    tokens, _ = PlainLlama(shape, max_seq_len=96, dtype=torch.float32).load(weights).generate(prompt, 24)
    half = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    plain16 = PlainLlama(shape, max_seq_len=96, dtype=torch.bfloat16).load(half)
    verdict = engine_check(plain16, half, shape, prompt, tokens, torch.device("cpu"))
    assert verdict["passed"], verdict
    assert verdict["tolerance"] == max(1e-3, NOISE_MARGIN * verdict["plain_max_logit_gap"])
    wrong = tokens[:5] + [0] * (len(tokens) - 5)
    assert not engine_check(plain16, half, shape, prompt, wrong, torch.device("cpu"))["passed"]


def test_serving_check_rejects_failed_and_short_requests():
    from phases.phase5_inference.benchmark.client import RequestResult, summarize

    good = [RequestResult(success=True, ttft_s=0.01, e2el_s=0.1, itl_s=[0.01] * 7, prompt_tokens=4, completion_tokens=8)
            for _ in range(3)]
    assert serving.serving_check(summarize(good, 1.0), 8)["passed"]
    short = good[:2] + [RequestResult(success=True, ttft_s=0.01, e2el_s=0.1, prompt_tokens=4, completion_tokens=5)]
    assert "returned 5 tokens" in serving.serving_check(summarize(short, 1.0), 8)["reason"]
    failed = good[:2] + [RequestResult(success=False, error="HTTP 503")]
    assert not serving.serving_check(summarize(failed, 1.0), 8)["passed"]


STAND_IN = textwrap.dedent("""\
    #!{python}
    # A stand-in for `vllm serve`: checks the arguments the exercise passes, then serves the tiny
    # shape with the lab's server on the port vLLM was asked for.
    import json, os, sys
    args = sys.argv[1:]
    assert args[0] == "serve", args
    config = json.load(open(os.path.join(args[1], "config.json")))
    assert config["model_type"] == "llama" and "--load-format" in args and "--skip-tokenizer-init" in args
    flag = lambda name: args[args.index(name) + 1]
    os.execv(sys.executable, [sys.executable, "-m", "phases.phase5_inference.engine.server", "--model", "tiny",
             "--host", flag("--host"), "--port", flag("--port"), "--served-model-name", flag("--served-model-name"),
             "--device", "cpu", "--dtype", "float32"])
    """)


def test_vllm_exercise_launches_vllm_serve_and_runs_the_sweep(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "vllm"
    stand_in.write_text(STAND_IN.format(python=sys.executable))
    stand_in.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO_ROOT)}
    proc = lab("run", "phase5.vllm_serve", "--device", "cpu", "--results", str(tmp_path / "r"),
               "--param", "concurrency=[1,2]", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [rec] = records(tmp_path / "r", "phase5.vllm_serve")
    assert rec["status"] == "ok" and [r["variant"] for r in rec["rows"]] == ["vllm", "vllm"]
    assert rec["summary"]["command"].startswith("vllm serve <model> --host 127.0.0.1")


def test_vllm_exercise_is_skipped_with_its_reason_where_vllm_is_missing(tmp_path):
    proc = lab("run", "phase5.vllm_serve", "--device", "cpu", "--results", str(tmp_path),
               env={"PATH": os.path.dirname(sys.executable)})
    assert proc.returncode == 3, proc.stdout + proc.stderr
    [rec] = records(tmp_path, "phase5.vllm_serve")
    assert rec["status"] == "skipped" and rec["reason"] == "needs `vllm` on PATH; not found"


@pytest.mark.parametrize("args, message", [
    (["--param", "base_url=http://127.0.0.1:9"], "does not answer GET http://127.0.0.1:9/v1/models"),
    (["--param", "model=llama-9"], "model=llama-9"),
    (["--param", "concurrency=[0]"], "concurrency"),
])
def test_bad_serving_parameters_end_in_one_line_before_any_work(tmp_path, args, message):
    proc = lab("run", "phase5.batching", "--device", "cpu", "--results", str(tmp_path), *args, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not list(tmp_path.rglob("*.json"))


def test_offline_rejects_a_length_range_that_runs_backwards(tmp_path):
    proc = lab("run", "phase5.offline", "--device", "cpu", "--results", str(tmp_path),
               "--param", "input_tokens=[50,10]", timeout=60)
    assert proc.returncode == 2 and "the low end 50 is above the high end 10" in proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["--model", "nope"], "unknown model shape 'nope'"),
    (["--port", "99999"], "not a TCP port"),
    (["--gpu-memory-utilization", "2"], "gpu_memory_utilization must be in (0, 1]"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--speculative-model", "ngram"], "num_speculative_tokens must be an integer in [1, 8]"),
    (["--speculative-model", "nope", "--num-speculative-tokens", "4"], "unknown model shape 'nope'"),
])
def test_lab_serve_refuses_bad_flags_in_one_line(argv, message):
    proc = lab("serve", *argv, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_lab_serve_refuses_a_port_in_use():
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = lab("serve", "--port", str(taken.getsockname()[1]), timeout=60)
    assert proc.returncode == 2 and "cannot listen on 127.0.0.1" in proc.stderr


# ------------------------------------------------------------------------------ predictions
def test_decode_turns_compute_bound_near_the_ridge():
    shape = named("llama-3.1-8b")
    ridge = analysis.ridge_batch(shape, bandwidth_gbps=4800, peak_tflops=989.5)
    assert 150 < ridge < 250                         # ~ peak / bandwidth, bf16: 2 bytes, 2 FLOPs per weight
    low = analysis.serving_prediction(shape, 8, 100, 200, 4800, 989.5)
    one = analysis.serving_prediction(shape, 1, 100, 200, 4800, 989.5)
    high = analysis.serving_prediction(shape, 512, 100, 200, 4800, 989.5)
    assert low["bound"] == "memory" and high["bound"] == "compute"
    assert low["decode_step_ms"] / one["decode_step_ms"] < 1.05       # flat TPOT below the ridge
    assert 7 < low["output_tok_s"] / one["output_tok_s"] <= 8


def test_offline_schedule_packs_prefills_then_decodes_while_any_sequence_is_unfinished():
    shape = named("tiny")
    steps = analysis.offline_steps(shape, [10, 20, 30], [5, 3, 1], max_num_seqs=8, max_batched_tokens=25)
    # prefills [10], [20], [30] (no two fit in 25 tokens), then decode steps 1..4 of the 5-token sequence
    assert len(steps) == 3 + 4 and all(len(step) == 1 for step in steps[:3])
    decode_bytes = [sum(b for _, b in step) for step in steps[3:]]
    weights = shape.decode_weight_bytes()
    kv = shape.kv_bytes_per_token()
    assert decode_bytes[0] == pytest.approx(weights + kv * ((10 + 1) + (20 + 1)))   # two sequences still going
    assert decode_bytes[-1] == pytest.approx(weights + kv * (10 + 4))                # only the first is left
