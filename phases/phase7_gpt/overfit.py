"""Exercise 7.3: two models, one small dataset: memorizing versus generalizing, and how fast.

    lab run phase7.overfit
    lab run phase7.overfit --variant throughput --param throughput_batch_size=128

  large, small      the 30M and 7.25M shapes trained far past their best validation loss on
                    304K tokens: curves, best and final loss, a sample and how much of it is
                    copied verbatim from the training text
  throughput        the 30M model, compiled, a fixed number of steps: tokens/s, MFU and where a
                    step's time goes (data, forward, backward, optimizer)
  throughput_eager  the same without torch.compile: what compiling buys
  reproducibility   two fresh runs of `large` with the same seed: their losses at `repro_step`
                    must agree within `repro_tolerance`

MFU = gpt.flops_per_token x tokens/s, over the spec sheet's dense BF16 peak and over the best
matmul rate phase 1 measured on this GPU. Ratios and verdicts: analysis.py. Every timed row is one
training step: its FLOPs, fewest bytes and kernels come from cost.step_cost (train.train_cost), the
same call `lab predict phase7.overfit` lists (`work`); throughput and throughput_eager are one problem
(the same FLOPs and bytes), and only their kernel counts differ.
"""
from dataclasses import replace

from common.exercise import Exercise, Result, Work, row
from common.params import Bool, Float, Int
from common.standalone import run_alone

from . import analysis, seed
from . import kernel_lists
from .gpt import param_formula
from .model import (
    BLOCK_SIZE,
    DATA_DIR,
    SEED,
    SHAPE_7M,
    SHAPE_30M,
    VOCAB_MULTIPLE,
    Shape,
    training_bytes,
)
from .train import clean, model_config, sample, setup, step_work, train, train_config, training_row

VARIANTS = ("throughput", "throughput_eager", "large", "small", "reproducibility")


def plan(params: dict, variant: str) -> tuple:
    """(model config, training config) of one variant's run: what run() trains and work() lists."""
    if variant.startswith("throughput"):
        steps = params["throughput_steps"]
        shape, overrides = params["model_large"], dict(
            stop_at=steps, eval_every=steps, eval_tokens=params["throughput_eval_tokens"],
            batch_size=params["throughput_batch_size"] or params["batch_size"],
            compile=params["compile"] and variant == "throughput")
    elif variant in ("large", "small"):
        shape, overrides = params["model_large" if variant == "large" else "model_small"], {}
    else:                                                   # reproducibility: two runs to repro_step
        k = params["repro_step"]
        shape, overrides = params["model_large"], dict(stop_at=k + 1, eval_every=k + 1,
                                                       eval_tokens=params["throughput_eval_tokens"])
    return model_config(shape, params["block_size"], params["vocab_multiple"]), train_config(params, **overrides)


def work(params: dict) -> list[Work]:
    """One training step of each variant on a GPU (bf16 autocast), as train.step_work counts it."""
    return [step_work(v, *plan(params, v), "bf16") for v in VARIANTS]


def _run(ctx, params, splits, variant):
    cfg, tc = plan(params, variant)
    return cfg, tc, train(cfg, tc, splits, ctx.device, keep_model=True)


def run(ctx, params):
    data_dir, splits, ceiling = setup(ctx, params)
    unique_tokens = len(splits[0])
    rows, summary = [], {"seed": {"tokens_per_s": seed.TOKENS_PER_S, "overfit_30m": seed.OVERFIT_30M,
                                  "val_floor_7m": seed.OVERFIT_7M_VAL_FLOOR}, "seed_citation": seed.CITATION}
    todo = [v for v in VARIANTS if ctx.wants(v)]
    for variant in ctx.track(todo, "phase 7.3 runs"):
        if variant.startswith("throughput"):
            cfg, tc, res = _run(ctx, params, splits, variant)
            res.pop("model")
            rows.append(training_row(ctx, variant, cfg, tc, res, ceiling=ceiling))
        elif variant in ("large", "small"):
            shape = params["model_large" if variant == "large" else "model_small"]
            cfg, tc, res = _run(ctx, params, splits, variant)
            model = res.pop("model")
            n_real = param_formula(model_config(shape, params["block_size"]))["total"]
            extra = {"sample": sample(model, data_dir, ctx.device, new_tokens=params["sample_tokens"],
                                      temperature=params["sample_temperature"], top_k=params["sample_top_k"],
                                      seed=params["seed"]),
                     "unique_train_tokens": unique_tokens,
                     "unique_tokens_per_param": unique_tokens / n_real,
                     "epochs": res["steps"] * res["tokens_per_step"] / unique_tokens}
            del model
            r = training_row(ctx, variant, cfg, tc, res, ceiling=ceiling, extra=extra)
            if r["status"] == "ok":
                r["metrics"].update(analysis.overfit_verdict(r["metrics"]["best_val_loss"], r["metrics"]["final_val_loss"]))
            rows.append(r)
        else:
            k = params["repro_step"]
            runs = [_run(ctx, params, splits, variant) for _ in range(2)]
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
    by = {r["variant"]: r["metrics"] for r in rows if r["status"] == "ok"}
    summary.update(analysis.overfit_summary(by, seed.TOKENS_PER_S["30M"], params["goal_tokens_per_s"]))
    return Result(clean(rows), clean(summary))


