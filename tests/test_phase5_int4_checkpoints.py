"""int4 checkpoint formats users bring (issue 31, "Formats users bring"): group sizes 32/64/128 and
per-channel, symmetric (GPTQ) and asymmetric (AWQ) quantization, and AutoAWQ's GEMM and GPTQ's
layouts converted at load. The packers here are the test's own, written from the formats' public
descriptions (a loop per nibble, as AutoAWQ's and AutoGPTQ's pack() describe them), independent of
the vectorised converters in engine/int4_checkpoints.py. A tiny Llama saved by transformers, its
projections packed in each layout, is served by the engine and gives the greedy tokens of the same
model with the dequantized weights (transformers' own forward). The Triton path runs in a child
pytest under TRITON_INTERPRET=1 (as test_phase5_quant.py does)."""
import json

import pytest
import torch
from conftest import HAS_TRITON, INTERPRETED, passes_under_the_interpreter

from common.errors import LabError
from phases.phase5_inference.engine import int4_checkpoints as ic
from phases.phase5_inference.engine import quantize as qz

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]       # AutoAWQ's order_map: nibble i holds column 8c + order[i]


def as_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def ints_of(qw: qz.Int4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [K, N], zeros [G, N], scales [G, N]) of an Int4Weight, in transformers' [in, out] orientation."""
    return qz.unpack_int4(qw.qweight, qw.in_features).t().to(torch.int64), qw.zeros.to(torch.int64), qw.scales


def pack_awq(qw: qz.Int4Weight) -> dict:
    """AutoAWQ GEMM: qweight [K, N/8] and qzeros [G, N/8] packed along N in AWQ's order."""
    q, zeros, scales = ints_of(qw)

    def pack(values):
        words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
        for col in range(words.shape[1]):
            for i in range(8):
                words[:, col] |= values[:, col * 8 + AWQ_PACK_ORDER[i]] << (4 * i)
        return as_int32(words)
    return {"qweight": pack(q), "qzeros": pack(zeros), "scales": scales.clone()}


