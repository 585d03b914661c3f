"""Exercise 5.3: speculative decoding with models the lab trains itself, a draft of the target's own
text, a draft of other text, and prompt lookup, against the target alone.

    lab run phase5.speculative [--param ks=[2,4] --param temperatures=[0] --param concurrency=[1]]

Random weights cannot agree with each other, so the models are trained (trained_models.py, in the
engine's Llama architecture, GPT-2 BPE): the target and the matched draft on TinyShakespeare, the
distilled draft on the same text against the target's distribution, the mismatched draft on the
Python standard library's sources (the same vocabulary, other text). They are cached in
<repo>/.lab_cache/speculative/ and trained when missing; each one's validation loss, and each
draft's top-1 agreement with the target on the validation split, is in the summary. Prompts are
windows of the TinyShakespeare validation split.

Variants:
  target      the target alone: the baseline of every speedup, at each temperature and concurrency
  matched     the Shakespeare draft proposes k tokens
  distilled   the Shakespeare draft taught the target's distribution proposes k tokens
  mismatched  the Python draft proposes k tokens
  ngram       prompt lookup (engine/speculator.py): no draft model
One engine serves every row: the target with room for max(ks) proposals, its proposer switched
between runs. Per (variant, k, temperature, concurrency): acceptance rate (kept / proposed), mean
tokens per verify pass (kept + 1), decode tok/s and its ratio to the target alone in the same run.

The prediction, made before the row is timed from step times measured first (each a median over
`step_reps` forward passes of the engine's runners, host-synchronous as the engine runs them):
    speedup = E[tokens per verify] x t_target / (k x t_draft + t_verify(k + 1))
t_target and t_draft one token per sequence, t_verify k + 1 per sequence, at the row's concurrency;
prompt lookup's k x t_draft is its measured lookup time per step, and its t_verify is at the mean
number of tokens it proposed. E is the row's own measured mean. The ratio measured / predicted says
what the formula leaves out (accepting, rolling back, the host's bookkeeping).

Correctness gates timing: at temperature 0 every speculative output must equal the target alone's
output for the same prompts, token for token; where it differs, the target's top two logits at the
first difference must be within NEAR_TIE_ULPS bf16 steps (the verify pass multiplies k + 1 rows
where the target alone multiplies one, and a tie may round either way), else the row fails.

Built on phase 7: its corpus and batches (data.py, train.py) train and check the drafts.
"""
import math
import statistics
import time

import numpy as np

from common.exercise import Exercise, Needs, Result, Work, measure_copy_gbps, row
from common.params import Bool, Choice, Float, Int
from common.standalone import run_alone
from common.timing import summarize

from .predictions.analysis import decode_parts, mean_decode_context
from .models.model_choice import SEED, release_memory
from .predictions import kernel_lists
from .predictions.prediction import summed_prediction

VARIANTS = ("target", "matched", "distilled", "mismatched", "ngram")
DRAFTS = ("matched", "distilled", "mismatched", "ngram")
MODEL_SETS = {"lab": {"target": "shakespeare-target", "matched": "shakespeare-draft",
                      "distilled": "shakespeare-distilled", "mismatched": "python-draft"},
              "tiny": {"target": "tiny-target", "matched": "tiny-draft", "distilled": "tiny-distilled",
                       "mismatched": "tiny-python-draft"}}
NEAR_TIE_ULPS = 2
STEP_WARMUP = 5
NOT_A_ROOFLINE_TEST = ("speedup formula: a speculative step chains k draft forwards, a verify pass and the host's "
                       "acceptance; its prediction is metrics.predicted_speedup, the roofline of its forwards a reference")


# ------------------------------------------------------------------------------ the models and prompts
def trained(ctx, params) -> tuple[dict, dict]:
    """({role: checkpoint folder}, {role: training info}), trained where the cache lacks them."""
    from .models.trained_models import checkpoint
    folders, infos = {}, {}
    for role, name in MODEL_SETS[params["models"]].items():
        folders[role], infos[role] = checkpoint(name, ctx.device, use_cache=params["use_cache"],
                                                progress=training_progress(name))
    return folders, infos