COMMON = {"data_dir": DATA_DIR, "seed": SEED, "block_size": BLOCK_SIZE,
          "batch_size": Int(64, min=1, unit="sequences per step"), "vocab_multiple": VOCAB_MULTIPLE,
          "lr": Float(1e-3, min=0, max=1, unit="peak learning rate"),
          "min_lr_ratio": Float(0.1, min=0, max=1, unit="final lr / peak lr"),
          "weight_decay": Float(0.1, min=0, unit="AdamW decoupled decay"),
          "grad_clip": Float(1.0, min=0, unit="max gradient L2 norm; 0: no clipping"),
          "profile_steps": Int(3, min=0, unit="steps"), "timing_warmup": Int(5, min=0, unit="steps"),
          "eval_tokens": Int(None, min=1, nullable=True, unit="validation tokens; null: the whole split")}


def footprint_bytes(p: dict) -> float:
    """The largest training run; reproducibility holds its first model's weights while the second trains."""
    batch, T, vm = p["batch_size"], p["block_size"], p["vocab_multiple"]
    large_weights = 4 * param_formula(model_config(p["model_large"], T, vm))["total"]
    return max(training_bytes(p["model_large"], T, p["throughput_batch_size"] or batch, vm),
               training_bytes(p["model_large"], T, batch, vm) + large_weights,
               training_bytes(p["model_small"], T, batch, vm))


EXERCISE = Exercise(
    id="phase7.overfit", title="Overfitting: 30M and 7.25M GPTs on 304K tokens; throughput and MFU",
    run=run,
    params={**COMMON, "model_large": Shape(SHAPE_30M), "model_small": Shape(SHAPE_7M),
            "max_iters": Int(2000, min=1, unit="steps"), "warmup_iters": Int(100, min=0, unit="steps"),
            "eval_every": Int(50, min=1, unit="steps"), "compile": Bool(True),
            "throughput_steps": Int(150, min=1, unit="steps"),
            "throughput_eval_tokens": Int(8192, min=1, unit="validation tokens"),
            "throughput_batch_size": Int(None, min=1, nullable=True, unit="sequences per step; null: batch_size"),
            "repro_step": Int(100, min=0, unit="step"), "repro_tolerance": Float(2e-2, min=0, unit="nats"),
            "sample_tokens": Int(100, min=1, unit="tokens"),
            "sample_temperature": Float(0.8, min=0, unit="softmax temperature; 0: greedy"),
            "sample_top_k": Int(200, min=1, max=50257, nullable=True, unit="tokens; null: no top-k"),
            "goal_tokens_per_s": Int(analysis.GOAL_TOKENS_PER_S, min=1, unit="tokens/s"),
            "timing_warmup": replace(COMMON["timing_warmup"], default=10),
            "profile_steps": replace(COMMON["profile_steps"], default=5)},
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
    variants=VARIANTS, footprint_bytes=footprint_bytes, work=work,
    workloads=lambda p: kernel_lists.training_workloads([(v, *plan(p, v)) for v in VARIANTS]))


if __name__ == "__main__":
    run_alone(EXERCISE, {"model_large": {"n_layer": 1, "n_head": 3, "n_embd": 24},
                         "model_small": {"n_layer": 1, "n_head": 1, "n_embd": 12}, "block_size": 19,
                         "batch_size": 3, "max_iters": 14, "throughput_steps": 11, "repro_step": 5})
