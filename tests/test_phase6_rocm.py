"""Portability to AMD, simulated on a CPU: torch's answers on a ROCm build (torch.version.hip set,
torch.cuda naming an Instinct MI300X) are patched in, and the lab must name the GPU from
hardware.yaml, skip the CUDA C and Nsight exercises with the reason, and let Triton and torch
exercises run."""
from types import SimpleNamespace

import pytest
import torch

from common import env
from common.registry import select
from common.runner import make_context, run_one, static_blocks

NAME = "AMD Instinct MI300X"


@pytest.fixture
def rocm(monkeypatch):
    """torch as a ROCm 6.2 build sees it on an MI300X (the values torch reports there)."""
    props = SimpleNamespace(name=NAME, major=9, minor=4, multi_processor_count=304, total_memory=192 * 2**30,
                            L2_cache_size=4 * 2**20, gcnArchName="gfx942:sramecc+:xnack-")
    monkeypatch.setattr(torch.version, "hip", "6.2.41133-dd7f95766", raising=False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: NAME)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(env, "run_quiet", lambda *a, **k: None)      # no nvidia-smi, no nvcc on this machine
    return props


def test_the_lab_names_the_mi300x_from_hardware_yaml(rocm):
    ctx = make_context("auto")
    assert ctx.is_cuda and ctx.is_rocm and ctx.spec.key == "mi300x" == ctx.hardware_key
    assert ctx.roofs("bf16").peak("bf16") == 1307.4 and ctx.roofs().bandwidth_gbps == 5300
    gpu = env.gpu_info()
    assert (gpu["name"], gpu["backend"], gpu["gcn_arch"], gpu["compute_capability"]) == \
        (NAME, "rocm", "gfx942:sramecc+:xnack-", "9.4")
    assert env.software_info()["torch_hip"].startswith("6.2") and env.software_info()["torch_cuda"] is None


def test_cuda_c_and_nsight_skip_with_the_reason_triton_and_torch_run(rocm):
    ctx = make_context("auto")
    for ex in select(["2", "phase1.nsight"]):
        reason = ex.needs.unmet(ctx)
        assert reason and "ROCm build (HIP 6.2" in reason and NAME in reason, (ex.id, reason)
    for ex in select(["phase1.elementwise", "phase1.matmul_fp16", "phase0.timer_check", "3"]):
        assert ex.needs.unmet(ctx) is None, ex.id


def test_a_cuda_c_record_on_rocm_is_skipped_and_names_the_gpu(rocm):
    ctx = make_context("auto")
    [ex] = select(["phase2.vector_add"])
    rec = run_one(ex, ctx, ex.resolve_params(False, True, {}), static_blocks(ctx, ["lab", "run", "2"]), None, None)
    assert rec["status"] == "skipped" and "ROCm" in rec["reason"] and rec["rows"] == []
    assert rec["hardware"]["key"] == "mi300x" and rec["hardware"]["name"] == NAME
    assert rec["hardware"]["spec"]["name"] == NAME and rec["software"]["torch_hip"]


def test_the_gates_read_a_rocm_machine(rocm):
    from phases.phase0_environment.gates import EXERCISE
    rows = {r["variant"]: r for r in EXERCISE.run(make_context("auto"), {}).rows}
    assert rows["driver"]["status"] == "ok" and NAME in rows["driver"]["metrics"]["observed"]
    assert rows["nvcc"]["status"] == "skipped" and "ROCm" in rows["nvcc"]["reason"]
    assert "ROCm HIP 6.2" in rows["torch_version"]["metrics"]["observed"]


def test_on_cuda_nothing_changes(monkeypatch):
    """The same needs on an NVIDIA build: the NVIDIA-only flag does not stand in the way."""
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    from common.exercise import Context
    ctx = Context(torch.device("cuda", 0), None, "gpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert not ctx.is_rocm
    [ex] = select(["phase2.vector_add"])
    reason = ex.needs.unmet(ctx)
    assert reason is None or "ROCm" not in reason