def agreement_with_target(folders: dict, models: str, device, tokens: int) -> dict:
    """{draft role: {val_kl_to_teacher, val_top1_agreement}} against the target on `tokens` of the
    TinyShakespeare validation split (evenly spaced windows): how often each draft's argmax is the
    target's, the greedy acceptance rate at k = 1 before the engine measures it."""
    from phases.phase7_gpt.train import Batches

    from .models.llama_training import compare_to_teacher
    from .models.trained_models import MODELS, corpus_ids, load_trained
    names = MODEL_SETS[models]
    target = load_trained(folders["target"], MODELS[names["target"]].shape, device)
    settings = MODELS[names["matched"]].settings
    train, val, _ = corpus_ids("shakespeare")
    windows, _ = Batches(train, val, settings.seq_len, device, 0).windows("val", tokens)
    out = {}
    for role in ("matched", "distilled", "mismatched"):
        draft = load_trained(folders[role], MODELS[names[role]].shape, device)
        out[role] = compare_to_teacher(draft, target, windows, settings.batch_size)
        del draft
    return out


def training_progress(name: str):
    last = [0.0]

    def report(step: int, steps: int, loss: float) -> None:
        now = time.perf_counter()
        if step == steps or now - last[0] > 10:
            last[0] = now
            print(f"  training {name}: step {step}/{steps}, loss {loss:.3f}", flush=True)
    return report


def shakespeare_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """`count` windows of `length` tokens from the TinyShakespeare validation split, seeded."""
    from phases.phase7_gpt import data as D
    _, val = D.load_splits(D.resolve_data_dir())
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(val) - length - 1, size=count)
    return [val[s:s + length].astype(np.int64).tolist() for s in starts]


# ------------------------------------------------------------------------------ step times
def step_ms(engine, runner, batch: int, rows_per_seq: int, context: int, reps: int, temperature: float = 0.0) -> float:
    """Median wall time of one forward of `runner` over `batch` sequences of `context` cached
    tokens, `rows_per_seq` rows each, and the read of a token per row: one draft step (1 row), one
    target step (1 row) or one verify pass (k + 1 rows), as the engine runs them. At a temperature
    the token is drawn (softmax, the exponential race) instead of the graph's argmax."""
    from .engine.sampler import categorical
    from .engine import SamplingParams, Sequence
    pool = engine.scheduler.block_pool
    seqs = [Sequence(f"probe-{i}", [1] * (context + rows_per_seq), SamplingParams()) for i in range(batch)]
    for seq in seqs:
        pool.allocate(seq)
    rows = [seq for seq in seqs for _ in range(rows_per_seq)]
    positions = [context - 1 + j for _ in seqs for j in range(rows_per_seq)]
    times = []
    try:
        for rep in range(STEP_WARMUP + reps):
            start = time.perf_counter()
            logits, argmax = runner.rows_logits(rows, positions)
            if temperature > 0:
                probs = (logits / temperature).softmax(dim=1)
                argmax = categorical(probs)
            runner.read_tokens(logits.argmax(dim=1) if argmax is None else argmax)
            if rep >= STEP_WARMUP:
                times.append((time.perf_counter() - start) * 1e3)
    finally:
        for seq in seqs:
            pool.free(seq)
    return float(np.median(times))


def measured_step_times(engine, proposers: dict, params, context: int) -> dict:
    """{(temperature, concurrency): {"target": ms, "verify": {rows per seq: ms}, "draft": {variant: ms}}}."""
    out = {}
    reps = params["step_reps"]
    for temperature in params["temperatures"]:
        for c in params["concurrency"]:
            verify = {j: step_ms(engine, engine.runner, c, j, context, reps, temperature)
                      for j in range(1, max(params["ks"]) + 2)}
            drafts = {v: step_ms(engine, p.runner, c, 1, context, reps, temperature)
                      for v, p in proposers.items() if hasattr(p, "runner")}
            out[temperature, c] = {"target": verify[1], "verify": verify, "draft": drafts}
    return out


