"""Phase 2's FLOP, byte and launch counts, on a CPU machine: each formula (vector_add.copy_work and
add_work, matmul.matmul_work, softmax.softmax_work) against a hand count at an irregular size; each
exercise's work(params) against the rows its newest committed record holds; the rows one_shape
records (the kernels replaced by torch, so no GPU is needed) carrying those very counts;
and `lab predict` listing every phase-2 exercise that times rows. phase2.traffic times nothing (its
rows are Nsight counters), so it declares no work()."""
import json
from pathlib import Path

import pytest
import torch

from phases.phase2_cuda import matmul as mm
from phases.phase2_cuda import softmax as sm
from phases.phase2_cuda import traffic
from phases.phase2_cuda import vector_add as va
from phases.phase2_cuda.rungs import BASELINES, VARIANTS

RESULTS = Path(__file__).resolve().parent.parent / "results" / "phase2"


# ------------------------------------------------------------------------------ the formulas by hand
def test_vector_add_counts():
    n = 1_000_003                                      # not a multiple of 4, 32 or 256
    copy = va.copy_work(n)
    assert (copy.flops, copy.bytes, copy.dtype, copy.launches) == (0, 8_000_024, None, 1)   # read a, write out
    assert copy.working_set_bytes == 8_000_024
    for v in va.LAUNCHERS:                             # both kernels: one add per element, read a and b, write c
        w = va.add_work(v, n)
        assert (w.flops, w.bytes, w.dtype, w.launches) == (1_000_003, 12_000_036, "fp32", 1)
        assert w.working_set_bytes == 12_000_036
    params = {"sizes": [4096, n], "graph_below_n": 4096}
    assert [(w.label, w.graph_reps) for w in va.work(params)] == [
        ("copy n=4096", 20), ("cuda n=4096", 20), ("cuda_vec4 n=4096", 20),
        (f"copy n={n}", None), (f"cuda n={n}", None), (f"cuda_vec4 n={n}", None)]


@pytest.mark.parametrize("variant", [*BASELINES, *VARIANTS])
def test_matmul_counts(variant):
    m, n, k = 1000, 777, 555
    ins = {"fp32": 4, "bf16": 2}
    # By hand: which dtype each one reads and writes (mma_bf16 alone reads bf16 and writes fp32).
    fp32 = {"cublas_fp32", "naive", "tiled", "regblock_1d", "coalesced_regblock", "warptiled_1stage", "warptiled"}
    in_dtype = "fp32" if variant in fp32 else "bf16"
    out_dtype = "fp32" if in_dtype == "fp32" or variant == "mma_bf16" else "bf16"
    w = mm.matmul_work(variant, m, n, k)
    assert w.flops == 2 * 1000 * 777 * 555 == 862_470_000
    assert w.bytes == (1000 * 555 + 555 * 777) * ins[in_dtype] + 1000 * 777 * ins[out_dtype]
    assert (w.dtype, w.launches) == (in_dtype, 1)


def test_matmul_counts_at_a_square_size():
    n = 520
    assert mm.matmul_work("tiled", n, n, n).bytes == 3 * n * n * 4
    assert mm.matmul_work("mma_bf16", n, n, n).bytes == n * n * (2 + 2 + 4)
    assert mm.matmul_work("wgmma_tma", n, n, n).bytes == mm.matmul_work("cublas_bf16_nt", n, n, n).bytes == 6 * n * n
    labels = [w.label.split()[0] for w in mm.work({"sizes": [256, 520], "naive_max_n": 256, "irregular_shape": [1, 1, 1]})]
    assert labels == [*BASELINES, *VARIANTS, *BASELINES, *(v for v in VARIANTS if v != "naive")]


