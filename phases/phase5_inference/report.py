"""Phase 5's README blocks, declared (rendered by common/render.py): startup telemetry, decode speed
against plain PyTorch, the continuous-batching sweep and its plot, offline throughput, the paged
attention kernel, vLLM, weight-only quantization (kernels, the engine, quality), the goals and the
findings."""
from common.above_roof import bandwidth_pct
from common.formats import count as tokens
from common.formats import gib, missing, ms, num, pct, ratio
from common.frame import by_hardware, find, value
from common import render
from common.spec import Goal, Goals, Phase, Plot, Table, Text, col, ident

from .reporting import findings, plots, seed, speculative_report, tp_report
from .reporting.goal_model import GOAL_MODEL, of_8b

STARTUP, DECODE, BATCHING = "phase5.startup", "phase5.ttft_decode", "phase5.batching"
SAMPLES, LONG_PROMPT = "phase5.samples", "phase5.long_prompt"
OFFLINE, ATTENTION, VLLM = "phase5.offline", "phase5.decode_attention", "phase5.vllm_serve"
QKERNELS, QENGINE, QQUALITY = "phase5.quant_kernels", "phase5.quant_engine", "phase5.quant_quality"


def variants(*names):
    return lambda d: d[d["variant"].isin(names)]


STARTUP_TABLE = Table(STARTUP, STARTUP, prediction=False, columns=(
    ident("model", "params.model"), ident("utilization", "params.gpu_memory_utilization", lambda x: f"{x:.2f}"),
    col("weights (params x bytes)", "metrics.weights_gib", gib), col("weights held", "metrics.measured_weights_gib", gib),
    col("KV pool", "metrics.kv_pool_gib", gib), col("KV per token", "metrics.kv_bytes_per_token",
                                                     lambda x: "-" if missing(x) else f"{x / 1024:.0f} KiB"),
    col("KV capacity (tokens)", "metrics.kv_capacity_tokens", tokens),
    col("concurrent 8K requests", "metrics.max_concurrency_at_context", tokens), col("load s", "metrics.load_s", num)),
    note=lambda view, rows: (f"The seed's Llama 3.1 8B under vLLM ({seed.CITATION}): weights "
                             f"{seed.STARTUP_8B['weights_gib']} GiB, KV pool {seed.STARTUP_8B['kv_pool_gib']} GiB, "
                             f"{seed.STARTUP_8B['kv_capacity_tokens']:,} tokens, {seed.STARTUP_8B['max_concurrency_8k']} "
                             f"concurrent 8K requests."))

DECODE_TABLE = Table(DECODE, DECODE, columns=(
    ident("model", "params.model"), ident("variant", "variant"),
    col("TTFT p50", "metrics.ttft_p50_ms", ms), col("TPOT", "metrics.tpot_ms", ms),
    col("decode tok/s", "metrics.decode_tok_s", num), col("GB/s", "metrics.gbps", num),
    col("% of copy roofline", "metrics.pct_of_copy_roofline", pct),
    col("x torch.compile", "metrics.speedup_vs_compile", ratio),
    col("client TPOT / engine step", "metrics.serving_overhead", ratio)),
    more=(col("compile s", "metrics.compile_s", num), col("KV capacity (tokens)", "metrics.kv_capacity_tokens", tokens),
          col("copy GB/s (this run)", "metrics.copy_gbps", num)),
    note=lambda view, rows: (f"The seed's Llama 3.1 8B under vLLM: TTFT {seed.TTFT_8B_MS} ms, {seed.DECODE_8B_TOK_S} tok/s; "
                             f"its 70B needed two A100s and left {seed.KV_LEFT_70B_TP2_GIB} GiB for KV ({seed.CITATION})."))

