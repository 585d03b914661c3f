"""Exercise 5.x: tensor-parallel decode, the 8B shape on 1, 2 and 4 GPUs and the 70B shape from the
smallest GPU count that holds it with a usable KV pool.

    lab run phase5.tensor_parallel                              # every TP size this machine's GPUs allow
    lab run phase5.tensor_parallel --param tp_sizes=[1,2] --param models=[llama-3.1-8b]
    lab run phase5.tensor_parallel --device cpu                 # the tiny shape over gloo, CPU processes

Each TP size is one torchrun job (tp_worker.py, phase 4's launcher) whose ranks all build the engine
with the model's shards and make the same calls: one warm-up request, then `runs` greedy requests of
`output_tokens` after a `prompt_tokens` prompt, one at a time. A row per (shape, TP): batch-1 decode
tok/s (1000 / the mean decode step on rank 0's clock), TTFT (the prefill step), the KV pool in
tokens, and the share of a step spent in all-reduce: the step's CUDA graph replayed alone, against
the same step captured with the all-reduces left out (what remains is weights, attention, the logits
gather and launches). Rows of the all-reduce itself follow: NCCL against the one-shot through
symmetric memory at every size from 2 KiB to 8 MiB, in CUDA graphs.

Prediction: a rank reads its shards (weights / TP, the embedding aside) and its KV heads' cache over
HBM bandwidth, plus 2 all-reduces per layer of one token's hidden state, each from phase 4's
alpha-beta fit of NCCL's all-reduce on the same number of GPUs: a `phase4.link_ceilings` record,
else the all-reduce rows of the newest `phase4.interconnect` record (the same definitions: alpha the
median time of the three smallest sizes, beta the best bus bandwidth of the three largest), else this
run's own all-reduce at the step's size; `allreduce_model.source` says which. The same prediction with
this run's in-graph all-reduce time is stored beside it (`pct_of_prediction_graph_allreduce`).

Which TP holds a shape is computed before anything loads (`kv_pool_tokens`): per GPU, its shards,
the activation reserve and ~1 GiB for the CUDA context and NCCL out of gpu_memory_utilization x the
GPU's memory, the rest in KV blocks; below `min_kv_tokens` tokens (one request at the engine's
default 8K context) the shape does not fit usably at that TP and its row is skipped with the numbers.

Correctness gates timing: each shape's reference is TP=1 where its weights fit at all (at
`reference_utilization`, without CUDA graphs, only for the reference), else its smallest TP. The
reference's greedy tokens are fed to every TP (teacher forcing, one prefill) and each TP's logits
compared with the reference's: each reference token must score within a tolerance of the best logit
(3x what the reference itself strays between its prefill and its decode, at least 10% of the logits'
spread), and the logits of 128 fixed vocabulary ids must agree within 25% (relative L2; a wrong
split is off by ~140%). On CPU processes (fp32) the tests ask for identical greedy tokens instead.

Built on phase 4: its launcher (launch.py) and all-reduce calibration (calibration.py).
"""
import math
import statistics

import torch

from common import roofline
from common.errors import LabError
from common.exercise import Exercise, Result, Work, measure_copy_gbps, row
from common.params import Bool, Choice, Float, Int
from common.standalone import run_alone
from common.timing import summarize

from .predictions.analysis import decode_parts
from .engine.kv_cache import activation_reserve_bytes, kv_block_bytes, kv_pool_blocks
from .engine import SHAPES, named
from .engine.tp_ranks import ALLREDUCE_MODES, COMPARE_SIZES, NO_MULTICAST_ENV
from .engine.tp_shards import (local_shape, rank_decode_weight_bytes, rank_kv_bytes_per_token, rank_weight_bytes,
                               unsplittable)
from .models.model_choice import BLOCK_SIZE, CPU_BYTES_PER_PARAM, GPU_MEMORY_UTILIZATION, SEED, release_memory
from .predictions import kernel_lists
from .predictions.prediction import summed_prediction

