"""Phase 4 without launching anything: nccl-tests arithmetic, #wrong, rows, plans, failure parsing."""
import importlib
import math

import pytest
import torch

from common import roofline
from common.errors import LabError
from common.records import problems

col = importlib.import_module("phases.phase4_distributed.collectives")
launch = importlib.import_module("phases.phase4_distributed.launch")
ring = importlib.import_module("phases.phase4_distributed.ring_allreduce")
ddp = importlib.import_module("phases.phase4_distributed.ddp")
sweep = importlib.import_module("phases.phase4_distributed.interconnect")
analysis = importlib.import_module("phases.phase4_distributed.analysis")
groups = importlib.import_module("phases.phase4_distributed.groups")
findings = importlib.import_module("phases.phase4_distributed.findings")

LINK = roofline.Roofs(bandwidth_gbps=450.0, peak_tflops={"bf16": 989.5}, source="test link",
                      bandwidth_source="test link source")


# ------------------------------------------------------------------------------ busbw arithmetic
@pytest.mark.parametrize("op, n, factor", [
    ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_reduce", 8, 1.75), ("ring_allreduce", 4, 1.5),
    ("all_gather", 2, 0.5), ("all_gather", 4, 0.75), ("reduce_scatter", 4, 0.75), ("sendrecv", 4, 1.0)])
def test_busbw_factors(op, n, factor):
    assert col.busbw_factor(op, n) == pytest.approx(factor)


