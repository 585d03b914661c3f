"""Phase 3's FLOP, byte and launch counts (phases/phase3_triton/counts.py), one test per formula:
each against a hand computation at an irregular size, and where a CPU can run the variant cheaply,
against the row the exercise records. Then `lab predict` for every phase-3 exercise, and the
report's calibrator for records written before the counts were corrected (issue 19).

Conventions (counts.py): bytes are the PROBLEM's fewest (inputs read once, outputs written once),
the same for every variant of one problem; an algorithm's extra traffic is metrics.algorithm_bytes.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common.cli import main
from phases.phase3_triton import counts
from phases.phase3_triton import flash_attention as fa
from phases.phase3_triton import flash_attention_bwd as fab
from phases.phase3_triton import matmul as mm
from phases.phase3_triton import softmax as sm
from phases.phase3_triton import vector_add as va


class _Kernels(TorchDispatchMode):
    """The aten ops a call dispatches that compute (views and reshapes move no data): on a GPU in
    eager mode, one kernel each for the ops the naive and unfused chains use."""
    METADATA = {"aten._unsafe_view.default"}

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and str(func) not in self.METADATA:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _rows(ex, ctx, overrides):
    params = ex.resolve_params(on_cpu=True, quick=True, overrides=overrides)
    return {(r["variant"], *(r["params"].get(k) for k in ("n", "rows", "cols"))): r
            for r in ex.run(ctx, params).rows}


def _recorded(r, c: counts.Count):
    assert r["status"] == "ok", r["reason"]
    p = r["prediction"]
    assert (p["flops"], p["bytes"], p["dtype"], p["launches"]) == (c.flops, c.bytes, c.dtype, c.launches)


# ------------------------------------------------------------------------------ 3.1 vector add
def test_vector_add_counts_by_hand(spec_ctx):
    n = 100_003
    assert counts.copy_count(n) == counts.Count(0, 800_024, None, 1)            # 4 bytes read + 4 written
    assert counts.add_count(n) == counts.Count(100_003, 1_200_036, "fp32", 1)   # 2 x 4 read + 4 written
    assert va.bytes_moved(n) == 1_200_036
    rows = _rows(va.EXERCISE, spec_ctx(("copy", "torch")), {"sizes": [n]})
    _recorded(rows[("copy", n, None, None)], counts.copy_count(n))
    _recorded(rows[("torch", n, None, None)], counts.add_count(n))


# ------------------------------------------------------------------------------ 3.2 softmax
def test_softmax_counts_by_hand():
    m, n = 37, 1537
    problem = 2 * 37 * 1537 * 4                                  # read x, write y: 454,952
    assert counts.softmax_bytes(m, n) == problem == 454_952
    for variant in ("torch", "unfused", "triton"):               # one problem: the same counts
        c = counts.softmax_count(m, n, variant)
        assert (c.flops, c.bytes, c.dtype) == (5 * 37 * 1537, problem, "fp32")
    assert counts.softmax_count(m, n, "copy") == counts.Count(0, problem, None, 1)
    # the chain's own traffic: max reads x, writes 37 fp32 maxima + 37 int64 indices; subtract reads x
    # and the maxima, writes z; exp reads z, writes e; sum reads e, writes 37 sums; divide reads e and
    # the sums, writes y
    elems, rows = 37 * 1537, 37
    chain = ((elems + rows) * 4 + rows * 8) + ((2 * elems + rows) * 4) + (2 * elems * 4) + ((elems + rows) * 4) \
        + ((2 * elems + rows) * 4)
    assert counts.unfused_bytes(m, n) == chain == sm.bytes_unfused(m, n)
    assert counts.unfused_bytes(1024, 2048) / counts.softmax_bytes(1024, 2048) == pytest.approx(4, rel=1e-3)


def test_softmax_launches_count_every_kernel():
    x = torch.randn(37, 1537)
    with _Kernels() as k:
        sm.softmax_unfused(x)
    assert k.ops == ["aten.max.dim", "aten.sub.Tensor", "aten.exp.default", "aten.sum.dim_IntList", "aten.div.Tensor"]
    assert counts.softmax_launches("unfused") == len(k.ops) == 5
    assert counts.softmax_launches("torch") == counts.softmax_launches("triton", "rows") == 1
    assert counts.softmax_launches("triton", "split") == 2      # the slots' memset, then the kernel


def test_softmax_rows_record_the_problems_bytes_and_the_chains_own(spec_ctx):
    m, n = 37, 1537
    rows = _rows(sm.EXERCISE, spec_ctx(("copy", "torch", "unfused")),
                 {"seed_shape": [m, n], "cols": [300], "total_elements": 3000})
    for variant in ("copy", "torch", "unfused"):
        _recorded(rows[(variant, None, m, n)], counts.softmax_count(m, n, variant))
    un, th = rows[("unfused", None, m, n)], rows[("torch", None, m, n)]
    assert un["prediction"]["launches"] == 5 and un["prediction"]["bytes"] == th["prediction"]["bytes"]
    assert un["metrics"]["algorithm_bytes"] == counts.unfused_bytes(m, n)
    assert un["metrics"]["algorithm_gbps"] == pytest.approx(counts.unfused_bytes(m, n) / (un["metrics"]["ms"] * 1e6))
    assert th["metrics"]["algorithm_bytes"] == counts.softmax_bytes(m, n)
    _recorded(rows[("torch", None, 10, 300)], counts.softmax_count(10, 300, "torch"))


# ------------------------------------------------------------------------------ 3.3 matmul
def test_matmul_counts_by_hand(spec_ctx):
    assert counts.matmul_count(97, 131, 53, "bf16") == counts.Count(2 * 97 * 131 * 53, (97 * 53 + 53 * 131 + 97 * 131) * 2,
                                                                    "bf16", 1)
    assert counts.matmul_count(8192, 8192, 8192, "fp16").bytes == 3 * 8192**2 * 2
    rows = _rows(mm.EXERCISE, spec_ctx(("cublas",)), {"sizes": [97], "dtypes": ["fp16"]})
    _recorded(rows[("cublas", 97, None, None)], counts.Count(2 * 97**3, 3 * 97 * 97 * 2, "fp16", 1))


# ------------------------------------------------------------------------------ 3.4 attention forward
B, H, N, D = 3, 5, 203, 48          # irregular: no power of two but the head dim's factor


def test_attention_forward_counts_by_hand():
    assert counts.attention_flops(B, H, N, D, False) == 4 * 3 * 5 * 203 * 203 * 48 == 118_681_920
    assert counts.attention_flops(B, H, N, D, True) == 59_340_960                     # half the scores
    assert counts.attention_bytes(B, H, N, D, 2) == (3 + 1) * 3 * 5 * 203 * 48 * 2    # Q, K, V read; O written
    assert counts.lse_bytes(B, H, N) == 3 * 5 * 203 * 4
    for variant in ("naive", *counts.LIBRARY, "triton"):                            # one problem: one count
        c = counts.forward_count(variant, B, H, N, D, "fp32", False)
        assert (c.flops, c.bytes, c.dtype) == (118_681_920, 4 * 3 * 5 * 203 * 48 * 4, "tf32")
        assert c.launches == (4 if variant == "naive" else 1)
    assert counts.forward_count("triton", B, H, N, D, "bf16", True).dtype == "bf16"
    with pytest.raises(ValueError):
        counts.forward_count("naive", B, H, N, D, "fp32", True)
    # naive's own traffic: Q, K, V, O once; S written, read and written by the scale, read by softmax;
    # P written, read by P V: six N x N passes per head
    assert counts.naive_bytes(B, H, N, D, 4) == 4 * (4 * 15 * 203 * 48 + 6 * 15 * 203 * 203)
    assert counts.forward_algorithm_bytes("triton", B, H, N, D, 2) == 4 * 15 * 203 * 48 * 2 + 15 * 203 * 4
    assert counts.forward_algorithm_bytes("sdpa_cudnn", B, H, N, D, 2) is None


def test_naive_attention_starts_four_kernels():
    q = torch.randn(1, 2, 9, 16)
    with _Kernels() as k:
        fa.naive_attention(q, q, q, False, 0.25)
    assert k.ops == ["aten.bmm.default", "aten.mul.Tensor", "aten._softmax.default", "aten.bmm.default"]
    assert counts.NAIVE_LAUNCHES == len(k.ops)


def test_naive_attention_row_records_the_problems_counts(spec_ctx):
    ctx = spec_ctx(("naive",))
    params = {"seed_sizes": [N], "seed_batch": B, "seed_heads": H, "seed_head_dim": 32, "sizes": [64],
              "dtypes": ["fp16"], "head_dims": [32], "causal": [False], "tokens": 64, "model_dim": 32}
    [r] = fa.EXERCISE.run(ctx, fa.EXERCISE.resolve_params(True, True, params)).rows
    _recorded(r, counts.forward_count("naive", B, H, N, 32, "fp32", False))
    assert r["prediction"]["bytes"] == 4 * B * H * N * 32 * 4 and r["prediction"]["dtype"] == "tf32"
    assert r["metrics"]["algorithm_bytes"] == (4 * B * H * N * 32 + 6 * B * H * N * N) * 4
    assert r["metrics"]["attn_matrix_bytes"] == B * H * N * N * 4


# ------------------------------------------------------------------------------ 3.5 attention backward
def test_attention_backward_counts_by_hand():
    assert counts.backward_flops(B, H, N, D, False) == 2.5 * 118_681_920
    assert counts.backward_flops(B, H, N, D, True) == 2.5 * 59_340_960
    # read Q, K, V, O, dO (bf16) and the fp32 LSE; write dQ, dK, dV
    assert counts.backward_bytes(B, H, N, D, 2) == (5 + 3) * 15 * 203 * 48 * 2 + 15 * 203 * 4 == fab.backward_bytes(B, H, N, D, 2)
    assert counts.backward_launches("triton") == 3        # delta, dK/dV, dQ: attention_backward's three launches
    for variant in (*counts.LIBRARY, "triton"):
        c = counts.backward_count(variant, B, H, N, D, "bf16", True)
        assert (c.flops, c.bytes, c.dtype) == (2.5 * 59_340_960, counts.backward_bytes(B, H, N, D, 2), "bf16")
        assert c.launches >= 1


# ------------------------------------------------------------------------------ work() and lab predict
def _work_matches(ex, overrides, expect):
    params = ex.resolve_params(on_cpu=False, quick=False, overrides=overrides)
    got = {w.label: (w.flops, w.bytes, w.dtype, w.launches) for w in ex.work(params)}
    for label, c in expect.items():
        assert got[label] == (c.flops, c.bytes, c.dtype, c.launches), label
    return got


def test_work_lists_every_row_with_the_same_counts():
    got = _work_matches(va.EXERCISE, {"sizes": [100003]}, {"copy n=100003": counts.copy_count(100003),
                                                           "triton n=100003": counts.add_count(100003)})
    assert len(got) == 3
    got = _work_matches(sm.EXERCISE, {"seed_shape": [37, 1537], "cols": [300], "total_elements": 3000},
                        {"unfused seed 37x1537": counts.softmax_count(37, 1537, "unfused"),
                         "triton sweep 10x300": counts.softmax_count(10, 300, "triton")})
    assert len(got) == 8
    got = _work_matches(mm.EXERCISE, {"sizes": [96], "dtypes": ["bf16"]},
                        {"triton_tma bf16 n=96": counts.matmul_count(96, 96, 96, "bf16")})
    assert len(got) == 3
    got = _work_matches(mm.EXERCISE, {"sizes": [97], "dtypes": ["bf16"]},
                        {"cublas bf16 n=97": counts.matmul_count(97, 97, 97, "bf16")})
    c = counts.matmul_count(97, 97, 97, "bf16")                 # 194-byte rows: A and B copied into 208-byte ones
    assert got["triton_tma bf16 n=97"] == got["triton bf16 n=97"] == (c.flops, c.bytes + 2 * 2 * 97 * 97 * 2, c.dtype, 3)
    got = _work_matches(fa.EXERCISE, {"seed_sizes": [N], "sizes": [256], "dtypes": ["bf16"], "head_dims": [64],
                                      "causal": [True], "tokens": 512, "model_dim": 128},
                        {f"naive fp32 d=64 causal=False n={N} 2x4": counts.forward_count("naive", 2, 4, N, 64, "fp32", False),
                         "sdpa_cudnn bf16 d=64 causal=True n=256 2x2": counts.forward_count("sdpa_cudnn", 2, 2, 256, 64,
                                                                                           "bf16", True)})
    assert len(got) == 5 + 4
    got = _work_matches(fab.EXERCISE, {"sizes": [N], "head_dims": [64], "causal": [True], "tokens": 406,
                                       "model_dim": 128},
                        {f"triton bf16 d=64 causal=True n={N} 2x2": counts.backward_count("triton", 2, 2, N, 64, "bf16", True)})
    assert len(got) == 4


@pytest.mark.parametrize("exercise, params", [
    ("phase3.vector_add", ["sizes=[98432,100003]"]),
    ("phase3.softmax", ["seed_shape=[37,1537]", "cols=[300,65536]", "total_elements=3000000"]),
    ("phase3.matmul", ["sizes=[4096]"]),
    ("phase3.flash_attention", ["sizes=[4096]", "seed_sizes=[1024]"]),
    ("phase3.flash_attention_bwd", ["sizes=[4096]"]),
])
def test_lab_predict_lists_each_exercises_rows(exercise, params, tmp_path, capsys):
    argv = ["predict", exercise, "--hardware", "h200_sxm", "--results", str(tmp_path)]
    for p in params:
        argv += ["--param", p]
    assert main(argv) == 0
    assert exercise in capsys.readouterr().out


# ------------------------------------------------------------------------------ older records
CEILINGS = {"hbm_gbps": 4000.0, "l2_gbps": 8000.0, "l2_fit_bytes": 30 * 2**20, "launch_us": 5.0, "graph_launch_us": 1.0,
            "matmul_tflops": {"bf16": 700.0, "fp16": 700.0, "tf32": 350.0, "fp32": 50.0}}


def test_older_rows_are_calibrated_from_the_corrected_counts():
    import pandas as pd

    from common import roofline
    from phases.phase3_triton.report import PHASE, recalibrated
    records = [{"exercise": {"id": "phase1.ceilings"}, "status": "ok", "summary": {"ceilings": CEILINGS},
                "source": {"kind": "measured"}, "hardware": {"key": "h200_sxm"}, "_path": "phase1/ceilings/x.json"}]

    def old(exercise, variant, stored_bytes, **params):
        c = counts.row_count(exercise, variant, {**params, "dtype": params.get("dtype", "fp32")})
        return pd.Series({"exercise": exercise, "variant": variant, "hardware": "h200_sxm", "source": "measured",
                          "metrics.ms": 2.0, "prediction.measured_ms": 2.0, "prediction.bytes": stored_bytes,
                          "prediction.flops": c.flops, "prediction.dtype": c.dtype,
                          "timing.flush_l2": True, "timing.graph_reps": float("nan"), "metrics.kernel": float("nan"),
                          **{f"params.{k}": v for k, v in params.items()}})

    shape = {"n": 1024.0, "batch": 16.0, "heads": 16.0, "head_dim": 128.0, "dtype": "bf16", "causal": False}
    bwd = recalibrated(old("phase3.flash_attention_bwd", "triton", 8 * 16 * 16 * 1024 * 128 * 2, **shape), records)
    c = counts.backward_count("triton", 16, 16, 1024, 128, "bf16", False)
    want = roofline.calibrated(c.flops, c.bytes, "bf16", CEILINGS, 2.0, launches=3)
    assert bwd["predicted_ms"] == pytest.approx(want["predicted_ms"]) and bwd["latency_ms"] == pytest.approx(0.015)
    assert bwd["computed"].startswith("at report time")
    # the old unfused row stored the chain's bytes: a problem of its own to the accuracy, so not calibrated
    soft = {"rows": 37.0, "cols": 1537.0, "group": "seed"}
    assert recalibrated(old("phase3.softmax", "unfused", counts.unfused_bytes(37, 1537), **soft), records) is None
    new = recalibrated(old("phase3.softmax", "unfused", counts.softmax_bytes(37, 1537), **soft), records)
    assert new["latency_ms"] == pytest.approx(0.025)                       # five launches
    naive = old("phase3.flash_attention", "naive", counts.attention_bytes(16, 16, 1024, 128, 4),
                **{**shape, "group": "seed", "dtype": "fp32"})
    assert recalibrated(naive, records)["latency_ms"] == pytest.approx(0.020)     # four launches
    naive["prediction.dtype"] = "fp32"            # as recorded before issue 19: not grouped with its problem
    assert recalibrated(naive, records) is None
    assert set(PHASE.calibrators) == {"phase3.vector_add", "phase3.softmax", "phase3.matmul", "phase3.flash_attention",
                                      "phase3.flash_attention_bwd"}
    assert recalibrated(old("phase3.matmul", "cublas", 1.0, n=512.0, dtype="fp16"), records[:0]) is None   # no ceilings