def verify_ms_at(verify: dict, rows_per_seq: float) -> float:
    """t_verify at a fractional number of rows per sequence (prompt lookup proposes fewer than k)."""
    low = max(1, min(int(math.floor(rows_per_seq)), max(verify)))
    high = min(low + 1, max(verify))
    return verify[low] + (verify[high] - verify[low]) * (rows_per_seq - low)


def predicted_speedup(tokens_per_verify: float, t_target: float, t_propose: float, t_verify: float) -> float:
    return tokens_per_verify * t_target / (t_propose + t_verify)


# ------------------------------------------------------------------------------ a run
def decode_run(engine, prompts: list[list[int]], concurrency: int, sampling) -> dict:
    """The prompts through the engine with `concurrency` requests in flight (a finished one is
    replaced at once, as a serving benchmark's clients do); decode steps timed (steps that prefill
    left out), with the tokens they emitted, and the outputs in prompt order."""
    queue = list(enumerate(prompts))
    produced: dict[str, list[int]] = {}
    order: dict[str, int] = {}
    decode_s, decode_tokens, steps, step_times, in_flight = 0.0, 0, 0, [], 0
    while queue or engine.has_unfinished():
        while queue and in_flight < concurrency:
            index, prompt = queue.pop(0)
            request = engine.add_request(prompt, sampling)
            order[request], produced[request] = index, []
            in_flight += 1
        prefill = bool(engine.scheduler.waiting)
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        for o in outs:
            produced[o.request_id] += o.new_token_ids
            in_flight -= o.finished
        if not prefill:
            decode_s += elapsed
            decode_tokens += sum(len(o.new_token_ids) for o in outs)
            steps += 1
            step_times.append(elapsed * 1e3)
    outputs = [produced[r] for r in sorted(produced, key=order.get)]
    return {"outputs": outputs, "decode_s": decode_s, "decode_tokens": decode_tokens, "steps": steps,
            "step_ms": step_times, "tok_s": decode_tokens / decode_s if decode_s else None}


def greedy_gate(engine, prompts, outputs, reference) -> dict:
    """Speculative greedy outputs against the target alone's: identical, or differing first at a
    near tie of the target's logits."""
    if outputs == reference:
        return {"passed": True, "identical": True, "reason": "token for token the target alone's output"}
    i = next(n for n, (a, b) in enumerate(zip(outputs, reference)) if a != b)
    j = next((n for n, (a, b) in enumerate(zip(outputs[i], reference[i])) if a != b),
             min(len(outputs[i]), len(reference[i])))
    top2 = target_top_two(engine, prompts[i] + reference[i][:j])
    ulp = 2.0 ** (math.floor(math.log2(max(abs(top2[0]), 1e-30))) - 7)
    gap = top2[0] - top2[1]
    passed = gap <= NEAR_TIE_ULPS * ulp
    return {"passed": passed, "identical": False, "request": i, "position": j, "top2_gap": gap,
            "bf16_ulp": ulp, "reason": (f"request {i} differs at output token {j}, where the target's top two logits are "
                                        f"{gap:.4g} apart ({gap / ulp:.1f} bf16 steps; a near tie is <= {NEAR_TIE_ULPS})")}


def target_top_two(engine, tokens: list[int]) -> list[float]:
    from .engine import SamplingParams, Sequence
    seq = Sequence("near-tie probe", tokens, SamplingParams())
    engine.scheduler.block_pool.allocate(seq)
    try:
        logits = engine.runner.prefill_logits([seq])[0]
        return logits.topk(2).values.tolist()
    finally:
        engine.scheduler.block_pool.free(seq)


