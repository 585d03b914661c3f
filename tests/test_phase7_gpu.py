"""Phase 7 on a CUDA GPU (run with `pytest -m gpu tests/test_phase7_gpu.py`): the paths a CPU cannot
exercise: flash attention in bf16, CUDA-event timing, fused AdamW, torch.compile without recompiles."""
from dataclasses import replace

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]



@pytest.fixture(scope="module")
def splits():
    from phases.phase7_gpt import data as D
    try:
        return D.load_splits(D.resolve_data_dir())
    except Exception:                                       # noqa: BLE001 - any data will do here
        rng = np.random.default_rng(0)
        return rng.integers(0, 50257, 50_000).astype("<u2"), rng.integers(0, 50257, 5_000).astype("<u2")


def test_flash_backend_runs_the_model_in_bf16():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from phases.phase7_gpt.gpt import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=2, n_head=6, n_embd=384)).cuda()
    x = torch.randint(0, 50257, (4, 256), device="cuda")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = model(x, x.roll(1, dims=1))
    loss.backward()
    assert torch.isfinite(loss)


def test_compiled_training_on_cuda_is_reproducible_and_does_not_recompile(splits):
    import torch._dynamo
    from torch._dynamo.utils import counters

    from phases.phase7_gpt import train as TR
    from phases.phase7_gpt.gpt import GPTConfig
    torch._dynamo.reset()
    counters.clear()
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_multiple=64)
    tc = TR.TrainConfig(batch_size=16, max_iters=40, stop_at=25, eval_every=25, eval_tokens=2048, compile=True,
                        timing_warmup=3, profile_steps=2)
    a = TR.train(cfg, tc, splits, torch.device("cuda"))
    assert a["compile_error"] is None and a["compile_s"] is not None
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    b = TR.train(cfg, tc, splits, torch.device("cuda"))
    assert abs(a["loss"][20] - b["loss"][20]) <= 2e-2
    assert a["loss"][-1] < a["loss"][0]
    assert all(ms > 0 for ms in a["step_ms"]) and len(a["breakdown"]) == 2
    eager = TR.train(cfg, replace(tc, compile=False), splits, torch.device("cuda"))
    assert abs(eager["loss"][20] - a["loss"][20]) < 0.1


def test_kernel_estimate_is_near_the_profilers_count(splits):
    """cost.step_kernels (the calibrated prediction's launches) against torch.profiler's count of one
    warm training step, eager and compiled: an estimate, so within a factor of 2 (the message has both)."""
    from phases.phase7_gpt import train as TR
    from phases.phase7_gpt.gpt import GPTConfig
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_multiple=64)
    for compile in (False, True):
        tc = TR.TrainConfig(batch_size=16, max_iters=12, stop_at=12, eval_every=12, eval_tokens=2048,
                            compile=compile, timing_warmup=3, profile_steps=2)
        res = TR.train(cfg, tc, splits, torch.device("cuda"))
        estimate = TR.train_cost(cfg, tc, "bf16", compiled=res["compile_error"] is None and compile)["launches_parts"]
        assert res["kernels_counted"] is not None, res["kernels_counted_error"]
        assert 0.5 <= res["kernels_counted"] / estimate["total"] <= 2.0, (compile, res["kernels_counted"], estimate)
