"""common/cost.py: where the $/hour comes from, and what a run cost."""
import math

import pytest

from common.cost import cost_block, hourly_rate
from common.errors import LabError


@pytest.fixture
def h200(specs):
    return specs["h200_sxm"]


def test_hardware_yaml_rate_with_its_source(h200):
    rate, source = hourly_rate(h200)
    assert rate == 4.59
    assert source.startswith("hardware.yaml:h200_sxm (") and "RunPod" in source


def test_env_beats_yaml(h200, monkeypatch):
    monkeypatch.setenv("LAB_USD_PER_HOUR", "2.5")
    assert hourly_rate(h200) == (2.5, "LAB_USD_PER_HOUR environment variable")


def test_flag_beats_env_and_yaml(h200, monkeypatch):
    monkeypatch.setenv("LAB_USD_PER_HOUR", "2.5")
    assert hourly_rate(h200, 1.25) == (1.25, "--usd-per-hour flag")
    assert hourly_rate(h200, 0.0) == (0.0, "--usd-per-hour flag")     # free is a rate, not "unset"


def test_empty_env_falls_through(h200, monkeypatch):
    monkeypatch.setenv("LAB_USD_PER_HOUR", "")
    assert hourly_rate(h200)[0] == 4.59


def test_no_rate_anywhere(specs):
    assert hourly_rate(None) == (None, None)
    assert hourly_rate(specs["mi300x"]) == (None, None)        # null in hardware.yaml


def test_negative_flag():
    with pytest.raises(LabError, match="--usd-per-hour"):
        hourly_rate(None, -1.0)


@pytest.mark.parametrize("value", ["-1", "abc", "1,50", "$2"])
def test_bad_env(monkeypatch, value):
    monkeypatch.setenv("LAB_USD_PER_HOUR", value)
    with pytest.raises(LabError, match="LAB_USD_PER_HOUR"):
        hourly_rate(None)


def test_cost_arithmetic():
    c = cost_block(3.6, "--usd-per-hour flag", seconds=100.0, gpus=2)
    assert c["usd"] == pytest.approx(0.2)                # 3.6 $/GPU-h x 2 GPUs x 100 s / 3600
    assert c == {"usd_per_hour": 3.6, "rate_source": "--usd-per-hour flag", "gpus": 2,
                 "seconds": 100.0, "usd": pytest.approx(0.2)}
    assert cost_block(4.59, "x", 3600.0)["usd"] == pytest.approx(4.59)
    assert cost_block(1.0, "x", 1.23456)["seconds"] == 1.235
    none = cost_block(None, None, 12.0)
    assert none["usd"] is None and none["usd_per_hour"] is None and none["seconds"] == 12.0


@pytest.mark.parametrize("where", ["flag", "env"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_rate_is_rejected(monkeypatch, where, value):
    with pytest.raises(LabError):
        if where == "flag":
            hourly_rate(None, float(value))
        else:
            monkeypatch.setenv("LAB_USD_PER_HOUR", value)
            rate, _ = hourly_rate(None)
            assert math.isfinite(rate)