BATCHING_TABLE = Table(BATCHING, BATCHING, columns=(
    ident("target", "params.target"), ident("concurrency", "params.concurrency", num),
    col("output tok/s", "metrics.output_tok_s", num), col("predicted tok/s", "metrics.predicted_output_tok_s", num),
    col("% of predicted", "metrics.pct_of_predicted_tok_s", pct), col("x concurrency 1", "metrics.x_output_tok_s_vs_1", ratio),
    col("median TPOT", "metrics.tpot_median_ms", ms), col("TTFT p50", "metrics.ttft_median_ms", ms),
    col("TTFT p99", "metrics.ttft_p99_ms", ms)),
    more=(col("ITL p99", "metrics.itl_p99_ms", ms), col("E2EL median", "metrics.e2el_median_ms", ms),
          col("requests", "metrics.completed", num), col("calibrated tok/s", "metrics.calibrated_output_tok_s", num)),
    note=lambda view, rows: ("The seed's vLLM on an A100, Llama 3.1 8B: " + ", ".join(
        f"{num(v)} tok/s at {c}" for c, v in seed.BATCHING_8B.items()) + f" ({seed.CITATION})."))

OFFLINE_TABLE = Table(OFFLINE, OFFLINE, columns=(
    ident("model", "params.model"), ident("sequences", "params.num_seqs", num),
    col("output tok/s", "metrics.output_tok_s", num), col("predicted tok/s", "metrics.predicted_output_tok_s", num),
    col("calibrated tok/s", "metrics.calibrated_output_tok_s", num), col("wall s", "metrics.wall_s", num),
    col("steps", "metrics.engine_steps", num), col("preemptions", "metrics.preemptions", num)))

VLLM_TABLE = Table(VLLM, VLLM, columns=(
    ident("concurrency", "params.concurrency", num), col("output tok/s", "metrics.output_tok_s", num),
    col("median TPOT", "metrics.tpot_median_ms", ms), col("TTFT p50", "metrics.ttft_median_ms", ms)))

ATTENTION_TABLE = Table(ATTENTION, ATTENTION, columns=(
    ident("variant", "variant"), ident("batch", "params.batch", num), ident("context", "params.context", num),
    col("µs", lambda r: 1000 * r["metrics.ms"], num), col("GB/s", "metrics.gbps", num),
    col("% of peak bandwidth", bandwidth_pct),
    col("x gather + SDPA", "metrics.speedup_vs_gather_sdpa", ratio), col("splits", "metrics.num_splits", num)),
    brief=lambda rows: rows[rows["params.batch"].isin([1, 64, 256])])

QUANT_KERNELS_TABLE = Table(QKERNELS, QKERNELS, columns=(
    ident("model", "params.model"), ident("matrix", "params.matrix"), ident("batch", "params.batch", num),
    ident("variant", "variant"),
    col("µs", lambda r: 1000 * r["metrics.ms"], num), col("GB/s", "metrics.gbps", num),
    col("% of roofline", "metrics.pct_of_roofline", pct), col("x bf16 cuBLAS", "metrics.speedup_vs_bf16_cublas", ratio)),
    more=(col("algorithm bytes", "metrics.algorithm_bytes", num),),
    brief=lambda rows: of_8b(rows[(rows["params.matrix"] == "gate_up") & rows["params.batch"].isin([1, 16, 256])]))

LADDER = ("w4_naive", "w4_fused", "w4_cuda_bulk", "w4_cuda", "w4_library")

QUANT_LADDER_TABLE = Table("phase5.quant_ladder", QKERNELS, columns=(
    ident("model", "params.model"), ident("matrix", "params.matrix"), ident("batch", "params.batch", num),
    ident("rung", "variant"),
    col("µs", lambda r: 1000 * r["metrics.ms"], num), col("% of roofline", "metrics.pct_of_roofline", pct),
    col("x bf16 cuBLAS", "metrics.speedup_vs_bf16_cublas", ratio), col("x Triton", "metrics.speedup_vs_w4_fused", ratio),
    col("x tinygemm", "metrics.speedup_vs_w4_library", ratio)),
    where=lambda d: d[d["variant"].isin(LADDER)],
    brief=lambda rows: of_8b(rows[rows["params.matrix"].isin(["gate_up", "down"]) & rows["params.batch"].isin([1, 16])]))

