"""lm-evaluation-harness's `local-completions` model against the lab's server on the tiny shape
(CPU, fp32; skipped where lm-eval[api] is not installed): a loglikelihood task and a generate_until
task with stop strings run to the end, the loglikelihoods equal transformers' with the same weights,
and each generation equals transformers' greedy text cut at the first stop string."""
import json

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")                   # lm-eval[api]
transformers = pytest.importorskip("transformers")

from phases.phase5_inference.engine import EngineConfig, LLMEngine, hf_config, load_tokenizer, named, random_weights  # noqa: E402
from phases.phase5_inference.engine.server import ServerThread  # noqa: E402

LOGLIKELIHOOD_ATOL = 1e-4         # a sum of fp32 log-probabilities over a few tokens
UNTIL = ["e", "an", "\n"]
DOCS = [{"question": "The quick brown fox", "choices": [" jumps", " sleeps", " runs"], "answer": 0},
        {"question": "One, two, three,", "choices": [" four", " five"], "answer": 0},
        {"question": "Paris is the capital of", "choices": [" France", " Spain", " Italy"], "answer": 0}]


def task_files(folder) -> None:
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps({**d, "target": d["choices"][0].strip()}) + "\n" for d in DOCS))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
              "doc_to_text: \"{{question}}\"\n")
    (folder / "lab_ll.yaml").write_text("task: lab_ll\noutput_type: multiple_choice\n" + common +
                                        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
                                        "metric_list:\n  - metric: acc\n")
    (folder / "lab_gen.yaml").write_text("task: lab_gen\noutput_type: generate_until\n" + common +
                                         "doc_to_target: \"{{target}}\"\ngeneration_kwargs:\n"
                                         f"  until: {json.dumps(UNTIL)}\n  max_gen_toks: 24\n  do_sample: false\n"
                                         "metric_list:\n  - metric: exact_match\n    aggregation: mean\n"
                                         "    higher_is_better: true\n")


def test_lm_eval_local_completions_matches_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    weights = random_weights(named("tiny"), seed=0, dtype=torch.float32)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(named("tiny")))).eval()
    hf.load_state_dict(weights, strict=False)
    ours = load_tokenizer()
    tokenizer_folder = tmp_path / "tokenizer"
    tokenizer_folder.mkdir()
    ours.backend.save(str(tokenizer_folder / "tokenizer.json"))
    (tokenizer_folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "model_max_length": 256}))
    task_files(tmp_path)
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu", max_model_len=256),
                       weights={k: v.clone() for k, v in weights.items()})
    with ServerThread(engine, ours, "tiny") as server:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"model": "tiny", "base_url": server.base_url + "/v1/completions", "num_concurrent": 1,
                        "max_retries": 1, "tokenizer_backend": "huggingface", "tokenizer": str(tokenizer_folder)},
            tasks=["lab_ll", "lab_gen"], task_manager=lm_eval.tasks.TaskManager(include_path=str(tmp_path)),
            log_samples=True)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_folder))
    loglikelihoods = 0
    for sample in results["samples"]["lab_ll"]:
        for argument, response in zip(sample["arguments"], sample["resps"]):
            context, continuation = argument
            whole, prefix = hf_tokenizer.encode(context + continuation), hf_tokenizer.encode(context)
            with torch.no_grad():
                logprobs = hf(torch.tensor([whole])).logits[0].log_softmax(-1)
            reference = sum(float(logprobs[i - 1, whole[i]]) for i in range(len(prefix), len(whole)))
            assert float(response[0][0]) == pytest.approx(reference, abs=LOGLIKELIHOOD_ATOL)
            loglikelihoods += 1
    assert loglikelihoods == sum(len(d["choices"]) for d in DOCS)
    generations = results["samples"]["lab_gen"]
    assert len(generations) == len(DOCS)
    for sample in generations:
        context = sample["arguments"][0][0]
        ids = hf_tokenizer(context, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
        text = hf_tokenizer.decode(out[0, ids.shape[1]:])
        cut = min([text.find(stop) for stop in UNTIL if stop in text] + [len(text)])
        assert sample["resps"][0][0] == text[:cut]