def test_algbw_busbw_and_wire_bytes():
    size, ms = 2**30, 4.0
    assert col.algbw_gbps(size, ms) == pytest.approx(2**30 / 4e-3 / 1e9)          # bytes / seconds / 1e9
    assert col.busbw_gbps("all_reduce", size, ms, 4) == pytest.approx(1.5 * col.algbw_gbps(size, ms))
    assert col.wire_bytes("all_reduce", size, 4) == 2 * 3 * (size // 4)             # 2(n-1) chunks of S/n
    assert col.wire_bytes("all_gather", size, 4) == 3 * (size // 4)                # n-1 chunks of S/n
    assert col.wire_bytes("sendrecv", size, 4) == size
    with pytest.raises(ValueError):
        col.busbw_factor("broadcast", 4)


def test_sizes_follow_nccl_tests():
    assert col.elements_for("all_reduce", 32780, 4) == (8195, 8195)
    assert col.elements_for("all_gather", 32780, 4) == (8192, 2048)               # output; each rank 1/n
    assert col.elements_for("reduce_scatter", 32780, 2) == (8194, 4097)
    assert col.iterations(2**32, {"warmup_iters": 5, "min_iters": 20, "max_iters": 200, "iter_bytes": 2**33}) == (5, 20)
    assert col.iterations(2**15, {"warmup_iters": 5, "min_iters": 20, "max_iters": 200, "iter_bytes": 2**33}) == (5, 200)


# ------------------------------------------------------------------------------ #wrong
def test_pattern_sums_are_exact_integers():
    n = 8
    s = col.pattern_sum(0, 5000, n, "cpu")
    exact = sum(col.pattern(0, 5000, r, "cpu").double() for r in range(n))
    assert torch.equal(s.double(), exact)
    assert s.abs().max() <= 30 * n and torch.equal(s, s.round())
    assert len(set(col.pattern(0, 64, 0, "cpu").tolist())) > 20                    # not constant, never all zero


def test_count_wrong_catches_a_corrupted_result(monkeypatch):
    monkeypatch.setattr(col, "CHUNK_ELEMENTS", 1000)                                # walk the tensor in chunks
    n, numel = 4, 4097
    want = lambda s, e: col.pattern_sum(s, e, n, "cpu")                            # noqa: E731
    good = col.pattern_sum(0, numel, n, "cpu")
    assert col.count_wrong(good, want) == 0
    bad = good.clone()
    bad[7] += 1
    bad[4000] = float("nan")                                                        # an unwritten element
    assert col.count_wrong(bad, want) == 2
    swapped = torch.cat([good[1024:2048], good[:1024], good[2048:]])                # chunks in the wrong place
    assert col.count_wrong(swapped, want) > 1000
    assert col.count_wrong(good[100:200], want, offset=100) == 0


def test_a_row_with_wrong_elements_fails_and_is_not_timed():
    meas = {"size_bytes": 4096, "wrong": 3, "elements": 2048}
    r = col.collective_row("all_reduce", "all_reduce", {"world_size": 2}, 2, meas, LINK, "m")
    assert r["status"] == "failed" and r["timing"] is None and "#wrong = 3 of 2048" in r["reason"]
    assert r["check"]["wrong_elements"] == 3 and not r["check"]["passed"]


def test_a_timed_row_carries_busbw_link_and_prediction():
    size, n = 2**28, 4
    meas = {"size_bytes": size, "wrong": 0, "elements": n * size // 4, "warmup": 5,
            "per_rank_samples_ms": [[1.0, 1.1, 1.2], [1.4, 1.5, 1.6], [1.0, 1.0, 1.0], [1.2, 1.2, 1.2]]}
    r = col.collective_row("all_reduce", "all_reduce", {"world_size": n}, n, meas, LINK, "m")
    m, p = r["metrics"], r["prediction"]
    assert r["status"] == "ok" and m["slowest_rank"] == 1 and m["ms"] == pytest.approx(1.5)
    assert m["busbw_gbps"] == pytest.approx(1.5 * size / 1.5e6)
    assert m["pct_of_link"] == pytest.approx(100 * m["busbw_gbps"] / 450)
    assert p["bytes"] == col.wire_bytes("all_reduce", size, n) and p["flops"] == 0
    assert p["predicted_ms"] == pytest.approx(p["bytes"] / 450e6)
    assert p["measured_over_predicted"] == pytest.approx(1.5 / p["predicted_ms"])
    assert m["per_rank_median_ms"] == [1.1, 1.5, 1.0, 1.2]


# ------------------------------------------------------------------------------ the ring's plan
def test_bounds_and_depth():
    assert ring.bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert ring.bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]                    # empty chunks are fine
    assert ring.pipeline_depth(2**24, 4, 8, 0) == 8
    assert ring.pipeline_depth(2**24, 4, 8, 32 * 2**20) == 2                         # 64 MiB chunk, 32 MiB pieces
    assert ring.pipeline_depth(100, 4, 8, 2**20) == 1


# ------------------------------------------------------------------------------ NCCL's log
def test_parse_nccl_tuning_lines():
    log = ["host:1:2 [0] NCCL INFO AllReduce: 1048576 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..31}",
           "host:1:2 [0] NCCL INFO AllGather: 262144 Bytes -> Algo RING proto LL128 channel{Lo..Hi}={0..15}",
           "host:1:2 [0] NCCL INFO ReduceScatter: 64 Bytes -> Algo Tree proto LL channel{Lo..Hi}={0..0} comm 0x1",
           "something else"]
    got = col.parse_nccl_tuning(log)
    assert got[("AllReduce", 1048576)] == {"algo": "RING", "proto": "SIMPLE", "channels": 32}
    assert got[("ReduceScatter", 64)]["algo"] == "TREE"
    assert col.nccl_log_key("all_gather", 2**20, 4) == ("AllGather", 2**18)           # NCCL logs the per-rank count
    assert col.nccl_log_key("all_reduce", 2**20, 4) == ("AllReduce", 2**20)
    assert col.nccl_log_key("sendrecv", 2**20, 4) is None


def test_sweep_rows_use_the_probe_and_compare_ours_with_nccl():
    mk = lambda op, ms: {"op": op, "size_bytes": 2**20, "wrong": 0, "elements": 2**18 * 2, "warmup": 1,  # noqa: E731
                         "per_rank_samples_ms": [[ms], [ms]]}
    res = {"rows": [mk("all_reduce", 1.0), mk("ring_allreduce", 2.0), mk("sendrecv", 0.5)]}
    algos = col.parse_nccl_tuning(["NCCL INFO AllReduce: 1048576 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..3}"])
    rows = sweep.rows_from(res, 2, "nccl", LINK, algos)
    by = {r["variant"]: r["metrics"] for r in rows}
    assert by["all_reduce"]["algo"] == "RING" and by["all_reduce"]["proto"] == "SIMPLE"
    assert by["ring_allreduce"]["ours_over_nccl_busbw"] == pytest.approx(0.5)
    assert by["sendrecv"]["algo"] == "P2P"
    v = sweep.verdict(rows, 2)                                                        # nothing >= 1 GiB or 256 MiB
    assert v["best_busbw_gbps_from_1gib"] is None and v["met"] is None and v["ring_worst_ours_over_nccl"] is None
    facts = analysis.sweep_facts(rows)
    assert facts["ours"]["over_nccl"] == pytest.approx(0.5) and facts["sendrecv"]["allreduce_over_sendrecv"] < 1
    assert facts["half_best_size"] == 2**20 and "sendrecv_jump" not in facts


# ------------------------------------------------------------------------------ DDP arithmetic
def test_ddp_flops_and_hidden_fraction():
    assert ddp.matmul_params(2048, 6) == 6 * 8 * 2048**2
    assert sum(p.numel() for n_, p in ddp.make_model(32, 2).named_parameters() if n_.endswith("weight")
               and p.dim() == 2) == ddp.matmul_params(32, 2)
    assert ddp.step_flops(64, 2, 10) == 6 * 10 * 2 * 8 * 64**2
    assert ddp.hidden_fraction(10.0, 4.0, 11.0) == (pytest.approx(0.75), pytest.approx(0.75))
    assert ddp.hidden_fraction(10.0, 4.0, 15.0)[0] == 0.0                             # clipped, raw kept
    assert ddp.hidden_fraction(10.0, 4.0, 15.0)[1] == pytest.approx(-0.25)
    assert ddp.hidden_fraction(10.0, 4.0, 9.0)[0] == 1.0
    # against the DDP step with no communication (10.5: DDP's bucket copies cost 0.5 ms), the same
    # 11 ms step hides 3.5 of 4 ms: the copies are not communication
    assert ddp.hidden_fraction(10.5, 4.0, 11.0)[0] == pytest.approx(0.875)


def _probed_rank(alone_ms: float, under_ms: float, matches: bool = True) -> dict:
    """One rank's contention probe as the worker returns it, for one kernel (a 1 GFLOP matmul)."""
    return {"background_ms": {"nccl_all_reduce": 3.0, "copy_engine": 2.5},
            "kernels": {"matmul": {"flops": 10**9, "bytes": 10**6, "dtype": "bf16", "alone_ms": alone_ms,
                                   "under_ms": {"nccl_all_reduce": under_ms, "copy_engine": alone_ms},
                                   "matches": {"nccl_all_reduce": matches, "copy_engine": True},
                                   "reps": {"nccl_all_reduce": 24, "copy_engine": 20}}}}


def test_contention_slowdown_is_the_slowest_ranks_and_rows_carry_a_prediction():
    contention = importlib.import_module("phases.phase4_distributed.contention")
    out = contention.slowdowns([_probed_rank(0.10, 0.12), _probed_rank(0.10, 0.13)])
    nccl, ce = (next(c for c in out if c["background"] == bg) for bg in ("nccl_all_reduce", "copy_engine"))
    assert nccl["slowdown"] == [pytest.approx(0.2), pytest.approx(0.3)]
    assert nccl["max_slowdown"] == pytest.approx(0.3) and nccl["slowest_rank"] == 1 and nccl["matches"]
    assert ce["max_slowdown"] == pytest.approx(0.0)
    r = ddp._contention_row(nccl, {"world_size": 2}, LINK)
    assert r["status"] == "ok" and r["variant"] == "contention_nccl_all_reduce_matmul"
    assert r["metrics"]["alone_ms"] == pytest.approx(0.10) and r["metrics"]["under_ms"] == pytest.approx(0.13)
    assert r["prediction"]["measured_ms"] == pytest.approx(0.10)                      # the roofline predicts it alone
    assert r["prediction"]["predicted_ms"] == pytest.approx(max(1e9 / 989.5e12, 1e6 / 450e9) * 1e3)   # s -> ms


def test_contention_row_is_not_timed_when_an_output_changed_under_the_transfer():
    contention = importlib.import_module("phases.phase4_distributed.contention")
    out = contention.slowdowns([_probed_rank(0.10, 0.12), _probed_rank(0.10, 0.13, matches=False)])
    nccl = next(c for c in out if c["background"] == "nccl_all_reduce")
    r = ddp._contention_row(nccl, {"world_size": 2}, LINK)
    assert not nccl["matches"] and r["status"] == "failed" and not r["metrics"] and r["check"]["passed"] is False


# ------------------------------------------------------------------------------ which backend, which sizes
class FakeCtx:
    def __init__(self, gpus):
        self.is_cuda, self.gpu_count = gpus > 0, gpus


@pytest.mark.parametrize("gpus, params, backend, sizes, why", [
    (0, {}, None, [], "no GPU in this run"),
    (0, {"backend": "nccl"}, "nccl", [], "needs CUDA GPUs"),
    (0, {"backend": "gloo"}, "gloo", [2, 4], None),
    (1, {}, "nccl", [], "needs 2 GPUs for NCCL; this machine has 1"),
    (2, {}, "nccl", [2], None),
    (4, {}, "nccl", [2, 4], None),
    (8, {"world_sizes": [2, 4]}, "nccl", [2, 4], None),
    (4, {"world_sizes": [2, 8]}, "nccl", [2], "8 ranks need 8 GPUs; this machine has 4"),
    (4, {"backend": "gloo"}, "gloo", [], "add --device cpu"),
])
def test_plan(gpus, params, backend, sizes, why):
    p = launch.plan(FakeCtx(gpus), {"backend": "auto", "world_sizes": "auto", **params})
    assert p.backend == backend and p.world_sizes == sizes
    if why:
        assert any(why in w for _, w in p.skipped)
        assert all(r["status"] == "skipped" and r["reason"] for r in p.skip_rows())
    else:
        assert not p.skipped


@pytest.mark.parametrize("params, msg", [({"backend": "mpi"}, "backend must be one of"),
                                         ({"world_sizes": [1]}, "world_sizes must be")])
def test_plan_rejects_bad_params(params, msg):
    with pytest.raises(LabError, match=msg):
        launch.plan(FakeCtx(4), {"backend": "auto", "world_sizes": "auto", **params})


def test_run_on_a_cpu_without_gloo_is_a_one_line_skip(spec_ctx):
    for mod in (ddp, ring, sweep):
        [r] = mod.run(spec_ctx(), mod.EXERCISE.resolve_params(True, True, {})).rows
        assert r["status"] == "skipped" and "--param backend=gloo" in r["reason"] and "\n" not in r["reason"]


def test_link_roof_comes_from_hardware_yaml(spec_ctx):
    roofs = launch.link_roofs(spec_ctx(), "nccl", "bf16")
    assert roofs.bandwidth_gbps == 450 and "interconnect_one_way_gbps" in roofs.source
    assert roofs.peak("bf16") == pytest.approx(989.5)


# ------------------------------------------------------------------------------ failures, diagnosed
TORCHRUN_ERR = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
phases.phase4_distributed.worker FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-21_12:51:16
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 19361)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 19361
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-21_12:51:16
  host      : localhost
  rank      : 2 (local_rank: 2)
  exitcode  : -9 (pid: 19362)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 19362
