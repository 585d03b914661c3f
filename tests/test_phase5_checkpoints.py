"""Real checkpoint folders read right or refused (issue 32, item 1): tiny Llamas made and saved by
transformers' own LlamaForCausalLM, in both config forms (transformers 5's `rope_parameters` and the
older top-level `rope_theta` / `rope_scaling`), each supported variant's greedy tokens equal to
transformers'; every refused config key, and every broken folder, one line and exit 2 through
`lab serve --model DIR`. CPU, float32, seconds."""
import json
import subprocess
import sys

import pytest
import torch

from common.errors import LabError
from phases.phase5_inference.engine import EngineConfig, LLMEngine, SamplingParams, from_checkpoint, load_checkpoint
from phases.phase5_inference.engine.server import main as serve_main

transformers = pytest.importorskip("transformers")

VOCAB = 512
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)
VARIANTS = {
    "default-untied": dict(rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}),
    "linear-tied": dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10_000.0},
                        tie_word_embeddings=True),
    # original context (16) shorter than the prompts: the llama3 blend is exercised, not idle
    "llama3-head_dim": dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                             "rope_theta": 500_000.0}, head_dim=32),
}
PROMPTS = [[(7 * i + 3 * j) % VOCAB for j in range(n)] for i, n in ((1, 5), (2, 23), (3, 41))]
STEPS = 12


def save_llama(folder, seed: int = 0, **config):
    """A tiny random LlamaForCausalLM saved by transformers (safetensors + its config.json)."""
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**BASE, **config})).eval()
    with torch.no_grad():                      # norms away from 1, so a dropped or misread weight shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(folder)
    return hf


def to_legacy_form(folder) -> dict:
    """Rewrite config.json as transformers 4 wrote it: top-level rope_theta and rope_scaling."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    rope_type = params.pop("rope_type")
    config["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **params}
    path.write_text(json.dumps(config))
    return config


def edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def hf_greedy(hf, prompt, steps=STEPS) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def engine_for(folder) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), dtype="float32", device="cpu", max_model_len=128,
                                  num_kv_blocks=64, cuda_graphs=False))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{variant: (folder in transformers 5's form, folder in the legacy form, hf model)}."""
    out = {}
    for index, (variant, config) in enumerate(VARIANTS.items()):
        new = tmp_path_factory.mktemp(f"{variant}-new")
        hf = save_llama(new, seed=index, **config)
        legacy = tmp_path_factory.mktemp(f"{variant}-legacy")
        save_llama(legacy, seed=index, **config)
        to_legacy_form(legacy)
        out[variant] = (new, legacy, hf)
    return out


# ------------------------------------------------------------------------------ supported: tokens equal
@pytest.mark.parametrize("form", ["rope_parameters", "legacy"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_equal_transformers(saved, variant, form):
    new, legacy, hf = saved[variant]
    folder = new if form == "rope_parameters" else legacy
    if form == "rope_parameters":
        assert "rope_parameters" in json.loads((folder / "config.json").read_text())
    eng = engine_for(folder)
    ours = eng.generate(PROMPTS, SamplingParams(max_tokens=STEPS, ignore_eos=True))
    assert ours == [hf_greedy(hf, p) for p in PROMPTS]


def test_both_forms_read_to_the_same_shape(saved):
    for variant, (new, legacy, _) in saved.items():
        a, b = from_checkpoint(new), from_checkpoint(legacy)
        assert (a.rope_theta, a.rope_scaling, a.head_dim) == (b.rope_theta, b.rope_scaling, b.head_dim), variant
    shape = from_checkpoint(saved["llama3-head_dim"][0])
    assert shape.head_dim == 32 and shape.rope_theta == 500_000.0 and shape.rope_scaling["rope_type"] == "llama3"
    assert from_checkpoint(saved["linear-tied"][0]).tie_word_embeddings


def test_each_variant_changes_the_output(saved):
    """The matrix can fail: with its RoPE variant dropped, transformers' own model gives other logits
    on the long prompt (so reading the config's rope wrong would show as a mismatch above)."""
    for variant in ("linear-tied", "llama3-head_dim"):
        _, _, hf = saved[variant]
        plain_config = hf.config.to_dict()
        plain_config["rope_parameters"] = {"rope_type": "default", "rope_theta": hf.config.rope_parameters["rope_theta"]}
        plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**plain_config)).eval()
        plain.load_state_dict(hf.state_dict())
        with torch.no_grad():
            ids = torch.tensor([PROMPTS[2]])
            assert not torch.allclose(hf(ids).logits, plain(ids).logits, atol=1e-4), variant


# ------------------------------------------------------------------------------ refused: one line, exit 2
def serve_refuses(folder, capsys, *needles) -> str:
    """`lab serve --model DIR` (in process) exits 2 with one line naming the problem."""
    code = serve_main(["--model", str(folder), "--device", "cpu", "--dtype", "float32", "--port", "0"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


REFUSED_CONFIGS = {
    "yarn": (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "'yarn'"),
    "dynamic": (dict(rope_scaling={"type": "dynamic", "factor": 2.0}, rope_theta=1e4), "'dynamic'"),
    "longrope": (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "'longrope'"),
    "rope-extra-key": (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "beta_fast": 32,
                                             "rope_theta": 1e4}), "beta_fast"),
    "llama3-missing": (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}),
                       "high_freq_factor"),
    "forms-disagree": (dict(rope_theta=500.0), "disagree"),
    "mlp_bias": (dict(mlp_bias=True), "mlp_bias"),
    "attention_bias": (dict(attention_bias=True), "attention_bias"),
    "hidden_act": (dict(hidden_act="gelu"), "hidden_act"),
    "sliding_window": (dict(sliding_window=4096), "sliding_window"),
    "unknown-key": (dict(rope_interleaved=True), "rope_interleaved"),
    "architecture": (dict(architectures=["MistralForCausalLM"]), "MistralForCausalLM"),
    "model_type": (dict(model_type="qwen2"), "qwen2"),
    "layers-zero": (dict(num_hidden_layers=0), "num_hidden_layers"),
    "heads-split": (dict(num_key_value_heads=3), "num_key_value_heads"),
    "theta-not-a-number": (dict(rope_parameters={"rope_type": "default", "rope_theta": "big"}), "rope_theta"),
    "eps-negative": (dict(rms_norm_eps=-1.0), "rms_norm_eps"),
    "quant-method": (dict(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True}),
                     "bitsandbytes"),
}


