"""The kernel lists of phases 3, 5 and 7 (kernel_lists.py) and the summed accuracy's row path, by hand."""
from dataclasses import replace

import pytest

from common import workload as wl
from common import workload_rows as acc
from common.workload import GRAPH, MATMUL, TORCH, TRITON
from phases.phase3_triton import kernel_lists as p3
from phases.phase5_inference.predictions import kernel_lists as p5
from phases.phase5_inference.engine.shapes import named
from phases.phase7_gpt import kernel_lists as p7
from phases.phase7_gpt.cost import GPTConfig, step_kernels

CEILINGS = {"hbm_gbps": 1000.0, "l2_gbps": 2000.0, "matmul_tflops": {"bf16": 100.0, "fp32": 10.0, "tf32": 50.0},
            "launch_us": 5.0, "graph_launch_us": 1.0, "sync_us": 10.0, "exp_per_s": 1e12, "l2_fit_bytes": 1e6}


# ------------------------------------------------------------------------------ phase 3
def test_causal_attention_computes_the_diagonal_tiles_whole():
    assert p3.causal_fraction(256, False) == 1.0
    assert p3.causal_fraction(256, True) == pytest.approx(3 / 4)            # 2 tiles of 128: 3 of 4 computed
    assert p3.causal_fraction(1000, True) == pytest.approx(9 / 16)          # 8 tiles: 36 of 64


def test_flash_attention_is_two_products_plus_the_exponentials_in_one_kernel():
    w = p3.attention_forward("sdpa_cudnn", 1, 2, 256, 64, "bf16", True)
    (k,) = w.kernels
    assert (k.kind, k.launch, k.dtype, k.overlap) == (MATMUL, TORCH, "bf16", False)
    assert k.flops == pytest.approx(4 * 2 * 256**2 * 64 * 0.75)
    assert k.exps == pytest.approx(2 * 256**2 * 0.75)
    assert k.bytes == 4 * 2 * 256 * 64 * 2
    r, _ = wl.rates(CEILINGS)
    products, exps = k.flops / 100e12 * 1e3, k.exps / 1e12 * 1e3           # added: the same warps run both
    assert wl.kernel_ms(k, r)[0] == pytest.approx(0.005 + products + exps)
    assert p3.attention_forward("triton", 1, 2, 256, 64, "fp32", False).kernels[0].launch == TRITON


def test_naive_attention_is_four_kernels_and_backward_recomputes_the_exponentials():
    assert len(p3.attention_forward("naive", 1, 2, 64, 16, "fp16", False).kernels) == 4
    bwd = p3.attention_backward("sdpa_cudnn", 1, 2, 128, 64, "bf16", False)
    assert [k.name.split(" ")[0] for k in bwd.kernels] == ["delta", "attention", "dQ"]
    assert bwd.kernels[1].flops == pytest.approx(2.5 * 4 * 2 * 128**2 * 64) and bwd.kernels[1].exps == 2 * 128**2
    triton = p3.attention_backward("triton", 1, 2, 128, 64, "bf16", False)
    assert sum(k.exps for k in triton.kernels) == 2 * 2 * 128**2                     # P rebuilt in both kernels


def test_a_phase3_row_becomes_its_workload_and_a_bad_one_none():
    row = {"exercise": "phase3.softmax", "variant": "triton", "params.rows": 4, "params.cols": 100,
           "metrics.kernel": "softmax_split_kernel"}
    w = p3.row_workload(row)
    assert w.totals()["launches"] == 2 and w.totals()["exps"] == 400
    assert p3.row_workload({"exercise": "phase3.flash_attention", "variant": "naive", "params.batch": 1,
                            "params.heads": 1, "params.n": 64, "params.head_dim": 16, "params.dtype": "fp16",
                            "params.causal": True}) is None                 # naive is timed non-causal only


