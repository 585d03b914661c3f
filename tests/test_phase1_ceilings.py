"""phase1.ceilings' ceilings for the summed workload model: the exp rate and the Triton launch floor."""
import importlib.util
import subprocess
import sys

import pytest
import torch
from conftest import REPO, clean_env

from common.exercise import Context
from phases.phase1_roofline import special_function
from phases.phase1_roofline.ceilings import EXERCISE, ceilings_of


def _ok(variant, metrics, params=None):
    return {"variant": variant, "status": "ok", "params": params or {}, "metrics": metrics}


def test_the_summary_carries_the_exp_rate_and_the_triton_floor_when_measured():
    rows = [_ok("hbm_copy", {"gbps": 3000.0}), _ok("launch", {"ms": 0.004}), _ok("triton_launch", {"ms": 0.009}),
            _ok("exp", {"ms": 1.0, "exp_per_s": 4e12})]
    c = ceilings_of(rows, None, 0.5)
    assert c["exp_per_s"] == 4e12 and c["triton_launch_us"] == pytest.approx(9.0)
    assert c["launch_us"] == pytest.approx(4.0)
    skipped = [_ok("hbm_copy", {"gbps": 3000.0}), {"variant": "exp", "status": "skipped", "params": {}, "metrics": {}}]
    assert ceilings_of(skipped, None, 0.5)["exp_per_s"] is None          # the model then falls back, saying so


def test_on_a_cpu_both_rows_are_skipped_with_the_reason():
    ctx = Context(torch.device("cpu"), None, "cpu")
    rows = special_function.rows(ctx, 1024)
    assert [(r["variant"], r["status"]) for r in rows] == [("exp", "skipped"), ("triton_launch", "skipped")]
    assert all(r["reason"] for r in rows)


def test_the_exercise_declares_the_exp_kernel_size():
    assert EXERCISE.params["exp_elements"] == 2**24 and EXERCISE.quick_params["exp_elements"] == 2**16


CHILD = """
import torch
from phases.phase1_roofline import special_function as sf
x = torch.rand(3001)
out = torch.full_like(x, float("nan"))
sf.exp_chain(x, out, reps=16)
ref = sf.exp_chain_reference(x, reps=16)
err = ((out.double() - ref).norm() / ref.norm()).item()
assert err < 5e-5, err
sf.exp_chain(x, out, reps=3)                  # the chain contracts to 2^-x = x: few reps tell counts apart
three, two = sf.exp_chain_reference(x, reps=3), sf.exp_chain_reference(x, reps=2)
assert ((out.double() - three).norm() / three.norm()).item() < 5e-5
assert ((out.double() - two).norm() / two.norm()).item() > 1e-2        # one exponential fewer is caught
one = torch.zeros(1)
sf.increment_kernel[(1,)](one)
assert one.item() == 1.0
print("ok", err)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the Python package `triton`")
def test_the_exp_chain_kernel_is_correct_under_the_interpreter():
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=clean_env(TRITON_INTERPRET="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), (proc.stdout + proc.stderr)[-3000:]


def test_the_autograd_op_row_measures_a_host_time_per_op_on_a_cpu():
    from phases.phase1_roofline.ceilings import _autograd_row
    ctx = Context(torch.device("cpu"), None, "cpu")
    r = _autograd_row(ctx)
    assert r["status"] == "ok" and r["check"]["passed"]
    assert r["metrics"]["long_chain_ms"] > r["metrics"]["short_chain_ms"]     # 128 more ops take longer
    assert r["metrics"]["op_us"] == pytest.approx(1e3 * r["metrics"]["ms"]) and r["metrics"]["op_us"] > 0
    assert r["prediction"]["excluded"]
    rows = [_ok("hbm_copy", {"gbps": 3000.0}), r]
    assert ceilings_of(rows, None, 0.5)["autograd_op_us"] == r["metrics"]["op_us"]


def test_two_gemv_sizes_give_a_fixed_part_and_a_slope():
    from phases.phase1_roofline.ceilings import gemv_fit
    big = _ok("gemv", {"ms": 0.070, "gbps": 235e6 / 70e3}, {"working_set_bytes": 235e6})
    small = _ok("gemv_small", {"ms": 0.016}, {"working_set_bytes": 33e6})
    rows = [_ok("hbm_copy", {"gbps": 4000.0}), _ok("launch", {"ms": 0.004}), big, small]
    c = ceilings_of(rows, None, 0.5)
    slope = (235e6 - 33e6) / (0.054 * 1e6)                      # GB/s between the two points
    assert c["gemv_slope_gbps"] == pytest.approx(slope)
    assert c["gemv_fixed_us"] == pytest.approx(1e3 * (0.016 - 33e6 / (slope * 1e6)) - 4.0)   # beyond the launch floor
    assert gemv_fit({"gemv": big, "launch": rows[1]}) == {"gemv_slope_gbps": None, "gemv_fixed_us": None}
    slower_small = _ok("gemv_small", {"ms": 0.080}, {"working_set_bytes": 33e6})              # no positive slope
    assert gemv_fit({"gemv": big, "gemv_small": slower_small, "launch": rows[1]})["gemv_fixed_us"] is None


def test_the_small_gemv_row_runs_on_a_cpu_and_names_itself():
    from phases.phase1_roofline.ceilings import _gemv_row
    ctx = Context(torch.device("cpu"), None, "cpu", quick=True)
    r = _gemv_row(ctx, 64, 100, "gemv_small")
    assert r["variant"] == "gemv_small" and r["status"] == "ok" and r["params"]["working_set_bytes"] == (64 * 100 + 164) * 4