GIB = 2**30
WORKER = "phases.phase5_inference.benchmark.tp_worker"
OTHER_BYTES = 1 << 30             # per GPU, besides weights, KV and activations: CUDA context, NCCL, graphs
NOISE_MARGIN, SPREAD_FLOOR, REL_L2_TOLERANCE = 3.0, 0.10, 0.25
EXCLUDED_ALLREDUCE = ("the all-reduce itself at decode sizes, NCCL beside the one-shot (phase 4's exercises test "
                      "the collectives' model)")


# ------------------------------------------------------------------------------ what fits (torch-free)
def kv_pool_tokens(shape, tp: int, total_bytes: float, utilization: float, max_num_seqs: int,
                   max_num_batched_tokens: int, block_size: int, element_bytes: int = 2) -> int:
    """KV tokens one GPU's pool would hold at TP=tp: what the engine's sizing gives (kv_cache.py)
    for this rank's shards and KV heads, with OTHER_BYTES for the rest of the GPU."""
    local = local_shape(shape, tp)
    reserve = activation_reserve_bytes(local, max_num_batched_tokens, max_num_seqs, element_bytes)
    blocks = kv_pool_blocks(total_bytes, utilization, rank_weight_bytes(shape, tp, element_bytes), reserve,
                            kv_block_bytes(local, block_size, element_bytes), OTHER_BYTES)
    return blocks * block_size


def refused(params: dict) -> str | None:
    """Why these parameters cannot run anywhere (a shape that does not split), or None."""
    for model in params["models"]:
        for tp in params["tp_sizes"]:
            why = unsplittable(named(model), tp)
            if why:
                return f"--param tp_sizes: {why}"
    return None


# ------------------------------------------------------------------------------ phase 4's alpha-beta (torch-free)
def interconnect_fit(records: list[dict], hardware: str, n: int) -> dict | None:
    """alpha (median time of the 3 smallest sizes) and beta (best busbw of the 3 largest) of NCCL's
    all-reduce on n GPUs, from the newest phase4.interconnect record of `hardware` holding such rows:
    phase4.link_ceilings' definitions, applied to the sweep's own rows."""
    for rec in reversed(records):
        if rec["exercise"]["id"] != "phase4.interconnect" or rec["hardware"]["key"] != hardware \
                or rec.get("status") == "skipped" or rec.get("source", {}).get("kind", "measured") != "measured":
            continue
        rows = sorted((r for r in rec["rows"] if r["status"] == "ok" and r["params"].get("op") == "all_reduce"
                       and r["params"].get("world_size") == n and r["params"].get("backend") == "nccl"),
                      key=lambda r: r["params"]["size_bytes"])
        if len(rows) >= 6:
            small, large = rows[:3], rows[-3:]
            return {"alpha_us": 1e3 * statistics.median(r["metrics"]["ms"] for r in small),
                    "beta_busbw_gbps": max(r["metrics"]["busbw_gbps"] for r in large),
                    "alpha_sizes_bytes": [r["params"]["size_bytes"] for r in small],
                    "beta_sizes_bytes": [r["params"]["size_bytes"] for r in large],
                    "source": "phase4.interconnect (link_ceilings' definitions applied to its all-reduce rows)",
                    "record": f"results/{rec['_path']}"}
    return None


def phase4_fit(ctx, n: int) -> dict | None:
    """Phase 4's alpha-beta of NCCL's all-reduce on n GPUs of this machine: a link-ceilings record
    in this run's results folder, else an interconnect sweep's rows; None on CPU processes or where
    phase 4 has not run here."""
    if not ctx.is_cuda:
        return None
    from common.paths import results_dir
    from common.records import load_records

    from phases.phase4_distributed import calibration
    found = calibration.run_time_index(ctx).get((ctx.hardware_key, "nccl", "all_reduce", n))
    if found:
        return {**found, "source": "phase4.link_ceilings"}
    return interconnect_fit(load_records(results_dir(ctx.results), exercise="phase4.interconnect",
                                         hardware=ctx.hardware_key), ctx.hardware_key, n)