# ------------------------------------------------------------------------------ phase 5
def test_a_batch1_decode_step_is_six_graphed_kernels_a_layer_and_reads_every_weight_once():
    s = named("llama-3.1-8b")
    w = p5.decode_step(s, 1, 0)
    t = w.totals()
    assert t["launches"] == 6 * s.num_hidden_layers + 3
    assert all(k.launch == GRAPH for k in w.kernels)
    norms = (2 * s.num_hidden_layers + 1) * s.hidden_size * 2                   # norm weights: not in the GEMVs' count
    assert t["bytes"] == pytest.approx(s.decode_weight_bytes() - norms, rel=2e-3)
    assert t["flops"] == pytest.approx(s.flops_per_token(0), rel=1e-3)
    assert [h[1] for h in w.host] == ["launch_us", "launch_us", "sync_us"]


def test_a_batched_decode_step_splits_norms_and_silu_from_cublas_and_counts_exponentials():
    s = named("tiny")
    w = p5.decode_step(s, 4, 100.0)
    assert w.totals()["launches"] == 9 * s.num_hidden_layers + 4
    assert w.totals()["exps"] == 4 * s.num_attention_heads * 100 * s.num_hidden_layers
    int4 = p5.decode_step(s, 1, 100.0, weight_bytes=p5.int4_weight_bytes(128))
    assert int4.totals()["bytes"] < p5.decode_step(s, 1, 100.0).totals()["bytes"]
    assert int4.totals()["launches"] == 9 * s.num_hidden_layers + 3        # a quantized weight: its norm unfused
    # the CUDA int4 kernel stages the RMSNorm before QKV and gate_up at batch 1 (not the SiLU before down)
    cuda = p5.decode_step(s, 1, 100.0, weight_bytes=p5.int4_weight_bytes(128), norm_in_quant_kernel=True)
    assert cuda.totals()["launches"] == 7 * s.num_hidden_layers + 3
    names = {k.name for k in cuda.kernels}
    assert "QKV (+ RMSNorm)" in names and "SiLU(gate) * up before down" in names
    batched = p5.decode_step(s, 2, 100.0, weight_bytes=p5.int4_weight_bytes(128), norm_in_quant_kernel=True)
    assert "RMSNorm before QKV" in {k.name for k in batched.kernels}


def test_prefill_pads_to_its_graph_bucket_and_phase5_rows_map_to_steps():
    s = named("tiny")
    assert "(128 computed)" in p5.prefill(s, 100).name and "(600 computed)" in p5.prefill(s, 600).name
    row = {"exercise": "phase5.batching", "variant": "lab-engine", "params.model": "tiny", "params.concurrency": 8.0,
           "params.prompt_tokens": 100.0, "params.output_tokens": 200}
    assert p5.row_workload(row).name.startswith("tiny decode step, batch 8, 200 cached")
    assert p5.row_workload({**row, "params.model": "no-such-model"}) is None


# ------------------------------------------------------------------------------ phase 7
def test_a_training_step_counts_every_launch_and_the_logits_passes():
    cfg = GPTConfig(vocab_size=1000, block_size=64, n_layer=2, n_head=2, n_embd=32)
    w = p7.training_step(cfg, 4, "bf16")
    N, d, V, L = 4 * 64, 32, 1000, 2
    assert w.totals()["launches"] == step_kernels(cfg, N)["total"]
    matmul_flops = sum(k.flops * k.count for k in w.kernels if k.kind == MATMUL and "attention (" not in k.name)
    assert matmul_flops == pytest.approx(6 * N * (12 * d * d * L + d * V))       # 2 forward + 4 backward per weight
    by_name = {k.name: k for k in w.kernels}
    assert by_name["logits to fp32"].bytes == N * V * (2 + 4)
    assert by_name["log-softmax over the vocabulary"].exps == N * V
    # PyTorch's wide-row log-softmax: forward reads the row 3 times and writes it; backward reads the
    # gradient twice and the output once and writes the gradient (SoftMax.cu), 4 fp32 passes each
    assert by_name["log-softmax over the vocabulary"].bytes == 4 * N * V * 4
    assert by_name["log-softmax backward"].bytes == 4 * N * V * 4
    # the token embedding's gradient: a zeroed fp32 V x d, and (tied, the default) the head's gradient added
    assert by_name["token embedding gradient: zero V x d"].bytes == V * d * 4
    assert by_name["tied weight: the head's gradient added to the embedding's"].bytes == 3 * V * d * 4
    untied = replace(cfg, tie_weights=False)
    assert not any(k.name.startswith("tied") for k in p7.training_step(untied, 4, "bf16").kernels)
    assert p7.training_step(untied, 4, "bf16").totals()["launches"] == step_kernels(untied, N)["total"]
    compiled = p7.training_step(cfg, 4, "bf16", compiled=True)
    assert "logits to fp32" not in {k.name for k in compiled.kernels}
    assert compiled.totals()["launches"] == step_kernels(cfg, N, compiled=True)["total"]


