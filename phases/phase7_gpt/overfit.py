"""Exercise 7.3: two models, one small dataset: memorizing versus generalizing, and how fast.

    lab run phase7.overfit
    lab run phase7.overfit --variant throughput --param throughput_batch_size=128

The 30M model sees 304K training tokens: 0.01 tokens per parameter, a thousand times fewer than
a compute-optimal run would use. It can store the training set; run long enough, training loss
goes to ~0 while validation loss turns around and climbs. The 7.25M model has less room to
memorize. Each run records its loss curves, its best validation loss and when, and a sample of
generated text with how much of it is copied verbatim from the training text.

Variants:
  throughput        the 30M model, compiled, a fixed number of steps: tokens/s, MFU and where a
                    step's time goes (data, forward, backward, optimizer)
  throughput_eager  the same without torch.compile: what compiling buys
  large, small      the 30M and 7.25M overfitting runs
  reproducibility   two fresh runs of the `large` configuration with the same seed, stopped after
                    step `repro_step`: their losses at that step must agree to bf16 tolerance

FLOPs per step = tokens x (6 N_non_embedding + 12 L d T + 6 d V) (model.flops_per_token); MFU is
that over the median step time, against the spec sheet's dense BF16 peak and against the best
matmul rate phase 1 measured on this GPU.
"""
from common.exercise import Exercise, row

from . import seed
from .architecture import SHAPE_7M, SHAPE_30M
from .model import param_formula
from .train import clean, model_config, sample, setup, train, train_config, training_row


def _run(ctx, params, splits, shape, **overrides):
    cfg = model_config(shape, params["block_size"], params["vocab_multiple"])
    tc = train_config(params, **overrides)
    return cfg, tc, train(cfg, tc, splits, ctx.device, keep_model=True)


def run(ctx, params):
    data_dir, splits, ceiling = setup(ctx, params)
    unique_tokens = len(splits[0])
    rows, summary = [], {"seed": {"tokens_per_s": seed.TOKENS_PER_S, "overfit_30m": seed.OVERFIT_30M,
                                  "val_floor_7m": seed.OVERFIT_7M_VAL_FLOOR}, "seed_citation": seed.CITATION}
    todo = [v for v in ("throughput", "throughput_eager", "large", "small", "reproducibility") if ctx.wants(v)]
    for variant in ctx.track(todo, "phase 7.3 runs"):
        if variant.startswith("throughput"):
            steps = params["throughput_steps"]
            cfg, tc, res = _run(ctx, params, splits, params["model_large"], stop_at=steps, eval_every=steps,
                                eval_tokens=params["throughput_eval_tokens"],
                                batch_size=params["throughput_batch_size"] or params["batch_size"],
                                compile=params["compile"] and variant == "throughput")
            res.pop("model")
            rows.append(training_row(ctx, variant, cfg, tc, res, ceiling=ceiling))
        elif variant in ("large", "small"):
            shape = params["model_large" if variant == "large" else "model_small"]
            cfg, tc, res = _run(ctx, params, splits, shape)
            model = res.pop("model")
            n_real = param_formula(model_config(shape, params["block_size"]))["total"]
            extra = {"sample": sample(model, data_dir, ctx.device, new_tokens=params["sample_tokens"],
                                      temperature=params["sample_temperature"], top_k=params["sample_top_k"],
                                      seed=params["seed"]),
                     "unique_train_tokens": unique_tokens,
                     "unique_tokens_per_param": unique_tokens / n_real,
                     "epochs": res["steps"] * res["tokens_per_step"] / unique_tokens}
            del model
            rows.append(training_row(ctx, variant, cfg, tc, res, ceiling=ceiling, extra=extra))
        else:
            k = params["repro_step"]
            runs = [_run(ctx, params, splits, params["model_large"], stop_at=k + 1, eval_every=k + 1,
                         eval_tokens=params["throughput_eval_tokens"]) for _ in range(2)]
            cfg, tc, first = runs[0]
            for _, _, r in runs:
                r.pop("model")
            a, b = (r["loss"][k] if len(r["loss"]) > k else None for _, _, r in runs)
            tol = params["repro_tolerance"]
            diff = abs(a - b) if a is not None and b is not None else None
            ok = diff is not None and diff <= tol
            check = {"reference": f"a second run with the same seed: train loss at step {k}", "metric": "abs_error",
                     "precision": "bf16" if ctx.is_cuda else "fp32", "tolerance": tol, "rel_l2_error": None,
                     "max_abs_error": diff, "passed": ok,
                     "reason": None if ok else f"loss at step {k}: {a} vs {b} (difference {diff})"}
            extra = {"repro_step": k, "loss_run_a": a, "loss_run_b": b, "loss_difference": diff,
                     "bitwise_equal": a == b if diff is not None else None}
            if not ok:
                rows.append(row(variant, {"model": cfg.as_dict(), "train": tc.as_dict()}, "failed", check["reason"],
                                check=check, metrics=extra))
                continue
            r = training_row(ctx, variant, cfg, tc, first, ceiling=ceiling, extra=extra)
            r["check"] = {**check, "init_loss_gate": r["check"]}
            rows.append(r)
    by = {r["variant"]: r for r in rows if r["status"] == "ok"}
    if "large" in by and "small" in by:
        summary["small_over_large_tokens_per_s"] = by["small"]["metrics"]["tokens_per_s"] / by["large"]["metrics"]["tokens_per_s"]
    if "throughput" in by and "throughput_eager" in by:
        summary["compile_speedup"] = by["throughput"]["metrics"]["tokens_per_s"] / by["throughput_eager"]["metrics"]["tokens_per_s"]
    if "throughput" in by:
        summary["throughput_tokens_per_s"] = by["throughput"]["metrics"]["tokens_per_s"]
        summary["throughput_over_seed_30m"] = by["throughput"]["metrics"]["tokens_per_s"] / seed.TOKENS_PER_S["30M"]
        summary["goal_tokens_per_s"] = params["goal_tokens_per_s"]
        summary["goal_met"] = by["throughput"]["metrics"]["tokens_per_s"] >= params["goal_tokens_per_s"]
    return clean(rows), clean(summary)