======================================================="""


def test_diagnose_names_the_rank_that_died():
    msg = launch.diagnose(TORCHRUN_ERR, {}, 4, "phase4.x on 4 ranks", 1)
    assert msg.startswith("phase4.x on 4 ranks: rank 2 of 4 died with exit code -9, SIGKILL")
    msg = launch.diagnose(TORCHRUN_ERR.replace("-9 (pid: 19362)  (SIGKILL)", "1 (pid: 19362)"),
                          {2: "ValueError: bad"}, 4, "x", 1)
    assert msg == "x: rank 2 of 4 raised ValueError: bad; torchrun stopped the other ranks"
    assert "torchrun exited with code 2: boom" in launch.diagnose("boom\n", {}, 2, "x", 2)


def test_records_from_rows_are_valid(spec_ctx, static_for):
    """A phase-4 record built by the runner from skip rows passes the schema (no launch needed)."""
    from common.runner import checked_params, run_one
    ctx = spec_ctx()
    rec = run_one(ring.EXERCISE, ctx, checked_params([ring.EXERCISE], ctx, {})[ring.EXERCISE.id],
                  static_for(ctx), None, None)
    assert rec["status"] == "skipped" and problems(rec) == []
    assert not math.isnan(rec["provenance"]["duration_s"])


def test_ring_goal_takes_one_configuration_at_every_size():
    """The goal's ratio is the best single configuration's worst size, not the best per size."""
    mk = lambda v, size, x: {"variant": v, "status": "ok", "params": {"world_size": 4, "size_bytes": size},  # noqa: E731
                             "metrics": {"ours_over_nccl_busbw": x}}
    rows = [mk("ring_l1_dir1_d1", 2**28, 0.95), mk("ring_l1_dir1_d1", 2**30, 0.60),      # great at 256 MiB only
            mk("ring_l4_dir1_d1", 2**28, 0.80), mk("ring_l4_dir1_d1", 2**30, 0.90),      # decent everywhere
            mk("ring_l4_dir1_d1", 2**26, 0.10)]                                      # below the goal's sizes
    assert analysis.worst_over_nccl(rows) == {"ring_l1_dir1_d1": 0.60, "ring_l4_dir1_d1": 0.80}
    assert analysis.worst_over_nccl(rows, 2**31) == {}
    v = ring.verdict(rows, 4)
    assert v["configuration"] == "ring_l4_dir1_d1" and v["worst_ours_over_nccl"] == 0.80 and v["met"] is False


def test_ring_configurations_and_their_names():
    p = {"lanes": [1, 2], "directions": [1], "depths": [1, 2], "graphs": [False, True]}
    on_gpu = ring.configs(p, "cuda")
    assert len(on_gpu) == 8 and sum(c.graph for c in on_gpu) == 4
    assert [c.name for c in ring.configs(p, "cpu")] == ["ring_l1_dir1_d1", "ring_l1_dir1_d2", "ring_l2_dir1_d1",
                                                        "ring_l2_dir1_d2"]       # no CUDA graphs without a GPU
    assert ring.Config(1, 2, 1, True).name == "ring_l1_dir2_d1_graph"
    sweep_cfg = importlib.import_module("phases.phase4_distributed.interconnect").ring_config
    params = {"ring_lanes": 1, "ring_directions": 1, "ring_depth": 1, "ring_graph": True}
    assert sweep_cfg(params, "cuda").graph and not sweep_cfg(params, "cpu").graph


def test_probe_finding_draws_its_conclusion_from_the_copy_engine_rows():
    """The contention facts say a cost comes with the bytes only when a transfer that uses no SM slows
    a kernel class nearly as much as NCCL's all-reduce does, and say it is the SMs when not."""
    def rows(ce_slowdown):
        mk = lambda bg, k, slow: {"variant": f"contention_{bg}_{k}", "status": "ok",  # noqa: E731
                                  "params": {"world_size": 2, "kernel": k, "background": bg},
                                  "metrics": {"slowdown": slow, "alone_ms": 0.1, "background_ms": [3.0, 3.1]},
                                  "prediction": {"bound": "compute" if k == "matmul" else "memory",
                                                 "predicted_ms": 0.09, "measured_over_predicted": 1.1}}
        return [mk("nccl_all_reduce", "matmul", 0.20), mk("nccl_all_reduce", "gelu_backward", 0.15),
                mk("copy_engine", "matmul", ce_slowdown), mk("copy_engine", "gelu_backward", 0.14)]
    best = {"params": {"bucket_cap_mb": 25}}
    p = analysis.probe(rows(0.18), best)
    assert p["slowdown"]["nccl_all_reduce"]["matmul"] == 0.20 and p["slowdown"]["copy_engine"]["matmul"] == 0.18
    assert p["by_bound"]["compute"]["verdict"] == "bytes" and p["by_bound"]["memory"]["verdict"] == "bytes"
    assert analysis.probe(rows(-0.03), best)["by_bound"]["compute"]["verdict"] == "sms"
    assert analysis.probe(rows(0.12), best)["by_bound"]["compute"]["verdict"] == "partly_sms"
    assert analysis.probe([], best) is None
    facts = {**_facts([_timed_row(25, "builtin", 4.0, 1.0, 27.0)]), "probe": analysis.probe(rows(-0.03), best)}
    text = findings._ddp_finding("2 x H200", facts)
    assert "matmul +20%" in text and "matmul -3%" in text
    assert "The compute-bound matmul lost +20% under NCCL and -3% under the copy engines, much less" in text


