"""common/workload.py: the summed roofline on small workloads computed by hand."""
import pytest

from common import workload as wl
from common.workload import ELEMENTWISE, GRAPH, MATMUL, TRITON, Kernel, Workload

# Round ceilings, so every expected time below is mental arithmetic.
CEILINGS = {"hbm_gbps": 1000.0, "l2_gbps": 2000.0, "gemv_gbps": 700.0, "gemv_slope_gbps": 800.0, "gemv_fixed_us": 0.0,
            "autograd_op_us": 20.0, "matmul_tflops": {"bf16": 100.0, "fp32": 10.0},
            "launch_us": 5.0, "graph_launch_us": 1.0, "triton_launch_us": 8.0, "sync_us": 10.0,
            "exp_per_s": 1e12, "l2_fit_bytes": 1e6, "record": "results/x.json"}


def test_a_matmul_is_compute_bound_at_its_dtype_rate():
    k = Kernel("mm", MATMUL, flops=2e9, bytes=1e6)              # 2e9 / 1e14 = 0.02 ms; 1e6 / 1e12 = 0.001 ms
    r, fallbacks = wl.rates(CEILINGS)
    assert wl.kernel_ms(k, r) == (pytest.approx(0.005 + 0.02), "compute")        # the 5 us floor, then the work
    assert wl.kernel_ms(k, r, launch_adds=False) == (pytest.approx(0.02), "compute")
    assert fallbacks == []


def test_elementwise_flops_run_at_the_fp32_rate_and_bytes_at_hbm_or_l2():
    r, _ = wl.rates(CEILINGS)
    assert wl.kernel_ms(Kernel("ew", ELEMENTWISE, flops=1e9, bytes=1e3), r) == (pytest.approx(0.105), "compute")
    assert wl.kernel_ms(Kernel("rd", ELEMENTWISE, flops=0, bytes=1e8), r) == (pytest.approx(0.105), "memory")
    assert wl.kernel_ms(Kernel("rd", ELEMENTWISE, flops=0, bytes=1e8, in_l2=True), r)[0] == pytest.approx(0.055)


def test_a_gemv_reads_its_weight_at_the_gemv_bandwidth():
    r, _ = wl.rates(CEILINGS)
    one_row = Kernel("gemv", wl.GEMV, flops=2e6, bytes=8e7, dtype=None)      # 8e7 B / 800 GB/s = 0.1 ms
    assert wl.kernel_ms(one_row, r, launch_adds=False) == (pytest.approx(0.1), "memory")
    batched = Kernel("skinny", wl.GEMV, flops=2e10, bytes=8e7, dtype="bf16")  # 2e10 / 100 TFLOP/s = 0.2 ms
    assert wl.kernel_ms(batched, r, launch_adds=False) == (pytest.approx(0.2), "compute")


def test_a_gemv_pays_its_measured_fixed_part_before_its_bytes_and_says_so_when_unmeasured():
    r, fallbacks = wl.rates({**CEILINGS, "gemv_fixed_us": 10.0})
    one_row = Kernel("gemv", wl.GEMV, flops=2e6, bytes=8e7, dtype=None)      # 10 us, then 8e7 B / 800 GB/s
    assert wl.kernel_ms(one_row, r) == (pytest.approx(0.005 + 0.01 + 0.1), "memory") and fallbacks == []
    copy = Kernel("copy", ELEMENTWISE, flops=0, bytes=8e7)                    # not a GEMV: no fixed part
    assert wl.kernel_ms(copy, r)[0] == pytest.approx(0.005 + 0.08)
    old = {k: v for k, v in CEILINGS.items() if k not in ("gemv_slope_gbps", "gemv_fixed_us")}
    r, fallbacks = wl.rates(old)                  # a record before the two-size GEMV: the one rate, no fixed part
    assert r["gemv_gbps"] == 700.0 and r["gemv_fixed_us"] == 0.0
    assert len(fallbacks) == 1 and "GEMV fixed time: unmeasured" in fallbacks[0]


def test_an_eager_autograd_op_waits_for_the_host_while_its_kernel_is_shorter():
    r, _ = wl.rates(CEILINGS)
    small = Kernel("add", ELEMENTWISE, 0, 1e6, launch=wl.AUTOGRAD, count=3)      # 5 us + 1 us of work < 20 us
    assert wl.kernel_ms(small, r) == (pytest.approx(3 * 0.02), "host")
    big = Kernel("mm", MATMUL, 1e10, 1e6, launch=wl.AUTOGRAD)                     # 5 us + 100 us > 20 us
    assert wl.kernel_ms(big, r) == (pytest.approx(0.105), "compute")


def test_exponentials_add_to_the_products_unless_the_kernel_overlaps_them():
    r, _ = wl.rates(CEILINGS)
    serial = Kernel("attn", MATMUL, flops=1e9, bytes=1e3, exps=1e7)     # 0.01 ms of products, 0.01 ms of exps
    assert wl.kernel_ms(serial, r, launch_adds=False)[0] == pytest.approx(0.02)
    overlapped = Kernel("attn", MATMUL, flops=1e9, bytes=1e3, exps=2e7, overlap=True)
    assert wl.kernel_ms(overlapped, r, launch_adds=False) == (pytest.approx(0.02), "exp")


