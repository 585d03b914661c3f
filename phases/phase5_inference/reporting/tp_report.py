"""Phase 5's tensor-parallel page (TENSOR_PARALLEL.md), declared: the table of every (shape, TP) with
the seed's 70B pair of A100s beside it, the scaling and all-reduce plot, the goals and the findings.
Rendered by common/render.py; no torch here.

A 2-GPU and a 4-GPU run of the same GPU kind are both kept: rows come from the newest record per
(GPU kind, GPUs on the machine), labelled '4 x NVIDIA H200 SXM'. The page's table shows each
machine's record; the goals and findings the machine with the most GPUs of its kind.
"""
import pandas as pd

from common.formats import count as tokens
from common.formats import bullets, gib, missing, ms, num, pct, ratio, share
from common.frame import value
from common.spec import Goal, Goals, Plot, Table, Text, col, ident

from . import plots, seed

TP = "phase5.tensor_parallel"
GB8, GB70 = "llama-3.1-8b", "llama-3.3-70b"
LACKING = "GPUs; this machine has"          # a skipped row's reason when the machine has too few GPUs


def groups(view) -> pd.DataFrame:
    """Measured rows of the newest record per (GPU kind, GPUs on the machine), labelled, with
    `machine_gpus` and `largest` (the machine with the most GPUs of its kind). Cached per frame."""
    cache = view.frame.__dict__.setdefault("_phase5_tp", {})
    if "rows" not in cache:
        cache["rows"] = _groups(view)
    return cache["rows"]


def _groups(view) -> pd.DataFrame:
    rows = view.frame.rows_of(TP)
    if len(rows):
        rows = rows[(rows["record_status"] != "skipped") & (rows["source"] == "measured")].copy()
    if not len(rows):
        return rows.assign(machine_gpus=0, largest=False)
    gpus = rows["summary.gpus"] if "summary.gpus" in rows else pd.Series([None] * len(rows), index=rows.index)
    rows["machine_gpus"] = gpus.fillna(0).astype(int)
    rows = rows[rows["order"] == rows.groupby(["hardware", "machine_gpus"])["order"].transform("max")].copy()
    rows["largest"] = rows["machine_gpus"] == rows.groupby("hardware")["machine_gpus"].transform("max")
    rows["hardware_name"] = [f"{n} x {name}" if n else f"{name} (CPU processes, gloo)"
                             for n, name in zip(rows["machine_gpus"], rows["hardware_name"])]
    return rows.sort_values(["hardware", "machine_gpus"], kind="stable")


def engine_rows(view) -> pd.DataFrame:
    rows = groups(view)
    return rows[rows["variant"] == "engine"] if len(rows) else rows


def brief(rows: pd.DataFrame) -> pd.DataFrame:
    """The page's part: every machine's record (a 2-GPU and a 4-GPU machine of one kind side by side),
    without the sizes a machine lacks GPUs for."""
    lacking = rows["reason"].fillna("").str.contains(LACKING)
    return rows[~lacking]


def seed_note(view, rows) -> str:
    return (f"The seed's Llama 3.3 70B under vLLM on two A100s at TP=2 ({seed.CITATION.replace(' on an A100 SXM4 80GB', '')}): "
            f"{seed.DECODE_70B_TP2_TOK_S} tok/s, TTFT {seed.TTFT_70B_TP2_MS} ms (through its server; ours is the engine's "
            f"prefill step), {seed.KV_LEFT_70B_TP2_GIB} GiB ({seed.KV_TOKENS_70B_TP2:,} tokens) left for KV.")