QUANT_ENGINE_TABLE = Table(QENGINE, QENGINE, columns=(
    ident("model", "params.model"), ident("variant", "variant"), ident("batch", "params.batch", num),
    col("weights", "metrics.weights_gib", gib), col("decode step", "metrics.decode_step_ms", ms),
    col("decode tok/s", "metrics.decode_tok_s", num),
    col("x bf16", "metrics.speedup_vs_bf16", ratio), col("% of copy roofline", "metrics.pct_of_copy_roofline", pct),
    col("kernels / step", "metrics.kernels_per_step", num)),
    more=(col("output tok/s (with prefills)", "metrics.output_tok_s", num), col("bytes / token", "metrics.bytes_per_token", num),
          col("predicted weights", "metrics.predicted_weights_gib", gib)),
    note=lambda view, rows: ("The seed's Llama 3.1 8B under vLLM on an A100 (" + seed.CITATION + "): " + "; ".join(
        f"{name} {g:.2f} GiB, {num(t)} tok/s ({x:.2f}x)" for name, (g, t, x) in seed.QUANT_8B.items())
        + f"; Mistral 7B with Marlin {seed.QUANT_MISTRAL_MARLIN_X}x."))

QUANT_LAYER_TABLE = Table("phase5.quant_layers", QQUALITY, prediction=False, columns=(
    ident("matrix", "params.matrix"), ident("format", "params.format"), ident("group", "params.group_size", num),
    col("output rel. error", "metrics.rel_error_output", lambda x: "-" if missing(x) else f"{x:.4f}"),
    col("predicted (uniform rounding)", "metrics.predicted_rel_error", lambda x: "-" if missing(x) else f"{x:.4f}"),
    col("max |error| / step", "metrics.max_abs_weight_error_over_scale", lambda x: "-" if missing(x) else f"{x:.3f}"),
    col("bits / weight", "metrics.bits_per_weight", lambda x: "-" if missing(x) else f"{x:.2f}")),
    where=variants("layer_int8", "layer_int4"))

QUANT_PERPLEXITY_TABLE = Table("phase5.quant_perplexity", QQUALITY, prediction=False, columns=(
    ident("variant", "variant"), ident("group", "params.group_size", num),
    col("val loss", "metrics.val_loss", lambda x: "-" if missing(x) else f"{x:.4f}"),
    col("perplexity", "metrics.perplexity", lambda x: "-" if missing(x) else f"{x:.2f}"),
    col("Δ loss", "metrics.delta_loss_vs_reference", lambda x: "-" if missing(x) else f"{x:+.4f}"),
    col("KL from bf16", "metrics.kl_vs_reference", lambda x: "-" if missing(x) else f"{x:.2e}"),
    col("top-1 unchanged", "metrics.top1_agreement", lambda x: "-" if missing(x) else f"{100 * x:.1f}%"),
    col("bits / weight", "metrics.bits_per_weight", lambda x: "-" if missing(x) else f"{x:.2f}")),
    where=variants("reference", "int8", "int4_rtn", "int4_awq"))


def issue_sizes(variant: str, **sizes):
    """Rows of `variant` at the sizes issue 35's goal names (a smaller run is not held to it)."""
    def where(d):
        keep = d["variant"] == variant
        for name, size in sizes.items():
            column = d.get(f"params.{name}")
            keep &= False if column is None else column == size
        return d[keep]
    return where


def by_kind(kind: str):
    return lambda d: d[d["params.kind"] == kind] if "params.kind" in d else d.iloc[0:0]


