"""Phase 5's speculative-decoding page (SPECULATIVE.md), declared: the trained models, the k sweep at
batch 1, each draft's best k at every temperature and concurrency beside the seed's rows, the speedup
plot, the goals and the findings. Rendered by common/render.py; no torch here."""
import pandas as pd

from common import render
from common.formats import missing, ms, num, ratio, share
from common.frame import per_hardware
from common.spec import Goal, Goals, Plot, Table, Text, col, ident

from . import findings, plots, seed

SPEC = "phase5.speculative"
DRAFTS = ("matched", "distilled", "mismatched", "ngram")
ROLES = {"target": "target", "matched": "matched draft", "distilled": "distilled draft", "mismatched": "mismatched draft"}


def two(x) -> str:
    return "-" if missing(x) else f"{float(x):.2f}"


def batch1_greedy(d: pd.DataFrame) -> pd.DataFrame:
    return d[(d["params.temperature"] == 0) & (d["params.concurrency"] == 1)]


def best_k(d: pd.DataFrame) -> pd.DataFrame:
    """Per GPU, draft, temperature and concurrency: the k with the most tok/s."""
    ok = d[(d["status"] == "ok") & (d["variant"] != "target")]
    group = ["hardware", "variant", "params.temperature", "params.concurrency"]
    return ok[ok["metrics.speedup_vs_target"] == ok.groupby(group)["metrics.speedup_vs_target"].transform("max")]


def with_prediction_error(d: pd.DataFrame) -> pd.DataFrame:
    """Speculative rows with metrics.prediction_error = |measured / predicted speedup - 1|."""
    ok = d[(d["status"] == "ok") & (d["variant"] != "target")].copy()
    ok["metrics.prediction_error"] = (ok["metrics.speedup_measured_over_predicted"] - 1).abs()
    return ok


def setting(r) -> str:
    return f"{r['variant']}, k = {int(r['params.k'])}, T = {r['params.temperature']:g}, {int(r['params.concurrency'])} at once"


SWEEP_COLUMNS = (
    ident("draft", "variant"), ident("k", "params.k", num),
    col("acceptance", "metrics.acceptance_rate", share), col("tokens / verify", "metrics.tokens_per_verify", two),
    col("decode tok/s", "metrics.decode_tok_s", num), col("x target alone", "metrics.speedup_vs_target", ratio),
    col("predicted x", "metrics.predicted_speedup", ratio),
    col("measured / predicted", "metrics.speedup_measured_over_predicted", two))
STEP_COLUMNS = (
    col("t_target", "metrics.t_target_ms", ms), col("t_draft", "metrics.t_draft_ms", ms),
    col("k t_draft (lookup: per step)", "metrics.t_propose_ms", ms), col("t_verify(k + 1)", "metrics.t_verify_ms", ms),
    col("propose per step (engine)", "metrics.propose_ms_per_step", ms),
    col("verify per step (engine)", "metrics.verify_ms_per_step", ms), col("step", "metrics.decode_step_ms", ms))

SWEEP_TABLE = Table(SPEC, SPEC, prediction=False, columns=(
    ident("temperature", "params.temperature", num), ident("concurrency", "params.concurrency", num), *SWEEP_COLUMNS),
    more=STEP_COLUMNS, brief=batch1_greedy)

BEST_TABLE = Table("phase5.speculative_best", SPEC, prediction=False, where=best_k, columns=(
    ident("draft", "variant"), ident("temperature", "params.temperature", num),
    ident("concurrency", "params.concurrency", num), ident("best k", "params.k", num),
    col("acceptance", "metrics.acceptance_rate", share), col("tokens / verify", "metrics.tokens_per_verify", two),
    col("target alone tok/s", "metrics.target_tok_s", num), col("decode tok/s", "metrics.decode_tok_s", num),
    col("x target alone", "metrics.speedup_vs_target", ratio), col("predicted x", "metrics.predicted_speedup", ratio)),
    note=lambda view, rows: (
        f"The seed's vLLM 0.18 runs on an A100 ({seed.CITATION}), temperature 0: " + "; ".join(
            f"{target} with {draft} ({kind}) {num(spec)} tok/s against {num(alone)} alone ({ratio(spec / alone)})"
            + (f", acceptance {share(acc)}, {two(tpv)} tokens per verify pass" if acc is not None else "")
            for target, draft, kind, spec, alone, acc, tpv in seed.SPECULATIVE) + "."))

