"""Tensor-parallel decode on CPU processes over gloo (torchrun, phase 4's launcher): the same greedy
tokens as one process on 2 and 4 ranks (with KV heads copied when ranks outnumber them, after
preemptions, with rank 0 driving), each rank's shards and KV pool, the all-reduces exact at
irregular sizes, the exercise and the server end to end, the refusals, and the prediction's parts.

Every job has a timeout (phase 4's launcher kills ranks that outlive it), so a hung rank fails a test
instead of hanging the suite. Ranks are few and small: this runs on two cores.
"""
import os
import sys
from dataclasses import replace

import pytest
import torch
from conftest import assert_one_line_error, run_lab

from common.errors import LabError
from common.records import load_records
from phases.phase4_distributed.launch import launch
from phases.phase5_inference import tensor_parallel as ex
from phases.phase5_inference.engine import EngineConfig, LLMEngine, SamplingParams, named, random_weights
from phases.phase5_inference.engine import tp_ranks as tpm
from phases.phase5_inference.engine import tp_shards as tps
from phases.phase5_inference.benchmark.workload import random_prompts

WORKER = "phases.phase5_inference.benchmark.tp_worker"
H200_BYTES = 150_117_539_840             # an H200's total_memory as torch reports it (139.8 GiB)
PROMPTS = random_prompts(3, (5, 40), 50_000, 1)


def job(task: str, n: int, timeout_s: float = 240, **params) -> dict:
    return launch(task, n, "gloo", {"pg_timeout_s": 60, **params}, timeout_s, f"test {task} on {n} ranks",
                  extra_env={"OMP_NUM_THREADS": "1"}, module=WORKER)


def tp1_tokens(prompts, max_tokens: int, num_kv_blocks=None, sample_seed=None, temperature=0.0) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu", cuda_graphs=False, max_num_seqs=8,
                                    num_kv_blocks=num_kv_blocks))
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=sample_seed, ignore_eos=True)
    return engine.generate(prompts, params), engine


# ------------------------------------------------------------------------------ the same tokens as one process
@pytest.mark.parametrize("n, settings", [
    (2, {"num_kv_blocks": 6}),                                   # preemptions: the schedulers must agree
    (4, {}),                                                     # 2 KV heads over 4 ranks: each held twice
    (2, {"allreduce": "one-shot", "drive": "rank0"}),            # the one-shot algorithm; rank 0 drives
], ids=["2-ranks-preempting", "4-ranks-kv-copies", "2-ranks-one-shot-rank0-drives"])
def test_greedy_tokens_are_those_of_one_process(n, settings):
    reference, engine = tp1_tokens(PROMPTS, 12, settings.get("num_kv_blocks"))
    res = job("generate", n, model="tiny", seed=0, dtype="float32", prompts=PROMPTS, max_tokens=12, **settings)
    ranks = res["ranks"]
    assert len(ranks) == n
    for r in ranks if settings.get("drive") != "rank0" else ranks[:1]:
        assert r["tokens"] == reference
    assert len({r["num_kv_blocks"] for r in ranks}) == 1              # one pool size on every rank
    if "num_kv_blocks" in settings:
        assert ranks[0]["preemptions"] == engine.num_preemptions > 0
    else:                                                            # the CPU pool's bytes hold more blocks of fewer heads
        assert ranks[0]["num_kv_blocks"] == engine.runner.num_kv_blocks * 2
    if settings.get("allreduce") == "one-shot":
        assert ranks[0]["telemetry"]["one_shot_available"] is True


def test_sampled_tokens_with_a_seed_are_those_of_one_process():
    prompts = PROMPTS[:2]
    reference, _ = tp1_tokens(prompts, 10, sample_seed=7, temperature=0.8)
    res = job("generate", 2, model="tiny", seed=0, dtype="float32", prompts=prompts, max_tokens=10,
              temperature=0.8, sample_seed=7, full_weights=True)
    assert all(r["tokens"] == reference for r in res["ranks"])