LONG_PROMPT_ITL_TABLE = Table("phase5.long_prompt_itl", LONG_PROMPT,
    where=by_kind("itl_under_long_prompt"), columns=(
    ident("variant", "variant"), ident("streams", "params.streams", num), ident("long prompt", "params.long_tokens", tokens),
    col("ITL median", "metrics.itl_median_ms", ms), col("ITL p99", "metrics.itl_p99_ms", ms),
    col("p99 / median", "metrics.itl_p99_over_median", ratio), col("ITL max", "metrics.itl_max_ms", ms),
    col("predicted ITL p99", "metrics.predicted_itl_p99_ms", ms), col("long prompt TTFT", "metrics.long_ttft_ms", ms)),
    more=(col("token budget", "params.token_budget", tokens), col("ITLs", "metrics.itl_count", num),
          col("steady ITL median", "metrics.steady_itl_median_ms", ms),
          col("p99 / steady median", "metrics.itl_p99_over_steady_median", ratio), col("predicted decode step", "metrics.predicted_decode_step_ms", ms),
          col("predicted mixed step", "metrics.predicted_mixed_step_ms", ms),
          col("predicted prefill + decode step", "metrics.predicted_prefill_then_decode_ms", ms),
          col("chunk tokens", "metrics.chunk_tokens", tokens), col("max ITL vs unchunked", "metrics.itl_max_vs_unchunked", ratio)))

LONG_PROMPT_PREFIX_TABLE = Table("phase5.long_prompt_prefix", LONG_PROMPT,
    where=by_kind("shared_prefix_ttft"), columns=(
    ident("variant", "variant"), ident("prefix", "params.prefix_tokens", tokens), ident("suffix", "params.suffix_tokens", tokens),
    col("TTFT A", "metrics.ttft_a_ms", ms), col("TTFT B", "metrics.ttft_b_ms", ms), col("A / B", "metrics.ttft_a_over_b", ratio),
    col("predicted A / B", "metrics.predicted_ttft_a_over_b", ratio), col("B's cached tokens", "metrics.b_cached_prompt_tokens", tokens)),
    more=(col("predicted TTFT A", "metrics.predicted_ttft_a_ms", ms), col("predicted TTFT B", "metrics.predicted_ttft_b_ms", ms)))


def vllm_runs(view) -> str:
    """The sweep against vllm serve where it ran, and every GPU's newest skip with its reason (a
    skipped record has no rows, so a table alone would hide that the exercise was run at all)."""
    newest = {}
    for rec in view.frame.records:                   # oldest first: the last one per GPU wins
        if rec["exercise"]["id"] == VLLM:
            newest[rec["hardware"]["key"]] = rec
    parts = [render.table(view, VLLM_TABLE)] if any(r["status"] != "skipped" for r in newest.values()) else []
    for _, rec in sorted(newest.items()):
        if rec["status"] == "skipped":
            name = (rec["hardware"].get("spec") or {}).get("name") or rec["hardware"]["key"]
            parts.append(f"{name}: skipped, {rec['reason']} ([record]({view.link(rec['_path'])})).")
    return "\n\n".join(parts)


LAB_8B = lambda d: d[(d["variant"] == "lab-engine") & (d["params.model"] == GOAL_MODEL)]    # noqa: E731


def best_level(d):
    """Each GPU's level of the sweep with the most output tok/s (the sweep's best, whatever its ratio)."""
    ok = d[d["status"] == "ok"]
    return ok[ok["metrics.output_tok_s"] == ok.groupby("hardware")["metrics.output_tok_s"].transform("max")]


def quant_row(variant: str, batch: int):
    return lambda d: of_8b(d[(d["variant"] == variant) & (d["params.batch"] == batch)])


def cuda_large_small_batch(d):
    return of_8b(d[(d["variant"] == "w4_cuda") & d["params.matrix"].isin(["gate_up", "down"])
                   & (d["params.batch"] <= 16)])


