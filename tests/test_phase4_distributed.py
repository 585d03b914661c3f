"""Phase 4 for real, over gloo on CPU processes launched by torchrun: the ring, the sweep's #wrong,
the DDP checksums, with 2 and 4 ranks; `lab run 4` end to end; a rank that crashes or hangs.

Starting ranks is most of the cost (every process imports torch), so ranks are started few times:
one `lab run 4 --quick` with 2 ranks, and one 4-rank job running all three tasks in one group.
"""
import importlib
import os
import time
import uuid
from pathlib import Path

import pytest
from conftest import as_full_run, cpu_only, json_files, run_lab

from common import roofline
from common.errors import LabError
from common.records import load_records, problems

col = importlib.import_module("phases.phase4_distributed.collectives")
launch = importlib.import_module("phases.phase4_distributed.launch")
ring = importlib.import_module("phases.phase4_distributed.ring_allreduce")
ddp = importlib.import_module("phases.phase4_distributed.ddp")
sweep = importlib.import_module("phases.phase4_distributed.interconnect")
cal = importlib.import_module("phases.phase4_distributed.calibration")
report = importlib.import_module("phases.phase4_distributed.report")

ROOFS = roofline.Roofs(bandwidth_gbps=10.0, peak_tflops={"fp32": 1.0}, source="test roofs")


def cpu_params(mod, **overrides):
    return {**mod.EXERCISE.resolve_params(True, True, {}), "backend": "gloo", **overrides}


# ------------------------------------------------------------------------------ `lab run 4`, 2 ranks
@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    results = tmp_path_factory.mktemp("phase4") / "results"
    t0 = time.monotonic()
    proc = run_lab("run", "4", "--quick", "--device", "cpu", "--param", "backend=gloo",
                   "--param", "world_sizes=[2]", "--results", results, timeout=300)
    return {"proc": proc, "results": results, "records": load_records(results), "s": time.monotonic() - t0}


def _rec(run, ex):
    [rec] = [r for r in run["records"] if r["exercise"]["id"] == ex]
    return rec


