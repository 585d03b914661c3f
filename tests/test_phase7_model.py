"""Phase 7 model and training loop on a CPU: counts, ablation switches, the loop, the records' rows."""
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn as nn

from phases.phase7_gpt import train as TR
from phases.phase7_gpt.gpt import (
    GPT,
    GPTConfig,
    bytes_per_step,
    flops_per_token,
    param_breakdown,
    param_formula,
)

TINY = dict(vocab_size=97, block_size=12, n_layer=2, n_head=2, n_embd=16)


def build(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**TINY, **kw}))


# ------------------------------------------------------------------------------ counting
@pytest.mark.parametrize("kw", [
    {}, {"tie_weights": False}, {"layernorm": False}, {"residual": False}, {"vocab_multiple": 64},
    {"n_layer": 3, "n_head": 3, "n_embd": 24, "block_size": 7}, {"layernorm": False, "tie_weights": False},
])
def test_module_counts_match_the_closed_form(kw):
    cfg = GPTConfig(**{**TINY, **kw})
    counted = param_breakdown(GPT(cfg))
    assert counted == param_formula(cfg)
    assert counted["total"] == sum(p.numel() for p in GPT(cfg).parameters())   # parameters() dedups a tied head


def test_the_seeds_published_counts():
    with torch.device("meta"):
        big = param_breakdown(GPT(GPTConfig(n_layer=6, n_head=6, n_embd=384)))
        small = param_breakdown(GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128)))
    assert big["wte"] == 50257 * 384 == 19_298_688                      # "19.3M"
    assert big["wpe"] == 256 * 384 == 98_304                            # "98K"
    assert round(big["blocks"] / 1e6, 1) == 10.6
    assert big["total"] == 30_023_808 and round(big["total"] / 1e6, 2) == 30.02
    assert round(small["total"] / 1e6, 2) == 7.25
    # the seed's scaling table, non-embedding parameters
    for (layers, width), n in {(2, 64): 98_944, (3, 96): 333_120, (4, 128): 788_736, (6, 192): 2_659_200}.items():
        assert param_formula(GPTConfig(n_layer=layers, n_head=1, n_embd=width))["non_embedding"] == n


def test_flops_and_bytes_formulas():
    cfg = GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256)
    f = flops_per_token(cfg)
    n_ne = 6 * (12 * 384**2 + 4 * 384) + 2 * 384
    assert f["non_embedding"] == 6 * n_ne
    assert f["attention"] == 12 * 6 * 384 * 256
    assert f["lm_head"] == 6 * 384 * 50257
    assert f["total"] == 6 * n_ne + 12 * 6 * 384 * 256 + 6 * 384 * 50257
    # 44 B/param of state traffic, the saved activations written and read (13 fp32 stream rows, 6 x 8 bf16 rows
    # of 384, 6 x 6 fp32 log-sum-exp per token), 16 B/token of ids (tests/test_phase7_counts.py: an odd shape)
    saved = 13 * 384 * 4 + 6 * 8 * 384 * 2 + 6 * 6 * 4
    assert bytes_per_step(cfg, 1000) == 44 * param_formula(cfg)["total"] + 2 * saved * 1000 + 16 * 1000


# ------------------------------------------------------------------------------ ablations
def test_layernorm_switch_removes_every_layernorm():
    on, off = build(), build(layernorm=False)
    assert sum(isinstance(m, nn.LayerNorm) for m in on.modules()) == 2 * TINY["n_layer"] + 1
    assert not any(isinstance(m, nn.LayerNorm) for m in off.modules())
    assert not any("ln_" in name for name, _ in off.named_parameters())
    d = TINY["n_embd"]
    assert param_breakdown(on)["total"] - param_breakdown(off)["total"] == (2 * TINY["n_layer"] + 1) * 2 * d
    off.load_state_dict(on.state_dict(), strict=False)        # same weights, minus the norms
    x = torch.randint(0, 97, (2, 12))
    assert not torch.allclose(on(x)[0], off(x)[0])


def test_layernorm_off_means_identity_where_the_norms_were():
    on, off = build(), build(layernorm=False)
    off.load_state_dict(on.state_dict(), strict=False)
    for m in on.modules():            # make every LayerNorm an exact identity: the outputs then agree
        if isinstance(m, nn.LayerNorm):
            m.forward = lambda x: x
    x = torch.randint(0, 97, (2, 12))
    torch.testing.assert_close(on(x)[0], off(x)[0])


def test_residual_switch_removes_the_skip_path():
    for residual in (True, False):
        model = build(residual=residual)
        block = model.blocks[0]
        with torch.no_grad():                                 # sublayers that output exactly zero
            block.attn.c_proj.weight.zero_()
            block.mlp.c_proj.weight.zero_()
        x = torch.randn(2, 12, TINY["n_embd"])
        out = block(x)
        if residual:
            torch.testing.assert_close(out, x)                # identity through the skip path
        else:
            assert torch.count_nonzero(out) == 0              # nothing gets through: no skip path
    on, off = build(), build(residual=False)
    assert param_breakdown(on) == param_breakdown(off)        # same parameters, different wiring
    x = torch.randint(0, 97, (2, 12))
    assert not torch.allclose(on(x)[0], off(x)[0])