def predicted_workloads(params: dict, results, hardware: str) -> list:
    """`lab predict`'s rows before running (kernel_lists.tensor_parallel_workloads), the all-reduces
    from this hardware's committed records in `results`: the newest measured tensor_parallel record's
    all-reduce rows, else phase4.link_ceilings' NCCL constants."""
    from common.records import is_smoke, load_records

    from phases.phase4_distributed import calibration
    link = calibration.index(load_records(results, exercise=calibration.EXERCISE, hardware=hardware))
    measured = [r for r in load_records(results, exercise="phase5.tensor_parallel", hardware=hardware)
                if not is_smoke(r) and r.get("source", {}).get("kind", "measured") == "measured"]
    rows = measured[-1].get("rows", []) if measured else []
    return kernel_lists.tensor_parallel_workloads(params, link, hardware, rows)


def allreduce_ms(fit: dict, size_bytes: float, n: int) -> float:
    return roofline.alpha_beta_ms(size_bytes, 2 * (n - 1) / n, fit["alpha_us"], fit["beta_busbw_gbps"])


# ------------------------------------------------------------------------------ the prediction
def step_parts(shape, tp: int, batch: int, context: float) -> list[tuple[float, float]]:
    """(FLOPs, bytes) of one rank's decode step: its weight matmuls, then attention over its KV heads."""
    (mm_flops, _), (att_flops, _) = decode_parts(shape, batch, context)
    return [(mm_flops / tp, rank_decode_weight_bytes(shape, tp)),
            (att_flops / tp, batch * context * rank_kv_bytes_per_token(shape, tp))]


def tp_prediction(ctx, shape, tp: int, context: float, measured_ms: float | None, dtype: str,
                  allreduce_each_ms: float, allreduce_source: dict, launches: int | None) -> dict:
    """The rank's decode parts by the roofline (spec sheet, and calibrated from this GPU's ceilings
    where they exist), plus 2 all-reduces per layer at `allreduce_each_ms` each."""
    block = summed_prediction(ctx, step_parts(shape, tp, 1, context), dtype, measured_ms, launches=launches or 1,
                              graphed=True, what="parts of one rank's decode step")
    comm = 2 * shape.num_hidden_layers * allreduce_each_ms if tp > 1 else 0.0
    block.update(model=block["model"] + " + 2 all-reduces per layer", allreduce_ms=comm,
                 allreduces_per_step=2 * shape.num_hidden_layers if tp > 1 else 0,
                 allreduce_bytes=shape.hidden_size * 2, allreduce_model=allreduce_source)
    block["predicted_ms"] += comm
    if comm > block["memory_ms"] + block["compute_ms"] - comm:
        block["bound"] = roofline.COMMUNICATION
    block["measured_over_predicted"] = measured_ms / block["predicted_ms"] if measured_ms else None
    if "calibrated" in block:
        cal = block["calibrated"]
        cal["predicted_ms"] += comm
        cal["allreduce_ms"] = comm
        cal["measured_over_predicted"] = measured_ms / cal["predicted_ms"] if measured_ms else None
        if comm > cal["predicted_ms"] - comm:
            cal["bound"] = roofline.COMMUNICATION
    return block


