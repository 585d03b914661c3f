"""Async scheduling (phase5 engine/overlap.py) off and on, in one process on one engine (one set of
CUDA graphs): each workload runs with the overlap off, then on; the two runs' tokens must be equal
(greedy, EOS ignored: the batches are the same step for step), then their speeds are printed as one
JSON line, with the overlap's own stats (host ms per step, steps whose host work the device hid,
drains and synchronous steps by reason).

    python scripts/overlap_ab.py                       # llama-3.1-8b, bf16, on the GPU (< 2 minutes on an H200)
    python scripts/overlap_ab.py --offline-seqs 0      # without nano-vllm's workload
    python scripts/overlap_ab.py --model tiny --device cpu --decode-tokens 32 --concurrency 4 --output-tokens 16 \\
        --offline-seqs 8 --offline-max-tokens 64       # a CPU smoke run

Workloads: batch-1 decode (a 128-token prompt, --decode-tokens out; median step ms against the copy
roofline: decode weight bytes plus the KV read at the mean context over the measured copy
bandwidth), --concurrency requests at once (128 in, --output-tokens out), and nano-vllm's offline
workload (--offline-seqs sequences, input and output lengths uniform in 100..--offline-max-tokens).
Weights are the named shape's seeded random ones: speed does not depend on their values.
Exit status 1 when a workload's tokens differ between the two runs (its speeds are then not shown).
"""
import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from phases.phase5_inference.benchmark.workload import random_lengths, random_prompts  # noqa: E402
from phases.phase5_inference.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

PROMPT_TOKENS = 128
SEED = 0


def copy_gbps(device: torch.device, nbytes: int = 1 << 30) -> float | None:
    """Device copy bandwidth, bytes read plus written: the lab's own measurement (common.exercise),
    at 1 GiB as quant_engine times it; None off a GPU."""
    from types import SimpleNamespace
    from common.exercise import measure_copy_gbps
    return measure_copy_gbps(SimpleNamespace(device=device), nbytes) if device.type == "cuda" else None


def timed_run(engine: LLMEngine, prompts: list[list[int]], output_lens: list[int]) -> dict:
    """Step the engine through the requests: wall time, output tokens, median decode step ms."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, output_lens)]
    tokens = {i: [] for i in ids}
    decode_ms = []
    sync()
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if engine.last_step.get("kind") == "decode":
            decode_ms.append(engine.last_step["ms"])
    sync()
    wall_s = time.perf_counter() - start
    out_tokens = sum(output_lens)
    decode_ms.sort()
    return {"tokens": [tokens[i] for i in ids], "wall_s": wall_s, "output_tokens": out_tokens,
            "output_tok_s": out_tokens / wall_s, "decode_step_ms_median": decode_ms[len(decode_ms) // 2] if decode_ms else None}


def ab(engine: LLMEngine, name: str, prompts, output_lens, extra=None) -> dict:
    """The workload with the overlap off, then on: tokens compared, speeds and the on-run's stats."""
    runs = {}
    for on in (False, True):
        engine.set_async_scheduling(on)
        runs["on" if on else "off"] = run = timed_run(engine, prompts, output_lens)
        if on:
            run["overlap"] = engine.telemetry["overlap"]
    off, on = runs["off"], runs["on"]
    differing = [i for i, (a, b) in enumerate(zip(off["tokens"], on["tokens"])) if a != b]
    result = {"workload": name, "requests": len(prompts), "output_tokens": off["output_tokens"],
              "tokens_equal": not differing}
    if differing:
        result["first_differing_request"] = differing[0]
        return result
    for key in ("off", "on"):
        runs[key].pop("tokens")
    result.update(off=runs["off"], on=runs["on"], speedup=on["output_tok_s"] / off["output_tok_s"])
    if extra:
        result.update(extra(runs))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--decode-tokens", type=int, default=512)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[8, 64])
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--offline-seqs", type=int, default=256)
    parser.add_argument("--offline-max-tokens", type=int, default=1024)
    args = parser.parse_args()
    for name in ("decode_tokens", "output_tokens", "offline_max_tokens"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.offline_seqs < 0 or any(c < 1 for c in args.concurrency):
        print("error: --offline-seqs must be >= 0 and each --concurrency >= 1", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA GPU here (use --device cpu --model tiny for a smoke run)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    bandwidth = copy_gbps(device)
    longest = max(PROMPT_TOKENS + max(args.decode_tokens, args.output_tokens), 2 * args.offline_max_tokens) + 1
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device,
                                    dtype="bfloat16" if device.type == "cuda" else "float32",
                                    max_num_seqs=max([256, *args.concurrency, args.offline_seqs]),
                                    max_num_batched_tokens=max(16384, longest), max_model_len=longest))
    vocab = engine.shape.vocab_size
    engine.generate([random_prompts(1, 16, vocab, SEED)[0]] * 2, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.set_async_scheduling(True)                 # warm both paths
    engine.generate([random_prompts(1, 16, vocab, SEED)[0]] * 2, SamplingParams(max_tokens=4, ignore_eos=True))
    shape = engine.shape
    results = []

    def roofline(runs):
        context = PROMPT_TOKENS + args.decode_tokens / 2
        if bandwidth is None:
            return {}
        roofline_ms = (shape.decode_weight_bytes() + context * shape.kv_bytes_per_token()) / (bandwidth * 1e9) * 1e3
        return {"copy_gbps": bandwidth, "roofline_step_ms": roofline_ms,
                **{f"pct_of_copy_roofline_{k}": 100 * roofline_ms / runs[k]["decode_step_ms_median"] for k in runs}}

    results.append(ab(engine, "batch-1 decode", random_prompts(1, PROMPT_TOKENS, vocab, SEED + 1),
                      [args.decode_tokens], roofline))
    for c in args.concurrency:
        results.append(ab(engine, f"{c} concurrent", random_prompts(c, PROMPT_TOKENS, vocab, SEED + c),
                          [args.output_tokens] * c))
    if args.offline_seqs:
        lengths = (100, args.offline_max_tokens) if args.offline_max_tokens >= 100 else (1, args.offline_max_tokens)
        results.append(ab(engine, "nano-vllm offline", random_prompts(args.offline_seqs, lengths, vocab, SEED),
                          random_lengths(args.offline_seqs, *lengths, SEED + 1)))
    print(json.dumps({"model": shape.name, "device": engine.telemetry["device_name"], "results": results}, indent=1))
    return 0 if all(r["tokens_equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