# ------------------------------------------------------------------------------ the accuracy's row path
def test_a_recorded_row_is_predicted_from_the_ceilings_recorded_before_it():
    ceilings = {"exercise": {"id": "phase1.ceilings"}, "status": "ok", "hardware": {"key": "h100_sxm"},
                "summary": {"ceilings": CEILINGS}, "provenance": {"started_utc": "2026-01-01T00:00:00Z"},
                "_path": "phase1/ceilings/h100_sxm/a.json"}
    row = {"exercise": "phase3.flash_attention", "variant": "sdpa_cudnn", "hardware": "h100_sxm",
           "started": "2026-01-02T00:00:00Z", "metrics.ms": 1.0, "timing.method": "cuda events",
           "timing.flush_l2": True, "params.batch": 1, "params.heads": 2, "params.n": 256, "params.head_dim": 64,
           "params.dtype": "bf16", "params.causal": False}
    p = acc.summed(row, [ceilings], p3.row_workload, specs={})
    flops, exps = 4 * 2 * 256**2 * 64, 2 * 256**2
    assert p["predicted_ms"] == pytest.approx(0.005 + flops / 100e12 * 1e3 + exps / 1e12 * 1e3)
    assert p["measured_over_predicted"] == pytest.approx(1.0 / p["predicted_ms"])
    graphed = acc.summed({**row, "timing.graph_reps": 1}, [ceilings], p3.row_workload, specs={})
    # in a graph of one call: the kernel at the graph floor, plus the graph's own launch
    assert graphed["predicted_ms"] == pytest.approx(p["predicted_ms"] - 0.005 + 0.001 + 0.005)


def _committed_view():
    from common import render
    from common.paths import REPO_ROOT
    from common.records import is_smoke, load_records
    from common.report import frame_of
    if not any((REPO_ROOT / "results" / "phase1" / "ceilings").glob("*/*.json")):
        pytest.skip("no committed ceilings records in this checkout")
    records = [r for r in load_records(REPO_ROOT / "results") if not is_smoke(r)]
    return render.View(frame_of(records), REPO_ROOT / "README.md", REPO_ROOT / "results")


def test_the_committed_records_give_summed_figures_per_phase():
    """The data a README table reads: per GPU and phase, the one-roof and summed errors (never fitted:
    the ceilings are the records' own phase1.ceilings)."""
    from common import accuracy, workload_accuracy
    rows = accuracy.counted(_committed_view())
    f = workload_accuracy.figures(rows)
    p3 = f[f["phase"] == 3]
    assert len(p3) and (p3["covered"] == p3["rows"]).all()
    assert (p3["summed_err"] < p3["one_roof_err"]).all()          # the exponentials are what one roof misses
    top = rows[rows["summed.top"].notna()].iloc[0]["summed.top"]
    assert 1 <= len(top) <= 3 and all(0 <= t["share"] <= 1 for t in top)
    # the summed-else-one-roof ratio is the sum's where a row has one, the one-roof one where not
    has = rows["summed.measured_over_predicted"].notna()
    assert (rows.loc[has, accuracy.RATIO] == rows.loc[has, "summed.measured_over_predicted"].astype(float)).all()
    assert (rows.loc[~has, accuracy.RATIO] == rows.loc[~has, "calibrated.measured_over_predicted"].astype(float)).all()