# ------------------------------------------------------------------------------ the check
def tp_check(ref: dict, mine: dict, ref_label: str) -> dict:
    """This TP's teacher-forced logits on the reference's greedy tokens against the reference's own."""
    r, m = ref["check"], mine["check"]
    noise = max(r["gaps"]) if r["gaps"] else 0.0
    tolerance = max(SPREAD_FLOOR * r["logit_std"], NOISE_MARGIN * noise)
    worst = max(m["gaps"]) if m["gaps"] else float("inf")
    a = torch.tensor(m["fingerprint"], dtype=torch.float64)
    b = torch.tensor(r["fingerprint"], dtype=torch.float64)
    rel = float((a - b).norm() / b.norm()) if b.numel() else float("inf")
    agree = sum(x == y for x, y in zip(mine.get("tokens") or [], r["reference_tokens"]))
    passed = worst <= tolerance and rel <= REL_L2_TOLERANCE
    reason = None
    if worst > tolerance:
        reason = f"a reference token scores {worst:.3g} below this TP's best logit (tolerance {tolerance:.3g})"
    elif rel > REL_L2_TOLERANCE:
        reason = f"logits differ from the reference's by {100 * rel:.1f}% (relative L2; tolerance {100 * REL_L2_TOLERANCE:.0f}%)"
    return {"passed": passed, "reference": f"{ref_label}, teacher-forced on its {len(r['reference_tokens'])} greedy "
                                           "tokens: each must score within the tolerance of this TP's best logit "
                                           "(3x the reference's own prefill-against-decode gap, at least 10% of the "
                                           "logits' spread); 128 fixed vocabulary ids' logits within 25% (relative L2)",
            "max_logit_gap": worst, "tolerance": tolerance, "reference_own_gap": noise,
            "logits_rel_l2": rel, "tokens_checked": len(m["gaps"]),
            "argmax_agreement": sum(x == y for x, y in zip(m["argmax"], r["reference_tokens"])) / max(1, len(m["argmax"])),
            "greedy_tokens_equal_to_reference": agree, "reason": reason}


# ------------------------------------------------------------------------------ the plan
def plan(params: dict, gpus: int | None, total: float | None) -> dict:
    """Per (model, TP): run it (timed), or why not; per model the reference's TP; the jobs, one per
    TP size, ascending. gpus, total: this machine's GPU count and one GPU's bytes (None on CPU
    processes, where every size runs)."""
    cells, reference = {}, {}
    for model in params["models"]:
        shape = named(model)
        for tp in sorted(set(params["tp_sizes"])):
            predicted = {"weights_gib_per_gpu": rank_weight_bytes(shape, tp) / GIB,
                         "kv_bytes_per_token_per_gpu": rank_kv_bytes_per_token(shape, tp)}
            why = None
            if gpus is not None and tp > gpus:
                why = f"TP={tp} needs {tp} GPUs; this machine has {gpus}"
            elif total:
                tokens = kv_pool_tokens(shape, tp, total, params["gpu_memory_utilization"], params["max_num_seqs"],
                                        params["max_num_batched_tokens"], params["block_size"])
                predicted["predicted_kv_tokens"] = tokens
                if tokens < params["min_kv_tokens"]:
                    most = kv_pool_tokens(shape, tp, total, params["reference_utilization"], params["max_num_seqs"],
                                          params["max_num_batched_tokens"], params["block_size"])
                    why = (f"{shape.name} does not fit usably at TP={tp}: {predicted['weights_gib_per_gpu']:.1f} GiB of "
                           f"weights per GPU leave room for {tokens:,} KV tokens at {params['gpu_memory_utilization']} "
                           f"of {total / GIB:.1f} GiB ({most:,} at {params['reference_utilization']}), fewer than "
                           f"min_kv_tokens={params['min_kv_tokens']:,}")
            cells[model, tp] = {"run": why is None, "why": why, "predicted": predicted}
        runnable = [tp for tp in sorted(set(params["tp_sizes"])) if cells[model, tp]["run"]]
        if not runnable:
            continue
        reference[model] = runnable[0]
        if runnable[0] != 1 and 1 in params["tp_sizes"] and total and kv_pool_tokens(
                shape, 1, total, params["reference_utilization"], 1, reference_len(params),
                params["block_size"]) >= reference_len(params):
            reference[model] = 1             # TP=1 holds the weights for the check, if not a usable pool
    jobs: dict[int, list[str]] = {}
    for (model, tp), cell in cells.items():
        if cell["run"] or reference.get(model) == tp:
            jobs.setdefault(tp, []).append(model)
    return {"cells": cells, "reference": reference, "jobs": dict(sorted(jobs.items()))}


def reference_len(params: dict) -> int:
    return params["prompt_tokens"] + params["check_tokens"] + 16