STEPS_TABLE = Table("phase5.speculative_steps", SPEC, prediction=True, columns=(
    ident("draft", "variant"), ident("k", "params.k", num), *STEP_COLUMNS),
    where=lambda d: batch1_greedy(d)[batch1_greedy(d)["params.k"].isin([0, 4])])


def models(view) -> str:
    """The newest record's trained models per GPU: size, corpus, training and how closely each draft
    follows the target."""
    out = []
    for hw, rows in per_hardware(view.latest(SPEC, measured_only=True)):
        r = rows.iloc[0]
        info, agreement = r.get("summary.models"), r.get("summary.agreement_with_target")
        if not isinstance(info, dict):
            continue
        agreement = agreement if isinstance(agreement, dict) else {}
        lines = []
        for role, m in info.items():
            a = agreement.get(role, {})
            corpus = m.get("corpus", {})
            lines.append([ROLES.get(role, role), m.get("model", "-"), f"{m['params'] / 1e6:.1f}M", corpus.get("name", "-"),
                          f"{m['train_tokens'] / 1e6:.2f}M", num(m.get("train_s")), f"{m['val_loss']:.3f}",
                          m.get("teacher") or "-", share(a.get("val_top1_agreement")),
                          "-" if missing(a.get("val_kl_to_teacher")) else f"{a['val_kl_to_teacher']:.3f}"])
        out.append(view.caption(r) + "\n\n" + render.markdown(
            lines, ["role", "model", "parameters", "corpus", "tokens trained", "train s", "val loss (own corpus)",
                    "taught by", "top-1 = target's (TinyShakespeare val)", "KL(target ‖ draft)"]))
    return "\n\n".join(out)


GOALS = Goals("phase5.speculative_goals", (
    Goal("matched draft (same text), batch 1, temperature 0, best k: x the target alone", SPEC,
         "metrics.speedup_vs_target", 1.5, "the lab's bar; EAGLE reports 2.15x on an A100 with a trained draft head (Li et al. 2024)",
         fmt=ratio, where=lambda d: batch1_greedy(d)[batch1_greedy(d)["variant"] == "matched"],
         detail=lambda r: f"k = {int(r['params.k'])}"),
    Goal("distilled draft (same text, the target's distribution), batch 1, temperature 0, best k", SPEC,
         "metrics.speedup_vs_target", 1.5, "the same bar for the draft trained as the seed's matched Llama 3.2 1B was",
         fmt=ratio, where=lambda d: batch1_greedy(d)[batch1_greedy(d)["variant"] == "distilled"],
         detail=lambda r: f"k = {int(r['params.k'])}"),
    Goal("mismatched draft (Python), batch 1, temperature 0, best k: slower than the target alone", SPEC,
         "metrics.speedup_vs_target", 1.0, f"the seed's TinyLlama draft for Mistral 7B: "
         f"{ratio(seed.SPECULATIVE[0][3] / seed.SPECULATIVE[0][4])} Marlin alone", op="<", fmt=ratio,
         where=lambda d: batch1_greedy(d)[batch1_greedy(d)["variant"] == "mismatched"],
         detail=lambda r: f"k = {int(r['params.k'])}"),
    Goal("measured speedup within 15% of the prediction, batch 1, temperature 0 (the worst row)", SPEC,
         "metrics.prediction_error", 0.15, "the lab's bar for a prediction: E[tokens per verify] x t_target / (k t_draft + t_verify(k + 1)), step times from the same run",
         op="<=", fmt=share, where=lambda d: with_prediction_error(batch1_greedy(d)), detail=setting),
    Goal("measured speedup within 15% of the prediction, every row (the worst)", SPEC, "metrics.prediction_error", 0.15,
         "the same bar at every temperature and concurrency", op="<=", fmt=share, where=with_prediction_error,
         detail=setting),
), empty="_Run `lab run phase5.speculative` on a GPU to measure the goals._")


def hardware_with_rows(view) -> list[str]:
    rows = view.latest(SPEC, measured_only=True)
    return sorted(set(rows[rows["status"] == "ok"]["hardware"])) if len(rows) else []


BLOCKS = (
    Text("phase5.speculative_models", models, "_No records yet: run `lab run phase5.speculative` on a GPU._"),
    SWEEP_TABLE, BEST_TABLE, STEPS_TABLE,
    Plot("phase5.speculative_plot", "phase5_speculative", (SPEC,), plots.speculative_speedup,
         "Speedup over the target alone against k on the {name}, measured (solid) and predicted (dashed), for each "
         "draft, temperature and concurrency", hardware=hardware_with_rows),
    GOALS, Text("phase5.speculative_findings", findings.speculative, "_No records yet._"))