@pytest.mark.parametrize("sms", [132, 114, 78])
def test_wgmma_ws_splits_k_where_the_tiles_leave_sms_idle(sms):
    """The split rule (rungs.ws_split_k, mirrored from matmul_wgmma.cu): tall-skinny products
    split until tiles x runs covers the SMs, each run >= 4 k-tiles, the partial sums' bytes within
    a quarter of A's and B's; large products never split; launches count the sum kernel."""
    from phases.phase2_cuda.rungs import rung_launches, tma_split_k, ws_split_k
    for m, n, k in [(8, 4097, 14336), (13, 14335, 4096), (32, 5003, 8192), (64, 8191, 4104), (1, 4096, 4096)]:
        for split, tiles, slots in ((ws_split_k(m, n, k, sms), -(-m // 128) * -(-n // 256), sms),
                                    (tma_split_k(m, n, k, sms), -(-m // 128) * -(-n // 128), 2 * sms)):
            if tiles >= slots:
                assert split == 1
                continue
            assert 1 < split <= 16 and -(-k // 64) >= 4 * split and 8 * split * m * n <= (m * k + k * n) * 2 / 4
            assert tiles * split >= min(slots, tiles * 16) * 0.9 or split == -(-k // 64) // 4
        assert rung_launches("wgmma_tma_ws", m, n, k, sms) == 2
        assert mm.matmul_work("wgmma_tma_ws", m, n, k, sms).launches == 2
        assert rung_launches("wgmma_tma", m, n, k, sms) == (2 if tma_split_k(m, n, k, sms) > 1 else 1)
        assert rung_launches("mma_bf16_pipelined", m, n, k, sms) == 2      # its tiles are wgmma_tma_ws's
        assert rung_launches("mma_bf16", m, n, k, sms) == 1
    assert tma_split_k(8, 4097, 14336, sms) > 1
    for shape in [(4001, 5003, 4104), (8192, 8192, 8192), (1024, 1024, 1024), (1000, 777, 555)]:
        assert ws_split_k(*shape, sms) == 1 and rung_launches("wgmma_tma_ws", *shape, sms) == 1
        assert tma_split_k(*shape, sms) == 1
    for variant in ("wgmma_tma_ws_tma_store", "wgmma_tma_ws_cluster"):         # hand split products to ws
        assert rung_launches(variant, 8, 4097, 14336, sms) == rung_launches(variant, 8, 4096, 14336, sms) == 2
        assert rung_launches(variant, 4001, 5003, 4104, sms) == 1
    assert rung_launches("wgmma_tma_ws_pitch128", 4001, 5003, 4104, sms) == 3          # two copies, then ws
    assert rung_launches("wgmma_tma_ws_pitch128", 4001, 5003, 4096, sms) == 1          # 128-byte rows already


@pytest.mark.parametrize("dtype,itemsize", [("fp32", 4), ("bf16", 2)])
def test_softmax_counts(dtype, itemsize):
    rows, cols = 77, 33                                # 2,541 elements
    for v in (*sm.BASELINES, *sm.VARIANTS):
        w = sm.softmax_work(v, rows, cols, dtype)
        assert w.bytes == w.working_set_bytes == 2 * 2541 * itemsize     # x in, y out, both in x's dtype
        assert w.launches == 1 and w.graph_reps is None
        if v == "copy":
            assert (w.flops, w.dtype) == (0, None)
        else:
            assert (w.flops, w.dtype) == (5 * 2541, dtype)
    assert sm.softmax_work("cuda", 4096, 32, dtype, "seed").graph_reps == sm.GRAPH_REPS


def test_softmax_work_lists_each_variant_where_it_is_timed():
    params = {"seed_shape": [4096, 32], "cols": [32, 4096, 65536], "total_elements": 2**20, "dtypes": ["fp32", "bf16"]}
    got = [(w.label.split()[0], w.label.split()[1]) for w in sm.work(params)]
    assert got[:6] == [("copy", "4096x32"), ("torch", "4096x32"), ("cuda", "4096x32"), ("warp_row", "4096x32"),
                       ("warp_packed", "4096x32"), ("online", "4096x32")]
    at = {(v, s) for v, s in got}
    assert ("block_row", "256x4096") in at and ("warp_row", "256x4096") not in at
    assert ("stream_row", "16x65536") in at and ("block_row", "16x65536") not in at
    assert sum(1 for v, _ in got if v == "copy") == 1 + 3 * 2


# ------------------------------------------------------------------------------ against the records
def _newest(exercise: str) -> dict | None:
    files = sorted(RESULTS.glob(f"{exercise}/*/*.json"), key=lambda p: p.name)
    return json.loads(files[-1].read_text()) if files else None


@pytest.mark.parametrize("module", [va, mm, sm], ids=["vector_add", "matmul", "softmax"])
def test_work_matches_the_newest_committed_record(module):
    rec = _newest(module.EXERCISE.name)
    if rec is None:
        pytest.skip(f"no committed {module.EXERCISE.id} record")
    params = {**module.EXERCISE.params, **rec["params"]}
    recorded = [(r["variant"], r["prediction"]["flops"], r["prediction"]["bytes"], r["prediction"]["dtype"],
                 (r["timing"] or {}).get("graph_reps")) for r in rec["rows"] if r["status"] == "ok"]
    # A variant added after the record was written (a new rung) has no rows in it yet: compare the rest.
    in_record = {r["variant"] for r in rec["rows"]}
    listed = [(w.label.split()[0], w.flops, w.bytes, w.dtype, w.graph_reps) for w in module.work(params)
              if w.label.split()[0] in in_record]
    assert recorded == listed


# ------------------------------------------------------------------------------ the rows run() records
def _timing_spy(ctx):
    """Record the timing kwargs each measure() asks for (graph replays happen only on a GPU)."""
    asked, real = [], ctx.time

    def time(fn, **kw):
        asked.append(kw.get("graph_reps"))
        return real(fn, target_ms=1.0, min_samples=2, warmup_ms=0.1)
    ctx.time = time
    return asked


def _assert_rows_carry(rows, works, asked):
    assert [r["variant"] for r in rows] == [w.label.split()[0] for w in works]
    for r, w, reps in zip(rows, works, asked):
        assert r["status"] == "ok", r["reason"]
        p = r["prediction"]
        assert (p["flops"], p["bytes"], p["dtype"], p["launches"]) == (w.flops, w.bytes, w.dtype, w.launches), w.label
        assert reps == w.graph_reps, w.label
        if "working_set_bytes" in r["params"]:
            assert r["params"]["working_set_bytes"] == w.working_set_bytes, w.label


def test_vector_add_rows_carry_the_counts(spec_ctx, monkeypatch):
    monkeypatch.setattr(va, "add", lambda a, b, out, variant="cuda": torch.add(a, b, out=out))
    ctx = spec_ctx()
    asked = _timing_spy(ctx)
    params = {"sizes": [1003], "graph_below_n": 2**22, "irregular_n": 7}
    rows = va.one_size(ctx, 1003, {v: {"passed": True} for v in va.LAUNCHERS}, params)
    _assert_rows_carry(rows, va.work(params), asked)


def test_matmul_rows_carry_the_counts(spec_ctx, monkeypatch):
    monkeypatch.setattr(mm, "matmul", lambda a, b, variant, out: out.copy_(a.float() @ b.float()))
    monkeypatch.setattr(mm, "runnable", lambda variant, device: None)
    ctx = spec_ctx()
    asked = _timing_spy(ctx)
    n = 24
    rows = mm.one_shape(ctx, (n, n, n), list(VARIANTS), {v: {"passed": True} for v in VARIANTS}, naive_max_n=n)
    _assert_rows_carry(rows, mm.work({"sizes": [n], "naive_max_n": n}), asked)


def test_matmul_rows_at_a_users_shape_carry_its_counts(spec_ctx, monkeypatch):
    """--param shapes=13x40x24: rows at M x N x K (not N^3), the counts work() lists for that shape."""
    monkeypatch.setattr(mm, "matmul", lambda a, b, variant, out: out.copy_(a.float() @ b.float()))
    monkeypatch.setattr(mm, "runnable", lambda variant, device: None)
    ctx = spec_ctx()
    asked = _timing_spy(ctx)
    params = {"sizes": [16], "naive_max_n": 40, "shapes": "13x40x24"}
    assert mm.timed_shapes(params) == [(16, 16, 16), (13, 40, 24)]
    rows = mm.one_shape(ctx, (13, 40, 24), list(VARIANTS), {v: {"passed": True} for v in VARIANTS}, naive_max_n=40)
    assert {(r["params"]["m"], r["params"]["n"], r["params"]["k"]) for r in rows} == {(13, 40, 24)}
    assert all(r["status"] == "ok" for r in rows), [(r["variant"], r.get("reason")) for r in rows]
    _assert_rows_carry(rows, [w for w in mm.work(params) if "13x40x24" in w.label], asked)


def test_matmul_a_users_k_the_tma_rungs_cannot_read_is_a_skipped_row_saying_why(spec_ctx, monkeypatch):
    monkeypatch.setattr(mm, "matmul", lambda a, b, variant, out: out.copy_(a.float() @ b.float()))
    monkeypatch.setattr(mm, "runnable", lambda variant, device: None)
    rows = mm.one_shape(spec_ctx(), (9, 10, 21), list(VARIANTS), {v: {"passed": True} for v in VARIANTS},
                        naive_max_n=40)
    by = {r["variant"]: r for r in rows}
    for v in VARIANTS:
        if mm.RUNGS[v].k_multiple > 1:
            assert by[v]["status"] == "skipped" and "multiple of 8" in by[v]["reason"] and "K = 21" in by[v]["reason"]
        else:
            assert by[v]["status"] == "ok", v


@pytest.mark.parametrize("shape", [(4096, 32, "fp32", "seed"), (40, 1000, "bf16", "sweep")])
def test_softmax_rows_carry_the_counts(spec_ctx, monkeypatch, shape):
    rows_, cols, dtype, group = shape
    monkeypatch.setattr(sm, "softmax", lambda x, variant="cuda", out=None: out.copy_(torch.softmax(x.float(), dim=1)))
    monkeypatch.setattr(sm, "has_clusters", lambda device: True)
    monkeypatch.setattr(sm, "chosen_kernel", lambda cols, dtype, device:
                        "warp_packed" if cols <= sm.PACKED_MAX_COLS[sm.DTYPES[dtype][1]] else "warp_row")
    ctx = spec_ctx()
    asked = _timing_spy(ctx)
    wanted = list(sm.VARIANTS)
    rows = sm.one_shape(ctx, rows_, cols, dtype, group, wanted, {v: {} for v in wanted})
    params = {"seed_shape": [4096, 32], "cols": [cols], "total_elements": rows_ * cols, "dtypes": [dtype]}
    works = [w for w in sm.work(params) if f"{rows_}x{cols} {dtype}" in w.label
             and (w.graph_reps is not None) == (group == "seed")]
    _assert_rows_carry(rows, works, asked)


# ------------------------------------------------------------------------------ lab predict
@pytest.mark.parametrize("exercise,param", [("phase2.vector_add", "sizes=[1000003]"),
                                            ("phase2.matmul", "sizes=[520]"),
                                            ("phase2.softmax", "cols=[1000,65536]")])
def test_lab_predict(lab, exercise, param):
    rc, out, err = lab("predict", exercise, "--hardware", "h200_sxm", "--param", param)
    assert rc == 0, err
    assert exercise in out and "predicted before running" in out


def test_lab_predict_through_cli_main(capsys):
    from common.cli import main
    assert main(["predict", "phase2.matmul", "--hardware", "h200_sxm"]) == 0
    assert "wgmma_tma" in capsys.readouterr().out


def test_traffic_times_nothing():
    assert traffic.EXERCISE.work is None               # its rows are Nsight counters, not timed calls