def test_time_interleaved_takes_the_functions_in_turn():
    order = []
    samples = col.time_interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                                   warmup=1, iters=3, device=torch.device("cpu"))
    assert order == ["a", "b"] * 4                                                    # 1 warm-up round + 3 timed
    assert set(samples) == {"a", "b"} and all(len(v) == 3 and min(v) >= 0 for v in samples.values())


def test_time_interleaved_lines_the_ranks_up_before_every_timed_call_only():
    order, host = [], {}
    col.time_interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                         warmup=1, iters=2, device=torch.device("cpu"), host=host, line_up=lambda: order.append("|"))
    assert order == ["a", "b"] + ["|", "a", "|", "b"] * 2      # warm-up unaligned, every timed call after a line-up
    assert host == {}                                          # enqueue time means something on GPUs only


# ------------------------------------------------------------------------------ the copy-engine all-reduce
copy_engine = importlib.import_module("phases.phase4_distributed.copy_engine")


@pytest.mark.parametrize("numel, world", [(1, 2), (3, 4), (4097, 2), (1_000_003, 4), (64 * 4, 4)])
def test_chunk_bounds_cover_the_bucket_once_on_aligned_starts(numel, world):
    bounds = copy_engine.chunk_bounds(numel, world)
    assert len(bounds) == world and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))             # contiguous, no overlap
    assert all(lo % copy_engine.ALIGN == 0 or lo == numel for lo, _ in bounds)
    assert sum(hi - lo for lo, hi in bounds) == numel


