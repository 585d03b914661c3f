"""Phase 5 refuses, before loading, a model too large for the device in the dtype it will load:
bf16 on a GPU, fp32 on a CPU; in `lab run` and in `lab serve` (issue 33, item 2)."""
import argparse

import pytest
import torch

from common import runner
from common.errors import LabError
from common.exercise import Context
from conftest import assert_one_line_error
from phases.phase5_inference.models import model_choice
from phases.phase5_inference import batching, offline, startup, tensor_parallel, ttft_decode
from phases.phase5_inference.engine import named, server

GIB = 2**30
EIGHT_B_PARAMS = named("llama-3.1-8b").params()


@pytest.fixture
def ram(monkeypatch):
    """Pretend the host has `gib` GiB of RAM available (what a CPU run may hold)."""
    def set_to(gib: float):
        monkeypatch.setattr(runner, "memory_bytes", lambda device: int(gib * GIB))
    return set_to


def test_the_footprint_counts_the_bytes_of_the_dtype_that_loads():
    p = batching.EXERCISE.resolve_params(on_cpu=True, quick=False, overrides={"model": "llama-3.1-8b"})
    assert model_choice.weights_footprint_bytes(p) == 2 * EIGHT_B_PARAMS        # bf16 on a GPU
    assert model_choice.cpu_weights_footprint_bytes(p) == 4 * EIGHT_B_PARAMS    # fp32 on a CPU
    for ex in (batching.EXERCISE, offline.EXERCISE, startup.EXERCISE, ttft_decode.EXERCISE, tensor_parallel.EXERCISE):
        assert ex.cpu_footprint_bytes is not None, ex.id


@pytest.mark.parametrize("ex, override", [
    (batching.EXERCISE, "model=llama-3.1-8b"),
    (offline.EXERCISE, "model=llama-3.1-8b"),
    (startup.EXERCISE, "models=[tiny,llama-3.1-8b]"),        # on a CPU no model is skipped once running
    (ttft_decode.EXERCISE, "models=[tiny,llama-3.1-8b]"),
    (tensor_parallel.EXERCISE, "models=[llama-3.1-8b]"),      # its ranks share the host's RAM: every shard
])
def test_lab_run_refuses_an_8b_model_on_a_24_gib_cpu_before_any_work(lab, ram, tmp_path, ex, override):
    ram(24)                                        # 16 GiB in bf16 would fit; 30 GiB in fp32 does not
    res = tmp_path / "results"
    rc, out, err = lab("run", ex.id, "--device", "cpu", "--param", override, "--results", res)
    assert_one_line_error(rc, err, res)
    need = ex.cpu_footprint_bytes(ex.resolve_params(True, False, runner.parse_overrides([override])))
    assert need >= 4 * EIGHT_B_PARAMS
    assert rc == 2 and f"{need / GIB:,.1f} GiB" in err and ex.id in err


def test_an_8b_model_passes_the_check_where_its_fp32_weights_fit(ram):
    ram(40)
    ctx = Context(torch.device("cpu"), None, "cpu")
    params = runner.checked_params([batching.EXERCISE], ctx, {"model": "llama-3.1-8b"})
    assert params["phase5.batching"]["model"] == "llama-3.1-8b"


def _serve_args(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_lab_serve_refuses_a_model_too_large_before_loading(ram, capsys):
    ram(24)
    rc = server.main(["--model", "llama-3.1-8b", "--device", "cpu", "--port", "0"])
    err = capsys.readouterr().err
    assert rc == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "llama-3.1-8b" in lines[0] and "29.9 GiB" in lines[0] and "32-bit" in lines[0], err


def test_lab_serve_counts_the_dtype_it_will_load(ram):
    ram(24)
    with pytest.raises(LabError, match="29.9 GiB"):                  # a CPU's default: fp32
        server.config_from_args(_serve_args("--model", "llama-3.1-8b", "--device", "cpu", "--port", "0"))
    config = server.config_from_args(_serve_args("--model", "llama-3.1-8b", "--device", "cpu", "--port", "0",
                                                 "--dtype", "bfloat16"))      # 15 GiB in bf16: fits, nothing loaded
    assert config.dtype == "bfloat16"
    assert server.config_from_args(_serve_args("--model", "tiny", "--device", "cpu", "--port", "0")).model == "tiny"
