"""Phase 4's counts and its calibrated model, without launching anything: each FLOP/byte formula
against a hand computation at an irregular size, `lab predict` for every exercise, the link
ceilings' alpha and beta, the alpha-beta calibrator, and which rows the accuracy leaves out.
(The same, end to end over gloo ranks: test_phase4_distributed.py.)"""
import importlib
import json
from pathlib import Path

import pytest

from common import roofline
from common.frame import Frame
from common.paths import REPO_ROOT
from common.records import load_records

col = importlib.import_module("phases.phase4_distributed.collectives")
cal = importlib.import_module("phases.phase4_distributed.calibration")
ddp = importlib.import_module("phases.phase4_distributed.ddp")
ring = importlib.import_module("phases.phase4_distributed.ring_allreduce")
sweep = importlib.import_module("phases.phase4_distributed.interconnect")
contention = importlib.import_module("phases.phase4_distributed.contention")
link = importlib.import_module("phases.phase4_distributed.link_ceilings")
report = importlib.import_module("phases.phase4_distributed.report")


# ------------------------------------------------------------------------------ the counts
@pytest.mark.parametrize("op, n, size, measured, wire", [
    # all_reduce: 32780 B = 8195 fp32 elements; a ring sends 2(n-1) chunks of S/n: 2 x 3 x 32780 / 4
    ("all_reduce", 4, 32780, 32780, 2 * 3 * 32780 / 4),
    ("ring_allreduce", 4, 32780, 32780, 2 * 3 * 32780 / 4),
    # all_gather: the output rounds down to 4 x 2048 elements = 32768 B; each rank receives 3 shares of 8192 B
    ("all_gather", 4, 32780, 32768, 3 * 8192),
    ("reduce_scatter", 3, 32780, 32772, 2 * 10924),     # 8193 elements = 3 x 2731; 2 shares of 10924 B out
    ("sendrecv", 5, 32782, 32780, 32780),              # whole elements; every byte sent once
])
def test_collective_work_is_the_bytes_on_each_ranks_link(op, n, size, measured, wire):
    w = col.collective_work(op, size, n)
    assert col.measured_size(op, size, n) == measured
    assert (w.flops, w.dtype, w.launches) == (0, None, 1)
    assert w.bytes == pytest.approx(wire)


def test_ddp_parameter_count_is_the_models():
    d, layers = 13, 3
    model = ddp.make_model(d, layers)
    assert ddp.param_count(d, layers) == sum(p.numel() for p in model.parameters()) == 3 * (8 * 169 + 7 * 13)
    # 6 FLOPs per matmul weight per token (2 forward, 4 backward); 8 d^2 matmul weights per block
    assert ddp.step_flops(d, layers, 37) == 6 * 37 * sum(m.weight.numel() for m in model.modules()
                                                         if isinstance(m, ddp.nn.Linear))


def test_contention_kernel_counts():
    t, d = 37, 13
    h = 4 * d
    k = contention.kernel_counts(t, d)
    # matmul [37, 13] @ [13, 52], bf16: read both operands, write the product
    assert k["matmul"] == (2 * t * d * h, 2 * (t * d + d * h + t * h), "bf16", 1)
    # layer norm backward, fp32: read dy, x (37 x 13), mean, rstd (37), gamma (13); write dx, dgamma, dbeta
    assert k["layer_norm_backward"] == (8 * t * d, 4 * (t * d + t * d + t + t + d) + 4 * (t * d + d + d), "fp32", 2)
    # gelu backward, bf16: read dy and x (37 x 52), write dx
    assert k["gelu_backward"] == (10 * t * h, 2 * (t * h + t * h + t * h), "bf16", 1)
    # bias grad dy.sum(0), bf16: read 37 x 52, write 52; one add per element read
    assert k["bias_grad"] == (t * h, 2 * (t * h + h), "bf16", 1)


def test_contention_rows_carry_the_kernels_launches():
    c = {"background": "nccl_all_reduce", "kernel": "layer_norm_backward", "flops": 8, "bytes": 100, "dtype": "fp32",
         "launches": 2, "alone_ms": [0.01, 0.02], "under_ms": [0.02, 0.03], "slowdown": [1.0, 0.5],
         "slowest_rank": 0, "max_slowdown": 1.0, "reps": [3, 3], "matches": True, "background_ms": [1.0, 1.0]}
    hbm = roofline.Roofs(bandwidth_gbps=4800.0, peak_tflops={"fp32": 67.0}, source="test")
    r = ddp._contention_row(c, {"world_size": 2}, hbm)
    assert r["prediction"]["launches"] == 2 and "excluded" not in r["prediction"]


