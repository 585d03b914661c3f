"""Phase 4's rows for the report, grouped by GPU count and labelled (pandas, no torch).

One 4-GPU run holds 2-rank and 4-rank rows, so rows are grouped by (hardware, GPUs on the machine,
world size), each group from its newest record and labelled "2 x NVIDIA H200 SXM"; per (hardware,
world size) the machine with exactly that many GPUs is `preferred` (else the newest record): goals,
brief tables and findings use it. Derived values older records lack (the goal's measures, the
findings' facts) come from analysis.py, the functions the exercises store them with.
"""
import pandas as pd

from common.formats import missing, num, pct
from common.frame import value

from . import analysis

EX_DDP, EX_RING, EX_SWEEP = "phase4.ddp", "phase4.ring_allreduce", "phase4.interconnect"
# ddp's bench_version 2 is the timing of commit 21aa12e on; every committed DDP record says 1 (the
# newest were made with that method before the bump), so tables still take version 1 (see README)
DDP_SINCE = 1
DERIVED = {EX_RING: ("metrics.worst_ours_over_nccl", analysis.worst_over_nccl),
           EX_SWEEP: ("metrics.worst_ours_over_nccl", analysis.worst_over_nccl),
           EX_DDP: ("metrics.fastest_step", analysis.fastest_flags)}
OPS = {"all_reduce": "all-reduce", "ring_allreduce": "all-reduce (ours: ring)", "all_gather": "all-gather",
       "reduce_scatter": "reduce-scatter", "sendrecv": "send/recv shift"}
HOOK = {"avg": "AVG comm hook", "copy_engine": "copy-engine all-reduce hook"}
BACKGROUND = {"nccl_all_reduce": "NCCL all-reduce", "copy_engine": "copy engines (no SMs)"}


def frac(x) -> str:
    return pct(None if missing(x) else 100 * x)


def us(key):
    return lambda r: None if value(r, key) is None else 1e3 * value(r, key)


def _nested(view, path: str, n: int) -> list[dict]:
    return [r for r in view.record(path)["rows"] if r["params"].get("world_size") == n]


def _label(rec: dict, n: int, machine: int) -> str:
    if rec["hardware"].get("device") != "cuda":
        return f"{n} CPU processes (gloo)"
    name = (rec["hardware"].get("spec") or {}).get("name") or rec["hardware"]["key"]
    return f"{n} x {name}" + (f", on a {machine}-GPU machine" if machine and machine != n else "")


def groups(view, exercise: str, since: int = 1) -> pd.DataFrame:
    """Cached per frame (tables, goals and findings ask for the same groups many times)."""
    cache = view.frame.__dict__.setdefault("_phase4_groups", {})
    if (exercise, since) not in cache:
        cache[(exercise, since)] = _groups(view, exercise, since)
    return cache[(exercise, since)]


def _groups(view, exercise: str, since: int = 1) -> pd.DataFrame:
    """Measured rows of `exercise`, newest record per (hardware, machine GPUs, ranks), labelled;
    `preferred` marks per (hardware, ranks) the exact-fit machine, else the newest record. Derived
    metrics older records lack are filled by the function the exercise stores them with."""
    df = view.frame.df
    empty = df.iloc[0:0].assign(ranks=0, machine_gpus=0, preferred=False, gpu=False, gpu_name="")
    if not len(df) or "params.world_size" not in df:
        return empty
    sub = df[(df["exercise"] == exercise) & (df["record_status"] != "skipped") & (df["source"] == "measured")
             & (df["bench_version"] >= since) & df["params.world_size"].notna()].copy()
    if not len(sub):
        return empty
    recs = {p: view.record(p) for p in set(sub["path"])}
    sub["ranks"] = sub["params.world_size"].astype(int)
    sub["machine_gpus"] = sub["path"].map(lambda p: (recs[p]["hardware"].get("gpu") or {}).get("count") or 0)
    sub = sub[sub["order"] == sub.groupby(["hardware", "machine_gpus", "ranks"])["order"].transform("max")].copy()
    rank = (sub["machine_gpus"] == sub["ranks"]) * 10**9 + sub["order"]
    sub["preferred"] = rank == rank.groupby([sub["hardware"], sub["ranks"]]).transform("max")
    sub["gpu_name"] = sub["hardware_name"]
    sub["gpu"] = sub["path"].map(lambda p: recs[p]["hardware"].get("device") == "cuda")
    sub["hardware_name"] = [_label(recs[p], n, g) for p, n, g in zip(sub["path"], sub["ranks"], sub["machine_gpus"])]
    key, fn = DERIVED[exercise]
    derived = pd.Series([None] * len(sub), index=sub.index, dtype=object)
    for (path, n), part in sub.groupby(["path", "ranks"]):
        derived[part.index] = part["variant"].map(fn(_nested(view, path, n)))
    sub[key] = sub[key].where(sub[key].notna(), derived) if key in sub else derived
    return sub.sort_values(["hardware", "machine_gpus", "ranks"], kind="stable")


def facts(view, rows: pd.DataFrame, fn) -> dict:
    """A group's findings: what the exercise stored (summary.analysis), else the same function."""
    r = rows.iloc[0]
    stored = (value(r, "summary.analysis") or {}).get(str(r["ranks"]))
    return stored if stored is not None else fn(_nested(view, r["path"], int(r["ranks"])))


def preferred_groups(rows: pd.DataFrame, gpu_only: bool = False) -> list:
    """[((hardware, ranks), rows)] of the preferred groups, in order (GPU runs only, if asked)."""
    keep = rows[rows["preferred"] & (rows["gpu"] if gpu_only else True)] if len(rows) else rows
    return list(keep.groupby(["hardware", "ranks"], sort=True)) if len(keep) else []


def variants(prefix: str):
    return lambda df: df[df["variant"].str.startswith(prefix)]


# ------------------------------------------------------------------------------ labels
def setting_words(p: dict) -> list[str]:
    ch, sm, hook = p.get("nccl_max_channels"), p.get("sm_carveout"), p.get("comm_hook")
    return (([f"NCCL_MAX_NCHANNELS={int(ch)}"] if ch else [])
            + ([f"high-priority {'copy' if hook == 'copy_engine' else 'NCCL'} stream"] if p.get("nccl_high_priority") else [])
            + ([f"matmuls leave {int(sm)} SMs free"] if sm else []) + ([HOOK[hook]] if hook in HOOK else []))


def bucket_label(p: dict, unit: str = "") -> str:
    extra = setting_words(p)
    return f"{num(p.get('bucket_cap_mb'))}{unit}" + (f" ({', '.join(extra)})" if extra else "")


def params(r) -> dict:
    return {k: value(r, f"params.{k}") for k in analysis.SETTING_KEYS}


def whole(x) -> str:
    return "-" if missing(x) else str(int(x))


def _count(x, what: str) -> str:
    return f"{whole(x)} {what}" + ("" if not missing(x) and int(x) == 1 else "s")


def ring_words(r) -> str:
    if r["variant"] == "nccl":
        return "NCCL"
    return (f"ours: {_count(value(r, 'params.lanes'), 'lane')}, {_count(value(r, 'params.directions'), 'direction')}, "
            f"depth {whole(value(r, 'params.depth'))}" + (", CUDA graph" if value(r, "params.graph") else ""))


def per_rank(key):
    return lambda r: " / ".join(num(x) for x in value(r, key) or [])