def test_the_launch_floor_is_a_roof_per_launch_kind_and_count_multiplies():
    r, _ = wl.rates(CEILINGS)
    tiny = dict(kind=ELEMENTWISE, flops=1, bytes=8, count=10)
    assert wl.kernel_ms(Kernel("t", **tiny), r) == (pytest.approx(0.05, rel=1e-4), "launch")
    assert wl.kernel_ms(Kernel("t", **tiny, launch=TRITON), r)[0] == pytest.approx(0.08, rel=1e-4)
    assert wl.kernel_ms(Kernel("t", **tiny, launch=GRAPH), r)[0] == pytest.approx(0.01, rel=1e-4)


def test_a_workload_is_the_sum_plus_host_with_the_top_kernels_and_one_roof_beside():
    w = Workload("step", (Kernel("mm", MATMUL, 2e9, 1e6), Kernel("norm", ELEMENTWISE, 0, 1e7, count=2),
                          Kernel("tiny", ELEMENTWISE, 1, 8, count=4)),
                 host=(("synchronize", "sync_us", 1), ("bookkeeping", 0.001, 3)))
    p = wl.predict(w, CEILINGS, measured_ms=0.1)
    # mm 0.005 + 0.02; norm 2 x (0.005 + 0.01 memory); tiny 4 x 0.005; host 0.01 + 3 x 0.001
    assert p["predicted_ms"] == pytest.approx(0.025 + 0.03 + 0.02 + 0.013, rel=1e-6)
    assert p["host_ms"] == pytest.approx(0.013)
    assert [t["kernel"] for t in p["top"]] == ["norm", "mm", "tiny"]
    assert p["top"][0]["share"] == pytest.approx(0.03 / 0.088, rel=1e-6)
    # the floor as a third roof instead: mm 0.02, norm 2 x 0.01, tiny 4 x 0.005
    assert wl.predict(w, CEILINGS, launch_adds=False)["predicted_ms"] == pytest.approx(0.073, rel=1e-6)
    assert p["launches"] == 7 and p["flops"] == pytest.approx(2e9 + 4) and p["bytes"] == pytest.approx(1e6 + 2e7 + 32)
    # one roof: 7 launches x 5 us + max((1e6 + 2e7 + 32) B / 1 TB/s, (2e9 + 4) / 100 TFLOP/s)
    assert p["one_roof_ms"] == pytest.approx(0.035 + 0.021, rel=1e-6)
    assert p["measured_over_predicted"] == pytest.approx(0.1 / 0.088, rel=1e-6)


def test_unmeasured_ceilings_fall_back_to_stated_values():
    ceilings = {k: v for k, v in CEILINGS.items()
                if k not in ("exp_per_s", "triton_launch_us", "gemv_gbps", "gemv_slope_gbps", "autograd_op_us")}
    r, fallbacks = wl.rates(ceilings, spec_fp32_tflops=64.0)
    assert r["exp_per_s"] == pytest.approx(4e12)                 # 64 TFLOP/s / 16
    assert r["launch_us"][TRITON] == 5.0 and r["gemv_gbps"] == 1000.0
    assert len(fallbacks) == 5 and "spec sheet" in fallbacks[0] and "PyTorch op" in fallbacks[1]
    assert "HBM copy rate stands in" in fallbacks[2] and "unmeasured" in fallbacks[3] and "autograd" in fallbacks[4]
    assert r["autograd_op_us"] == 5.0
    with pytest.raises(ValueError, match="exp rate"):
        wl.rates(ceilings)


def test_scaled_repeats_every_kernel_and_host_item():
    w = Workload("step", (Kernel("mm", MATMUL, 2e9, 1e6),), host=(("sync", "sync_us", 1),)).scaled(3)
    assert w.kernels[0].count == 3 and w.host == (("sync", "sync_us", 3),)
    assert wl.predict(w, CEILINGS)["predicted_ms"] == pytest.approx(3 * 0.025 + 3 * 0.01)


@pytest.mark.parametrize("bad", [dict(kind="gemm"), dict(launch="cuda"), dict(flops=-1)])
def test_a_kernel_refuses_what_the_model_does_not_implement(bad):
    with pytest.raises(ValueError):
        Kernel("k", **{"kind": MATMUL, "flops": 1, "bytes": 1, **bad})


def test_a_dtype_without_a_measured_rate_is_refused_by_name():
    r, _ = wl.rates(CEILINGS)
    with pytest.raises(ValueError, match="fp8"):
        wl.kernel_ms(Kernel("mm", MATMUL, 1e9, 1, dtype="fp8"), r)


def test_timed_as_puts_every_kernel_in_a_graph_and_in_l2():
    w = Workload("w", (Kernel("a", ELEMENTWISE, 0, 1e8), Kernel("b", ELEMENTWISE, 1, 8, launch=TRITON)))
    t = w.timed_as(graph=True, in_l2=True)
    assert [k.launch for k in t.kernels] == [GRAPH, GRAPH] and all(k.in_l2 for k in t.kernels)
    assert wl.predict(t, CEILINGS)["predicted_ms"] == pytest.approx(0.001 + 0.05 + 0.001, rel=1e-4)