# ------------------------------------------------------------------------------ `lab predict`
@pytest.mark.parametrize("ex_id, params", [
    ("phase4.link_ceilings", []), ("phase4.interconnect", ["--param", "sizes_bytes=[32780,1048576]"]),
    ("phase4.ring_allreduce", ["--param", "world_sizes=[2,8]"]), ("phase4.ddp", ["--param", "world_sizes=[4]"])])
def test_lab_predict_lists_every_phase4_exercises_rows(lab, ex_id, params):
    rc, out, err = lab("predict", ex_id, "--hardware", "h200_sxm", *params)
    assert rc == 0, err
    assert "predicted before running" in out


def test_work_lists_the_rows_run_would_time():
    p = sweep.EXERCISE.resolve_params(False, False, {"world_sizes": [2, 4], "sizes_bytes": [32780]})
    assert len(sweep.work(p)) == 2 * 5                     # 4 NCCL collectives and our ring, per world size
    p = ring.EXERCISE.resolve_params(False, False, {"world_sizes": [8], "sizes_bytes": [2**20]})
    w = ring.work(p)
    assert len(w) == 1 + 16 and {x.bytes for x in w} == {1.75 * 2**20}    # NCCL + 2 x 2 x 2 x 2 configurations
    p = link.EXERCISE.resolve_params(False, False, {"world_sizes": [2]})
    assert len(link.work(p)) == 6 * 4                      # 3 small + 3 large sizes x 4 collectives
    p = ddp.EXERCISE.resolve_params(False, False, {"world_sizes": [2], "nccl_max_channels": [None],
                                                   "nccl_high_priority": [False]})
    names = [x.label.split(" ")[0] for x in ddp.work(p)]
    assert names.count("bucket_5mb") == 1 and len([x for x in names if x.startswith("bucket_")]) == 15
    assert len([x for x in names if x.startswith("contention_")]) == 8


# ------------------------------------------------------------------------------ alpha and beta
def _row(op, n, size, ms, role, status="ok"):
    busbw = col.busbw_gbps(op, size, ms, n)
    return {"variant": op, "status": status, "params": {"op": op, "world_size": n, "size_bytes": size, "role": role},
            "metrics": {"ms": ms, "busbw_gbps": busbw}}


def test_alpha_is_the_median_small_time_and_beta_the_best_large_busbw():
    rows = [_row("all_reduce", 2, 2**15, 0.020, "alpha"), _row("all_reduce", 2, 2**16, 0.030, "alpha"),
            _row("all_reduce", 2, 2**17, 0.024, "alpha"),
            _row("all_reduce", 2, 2**30, 2**30 / 350e6, "beta"), _row("all_reduce", 2, 2**31, 2**31 / 360e6, "beta"),
            _row("sendrecv", 2, 2**15, 0.010, "alpha"), _row("sendrecv", 2, 2**30, 1.0, "beta", "failed"),
            _row("all_gather", 4, 2**15, 0.015, "alpha"), _row("all_gather", 4, 2**30, 2**30 / 300e6, "beta")]
    got = cal.ceilings_of(rows)
    assert set(got) == {"all_reduce", "all_gather"}                   # sendrecv: no ok large row
    ar = got["all_reduce"]["2"]
    assert ar["alpha_us"] == pytest.approx(24.0) and ar["busbw_factor"] == "2(n-1) / n"
    assert ar["beta_busbw_gbps"] == pytest.approx(360.0) and ar["beta_size_bytes"] == 2**31
    ag = got["all_gather"]["4"]
    assert ag["alpha_us"] == pytest.approx(15.0) and ag["beta_busbw_gbps"] == pytest.approx(300 * 0.75)


def test_link_ceilings_sizes_are_refused_when_they_overlap():
    from common.errors import LabError
    with pytest.raises(LabError, match="must all be below"):
        link.sizes_of({"small_sizes_bytes": [2**15, 2**20], "large_sizes_bytes": [2**20]})