# ------------------------------------------------------------------------------ the exercise
def run(ctx, params):
    from .engine import EngineConfig, LLMEngine, SamplingParams, from_checkpoint
    from .engine.speculator import NgramProposer

    folders, infos = trained(ctx, params)
    agreement = agreement_with_target(folders, params["models"], ctx.device, params["agreement_tokens"])
    target_shape, draft_shape = from_checkpoint(folders["target"]), from_checkpoint(folders["matched"])
    k_max, concurrency = max(params["ks"]), list(params["concurrency"])
    prompt_len, out_len = params["prompt_tokens"], params["output_tokens"]
    max_model_len = prompt_len + out_len + k_max + 1
    blocks_per_seq = -(-max_model_len // params["block_size"])
    engine = LLMEngine(EngineConfig(
        model=str(folders["target"]), dtype="bfloat16" if ctx.is_cuda else "float32", device=ctx.device.type,
        block_size=params["block_size"], max_num_seqs=max(concurrency), max_model_len=max_model_len,
        max_num_batched_tokens=max(2048, max_model_len), num_kv_blocks=2 * max(concurrency) * blocks_per_seq + 8,
        speculative_model=str(folders["matched"]), num_speculative_tokens=k_max, seed=params["seed"]))
    try:
        proposers = {"matched": engine.speculator.proposer,
                     "distilled": engine.draft_proposer(str(folders["distilled"])),
                     "mismatched": engine.draft_proposer(str(folders["mismatched"])),
                     "ngram": NgramProposer()}
        prompts = shakespeare_prompts(params["requests"] * max(concurrency), prompt_len, params["seed"])
        context = int(mean_decode_context(prompt_len, out_len))
        engine.speculate(None)
        decode_run(engine, prompts[:1], 1, SamplingParams(max_tokens=8, ignore_eos=True))     # warm
        times = measured_step_times(engine, proposers, params, context)
        copy_gbps = measure_copy_gbps(ctx, 1 << 30) if ctx.is_cuda else measure_copy_gbps(ctx)
        rows = []
        for temperature in params["temperatures"]:
            sampling = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=temperature)
            for c in concurrency:
                chosen = prompts[:params["requests"] * c]
                engine.speculate(None)
                base = decode_run(engine, chosen, c, sampling)
                identity = {"temperature": temperature, "concurrency": c, "prompt_tokens": prompt_len,
                            "output_tokens": out_len, "requests": len(chosen)}
                if ctx.wants("target"):
                    rows.append(target_row(ctx, identity, base, times[temperature, c], target_shape, context, engine,
                                           copy_gbps))
                for variant in DRAFTS:
                    if not ctx.wants(variant):
                        continue
                    for k in ctx.track(params["ks"], f"{variant} at T={temperature}, {c} at once"):
                        engine.speculate(proposers[variant], k)
                        spec = decode_run(engine, chosen, c, sampling)
                        rows.append(speculative_row(ctx, variant, {**identity, "k": k}, spec, base, engine, chosen,
                                                    times[temperature, c], target_shape, draft_shape, context))
                        engine.speculator.reset_stats()
        engine.speculate(None)
        summary = {"models": {role: public_info(info) for role, info in infos.items()},
                   "agreement_with_target": agreement,
                   "target_params": target_shape.params(), "draft_params": draft_shape.params(),
                   "step_ms": {f"T={t} x{c}": v for (t, c), v in times.items()}, "copy_gbps": copy_gbps,
                   **memory_bound_summary(target_shape, times, copy_gbps),
                   "formula": "E[tokens per verify] x t_target / (k x t_draft + t_verify(k + 1))"}
        return Result(rows, summary)
    finally:
        del engine
        release_memory(ctx)


def public_info(info: dict) -> dict:
    """Training info without the loss curve (the record keeps what the README reads)."""
    return {k: v for k, v in info.items() if k != "loss_curve"}


