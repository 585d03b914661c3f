"""What every rank of a tensor-parallel job runs, started by phase 4's launcher (launch.py):

    python -m torch.distributed.run --standalone --nproc_per_node N \\
        -m phases.phase5_inference.benchmark.tp_worker <task> '<job json>' <result file>

Every rank makes the same engine calls (the engine's SPMD use, engine/tp_ranks.py); rank 0
writes the result. Tasks:
  bench     phase5.tensor_parallel at one TP size: per model, the engine's TTFT and decode steps
            (one warm-up request, then `runs`), its CUDA-graph step with and without the all-reduces,
            and its teacher-forced logits on the reference tokens (the check); NCCL against the
            one-shot all-reduce per size
  generate  greedy tokens on every rank and each rank's shards and KV pool (the CPU tests);
            drive=rank0 has rank 0 drive (DrivenEngine) while the others follow
  allreduce every all-reduce the engine can use, against exact sums at irregular sizes
A rank's life (markers pid, stage, error; the process group; the result file; the test hook
LAB_PHASE4_FAULT, crash:R or hang:R) is phase 4's worker.main with these tasks.

Built on phase 4: its launcher and worker (launch.py, worker.py) run the ranks.
"""
import gc
import sys
import time
import traceback

import torch

FINGERPRINT_IDS = 128           # vocabulary ids whose logits the check compares, at every checked position
FINGERPRINT_SEED = 1234


# ------------------------------------------------------------------------------ the engine, as every rank builds it
def engine_for(me, p: dict, model: str, **settings):
    from ..engine import EngineConfig, LLMEngine
    config = EngineConfig(model=model, seed=p["seed"], dtype=p["dtype"],
                          device="cuda" if me.backend == "nccl" else "cpu", block_size=p.get("block_size", 16),
                          tensor_parallel=me.world, allreduce=p.get("allreduce", "auto"), **settings)
    return LLMEngine(config)


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def timed_request(engine, prompt: list[int], tokens: int) -> dict:
    """One greedy request alone: the first step's time (prefill and first token: TTFT as the engine
    sees it) and the mean of the decode steps after it (TPOT), by the host clock."""
    from ..engine import SamplingParams
    if engine.tp is not None:                    # every rank starts the request together
        engine.tp.line_up()
    engine.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    out, stamps = [], []
    start = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
        stamps.append(time.perf_counter())
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ttft_ms": 1e3 * (stamps[0] - start), "tpot_ms": 1e3 * sum(steps) / len(steps) if steps else None,
            "tokens": out}


def teacher_forced(engine, prompt: list[int], reference: list[int]) -> dict:
    """The engine's fp32 logits at every position that predicts a reference token, from one eager
    prefill of prompt + reference: the logits of FINGERPRINT_IDS fixed vocabulary ids, how far the
    reference token scores below the best logit (gap), the argmax, and the logits' spread."""
    from ..engine import SamplingParams, Sequence
    seq = Sequence("check", list(prompt) + list(reference), SamplingParams(max_tokens=1))
    pool = engine.scheduler.block_pool
    pool.allocate(seq)
    try:
        logits = engine.runner.prefill_logits([seq], all_positions=True)
    finally:
        pool.free(seq)
    rows = logits[len(prompt) - 1:len(prompt) - 1 + len(reference)].float()
    vocab = rows.shape[1]
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(FINGERPRINT_SEED))[:FINGERPRINT_IDS]
    chosen = torch.tensor(reference, device=rows.device)
    gaps = rows.max(dim=1).values - rows.gather(1, chosen[:, None]).squeeze(1)
    return {"fingerprint": rows[:, ids.to(rows.device)].tolist(), "gaps": gaps.tolist(),
            "argmax": rows.argmax(dim=1).tolist(), "logit_std": float(rows.std(dim=1).mean()),
            "positions": len(reference)}