def test_switches_keep_the_controls_initial_weights():
    """Same seed, same initial weights for every parameter the ablated model still has (7.5 relies on it)."""
    ref = build().state_dict()
    for kw in ({"layernorm": False}, {"residual": False}, {"residual": False, "layernorm": False}):
        for name, t in build(**kw).state_dict().items():
            assert torch.equal(t, ref[name]), (kw, name)


def test_tied_head_is_the_embedding():
    tied, untied = build(), build(tie_weights=False)
    assert tied.lm_head.weight is tied.wte.weight
    assert untied.lm_head.weight is not untied.wte.weight


def test_attention_is_causal_and_shapes_are_right():
    model = build().eval()
    x = torch.randint(0, 97, (3, 12))
    logits, loss = model(x)
    assert logits.shape == (3, 12, 97) and loss is None
    y = x.clone()
    y[:, 8:] = (y[:, 8:] + 1) % 97                            # change only the future
    torch.testing.assert_close(model(y)[0][:, :8], logits[:, :8])
    assert not torch.allclose(model(y)[0][:, 8:], logits[:, 8:])


def test_initial_loss_is_near_ln_vocab():
    model = build(vocab_size=50257, n_embd=32)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 50257, (2, 12), generator=g) for _ in range(2))
    with torch.no_grad():
        _, loss = model(x, y)
    assert abs(float(loss) - math.log(50257)) < 0.3


def test_padded_vocab_is_never_sampled():
    model = build(vocab_multiple=64)
    assert model.cfg.padded_vocab == 128
    out = model.generate(torch.zeros(1, 1, dtype=torch.long), 30, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 31) and int(out.max()) < 97


# ------------------------------------------------------------------------------ the loop
@pytest.fixture(scope="module")
def splits():
    from phases.phase7_gpt import data as D
    return D.load_splits(D.SHIPPED)                          # the split that ships in data/


CPU = torch.device("cpu")
SMALL = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)
FAST = TR.TrainConfig(batch_size=8, max_iters=30, lr=1e-2, warmup_iters=2, eval_every=10, eval_tokens=256,
                      timing_warmup=2, profile_steps=2)


def test_a_tiny_model_learns_on_cpu(splits):
    res = TR.train(SMALL, FAST, splits, CPU)
    loss = res["loss"]
    assert len(loss) == 30 and all(math.isfinite(x) for x in loss)
    assert abs(loss[0] - math.log(50257)) < 0.3
    assert np.mean(loss[-5:]) < loss[0] - 1.0                 # the training loss falls
    assert res["evals"][-1][2] < res["evals"][0][2] - 0.5      # and so does the validation loss
    assert len(res["grad_norm"]) == 30 and all(g > 0 for g in res["grad_norm"])   # measured every step
    assert res["best_val_step"] == max(res["evals"], key=lambda e: -e[2])[0]
    assert len(res["breakdown"]) == 2 and set(res["breakdown"][0]) >= {"data_ms", "forward_ms", "backward_ms", "optimizer_ms"}
    assert len(res["step_ms"]) == 30 - 2 - 2                   # profiled and warm-up steps left out


def test_padding_rows_are_allocated_but_not_counted(splits):
    res = TR.train(replace(SMALL, vocab_multiple=64), replace(FAST, stop_at=2), splits, CPU)
    assert res["params"] == param_formula(SMALL)
    assert res["params_allocated"] == param_formula(SMALL)["total"] + (50304 - 50257) * SMALL.n_embd


def test_same_seed_same_run(splits):
    a = TR.train(SMALL, replace(FAST, stop_at=12), splits, CPU)
    b = TR.train(SMALL, replace(FAST, stop_at=12), splits, CPU)
    assert a["loss"] == b["loss"] and len(a["loss"]) == 12
    c = TR.train(SMALL, replace(FAST, stop_at=12, seed=FAST.seed + 1), splits, CPU)
    assert c["loss"] != a["loss"]
    full = TR.train(SMALL, FAST, splits, CPU)                  # stopping early does not change the path
    assert full["loss"][:12] == a["loss"]


def test_no_clip_still_measures_the_norm_and_does_not_clip(splits):
    clipped = TR.train(SMALL, replace(FAST, grad_clip=1e-3, stop_at=5), splits, CPU)
    free = TR.train(SMALL, replace(FAST, grad_clip=0.0, stop_at=5), splits, CPU)
    assert clipped["grad_norm"][0] == pytest.approx(free["grad_norm"][0], rel=1e-5)  # the norm before clipping
    assert clipped["loss"][1] != free["loss"][1]                                     # clipping changed the step