def test_copy_engine_refuses_clearly_where_it_cannot_run():
    assert "needs CUDA GPUs" in copy_engine.unavailable("gloo", 2, 0)
    assert "every rank on one host" in copy_engine.unavailable("nccl", 4, 2)
    assert copy_engine.unavailable("nccl", 2, 2) is None
    hooks, why = ddp._hooks_for(["builtin", "copy_engine"], "gloo", 2)
    assert hooks == ["builtin"] and "gloo" in why
    assert ddp._hooks_for(["builtin", "avg"], "gloo", 2) == (["builtin", "avg"], None)


def test_an_unknown_comm_hook_is_a_one_line_error():
    with pytest.raises(LabError, match="unknown comm hook bogus: choose from builtin, avg, copy_engine"):
        ddp.run(None, {**ddp.EXERCISE.params, "comm_hooks": ["builtin", "bogus"]})


def _ddp_res(check=None, grads_identical=True) -> dict:
    """What the workers of a 2-rank DDP run with the copy-engine hook return, made up."""
    bucket = {"bucket_cap_mb": 25, "comm_hook": "copy_engine", "bucket_bytes": [4000, 4000], "warmup": 1,
              "grads_identical": grads_identical,
              **{k: [[v] * 5, [v] * 5] for k, v in (("compute", 10.0), ("comm", 4.0), ("nocomm", 10.5), ("ddp", 11.5))}}
    return {"checksum_before_ddp": [1.0, 2.0], "checksum_after_broadcast": [1.0, 1.0], "checksum_after_steps": [3.0, 3.0],
            "first_loss": [0.5, 0.6], "steps": 20, "grad_bytes": 8000, "buckets": [bucket], "wall": None,
            "copy_engine_check": check if check is not None else
            [{"max_abs_error": 2e-7, "checksums": [1.0, 2.0]}, {"max_abs_error": 1e-7, "checksums": [1.0, 2.0]}]}