TABLE = Table(TP, TP, rows=engine_rows, brief=brief, note=seed_note, columns=(
    ident("model", "params.model"), ident("TP", "params.tp", num),
    col("decode tok/s", "metrics.decode_tok_s", num), col("x TP=1", "metrics.x_tp1_tok_s", ratio),
    col("TTFT", "metrics.ttft_ms", ms), col("KV capacity (tokens)", "metrics.kv_capacity_tokens", tokens),
    col("all-reduce share of a step", "metrics.allreduce_share", share),
    col("% of prediction", "metrics.pct_of_prediction", pct),
    col("% of prediction, this run's all-reduce", "metrics.pct_of_prediction_graph_allreduce", pct)),
    more=(col("KV pool / GPU", "metrics.kv_pool_gib", gib), col("TPOT", "metrics.tpot_ms", ms), col("weights / GPU", "metrics.weights_gib", gib),
          col("graph step", "metrics.graph_step_ms", ms),
          col("graph step without all-reduces", "metrics.graph_step_noop_ms", ms),
          col("all-reduces alone per step", "metrics.allreduce_isolated_ms_per_step", ms),
          col("% of copy roofline (all-reduces aside)", "metrics.pct_of_copy_roofline", pct),
          col("x smallest TP", "metrics.x_smallest_tp_tok_s", ratio)))


def tp_8b(tp: int):
    return lambda d: d[(d["variant"] == "engine") & (d["params.model"] == GB8) & (d["params.tp"] == tp)]


def smallest_70b(d: pd.DataFrame) -> pd.DataFrame:
    return d[(d["variant"] == "engine") & (d["params.model"] == GB70) & (d["params.tp"] == d["metrics.smallest_tp"])]


def goal_rows(view, goal) -> pd.DataFrame:
    """The largest machine's record per GPU kind (labelled '4 x ...'), GPU runs only."""
    rows = groups(view)
    return rows[rows["largest"] & (rows["machine_gpus"] > 0)] if len(rows) else rows


GOALS = Goals("phase5.tp_goals", (
    Goal("8B batch-1 decode at TP=2, x TP=1 (same run)", TP, "metrics.x_tp1_tok_s", 1.6,
         "gpt-fast's tensor-parallel Llama on A100s: 1.59x", fmt=ratio, where=tp_8b(2)),
    Goal("8B batch-1 decode at TP=4, x TP=1 (same run)", TP, "metrics.x_tp1_tok_s", 2.3,
         "gpt-fast's tensor-parallel Llama on A100s: 2.31x", fmt=ratio, where=tp_8b(4)),
    Goal("70B batch-1 decode at its smallest TP, % of its prediction", TP, "metrics.pct_of_prediction", 80,
         "the lab's bar: weights / TP over HBM bandwidth plus 2 all-reduces per layer by phase 4's alpha-beta fit",
         where=smallest_70b, detail=lambda r: f"TP={int(r['params.tp'])}"),
    Goal("70B batch-1 decode at its smallest TP, % of its prediction with this run's all-reduce (in a CUDA graph)", TP,
         "metrics.pct_of_prediction_graph_allreduce", 80,
         "the same bar with the all-reduce timed as the engine runs it: phase 4 timed calls launched one at a time, "
         "which makes the prediction above slower than the engine's all-reduces", where=smallest_70b,
         detail=lambda r: f"TP={int(r['params.tp'])}"),
), rows=goal_rows, list_unmeasured=True)


def _row(rows: pd.DataFrame, model: str, tp: int):
    hit = rows[(rows["variant"] == "engine") & (rows["params.model"] == model) & (rows["params.tp"] == tp)
               & (rows["status"] == "ok")]
    return None if not len(hit) else hit.iloc[0]