def test_early_stopping_on_validation(splits):
    res = TR.train(SMALL, replace(FAST, max_iters=200, lr=3e-2, eval_every=5, patience=1), splits, CPU)
    assert res["stopped"] is None or res["stopped"].startswith("early stop")
    if res["stopped"]:
        assert res["steps"] < 200 and res["steps"] - res["best_val_step"] == 5


def test_schedule():
    tc = TR.TrainConfig(lr=1.0, warmup_iters=10, max_iters=110, min_lr_ratio=0.1)
    assert TR.lr_at(0, tc) == pytest.approx(1 / 11)
    assert TR.lr_at(9, tc) == pytest.approx(10 / 11)
    assert TR.lr_at(10, tc) == pytest.approx(1.0)
    assert TR.lr_at(60, tc) == pytest.approx(0.55)
    assert TR.lr_at(110, tc) == pytest.approx(0.1) and TR.lr_at(500, tc) == pytest.approx(0.1)
    assert TR.lr_at(0, replace(tc, warmup_iters=0)) == pytest.approx(1.0)


def test_memorization_measures():
    text = "To be, or not to be, that is the question"
    assert TR.longest_verbatim("xx not to be, thzz", text) == " not to be, th"
    assert TR.longest_verbatim("zzz", text) == ""
    ids = np.arange(20)
    grams = frozenset(TR.D.to_u16(ids).tobytes()[2 * i: 2 * i + 16] for i in range(13))
    assert TR.ngram_overlap(list(range(5, 15)), grams) == 1.0
    assert TR.ngram_overlap([99] * 10, grams) == 0.0


# ------------------------------------------------------------------------------ rows
def _fake(loss, spec_ctx):
    res = {"loss": loss, "grad_norm": [1.0] * len(loss), "evals": [[0, 10.8, 10.8], [len(loss), 9.0, float("nan")]],
           "best_val_loss": 10.8, "best_val_step": 0, "steps": len(loss), "stopped": None,
           "first_nonfinite_step": next((i for i, x in enumerate(loss) if not math.isfinite(x)), None),
           "tokens_per_step": 64, "step_ms": [2.0, 2.1, 1.9], "breakdown": [], "wall_s": 1.0, "eval_s": 0.1,
           "compile_s": None, "compile_error": None, "zero_grad_fraction_step0": 0.0,
           "params": param_formula(SMALL)}
    return res


def test_rows_gate_on_initial_loss_and_nan(spec_ctx):
    ctx = spec_ctx()
    ceiling = {"tflops": None, "source": None}
    ok = TR.training_row(ctx, "x", SMALL, FAST, _fake([10.8, 9.0, 8.0], ctx), ceiling=ceiling)
    assert ok["status"] == "ok" and ok["timing"]["median_ms"] == 2.0 and ok["prediction"]["flops"] > 0
    assert ok["metrics"]["curve"][1][2] is None                          # NaN stored as null
    assert ok["metrics"]["tokens_per_s"] == pytest.approx(64 / 2e-3)
    bad_init = TR.training_row(ctx, "x", SMALL, FAST, _fake([3.0, 2.0], ctx), ceiling=ceiling)
    assert bad_init["status"] == "failed" and bad_init["timing"] is None and "initial loss" in bad_init["reason"]
    nan = _fake([10.8, float("nan")], ctx)
    failed = TR.training_row(ctx, "x", SMALL, FAST, nan, ceiling=ceiling)
    assert failed["status"] == "failed" and "non-finite" in failed["reason"] and failed["timing"] is None
    outcome = TR.training_row(ctx, "x", SMALL, FAST, nan, ceiling=ceiling, nan_is_outcome=True)
    assert outcome["status"] == "ok" and outcome["metrics"]["first_nonfinite_step"] == 1


def test_mfu_against_both_ceilings(spec_ctx):
    ctx = spec_ctx()
    r = TR.training_row(ctx, "x", SMALL, FAST, _fake([10.8, 9.0], ctx), ceiling={"tflops": 500.0, "source": "results/x.json"})
    m = r["metrics"]
    assert m["model_tflops"] == pytest.approx(flops_per_token(SMALL)["total"] * m["tokens_per_s"] / 1e12)
    assert m["mfu_pct_of_phase1"] == pytest.approx(100 * m["model_tflops"] / 500.0)
    assert m["mfu_pct_of_spec"] == pytest.approx(100 * m["model_tflops"] / m["mfu_spec_peak_tflops"])


def test_residual_stream_rms_shows_the_attenuation():
    x = torch.randint(0, 97, (2, 12))
    healthy = TR.residual_stream_rms(build(n_layer=6), x)
    broken = TR.residual_stream_rms(build(n_layer=6, residual=False, layernorm=False), x)
    assert len(healthy) == len(broken) == 7
    assert healthy[-1] / healthy[0] > 0.5
    assert broken[-1] / broken[0] < 1e-6