# ------------------------------------------------------------------------------ what each rank holds
@pytest.mark.parametrize("model, tp", [("tiny", 2), ("tiny", 4), ("tiny-tied", 2), ("tiny-odd-vocab", 2)])
def test_each_rank_holds_its_slice_and_the_slices_rebuild_the_weights(model, tp):
    shape = replace(named("tiny"), name=model, vocab_size=50_301) if model == "tiny-odd-vocab" else named(model)
    full = random_weights(shape, 0, torch.float32)
    shards = [tps.shard(full.items(), shape, r, tp, torch.float32, "cpu") for r in range(tp)]
    d, kv = shape.head_dim, shape.num_key_value_heads
    p = "model.layers.1."
    for name in ("q_proj", "gate_proj", "up_proj"):
        key = p + ("self_attn." if name == "q_proj" else "mlp.") + name + ".weight"
        assert torch.equal(torch.cat([s[key] for s in shards]), full[key]), key
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        key = p + name + ".weight"
        assert torch.equal(torch.cat([s[key] for s in shards], dim=1), full[key]), key
    for r, s in enumerate(shards):
        first, count = tps.kv_heads_held(shape, tp, r)
        for name in ("k_proj", "v_proj"):
            key = p + f"self_attn.{name}.weight"
            assert torch.equal(s[key], full[key][first * d:(first + count) * d])
        if kv < tp:                                          # ranks sharing a KV head hold the same one
            assert count == 1 and first == r * kv // tp
        for key in ("model.embed_tokens.weight", p + "input_layernorm.weight", "model.norm.weight"):
            assert torch.equal(s[key], full[key])            # whole on every rank
        assert {k: tuple(v.shape) for k, v in s.items()} == tps.shard_shapes(shape, tp)
        assert sum(t.numel() for t in s.values()) * 2 == tps.rank_weight_bytes(shape, tp)
    head = torch.cat([s["lm_head.weight"] for s in shards])
    whole = full["model.embed_tokens.weight" if shape.tie_word_embeddings else "lm_head.weight"]
    assert torch.equal(head[:shape.vocab_size], whole) and not head[shape.vocab_size:].any()   # zero padding


def test_the_runner_holds_local_heads_and_a_pool_of_their_kv():
    res = job("generate", 2, model="tiny", seed=0, dtype="float32", prompts=PROMPTS[:1], max_tokens=2)
    shape, local = named("tiny"), tps.local_shape(named("tiny"), 2)
    for r in res["ranks"]:
        s = r["shards"]
        assert s["qkv"][0] == [local.q_size + 2 * local.kv_size, shape.hidden_size]
        assert s["o"][0] == [shape.hidden_size, local.q_size]
        assert s["gate_up"][0] == [2 * local.intermediate_size, shape.hidden_size]
        assert s["down"][0] == [shape.hidden_size, local.intermediate_size]
        assert s["lm_head"][0] == [tps.vocab_rows(shape, 2), shape.hidden_size]
        assert s["embed"][0] == [shape.vocab_size, shape.hidden_size]
        assert s["kv_cache"][0][4:] == [local.num_key_value_heads, shape.head_dim]
    assert res["ranks"][0]["shards"]["qkv"][1] != res["ranks"][1]["shards"]["qkv"][1]   # different slices


# ------------------------------------------------------------------------------ the all-reduce
def test_every_all_reduce_is_exact_and_the_same_on_every_rank_at_irregular_sizes():
    res = job("allreduce", 4, modes=["nccl", "one-shot"], numels=[1, 7, 4097, 100_003])
    for mode in ("nccl", "one-shot"):
        per_rank = res[mode]
        for i in range(4):
            rows = [rank[i] for rank in per_rank]
            assert all(r["wrong"] == 0 for r in rows), (mode, rows)
            assert len({r["checksum"] for r in rows}) == 1, (mode, rows)
            assert all(r["one_shot"] == (mode == "one-shot") for r in rows)


def test_the_one_shot_emulation_adds_in_rank_order():
    """What every rank computes in the one-shot: the same sum, in rank order, whoever computes it."""
    parts = [tpm.pattern(1000, r, torch.float32, "cpu") * 0.1 for r in range(4)]
    in_order = parts[0].clone()
    for p in parts[1:]:
        in_order += p
    assert torch.equal(in_order, ((parts[0] + parts[1]) + parts[2]) + parts[3])


def test_a_rank_that_hangs_fails_the_job_at_its_timeout(monkeypatch):
    monkeypatch.setenv("LAB_PHASE4_FAULT", "hang:1")
    with pytest.raises(LabError, match="no result after"):
        job("generate", 2, timeout_s=20, model="tiny", seed=0, dtype="float32", prompts=PROMPTS[:1], max_tokens=2)


