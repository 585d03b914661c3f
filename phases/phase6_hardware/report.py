"""Phase 6's README blocks, declared (rendered by common/render.py): the JAX matmul and attention
tables (quoted TPU rows beside the lab's), the fusion answer, the Groq table, the cross-architecture
tables, the all-accelerator roofline plot, goals and findings. Torch-free, exercise-free."""
from common.formats import missing, num, pct, size_bytes, text
from common.frame import by_hardware, find, value
from common.spec import Goal, Goals, Phase, Plot, Table, Text, col, ident

from . import cross_arch, findings, plots, seed

MATMUL, ATTENTION, GROQ = "phase6.jax_matmul", "phase6.jax_attention", "phase6.groq_api"


def ms(x) -> str:
    return "-" if missing(x) else f"{num(x)} ms"


def shape(r) -> str:
    return f"{int(r['params.batch'])}x{int(r['params.heads'])}x{int(r['params.seq'])}x{int(r['params.head_dim'])}"


def scores_in_memory(r) -> str:
    materialized = value(r, "metrics.score_materialized")
    if materialized is None:
        return "fused, by the seed's account" if value(r, "metrics.xla_fused_claim") else "-"
    return "yes" if materialized else "no"


MATMUL_TABLE = Table(MATMUL, MATMUL, columns=(
    ident("variant", "variant"), ident("N", "params.n", num), ident("dtype", "params.dtype"),
    col("TFLOP/s", "metrics.tflops", num), col("% of peak", "metrics.pct_of_peak_tflops", pct),
    col("wall ms", "metrics.wall_ms", num), col("% of torch (same wall clock)", "metrics.pct_of_torch", pct),
    col("library / XLA's calls", lambda r: value(r, "metrics.library") or value(r, "metrics.hlo_custom_call_targets")
        or value(r, "metrics.hlo_fusion_kinds") or value(r, "metrics.quote"), text)),
    note=lambda view, rows: ("Quoted rows give no matrix size. TFLOP/s and % of peak come from each row's own timing: "
                             "CUDA events for torch and Triton, the wall clock for JAX."))

ATTENTION_TABLE = Table(ATTENTION, ATTENTION, columns=(
    ident("shape BxHxSxD", shape), ident("variant", "variant"),
    col("wall ms", lambda r: value(r, "metrics.wall_ms") or value(r, "metrics.ms"), num),
    col("TFLOP/s", "metrics.tflops", num), col("% of best SDPA", "metrics.pct_of_best_sdpa", pct),
    col("S x S in memory", scores_in_memory), col("kernels", "metrics.hlo_kernels", num),
    col("both matmuls in one fusion", lambda r: (value(r, "metrics.hlo") or {}).get("attention_in_one_fusion")
        or ("no" if value(r, "metrics.hlo") else None), text),
    col("XLA temp", "metrics.hlo_temp_bytes", size_bytes)),
    more=(col("library calls", "metrics.hlo_custom_call_targets", text),),
    note=lambda view, rows: ("\"S x S in memory\" and the kernel count come from each JAX row's compiled HLO "
                             "(hlo.py); torch's rows have none. A skipped row says why this backend refused it."))

GROQ_TABLE = Table(GROQ, GROQ, columns=(
    ident("model", "params.model"), col("served by", "metrics.served_by", text),
    col("decode tok/s", "metrics.decode_tok_s", num), col("TTFT", "metrics.ttft_mean_ms", ms),
    col("network RTT", "metrics.network_rtt_ms", ms), col("API queue", "metrics.api_queue_ms", ms),
    col("API prompt", "metrics.api_prompt_ms", ms), col("rest of TTFT", "metrics.ttft_rest_ms", ms),
    col("API decode tok/s", "metrics.api_decode_tok_s", num)),
    note=lambda view, rows: (f"The seed's method throughout (~100-token prompt, 200 tokens, temperature 0, one warmup, "
                             f"5 runs). The seed split its Groq 8B TTFT into {seed.GROQ_TTFT_SPLIT_MS['round_trip']} ms of "
                             f"round trip, {seed.GROQ_TTFT_SPLIT_MS['lpu_compute']} ms of LPU compute and "
                             f"{seed.GROQ_TTFT_SPLIT_MS['api_overhead']} ms of API overhead; Groq's published speculative "
                             f"decoding: {seed.GROQ_SPEC_DECODE_70B_TOK_S.text()} tok/s on a 70B ({seed.GROQ_SPEC_DECODE_70B_TOK_S.by})."))