def test_the_accuracy_table_and_goals_count_every_phase_with_the_sum_beside_one_roof():
    from common import accuracy, accuracy_goals
    view = _committed_view()
    table = accuracy.table(view, (3,))
    assert accuracy.HEADER[-1] in table.splitlines()[0]
    goals = {g.exercise: g for g in accuracy_goals.GOALS.goals}
    assert {f"accuracy.p{n}" for n in range(1, 8)} <= set(goals) and accuracy_goals.SCOPES["accuracy.all"][0] == \
        (1, 2, 3, 4, 5, 6, 7)
    for scope in ("accuracy.all", "accuracy.p3", "accuracy.p5"):
        g = accuracy_goals.rows(view, goals[scope])
        assert len(g) and {"metrics.sum_abs_err_pct", "metrics.cal_abs_err_pct", "metrics.sum_rows"} <= set(g)
        if scope == "accuracy.p3":                   # every phase 3 row has a kernel list: the sum is better
            assert (g["metrics.sum_rows"] == g["metrics.rows"]).all()
            assert (g["metrics.sum_abs_err_pct"] < g["metrics.cal_abs_err_pct"]).all()
    assert "phase 5 alone" in accuracy_goals.GOALS.goals[5].text


def test_a_gpu_run_attaches_the_summed_prediction_to_each_ok_row():
    from common.hardware import load_hardware
    spec = load_hardware()["h100_sxm"]
    rows = [{"variant": "sdpa_cudnn", "status": "ok",
             "params": {"batch": 1, "heads": 2, "n": 256, "head_dim": 64, "dtype": "bf16", "causal": False},
             "metrics": {"ms": 1.0}, "timing": {"method": "cuda events", "flush_l2": True},
             "prediction": {"measured_ms": 1.0}},
            {"variant": "triton", "status": "failed", "params": {}, "metrics": {}, "prediction": None}]
    acc.attach("phase3.flash_attention", rows, CEILINGS, spec)
    s = rows[0]["prediction"]["summed"]
    flops, exps = 4 * 2 * 256**2 * 64, 2 * 256**2
    assert s["computed"] == "at run time" and len(s["fallbacks"]) == 4    # Triton floor, GEMV rate and fixed part, autograd op
    assert s["predicted_ms"] == pytest.approx(0.005 + flops / 100e12 * 1e3 + exps / 1e12 * 1e3)
    assert rows[1]["prediction"] is None
    # the report reads the stored block rather than recomputing it
    frame_row = {"exercise": "phase3.flash_attention", "prediction.summed": s}
    assert acc.summed(frame_row, []) is s
    acc.attach("phase1.elementwise", rows, CEILINGS, spec)             # no kernel list: nothing added


def test_an_offline_run_is_the_sum_of_the_steps_the_scheduler_takes():
    from phases.phase5_inference import offline
    from phases.phase5_inference.predictions.analysis import offline_steps
    assert p5.OFFLINE_MAX_BATCHED_TOKENS == offline.MAX_BATCHED_TOKENS
    s = named("tiny")
    prompts, outputs = [30, 50, 40, 20, 60], [3, 5, 2, 4, 1]
    run = p5.offline_run(s, prompts, outputs, max_num_seqs=4, max_batched_tokens=100)
    steps = offline_steps(s, prompts, outputs, 4, 100)
    assert f"in {len(steps)} steps" in run.name and len(run.host) == 3 * len(steps)   # each step's host work
    prefill = p5.packed_prefill(s, [30, 50])
    assert "2 prompts, 80 tokens" in prefill.name          # attention over each prompt alone, one tile each
    assert prefill.totals()["exps"] == s.num_attention_heads * (30**2 + 50**2) * s.num_hidden_layers
    row = {"exercise": "phase5.offline", "variant": "lab-engine", "params.model": "tiny", "params.num_seqs": 3,
           "params.input_tokens": [4, 9], "params.output_tokens": [2, 5]}
    assert p5.row_workload(row) is None                           # no record seed: not guessed
    w = p5.row_workload({**row, "record.params.seed": 0, "record.params.max_num_seqs": 256})
    assert w is not None and w.name.startswith("tiny offline run: 3 requests")


