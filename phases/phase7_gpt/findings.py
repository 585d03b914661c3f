"""Phase 7's findings: sentences whose every number comes from the records (a thin template)."""
from common.formats import bullets, num, num4, pct, ratio
from common.frame import by_hardware, find, value

from . import analysis


def _sentences(got: dict) -> list[str]:
    rows = {ex.split(".")[1]: df for ex, df in got.items()}
    t, big = find(rows.get("data_prep"), "tokenize"), find(rows.get("model"), "params_30m")
    fl, lg = find(rows.get("model"), "sdpa_flash"), find(rows.get("overfit"), "large")
    th, ctl = find(rows.get("overfit"), "throughput"), find(rows.get("failures"), "control")
    sc = rows["scaling"][rows["scaling"]["status"] == "ok"] if "scaling" in rows else []
    fit = value(sc.iloc[0], "summary.fit_non_embedding") if len(sc) else None
    s = []
    if t is not None and big is not None:
        s.append(f"**Data and model.** GPT-2's tokenizer turned {num(t['metrics.chars'])} characters into "
                 f"{num(t['metrics.tokens'])} tokens, the seed write-up's count, every id below 2^16.")
        s.append(f"The 30M shape's {num(big['metrics.total'])} parameters are {pct(big['metrics.wte_pct_of_total'])} "
                 f"token embedding; only {num(big['metrics.non_embedding'])} compute between embedding and head.")
        if fl is not None:
            s.append(f"Flash attention ran its forward + backward {ratio(fl['summary.flash_speedup_over_math'])} faster "
                     "than the math path.")
    if lg is not None:
        best, final = lg["metrics.best_val_loss"], lg["metrics.final_val_loss"]
        s.append(f"**Overfitting.** The 30M model's validation loss was best, {num4(best)}, at step "
                 f"{num(lg['metrics.best_val_step'])}; by step {num(lg['metrics.final_step'])}, with training loss at "
                 f"{num4(lg['metrics.final_train_loss'])}, it "
                 + ("had climbed back to" if analysis.overfit_verdict(best, final)["val_rose"] else "was still at")
                 + f" {num4(final)}, and its sample repeated {lg['metrics.sample']['longest_verbatim_chars']} characters "
                 "of the training text verbatim.")
    if th is not None:
        s.append(f"**Throughput.** The 30M model trained at {num(th['metrics.tokens_per_s'])} tokens/s, "
                 f"{ratio(value(th, 'summary.throughput_over_seed_30m'))} the seed write-up's A100 figure.")
        s.append(f"Its training step ran at MFU {pct(th['metrics.mfu_pct_of_spec'])} of the spec peak, "
                 f"{pct(value(th, 'metrics.mfu_pct_of_phase1'))} of phase 1's measured matmul rate, "
                 f"{ratio(th['prediction.measured_over_predicted'])} the roofline's floor.")
        s.append(f"torch.compile changed throughput by {ratio(value(th, 'summary.compile_speedup'))}.")
    if fit:
        span = analysis.scaling_span([(r["variant"], r["metrics.n_non_embedding"], r["metrics.best_val_loss"])
                                      for _, r in sc.iterrows()])
        s.append(f"**Scaling.** Across {ratio(span['n_ratio'])} in non-embedding parameters the best validation loss went "
                 f"from {num4(span['loss_smallest'])} to {num4(span['loss_largest'])}: an exponent of {num(fit['alpha'])} "
                 f"(95% interval {num(fit['bootstrap']['low'])} to {num(fit['bootstrap']['high'])}) against Kaplan et al.'s "
                 f"{value(sc.iloc[0], 'summary.kaplan_alpha_n')}, fitted where every model is data-starved.")
        if span["non_monotonic"]:
            s.append(f"Larger but worse than the next smaller size: {', '.join(span['non_monotonic'])}.")
    if ctl is not None:
        fa = rows["failures"]
        broke = [f"{r['variant']} ({r['metrics.outcome']})" for _, r in fa[fa["status"] == "ok"].iterrows()
                 if r["metrics.outcome"] != "learned"]
        s.append(f"**Failures.** Against a control that reached {num4(ctl['metrics.best_val_loss'])}, every switch still "
                 "learned" + (f" except {'; '.join(broke)}" if broke else "") + "; the table gives each one's cost.")
    return s


def findings(view) -> str:
    exercises = ["phase7.data_prep", "phase7.model", "phase7.overfit", "phase7.scaling", "phase7.failures"]
    return "\n\n".join(bullets(s, f"On the {next(iter(got.values())).iloc[0]['hardware_name']}:")
                       for _, got in sorted(by_hardware(view.frame, exercises).items()) for s in [_sentences(got)] if s)
