"""Exercise 7.4: a scaling law on a fixed dataset, with error bars.

    lab run phase7.scaling

Five shapes (the seed's nano, micro, mini and small, plus the 30M model of 7.3) train on the same
tokens with the same recipe; each stops once validation loss has not improved for `patience`
evaluations, and its *best* validation loss is its point: a scaling law compares models at their
optimum. fit.py fits L(N) = a N^(-alpha) in log-log space, for N = all parameters and for N =
non-embedding parameters (Kaplan et al.'s choice), with a bootstrap interval for alpha.

Tokens per parameter against Chinchilla's ~20: unique (training tokens / N), seen (steps to the
best point x tokens per step / N), and the seed's "x underfed" (20 N_non_embedding / tokens).
"""
from common.exercise import Exercise, Result, Work
from common.params import Bool, Int, Text
from common.standalone import run_alone

from . import analysis, seed
from . import kernel_lists
from .fit import CHINCHILLA_TOKENS_PER_PARAM, KAPLAN_ALPHA_N, scaling_fit
from .gpt import param_formula
from .model import SHAPE, Shape, training_bytes
from .overfit import COMMON
from .train import clean, model_config, setup, step_work, train, train_config, training_row


def plan(params: dict, size: dict) -> tuple:
    """(model config, training config) of one size's run: what run() trains and work() lists."""
    shape = {k: size[k] for k in SHAPE}
    return model_config(shape, params["block_size"], params["vocab_multiple"]), train_config(params)


def work(params: dict) -> list[Work]:
    """One training step of each size on a GPU (bf16 autocast), as train.step_work counts it."""
    return [step_work(size["name"], *plan(params, size), "bf16") for size in params["sizes"]]


def run(ctx, params):
    data_dir, splits, ceiling = setup(ctx, params)
    unique = len(splits[0])
    rows = []
    sizes = [s for s in params["sizes"] if ctx.wants(s["name"])]
    for size in ctx.track(sizes, "scaling-law sizes"):
        shape = {k: size[k] for k in SHAPE}
        cfg, tc = plan(params, size)
        res = train(cfg, tc, splits, ctx.device)
        counts = param_formula(model_config(shape, params["block_size"]))     # the real vocabulary, unpadded
        n_total, n_ne = counts["total"], counts["non_embedding"]
        seen = (res["best_val_step"] or 0) * res["tokens_per_step"]
        extra = {"size": size["name"], "n_total": n_total, "n_non_embedding": n_ne,
                 "unique_train_tokens": unique,
                 "unique_tokens_per_param": unique / n_total,
                 "unique_tokens_per_non_embedding_param": unique / n_ne,
                 "tokens_seen_at_best": seen, "tokens_seen_per_param_at_best": seen / n_total,
                 "chinchilla_tokens_per_param": CHINCHILLA_TOKENS_PER_PARAM,
                 "chinchilla_underfed_factor_non_embedding": CHINCHILLA_TOKENS_PER_PARAM * n_ne / unique,
                 "chinchilla_underfed_factor_total": CHINCHILLA_TOKENS_PER_PARAM * n_total / unique,
                 "seed_point": list(seed.SCALING[size["name"]]) if size["name"] in seed.SCALING else None}
        rows.append(training_row(ctx, size["name"], cfg, tc, res, ceiling=ceiling, extra=extra))

    ok = [r for r in rows if r["status"] == "ok" and r["metrics"].get("best_val_loss") is not None]
    summary = {"kaplan_alpha_n": KAPLAN_ALPHA_N, "chinchilla_tokens_per_param": CHINCHILLA_TOKENS_PER_PARAM,
               "seed": {"points": seed.SCALING, "fit": seed.SCALING_FIT}, "seed_citation": seed.CITATION,
               "sizes": [r["variant"] for r in ok]}
    if len({r["metrics"]["n_total"] for r in ok}) >= 2:
        loss = [r["metrics"]["best_val_loss"] for r in ok]
        for key, name in (("n_total", "fit_total"), ("n_non_embedding", "fit_non_embedding")):
            fit = scaling_fit([r["metrics"][key] for r in ok], loss, params["bootstrap_resamples"], params["seed"])
            fit["n"] = [r["metrics"][key] for r in ok]
            fit["loss"] = loss
            summary[name] = fit
        for r, e_t, e_ne in zip(ok, summary["fit_total"]["error_pct"], summary["fit_non_embedding"]["error_pct"]):
            r["metrics"]["fit_error_pct_total"] = e_t
            r["metrics"]["fit_error_pct_non_embedding"] = e_ne
        best = min(ok, key=lambda r: r["metrics"]["best_val_loss"])
        summary["best_size"] = best["variant"]
        summary.update(analysis.scaling_span([(r["variant"], r["metrics"]["n_non_embedding"],
                                               r["metrics"]["best_val_loss"]) for r in ok]))
    return Result(clean(rows), clean(summary))


