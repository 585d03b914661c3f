"""The figures of seed.py as quoted records, so phase 6's tables show them beside the lab's own
rows, labelled with where they come from (source.kind "quoted", source.citation).

    python -m phases.phase6_hardware.quoted        # writes the records results/ lacks; never rewrites one

A quoted row has no timing (nothing was timed here), so it needs no prediction; its metrics hold
the figure as quoted, and derived ones (percent of the spec sheet's peak, TFLOP/s from a time)
computed from hardware.yaml and the quoted shape.

Built on phase 3: its attention FLOP count (counts.py).
"""
import datetime as dt
import sys

from common.cost import cost_block
from common.hardware import load_hardware
from common.records import SCHEMA_VERSION
from phases.phase3_triton.counts import attention_flops

from . import seed

TITLES = {"phase6.jax_matmul": "bf16 matmul, quoted", "phase6.jax_attention": "attention through XLA, quoted",
          "phase6.groq_api": "batch-1 streaming decode, quoted"}
NAMES = {"cloud_api_median": "Cloud API median"}
SEED_MODELS = {"llama-3.1-8b": "Llama 3.1 8B", "llama-3.3-70b": "Llama 3.3 70B"}


def quoted_row(variant: str, params: dict, metrics: dict) -> dict:
    return {"variant": variant, "params": params, "status": "ok", "reason": None, "check": None, "timing": None,
            "metrics": metrics, "prediction": None}


def matmul_rows(key: str, quote: seed.Quote) -> list[dict]:
    spec = load_hardware().get(key)
    peak = spec.peak("bf16").value if spec else None
    variant = {"tpu_v5e": "jax_jit", "wormhole_n300": "community"}.get(key, "torch")
    return [quoted_row(variant, {"n": None, "dtype": "bf16"},
                       {"tflops": quote.value, "tflops_low": quote.low, "tflops_high": quote.high,
                        "peak_tflops": peak, "pct_of_peak_tflops": 100 * quote.value / peak if peak else None,
                        "quote": quote.note})]


def attention_rows() -> list[dict]:
    a = seed.TPU_ATTENTION
    flops = attention_flops(a["batch"], a["heads"], a["seq"], a["head_dim"], False)
    return [quoted_row("jax_jit_math", {"batch": a["batch"], "heads": a["heads"], "seq": a["seq"],
                                        "head_dim": a["head_dim"], "dtype": "bf16", "causal": False},
                       {"ms": a["ms"], "tflops": flops / (a["ms"] * 1e9), "xla_fused_claim": a["claim"]})]


def decode_rows(key: str) -> list[dict]:
    rows = []
    for model, (tok_s, ttft_ms) in seed.GROQ_RUNS[key].items():
        metrics = {"decode_tok_s": tok_s, "ttft_mean_ms": ttft_ms,
                   "served_by": {"groq_lpu": "Groq API", "a100_sxm_80gb": "vLLM, local",
                                 "cloud_api_median": "cloud APIs (median)"}[key]}
        if key == "a100_sxm_80gb" and model == "llama-3.3-70b":
            metrics["devices"] = 2
        if key == "groq_lpu" and model == "llama-3.1-8b":
            split = seed.GROQ_TTFT_SPLIT_MS
            metrics.update(network_rtt_ms=split["round_trip"], lpu_compute_ms=split["lpu_compute"],
                           ttft_rest_ms=split["api_overhead"])
        rows.append(quoted_row("seed", {"model": SEED_MODELS[model], "output_tokens": 200, "runs": 5,
                                        "temperature": 0.0}, metrics))
    return rows


def record(exercise: str, key: str, citation: str, rows: list[dict], params: dict, provenance: dict) -> dict:
    spec = load_hardware().get(key)
    return {
        "schema_version": SCHEMA_VERSION,
        "exercise": {"id": exercise, "phase": 6, "name": exercise.split(".", 1)[1], "title": TITLES[exercise],
                     "bench_version": 1},
        "status": "ok", "reason": None, "params": params, "rows": rows, "summary": {},
        "source": {"kind": "quoted", "citation": citation},
        "hardware": {"key": key, "device": spec.kind if spec else "api", "name": spec.name if spec else NAMES[key],
                     "spec": spec.summary() if spec else None, "spec_matched": spec is not None, "gpu": None,
                     "host": None},
        "software": {}, "provenance": provenance, "cost": cost_block(None, None, 0.0),
    }


def records(provenance: dict | None = None) -> list[dict]:
    """Every quoted record phase 6 shows, built from seed.py."""
    prov = provenance or {"commit": None, "dirty": None, "source": None, "command": None,
                          "started_utc": "1970-01-01T00:00:00Z", "duration_s": 0.0}
    out = [record("phase6.jax_matmul", key, q.source, matmul_rows(key, q), {"sizes": None, "dtype": "bf16"}, prov)
           for key, q in seed.MATMUL_TFLOPS.items()]
    out.append(record("phase6.jax_attention", "tpu_v5e", seed.SEED, attention_rows(), {"dtype": "bf16"}, prov))
    out += [record("phase6.groq_api", key, seed.GROQ_SOURCES[key], decode_rows(key), {"output_tokens": 200}, prov)
            for key in seed.GROQ_RUNS]
    return out


def same(a: dict, b: dict) -> bool:
    """Two records quote the same thing: exercise, hardware, source and rows."""
    keys = lambda r: (r["exercise"]["id"], r["hardware"]["key"], r["source"], r["rows"])   # noqa: E731
    return keys(a) == keys(b)


def main() -> int:
    from common import env
    from common.paths import results_dir
    from common.records import load_records, write_record
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    prov = {**env.git_info(), "command": env.command_line(), "started_utc": started, "duration_s": 0.0}
    folder = results_dir()
    present = load_records(folder, phase=6)
    written = 0
    for rec in records(prov):
        if not any(same(rec, old) for old in present):
            print(f"wrote {write_record(rec, folder).relative_to(folder)}")
            written += 1
    print(f"{written} quoted record(s) written; {len(records()) - written} already in results/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
