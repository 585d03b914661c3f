"""common/roofline.py: intensity, ridge point, times, and the bound on both sides of the ridge."""
import pytest

from common import roofline
from common.roofline import (Roofs, attainable_tflops, compute_ms, intensity, memory_ms, predict,
                             ridge_point)

H200 = Roofs(bandwidth_gbps=4800.0, peak_tflops={"fp16": 989.0, "fp32": 67.0, "fp8": None},
             source="test:h200")


def test_intensity():
    assert intensity(1.0, 12.0) == pytest.approx(1 / 12)
    assert intensity(2 * 8192**3, 3 * 8192**2 * 2) == pytest.approx(8192 / 3)
    assert intensity(0, 100) == 0.0
    assert intensity(100, 0) is None


def test_ridge_point():
    assert ridge_point(989, 4800) == pytest.approx(206.04, abs=0.01)
    assert ridge_point(19.5, 1555) == pytest.approx(12.54, abs=0.01)


def test_memory_and_compute_ms():
    assert memory_ms(4.8e9, 4800) == pytest.approx(1.0)          # 4.8 GB at 4.8 TB/s: 1 ms
    assert memory_ms(1e9, 1000) == pytest.approx(1.0)
    assert compute_ms(989e9, 989) == pytest.approx(1.0)          # 989 GFLOP at 989 TFLOP/s: 1 ms
    assert compute_ms(2e12, 1) == pytest.approx(2000.0)


def test_attainable_is_the_roof():
    assert attainable_tflops(1.0, 989, 4800) == pytest.approx(4.8)
    assert attainable_tflops(1e6, 989, 4800) == 989
    assert attainable_tflops(ridge_point(989, 4800), 989, 4800) == pytest.approx(989)


def test_memory_bound_left_of_ridge():
    n = 2**25
    p = predict(n, 12 * n, H200, "fp32")                  # elementwise multiply, 1/12 FLOP/byte
    assert p["bound"] == "memory"
    assert p["predicted_ms"] == pytest.approx(memory_ms(12 * n, 4800))
    assert p["predicted_ms"] == pytest.approx(p["memory_ms"]) and p["memory_ms"] > p["compute_ms"]
    assert p["intensity_flop_per_byte"] == pytest.approx(1 / 12)
    assert p["ridge_flop_per_byte"] == pytest.approx(67e3 / 4800)
    assert p["measured_ms"] is None and p["measured_over_predicted"] is None
    assert p["model"] == "roofline" and p["roofs_source"] == "test:h200"


def test_compute_bound_right_of_ridge():
    n = 8192
    flops, nbytes = 2 * n**3, 3 * n * n * 2
    p = predict(flops, nbytes, H200, "fp16")
    assert p["bound"] == "compute"
    assert p["predicted_ms"] == pytest.approx(compute_ms(flops, 989))
    assert p["compute_ms"] > p["memory_ms"]
    assert p["intensity_flop_per_byte"] > p["ridge_flop_per_byte"] == pytest.approx(206.04, abs=0.01)


def test_the_bound_flips_at_the_ridge():
    ridge = ridge_point(989, 4800)
    nbytes = 1e9
    assert predict(0.9 * ridge * nbytes, nbytes, H200, "fp16")["bound"] == "memory"
    assert predict(1.1 * ridge * nbytes, nbytes, H200, "fp16")["bound"] == "compute"


def test_copy_has_no_flops():
    p = predict(0, 2e9, H200, None)
    assert p["bound"] == "memory"
    assert p["compute_ms"] == 0.0
    assert p["predicted_ms"] == pytest.approx(2e9 / 4.8e12 * 1e3)
    assert p["intensity_flop_per_byte"] == 0.0
    assert p["peak_tflops"] is None and p["ridge_flop_per_byte"] is None


@pytest.mark.parametrize("dtype", ["fp8", "int8", None])
def test_unknown_peak_is_said(dtype):
    p = predict(1e12, 1e9, H200, dtype)
    assert p["compute_ms"] is None
    assert p["bound"] == "memory (compute peak unknown)"
    assert p["predicted_ms"] == pytest.approx(memory_ms(1e9, 4800))
    assert p["ridge_flop_per_byte"] is None


def test_measured_over_predicted():
    p = predict(0, 4.8e9, H200, None, measured_ms=1.25)
    assert p["predicted_ms"] == pytest.approx(1.0)
    assert p["measured_ms"] == 1.25
    assert p["measured_over_predicted"] == pytest.approx(1.25)
    # faster than the roofline allows shows up as a ratio below 1 (the synchronize lesson)
    assert predict(0, 4.8e9, H200, None, measured_ms=0.1)["measured_over_predicted"] == pytest.approx(0.1)


def test_roofs_peak_lookup():
    assert H200.peak("fp16") == 989.0
    assert H200.peak("bf16") is None
    assert roofline.Roofs(1.0, {}, "x").peak("fp32") is None