GOALS = Goals("phase5.goals", (
    Goal("8B batch-1 decode, % of the HBM roofline (copy bandwidth of the same run)", DECODE,
         "metrics.pct_of_copy_roofline", 85, "the lab's bar for an engine: the roofline is the weight and KV bytes a token reads over the copy bandwidth measured in the same run",
         where=LAB_8B, detail=lambda r: r["params.model"]),
    Goal("8B batch-1 decode against torch.compile static-cache decode", DECODE, "metrics.speedup_vs_compile", 1.25,
         "the lab's bar: gpt-fast's recipe (torch.compile, static cache), timed in the same run, reaches about two thirds of the roofline", where=LAB_8B, fmt=ratio),
    Goal("output tok/s at 8 concurrent requests, x one request", BATCHING, "metrics.x_output_tok_s_vs_1", 7.0,
         f"the seed's vLLM: {seed.BATCHING_8B[8] / seed.BATCHING_8B[1]:.2f}x on an A100", fmt=ratio,
         where=lambda d: d[d["params.concurrency"] == 8]),
    Goal("median TPOT at 8 concurrent requests, x one request", BATCHING, "metrics.tpot_vs_1", 1.15,
         "the lab's bar: below the ridge a step reads the same weights whatever the batch, so TPOT should stay flat", op="<=", pick="min", fmt=ratio,
         where=lambda d: d[d["params.concurrency"] == 8]),
    Goal("16 samples of one prompt: output tok/s, x one sample", SAMPLES, "metrics.x_output_tok_s_vs_1", 12.0,
         "the talk (shared/seeds/001_b29bfe611a5ae8f8.txt): below the ridge one weight read serves every sample in the step", fmt=ratio,
         where=lambda d: d[d["params.n"] == 16]),
    Goal("16 samples of one prompt: median TPOT, x one sample", SAMPLES, "metrics.tpot_vs_1", 1.2,
         "the talk (shared/seeds/001_b29bfe611a5ae8f8.txt): TPOT stays ~flat below the ridge (each row carries the roofline's own ratio, predicted_tpot_vs_1)", op="<=",
         pick="min", fmt=ratio, where=lambda d: d[d["params.n"] == 16]),
    Goal("32 streams while an 8,000-token prompt is prefilled (chunked): ITL p99 over median", LONG_PROMPT,
         "metrics.itl_p99_over_median", 2.0, "the lab's bar: a step carries one budget-sized chunk of the prompt, so no stream waits for the whole prefill",
         op="<=", pick="min", fmt=ratio, where=issue_sizes("chunked", streams=32, long_tokens=8000)),
    Goal("a second request sharing a 4,000-token prefix: TTFT of the first over the second", LONG_PROMPT,
         "metrics.ttft_a_over_b", 5.0, "the lab's bar: with the prefix cached only the suffix is prefilled (each row carries the roofline's ratio)", fmt=ratio,
         where=issue_sizes("prefix-cache", prefix_tokens=4000)),
    Goal("best level of the sweep (most tok/s), % of its predicted throughput", BATCHING,
         "metrics.pct_of_predicted_tok_s", 60, "the lab's bar: the roofline's throughput, prefills plus decode steps (analysis.serving_prediction)", where=best_level,
         detail=lambda r: f"concurrency {int(r['params.concurrency'])}"),
    Goal("TTFT p50 at concurrency 1, ~100-token prompt", DECODE, "metrics.ttft_p50_ms", 10.0,
         f"the seed's A100 with vLLM: {seed.TTFT_8B_MS} ms", op="<=", pick="min", fmt=ms,
         where=lambda d: d[(d["variant"] == "lab-engine-prefill") & (d["params.model"] == GOAL_MODEL)]),
    Goal("client TPOT over the engine's own step time, concurrency 1", DECODE, "metrics.serving_overhead", 1.05,
         "the lab's bar: HTTP, SSE and the event loop add at most 5% to a step", op="<=", pick="min", fmt=ratio, where=LAB_8B),
    Goal("8B batch-1 decode, int4 (the CUDA kernel) against bf16 (same run)", QENGINE, "metrics.speedup_vs_bf16", 2.5,
         f"the seed's Marlin: {seed.QUANT_MISTRAL_MARLIN_X}x on an A100 (Mistral 7B); the best published int4 8B decode on Hopper: 1.9-2.03x (torchao, SGLang)",
         fmt=ratio, where=quant_row("int4_cuda", 1)),
    Goal("8B batch-1 decode, int4 (the CUDA kernel), % of the int4 roofline (copy bandwidth of the same run)", QENGINE,
         "metrics.pct_of_copy_roofline", 75, "the lab's bar for a Marlin-class kernel in the engine",
         where=quant_row("int4_cuda", 1)),
    Goal("8B decode at 8 concurrent requests, int4 (the CUDA kernel) against bf16", QENGINE, "metrics.speedup_vs_bf16", 2.0,
         "Marlin's 3.1-3.9x at batch 1-16 on Ampere, less the step's unquantized parts", fmt=ratio,
         where=quant_row("int4_cuda", 8)),
    Goal("8B decode at 64 concurrent requests, int4 (the CUDA kernel) against bf16", QENGINE, "metrics.speedup_vs_bf16", 1.2,
         "the lab's bar: int4 never slower than bf16 where requests share a step", fmt=ratio,
         where=quant_row("int4_cuda", 64)),
    Goal("8B batch-1 decode, int8 fused against bf16 (same run)", QENGINE, "metrics.speedup_vs_bf16", 1.7,
         "the lab's bar: half the weight bytes, 85% of the 2x they promise", fmt=ratio,
         where=quant_row("int8_fused", 1)),
    Goal("8B batch-1 decode, int4 through the naive path against bf16: the trap", QENGINE, "metrics.speedup_vs_bf16", 0.5,
         f"the seed's naive AWQ kernel: {seed.QUANT_8B['AWQ int4, naive kernel'][2]}x", op="<=", pick="min", fmt=ratio,
         where=quant_row("int4_naive", 1)),
    Goal("CUDA W4A16 kernel at batch 1, % of the int4 copy roofline, every 8B matrix (the worst)", QKERNELS,
         "metrics.pct_of_roofline", 75, "the lab's bar: Marlin's int4 stream on an H100 runs at about 1.45 TB/s, under half the bandwidth",
         pick="min", where=lambda d: of_8b(d[(d["variant"] == "w4_cuda") & (d["params.batch"] == 1)]),
         detail=lambda r: r["params.matrix"]),
    Goal("CUDA W4A16 kernel against bf16 cuBLAS, batch 1 to 16, gate_up and down (the worst)", QKERNELS,
         "metrics.speedup_vs_bf16_cublas", 3.0, "Marlin's ideal is about 3.9x (4 bits against 16, plus scales)",
         pick="min", fmt=ratio, where=cuda_large_small_batch,
         detail=lambda r: f"{r['params.matrix']}, batch {int(r['params.batch'])}"),
    Goal("CUDA W4A16 kernel against tinygemm (torch._weight_int4pack_mm), every matrix and batch (the worst)", QKERNELS,
         "metrics.speedup_vs_w4_library", 1.0, "the library baseline in the same run", pick="min", fmt=ratio,
         where=lambda d: of_8b(d[d["variant"] == "w4_cuda"]), detail=lambda r: f"{r['params.matrix']}, batch {int(r['params.batch'])}"),
    Goal("CUDA W4A16 kernel against the Triton rung, batch 1 to 16, every matrix (the worst)", QKERNELS,
         "metrics.speedup_vs_w4_fused", 2.0, "the lab's bar: the rung must teach something", pick="min", fmt=ratio,
         where=lambda d: of_8b(d[(d["variant"] == "w4_cuda") & (d["params.batch"] <= 16)]),
         detail=lambda r: f"{r['params.matrix']}, batch {int(r['params.batch'])}"),
), empty="_Run `lab run 5` on a GPU to measure the goals._")


