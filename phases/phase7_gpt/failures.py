"""Exercise 7.5: break training on purpose, one part at a time, against a control run.

    lab run phase7.failures
    lab run phase7.failures --variant control --variant no_residual_no_layernorm

The switches (CONFIGS): residuals off, LayerNorm off, both; no or short warmup; the learning rate
times `lr_multiplier` with and without clipping; clipping off. Every run shares the control's
seed: the same initial weights (where the architecture is the same) and the same batches, so a
difference in the curves is the switch. Each run records the loss and gradient norm of every
step and the activation RMS after every block at initialization: where a broken network's
signal dies (or grows) layer by layer.

A NaN or a frozen loss is this exercise's *result*: such rows are `ok`, and their `outcome`
(analysis.outcome) says what happened. They still must pass the init-loss gate.
"""
import torch

from common.exercise import Exercise, Result, Work
from common.params import Bool, Float, Int
from common.standalone import run_alone

from . import seed
from . import kernel_lists
from .analysis import outcome
from .gpt import GPT
from .model import Shape, training_bytes
from .overfit import COMMON
from .train import (
    clean,
    model_config,
    residual_stream_rms,
    setup,
    step_work,
    train,
    train_config,
    training_row,
)

CONFIGS = {  # variant: (model switches, training overrides as functions of params)
    "control": ({}, {}),
    "no_residual": ({"residual": False}, {}),
    "no_layernorm": ({"layernorm": False}, {}),
    "no_residual_no_layernorm": ({"residual": False, "layernorm": False}, {}),
    "warmup_none": ({}, {"warmup_iters": lambda p: 0}),
    "warmup_short": ({}, {"warmup_iters": lambda p: p["warmup_short"]}),
    "lr_x100": ({}, {"lr": lambda p: p["lr"] * p["lr_multiplier"]}),
    "lr_x100_no_clip": ({}, {"lr": lambda p: p["lr"] * p["lr_multiplier"], "grad_clip": lambda p: 0.0}),
    "no_clip": ({}, {"grad_clip": lambda p: 0.0}),
}


def plan(params: dict, variant: str) -> tuple:
    """(model config, training config) of one variant's run: what run() trains and work() lists."""
    switches, overrides = CONFIGS[variant]
    cfg = model_config(params["model"], params["block_size"], params["vocab_multiple"], **switches)
    return cfg, train_config(params, **{"warmup_iters": params["warmup_full"],
                                        **{k: f(params) for k, f in overrides.items()}})


def work(params: dict) -> list[Work]:
    """One training step of each variant on a GPU (bf16 autocast), as train.step_work counts it: the
    switches change the parameters (LayerNorm), the kernels (LayerNorm, residual adds, clipping)."""
    return [step_work(v, *plan(params, v), "bf16") for v in CONFIGS]


def run(ctx, params):
    data_dir, splits, ceiling = setup(ctx, params)
    rows, control = [], None
    probe = torch.from_numpy(splits[1][: 4 * params["block_size"]].astype("int64")).view(4, -1).to(ctx.device)
    todo = [v for v in CONFIGS if ctx.wants(v)]
    for variant in ctx.track(todo, "failure modes"):
        cfg, tc = plan(params, variant)
        torch.manual_seed(tc.seed)
        rms = residual_stream_rms(GPT(cfg).to(ctx.device), probe)      # the same init train() builds
        res = train(cfg, tc, splits, ctx.device)
        extra = {"activation_rms_at_init": rms, "activation_rms_last_over_first": rms[-1] / rms[0] if rms[0] else None,
                 "switches": {"residual": cfg.residual, "layernorm": cfg.layernorm, "warmup_iters": tc.warmup_iters,
                              "lr": tc.lr, "grad_clip": tc.grad_clip},
                 "seed_result": seed.FAILURES.get(variant if variant != "control" else "control")}
        r = training_row(ctx, variant, cfg, tc, res, ceiling=ceiling, nan_is_outcome=True, extra=extra)
        if r["status"] == "ok":
            r["metrics"].update(outcome(r["metrics"], control, params["frozen_below"]))
            if variant == "control":
                control = r["metrics"]
        rows.append(r)
    summary = {"seed": seed.FAILURES, "seed_citation": seed.CITATION,
               "outcomes": {r["variant"]: r["metrics"].get("outcome") for r in rows}}
    return Result(clean(rows), clean(summary))


def footprint_bytes(p: dict) -> float:
    """One training run of `model` (each variant trains alone; the RMS probe's model is freed first)."""
    return training_bytes(p["model"], p["block_size"], p["batch_size"], p["vocab_multiple"])


EXERCISE = Exercise(
    id="phase7.failures", title="Engineered failures: residuals, LayerNorm, warmup, learning rate, clipping",
    run=run,
    params={**COMMON, "model": Shape({"n_layer": 12, "n_head": 4, "n_embd": 128}),
            "max_iters": Int(400, min=1, unit="steps"), "warmup_full": Int(200, min=0, unit="steps"),
            "warmup_short": Int(50, min=0, unit="steps"),
            "lr_multiplier": Float(100, min=0, unit="x lr in the lr_x100 variants"),
            "eval_every": Int(25, min=1, unit="steps"), "compile": Bool(False),
            "frozen_below": Float(0.1, min=0, unit="nats of validation-loss drop")},
    cpu_params={"model": {"n_layer": 4, "n_head": 2, "n_embd": 32}, "block_size": 32, "batch_size": 4,
                "max_iters": 60, "warmup_full": 20, "warmup_short": 5, "eval_every": 20, "eval_tokens": 256,
                "vocab_multiple": 1, "timing_warmup": 3},
    quick_params={"model": {"n_layer": 3, "n_head": 1, "n_embd": 8}, "block_size": 16, "batch_size": 4,
                  "max_iters": 8, "warmup_full": 4, "warmup_short": 1, "eval_every": 4, "eval_tokens": 128,
                  "vocab_multiple": 1, "timing_warmup": 1, "profile_steps": 2},
    variants=tuple(CONFIGS), footprint_bytes=footprint_bytes, work=work,
    workloads=lambda p: kernel_lists.training_workloads([(v, *plan(p, v)) for v in CONFIGS]))


if __name__ == "__main__":
    run_alone(EXERCISE, {"model": {"n_layer": 3, "n_head": 3, "n_embd": 15}, "block_size": 19, "batch_size": 3,
                         "max_iters": 9, "warmup_full": 3})