def model_spec(params: dict, model: str, timed: bool, reference_tokens) -> dict:
    """How the job builds one model's engine: timed (the run's settings, CUDA graphs) or the
    reference alone (every byte for the weights, a short context, eager)."""
    if timed:
        max_len = params["prompt_tokens"] + max(params["output_tokens"], params["check_tokens"]) + 64
        return {"model": model, "timed": True, "gpu_memory_utilization": params["gpu_memory_utilization"],
                "max_num_batched_tokens": max(params["max_num_batched_tokens"], max_len), "max_model_len": max_len,
                "cuda_graphs": params["cuda_graphs"], "reference_tokens": reference_tokens}
    length = reference_len(params)
    return {"model": model, "timed": False, "gpu_memory_utilization": params["reference_utilization"],
            "max_num_batched_tokens": length, "max_model_len": length, "cuda_graphs": False,
            "reference_tokens": reference_tokens}


# ------------------------------------------------------------------------------ the run
def run(ctx, params):
    from phases.phase4_distributed.launch import launch

    backend = "nccl" if ctx.is_cuda else "gloo"
    dtype = "bf16" if ctx.is_cuda else "fp32"
    copy_gbps = measure_copy_gbps(ctx, 1 << 30) if ctx.is_cuda else measure_copy_gbps(ctx)
    release_memory(ctx)
    p = plan(params, ctx.gpu_count if ctx.is_cuda else None,
             torch.cuda.get_device_properties(ctx.device).total_memory if ctx.is_cuda else None)
    env = dict(NO_MULTICAST_ENV) if ctx.is_cuda else {"OMP_NUM_THREADS": "1", **NO_MULTICAST_ENV}
    cells, outputs, references, failures = p["cells"], {}, {}, {}
    job_params = {k: params[k] for k in ("seed", "prompt_tokens", "output_tokens", "runs", "check_tokens",
                                         "block_size", "max_num_seqs", "allreduce", "step_reps", "pg_timeout_s")}
    job_params.update(dtype="bfloat16" if ctx.is_cuda else "float32", compare_allreduce=params["compare_allreduce"],
                      compare_sizes=list(COMPARE_SIZES))
    tables, hung = {}, None
    for tp in ctx.track(list(p["jobs"]), "tensor-parallel sizes"):
        if hung is not None and tp > 1:
            for m in p["jobs"][tp]:
                failures[m, tp] = f"not run: the TP={hung} job ran out of time, and a larger one would too"
            continue
        specs = [model_spec(params, m, cells[m, tp]["run"], (references.get(m) or {}).get("reference_tokens"))
                 for m in p["jobs"][tp]]
        try:
            res = launch("bench", tp, backend, {**job_params, "models": specs}, params["timeout_s"],
                         f"phase5.tensor_parallel at TP={tp}", extra_env=env, module=WORKER)
        except LabError as exc:
            hung = tp if "no result after" in str(exc) and tp > 1 else hung
            for m in p["jobs"][tp]:
                failures[m, tp] = str(exc)
            continue
        for out in res["models"]:
            if out.get("error"):
                failures[out["model"], tp] = out["error"]
                continue
            outputs[out["model"], tp] = out
            if p["reference"].get(out["model"]) == tp:
                references[out["model"]] = {**out["check"], "tp": tp}
            if out.get("allreduce_table"):
                tables[tp] = out["allreduce_table"]
    rows, fits = [], {}
    for (model, tp), cell in cells.items():
        shape = named(model)
        identity = {"model": shape.name, "tp": tp, "prompt_tokens": params["prompt_tokens"],
                    "output_tokens": params["output_tokens"], "runs": params["runs"], "dtype": dtype,
                    "allreduce": params["allreduce"], "gpu_memory_utilization": params["gpu_memory_utilization"],
                    "max_num_seqs": params["max_num_seqs"], "max_num_batched_tokens": params["max_num_batched_tokens"]}
        if not cell["run"]:
            rows.append(row("engine", identity, "skipped", cell["why"], metrics=cell["predicted"]))
            continue
        if (model, tp) in failures or (model, tp) not in outputs:
            rows.append(row("engine", identity, "failed", failures.get((model, tp), "the job returned no result"),
                            metrics=cell["predicted"]))
            continue
        if tp > 1 and tp not in fits:
            fits[tp] = phase4_fit(ctx, tp)
        ref_tp = p["reference"].get(model)
        ref_label = ("this row: the shape's reference (its smallest TP)" if ref_tp == tp else
                     f"TP={ref_tp} of the same weights" + ("" if cells[model, ref_tp]["run"] else
                                                           " (loaded for the check alone, untimed)"))
        rows.append(engine_row(ctx, identity, shape, tp, dtype, outputs[model, tp], references.get(model),
                               ref_tp, ref_label, fits.get(tp), copy_gbps, cell["predicted"], params))
    speedups(rows)
    for tp, table in sorted(tables.items()):
        rows += allreduce_rows(table, tp, dtype, fits.get(tp) or phase4_fit(ctx, tp))
    summary = {"copy_gbps": copy_gbps, "backend": backend, "gpus": ctx.gpu_count if ctx.is_cuda else None,
               "reference_tp": p["reference"], "jobs": {str(k): v for k, v in p["jobs"].items()},
               "allreduce_fits": {str(k): v for k, v in fits.items()},
               "one_shot": {str(tp): {k: out["telemetry"].get(k) for k in ("one_shot_available",
                                                                            "one_shot_unavailable_reason")}
                            for (_, tp), out in outputs.items() if tp > 1}}
    return Result(rows, summary)