def decode_step_ms(engine, context_tokens: int, reps: int, allreduce: bool = True) -> float:
    """Median ms of one batch-1 decode step over `context_tokens` cached tokens (the runner's
    decode_probe: its CUDA graph replayed, or an eager forward without graphs), `reps` samples
    back to back by common/timing.py with warm caches. Every rank calls it at once and makes the
    same number of calls (no warm-up sized by time: the graphs hold collectives)."""
    from common.timing import benchmark
    step = engine.runner.decode_probe(context_tokens, allreduce)
    if engine.tp is not None:
        engine.tp.line_up()
    return benchmark(step, engine.device, warmup_ms=0.0, target_ms=0.0, min_samples=reps, max_samples=reps,
                     flush_l2=False).median_ms


TELEMETRY = ("weights_bytes", "kv_pool_bytes", "kv_capacity_tokens", "num_kv_blocks", "block_size", "gpu_total_bytes",
             "activation_reserve_bytes", "other_gpu_bytes", "kernels_per_decode_step", "graph_capture_s",
             "decode_graphs", "max_model_len", "startup_s", "load_s", "tensor_parallel", "allreduce_mode",
             "one_shot_available", "one_shot_unavailable_reason", "allreduce_choices", "device_name",
             "gpu_memory_utilization", "prefill_attention")


