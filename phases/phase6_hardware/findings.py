"""Phase 6's findings: sentences whose every number comes from the newest records per GPU, from
hardware.yaml (through architectures.py), or from seed.py (named as such)."""
from common.formats import bullets, num, pct, size_bytes
from common.frame import by_hardware, find, value

from . import seed
from .architectures import DECODE_MODELS, architectures, matmul_binds
from .cross_arch import MODEL_LABEL, measured_decode

SEED_SHAPE = dict(batch=4, heads=16, seq=2048, head_dim=64)


def _ms(r) -> str:
    return f"{num(value(r, 'metrics.wall_ms'))} ms"


def fused(r) -> bool:
    """XLA fused attention: no S x S buffer of its own between kernels."""
    return value(r, "metrics.score_materialized") is False


def verdict(r) -> str:
    """What the HLO of one JAX attention row says, in a sentence."""
    hlo = value(r, "metrics.hlo", {}) or {}
    one = hlo.get("attention_in_one_fusion")
    if not fused(r):
        return (f"its scores sit in device memory between kernels (largest {hlo.get('largest_score_buffer')}, "
                f"{size_bytes(hlo.get('largest_score_buffer_bytes'))}; temp {size_bytes(hlo.get('temp_bytes'))}, "
                f"{num(hlo.get('temp_over_bf16_scores'))}x a bf16 score matrix): XLA did not fuse attention.")
    if one:
        return (f"one fusion ({one}) holds both matmuls and the softmax and XLA allocated no S x S buffer: XLA fused "
                "attention" + (" (into a library's fusion, whose own scratch memory the HLO does not show)."
                               if one.startswith("kCustom") else "."))
    if hlo.get("library_attention"):
        return f"XLA handed attention to a library's fused kernel ({hlo['library_attention']}), no S x S buffer of its own."
    return "no S x S buffer is in device memory: XLA fused attention."


def fusion(view) -> str:
    """Did XLA fuse attention on this GPU: the HLO's answer, beside the library's and our kernel's times."""
    out = []
    for _, got in sorted(by_hardware(view.frame, ["phase6.jax_attention"]).items()):
        rows = got["phase6.jax_attention"]
        name = rows.iloc[0]["hardware_name"]
        parts = []
        for shape in sorted({(int(r["params.batch"]), int(r["params.heads"]), int(r["params.seq"]), int(r["params.head_dim"]))
                             for _, r in rows.iterrows()}):
            p = dict(zip(("batch", "heads", "seq", "head_dim"), shape))
            mine = rows[(rows["params.batch"] == p["batch"]) & (rows["params.seq"] == p["seq"])
                        & (rows["params.heads"] == p["heads"]) & (rows["params.head_dim"] == p["head_dim"])]
            plain = find(mine, "jax_jit_math")
            if plain is None:
                continue
            targets = value(plain, "metrics.hlo_custom_call_targets")
            at = f"B={p['batch']}, H={p['heads']}, S={p['seq']}, d={p['head_dim']}"
            parts.append(f"At {at}, jax.jit of the plain math compiled to {num(value(plain, 'metrics.hlo_kernels'))} "
                         f"kernels ({num(value(plain, 'metrics.hlo_fusions'))} fusions, "
                         f"{num(value(plain, 'metrics.hlo_custom_calls'))} library calls{': ' + targets if targets else ''}); "
                         + verdict(plain))
            times = [f"the plain math takes {_ms(plain)}"]
            best = mine[mine["variant"].str.startswith("sdpa") & (mine["status"] == "ok")]
            if len(best):
                b = best.loc[best["metrics.wall_ms"].astype(float).idxmin()]
                times.append(f"SDPA's best backend ({b['variant']}) {_ms(b)}")
            tri = find(mine, "triton")
            if tri is not None:
                times.append(f"the phase 3 Triton kernel {_ms(tri)}")
            avoided = [r["variant"] for _, r in mine.iterrows() if r["status"] == "ok" and r["variant"].startswith("jax")
                       and fused(r)]
            refused = [f"{r['variant']} ({r['reason']})" for _, r in mine.iterrows()
                       if r["status"] == "skipped" and r["variant"].startswith("jax")]
            parts.append(f"At {at}, " + ", ".join(times) + ". Without S x S buffers: "
                         + (", ".join(avoided) or "none of the JAX variants") + ".")
            if refused:
                parts.append(f"Refused at {at}: " + "; ".join(refused) + ".")
        if parts:
            out.append(bullets(parts, f"{name}:"))
    if not out:
        out.append("Not measured here yet: `lab run phase6.jax_attention` compiles attention on this machine's GPU "
                   "and reads the answer from the HLO.")
    a = seed.TPU_ATTENTION
    out.append(bullets([f"On a TPU v5e at B={a['batch']}, H={a['heads']}, S={a['seq']}, d={a['head_dim']}: {a['ms']} ms "
                        f"through jax.jit, and by its account {a['claim']} ({seed.SEED})."], "The seed, quoted:"))
    return "\n\n".join(out)


