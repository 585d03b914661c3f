"""phase5's own trained Llamas on a CPU (fp32, tiny shapes): LlamaForTraining's state dict is a Hugging
Face checkpoint's, the engine loading what save_checkpoint wrote generates what the training model
predicts, the logits match transformers', a few dozen steps lower the loss, and checkpoint()'s cache
(hit, incomplete folder, unknown name, no absolute path). The real models are far too big for this."""
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from common.errors import LabError
from common.paths import absolute_paths
from phases.phase5_inference.models import llama_training as lt
from phases.phase5_inference.models import trained_models as tm
from phases.phase5_inference.engine import SHAPES, EngineConfig, LlamaShape, LLMEngine, SamplingParams, hf_config, tensor_shapes
from phases.phase7_gpt import data as D


def tiny_shape(name="trained-tiny", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, inter=176,
               tied=True) -> LlamaShape:
    return LlamaShape(name=name, vocab_size=tm.VOCAB_SIZE, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=2048, rope_theta=10_000.0,
                      tie_word_embeddings=tied, eos_token_id=D.EOT)


@pytest.fixture(scope="module")
def shakespeare():
    try:
        train, val, _ = tm.corpus_ids("shakespeare")
    except LabError as exc:                     # Skip is a LabError: the data is not here
        pytest.skip(str(exc))
    return train, val


# ------------------------------------------------------------------------------ the model
@pytest.mark.parametrize("shape", [tiny_shape(), SHAPES["tiny"], SHAPES["tiny-tied"]], ids=lambda s: s.name)
def test_state_dict_is_a_hugging_face_checkpoint(shape):
    model = lt.LlamaForTraining(shape)
    sizes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert sizes == tensor_shapes(shape)
    assert ("lm_head.weight" in sizes) == (not shape.tie_word_embeddings)
    assert sum(p.numel() for p in model.parameters()) == shape.params()
    layers = shape.num_hidden_layers
    o = model.state_dict()["model.layers.0.self_attn.o_proj.weight"]
    q = model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert float(q.std()) == pytest.approx(lt.INIT_STD, rel=0.1)
    assert float(o.std()) == pytest.approx(lt.INIT_STD / (2 * layers) ** 0.5, rel=0.1)
    assert torch.equal(model.state_dict()["model.norm.weight"], torch.ones(shape.hidden_size))
    same = lt.LlamaForTraining(shape, seed=0).state_dict()
    assert all(torch.equal(v, same[k]) for k, v in model.state_dict().items())       # seeded