def _ddp_bucket_rows(res: dict) -> list[dict]:
    res = {**res, "wall": {k: [1.0, 1.0] for k in ("local", "ddp", "local_straggler", "ddp_straggler")}}
    p = {**ddp.EXERCISE.params, "d_model": 8, "n_layers": 1, "tokens_per_rank": 4}
    return [r for r in ddp.rows_from(res, 2, "nccl", p, LINK, None) if r["variant"].startswith("bucket_")]


@pytest.mark.parametrize("check, reason", [
    ([{"max_abs_error": 2e-7, "checksums": [1.0]}, {"max_abs_error": 3e-2, "checksums": [1.0]}], "0.03 from NCCL's"),
    ([{"max_abs_error": 0.0, "checksums": [1.0]}, {"max_abs_error": 0.0, "checksums": [1.5]}], "different results"),
    ([], "no copy-engine check ran"),
])
def test_a_wrong_copy_engine_all_reduce_fails_its_rows_untimed(check, reason):
    (good,) = _ddp_bucket_rows(_ddp_res())
    assert good["status"] == "ok" and good["check"]["passed"] and good["check"]["max_abs_error"] == 2e-7
    assert good["metrics"]["hidden_fraction_vs_nocomm"] == pytest.approx(0.75)     # (10.5 + 4 - 11.5) / 4
    (bad,) = _ddp_bucket_rows(_ddp_res(check))
    assert bad["status"] == "failed" and reason in bad["reason"] and bad["timing"] is None and not bad["metrics"]