# ------------------------------------------------------------------------------ the exercise
def test_the_exercise_runs_on_cpu_processes_end_to_end(tmp_path):
    proc = run_lab("run", "phase5.tensor_parallel", "--device", "cpu", "--results", tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [rec] = load_records(tmp_path)
    assert rec["status"] == "ok" and rec["summary"]["backend"] == "gloo"
    by_tp = {r["params"]["tp"]: r for r in rec["rows"] if r["variant"] == "engine"}
    assert set(by_tp) == {1, 2}
    for tp, r in by_tp.items():
        assert r["status"] == "ok" and r["check"]["passed"], r["reason"]
        assert r["check"]["max_logit_gap"] < 1e-4 and r["check"]["logits_rel_l2"] < 1e-4    # fp32: the same logits
        m = r["metrics"]
        assert m["decode_tok_s"] > 0 and m["ttft_ms"] > 0 and m["kv_capacity_tokens"] > 0
        assert r["prediction"]["predicted_ms"] > 0 and r["prediction"]["measured_over_predicted"] > 0
        assert m["x_tp1_tok_s"] > 0
    two = by_tp[2]
    assert 0 <= two["metrics"]["allreduce_share"] <= 1 and two["metrics"]["allreduce_each_ms"] > 0
    assert two["prediction"]["allreduce_ms"] > 0 and two["prediction"]["allreduces_per_step"] == 2 * 2
    assert "this run" in two["prediction"]["allreduce_model"]["source"]      # no phase 4 fit for CPU processes
    assert by_tp[1]["metrics"]["kv_capacity_tokens"] * 2 == two["metrics"]["kv_capacity_tokens"]


def test_a_tp_size_the_heads_do_not_divide_ends_lab_run_in_one_line(tmp_path):
    proc = run_lab("run", "phase5.tensor_parallel", "--device", "cpu", "--param", "tp_sizes=[3]",
                   "--results", tmp_path, timeout=120)
    assert proc.returncode == 2
    assert_one_line_error(proc.returncode, proc.stderr, tmp_path)
    assert "do not split evenly over 3 ranks" in proc.stderr


# ------------------------------------------------------------------------------ where each shape fits
def test_the_70b_shape_needs_two_h200s_for_a_usable_pool_and_one_gpu_runs_tp1_alone():
    params = ex.EXERCISE.resolve_params(False, False, {})
    shape = named("llama-3.3-70b")
    assert ex.kv_pool_tokens(shape, 1, H200_BYTES, 0.90, 1, 8192, 16) < params["min_kv_tokens"]
    assert ex.kv_pool_tokens(shape, 2, H200_BYTES, 0.90, 1, 8192, 16) > 100_000
    one = ex.plan(params, 1, H200_BYTES)
    assert one["jobs"] == {1: ["llama-3.1-8b"]}
    assert one["cells"]["llama-3.1-8b", 2]["why"] == "TP=2 needs 2 GPUs; this machine has 1"
    assert "does not fit usably at TP=1" in one["cells"]["llama-3.3-70b", 1]["why"]
    four = ex.plan(params, 4, H200_BYTES)
    assert four["jobs"] == {1: ["llama-3.1-8b", "llama-3.3-70b"], 2: ["llama-3.1-8b", "llama-3.3-70b"],
                            4: ["llama-3.1-8b", "llama-3.3-70b"]}
    assert four["reference"] == {"llama-3.1-8b": 1, "llama-3.3-70b": 1}       # 70B at TP=1: the check's reference only
    assert not four["cells"]["llama-3.3-70b", 1]["run"] and four["cells"]["llama-3.3-70b", 2]["run"]
    small = ex.plan(params, 4, 80 * 2**30)                                    # an 80 GiB GPU: no TP=1 reference
    runs = [tp for tp in (1, 2, 4) if small["cells"]["llama-3.3-70b", tp]["run"]]
    assert small["reference"]["llama-3.3-70b"] == runs[0] > 1
    assert [tp for tp, models in small["jobs"].items() if "llama-3.3-70b" in models] == runs


def test_the_prediction_adds_two_all_reduces_per_layer_from_phase4s_fit(spec_ctx):
    from common.paths import REPO_ROOT
    recs = load_records(REPO_ROOT / "results", exercise="phase4.interconnect", hardware="h200_sxm")
    fit = ex.interconnect_fit(recs, "h200_sxm", 2)
    if fit is None:
        pytest.skip("no committed phase4.interconnect record on 2 H200s")
    assert fit["alpha_sizes_bytes"] == [2**15, 2**16, 2**17] and fit["record"].startswith("results/phase4/")
    shape = named("llama-3.1-8b")
    each = ex.allreduce_ms(fit, shape.hidden_size * 2, 2)
    assert fit["alpha_us"] / 1e3 <= each < fit["alpha_us"] / 1e3 * 1.01            # latency-bound at 8 KiB
    p1 = ex.tp_prediction(spec_ctx(), shape, 1, 150, 5.0, "bf16", 0.0, None, None)
    p2 = ex.tp_prediction(spec_ctx(), shape, 2, 150, 5.0, "bf16", each, fit, None)
    assert p1["allreduce_ms"] == 0 and p2["allreduce_ms"] == pytest.approx(64 * each)
    assert p2["predicted_ms"] - p2["allreduce_ms"] == pytest.approx(
        p1["predicted_ms"] * tps.rank_decode_weight_bytes(shape, 2) / shape.decode_weight_bytes(), rel=0.02)


def test_the_check_passes_the_same_logits_and_fails_another_models():
    ref = {"fingerprint": [[0.1 * i + j for j in range(8)] for i in range(4)], "gaps": [0.0] * 4, "logit_std": 1.0,
           "argmax": [1, 2, 3, 4], "reference_tokens": [1, 2, 3, 4]}
    same = {"check": dict(ref), "tokens": [1, 2, 3, 4]}
    assert ex.tp_check({"check": ref}, same, "ref")["passed"]
    far = {"check": {**ref, "gaps": [2.0] * 4}, "tokens": [9, 9, 9, 9]}
    assert "scores" in ex.tp_check({"check": ref}, far, "ref")["reason"]
    shuffled = {"check": {**ref, "fingerprint": [list(reversed(r)) for r in ref["fingerprint"]]}, "tokens": []}
    assert "relative L2" in ex.tp_check({"check": ref}, shuffled, "ref")["reason"]


# ------------------------------------------------------------------------------ refusals
def test_tensor_parallel_without_torchrun_or_with_what_it_cannot_split_is_refused_in_one_line():
    with pytest.raises(LabError, match="needs 2 processes started by torchrun"):
        LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu", tensor_parallel=2))
    with pytest.raises(LabError, match="do not split evenly over 3"):
        LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu", tensor_parallel=3))
    for bad, says in (({"quantization": "int8"}, "quantization"), ({"speculative_model": "ngram",
                                                                       "num_speculative_tokens": 2}, "speculative"),
                      ({"allreduce": "ring"}, "allreduce"), ({"tensor_parallel": 0}, "positive integer")):
        with pytest.raises(LabError, match=says):
            EngineConfig(model="tiny", **{"tensor_parallel": 2, **bad}).check()
    assert tps.unsplittable(named("llama-3.1-8b"), 16) is None                    # 8 KV heads, each held twice
    assert "KV heads" in tps.unsplittable(named("tiny").__class__(**{**named("tiny").to_dict(),
                                                                       "num_key_value_heads": 3,
                                                                       "num_attention_heads": 6}), 2)


def test_lab_serve_refuses_a_split_it_cannot_make_in_one_line():
    proc = run_lab("serve", "--model", "tiny", "--device", "cpu", "--tensor-parallel", "3", "--port", "0", timeout=120)
    assert proc.returncode == 2 and "do not split evenly over 3 ranks" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_lab_serve_refuses_more_ranks_than_gpus(monkeypatch, capsys):
    from phases.phase5_inference.engine import server
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("RANK", raising=False)
    assert server.main(["--model", "llama-3.1-8b", "--device", "cuda", "--tensor-parallel", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "lab serve: --tensor-parallel 8 needs 8 GPUs; this machine has 4"


# ------------------------------------------------------------------------------ the server in front of rank 0
def test_the_server_over_two_ranks_answers_as_one_process_does():
    import json
    import urllib.request

    from phases.phase5_inference.benchmark import client
    reference, _ = tp1_tokens([PROMPTS[0]], 9)
    with client.launch_server({"model": "tiny", "dtype": "float32", "device": "cpu", "tensor_parallel": 2},
                              ready_timeout_s=180) as server:
        body = {"prompt": PROMPTS[0], "max_tokens": 9, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        request = urllib.request.Request(server.base_url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            tokens = json.load(response)["choices"][0]["token_ids"]
        result = client.benchmark(server.base_url, [client.RequestSpec(PROMPTS[1], 6)] * 3, max_concurrency=2,
                                  ignore_eos=True)
    assert tokens == reference[0]
    assert result.completed == 3 and result.failed == 0
    assert server.process.returncode == 0                    # every rank left cleanly on Ctrl-C


# ------------------------------------------------------------------------------ on GPUs (pytest -m gpu)
def _need_gpus(n: int):
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs")


@pytest.mark.gpu
def test_all_reduces_exact_on_two_gpus():
    _need_gpus(2)
    res = launch("allreduce", 2, "nccl", {"pg_timeout_s": 120, "modes": ["nccl", "auto"], "dtype": "bfloat16",
                                          "numels": [8, 4096, 8192, 1_048_576]}, 600, "gpu all-reduce",
                 extra_env=tpm.NO_MULTICAST_ENV, module=WORKER)
    for mode in ("nccl", "auto"):
        assert all(r["wrong"] == 0 for rank in res[mode] for r in rank), mode


@pytest.mark.gpu
def test_quick_exercise_on_two_gpus(tmp_path):
    _need_gpus(2)
    proc = run_lab("run", "phase5.tensor_parallel", "--quick", "--param", "models=[llama-3.2-1b]",
                   "--param", "tp_sizes=[1,2]", "--results", tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [rec] = load_records(tmp_path)
    engine = [r for r in rec["rows"] if r["variant"] == "engine"]
    assert [r["status"] for r in engine] == ["ok", "ok"], [r["reason"] for r in engine]
    assert any(r["variant"] == "allreduce_nccl" for r in rec["rows"])


if __name__ == "__main__":
    sys.exit(pytest.main([os.path.abspath(__file__), "-q"]))