def bench_model(me, p: dict, spec: dict) -> dict:
    from .workload import random_prompts
    me.stage(f"{spec['model']}: loading")
    engine = engine_for(me, p, spec["model"], gpu_memory_utilization=spec["gpu_memory_utilization"],
                        max_num_seqs=p["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
                        max_model_len=spec["max_model_len"], cuda_graphs=spec["cuda_graphs"])
    out = {"telemetry": {k: engine.telemetry.get(k) for k in TELEMETRY}, "timed": spec["timed"]}
    prompt = random_prompts(1, p["prompt_tokens"], engine.shape.vocab_size, p["seed"])[0]
    if spec["timed"]:
        runs = []
        for i in range(p["runs"] + 1):
            me.stage(f"{spec['model']}: request {i} of {p['runs']} (0 is the warm-up)")
            runs.append(timed_request(engine, prompt, p["output_tokens"]))
        out.update(ttft_ms=[r["ttft_ms"] for r in runs[1:]], tpot_ms=[r["tpot_ms"] for r in runs[1:]],
                   all_runs_agree=all(r["tokens"] == runs[0]["tokens"] for r in runs))
        tokens = runs[1]["tokens"]
        context = p["prompt_tokens"] + p["output_tokens"] // 2
        me.stage(f"{spec['model']}: one step alone, with and without all-reduces")
        out["graph_step_ms"] = decode_step_ms(engine, context, p["step_reps"])
        if me.world > 1:
            out["graph_step_noop_ms"] = decode_step_ms(engine, context, p["step_reps"], allreduce=False)
        out["step_context_tokens"] = context
        if me.world > 1:                  # one all-reduce of a batch-1 step's size, as the model makes it
            out["allreduce_step_ms"] = engine.tp.time_all_reduce(engine.shape.hidden_size)
            out["allreduce_step_bytes"] = engine.shape.hidden_size * engine.tp.dtype.itemsize
    else:
        me.stage(f"{spec['model']}: reference tokens")
        tokens = timed_request(engine, prompt, p["check_tokens"])["tokens"]
    reference = spec.get("reference_tokens") or tokens[:p["check_tokens"]]
    me.stage(f"{spec['model']}: teacher-forced logits")
    out["tokens"] = tokens[:p["check_tokens"]]
    out["check"] = teacher_forced(engine, prompt, reference)
    out["check"]["reference_tokens"] = reference
    if p.get("compare_allreduce") and me.world > 1 and me.backend == "nccl" and not p.get("_compared"):
        me.stage("NCCL against the one-shot all-reduce")
        table = engine.telemetry.get("allreduce_table") or engine.tp.compare(p["compare_sizes"])
        out["allreduce_table"] = table
        p["_compared"] = True
    del engine
    release()
    return out


def bench(me, p: dict) -> dict:
    """Each model in turn; one that raises on every rank alike (no room for its KV pool, out of
    memory while loading) becomes an error line and the next model still runs."""
    out = []
    for spec in p["models"]:
        error = None
        try:
            out.append({"model": spec["model"], **bench_model(me, p, spec)})
        except Exception as exc:                   # noqa: BLE001 - recorded as the row's failure
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            error = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
            traceback.print_exc()
        if error is not None:                      # outside the except: its traceback no longer holds the engine
            out.append({"model": spec["model"], "error": error})
            release()
    return {"world": me.world, "models": out}


# ------------------------------------------------------------------------------ the CPU tests' tasks
def generate(me, p: dict) -> dict:
    """Greedy tokens of p["prompts"], each rank's, and each rank's tensors' shapes and sums."""
    from ..engine import SamplingParams
    from ..engine.tp_ranks import Channel, DrivenEngine, follow
    weights = None
    if p.get("full_weights"):                   # every rank given the same whole dict, as a caller may
        from ..engine import named, random_weights
        weights = random_weights(named(p["model"]), p["seed"], torch.float32)
    from ..engine import EngineConfig, LLMEngine
    engine = LLMEngine(EngineConfig(model=p["model"], seed=p["seed"], dtype=p["dtype"],
                                    device="cuda" if me.backend == "nccl" else "cpu",
                                    num_kv_blocks=p.get("num_kv_blocks"), max_num_seqs=p.get("max_num_seqs", 8),
                                    cuda_graphs=False, tensor_parallel=me.world, allreduce=p.get("allreduce", "auto")),
                       weights=weights)
    params = [SamplingParams(max_tokens=p["max_tokens"], temperature=p.get("temperature", 0.0),
                             seed=p.get("sample_seed"), ignore_eos=True) for _ in p["prompts"]]
    if p.get("drive") == "rank0":
        channel = Channel()
        if me.rank == 0:
            driven = DrivenEngine(engine, channel)
            tokens = driven.generate(p["prompts"], params)
            driven.stop()
        else:
            follow(engine, channel)
            tokens = None
    else:
        tokens = engine.generate(p["prompts"], params)
    model = engine.runner.model
    layer = model.layers[0]
    shards = {name: [list(t.shape), float(t.double().sum())] for name, t in (
        ("qkv", layer.qkv), ("o", layer.o), ("gate_up", layer.gate_up), ("down", layer.down),
        ("embed", model.embed), ("lm_head", model.lm_head), ("input_norm", layer.input_norm))}
    shards["kv_cache"] = [list(engine.runner.kv_cache.shape), None]
    mine = {"tokens": tokens, "shards": shards, "num_kv_blocks": engine.runner.num_kv_blocks,
            "preemptions": engine.num_preemptions, "telemetry": {k: engine.telemetry.get(k) for k in TELEMETRY}}
    return {"ranks": me.gather(mine)}


def allreduce(me, p: dict) -> dict:
    """Every implementation on irregular sizes: #wrong against exact sums, and a checksum per rank
    (every rank must end with the same bits)."""
    from ..engine.tp_ranks import TensorParallel, pattern
    out = {}
    dtype = getattr(torch, p.get("dtype", "float32"))
    for mode in p["modes"]:
        tp = TensorParallel(me.world, me.device, dtype, mode)
        rows = []
        for numel in p["numels"]:
            x = pattern(numel, me.rank, dtype, me.device)
            expected = sum(pattern(numel, r, torch.float64, me.device) for r in range(me.world))
            got = tp.all_reduce(x.clone())
            rows.append({"numel": numel, "wrong": int((got.double() != expected).sum()),
                         "checksum": float(got.double().sum()), "one_shot": tp.use_one_shot(numel * x.element_size())})
        out[mode] = me.gather(rows)
    return out


TASKS = {"bench": bench, "generate": generate, "allreduce": allreduce}


if __name__ == "__main__":
    from phases.phase4_distributed.worker import main
    sys.exit(main(sys.argv, TASKS))