def test_a_tensor_parallel_step_is_a_shard_plus_its_measured_collectives():
    from phases.phase5_inference.engine.tp_shards import local_shape
    s = named("llama-3.1-8b")
    assert p5.tp_local_shape(s, 2) == local_shape(s, 2)
    rows = [{"variant": "allreduce_nccl", "status": "ok", "params": {"world_size": 2, "size_bytes": 8192},
             "metrics": {"us": 11.0}},
            {"variant": "allreduce_one_shot", "status": "ok", "params": {"world_size": 2, "size_bytes": 8192},
             "metrics": {"us": 7.0}},
            {"variant": "allreduce_nccl", "status": "ok", "params": {"world_size": 2, "size_bytes": 1 << 20},
             "metrics": {"us": 18.0}},
            {"variant": "allreduce_nccl", "status": "ok", "params": {"world_size": 4, "size_bytes": 8192},
             "metrics": {"us": 99.0}}]
    ms = p5.all_reduce_from_rows(rows, 2)
    assert ms(8192) == pytest.approx(0.007) and ms(100) == pytest.approx(0.007)      # the faster, at 8 KiB
    assert ms(500_000) == pytest.approx(0.018) and p5.all_reduce_from_rows(rows, 8) is None
    w = p5.tp_decode_step(s, 2, 1, 200.0, ms)
    (what, each, n), gather = w.collectives
    assert n == 2 * s.num_hidden_layers and each == pytest.approx(0.007)            # hidden state: 8 KiB
    assert gather[2] == 1 and gather[1] == pytest.approx(0.018)                      # fp32 logits: 513 KB
    whole = p5.decode_step(s, 1, 200.0).totals()["bytes"]
    assert w.totals()["bytes"] < 0.6 * whole                                         # about half the weights
    p = wl.predict(w, CEILINGS)
    assert p["communication_ms"] == pytest.approx(2 * 32 * 0.007 + 0.018)
    assert p["predicted_ms"] == pytest.approx(wl.predict(replace(w, collectives=()), CEILINGS)["predicted_ms"]
                                              + p["communication_ms"])
    unmeasured = p5.tp_decode_step(s, 2, 1, 200.0, None)
    assert not unmeasured.collectives and "unmeasured" in unmeasured.notes[-1]
    row = {"exercise": "phase5.tensor_parallel", "variant": "engine", "params.model": "llama-3.1-8b",
           "params.tp": 2, "params.max_num_seqs": 1, "params.prompt_tokens": 100, "params.output_tokens": 200,
           "record.rows": rows}
    assert len(p5.row_workload(row).collectives) == 2


def test_tensor_parallel_rows_take_committed_all_reduces_first_then_link_ceilings_said_so():
    p = {"models": ["llama-3.1-8b", "tiny"], "tp_sizes": [1, 2], "max_num_seqs": 1, "prompt_tokens": 100,
         "output_tokens": 200}
    link = {("h200_sxm", "nccl", "all_reduce", 2): {"alpha_us": 20.0, "beta_busbw_gbps": 100.0}}
    assert p5.all_reduce_from_link_ceilings(link, "h200_sxm", 2)(1e6) == pytest.approx(0.020 + 1e6 / 100e6)
    assert p5.all_reduce_from_link_ceilings(link, "h100_sxm", 2) is None
    rows = [{"variant": "allreduce_one_shot", "status": "ok", "params": {"world_size": 2, "size_bytes": 1 << 20},
             "metrics": {"us": 7.0}}]
    committed = p5.tensor_parallel_workloads(p, link, "h200_sxm", rows)
    assert [label for label, _ in committed] == ["llama-3.1-8b at TP=1: one rank's decode step",
                                                 "llama-3.1-8b at TP=2: one rank's decode step"]   # tiny: none
    tp2 = committed[1][1]
    assert tp2.collectives[0][1] == pytest.approx(0.007) and not any("link_ceilings" in n for n in tp2.notes)
    from_link = p5.tensor_parallel_workloads(p, link, "h200_sxm", [])[1][1]
    assert from_link.collectives[0][1] > 0.020 and "link_ceilings" in from_link.notes[-1]
    assert not p5.tensor_parallel_workloads(p, None, None, None)[1][1].collectives          # neither: left out
    assert p5.tensor_parallel_workloads({**p, "max_num_seqs": 8}) == []


