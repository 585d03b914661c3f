"""Phase 4's README blocks, declared (rendered by common/render.py): the goals, the busbw plot, the
sweep, ring and DDP tables (a brief part in the README, every row in results/tables/<id>.csv) and
the findings (findings.py). Rows come grouped by GPU count (groups.py).
"""
import pandas as pd

from common.formats import missing, num, pct, size_bytes
from common.frame import value
from common.spec import Goal, Goals, Phase, Plot, Table, Text, col, ident

from . import analysis, calibration, plots
from .findings import findings
from .groups import (
    BACKGROUND,
    DDP_SINCE,
    EX_DDP,
    EX_RING,
    EX_SWEEP,
    OPS,
    bucket_label,
    frac,
    groups,
    params,
    per_rank,
    preferred_groups,
    ring_words,
    setting_words,
    us,
    variants,
    whole,
)


# ------------------------------------------------------------------------------ tables
def _sweep_rows(view):
    rows = groups(view, EX_SWEEP)
    order = rows["params.op"].map(list(OPS).index) if len(rows) else None
    return rows.assign(op_order=order).sort_values(["hardware", "machine_gpus", "ranks", "params.size_bytes",
                                                    "op_order"], kind="stable") if len(rows) else rows


def _brief_sweep(rows):
    out = []
    for _, g in preferred_groups(rows[rows["params.op"].isin(["all_reduce", "ring_allreduce", "sendrecv"])]):
        sizes = sorted(set(g["params.size_bytes"]))
        out.append(g[g["params.size_bytes"].isin({sizes[0], sizes[len(sizes) // 2], sizes[-1]})])
    return pd.concat(out) if out else rows.iloc[0:0]


def _algo(r):
    algo, proto = value(r, "metrics.algo"), value(r, "metrics.proto")
    return f"{algo} / {proto}" if proto else algo


SWEEP = Table("phase4.sweep", EX_SWEEP, rows=_sweep_rows, brief=_brief_sweep, columns=(
    ident("size", "params.size_bytes", size_bytes), ident("collective", lambda r: OPS.get(r["params.op"])),
    col("µs", us("metrics.ms"), num), col("algbw GB/s", "metrics.algbw_gbps", num),
    col("busbw GB/s", "metrics.busbw_gbps", num), col("% of link", "metrics.pct_of_link", pct),
    col("ours / NCCL", "metrics.ours_over_nccl_busbw", frac), col("#wrong", "metrics.wrong"), col("algo", _algo)),
    more=(col("busbw factor", "metrics.busbw_factor", num),))


def _ring_rows(view):
    rows = groups(view, EX_RING)
    return rows[(rows["variant"] == "nccl") | rows["variant"].str.startswith("ring_")].sort_values(
        ["hardware", "machine_gpus", "ranks", "params.size_bytes"], kind="stable") if len(rows) else rows


def _brief_ring(rows):
    out = []
    for _, g in preferred_groups(rows):
        worst = g.dropna(subset=["metrics.worst_ours_over_nccl"])
        best = worst.loc[worst["metrics.worst_ours_over_nccl"].astype(float).idxmax(), "variant"] if len(worst) else None
        out.append(g[g["variant"].isin(["nccl", best])])
    return pd.concat(out) if out else rows.iloc[0:0]


RING = Table("phase4.ring", EX_RING, rows=_ring_rows, brief=_brief_ring, columns=(
    ident("size", "params.size_bytes", size_bytes), ident("all-reduce", ring_words),
    col("busbw GB/s", "metrics.busbw_gbps", num), col("ours / NCCL", "metrics.ours_over_nccl_busbw", frac),
    col("its worst ours / NCCL from 256 MiB", "metrics.worst_ours_over_nccl", frac)))


def _checks_note(view, rows) -> str:
    return "\n".join(f"{g.iloc[0]['hardware_name']}: {int((g['status'] == 'ok').sum())} of {len(g)} checks passed "
                     f"({g['variant'].nunique()} configurations x sizes "
                     f"{', '.join(num(x) for x in sorted(set(g['params.numel'])))} elements)."
                     for _, g in preferred_groups(rows))


def _brief_checks(rows):
    out = [pd.concat([g[g["status"] != "ok"], g.loc[[g["metrics.max_abs_diff_vs_nccl"].astype(float).idxmax()]]])
           for _, g in preferred_groups(rows)]
    return pd.concat(out).drop_duplicates(subset=["path", "variant", "params.numel"]) if out else rows.iloc[0:0]


RING_CHECKS = Table("phase4.ring_checks", EX_RING, prediction=False, rows=lambda v: variants("check_")(groups(v, EX_RING)),
                    brief=_brief_checks, note=_checks_note, columns=(
    ident("configuration", lambda r: ring_words(r).removeprefix("ours: ")), ident("elements", "params.numel", num),
    col("integer data exact", "metrics.integers_exact"), col("random fp32: max |ours - NCCL|", "metrics.max_abs_diff_vs_nccl")))

DEADLOCK = Table("phase4.deadlock", EX_RING, prediction=False,
                 rows=lambda v: (lambda g: g[g["preferred"] & (g["variant"] == "naive_blocking")])(groups(v, EX_RING)),
                 columns=(ident("backend", "params.backend"), ident("per rank", "params.size_bytes", size_bytes),
                          col("outcome", "metrics.outcome")))


def _model_note(view, rows) -> str:
    return "\n".join(f"{g.iloc[0]['hardware_name']}: {whole(value(r, 'params.n_layers'))} MLP blocks, d = "
                     f"{whole(value(r, 'params.d_model'))}, {num(value(r, 'summary.params_count', 0) / 1e6)}M parameters, "
                     f"{whole(value(r, 'params.tokens_per_rank'))} tokens per rank, {value(r, 'params.dtype')}."
                     for _, g in preferred_groups(rows) for r in [g.iloc[0]])


def _ddp_pick(prefixes):
    return lambda v: (lambda g: g[g["preferred"] & g["variant"].str.startswith(prefixes)])(groups(v, EX_DDP))


DDP_CHECKS = Table("phase4.ddp_checks", EX_DDP, prediction=False, rows=_ddp_pick(("checksum_",)), note=_model_note, columns=(
    ident("checksums", lambda r: "after DDP's broadcast" if r["variant"] == "checksum_broadcast"
          else f"after {whole(value(r, 'params.steps'))} steps on different data"),
    col("before: distinct across ranks", lambda r: value(r, "metrics.distinct_before") or
        f"{whole(value(r, 'metrics.distinct_first_losses'))} first-step losses"),
    col("identical on every rank", "metrics.identical"),
    col("checksum", lambda r: (value(r, "metrics.checksum_after_broadcast") or value(r, "metrics.checksum_after_steps"))[0],
        lambda x: repr(float(x)))))


def _ddp_rows(view):
    rows = variants("bucket_")(groups(view, EX_DDP, DDP_SINCE))
    if not len(rows):
        return rows
    key = rows.apply(lambda r: (analysis.launch_key(params(r)), value(r, "params.comm_hook") or "builtin",
                                value(r, "params.bucket_cap_mb")), axis=1)
    return rows.assign(_key=key).sort_values(["hardware", "machine_gpus", "ranks", "_key"], kind="stable")


def _brief_ddp(rows):
    out = [g.loc[g.groupby("params.bucket_cap_mb")["metrics.ddp_ms"].idxmin().dropna()]
           for _, g in preferred_groups(rows[rows["status"] == "ok"])]
    return pd.concat(out) if out else rows.iloc[0:0]


DDP = Table("phase4.ddp", EX_DDP, rows=_ddp_rows, brief=_brief_ddp, since_version=DDP_SINCE, columns=(
    ident("bucket cap MB (settings)", lambda r: bucket_label(params(r))), col("step ms", "metrics.ddp_ms", num),
    col("no-comm step ms", "metrics.nocomm_ms", num), col("comm ms (alone)", "metrics.comm_ms", num),
    col("exposed ms", "metrics.exposed_vs_nocomm_ms", num), col("hidden", "metrics.hidden_fraction_vs_nocomm", frac)),
    more=(col("buckets", "metrics.buckets", num), col("compute ms (no_sync)", "metrics.compute_ms", num),
          col("host ms to enqueue a step", "metrics.ddp_host_ms", num), col("hidden (vs no_sync)", "metrics.hidden_fraction", frac),
          col("TFLOP/s", "metrics.tflops", num), col("MFU (spec peak)", "metrics.mfu_vs_peak", frac),
          col("MFU (phase-1 ceiling)", "metrics.mfu_vs_phase1_ceiling", frac)))

PER_RANK = Table("phase4.per_rank", EX_DDP, prediction=False, rows=_ddp_pick(("per_rank_",)), columns=(
    ident("straggler", lambda r: f"last rank sleeps {num(value(r, 'params.straggler_ms'))} ms"
          if value(r, "params.straggler_ms") else "none"),
    col("local work ms per rank (no_sync)", per_rank("metrics.per_rank_local_ms")),
    col("DDP step ms per rank", per_rank("metrics.per_rank_ddp_ms")),
    col("spread: local ms", "metrics.local_spread_ms", num), col("spread: DDP ms", "metrics.ddp_spread_ms", num)))


def _brief_contention(rows):
    """NCCL's default settings, on the largest GPU count of each GPU kind."""
    default = rows["params.nccl_max_channels"].isna() & (rows["params.nccl_high_priority"] != True)  # noqa: E712
    largest = {hw: g for (hw, _), g in preferred_groups(rows[default])}
    return pd.concat(list(largest.values()) or [rows.iloc[0:0]])


CONTENTION = Table("phase4.contention", EX_DDP, rows=lambda v: variants("contention_")(groups(v, EX_DDP)),
                   brief=_brief_contention, columns=(
    ident("transfer in flight", lambda r: ", ".join([BACKGROUND.get(r["params.background"], r["params.background"]),
                                                      *setting_words(params(r))])),
    ident("kernel", "params.kernel"), col("alone µs", us("metrics.alone_ms"), num),
    col("transfer alone ms", lambda r: max(value(r, "metrics.background_ms") or [None]), num),
    col("slowdown", "metrics.slowdown", lambda x: "-" if missing(x) else f"{100 * x:+.0f}%")))


# ------------------------------------------------------------------------------ goals
def _ranks(n):
    return lambda df: df[(df["variant"] == "all_reduce") & (df["params.size_bytes"] >= analysis.NCCL_GOAL_MIN_SIZE)
                         & (df["ranks"] == n)]


def _gbps(x) -> str:
    return "-" if missing(x) else f"{float(x):.1f} GB/s"


def goal_rows(view, goal) -> pd.DataFrame:
    """A goal's candidates: the preferred group of each GPU count, labelled '2 x NVIDIA H200 SXM'."""
    found = preferred_groups(groups(view, goal.exercise, goal.since_version), gpu_only=True)
    return pd.concat([rows for _, rows in found]) if found else pd.DataFrame()


GOALS = Goals("phase4.goals", rows=goal_rows, goals=tuple(
    Goal(f"NCCL all-reduce busbw on {n} GPUs, best size from 1 GiB", EX_SWEEP, "metrics.busbw_gbps", target,
         f"the lab's bar for H200 NVLink: {pct(100 * target / analysis.H200_LINK_GBPS)} of its "
         f"{analysis.H200_LINK_GBPS} GB/s one way (hardware.yaml)",
         where=_ranks(n), fmt=_gbps, detail=lambda r: size_bytes(r["params.size_bytes"]))
    for n, target in analysis.NCCL_BUSBW_GOAL_GBPS.items()) + (
    Goal("our ring / NCCL busbw in the sweep, worst size from 256 MiB", EX_SWEEP, "metrics.worst_ours_over_nccl",
         analysis.RING_GOAL_RATIO, "same-run NCCL all-reduce; the lab's bar for a hand-written collective",
         where=lambda df: df[df["variant"] == "ring_allreduce"], fmt=frac),
    Goal("our ring / NCCL busbw, best configuration, worst size from 256 MiB", EX_RING, "metrics.worst_ours_over_nccl",
         analysis.RING_GOAL_RATIO, "same-run NCCL all-reduce; the lab's bar for a hand-written collective",
         where=variants("ring_"), fmt=frac, detail=lambda r: ring_words(r).removeprefix("ours: ")),
    Goal("DDP: gradient all-reduce hidden under backward, at the fastest step", EX_DDP,
         "metrics.hidden_fraction_vs_nocomm", analysis.HIDDEN_GOAL,
         "the lab's bar for DDP at its best bucket size, read as the fastest step",
         where=lambda df: df[df["metrics.fastest_step"] == True], fmt=frac, since_version=DDP_SINCE,  # noqa: E712
         detail=lambda r: f"{bucket_label(params(r), ' MB buckets')}; {frac(r['metrics.hidden_fraction'])} against no_sync")))


def headline(view) -> list[str]:
    """Per GPU kind: NCCL's best all-reduce busbw from 1 GiB up, per GPU count."""
    best: dict = {}
    for (hw, n), g in preferred_groups(groups(view, EX_SWEEP), gpu_only=True):
        big = _ranks(n)(g[g["status"] == "ok"])["metrics.busbw_gbps"]
        if len(big):
            best.setdefault(g.iloc[0]["gpu_name"], []).append(f"{num(big.max())} GB/s on {n} GPUs")
    return [f"{name}: NCCL all-reduce busbw " + ", ".join(parts) for name, parts in sorted(best.items())]


PLOT = Plot("phase4.plots", "phase4_busbw", (EX_SWEEP,), lambda v, hw, path: plots.busbw(groups(v, EX_SWEEP), hw, path),
            "Bus bandwidth against size on the {name}: NCCL's collectives and our ring, one panel per GPU count")

# Rows recorded before they carried prediction.excluded: the deadlock demo (a lesson) and every DDP
# step (no test of a model), by the variant names the committed records use (caps x hooks x launch settings).
EXCLUDED = {(EX_RING, "naive_blocking"): calibration.NAIVE_LESSON,
            **{(EX_DDP, f"bucket_{cap}mb{hook}{ch}{hp}{sm}"): calibration.STEP_EXCLUDED
               for cap in (1, 5, 25, 50, 100, 400) for hook in ("", "_avg", "_copy_engine")
               for ch in ("", "_ch8", "_ch16") for hp in ("", "_hp") for sm in ("", "_sm32")}}
# Collectives are predicted by alpha-beta from phase4.link_ceilings, not by the roofline's terms
CALIBRATORS = {calibration.EXERCISE: calibration.calibrator, EX_SWEEP: calibration.calibrator,
               EX_RING: calibration.calibrator}

PHASE = Phase(4, "Distributed primitives", "phase4_distributed", headline=headline,
              excluded=EXCLUDED, calibrators=CALIBRATORS, blocks=(
    GOALS,
    PLOT, SWEEP, Text("phase4.findings", findings, "_No phase 4 GPU records yet._"), RING, RING_CHECKS, DEADLOCK,
    DDP_CHECKS, DDP, CONTENTION, PER_RANK))
