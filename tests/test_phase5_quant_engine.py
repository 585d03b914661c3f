"""The engine with weight-only quantized projections, on a CPU: greedy tokens with int8 (and int4)
weights equal those of the same engine given the dequantized weights as plain tensors, the
weights' bytes shrink as the formats say, and bad settings are refused before any work.
The fused path's kernels are checked under the interpreter in test_phase5_quant.py."""
import pytest
import torch

from common.errors import LabError
from phases.phase5_inference.predictions import quant_analysis as qa
from phases.phase5_inference.engine import EngineConfig, LLMEngine, SamplingParams, named, random_weights
from phases.phase5_inference.engine import quantize as qz

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PROMPTS = [[(17 * i + 5) % 50000 for i in range(n)] for n in (7, 40, 91)]


@pytest.fixture(scope="module")
def weights():
    return random_weights(named("tiny"), seed=0, dtype=torch.float32)


def dequantized(weights: dict, bits: int, group_size: int = 128) -> dict:
    """The same weights with every projection replaced by quantize-then-dequantize of itself.
    Quantizing fused qkv (or gate_up) equals quantizing its parts: scales are per output row."""
    out = dict(weights)
    for name, w in weights.items():
        if any(f"{p}.weight" in name for p in PROJECTIONS):
            out[name] = qz.quantize(w, bits, group_size).dequantize(torch.float32)
    return out


def engine(weights, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu", **config), weights=weights)


@pytest.mark.parametrize("bits", [8, 4])
def test_greedy_tokens_match_dequantized_weight_inference(weights, bits):
    quantized = engine(weights, quantization=f"int{bits}", quant_path="naive")
    reference = engine(dequantized(weights, bits))
    ours = quantized.generate(PROMPTS, GREEDY)
    assert ours == reference.generate(PROMPTS, GREEDY)
    assert ours != engine(weights).generate(PROMPTS, GREEDY)       # quantization changed something
    assert quantized.telemetry["quantization"].startswith(f"int{bits}")


def test_weight_bytes_shrink_as_the_formats_say(weights):
    shape = named("tiny")
    sizes = {q: engine(weights, quantization=q, quant_path="naive").telemetry["weights_bytes"]
             for q in ("none", "int8", "int4")}
    projections = [(shape.q_size + 2 * shape.kv_size, shape.hidden_size), (shape.hidden_size, shape.q_size),
                   (2 * shape.intermediate_size, shape.hidden_size), (shape.hidden_size, shape.intermediate_size)]
    for q, fmt in (("int8", "int8"), ("int4", "int4")):
        # fp32 model: scales are fp32 (4 bytes), the analysis counts bf16 scales (2 bytes)
        packed = sum(qa.weight_bytes(fmt, n, k) for n, k in projections) * shape.num_hidden_layers
        scale_rows = sum(n * (1 if fmt == "int8" else -(-k // 128)) for n, k in projections) * shape.num_hidden_layers
        dense = sum(4 * n * k for n, k in projections) * shape.num_hidden_layers
        assert sizes[q] == sizes["none"] - dense + packed + 2 * scale_rows


@pytest.mark.parametrize("settings, message", [
    ({"quantization": "int3"}, "quantization 'int3'"),
    ({"quantization": "int4", "quant_path": "fast"}, "quant_path 'fast'"),
    ({"quantization": "int4", "quant_group_size": 100}, "quant_group_size"),
])
def test_bad_quantization_settings_are_refused(weights, settings, message):
    with pytest.raises(LabError, match=message):
        engine(weights, **settings)


def test_library_path_refuses_what_tinygemm_cannot_take(weights):
    with pytest.raises(LabError, match="bf16 activations"):        # fp32 engine, int4 library
        engine(weights, quantization="int4", quant_path="library")


def test_fused_path_on_a_cpu_is_refused_before_loading(weights, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(LabError, match="needs a CUDA GPU"):
        engine(weights, quantization="int8", quant_path="fused")     # auto would pick naive here


def test_exercise_runs_end_to_end_on_a_cpu(spec_ctx, monkeypatch):
    """fp32 on a CPU: the baseline and the naive path run; the fused path (no GPU, no interpreter)
    and tinygemm's int4 (bf16 only) are skipped with their reasons."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from phases.phase5_inference import quant_engine as ex
    params = ex.EXERCISE.resolve_params(on_cpu=True, quick=False, overrides={})
    res = ex.run(spec_ctx(), params)
    status = {(r["variant"], r["params"]["batch"]): r["status"] for r in res.rows}
    assert status == {(v, b): ("ok" if v in ("bf16", "int4_naive") else "skipped") for v in ex.VARIANTS for b in (1, 3)}
    ok = [r for r in res.rows if r["status"] == "ok"]
    for r in ok:
        assert r["check"]["passed"] and r["prediction"]["predicted_ms"] > 0
        assert r["metrics"]["bytes_per_step"] == r["prediction"]["bytes"]
    by = {(r["variant"], r["params"]["batch"]): r["metrics"] for r in ok}
    assert by[("int4_naive", 1)]["weights_gib"] < by[("bf16", 1)]["weights_gib"]
    assert by[("int4_naive", 1)]["speedup_vs_bf16"] > 0
    reasons = {r["variant"]: r["reason"] for r in res.rows if r["status"] == "skipped"}
    assert "CUDA GPU" in reasons["int4_fused"] and "bf16 activations" in reasons["int4_library"]