def greedy(model: lt.LlamaForTraining, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding the slow way: the whole prefix again for every token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([ids]))
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("shape", [SHAPES["tiny"], tiny_shape(tied=True)], ids=lambda s: s.name)
def test_engine_loads_the_saved_checkpoint_and_generates_the_same_tokens(shape, tmp_path):
    model = lt.LlamaForTraining(shape, seed=3).eval()
    folder = lt.save_checkpoint(model, shape, tmp_path / "ckpt", dtype=torch.float32, extra={"note": "test"})
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "train.json"]
    config = json.loads((folder / "config.json").read_text())
    assert config == {**hf_config(shape), "torch_dtype": "float32"}
    assert json.loads((folder / "train.json").read_text()) == {"note": "test"}
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", device="cpu", cuda_graphs=False))
    prompts = [[464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13] * 8, [50256, 1, 2]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out == greedy(model, prompt, 8)


def test_logits_match_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    for shape in (SHAPES["tiny"], tiny_shape(tied=True)):
        model = lt.LlamaForTraining(shape, seed=1).eval()
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(shape))).eval()
        missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
        idx = torch.randint(0, D.EOT, (2, 80), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ours, _ = model(idx)
            theirs = hf(idx).logits.float()
        assert ours.dtype == torch.float32 and ours.shape == (2, 80, shape.vocab_size)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_loss_is_the_mean_cross_entropy_of_the_logits():
    model = lt.LlamaForTraining(tiny_shape(), seed=0)
    g = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(0, D.EOT, (2, 16), generator=g), torch.randint(0, D.EOT, (2, 16), generator=g)
    logits, loss = model(idx, targets)
    ref = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
    assert torch.allclose(loss, ref)
    # a fresh model guesses almost uniformly (a tied head favours the input token itself, not a random target)
    assert abs(float(loss.detach()) - np.log(tm.VOCAB_SIZE)) < 0.1
    assert model(idx)[1] is None


# ------------------------------------------------------------------------------ training
def test_training_lowers_the_loss(shakespeare):
    train, val = shakespeare
    settings = lt.TrainSettings(steps=30, batch_size=8, seq_len=64, lr=3e-3, warmup_steps=5, eval_tokens=2048)
    seen = []
    model, info = lt.train_llama(tiny_shape(), train[:50_000], val, settings, "cpu",
                                 progress=lambda *a: seen.append(a))
    assert info["first_loss"] == pytest.approx(np.log(tm.VOCAB_SIZE), abs=0.2)
    assert info["last_loss"] < info["first_loss"] - 2.0, info           # well inside the drop seen across seeds
    assert info["val_loss"] < info["first_loss"] - 1.5, info
    assert info["steps"] == 30 and info["train_tokens"] == 30 * 8 * 64
    assert info["params"] == tiny_shape().params() and info["train_s"] > 0
    assert info["loss_curve"][0][0] == 0 and info["loss_curve"][-1][0] == 29 and len(info["loss_curve"]) <= 100
    assert [s for s, _, _ in seen] == [10, 20, 30] and all(total == 30 for _, total, _ in seen)
    assert not model.training
    json.dumps(info)


def test_distill_loss_is_the_kl_divergence():
    g = torch.Generator().manual_seed(1)
    teacher, student = torch.randn(2, 3, 11, generator=g), torch.randn(2, 3, 11, generator=g)
    p, log_p, log_q = teacher.softmax(-1), teacher.log_softmax(-1), student.log_softmax(-1)
    expected = (p * (log_p - log_q)).sum(-1).mean()
    assert float(lt.distill_loss(student, teacher)) == pytest.approx(float(expected), rel=1e-5)
    assert float(lt.distill_loss(teacher, teacher)) == pytest.approx(0.0, abs=1e-6)


def test_distillation_brings_the_student_closer_to_its_teacher(shakespeare):
    """A student taught the teacher's distribution ends nearer to it (KL, top-1 agreement) than the
    same student taught the text alone for the same steps."""
    train, val = shakespeare
    settings = lt.TrainSettings(steps=15, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2, eval_tokens=512)
    teacher, _ = lt.train_llama(tiny_shape(hidden=32, layers=1, heads=2, kv_heads=1, inter=64), train[:50_000], val,
                                replace(settings, steps=25), "cpu")
    student = tiny_shape(name="student", hidden=32, layers=1, heads=2, kv_heads=1, inter=64)
    plain, _ = lt.train_llama(student, train[:50_000], val, replace(settings, seed=1), "cpu")
    distilled, info = lt.train_llama(student, train[:50_000], val, replace(settings, seed=1, distill_weight=1.0),
                                     "cpu", teacher=teacher)
    x, _ = lt.Batches(train[:50_000], val, 32, torch.device("cpu"), 0).windows("val", 512)
    before = lt.compare_to_teacher(plain, teacher, x, 4)
    assert info["val_kl_to_teacher"] < before["val_kl_to_teacher"], (info, before)
    assert info["val_top1_agreement"] == pytest.approx(lt.compare_to_teacher(distilled, teacher, x, 4)["val_top1_agreement"])
    with pytest.raises(LabError, match="distill_weight"):
        lt.train_llama(student, train, val, replace(settings, distill_weight=1.5), "cpu", teacher=teacher)


def test_a_diverging_run_raises(shakespeare):
    train, val = shakespeare
    settings = lt.TrainSettings(steps=12, batch_size=2, seq_len=16, lr=1e30, grad_clip=0.0, eval_tokens=64)
    with pytest.raises(LabError, match="non-finite"):
        lt.train_llama(tiny_shape(hidden=32, layers=1, heads=2, kv_heads=1), train[:5000], val, settings, "cpu")


def test_settings_are_checked(shakespeare):
    train, val = shakespeare
    with pytest.raises(LabError, match="seq_len"):
        lt.train_llama(tiny_shape(), train, val, lt.TrainSettings(steps=1, batch_size=1, seq_len=4096, lr=1e-3), "cpu")
    with pytest.raises(LabError, match="steps"):
        lt.train_llama(tiny_shape(), train, val, lt.TrainSettings(steps=0, batch_size=1, seq_len=8, lr=1e-3), "cpu")


def test_downsample_keeps_first_and_last():
    curve = lt.downsample([float(i) for i in range(1000)])
    assert len(curve) == 100 and curve[0] == [0, 0.0] and curve[-1] == [999, 999.0]
    assert lt.downsample([1.0, 2.0]) == [[0, 1.0], [1, 2.0]] and lt.downsample([]) == []


# ------------------------------------------------------------------------------ the named models
def test_the_named_models():
    assert set(tm.MODELS) == {"shakespeare-target", "shakespeare-draft", "shakespeare-distilled", "python-draft",
                              "tiny-target", "tiny-draft", "tiny-distilled", "tiny-python-draft"}
    distilled = tm.MODELS["shakespeare-distilled"]
    assert distilled.teacher == "shakespeare-target" and distilled.settings.distill_weight == 1.0
    assert distilled.shape.params() == tm.MODELS["shakespeare-draft"].shape.params()
    assert tm.MODELS["tiny-distilled"].teacher == "tiny-target"
    target, draft, python = (tm.MODELS[n] for n in ("shakespeare-target", "shakespeare-draft", "python-draft"))
    assert 660e6 < target.shape.params() < 680e6 and 20e6 < draft.shape.params() < 25e6
    assert python.shape.params() == draft.shape.params() and python.corpus == "python"
    assert tm.MODELS["tiny-python-draft"].corpus == "python-small"
    for m in tm.MODELS.values():
        s = m.shape
        assert (s.vocab_size, s.eos_token_id, s.bos_token_id, s.tie_word_embeddings) == (50304, 50256, None, True)
        assert s.rope_scaling is None and s.rope_theta == 10_000.0 and s.max_position_embeddings == 2048
        assert s.name == m.name


def test_python_corpus(monkeypatch):
    monkeypatch.setattr(tm, "PYTHON_CORPUS_BYTES", 200_000)
    try:
        train, val, info = tm.corpus_ids("python")
    except LabError as exc:
        pytest.skip(str(exc))
    assert train.dtype == np.uint16 and len(train) > 0 and len(val) > 0
    assert info["bytes"] <= 200_000 and info["tokens"] == len(train) + len(val) and info["files"] >= 1
    assert "/" not in json.dumps(info) and len(info["sha256"]) == 64
    assert tm.corpus_ids("python")[2] == info                     # the same cut, cached
    with pytest.raises(LabError, match="known: shakespeare, python"):
        tm.corpus_ids("klingon")


# ------------------------------------------------------------------------------ checkpoint()
@pytest.fixture
def tiny_entry(monkeypatch, tmp_path):
    shape = tiny_shape(name="tiny-test", hidden=32, layers=1, heads=2, kv_heads=1, inter=64)
    settings = lt.TrainSettings(steps=3, batch_size=2, seq_len=32, lr=1e-3, warmup_steps=1, eval_tokens=256)
    monkeypatch.setitem(tm.MODELS, "tiny-test", tm.TrainedModel("tiny-test", shape, "shakespeare", settings, "test"))
    monkeypatch.setattr(tm, "CACHE_DIR", tmp_path / "cache")
    return shape


def test_checkpoint_trains_once_then_reads_the_cache(tiny_entry, shakespeare, tmp_path):
    folder, info = tm.checkpoint("tiny-test", "cpu")
    assert info["from_cache"] is False and "cache_error" not in info
    assert folder.parent == tmp_path / "cache" and folder.name == f"tiny-test-{info['cache_key']}"
    assert info["steps"] == 3 and info["params"] == tiny_entry.params() and info["corpus"]["name"] == "tinyshakespeare"
    text = json.dumps(info)
    assert str(tmp_path) not in text and not absolute_paths(text)

    again, hit = tm.checkpoint("tiny-test", "cpu")
    assert again == folder and hit["from_cache"] is True
    assert hit["val_loss"] == info["val_loss"] and hit["loss_curve"] == info["loss_curve"]
    assert str(tmp_path) not in json.dumps(hit)

    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", device="cpu", cuda_graphs=False))
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0]) == 4

    other, quick = tm.checkpoint("tiny-test", "cpu", steps=2)       # another run: another entry
    assert other != folder and quick["steps"] == 2 and quick["from_cache"] is False

    (folder / "train.json").unlink()                                # as an interrupted save leaves it
    _, redone = tm.checkpoint("tiny-test", "cpu")
    assert redone["from_cache"] is False and "train.json" in redone["cache_error"]
    assert (folder / "train.json").is_file()

    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    _, damaged = tm.checkpoint("tiny-test", "cpu")
    assert damaged["from_cache"] is False and damaged["cache_error"].startswith("unreadable")
    assert str(tmp_path) not in json.dumps(damaged)
    assert tm.checkpoint("tiny-test", "cpu")[1]["from_cache"] is True

    _, forced = tm.checkpoint("tiny-test", "cpu", use_cache=False)
    assert forced["from_cache"] is False