def engine_row(ctx, identity, shape, tp, dtype, out, ref, ref_tp, ref_label, fit, copy_gbps, predicted,
               params) -> dict:
    t = out["telemetry"]
    check = tp_check({"check": ref}, out, ref_label) if ref else \
        {"passed": False, "reference": "none", "reason": f"the reference run (TP={ref_tp}) gave no result"}
    if not check["passed"]:
        return row("engine", identity, "failed", check["reason"], check=check, metrics=predicted)
    tpot, ttft = statistics.median(out["tpot_ms"]), statistics.median(out["ttft_ms"])
    context = params["prompt_tokens"] + params["output_tokens"] / 2
    nbytes = sum(b for _, b in step_parts(shape, tp, 1, context))
    timing = summarize(out["tpot_ms"], "mean decode step per request on rank 0's clock (host included), median of "
                       "requests", warmup_calls=1, flush_l2=False, graph_reps=params["output_tokens"])
    own_each = out.get("allreduce_step_ms")
    if tp == 1:
        each, source = 0.0, None
    elif fit is not None:
        each, source = allreduce_ms(fit, shape.hidden_size * 2, tp), fit
    else:
        each = own_each or 0.0
        source = {"source": "this run: one all-reduce of the step's size as the model makes it (phase 4's fit is "
                            "not on this machine)", "ms": own_each}
    prediction = tp_prediction(ctx, shape, tp, context, tpot, dtype, each, source, t.get("kernels_per_decode_step"))
    own = (prediction["predicted_ms"] - prediction["allreduce_ms"]
           + (2 * shape.num_hidden_layers * own_each if tp > 1 and own_each else 0.0))
    real, noop = out.get("graph_step_ms"), out.get("graph_step_noop_ms")
    metrics = {
        **predicted, "ms": tpot, "tpot_ms": tpot, "decode_tok_s": 1e3 / tpot, "ttft_ms": ttft, "ttft_p50_ms": ttft,
        "kv_capacity_tokens": t.get("kv_capacity_tokens"), "kv_pool_gib": (t.get("kv_pool_bytes") or 0) / GIB,
        "weights_gib": (t.get("weights_bytes") or 0) / GIB, "bytes_per_token_per_gpu": nbytes,
        "gbps_per_gpu": nbytes / (tpot * 1e6), "copy_gbps": copy_gbps,
        "pct_of_copy_roofline": 100 * nbytes / (copy_gbps * 1e6) / tpot,
        "graph_step_ms": real, "graph_step_noop_ms": noop,
        "allreduce_ms_per_step": (real - noop) if real and noop else (0.0 if tp == 1 else None),
        "allreduce_share": (real - noop) / real if real and noop else (0.0 if tp == 1 else None),
        "allreduce_each_ms": own_each, "allreduce_isolated_ms_per_step":
            2 * shape.num_hidden_layers * own_each if own_each else (0.0 if tp == 1 else None),
        "host_overhead_ms": tpot - real if real else None,
        "predicted_ms": prediction["predicted_ms"], "predicted_tok_s": 1e3 / prediction["predicted_ms"],
        "pct_of_prediction": 100 * prediction["predicted_ms"] / tpot,
        "predicted_ms_graph_allreduce": own, "pct_of_prediction_graph_allreduce": 100 * own / tpot,
        "kernels_per_step": t.get("kernels_per_decode_step"), "one_shot_available": t.get("one_shot_available"),
        "allreduce_choices": t.get("allreduce_choices"), "runs_agree": out.get("all_runs_agree"),
        "load_s": t.get("load_s"), "startup_s": t.get("startup_s"), "graph_capture_s": t.get("graph_capture_s")}
    return row("engine", identity, check=check, timing=timing, metrics=metrics, prediction=prediction)