def test_a_bucket_row_carries_the_slowest_ranks_host_time_per_call():
    res = _ddp_res()
    res["buckets"][0]["host_ms"] = {"ddp": [9.0, 11.0], "nocomm": [8.0, 7.5]}
    (r,) = _ddp_bucket_rows(res)
    assert r["metrics"]["ddp_host_ms"] == 11.0 and r["metrics"]["nocomm_host_ms"] == 8.0
    (r,) = _ddp_bucket_rows(_ddp_res())                        # gloo records have none, and say nothing
    assert "ddp_host_ms" not in r["metrics"]


def test_a_hook_that_leaves_the_ranks_different_gradients_fails_its_row():
    (bad,) = _ddp_bucket_rows(_ddp_res(grads_identical=False))
    assert bad["status"] == "failed" and "averaged gradients differ" in bad["reason"]


def test_the_goal_is_judged_at_the_fastest_step_and_the_largest_share_is_reported():
    def timed(cap, hook, ddp_ms, share):
        return {"variant": f"bucket_{cap}mb_{hook}", "status": "ok",
                "params": {"bucket_cap_mb": cap, "nccl_max_channels": None, "nccl_high_priority": False,
                           "sm_carveout": None, "comm_hook": hook},
                "metrics": {"ddp_ms": ddp_ms, "hidden_fraction_vs_nocomm": share, "hidden_fraction": share - 0.1,
                            "bookkeeping_ms": 0.5, "comm_ms": 4.0, "exposed_vs_nocomm_ms": 4.0 * (1 - share)}}
    rows = [timed(25, "builtin", 27.5, 0.68), timed(5, "copy_engine", 28.1, 0.80)]
    verdict = analysis.judge(2, rows)
    assert verdict["bucket_cap_mb"] == 25 and verdict["judged_on"] == "fastest_step" and verdict["met"] is False
    assert verdict["most_hidden"]["comm_hook"] == "copy_engine"
    assert analysis.judge(2, [timed(25, "builtin", 27.5, 0.71)])["met"] is True
    assert analysis.fastest_flags(rows) == {"bucket_25mb_builtin": True, "bucket_5mb_copy_engine": False}


def _timed_row(cap, hook, comm, exposed, ddp_ms, host_ms=None, **p):
    return {"variant": "b", "status": "ok", "params": {"bucket_cap_mb": cap, "comm_hook": hook, **p},
            "metrics": {"comm_ms": comm, "exposed_vs_nocomm_ms": exposed, "ddp_ms": ddp_ms,
                        **({"ddp_host_ms": host_ms} if host_ms is not None else {})}}