def test_checkpoint_refuses_unknown_names_and_bad_steps(tiny_entry):
    with pytest.raises(LabError, match="known: .*shakespeare-target.*tiny-test"):
        tm.checkpoint("gpt-5", "cpu")
    with pytest.raises(LabError, match="steps"):
        tm.checkpoint("tiny-test", "cpu", steps=0)


def test_cache_key_follows_every_input():
    shape, settings = tiny_shape(), lt.TrainSettings(steps=3, batch_size=2, seq_len=32, lr=1e-3)
    key = tm.cache_key(shape, settings, "abc", "cpu")
    assert len(key) == 12 and key == tm.cache_key(shape, settings, "abc", "cpu")
    assert len({key, tm.cache_key(replace(shape, hidden_size=48), settings, "abc", "cpu"),
                tm.cache_key(shape, replace(settings, steps=4), "abc", "cpu"),
                tm.cache_key(shape, settings, "abd", "cpu"), tm.cache_key(shape, settings, "abc", "cuda"),
                tm.cache_key(shape, settings, "abc", "cpu", teacher_key="t1")}) == 6


def test_a_student_gets_its_teacher_first_and_keys_on_it(tiny_entry, shakespeare, monkeypatch):
    student = tm.TrainedModel("tiny-student", replace(tiny_entry, name="tiny-student"), "shakespeare",
                              replace(tm.MODELS["tiny-test"].settings, distill_weight=1.0), "test", teacher="tiny-test")
    monkeypatch.setitem(tm.MODELS, "tiny-student", student)
    folder, info = tm.checkpoint("tiny-student", "cpu")
    teacher_folder, teacher_info = tm.checkpoint("tiny-test", "cpu")
    assert teacher_info["from_cache"] is True and info["teacher"] == "tiny-test"
    assert 0.0 <= info["val_top1_agreement"] <= 1.0 and info["val_kl_to_teacher"] > 0
    assert info["cache_key"] == tm.cache_key(student.shape, student.settings, info["corpus"]["sha256"], "cpu",
                                             teacher_info["cache_key"])
    loaded = tm.load_trained(folder, student.shape, "cpu")
    assert not loaded.training and sum(p.numel() for p in loaded.parameters()) == student.shape.params()


def test_load_trained_gives_back_the_saved_model(tmp_path):
    model = lt.LlamaForTraining(tm.TINY_TARGET, seed=3).eval()
    folder = lt.save_checkpoint(model, tm.TINY_TARGET, tmp_path / "ckpt", dtype=torch.float32)
    loaded = tm.load_trained(folder, tm.TINY_TARGET, "cpu")
    x = torch.randint(0, D.EOT, (2, 17), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(x)[0], loaded(x)[0]) and not loaded.training