def test_speculative_rows_are_the_target_step_and_each_k_for_the_lab_models_only():
    p = {"models": "lab", "ks": [1, 4], "concurrency": [1], "prompt_tokens": 100, "output_tokens": 200}
    labels = [label for label, _ in p5.speculative_workloads(p)]
    assert labels == ["target decode step at 1 at once", "draft x 1 + verify at 1 at once",
                      "prompt lookup of up to 1 + verify at 1 at once", "draft x 4 + verify at 1 at once",
                      "prompt lookup of up to 4 + verify at 1 at once"]
    steps = dict(p5.speculative_workloads(p))
    one, four = (wl.predict(steps[f"draft x {k} + verify at 1 at once"], CEILINGS)["predicted_ms"] for k in (1, 4))
    assert four > one > wl.predict(steps["target decode step at 1 at once"], CEILINGS)["predicted_ms"]
    assert p5.speculative_workloads({**p, "models": "tiny"}) == []


def test_the_host_step_ceiling_times_the_scheduler_on_this_cpu_and_the_step_reads_it():
    from phases.phase5_inference.predictions.host_step import host_step_us, host_steps_us
    one, many = host_step_us(1, 40, steps=30), host_step_us(32, 40, steps=30)
    assert 0 < one < many                                     # per-sequence Python: more sequences, more time
    assert set(host_steps_us([1, 2], 20)) == {"1", "2"}
    s = named("tiny")
    step = p5.decode_step(s, 2, 100.0)
    timed = p5.with_host_step(step, {"2": 50.0}, 2)
    assert timed.host[-1] == ("scheduler step and input writing, 2 sequences", 0.05, 1)
    assert "unmeasured" in p5.with_host_step(step, None, 2).notes[-1] and p5.with_host_step(step, None, 2).host == step.host
    row = {"exercise": "phase5.batching", "variant": "lab-engine", "params.model": "tiny", "params.concurrency": 2,
           "params.prompt_tokens": 10, "params.output_tokens": 20, "summary.host_step_us": {"2": 50.0}}
    assert p5.row_workload(row).host[-1][1] == 0.05


def test_a_sampled_step_adds_the_samplers_eager_kernels_one_noise_draw_per_seeded_row():
    s, old = named("tiny"), p5.PER_ROW_GENERATOR
    greedy = p5.sampled_decode_step(s, 8, 50.0, 0.0, seeded=False)
    assert greedy.kernels == p5.decode_step(s, 8, 50.0).kernels              # greedy: the graph's argmax alone
    shared = p5.sampled_decode_step(s, 8, 50.0, 1.0, seeded=False, draw=old)
    seeded = p5.sampled_decode_step(s, 8, 50.0, 1.0, seeded=True, draw=old)
    extra = {k.name: k for k in seeded.kernels[len(greedy.kernels):]}
    assert extra["exponential noise, one row from its own generator"].count == 8
    assert all(k.launch == TORCH for k in extra.values())                   # eager, after the graph
    assert "exponential noise, shared generator" in {k.name for k in shared.kernels}
    assert seeded.totals()["launches"] > shared.totals()["launches"] > greedy.totals()["launches"]


def test_the_inverse_cdf_draw_launches_the_same_kernels_at_any_batch_seeded_or_not():
    s = named("tiny")
    launches = {(b, seeded): p5.sampled_decode_step(s, b, 50.0, 1.0, seeded).totals()["launches"]
                - p5.decode_step(s, b, 50.0).totals()["launches"] for b in (1, 8, 256) for seeded in (False, True)}
    assert len(set(launches.values())) == 1
    names = {k.name for k in p5.sampled_decode_step(s, 8, 50.0, 1.0, True).kernels}
    assert "running sums of the probabilities (float64)" in names and not any("noise" in n for n in names)
    with pytest.raises(ValueError, match="unknown sampler draw"):
        p5.sampling_kernels(100, 1, True, draw="gumbel")