def speedups(rows: list[dict]) -> None:
    """x_tp1_tok_s: each ok row's tok/s over TP=1's of the same shape (this record); x_smallest_tp:
    over the shape's smallest TP that ran."""
    ok = [r for r in rows if r["variant"] == "engine" and r["status"] == "ok"]
    for r in ok:
        mine = [o for o in ok if o["params"]["model"] == r["params"]["model"]]
        first = min(mine, key=lambda o: o["params"]["tp"])
        one = next((o for o in mine if o["params"]["tp"] == 1), None)
        r["metrics"]["x_smallest_tp_tok_s"] = r["metrics"]["decode_tok_s"] / first["metrics"]["decode_tok_s"]
        r["metrics"]["smallest_tp"] = first["params"]["tp"]
        if one is not None:
            r["metrics"]["x_tp1_tok_s"] = r["metrics"]["decode_tok_s"] / one["metrics"]["decode_tok_s"]


def allreduce_rows(table: list[dict], n: int, dtype: str, fit: dict | None) -> list[dict]:
    """NCCL and the one-shot at every size, in CUDA graphs; the faster marked (the engine uses it)."""
    out = []
    for entry in table:
        for impl, key in (("nccl", "nccl_us"), ("one-shot", "one_shot_us")):
            params = {"world_size": n, "size_bytes": entry["size_bytes"], "impl": impl, "dtype": dtype}
            us = entry.get(key)
            if us is None:
                out.append(row(f"allreduce_{impl.replace('-', '_')}", params, "skipped",
                               "the one-shot all-reduce is not available on this machine (see summary.one_shot)"))
                continue
            other = entry.get("one_shot_us" if impl == "nccl" else "nccl_us")
            prediction = None
            if fit is not None:
                predicted = allreduce_ms(fit, entry["size_bytes"], n)
                prediction = {"model": "alpha-beta, phase 4's fit of NCCL's all-reduce", "predicted_ms": predicted,
                              "measured_ms": us / 1e3, "measured_over_predicted": us / 1e3 / predicted,
                              "bound": roofline.LATENCY, "allreduce_model": fit, "excluded": EXCLUDED_ALLREDUCE}
            out.append(row(f"allreduce_{impl.replace('-', '_')}", params, metrics={
                "us": us, "ms": us / 1e3, "faster": entry["faster"] == impl,
                "x_other": (other / us) if other else None}, prediction=prediction))
    return out


# ------------------------------------------------------------------------------ before running
def footprint_bytes(params: dict) -> float:
    """Per GPU: the largest shape's weights at its largest requested TP (rows that do not fit are
    skipped with their numbers, not refused). A shape that does not split over a requested TP
    ends the run here, before any work (exit 2)."""
    why = refused(params)
    if why:
        raise LabError(why)
    return max(rank_weight_bytes(named(m), max(params["tp_sizes"])) for m in params["models"])


