"""phases/phase7_gpt/analysis.py: the verdicts and ratios the exercises store and the report reuses."""
import subprocess
import sys

from conftest import REPO, clean_env

from phases.phase7_gpt import analysis as A


def test_analysis_imports_no_torch():
    code = "import sys; import phases.phase7_gpt.analysis; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=clean_env())
    assert out.stdout.strip() == "False", out.stderr


def test_overfit_verdict_and_compiled():
    assert A.overfit_verdict(4.8, 8.5) == {"val_rise": 8.5 - 4.8, "val_rose": True}
    assert A.overfit_verdict(4.8, 4.805)["val_rose"] is False
    assert A.overfit_verdict(None, 4.8) == {"val_rise": None, "val_rose": None}
    assert A.compiled({"compile": True}, None) and not A.compiled({"compile": True}, "no compiler")
    assert not A.compiled({"compile": False}, None)


def test_overfit_summary_goal_and_ratios():
    by = {"throughput": {"tokens_per_s": 2e6}, "throughput_eager": {"tokens_per_s": 1e6},
          "large": {"tokens_per_s": 1.0}, "small": {"tokens_per_s": 2.0}}
    s = A.overfit_summary(by, seed_tokens_per_s=2e5)
    assert s["goal_met"] and s["goal_tokens_per_s"] == A.GOAL_TOKENS_PER_S
    assert s["compile_speedup"] == 2 and s["throughput_over_seed_30m"] == 10 and s["small_over_large_tokens_per_s"] == 2
    assert not A.overfit_summary({"throughput": {"tokens_per_s": 5e5}}, 2e5)["goal_met"]


def test_scaling_span_orders_by_size_and_flags_a_bigger_worse_model():
    s = A.scaling_span([("base", 1000, 4.9), ("nano", 10, 5.3), ("mini", 100, 4.8)])
    assert (s["smallest"], s["largest"], s["n_ratio"]) == ("nano", "base", 100)
    assert s["non_monotonic"] == ["base"] and s["loss_smallest"] == 5.3
    assert A.scaling_span([]) == {}


def test_failure_outcomes():
    control = {"best_val_loss": 5.0, "final_val_loss": 5.0}
    frozen = {"curve": [[0, 10.8, 10.83]], "best_val_loss": 10.8, "final_val_loss": 10.83}
    out = A.outcome(frozen, control, 0.1)
    assert out["outcome"].startswith("frozen") and round(out["final_val_vs_control_pct"], 1) == 116.6
    assert A.outcome({"curve": [[0, 10.8, 10.8]], "first_nonfinite_step": 7}, None, 0.1)["outcome"].startswith("diverged")
    assert A.outcome({"curve": [[0, 10.8, 10.8]], "best_val_loss": 6.0}, None, 0.1)["outcome"] == "learned"