def with_ok(exercise: str):
    def hardware(view) -> list[str]:
        rows = view.latest(exercise, measured_only=True)
        return sorted(set(rows[rows["status"] == "ok"]["hardware"])) if len(rows) else []
    return hardware


def headline(view) -> list[str]:
    out = []
    for _, got in sorted(by_hardware(view.frame, [DECODE, BATCHING]).items()):
        d = find(got.get(DECODE), "lab-engine", model=GOAL_MODEL)
        b = got.get(BATCHING)
        if d is None or b is None:
            continue
        best = b[b["status"] == "ok"]
        best = best.loc[best["metrics.output_tok_s"].idxmax()] if len(best) else None
        out.append(f"{d['hardware_name']}: 8B decode {num(value(d, 'metrics.decode_tok_s'))} tok/s "
                   f"({pct(value(d, 'metrics.pct_of_copy_roofline'))} of the roofline)"
                   + (f", {num(best['metrics.output_tok_s'])} tok/s at concurrency {int(best['params.concurrency'])}"
                      if best is not None else ""))
    return out


# Speculative rows recorded before they carried prediction.excluded (speculative.NOT_A_ROOFLINE_TEST)
EXCLUDED = {(speculative_report.SPEC, v): "speedup formula: a speculative step's prediction is metrics.predicted_speedup"
            for v in speculative_report.DRAFTS}