COMMON = {"data_dir": None, "seed": 1337, "block_size": 256, "batch_size": 64, "vocab_multiple": 64,
          "lr": 1e-3, "min_lr_ratio": 0.1, "weight_decay": 0.1, "grad_clip": 1.0, "profile_steps": 3,
          "timing_warmup": 5, "eval_tokens": None}

EXERCISE = Exercise(
    id="phase7.overfit", title="Overfitting: 30M and 7.25M GPTs on 304K tokens; throughput and MFU",
    run=run,
    params={**COMMON, "model_large": SHAPE_30M, "model_small": SHAPE_7M, "max_iters": 2000, "warmup_iters": 100,
            "eval_every": 50, "compile": True, "throughput_steps": 150, "throughput_eval_tokens": 8192,
            "throughput_batch_size": None,
            "repro_step": 100, "repro_tolerance": 2e-2, "sample_tokens": 100, "sample_temperature": 0.8,
            "sample_top_k": 200, "goal_tokens_per_s": 1_000_000, "timing_warmup": 10, "profile_steps": 5},
    cpu_params={"model_large": {"n_layer": 2, "n_head": 2, "n_embd": 64},
                "model_small": {"n_layer": 1, "n_head": 1, "n_embd": 32}, "block_size": 32, "batch_size": 4,
                "max_iters": 120, "warmup_iters": 10, "eval_every": 20, "eval_tokens": 512, "compile": False,
                "throughput_steps": 30, "throughput_eval_tokens": 256, "repro_step": 20, "sample_tokens": 40,
                "timing_warmup": 3, "profile_steps": 3, "vocab_multiple": 1},
    quick_params={"model_large": {"n_layer": 1, "n_head": 2, "n_embd": 16},
                  "model_small": {"n_layer": 1, "n_head": 1, "n_embd": 8}, "block_size": 16, "batch_size": 4,
                  "max_iters": 12, "warmup_iters": 2, "eval_every": 4, "eval_tokens": 256, "compile": False,
                  "throughput_steps": 10, "throughput_eval_tokens": 64, "repro_step": 6, "sample_tokens": 12,
                  "timing_warmup": 1, "profile_steps": 2, "vocab_multiple": 1},
    variants=("throughput", "throughput_eager", "large", "small", "reproducibility"))