def test_samples_and_best_of_n_rows_map_to_sampled_steps_with_their_host_step():
    row = {"exercise": "phase5.samples", "variant": "lab-engine", "params.model": "tiny", "params.n": 4,
           "params.prompt_tokens": 17, "params.output_tokens": 8, "params.temperature": 1.0, "params.seeded": False,
           "summary.host_step_us": {"4": 30.0}}
    w = p5.row_workload(row)
    assert "batch 4" in w.name and "shared generator" in " ".join(k.name for k in w.kernels)
    assert w.host[-1] == ("scheduler step and input writing, 4 sequences", 0.03, 1)
    bon = {"exercise": "phase5.best_of_n", "variant": "sampled", "params.digits": 2, "params.max_tokens": 4,
           "params.temperature": 1.0, "metrics.decode_batch": 64, "record.params.hidden": 256,
           "record.params.layers": 4, "record.params.heads": 4}
    w = p5.row_workload(bon)
    noise = next(k for k in w.kernels if k.name.startswith("exponential noise, one row"))
    assert noise.count == 64 and "unmeasured" in w.notes[-1]                 # every sample seeded; no host ceiling
    assert "batch 64, 9 cached tokens" in w.name                          # "\na+b=" (7) + half of 4
    assert p5.row_workload({**bon, "variant": "greedy", "params.temperature": 0.0}).totals()["launches"] \
        < w.totals()["launches"]
    assert p5.row_workload({**bon, "record.params.hidden": None}) is None
    drawn = p5.row_workload({**bon, "summary.sampler_draw": "inverse_cdf"})          # a record that names its draw
    assert not any("noise" in k.name for k in drawn.kernels) and drawn.totals()["launches"] < w.totals()["launches"]


def test_best_of_ns_model_shape_is_the_torch_free_one():
    from phases.phase5_inference import best_of_n
    from phases.phase5_inference.models import arithmetic
    for params in ({"hidden": 256, "layers": 4, "heads": 4}, {"hidden": 32, "layers": 1, "heads": 1}):
        assert p5.arithmetic_shape(params["hidden"], params["layers"], params["heads"]) == best_of_n.model_shape(params)
    assert (p5.ARITHMETIC_VOCAB, p5.ARITHMETIC_POSITIONS) == (arithmetic.VOCAB_SIZE, arithmetic.MAX_POSITIONS)


def test_a_speculative_step_is_the_draft_chain_plus_a_verify_of_k_plus_1_rows():
    from phases.phase5_inference.models.trained_models import MODELS
    counts = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim")
    for role, name in (("target", "shakespeare-target"), ("matched", "shakespeare-draft")):
        mine, theirs = p5.SPECULATIVE_SHAPES[role], MODELS[name].shape
        assert [getattr(mine, c) for c in counts] == [getattr(theirs, c) for c in counts]
    t, d = p5.SPECULATIVE_TARGET, p5.SPECULATIVE_DRAFT
    w = p5.speculative_step(t, d, 2, 3, 128.0)
    chain, verify = p5.draft_chain(d, 2, 3, 128.0), p5.decode_step(t, 8, 128.0)      # 2 x (3 + 1) rows
    assert w.totals()["launches"] == chain.totals()["launches"] + verify.totals()["launches"]
    assert chain.totals()["launches"] == 3 * p5.decode_step(d, 2, 128.0).totals()["launches"]
    assert [h[2] for h in chain.host] == [1, 3, 1]                       # one copy, k launches, one wait
    assert any("acceptance" in n for n in w.notes)
    lookup = p5.speculative_step(t, None, 2, 4, 128.0, proposed_per_verify=1.5)
    assert "prompt lookup" in lookup.name and lookup.totals()["launches"] == p5.decode_step(t, 5, 128.0).totals()["launches"]
    assert p5.expected_tokens_per_verify(0.0, 4) == 1.0 and p5.expected_tokens_per_verify(1.0, 4) == 5.0
    assert p5.expected_tokens_per_verify(0.405, 8) == pytest.approx(4.24)          # kept of proposed, plus one
    row = {"exercise": "phase5.speculative", "variant": "target", "params.concurrency": 4, "params.k": 0,
           "params.prompt_tokens": 64, "params.output_tokens": 128}
    assert p5.row_workload(row).name.startswith("shakespeare-target decode step, batch 4")
    assert p5.row_workload({**row, "record.params.models": "tiny"}) is None