def test_link_ceilings_rows_are_ceilings_not_tests():
    res = {"rows": [{"op": op, "size_bytes": col.measured_size(op, s, 2), "wrong": 0, "elements": 8, "warmup": 1,
                     "per_rank_samples_ms": [[0.1, 0.1], [0.1, 0.2]]} for s in (64, 4096) for op in ("all_reduce", "sendrecv")]}
    link_roof = roofline.Roofs(bandwidth_gbps=450.0, peak_tflops={}, source="test link")
    rows = link.rows_from(res, 2, "nccl", link_roof, [64], [4096], ["all_reduce", "sendrecv"])
    assert [r["params"]["role"] for r in rows] == ["alpha", "alpha", "beta", "beta"]
    assert all(r["prediction"]["excluded"].startswith("calibration: ") for r in rows)
    assert cal.ceilings_of(rows)["sendrecv"]["2"]["alpha_us"] == pytest.approx(150.0)   # slowest rank's median


# ------------------------------------------------------------------------------ the calibrator
CEIL = {"all_reduce": {"2": {"alpha_us": 20.0, "beta_busbw_gbps": 360.0, "busbw_factor": "2(n-1) / n"}},
        "sendrecv": {"2": {"alpha_us": 10.0, "beta_busbw_gbps": 150.0, "busbw_factor": "1"}}}


def _record(make_record, ex, rows, summary=None, started="2026-11-21T12:00:00Z", hardware="h200_sxm", kind="measured"):
    rec = make_record(exercise={"id": ex, "phase": 4, "name": ex.split(".")[1], "title": "t", "bench_version": 1},
                      rows=rows, summary=summary or {}, hardware={"key": hardware, "device": "cuda", "name": hardware,
                                                                  "spec": None},
                      source={"kind": kind, "citation": None if kind == "measured" else "elsewhere"})
    rec["provenance"]["started_utc"] = started
    rec["_path"] = f"phase4/{ex.split('.')[1]}/{hardware}/{started}.json"
    return rec


def _sweep_row(op, size, ms, n=2, variant=None, backend="nccl"):
    link_roof = roofline.Roofs(bandwidth_gbps=450.0, peak_tflops={}, source="test link")
    meas = {"size_bytes": size, "wrong": 0, "elements": 8, "warmup": 1, "per_rank_samples_ms": [[ms]] * n}
    return col.collective_row(variant or op, "all_reduce" if op == "ring_allreduce" else op,
                              {"world_size": n, "backend": backend, "size_bytes": size, "op": op, "dtype": "fp32"},
                              n, meas, link_roof, "test")


def test_the_calibrator_predicts_collectives_from_the_newest_link_ceilings(make_record):
    old = _record(make_record, cal.EXERCISE, [], {"backend": "nccl", "link_ceilings": {
        "all_reduce": {"2": {"alpha_us": 99.0, "beta_busbw_gbps": 1.0}}}}, started="2026-11-20T12:00:00Z")
    new = _record(make_record, cal.EXERCISE, [], {"backend": "nccl", "link_ceilings": CEIL})
    quoted = _record(make_record, cal.EXERCISE, [], {"backend": "nccl", "link_ceilings": {
        "all_reduce": {"2": {"alpha_us": 1.0, "beta_busbw_gbps": 1e6}}}}, started="2026-11-22T12:00:00Z", kind="quoted")
    rows = [_sweep_row("all_reduce", 2**30, 3.5), _sweep_row("ring_allreduce", 2**30, 4.0),
            _sweep_row("sendrecv", 2**15, 0.012), _sweep_row("all_gather", 2**30, 3.0),       # no all_gather ceiling
            _sweep_row("all_reduce", 2**30, 3.5, n=4)]                                       # nor one for 4 ranks
    ring_rows = [_sweep_row("all_reduce", 2**20, 0.03, variant="nccl"),
                 _sweep_row("ring_allreduce", 2**20, 0.05, variant="ring_l1_dir1_d1"),
                 {"variant": "naive_blocking", "status": "ok", "reason": None, "check": None, "timing": None,
                  "params": {"world_size": 2, "backend": "nccl", "size_bytes": 2**20},
                  "metrics": {"deadlocked": True}, "prediction": {"excluded": cal.NAIVE_LESSON}}]
    records = [old, new, quoted, _record(make_record, "phase4.interconnect", rows),
               _record(make_record, "phase4.ring_allreduce", ring_rows)]
    df = Frame.of(records, report.PHASE.excluded, report.PHASE.calibrators).df
    sw = df[df["exercise"] == "phase4.interconnect"].set_index(["params.op", "params.world_size"])
    big = roofline.alpha_beta_ms(2**30, 1.0, 20.0, 360.0)
    assert sw.loc[("all_reduce", 2), "calibrated.predicted_ms"] == pytest.approx(big)
    assert sw.loc[("all_reduce", 2), "calibrated.bound"] == "communication"
    assert sw.loc[("all_reduce", 2), "calibrated.measured_over_predicted"] == pytest.approx(3.5 / big)
    assert sw.loc[("all_reduce", 2), "calibrated.ceilings_record"] == f"results/{new['_path']}"
    assert sw.loc[("all_reduce", 2), "calibrated.computed"].startswith("at report time")
    assert sw.loc[("ring_allreduce", 2), "calibrated.predicted_ms"] == pytest.approx(big)   # NCCL's constants
    small = roofline.alpha_beta_ms(2**15, 1.0, 10.0, 150.0)
    assert sw.loc[("sendrecv", 2), "calibrated.predicted_ms"] == pytest.approx(small)
    assert sw.loc[("sendrecv", 2), "calibrated.bound"] == "latency"
    assert sw.loc[("all_gather", 2), "calibrated.predicted_ms"] != sw.loc[("all_gather", 2), "calibrated.predicted_ms"]
    assert sw.loc[("all_reduce", 4), "calibrated.predicted_ms"] != sw.loc[("all_reduce", 4), "calibrated.predicted_ms"]
    rg = df[df["exercise"] == "phase4.ring_allreduce"].set_index("variant")
    assert rg.loc["nccl", "calibrated.predicted_ms"] == pytest.approx(roofline.alpha_beta_ms(2**20, 1.0, 20.0, 360.0))
    assert rg.loc["ring_l1_dir1_d1", "calibrated.predicted_ms"] == rg.loc["nccl", "calibrated.predicted_ms"]
    assert rg.loc["naive_blocking", "calibrated.predicted_ms"] != rg.loc["naive_blocking", "calibrated.predicted_ms"]
    assert rg.loc["naive_blocking", "excluded"].startswith("lesson: ")