# Tensor-parallel rows carry their own calibrated prediction (the ceilings' roofline plus phase 4's
# alpha-beta for the all-reduces); the report never recomputes them from HBM ceilings alone.
CALIBRATORS = {tp_report.TP: lambda r, records: None}

PHASE = Phase(5, "Inference & serving", "phase5_inference", headline=headline, excluded=EXCLUDED,
              calibrators=CALIBRATORS, blocks=(
    STARTUP_TABLE, ATTENTION_TABLE, DECODE_TABLE,
    Plot("phase5.decode_plot", "phase5_decode_bandwidth", (DECODE,), plots.decode_bandwidth,
         "Batch-1 decode bandwidth of each way to decode on the {name}, against the copy roofline",
         hardware=with_ok(DECODE)),
    BATCHING_TABLE,
    Plot("phase5.batching_plot", "phase5_batching", (BATCHING,), plots.batching,
         "Output tok/s and median TPOT against concurrency on the {name}, measured and predicted",
         hardware=with_ok(BATCHING)),
    OFFLINE_TABLE, LONG_PROMPT_ITL_TABLE, LONG_PROMPT_PREFIX_TABLE, Text("phase5.vllm_serve", vllm_runs, "_No records yet: run `lab run phase5.vllm_serve`._"),
    QUANT_KERNELS_TABLE, QUANT_LADDER_TABLE,
    Plot("phase5.quant_ladder_plot", "phase5_quant_ladder", (QKERNELS,), plots.quant_ladder,
         "The int4 ladder on the {name}: each rung's time against its roofline (its own bytes at the "
         "bandwidth) at batch 1 and 16, per matrix", hardware=with_ok(QKERNELS)),
    QUANT_ENGINE_TABLE,
    Plot("phase5.quant_plot", "phase5_quant_tok_s", (QENGINE,), plots.quant_tok_s,
         "Decode tok/s against bytes read per token for every weight format and path on the {name}, with the "
         "copy-bandwidth roofline drawn through them", hardware=with_ok(QENGINE)),
    QUANT_LAYER_TABLE, QUANT_PERPLEXITY_TABLE,
    GOALS, Text("phase5.findings", findings.findings, "_No phase 5 records yet._"),
    *speculative_report.BLOCKS, *tp_report.BLOCKS))