def test_the_speculative_speedup_is_predicted_from_sums_and_the_measured_acceptance():
    from phases.phase5_inference.predictions import speculative_speedup as sp
    ceilings = {"exercise": {"id": "phase1.ceilings"}, "status": "ok", "hardware": {"key": "h100_sxm"},
                "summary": {"ceilings": CEILINGS}, "provenance": {"started_utc": "2026-01-01T00:00:00Z"},
                "_path": "phase1/ceilings/h100_sxm/a.json"}
    params = {"temperature": 0.0, "concurrency": 1, "prompt_tokens": 64, "output_tokens": 128, "k": 2}
    rec = {"exercise": {"id": "phase5.speculative"}, "hardware": {"key": "h100_sxm"}, "params": {"models": "lab"},
           "provenance": {"started_utc": "2026-01-02T00:00:00Z"},
           "rows": [{"variant": "target", "status": "ok", "params": {**params, "k": 0}, "metrics": {}},
                    {"variant": "matched", "status": "ok", "params": params,
                     "metrics": {"acceptance_rate": 0.5, "speedup_vs_target": 1.2, "predicted_speedup": 1.3,
                                 "tokens_per_verify": 2.0}}]}
    [r] = sp.speedup_rows([ceilings, rec])
    context = 64 + 128 / 2
    step = wl.predict(p5.speculative_step(p5.SPECULATIVE_TARGET, p5.SPECULATIVE_DRAFT, 1, 2, context), CEILINGS)
    target = wl.predict(p5.decode_step(p5.SPECULATIVE_TARGET, 1, context), CEILINGS)
    assert r["expected_tokens"] == 2.0                                       # 1 + 0.5 x 2
    assert r["summed_speedup"] == pytest.approx(2.0 * target["predicted_ms"] / step["predicted_ms"])
    assert r["measured_over_summed"] == pytest.approx(1.2 / r["summed_speedup"])
    assert sp.speedup_rows([rec]) == []                                      # no ceilings: nothing claimed


def test_phase6_torch_attention_rows_are_phase3s_attention_and_jax_rows_keep_one_roof():
    from phases.phase6_hardware import kernel_lists as p6
    row = {"exercise": "phase6.jax_attention", "variant": "sdpa_cudnn", "params.batch": 4, "params.heads": 16,
           "params.seq": 2048, "params.head_dim": 64, "params.dtype": "bf16", "params.causal": False}
    w = p6.row_workload(row)
    assert w.kernels == p3.attention_forward("sdpa_cudnn", 4, 16, 2048, 64, "bf16", False).kernels
    assert w.totals()["exps"] == 4 * 16 * 2048**2
    assert p6.row_workload({**row, "variant": "jax_dpa_xla"}) is None
    assert p6.row_workload({k: v for k, v in row.items() if k != "params.seq"}) is None


def test_at_run_time_the_summary_and_run_parameters_reach_the_kernel_list_as_at_report_time():
    from common.hardware import load_hardware
    spec = load_hardware()["h100_sxm"]
    rows = [{"variant": "lab-engine", "status": "ok",
             "params": {"model": "tiny", "concurrency": 2, "prompt_tokens": 10, "output_tokens": 20},
             "metrics": {"ms": 1.0}, "timing": {"method": "TPOT per request"}, "prediction": {"measured_ms": 1.0}}]
    acc.attach("phase5.batching", rows, CEILINGS, spec, {"host_step_us": {"2": 40.0}}, {"seed": 0})
    top = rows[0]["prediction"]["summed"]
    assert top["host_ms"] == pytest.approx(0.005 + 0.005 + 0.010 + 0.040)    # copy, launch, sync, scheduler step