def test_lab_run_4_over_gloo_exits_0_with_valid_records(gloo_run):
    proc = gloo_run["proc"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(r["exercise"]["id"] for r in gloo_run["records"]) == \
        ["phase4.ddp", "phase4.interconnect", "phase4.link_ceilings", "phase4.ring_allreduce"]
    for rec in gloo_run["records"]:
        path = rec.pop("_path")
        assert problems(rec) == [], path
        rec["_path"] = path
        assert rec["status"] == "ok", (rec["exercise"]["id"], rec["reason"])
        assert rec["summary"]["backend"] == "gloo" and rec["summary"]["world_sizes"] == [2]


def test_link_ceilings_measure_alpha_and_beta_of_every_collective(gloo_run):
    rec = _rec(gloo_run, "phase4.link_ceilings")
    ceil = rec["summary"]["link_ceilings"]
    assert sorted(ceil) == sorted(col.OPS)
    for op, per_n in ceil.items():
        c = per_n["2"]
        assert c["alpha_us"] > 0 and c["beta_busbw_gbps"] > 0 and c["busbw_factor"] == cal.FACTOR_RULES[op]
        small = [r for r in rec["rows"] if r["params"]["op"] == op and r["params"]["role"] == "alpha"]
        large = [r for r in rec["rows"] if r["params"]["op"] == op and r["params"]["role"] == "beta"]
        assert len(small) == len(large) == 2                      # the quick sizes: 2 small, 2 large
        assert c["beta_busbw_gbps"] == max(r["metrics"]["busbw_gbps"] for r in large)
    assert all(r["prediction"]["excluded"].startswith("calibration: ") for r in rec["rows"])


def test_the_sweep_and_the_ring_are_predicted_from_the_link_ceilings(gloo_run):
    """Run after phase4.link_ceilings, every timed collective row carries the alpha-beta prediction,
    and the report's calibrator (the same function) gives the same numbers from the records."""
    from common.frame import Frame
    ceil = _rec(gloo_run, "phase4.link_ceilings")
    constants = ceil["summary"]["link_ceilings"]
    timed = [(ex, r) for ex in ("phase4.interconnect", "phase4.ring_allreduce") for r in _rec(gloo_run, ex)["rows"]
             if r["status"] == "ok" and r.get("timing")]
    assert len(timed) > 10
    for ex, r in timed:
        c = r["prediction"]["calibrated"]
        k = constants[cal.model_op(r["params"].get("op", "all_reduce"))]["2"]
        want = roofline.alpha_beta_ms(r["params"]["size_bytes"], col.busbw_factor(r["params"].get("op", "all_reduce"), 2),
                                      k["alpha_us"], k["beta_busbw_gbps"])
        assert c["predicted_ms"] == pytest.approx(want) and c["computed"].startswith("at run time")
        assert c["ceilings_record"] == f"results/{ceil['_path']}" and c["bound"] in ("latency", "communication")
        assert c["measured_over_predicted"] == pytest.approx(r["metrics"]["ms"] / want)
    df = Frame.of([as_full_run(r) for r in gloo_run["records"]]).df
    sweep_rows = df[(df["exercise"] == "phase4.interconnect") & (df["status"] == "ok")]
    for (_, fr), (_, r) in zip(sweep_rows.iterrows(), [t for t in timed if t[0] == "phase4.interconnect"]):
        again = cal.calibrator(fr, gloo_run["records"])
        assert again["predicted_ms"] == pytest.approx(r["prediction"]["calibrated"]["predicted_ms"])
        assert again["computed"].startswith("at report time")


def test_naive_blocking_order_deadlocks_and_is_killed(gloo_run):
    [r] = [r for r in _rec(gloo_run, "phase4.ring_allreduce")["rows"] if r["variant"] == "naive_blocking"]
    assert r["prediction"]["excluded"].startswith("lesson: ")
    m = r["metrics"]
    assert m["deadlocked"] and m["killed"] and m["ranks_returned"] == 0
    assert m["outcome"].startswith("deadlocked as predicted after ")
    assert m["waited_s"] >= 1.0                    # quick params wait 1.5 s once every rank is inside dist.send


def test_ring_records_checks_before_timing(gloo_run):
    rows = _rec(gloo_run, "phase4.ring_allreduce")["rows"]
    checks = [r for r in rows if r["variant"].startswith("check_")]
    assert checks and all(r["status"] == "ok" and r["metrics"]["integers_exact"] for r in checks)
    assert {(r["params"]["lanes"], r["params"]["directions"], r["params"]["depth"]) for r in checks} == \
        {(1, 2, 1), (1, 2, 3), (2, 2, 1), (2, 2, 3)}
    timed = [r for r in rows if r["variant"].startswith("ring_l")]
    assert {r["variant"] for r in timed} == {"ring_l1_dir2_d1", "ring_l1_dir2_d3", "ring_l2_dir2_d1", "ring_l2_dir2_d3"}
    assert timed and all(r["status"] == "ok" and r["metrics"]["ours_over_nccl_busbw"] > 0 for r in timed)
    assert all(r["check"]["wrong_elements"] == 0 for r in timed)


def test_sweep_rows_follow_nccl_tests(gloo_run):
    rows = _rec(gloo_run, "phase4.interconnect")["rows"]
    assert {r["params"]["op"] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter", "sendrecv",
                                                  "ring_allreduce"}
    for r in rows:
        m, op = r["metrics"], r["params"]["op"]
        assert r["status"] == "ok" and m["wrong"] == 0 and r["check"]["checked_elements"] > 0
        factor = col.busbw_factor(op, 2)
        assert m["busbw_factor"] == factor
        assert m["busbw_gbps"] == pytest.approx(m["algbw_gbps"] * factor)
        assert m["algbw_gbps"] == pytest.approx(r["params"]["size_bytes"] / (m["ms"] * 1e6))
        assert r["prediction"]["bytes"] == pytest.approx(factor * r["params"]["size_bytes"])
    sizes = {r["params"]["op"]: r["params"]["size_bytes"] for r in rows if r["params"]["size_bytes"] < 2**16}
    assert sizes["all_reduce"] == 2**15 + 12 and sizes["all_gather"] == 2**15 + 8    # rounded to n elements


def test_ddp_checksums_identical_after_broadcast_and_steps(gloo_run):
    by = {r["variant"]: r for r in _rec(gloo_run, "phase4.ddp")["rows"]}
    b, a = by["checksum_broadcast"]["metrics"], by["checksum_after_steps"]["metrics"]
    assert b["distinct_before"] == 2 and len(set(b["checksum_after_broadcast"])) == 1
    assert len(set(a["checksum_after_steps"])) == 1 and a["distinct_first_losses"] == 2
    assert a["checksum_after_steps"] != b["checksum_after_broadcast"]                  # the steps did train
    buckets = [r for r in by.values() if r["variant"].startswith("bucket_")]
    assert buckets and all(0 <= r["metrics"]["hidden_fraction"] <= 1 for r in buckets)
    st = by["per_rank_steps_straggler"]["metrics"]
    assert st["per_rank_local_ms"][1] > st["per_rank_local_ms"][0] + 10                 # rank 1 slept 20 ms
    assert min(st["per_rank_ddp_ms"]) > 10                                              # rank 0 waited for it


def test_report_and_plot_from_gloo_records(gloo_run, tmp_path):
    from common import render
    from common.frame import Frame
    v = render.View(Frame.of([as_full_run(r) for r in gloo_run["records"]]), tmp_path / "README.md", gloo_run["results"])
    text = {b.id: render.block(v, b) for b in report.PHASE.blocks}
    assert all(t.strip() for t in text.values())
    assert "deadlocked as predicted" in text["phase4.deadlock"]
    assert "2 CPU processes (gloo)" in text["phase4.sweep"] and "| all-reduce (ours: ring) |" in text["phase4.sweep"]
    assert "No records yet" in text["phase4.goals"]          # goals and findings are for GPUs
    assert report.PLOT.hardware is None and render.plot_hardware(v, report.PLOT) == [gloo_run["records"][0]["hardware"]["key"]]
    path = tmp_path / "busbw.png"
    report.PLOT.draw(v, render.plot_hardware(v, report.PLOT)[0], path)
    assert path.stat().st_size > 1000
    stored = _rec(gloo_run, "phase4.interconnect")["summary"]["analysis"]["2"]
    assert stored == report.findings.__globals__["analysis"].sweep_facts(
        [r for r in _rec(gloo_run, "phase4.interconnect")["rows"] if r["params"].get("world_size") == 2])


@pytest.mark.parametrize("module", ["link_ceilings", "ring_allreduce", "interconnect", "ddp"])
def test_each_exercise_runs_alone_on_two_cpu_ranks(module):
    """`python -m phases.phase4_distributed.<module>`: gloo, 2 ranks, small irregular sizes, a table."""
    import subprocess
    import sys
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", f"phases.phase4_distributed.{module}"], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(quick timing, no record written)" in proc.stdout and "| ok |" in proc.stdout
    assert time.monotonic() - t0 < 60


# ------------------------------------------------------------------------------ 4 ranks, one job
@pytest.fixture(scope="module")
def four_ranks():
    p = {"pg_timeout_s": 60,
         "ring": cpu_params(ring, lanes=[1, 3], directions=[1, 2], depths=[1, 2, 3], check_numels=[1, 3, 1031, 100_003]),
         "sweep": cpu_params(sweep), "ddp": cpu_params(ddp)}
    res = launch.launch("ring+sweep+ddp", 4, "gloo", p, 240, "4 ranks")
    return p, res


def test_ring_equals_all_reduce_on_4_ranks(four_ranks):
    p, res = four_ranks
    rows = ring.rows_from(res["ring"], 4, "gloo", ROOFS, p["ring"])
    checks = [r for r in rows if r["variant"].startswith("check_")]
    assert len(checks) == 2 * 2 * 3 * 4 and all(r["status"] == "ok" for r in checks)
    for r in checks:
        assert r["check"]["wrong_elements"] == 0 and r["metrics"]["integers_exact"]
        assert r["check"]["rel_l2_error"] < 1e-6                   # random floats: only the order of sums differs
    assert {r["params"]["numel"] for r in checks} == {1, 3, 1031, 100_003}
    assert all(r["status"] == "ok" for r in rows if r["variant"].startswith("ring_l"))
    assert {(r["params"]["lanes"], r["params"]["directions"]) for r in rows if r["variant"].startswith("ring_l")} == \
        {(1, 1), (1, 2), (3, 1), (3, 2)}


def test_sweep_counts_zero_wrong_on_4_ranks(four_ranks):
    p, res = four_ranks
    rows = sweep.rows_from(res["sweep"], 4, "gloo", ROOFS, None)
    assert len(rows) == 5 * len(p["sweep"]["sizes_bytes"])
    for r in rows:
        assert r["status"] == "ok" and r["metrics"]["wrong"] == 0
        assert r["metrics"]["busbw_factor"] == col.busbw_factor(r["params"]["op"], 4)


def test_ddp_checksums_on_4_ranks(four_ranks):
    p, res = four_ranks
    assert len(set(res["ddp"]["checksum_before_ddp"])) == 4
    assert len(set(res["ddp"]["checksum_after_broadcast"])) == 1
    assert len(set(res["ddp"]["checksum_after_steps"])) == 1 and res["ddp"]["steps"] == 20
    rows = ddp.rows_from(res["ddp"], 4, "gloo", p["ddp"], ROOFS, None)
    assert all(r["status"] == "ok" for r in rows)
    assert all(len(r["metrics"]["per_rank_ddp_ms"]) == 4 for r in rows if r["variant"].startswith("bucket_"))


# ------------------------------------------------------------------------------ failures never hang
def _alive(marker: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker.encode() in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def test_a_crashing_rank_is_named_and_the_others_stop(monkeypatch):
    marker = f"crash-{uuid.uuid4().hex}"
    monkeypatch.setenv("LAB_PHASE4_FAULT", "crash:1")
    t0 = time.monotonic()
    with pytest.raises(LabError) as err:
        launch.launch("sweep", 2, "gloo", {**cpu_params(sweep), "test_marker": marker}, 60, "phase4.interconnect on 2 ranks")
    msg = str(err.value)
    assert msg.startswith("phase4.interconnect on 2 ranks: rank 1 of 2 died with exit code 3") and "\n" not in msg
    assert time.monotonic() - t0 < 45
    assert _alive(marker) == []


def test_a_hanging_rank_is_killed_after_the_timeout(monkeypatch):
    marker = f"hang-{uuid.uuid4().hex}"
    monkeypatch.setenv("LAB_PHASE4_FAULT", "hang:1")
    t0 = time.monotonic()
    with pytest.raises(LabError, match=r"no result after 10 s, so the 2 ranks were killed; last progress: ") as err:
        launch.launch("sweep", 2, "gloo", {**cpu_params(sweep, pg_timeout_s=300), "test_marker": marker}, 10,
                      "phase4.interconnect on 2 ranks")
    assert time.monotonic() - t0 < 30
    if "fault injected" in str(err.value):
        assert "rank 1 at 'fault injected: hang'" in str(err.value)
    time.sleep(0.5)
    assert _alive(marker) == []


# ------------------------------------------------------------------------------ no GPU, no gloo asked
@cpu_only
def test_no_gpu_and_no_gloo_is_a_clear_skip(lab, tmp_path):
    rc, out, err = lab("run", "4", "--quick", "--results", tmp_path)
    assert rc == 3
    assert [ln for ln in err.splitlines() if ln.strip()] == \
        ["lab: nothing ran: every selected exercise was skipped (reasons above)"]
    for ex in ("phase4.link_ceilings", "phase4.ddp", "phase4.ring_allreduce", "phase4.interconnect"):
        assert f"skip {ex}: no GPU in this run" in out
    assert len(json_files(tmp_path)) == 4                  # skipped records, saying why
    rc, out, _ = lab("run", "phase4.ring_allreduce", "--param", "backend=nccl", "--results", tmp_path)
    assert rc == 3 and "needs CUDA GPUs" in out
    assert os.environ.get("LAB_PHASE4_FAULT") is None


# ------------------------------------------------------------------------------ on GPUs (pytest -m gpu)
def _need_gpus(n: int):
    import torch
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs")


@pytest.mark.gpu
def test_quick_run_on_two_gpus(tmp_path):
    _need_gpus(2)
    proc = run_lab("run", "4", "--quick", "--param", "world_sizes=[2]", "--results", tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs = {r["exercise"]["id"]: r for r in load_records(tmp_path)}
    assert all(r["status"] == "ok" and r["summary"]["backend"] == "nccl" for r in recs.values())
    naive = [r for r in recs["phase4.ring_allreduce"]["rows"] if r["variant"] == "naive_blocking"]
    assert naive and naive[0]["metrics"]["deadlocked"]
    assert all(r["metrics"]["wrong"] == 0 for r in recs["phase4.interconnect"]["rows"])


@pytest.mark.gpu
def test_nccl_algorithm_is_observed(tmp_path):
    _need_gpus(2)
    proc = run_lab("run", "phase4.interconnect", "--quick", "--param", "world_sizes=[2]", "--results", tmp_path,
                   timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [rec] = load_records(tmp_path)
    assert rec["summary"]["algo_probe"]["2"]["tuning_lines_parsed"] > 0
    assert all(r["metrics"]["algo"] for r in rec["rows"] if r["params"]["op"] == "all_reduce")