def cpu_footprint_bytes(params: dict) -> float:
    """On a CPU every rank holds its shard in the host's one RAM, in fp32: all shards at once."""
    footprint_bytes(params)                        # the same refusals first
    return max(tp * rank_weight_bytes(named(m), tp, CPU_BYTES_PER_PARAM) for m in params["models"]
               for tp in params["tp_sizes"])


def work(params: dict) -> list[Work]:
    why = refused(params)
    if why:
        raise LabError(why)
    out = []
    context = params["prompt_tokens"] + params["output_tokens"] / 2
    for model in params["models"]:
        shape = named(model)
        for tp in sorted(set(params["tp_sizes"])):
            (mm_f, mm_b), (att_f, att_b) = step_parts(shape, tp, 1, context)
            out.append(Work(f"{shape.name} at TP={tp}: one rank's weight matmuls of a batch-1 step (all-reduces "
                            "not counted here)", mm_f, mm_b, "bf16"))
            out.append(Work(f"{shape.name} at TP={tp}: its attention over {context:.0f} cached tokens", att_f, att_b, "bf16"))
    return out


EXERCISE = Exercise(
    id="phase5.tensor_parallel",
    title="Tensor-parallel decode: the 8B shape on 1, 2, 4 GPUs, the 70B shape from the fewest that hold it",
    run=run,
    variants=("engine", "allreduce_nccl", "allreduce_one_shot"),
    workloads=predicted_workloads,
    params={
        "models": Choice(["llama-3.1-8b", "llama-3.3-70b"], tuple(SHAPES), many=True),
        "tp_sizes": Int([1, 2, 4], min=1, max=8, many=True, unit="GPUs per model",
                        help="sizes above this machine's GPU count are skipped with the reason"),
        "seed": SEED, "gpu_memory_utilization": GPU_MEMORY_UTILIZATION, "block_size": BLOCK_SIZE,
        "prompt_tokens": Int(100, min=1, max=4096, unit="tokens"),
        "output_tokens": Int(200, min=2, max=4096, unit="tokens"),
        "runs": Int(3, min=1, max=20, unit="requests after one warm-up"),
        "check_tokens": Int(32, min=1, max=512, unit="reference tokens the logits are compared on"),
        "max_num_seqs": Int(1, min=1, max=1024, unit="sequences per step (batch-1 decode: CUDA graphs for 1)"),
        "max_num_batched_tokens": Int(8192, min=16, max=65536, unit="tokens", help="sizes the activation reserve, "
                                      "so the KV pool is the engine's serving pool"),
        "min_kv_tokens": Int(8192, min=1, unit="tokens", help="a usable KV pool: one request at the engine's 8K context"),
        "reference_utilization": Float(0.98, min=0.05, max=0.99, help="memory the TP=1 reference may use where the "
                                       "shape's TP=1 pool is not usable"),
        "allreduce": Choice("auto", ALLREDUCE_MODES, help="auto: the faster of NCCL and the one-shot per size"),
        "compare_allreduce": Bool(True, help="rows of NCCL against the one-shot per size (GPUs)"),
        "cuda_graphs": Bool(True),
        "step_reps": Int(20, min=1, max=1000, unit="graph replays timing one step alone"),
        "timeout_s": Int(300, min=10, unit="s", help="one TP size's job, killed after this (a hung job also "
                                                         "skips the larger sizes: device time is dear)"),
        "pg_timeout_s": Int(180, min=10, unit="s", help="a collective whose peer never arrives fails after this"),
    },
    cpu_params={"models": ["tiny"], "tp_sizes": [1, 2], "prompt_tokens": 12, "output_tokens": 8, "runs": 1,
                "check_tokens": 6, "step_reps": 3, "min_kv_tokens": 64, "timeout_s": 300, "pg_timeout_s": 60},
    quick_params={"output_tokens": 16, "runs": 1, "check_tokens": 8, "step_reps": 5},
    footprint_bytes=footprint_bytes, cpu_footprint_bytes=cpu_footprint_bytes, work=work,
)

if __name__ == "__main__":
    run_alone(EXERCISE, {})