def pack_gptq(qw: qz.Int4Weight, v1: bool = True, g_idx: torch.Tensor | None = None) -> dict:
    """GPTQ: qweight [K/8, N] packed along K, qzeros [G, N/8] along N (v1: zero − 1), g_idx [K]."""
    q, zeros, scales = ints_of(qw)
    k_in = q.shape[0]
    qweight = torch.zeros(k_in // 8, q.shape[1], dtype=torch.int64)
    for row in range(k_in // 8):
        for j in range(8):
            qweight[row] |= q[8 * row + j] << (4 * j)
    stored = (zeros - 1) & 0xF if v1 else zeros
    qzeros = torch.zeros(stored.shape[0], stored.shape[1] // 8, dtype=torch.int64)
    for col in range(qzeros.shape[1]):
        for j in range(8):
            qzeros[:, col] |= stored[:, 8 * col + j] << (4 * j)
    if g_idx is None:
        g_idx = torch.arange(k_in) // qw.group_size
    return {"qweight": as_int32(qweight), "qzeros": as_int32(qzeros), "scales": scales.clone(),
            "g_idx": g_idx.to(torch.int32)}


def reference_weight(n_out=48, k_in=256, group=64, symmetric=False, seed=0) -> qz.Int4Weight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, k_in, generator=g) * 0.05
    return qz.quantize_int4(w, group, scale_dtype=torch.float16, symmetric=symmetric)


def assert_same(a: qz.Int4Weight, b: qz.Int4Weight) -> None:
    assert (a.in_features, a.group_size) == (b.in_features, b.group_size)
    assert torch.equal(a.qweight, b.qweight) and torch.equal(a.zeros, b.zeros) and torch.equal(a.scales, b.scales)


def formula_dequantize(q, zeros, scales, group) -> torch.Tensor:
    """W [N, K] from the formats' formula W[n, k] = (q[k, n] − z[k // G, n]) · s[k // G, n]."""
    k = torch.arange(q.shape[0])
    return ((q - zeros[k // group]).double() * scales.double()[k // group]).t()


# ------------------------------------------------------------------------------ formats and the quantizer
@pytest.mark.parametrize("group", [32, 64, 128, 256])       # 256 == K: per-channel
def test_symmetric_and_per_channel_quantization_bounds(group):
    g = torch.Generator().manual_seed(group)
    w = torch.randn(40, 256, generator=g) * 0.05
    for symmetric in (False, True):
        qw = qz.quantize_int4(w, group, symmetric=symmetric)
        assert qw.scales.shape == (256 // group, 40)
        if symmetric:
            assert bool((qw.zeros == qz.SYMMETRIC_ZERO).all())
        step = qw.scales.float().t().repeat_interleave(group, dim=1)
        assert bool(((qw.dequantize() - w).abs() <= step / 2 + 1e-7).all()), (group, symmetric)


def test_per_channel_and_bad_group_sizes():
    w = torch.randn(8, 200)
    assert qz.quantize_int4(w, 200).scales.shape == (1, 8)          # per-channel: G = 1, K not a power of 2
    with pytest.raises(LabError, match="per-channel"):
        qz.quantize_int4(w, 48)


# ------------------------------------------------------------------------------ converters
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_awq_round_trip_and_formula(group, symmetric):
    qw = reference_weight(group=group, symmetric=symmetric)
    packed = pack_awq(qw)
    converted = ic.awq_to_int4(packed["qweight"], packed["qzeros"], packed["scales"], group)
    assert_same(converted, qw)
    q, zeros, scales = ints_of(qw)
    assert torch.equal(converted.dequantize(torch.float64), formula_dequantize(q, zeros, scales, group))


@pytest.mark.parametrize("group", [32, 64, 128, -1])
@pytest.mark.parametrize("v1", [True, False])
def test_gptq_round_trip_and_formula(group, v1):
    k_in = 256
    qw = reference_weight(k_in=k_in, group=k_in if group == -1 else group, symmetric=True)
    fmt = ic.Int4CheckpointFormat("gptq", group, per_channel=group == -1, zeros_minus_one=v1, symmetric=True)
    packed = pack_gptq(qw, v1=v1)
    converted = ic.gptq_to_int4(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], fmt)
    assert_same(converted, qw)
    q, zeros, scales = ints_of(qw)
    assert torch.equal(converted.dequantize(torch.float64), formula_dequantize(q, zeros, scales, qw.group_size))


def test_a_wrong_nibble_order_is_caught():
    """The round trip can fail: AWQ words packed in plain order, or GPTQ zeros without v1's − 1,
    convert to other weights."""
    qw = reference_weight(group=64)
    q, zeros, scales = ints_of(qw)
    plain = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for col in range(plain.shape[1]):
        for i in range(8):
            plain[:, col] |= q[:, col * 8 + i] << (4 * i)
    packed = pack_awq(qw)
    wrong = ic.awq_to_int4(as_int32(plain), packed["qzeros"], packed["scales"], 64)
    assert not torch.equal(wrong.qweight, qw.qweight)
    v2 = pack_gptq(qw, v1=False)
    read_as_v1 = ic.gptq_to_int4(v2["qweight"], v2["qzeros"], v2["scales"], v2["g_idx"],
                                 ic.Int4CheckpointFormat("gptq", 64, zeros_minus_one=True))
    assert not torch.equal(read_as_v1.zeros, qw.zeros)


def test_act_order_and_unrepresentable_zeros_are_refused():
    qw = reference_weight(group=64)
    fmt = ic.Int4CheckpointFormat("gptq", 64, zeros_minus_one=True)
    shuffled = (torch.arange(256) // 64)[torch.randperm(256, generator=torch.Generator().manual_seed(0))]
    packed = pack_gptq(qw, g_idx=shuffled)
    with pytest.raises(LabError, match="act-order"):
        ic.gptq_to_int4(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], fmt)
    zero_at_zero = qz.Int4Weight(qw.qweight, qw.scales, torch.zeros_like(qw.zeros), 256, 64)
    packed = pack_gptq(zero_at_zero, v1=True)              # v1 stores 0 − 1: nibble 15, a zero point of 16
    with pytest.raises(LabError, match="zero point of 16"):
        ic.gptq_to_int4(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], fmt)
    with pytest.raises(LabError, match="qzeros has shape"):
        ic.awq_to_int4(pack_awq(qw)["qweight"], torch.zeros(3, 6, dtype=torch.int32), qw.scales, 64)


AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True, "desc_act": False,
               "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True, "static_groups": False}


@pytest.mark.parametrize("base, changes, needle", [
    (AWQ_CONFIG, {"bits": 8}, "bits=8"),
    (AWQ_CONFIG, {"version": "gemv"}, "version='gemv'"),
    (AWQ_CONFIG, {"version": "exllama"}, "version='exllama'"),
    (AWQ_CONFIG, {"zero_point": False}, "zero_point=False"),
    (AWQ_CONFIG, {"modules_to_not_convert": ["mlp"]}, "modules_to_not_convert"),
    (AWQ_CONFIG, {"group_size": 0}, "group_size=0"),
    (GPTQ_CONFIG, {"checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    (GPTQ_CONFIG, {"is_marlin_format": True}, "is_marlin_format"),
    (GPTQ_CONFIG, {"bits": 3}, "bits=3"),
    (GPTQ_CONFIG, {"lm_head": True}, "lm_head"),
    (GPTQ_CONFIG, {"some_new_knob": 1}, "some_new_knob"),
    ({"quant_method": "fp8"}, {}, "quant_method='fp8'"),
])
def test_quantization_config_refused_by_name(base, changes, needle):
    with pytest.raises(LabError, match=__import__("re").escape(needle)):
        ic.parse_quantization_config({**base, **changes}, "m")


HUB_GPTQ_CONFIG = {      # as optimum / transformers write it for a Llama 3.1 GPTQ-INT4 folder
    "batch_size": 1, "bits": 4, "block_name_to_quantize": None, "cache_block_outputs": True, "damp_percent": 0.1,
    "dataset": None, "desc_act": False, "exllama_config": {"version": 1}, "group_size": 128, "max_input_length": None,
    "model_seqlen": None, "module_name_preceding_first_block": None, "modules_in_block_to_quantize": None,
    "pad_token_id": None, "quant_method": "gptq", "sym": True, "tokenizer": None, "true_sequential": True,
    "use_cuda_fp16": False, "use_exllama": True}


def test_quantization_config_read():
    assert ic.parse_quantization_config(HUB_GPTQ_CONFIG, "m").zeros_minus_one
    fmt = ic.parse_quantization_config(AWQ_CONFIG, "m")
    assert (fmt.method, fmt.group_size, fmt.zeros_minus_one) == ("awq", 64, False)
    fmt = ic.parse_quantization_config({**GPTQ_CONFIG, "group_size": -1, "checkpoint_format": "gptq_v2"}, "m")
    assert fmt.per_channel and not fmt.zeros_minus_one and fmt.group_for(200) == 200


# ------------------------------------------------------------------------------ the engine serving such a folder
transformers = pytest.importorskip("transformers")
BASE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=None,
            eos_token_id=None, pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
PROMPTS = [[(5 * i + 11 * j) % 512 for j in range(n)] for i, n in ((1, 4), (2, 19))]
STEPS = 8
PROJECTIONS = ic.PROJECTIONS


def write_int4_folder(folder, method: str, group: int, symmetric: bool, seed=0):
    """A tiny transformers Llama whose projections are int4 (group, symmetric or not), saved in
    `method`'s layout; returns transformers' model holding the dequantized weights (the reference)."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE)).eval()
    tensors = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            module = name[: -len(".weight")]
            if any(module.endswith(proj) for proj in PROJECTIONS):
                k_in = p.shape[1]
                qw = qz.quantize_int4(p.detach().float(), k_in if group == -1 else group, scale_dtype=torch.float16,
                                      symmetric=symmetric)
                p.copy_(qw.dequantize(torch.float32))
                packed = pack_awq(qw) if method == "awq" else pack_gptq(qw, v1=True)
                tensors.update({f"{module}.{part}": t for part, t in packed.items()})
            else:
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
                tensors[name] = p.detach().clone().contiguous()
    hf.config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = ({**AWQ_CONFIG, "group_size": group} if method == "awq"
                                     else {**GPTQ_CONFIG, "group_size": group, "sym": symmetric})
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return hf


def hf_greedy(hf, prompt) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(STEPS):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def engine_tokens(folder, path="naive", **config) -> list[list[int]]:
    from phases.phase5_inference.engine import EngineConfig, LLMEngine, SamplingParams
    eng = LLMEngine(EngineConfig(model=str(folder), dtype="float32", device="cpu", max_model_len=64,
                                 num_kv_blocks=32, cuda_graphs=False, quant_path=path, **config))
    return eng.generate(PROMPTS, SamplingParams(max_tokens=STEPS, ignore_eos=True))


CASES = [("awq", 32, False), ("awq", 64, False), ("gptq", 128, True), ("gptq", -1, True), ("gptq", 64, False)]


@pytest.mark.skipif(INTERPRETED, reason="the CPU paths run in the parent")
@pytest.mark.parametrize("method, group, symmetric", CASES)
def test_engine_serves_the_folder_with_the_dequantized_models_tokens(tmp_path, method, group, symmetric):
    hf = write_int4_folder(tmp_path, method, group, symmetric)
    expected = [hf_greedy(hf, p) for p in PROMPTS]
    assert engine_tokens(tmp_path, "naive") == expected
    if method == "awq" and group in qz.LIBRARY_INT4_GROUP_SIZES:
        from phases.phase5_inference.engine.model import QuantizationConfig
        weight = ic.load_int4_checkpoint(tmp_path, __import__(
            "phases.phase5_inference.engine.shapes", fromlist=["x"]).from_checkpoint(tmp_path),
            json.loads((tmp_path / "config.json").read_text())["quantization_config"], torch.float32)
        assert isinstance(weight["model.layers.0.mlp.down_proj.weight"], qz.Int4Weight)
        assert QuantizationConfig(4, prequantized=ic.parse_quantization_config(AWQ_CONFIG, "m")).label()


@pytest.mark.skipif(INTERPRETED, reason="the CLI runs in the parent")
def test_serve_refuses_conflicts_and_broken_int4_folders(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from phases.phase5_inference.engine.server import main as serve_main
    write_int4_folder(tmp_path, "awq", 64, False)

    def refused(*flags, needle):
        code = serve_main(["--model", str(tmp_path), "--device", "cpu", "--dtype", "float32", "--port", "0", *flags])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and needle in err, (code, err)

    refused("--quantization", "int8", "--quant-path", "naive", needle="conflicts")
    refused("--quantization", "int4", "--quant-group-size", "128", "--quant-path", "naive", needle="conflicts")
    refused("--quant-path", "fused", needle="quant_path 'fused'")           # the Triton path, on a CPU without Triton
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(128)
    save_file(tensors, str(path), metadata={"format": "pt"})
    refused("--quant-path", "naive", needle="q_proj.bias")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["version"] = "gemv"
    (tmp_path / "config.json").write_text(json.dumps(config))
    refused("--quant-path", "naive", needle="version='gemv'")


# ------------------------------------------------------------------------------ Triton, interpreted (child)
@pytest.mark.skipif(INTERPRETED, reason="this is the parent test")
@pytest.mark.skipif(not HAS_TRITON, reason="needs the Python package `triton`")
def test_fused_path_under_the_interpreter():
    passes_under_the_interpreter("tests/test_phase5_int4_checkpoints.py",
                                 allowed_skips=("parent test", "run in the parent", "runs in the parent"),
                                 timeout_s=600)


@pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter child")
@pytest.mark.parametrize("m, n, k", [(1, 24, 200), (3, 40, 256), (17, 16, 96)])
def test_w4a16_per_channel_matches_dequantize_then_matmul(m, n, k):
    from phases.phase5_inference.engine import quant_gemm as qg
    g = torch.Generator().manual_seed(k)
    w, x = torch.randn(n, k, generator=g) * 0.05, torch.randn(m, k, generator=g)
    for symmetric in (False, True):
        qw = qz.quantize_int4(w, k, symmetric=symmetric)
        out = qg.w4a16_matmul(x, qw.qweight, qw.scales, qw.zeros, k)
        ref = x @ qw.dequantize().t()
        assert (out - ref).abs().max() <= 1e-4 * ref.abs().max(), (m, n, k, symmetric)
    with pytest.raises(LabError, match="per-channel"):
        qg.w4a16_matmul(x, qw.qweight, qw.scales, qw.zeros, 48)


@pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter child")
@pytest.mark.parametrize("method, group, symmetric", [("awq", 32, False), ("gptq", -1, True)])
def test_engine_fused_path_gives_the_dequantized_models_tokens(tmp_path, method, group, symmetric):
    hf = write_int4_folder(tmp_path, method, group, symmetric)
    assert engine_tokens(tmp_path, "fused") == [hf_greedy(hf, p) for p in PROMPTS]


# ------------------------------------------------------------------------------ on a GPU (pytest -m gpu)
@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method, group, symmetric", [("awq", 128, False), ("gptq", -1, True)])
def test_gpu_fused_and_naive_serve_the_folder(tmp_path, method, group, symmetric):
    """The Triton kernels compiled on a GPU (fp32 activations: ieee dots) give the dequantized
    model's tokens, as the naive path does."""
    from phases.phase5_inference.engine import EngineConfig, LLMEngine, SamplingParams
    hf = write_int4_folder(tmp_path, method, group, symmetric)
    expected = [hf_greedy(hf, p) for p in PROMPTS]
    for path in ("fused", "naive"):
        eng = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", device="cuda", max_model_len=64,
                                     quant_path=path, num_kv_blocks=64))   # not sized by what earlier tests left
        assert eng.generate(PROMPTS, SamplingParams(max_tokens=STEPS, ignore_eos=True)) == expected, path