SIZES = [{"name": "nano", "n_layer": 2, "n_head": 2, "n_embd": 64},
         {"name": "micro", "n_layer": 3, "n_head": 3, "n_embd": 96},
         {"name": "mini", "n_layer": 4, "n_head": 4, "n_embd": 128},
         {"name": "small", "n_layer": 6, "n_head": 6, "n_embd": 192},
         {"name": "base", "n_layer": 6, "n_head": 6, "n_embd": 384}]


def footprint_bytes(p: dict) -> float:
    """The largest size's training run (the sizes train one after another)."""
    return max(training_bytes({k: s[k] for k in SHAPE}, p["block_size"], p["batch_size"], p["vocab_multiple"])
               for s in p["sizes"])


EXERCISE = Exercise(
    id="phase7.scaling", title="Scaling law: five sizes to their best validation loss, power-law fit with bootstrap",
    run=run,
    params={**COMMON, "sizes": Shape(SIZES, many=True, extra={"name": Text(None)}),
            "max_iters": Int(3000, min=1, unit="steps"), "warmup_iters": Int(100, min=0, unit="steps"),
            "eval_every": Int(50, min=1, unit="steps"),
            "patience": Int(6, min=1, unit="evaluations without a new best"), "compile": Bool(False),
            "bootstrap_resamples": Int(2000, min=1, unit="resamples")},
    cpu_params={"sizes": [{"name": "nano", "n_layer": 1, "n_head": 1, "n_embd": 16},
                          {"name": "micro", "n_layer": 1, "n_head": 2, "n_embd": 32},
                          {"name": "mini", "n_layer": 2, "n_head": 2, "n_embd": 48},
                          {"name": "small", "n_layer": 2, "n_head": 2, "n_embd": 64}],
                "block_size": 32, "batch_size": 4, "max_iters": 120, "warmup_iters": 10, "eval_every": 20,
                "patience": 3, "eval_tokens": 512, "vocab_multiple": 1, "timing_warmup": 3},
    quick_params={"sizes": [{"name": "nano", "n_layer": 1, "n_head": 1, "n_embd": 4},
                            {"name": "micro", "n_layer": 1, "n_head": 1, "n_embd": 8},
                            {"name": "mini", "n_layer": 1, "n_head": 2, "n_embd": 12},
                            {"name": "small", "n_layer": 1, "n_head": 2, "n_embd": 16}],
                  "block_size": 16, "batch_size": 4, "max_iters": 8, "warmup_iters": 2, "eval_every": 4,
                  "patience": 2, "eval_tokens": 128, "vocab_multiple": 1, "timing_warmup": 1, "profile_steps": 2,
                  "bootstrap_resamples": 200},
    variants=tuple(s["name"] for s in SIZES), footprint_bytes=footprint_bytes, work=work,
    workloads=lambda p: kernel_lists.training_workloads([(s["name"], *plan(p, s)) for s in p["sizes"]]))


if __name__ == "__main__":
    run_alone(EXERCISE, {"sizes": [{"name": "nano", "n_layer": 1, "n_head": 1, "n_embd": 6},
                                   {"name": "micro", "n_layer": 1, "n_head": 3, "n_embd": 15}],
                         "block_size": 19, "batch_size": 3, "max_iters": 9, "bootstrap_resamples": 50})