def memory_bound_summary(target_shape, times: dict, copy_gbps: float) -> dict:
    """Is the target's batch-1 step memory-bound? Its time beside its weights' copy time and the
    draft's step (a model whose step is mostly launches)."""
    one = times[min(times)]                                    # the lowest temperature, one request
    roofline_ms = target_shape.decode_weight_bytes() / (copy_gbps * 1e6)
    draft_ms = min(one["draft"].values()) if one["draft"] else None
    return {"target_step_ms": one["target"], "target_copy_roofline_ms": roofline_ms,
            "target_pct_of_copy_roofline": 100 * roofline_ms / one["target"],
            "draft_step_ms": draft_ms, "target_over_draft_step": one["target"] / draft_ms if draft_ms else None}


def target_row(ctx, identity, base, times, shape, context, engine, copy_gbps) -> dict:
    c = identity["concurrency"]
    timing = summarize(base["step_ms"], "engine decode step wall time (host-synchronous)", warmup_calls=1,
                       flush_l2=False)
    parts = decode_parts(shape, c, context)
    metrics = {"ms": timing.median_ms, "decode_step_ms": timing.median_ms, "decode_tok_s": base["tok_s"],
               "t_target_ms": times["target"], "speedup_vs_target": 1.0,
               "copy_roofline_ms": sum(b for _, b in parts) / (copy_gbps * 1e6)}
    prediction = summed_prediction(ctx, parts, "bf16" if ctx.is_cuda else "fp32", timing.median_ms,
                                   launches=engine.telemetry.get("kernels_per_decode_step") or 1,
                                   graphed=ctx.is_cuda, what="parts of a decode step")
    return row("target", {**identity, "k": 0}, timing=timing, metrics=metrics, prediction=prediction)


def speculative_row(ctx, variant, identity, spec, base, engine, prompts, times, target_shape, draft_shape,
                    context) -> dict:
    k, c = identity["k"], identity["concurrency"]
    stats = engine.speculator.stats
    check = {"passed": True, "reason": "sampled (temperature > 0): no token-for-token reference"}
    if identity["temperature"] == 0:
        check = greedy_gate(engine, prompts, spec["outputs"], base["outputs"])
        if not check["passed"]:
            return row(variant, identity, "failed", check["reason"], check=check)
    passes = stats["verify_passes"]
    tokens_per_verify = stats["emitted"] / passes
    proposed_per_verify = stats["proposed"] / passes
    if variant == "ngram":
        t_propose = stats["propose_s"] * 1e3 / spec["steps"]
        t_verify = verify_ms_at(times["verify"], proposed_per_verify + 1)
    else:
        t_propose = k * times["draft"][variant]
        t_verify = times["verify"][k + 1]
    predicted = predicted_speedup(tokens_per_verify, times["target"], t_propose, t_verify)
    measured = spec["tok_s"] / base["tok_s"]
    timing = summarize(spec["step_ms"], "engine speculative step wall time (propose, verify, accept; "
                                        "host-synchronous)", warmup_calls=0, flush_l2=False)
    metrics = {"ms": timing.median_ms, "decode_step_ms": timing.median_ms, "decode_tok_s": spec["tok_s"],
               "target_tok_s": base["tok_s"], "speedup_vs_target": measured, "predicted_speedup": predicted,
               "speedup_measured_over_predicted": measured / predicted,
               "acceptance_rate": stats["kept"] / stats["proposed"] if stats["proposed"] else None,
               "tokens_per_verify": tokens_per_verify, "proposed_per_verify": proposed_per_verify,
               "t_target_ms": times["target"], "t_draft_ms": times["draft"].get(variant),
               "t_propose_ms": t_propose, "t_verify_ms": t_verify,
               "propose_ms_per_step": stats["propose_s"] * 1e3 / spec["steps"],
               "verify_ms_per_step": stats["verify_s"] * 1e3 / spec["steps"],
               "target_engine_step_ms": statistics.median(base["step_ms"]),
               "greedy_identical": check.get("identical")}
    dtype = "bf16" if ctx.is_cuda else "fp32"
    parts = decode_parts(target_shape, round(c * (proposed_per_verify + 1)), context)
    if variant != "ngram":
        parts = [p for _ in range(k) for p in decode_parts(draft_shape, c, context)] + parts
    prediction = summed_prediction(ctx, parts, dtype, timing.median_ms,
                                   launches=(engine.telemetry.get("kernels_per_decode_step") or 1) * (1 + (variant != "ngram") * k),
                                   graphed=ctx.is_cuda, what="forward passes of a speculative step (k drafts, one verify)")
    prediction["excluded"] = NOT_A_ROOFLINE_TEST
    return row(variant, identity, check=check, timing=timing, metrics=metrics, prediction=prediction)


