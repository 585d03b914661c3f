"""The profiler check (common/kernel_trace.py, kernel_trace_check.py) on a fake trace, and its CLI's
refusals on a CPU-only machine."""
from types import SimpleNamespace

import pytest

from common import kernel_trace as kt
from common import kernel_trace_check as check
from common.workload import ELEMENTWISE, GEMV, MATMUL, Kernel, Workload

CEILINGS = {"hbm_gbps": 1000.0, "l2_gbps": 2000.0, "gemv_gbps": 1000.0, "gemv_slope_gbps": 1000.0,
            "gemv_fixed_us": 0.0, "autograd_op_us": 5.0, "matmul_tflops": {"bf16": 100.0, "fp32": 10.0},
            "launch_us": 5.0, "graph_launch_us": 1.0, "triton_launch_us": 8.0, "sync_us": 10.0,
            "exp_per_s": 1e12, "l2_fit_bytes": 1e6}


def test_kernels_group_by_name_attention_before_matmul():
    assert kt.trace_group("flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64>>") == kt.ATTENTION
    assert kt.trace_group("_paged_decode_attention_kernel") == kt.ATTENTION
    assert kt.trace_group("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == kt.MATMUL
    assert kt.trace_group("nvjet_hsh_128x64_64x5_1x2_h_bz_coopA_NTN") == kt.MATMUL
    assert kt.trace_group("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>") == kt.OTHER
    assert kt.model_group(Kernel("causal flash attention (forward)", MATMUL, 1, 1)) == kt.ATTENTION
    assert kt.model_group(Kernel("QKV (+ RMSNorm)", GEMV, 1, 1, None)) == kt.MATMUL
    assert kt.model_group(Kernel("RMSNorm before QKV", ELEMENTWISE, 1, 1, None)) == kt.OTHER


def test_a_fake_trace_is_compared_per_group_per_step():
    w = Workload("step", (Kernel("mm", MATMUL, 2e9, 1e6, count=2),            # 5 us + 20 us each
                          Kernel("attention", MATMUL, 0, 1e6, count=1),         # 5 us + 1 us
                          Kernel("add", ELEMENTWISE, 0, 1e6, None, count=4)))   # 5 us + 1 us each
    trace = [("ampere_bf16_gemm", 2 * 2 * 30.0, 4),          # two steps: 2 gemms a step at 30 us
             ("flash_fwd", 2 * 10.0, 2), ("elementwise_add", 2 * 4 * 6.0, 8), ("Memset (Device)", 2 * 2.0, 2)]
    r = kt.compare(trace, 2, w, CEILINGS)
    g = {x["group"]: x for x in r["groups"]}
    assert g[kt.MATMUL]["trace_launches"] == 2 and g[kt.MATMUL]["model_launches"] == 2
    assert g[kt.MATMUL]["trace_ms"] == pytest.approx(0.060) and g[kt.MATMUL]["model_ms"] == pytest.approx(0.050)
    assert g[kt.OTHER]["trace_launches"] == 5 and g[kt.OTHER]["trace_ms"] == pytest.approx(0.026)   # the memset too
    assert g[kt.ATTENTION]["model_ms"] == pytest.approx(0.006)
    t = r["totals"]
    assert t["trace_kernel_ms"] == pytest.approx(0.096) and t["model_kernel_ms"] == pytest.approx(0.080)
    assert t["trace_launches"] == 8 and t["model_launches"] == 7
    assert sum(x["trace_share"] for x in r["groups"]) == pytest.approx(1.0)
    assert r["trace_top"][0]["kernel"] == "ampere_bf16_gemm" and r["trace_top"][0]["ms_per_step"] == pytest.approx(0.06)
    assert "| all | 8 | 7 |" in kt.table(r)
    with pytest.raises(ValueError):
        kt.compare(trace, 0, w, CEILINGS)


def test_device_events_are_summed_by_name_and_host_ops_left_out():
    def event(name, kind, us):
        return SimpleNamespace(name=name, device_type=f"DeviceType.{kind}",
                               time_range=SimpleNamespace(elapsed_us=lambda: us))
    events = [event("gemm", "CUDA", 10.0), event("gemm", "CUDA", 12.0), event("aten::mm", "CPU", 50.0),
              event("Memcpy HtoD", "CUDA", 3.0)]
    assert sorted(check.kernels_of(events)) == [("Memcpy HtoD", 3.0, 1), ("gemm", 22.0, 2)]


def test_the_phases_declare_their_trace_steps():
    steps = check.trace_steps()
    assert {"phase3.flash_attention", "phase5.ttft_decode", "phase5.batching", "phase7.scaling"} <= set(steps)
    from common.errors import LabError
    with pytest.raises(LabError, match="no parameter 'batch'"):
        steps["phase5.ttft_decode"]({"batch": 4}, None)
    with pytest.raises(LabError, match="no scaling size 'huge'"):
        steps["phase7.scaling"]({"size": "huge"}, None)
    with pytest.raises(LabError, match="variant 'naive'"):
        steps["phase3.flash_attention"]({"variant": "naive"}, None)


def test_bad_input_gets_one_line_and_exit_2(capsys):
    assert check.main(["--exercise", "phase9.nothing"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no trace step for 'phase9.nothing'" in err
    assert check.main(["--exercise", "phase7.scaling", "--param", "size"]) == 2
    assert "not key=value" in capsys.readouterr().err
    assert check.main(["--exercise", "phase7.scaling", "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err


def test_on_a_cpu_it_says_it_needs_a_gpu(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert check.main(["--exercise", "phase5.ttft_decode"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