def binding(view) -> str:
    """Per architecture: what binds batch-1 decode, and what binds a training-sized matmul."""
    measured = measured_decode(view)
    lines = []
    for a in architectures():
        decode = []
        for m in DECODE_MODELS:
            d = a.decode.get(m)
            if d is None:
                continue
            what = f"{MODEL_LABEL[m]}: {d.binds}"
            if (a.key, m) in measured:
                what += f" (measured here on one device: {num(measured[(a.key, m)])} tok/s"
                what += (f"; the sheet's {a.memory_gb:g} GB is short of {d.weight_bytes / 1e9:.1f} GB, the device "
                         "holds more than its headline figure)" if not d.fits else ")")
            decode.append(what)
        lines.append(f"- **{a.name}**\n" + "\n".join(f"  - Decode, {what}." for what in decode or
                                                      ["no bandwidth in hardware.yaml"])
                     + f"\n  - Training-sized matmul: {matmul_binds(a)}.")
    return "\n".join(lines)


def findings(view) -> str:
    out = []
    for _, got in sorted(by_hardware(view.frame, ["phase6.jax_matmul", "phase6.groq_api"]).items()):
        parts = []
        m = got.get("phase6.jax_matmul")
        name = next(iter(got.values())).iloc[0]["hardware_name"]
        if m is not None:
            big = m[m["params.n"] == m["params.n"].max()]
            j, t = find(big, "jax_jit"), find(big, "torch")
            if j is not None and t is not None:
                parts.append(f"At N = {int(j['params.n']):,}, jax.jit's bf16 matmul runs at {num(j['metrics.tflops'])} "
                             f"TFLOP/s, {pct(value(j, 'metrics.pct_of_torch'))} of torch's {value(t, 'metrics.library', '')} "
                             f"timed the same way ({num(value(t, 'metrics.tflops'))} TFLOP/s by CUDA events); XLA "
                             f"compiled it to {value(j, 'metrics.hlo_custom_call_targets') or value(j, 'metrics.hlo_fusion_kinds') or 'its own kernels'}.")
            tri = find(big, "triton")
            if tri is not None:
                parts.append(f"The phase 3 Triton kernel reaches {pct(value(tri, 'metrics.pct_of_torch'))} of torch the same way.")
        g = got.get("phase6.groq_api")
        if g is not None:
            for _, r in g[g["status"] == "ok"].iterrows():
                parts.append(f"{r['params.model']} through {value(r, 'metrics.served_by')}: {num(r['metrics.decode_tok_s'])} tok/s "
                             f"after the first token, TTFT {num(r['metrics.ttft_mean_ms'])} ms, of which the network round "
                             f"trip is {num(r['metrics.network_rtt_ms'])} ms"
                             + (f", the API's queue {num(value(r, 'metrics.api_queue_ms'))} ms and prompt "
                                f"{num(value(r, 'metrics.api_prompt_ms'))} ms" if value(r, "metrics.api_queue_ms") is not None else "")
                             + f" and the rest {num(r['metrics.ttft_rest_ms'])} ms.")
        if parts:
            out.append(bullets(parts, f"{name}:"))
    split = seed.GROQ_TTFT_SPLIT_MS
    out.append(bullets([
        f"The seed's Groq run split its 8B TTFT of {seed.GROQ_RUNS['groq_lpu']['llama-3.1-8b'][1]} ms into about "
        f"{split['network']} ms of network (its round trip to the API measured about {split['round_trip']} ms), "
        f"{split['lpu_compute']} ms of LPU compute and {split['api_overhead']} ms of API infrastructure ({seed.SEED}).",
        f"Groq publishes {seed.GROQ_SPEC_DECODE_70B_TOK_S.value:,g} tok/s for Llama 3 70B with speculative decoding "
        f"({seed.SEED})."], "The seed, quoted:"))
    return "\n\n".join(out)
