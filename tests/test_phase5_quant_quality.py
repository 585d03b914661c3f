"""phase5.quant_quality and engine/awq.py on a CPU: AWQ's scale search against round-to-nearest,
QuantizedLinear's input_scale, and the exercise end to end (a tiny GPT, a few dozen steps) with
its trained-model cache."""
import json

import pytest
import torch
import torch.nn as nn

from common.errors import LabError
from common.params import ParamError
from common.paths import absolute_paths
from common.records import problems
from phases.phase5_inference import quant_quality as qq
from phases.phase5_inference.engine import awq
from phases.phase5_inference.engine import quantize as qz


def linear_and_inputs(n_out=24, k_in=80, tokens=256, seed=0, outliers=(3, 17, 40)):
    """A linear layer and calibration inputs with a few large ('salient') input channels."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k_in, n_out, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n_out, k_in, generator=g) * 0.05)
    x = torch.randn(tokens, k_in, generator=g)
    x[:, list(outliers)] *= 30.0
    return lin, x


def calibration_error(module, lin, x) -> float:
    with torch.no_grad():
        return float((module(x) - lin(x)).double().pow(2).sum())


# ------------------------------------------------------------------------------ AWQ
@pytest.mark.parametrize("group", [16, 32, 128])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_awq_is_never_worse_than_rtn_on_its_calibration_set(group, seed):
    lin, x = linear_and_inputs(seed=seed)
    found = awq.search_scale(lin.weight, x, group)
    assert found.alphas[0] == 0.0 and len(found.alphas) == awq.GRID_POINTS and found.alphas[-1] == 1.0
    assert found.loss <= found.rtn_loss and found.loss == min(found.losses)
    assert found.rtn_loss == found.losses[0]
    # the module it builds: the same comparison on its real outputs, and a clear gain with salient channels
    module, _ = awq.awq_linear(lin, x, group)
    rtn = qz.QuantizedLinear.from_linear(lin, 4, group, path="naive")
    awq_err, rtn_err = calibration_error(module, lin, x), calibration_error(rtn, lin, x)
    assert awq_err <= rtn_err
    assert found.alpha > 0 and awq_err < 0.9 * rtn_err, (found.alpha, awq_err / rtn_err)
    assert module.input_scale is not None and torch.allclose(module.input_scale, 1 / found.scale)
    assert found.as_dict()["loss_over_rtn"] <= 1.0
    json.dumps(found.as_dict())                                  # JSON-safe: a record can hold it


def test_awq_with_alpha_zero_is_rtn_exactly():
    lin, x = linear_and_inputs(k_in=72)                          # K not a multiple of the group: a partial group
    module, found = awq.awq_linear(lin, x, 32, alphas=[0.0])
    rtn = qz.QuantizedLinear.from_linear(lin, 4, 32, path="naive")
    assert found.alpha == 0.0 and found.loss == found.rtn_loss
    assert torch.equal(found.scale, torch.ones(72))
    for name in ("qweight", "scales", "zeros"):
        assert torch.equal(getattr(module.weight_format, name), getattr(rtn.weight_format, name)), name
    with torch.no_grad():
        assert torch.equal(module(x), rtn(x))


def test_awq_scales_are_normalized_and_refuse_bad_input():
    mag = torch.tensor([0.0, 0.5, 2.0, 8.0])
    s = awq.awq_scales(mag, 0.5)
    assert float(s.max() * s.min()) == pytest.approx(1.0)        # straddle 1
    assert bool((s > 0).all())                                   # a dead channel keeps a usable scale
    assert torch.equal(awq.awq_scales(mag, 0.0), torch.ones(4))
    lin, x = linear_and_inputs()
    with pytest.raises(LabError, match="do not fit"):
        awq.search_scale(lin.weight, x[:, :10], 32)
    with pytest.raises(LabError, match=r"\[0, 1\]"):
        awq.search_scale(lin.weight, x, 32, alphas=[0.5, 1.5])
    with pytest.raises(LabError, match="at least 2"):
        awq.alpha_grid(1)


# ------------------------------------------------------------------------------ input_scale
@pytest.mark.parametrize("bits", [4, 8])
def test_input_scale_round_trip_on_the_naive_path(bits):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(13, 40, generator=g) * 0.1
    bias = torch.randn(13, generator=g)
    scale = torch.rand(40, generator=g) + 0.5
    qw = qz.quantize(w, bits, 16)
    module = qz.QuantizedLinear(qw, bias, path="naive", input_scale=scale)
    x = torch.randn(2, 3, 40, generator=g)
    want = (x * scale) @ qw.dequantize(torch.float32).t() + bias
    assert torch.allclose(module(x), want, rtol=1e-6, atol=1e-6)
    plain = qz.QuantizedLinear(qw, bias, path="naive")
    assert torch.allclose(module(x / scale), plain(x), rtol=1e-5, atol=1e-5)
    assert "input_scale=[40]" in repr(module) and "input_scale" not in repr(plain)
    module.to(torch.float64)                                     # _apply moves it; its dtype stays
    assert module.input_scale.dtype == torch.float32 and module.input_scale.shape == (40,)
    with pytest.raises(LabError, match="input_scale must have shape"):
        qz.QuantizedLinear(qw, input_scale=torch.ones(39))


# ------------------------------------------------------------------------------ the exercise
def test_quant_quality_runs_on_a_cpu_and_reuses_its_trained_model(tmp_path, monkeypatch, spec_ctx):
    monkeypatch.setattr(qq, "CACHE_DIR", tmp_path / "cache")
    calls = []
    real_train = qq.train
    monkeypatch.setattr(qq, "train", lambda *a, **k: calls.append(1) or real_train(*a, **k))
    ex = qq.EXERCISE
    params = ex.resolve_params(on_cpu=True, quick=False, overrides={})
    assert params["layer_model"] == "tiny" and params["max_iters"] <= 100

    first = qq.run(spec_ctx(quick=False), params)
    assert len(calls) == 1 and list((tmp_path / "cache").glob("*.pt"))
    rows = first.rows
    assert all(r["status"] == "ok" for r in rows), [r["reason"] for r in rows if r["status"] != "ok"]
    layer = [r for r in rows if r["variant"] in qq.LAYER_VARIANTS]
    assert len(layer) == 2 * len(params["matrices"])
    for r in layer:
        m = r["metrics"]
        assert r["check"]["passed"] and m["max_abs_weight_error_over_scale"] <= 0.5 + 1e-5
        assert m["rel_error_output"] == pytest.approx(m["predicted_rel_error"], rel=0.25)
        assert m["rel_error_output"] < (0.02 if r["variant"] == "layer_int8" else 0.2)

    by = {qq.label(r): r["metrics"] for r in rows if r["variant"] in qq.GPT_VARIANTS}
    assert set(by) == {"reference", "int8", "int4_rtn_g128", "int4_rtn_g32", "int4_awq_g128", "int4_awq_g32"}
    ref = by["reference"]["val_loss"]
    for k, m in by.items():
        assert m["perplexity"] == pytest.approx(torch.tensor(m["val_loss"]).exp().item(), rel=1e-6)
        assert m["delta_loss_vs_reference"] == pytest.approx(m["val_loss"] - ref)
    int8_gap = abs(by["int8"]["perplexity"] - by["reference"]["perplexity"])
    for k in ("int4_rtn_g128", "int4_rtn_g32"):
        assert int8_gap < abs(by[k]["perplexity"] - by["reference"]["perplexity"]), k
        assert by["int8"]["kl_vs_reference"] < by[k]["kl_vs_reference"], k
        assert by["int8"]["weight_rel_error"] < by[k]["weight_rel_error"]
    for g in (128, 32):
        m = by[f"int4_awq_g{g}"]
        assert m["calibration_loss_over_rtn_max"] <= 1.0 and len(m["alpha_per_layer"]) == 4 * params["gpt"]["n_layer"]
    assert first.summary["int8_closer_than_every_int4_rtn"] is True
    assert first.summary["reference_model"]["training"]["from_cache"] is False

    text = json.dumps({"rows": rows, "summary": first.summary})
    assert absolute_paths(text) == [] and str(tmp_path) not in text
    assert problems(_as_record(rows, first.summary, params)) == []

    second = qq.run(spec_ctx(quick=False), params)                # the cached model: no training
    assert len(calls) == 1
    assert second.summary["reference_model"]["training"]["from_cache"] is True
    again = {qq.label(r): r["metrics"] for r in second.rows if r["variant"] in qq.GPT_VARIANTS}
    assert again["reference"]["val_loss"] == pytest.approx(ref, abs=1e-6)
    assert again["int8"]["val_loss"] == pytest.approx(by["int8"]["val_loss"], abs=1e-6)


def _as_record(rows, summary, params) -> dict:
    from conftest import _make_record
    return _make_record(exercise={"id": "phase5.quant_quality", "phase": 5, "name": "quant_quality",
                                  "title": "t", "bench_version": 1},
                        rows=rows, summary=summary, params=qq.EXERCISE.recorded_params(params))


@pytest.mark.parametrize("key, value", [("group_sizes", [100]), ("gpt", {"n_layer": 2, "n_head": 3, "n_embd": 64}),
                                        ("awq_grid", 1), ("matrices", ["nope"]), ("calib_tokens", 0)])
def test_bad_parameters_are_one_line_errors(key, value):
    with pytest.raises(ParamError) as exc:
        qq.EXERCISE.resolve_params(on_cpu=True, quick=False, overrides={key: value})
    assert "\n" not in str(exc.value) and f"--param {key}" in str(exc.value)