def _facts(timed: list[dict]) -> dict:
    return analysis.ddp_facts([{**r, "variant": f"bucket_{k}"} for k, r in enumerate(timed)])


@pytest.mark.parametrize("ce_exposed, verdict", [(0.8, "less"), (1.0, "same"), (1.5, "more")])
def test_copy_engine_facts_compare_with_nccl_at_the_same_buckets_and_priority(ce_exposed, verdict):
    timed = [_timed_row(25, "copy_engine", 3.6, ce_exposed, 27.2), _timed_row(25, "builtin", 3.7, 1.05, 27.5),
             _timed_row(25, "builtin", 4.5, 0.2, 27.9, nccl_max_channels=16),      # not its twin: another channel cap
             _timed_row(25, "builtin", 3.8, 0.3, 27.9, nccl_high_priority=True)]   # nor another priority
    ce = analysis.copy_engine_vs_nccl(timed)
    assert ce["verdict"] == verdict and ce["nccl"]["exposed_ms"] == 1.05 and ce["copy_engine"]["comm_ms"] == 3.6
    assert analysis.copy_engine_vs_nccl(timed[1:]) is None
    text = findings._ddp_finding("2 x H200", _facts(timed))
    assert findings.CE[verdict] in text and "against NCCL's 1.05 ms" in text and "3.6 ms against NCCL's 3.7 ms" in text


def test_overrun_facts_name_python_hooks_only_when_they_are_all_there_is():
    fine = _timed_row(25, "builtin", 3.7, 1.0, 27.5)
    assert _facts([fine])["overrun"] is None
    ov = _facts([fine, _timed_row(5, "avg", 4.0, 6.0, 33.0), _timed_row(5, "copy_engine", 5.0, 9.0, 35.0)])["overrun"]
    assert ov["settings"] == 2 and ov["worst"]["exposed_ms"] == 9.0 and ov["python_hooks_only"] and ov["host_share"] is None
    ov = _facts([_timed_row(5, "builtin", 4.0, 6.0, 33.0), _timed_row(5, "avg", 4.0, 6.0, 33.0)])["overrun"]
    assert not ov["python_hooks_only"]
    # with the host's enqueue time recorded, the sentence says what it measured
    f = _facts([_timed_row(5, "avg", 4.0, 6.0, 33.0, host_ms=31.0), _timed_row(5, "copy_engine", 5.0, 9.0, 35.0, host_ms=35.0)])
    assert f["overrun"]["host_share"] == [pytest.approx(31 / 33), 1.0]
    assert "In those settings the CPU took 93.9% to 100.0% of the GPU step time" in findings._ddp_finding("2 x H200", f)


def test_host_facts_name_the_settings_the_cpu_bound():
    best = _timed_row(25, "builtin", 4.0, 1.0, 27.0, host_ms=20.0)
    assert _facts([_timed_row(25, "builtin", 4.0, 1.0, 27.0)])["fastest"]["host_share"] is None   # no host times
    f = _facts([best])
    assert f["host_bound"] is None and "The CPU took 20 ms to enqueue the fastest step (74.1% of its GPU time)." \
        in findings._ddp_finding("2 x H200", f)
    bound = _timed_row(5, "avg", 4.0, 6.0, 33.0, host_ms=32.5)
    f = _facts([best, bound, _timed_row(5, "builtin", 4.0, 2.0, 29.0, host_ms=25.0)])
    assert f["host_bound"]["settings"] == 1 and f["host_bound"]["most"]["host_ms"] == 32.5
    assert "1 of the 3 settings kept the CPU busy for at least 90.0%" in findings._ddp_finding("2 x H200", f)


def test_settings_name_the_copy_engine_hook_and_its_stream():
    assert groups.setting_words({"comm_hook": "copy_engine", "nccl_high_priority": True}) == \
        ["high-priority copy stream", "copy-engine all-reduce hook"]
    assert groups.setting_words({"comm_hook": "avg", "nccl_high_priority": True, "nccl_max_channels": 16}) == \
        ["NCCL_MAX_NCHANNELS=16", "high-priority NCCL stream", "AVG comm hook"]