def at_seed_shape(d):
    return d[(d["params.seq"] == 2048) & (d["params.head_dim"] == 64)]


GOALS = Goals("phase6.goals", (
    Goal("JAX bf16 matmul at N = 8,192, % of torch's cuBLAS in the same run (same wall clock)", MATMUL,
         "metrics.pct_of_torch", 95, "the lab's bar: XLA's matmul within 5% of the library called directly",
         where=lambda d: d[(d["variant"] == "jax_jit") & (d["params.n"] == 8192)]),
    Goal("jax.jit of plain attention at the seed's shape: S x S scores kept out of device memory (1 = in memory)",
         ATTENTION, "metrics.score_materialized", 0, "the seed's TPU v5e: XLA fused matmul, softmax and matmul into one kernel by itself",
         op="<=", pick="min", fmt=lambda x: "-" if missing(x) else ("1 (in memory)" if float(x) else "0 (fused)"),
         where=lambda d: at_seed_shape(d[d["variant"] == "jax_jit_math"])),
    Goal("fastest JAX attention at the seed's shape, % of SDPA's best backend (same wall clock)", ATTENTION,
         "metrics.pct_of_best_sdpa", 90, "the lab's bar: a compiler's attention within 10% of the library's",
         where=lambda d: at_seed_shape(d[d["variant"].str.startswith("jax")]), detail=lambda r: r["variant"]),
), list_unmeasured=True)


def headline(view) -> list[str]:
    out = []
    for _, got in sorted(by_hardware(view.frame, [MATMUL, ATTENTION]).items()):
        parts, name = [], next(iter(got.values())).iloc[0]["hardware_name"]
        m = got.get(MATMUL)
        j = find(m[m["params.n"] == 8192], "jax_jit") if m is not None else None
        if j is not None:
            parts.append(f"JAX bf16 matmul {pct(value(j, 'metrics.pct_of_torch'))} of cuBLAS at N = 8,192")
        a = got.get(ATTENTION)
        plain = find(at_seed_shape(a), "jax_jit_math") if a is not None else None
        if plain is not None:
            parts.append("XLA " + ("fused" if findings.fused(plain) else "did not fuse")
                         + f" attention ({num(value(plain, 'metrics.hlo_kernels'))} kernels)")
        if parts:
            out.append(f"{name}: " + ", ".join(parts))
    if not out:
        tpu = seed.MATMUL_TFLOPS["tpu_v5e"]
        groq = seed.DECODE_TOK_S[("groq_lpu", "llama-3.1-8b")]
        out.append(f"not yet measured here; quoted: TPU v5e {tpu.text()} TFLOP/s through JAX, Groq 8B {groq.text()} tok/s "
                   f"(the seed)")
    return out


PHASE = Phase(6, "Alternative hardware", "phase6_hardware", headline=headline, blocks=(
    MATMUL_TABLE, ATTENTION_TABLE,
    Text("phase6.fusion", findings.fusion),
    GROQ_TABLE,
    Text("phase6.cross_arch", cross_arch.roofline_table),
    Text("phase6.cross_arch_decode", cross_arch.decode_table),
    Plot("phase6.rooflines", "phase6_rooflines", (MATMUL,), plots.rooflines,
         "Every accelerator in hardware.yaml on one roofline, with the lab's measured and others' quoted points",
         hardware=lambda view: ["all"] if len(view.frame.df) and (view.frame.df["phase"] == 6).any() else []),
    Text("phase6.binding", findings.binding),
    GOALS, Text("phase6.findings", findings.findings)))