def test_no_link_ceilings_record_means_no_calibrated_prediction(make_record):
    other = _record(make_record, cal.EXERCISE, [], {"backend": "nccl", "link_ceilings": CEIL}, hardware="h100_sxm")
    gloo = _record(make_record, cal.EXERCISE, [], {"backend": "gloo", "link_ceilings": CEIL})
    records = [other, gloo, _record(make_record, "phase4.interconnect", [_sweep_row("all_reduce", 2**30, 3.5)])]
    df = Frame.of(records, report.PHASE.excluded, report.PHASE.calibrators).df
    assert df["calibrated.predicted_ms"].isna().all()


def test_run_time_attach_is_the_same_function():
    found = {("h200_sxm", "nccl", "all_reduce", 2): {**CEIL["all_reduce"]["2"], "record": "results/x.json"}}
    rows = cal.attach("phase4.interconnect", [_sweep_row("all_reduce", 2**30, 3.5), _sweep_row("sendrecv", 2**30, 9.0)],
                      found, "h200_sxm")
    block = rows[0]["prediction"]["calibrated"]
    assert block["predicted_ms"] == pytest.approx(roofline.alpha_beta_ms(2**30, 1.0, 20.0, 360.0))
    assert block["computed"].startswith("at run time") and block["ceilings_record"] == "results/x.json"
    assert "calibrated" not in rows[1]["prediction"]


# ------------------------------------------------------------------------------ what the accuracy counts
def test_committed_lessons_and_steps_are_excluded():
    res = REPO_ROOT / "results"
    seen = set()
    for path in sorted(res.glob("phase4/*/*/*.json")):
        for r in json.loads(Path(path).read_text())["rows"]:
            if r["variant"].startswith("bucket_") or r["variant"] == "naive_blocking":
                seen.add((json.loads(Path(path).read_text())["exercise"]["id"], r["variant"]))
    assert seen and not seen - set(report.PHASE.excluded)
    assert report.PHASE.excluded[("phase4.ring_allreduce", "naive_blocking")].startswith("lesson: ")


def test_committed_records_report_without_a_calibrated_collective():
    """No link-ceilings record is committed yet (multi-GPU runs come later): collectives carry none."""
    records = load_records(REPO_ROOT / "results", phase=4)
    df = Frame.of(records, report.PHASE.excluded, report.PHASE.calibrators).df
    coll = df[df["exercise"].isin(["phase4.interconnect", "phase4.ring_allreduce"])]
    if not any(r["exercise"]["id"] == cal.EXERCISE for r in records):
        assert coll["calibrated.predicted_ms"].isna().all()
    steps = df[df["variant"].str.startswith("bucket_")]
    assert steps["excluded"].notna().all()