@pytest.fixture(scope="module")
def plain_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plain")
    save_llama(folder, **VARIANTS["default-untied"])
    return folder


def copy_of(plain_folder, tmp_path):
    import shutil
    target = tmp_path / "model"
    shutil.copytree(plain_folder, target)
    return target


@pytest.mark.parametrize("case", list(REFUSED_CONFIGS))
def test_refused_config_keys(plain_folder, tmp_path, capsys, case):
    changes, needle = REFUSED_CONFIGS[case]
    folder = copy_of(plain_folder, tmp_path)
    edit_config(folder, **changes)
    with pytest.raises(LabError, match=needle.replace("'", ".")):
        load_checkpoint(folder, torch.float32)
    serve_refuses(folder, capsys, needle)


def test_config_lacking_a_field_or_not_json(plain_folder, tmp_path, capsys):
    folder = copy_of(plain_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["hidden_size"]
    (folder / "config.json").write_text(json.dumps(config))
    serve_refuses(folder, capsys, "lacks hidden_size")
    (folder / "config.json").write_text("{not json")
    serve_refuses(folder, capsys, "not valid JSON")
    (folder / "config.json").write_text("[1, 2]")
    serve_refuses(folder, capsys, "JSON object")


def test_corrupt_and_truncated_safetensors(plain_folder, tmp_path, capsys):
    folder = copy_of(plain_folder, tmp_path)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    serve_refuses(folder, capsys, "model.safetensors", "not a readable safetensors file")
    path.write_bytes(b"\xff" * 64)
    serve_refuses(folder, capsys, "not a readable safetensors file")
    path.unlink()
    serve_refuses(folder, capsys, "no *.safetensors")


def rewrite_tensors(folder, edit) -> None:
    from safetensors.torch import load_file, save_file
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_extra_and_misshapen_tensors(plain_folder, tmp_path, capsys):
    folder = copy_of(plain_folder, tmp_path)
    rewrite_tensors(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    serve_refuses(folder, capsys, "lacks", "model.layers.1.mlp.up_proj.weight")

    folder = copy_of(plain_folder, tmp_path / "b")
    rewrite_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    serve_refuses(folder, capsys, "model.layers.0.self_attn.q_proj.bias", "refused")

    folder = copy_of(plain_folder, tmp_path / "c")
    rewrite_tensors(folder, lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    serve_refuses(folder, capsys, "model.norm.weight", "(65,)")


def test_a_saved_rotary_buffer_is_accepted(plain_folder, tmp_path):
    """An older checkpoint's saved rotary inv_freq buffer is derived from config.json: dropped."""
    folder = copy_of(plain_folder, tmp_path)
    rewrite_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    weights = load_checkpoint(folder, torch.float32)
    assert not any("inv_freq" in name for name in weights)


def test_tied_checkpoint_with_a_saved_head(saved, tmp_path, capsys):
    """A tied checkpoint that also saves lm_head.weight: equal to the embedding, it loads (and the
    tokens equal transformers'); different, transformers 5 unties them where older releases tie
    them, so the engine refuses the folder by name rather than pick one."""
    import shutil
    folder = tmp_path / "tied"
    shutil.copytree(saved["linear-tied"][0], folder)
    rewrite_tensors(folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    hf = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    ours = engine_for(folder).generate(PROMPTS, SamplingParams(max_tokens=STEPS, ignore_eos=True))
    assert ours == [hf_greedy(hf, p) for p in PROMPTS]
    rewrite_tensors(folder, lambda t: t.update({"lm_head.weight": torch.randn(VOCAB, 64)}))
    capsys.readouterr()                                    # transformers' own loading bar
    serve_refuses(folder, capsys, "tie_word_embeddings", "lm_head.weight")


def test_cli_exit_code_is_2_end_to_end(plain_folder, tmp_path):
    """The real `lab serve` entry point in a fresh process: exit 2, one line, no traceback."""
    folder = copy_of(plain_folder, tmp_path)
    edit_config(folder, num_hidden_layers=0)
    proc = subprocess.run([sys.executable, "-m", "common.cli", "serve", "--model", str(folder), "--device", "cpu",
                           "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "num_hidden_layers" in lines[0], proc.stderr


def test_named_shapes_round_trip_through_their_hf_config():
    """hf_config (what vllm_serve and the trained models write) reads back to the same shape."""
    from dataclasses import replace

    from phases.phase5_inference.engine.shapes import SHAPES, from_hf_config, hf_config
    for name, shape in SHAPES.items():
        back = from_hf_config(hf_config(shape), name)
        assert back == shape and back.rope_scaling == shape.rope_scaling, name
        assert replace(back, name=name).to_dict() == shape.to_dict()