def work(params) -> list[Work]:
    from .models.trained_models import MODELS
    names = MODEL_SETS[params["models"]]
    target, draft = MODELS[names["target"]].shape, MODELS[names["matched"]].shape
    context = mean_decode_context(params["prompt_tokens"], params["output_tokens"])
    out = []
    for c in params["concurrency"]:
        for label, shape, batch in (("target step", target, c), ("draft step", draft, c)):
            (mf, mb), (af, ab) = decode_parts(shape, batch, context)
            out.append(Work(f"{label} at {c} at once", mf + af, mb + ab, "bf16"))
        for k in params["ks"]:
            (mf, mb), (af, ab) = decode_parts(target, c * (k + 1), context)
            out.append(Work(f"verify pass of {k} + 1 tokens at {c} at once", mf + af, mb + ab, "bf16"))
    return out


def footprint_bytes(params) -> float:
    """Training the target dominates: fp32 weights, gradients and AdamW's two moments."""
    from .models.trained_models import MODELS
    return 16 * MODELS[MODEL_SETS[params["models"]]["target"]].shape.params()


EXERCISE = Exercise(
    id="phase5.speculative",
    title="Speculative decoding with trained models: a matched draft, a mismatched draft and prompt lookup, k = 1..8, "
          "acceptance and speedup against the target alone, beside the predicted speedup",
    run=run, needs=Needs(cuda=True, modules=("triton", "safetensors", "tiktoken")),
    variants=VARIANTS,
    workloads=kernel_lists.speculative_workloads,
    params={"models": Choice("lab", tuple(MODEL_SETS), help="lab: the three trained models; tiny: test-sized"),
            "ks": Int(list(range(1, 9)), min=1, max=8, many=True, unit="tokens proposed per step"),
            "temperatures": Float([0.0, 0.8], min=0.0, max=2.0, many=True),
            "concurrency": Int([1, 4, 16], min=1, max=64, many=True, unit="requests at once"),
            "prompt_tokens": Int(64, min=4, max=1024, unit="tokens"),
            "output_tokens": Int(128, min=2, max=1024, unit="tokens per request"),
            "requests": Int(4, min=1, max=64, help="requests per slot: concurrency c runs requests x c, c in flight"),
            "agreement_tokens": Int(32768, min=256, max=1 << 20, unit="validation tokens",
                                    help="tokens over which each draft's top-1 agreement with the target is counted"),
            "step_reps": Int(50, min=5, max=1000, help="forward passes per measured step time (median)"),
            "block_size": Int(16, choices=(8, 16, 32, 64), unit="tokens per KV block"),
            "use_cache": Bool(True, help="reuse trained models from <repo>/.lab_cache/speculative/ (and save them)"),
            "seed": SEED},
    cpu_params={"models": "tiny", "ks": [1, 3], "concurrency": [1, 2], "output_tokens": 12, "requests": 2,
                "prompt_tokens": 16, "step_reps": 5, "agreement_tokens": 512},
    quick_params={"ks": [1, 2, 4], "concurrency": [1, 4], "output_tokens": 64, "requests": 2},
    footprint_bytes=footprint_bytes, work=work)


if __name__ == "__main__":
    run_alone(EXERCISE, {"ks": [2, 4], "concurrency": [1]})