def findings(view) -> str:
    """Per machine (largest of its kind): how the 8B shape scales and what the all-reduces cost it,
    where the 70B shape starts and how close it comes to its prediction, beside the seed's A100s."""
    out = []
    rows = groups(view)
    if not len(rows):
        return ""
    for label, mine in rows[rows["largest"]].groupby("hardware_name", sort=True):
        parts = []
        ok = mine[(mine["variant"] == "engine") & (mine["status"] == "ok")]
        eight = [(int(tp), _row(ok, GB8, tp)) for tp in sorted(set(ok[ok["params.model"] == GB8]["params.tp"]))]
        if eight:
            parts.append("The 8B shape decodes at " + ", ".join(
                f"{num(r['metrics.decode_tok_s'])} tok/s on {tp} GPU{'s' if tp > 1 else ''}"
                + (f" ({ratio(value(r, 'metrics.x_tp1_tok_s'))})" if tp > 1 else "") for tp, r in eight) + ".")
            top = eight[-1][1]
            if eight[-1][0] > 1 and not missing(value(top, "metrics.allreduce_share")):
                each = value(top, "metrics.allreduce_each_ms")
                count = value(top, "prediction.allreduces_per_step")
                parts.append(f"At TP={eight[-1][0]} its {num(count) if count else 'two per layer'} all-reduces a step take "
                             f"{share(top['metrics.allreduce_share'])} "
                             f"of it (the step's graph against the same graph without them)"
                             + (f"; one alone takes {num(1e3 * each)} µs in a CUDA graph" if each else "")
                             + f", and it reaches {pct(value(top, 'metrics.pct_of_prediction'))} of its prediction.")
            one = eight[0][1] if eight[0][0] == 1 else None
            alone, bare = value(one, "metrics.graph_step_ms") if one is not None else None, value(top, "metrics.graph_step_noop_ms")
            if alone and bare:
                def streamed(r, step_ms):          # % of the copy bandwidth at which a step reads its shards
                    return 100 * r["metrics.bytes_per_token_per_gpu"] / (step_ms * 1e6) / r["metrics.copy_gbps"]
                parts.append(f"Without its all-reduces that step would take {num(bare)} ms, {ratio(alone / bare)} TP=1's "
                             f"{num(alone)} ms: the shards alone scale short of {eight[-1][0]}x because each GPU streams "
                             f"its smaller matrices at {pct(streamed(top, bare))} of the copy bandwidth (TP=1: "
                             f"{pct(streamed(one, alone))}), and the all-reduces take the rest.")
        big = mine[(mine["variant"] == "engine") & (mine["params.model"] == GB70)]
        first = big[big["status"] == "ok"]
        if len(first):
            r = first.loc[first["params.tp"].idxmin()]
            parts.append(f"The 70B shape needs {int(r['params.tp'])} GPUs for a usable KV pool "
                         f"({tokens(value(r, 'metrics.kv_capacity_tokens'))} tokens, {gib(value(r, 'metrics.kv_pool_gib'))} "
                         f"per GPU) and decodes there at {num(r['metrics.decode_tok_s'])} tok/s, "
                         f"{pct(value(r, 'metrics.pct_of_prediction'))} of its prediction "
                         f"({pct(value(r, 'metrics.pct_of_prediction_graph_allreduce'))} with the all-reduce timed in "
                         f"this run's CUDA graphs), TTFT {ms(value(r, 'metrics.ttft_ms'))}.")
            parts.append(f"The seed's 70B on two A100s: {seed.DECODE_70B_TP2_TOK_S} tok/s, TTFT {seed.TTFT_70B_TP2_MS} ms, "
                         f"{seed.KV_TOKENS_70B_TP2:,} tokens of KV.")
        if parts:
            out.append(bullets(parts, f"{label}:"))
    return "\n\n".join(out)


def hardware_with_rows(view) -> list[str]:
    rows = groups(view)
    return sorted(set(rows[rows["status"] == "ok"]["hardware"])) if len(rows) else []


BLOCKS = (
    TABLE,
    Plot("phase5.tp_plot", "phase5_tensor_parallel", (TP,), lambda v, hw, path: plots.tensor_parallel(groups(v), hw, path),
         "Batch-1 decode against GPUs (measured, predicted, linear from the smallest TP) and the all-reduce at "
         "decode sizes (NCCL and the one-shot) on the {name}", hardware=hardware_with_rows),
    GOALS, Text("phase5.tp_findings", findings, "_No records yet: run `lab run phase5.tensor_parallel` on a GPU._"))
