"""Phase 5, quantization quality: what weight-only int8 and int4 cost in accuracy (nothing is timed here).

    lab run phase5.quant_quality [--param group_sizes=[128] --variant int4_awq]

Part 1, one layer on random weights (layer_int8, layer_int4). Llama-3.1-8B's four projections as
K x N (qkv 4096 x 6144, o 4096 x 4096, gate_up 4096 x 28672, down 14336 x 4096; on a CPU the
`tiny` shape's), the seeded bf16 weights of phase5.quant_kernels, quantized the same way (int8 per
output row, int4 in groups of `layer_group_size` with zero points). Per (matrix, format):
  rel_error_output     ||x W_q^T − x W^T|| / ||x W^T|| on `layer_batch` random bf16 activation rows,
                       in fp32 math (W the bf16 weight, W_q its dequantized copy)
  weight_rel_error     ||W_q − W|| / ||W||, and predicted_rel_error: rounding as uniform noise of
                       one step (the element's scale), sqrt(Σ scale² / 12) / ||W||
  max_abs_weight_error_over_scale   the check: every weight within half a step (<= 0.5)
For activations independent of W the output error equals the weight error in expectation.

Part 2, perplexity with real weights (reference, int8, int4_rtn, int4_awq). A phase 7 GPT (the 30M
shape by default) trained on TinyShakespeare, or loaded from <repo>/.lab_cache/quant_quality/ (git-
ignored; keyed by model and training config, the data's sha256 and the device type), then every
nn.Linear inside the transformer blocks (c_attn, attn c_proj, c_fc, mlp c_proj; not the embedding
nor the tied lm_head) replaced by a QuantizedLinear on the "naive" path (dequantize, then F.linear:
the same numbers as the fused kernels, on any device):
  reference   the trained model as it is (bf16 autocast on a GPU, as phase 7 evaluates; fp32 on a CPU)
  int8        per output row
  int4_rtn    round to nearest, one row per group size in `group_sizes` (128 and 32 by default;
              a width that is not a multiple of the group ends in a partial group)
  int4_awq    engine/awq.py: per layer, alpha on a grid of `awq_grid` points, scales from
              `calib_tokens` tokens of the TRAIN split, the scale kept in the layer (input_scale)
Each row: validation loss over the same windows (`eval_tokens`; null: the whole split) by phase 7's
evaluate(), perplexity exp(loss), its difference and ratio to the reference, the mean KL divergence
of the next-token distributions from the reference's and how often the top token is unchanged
(KL is second order in the perturbation, never negative: it ranks formats where a loss difference,
first order and of either sign, is still noise, as on a CPU's barely trained model), and the
quantized layers' bytes, bits per weight and relative weight error. The summary gives the training run (or the cache it came
from), the unigram loss of the validation split (what a model without context scores), and the
comparisons the exercise is about: int8 against int4, AWQ against RTN.

Built on phase 7: its trained GPT and data give the perplexity with real weights.
"""
import contextlib
import hashlib
import json
import math
from dataclasses import replace

import numpy as np
import torch
import torch.nn as nn

from common.exercise import Exercise, Needs, Result, row
from common.params import Bool, Choice, Float, Int
from common.paths import REPO_ROOT, relative_to_repo
from common.standalone import run_alone
from phases.phase7_gpt import data as D
from phases.phase7_gpt.gpt import GPT, param_formula
from phases.phase7_gpt.model import (
    BLOCK_SIZE,
    DATA_DIR,
    SEED,
    SHAPE_30M,
    VOCAB_MULTIPLE,
    Shape,
    training_bytes,
)
from phases.phase7_gpt.train import (
    Batches,
    autocast,
    clean,
    evaluate,
    model_config,
    setup,
    train,
    train_config,
)

from . import quant_kernels as qk
from .engine import SHAPES, awq, quantize

LAYER_VARIANTS = ("layer_int8", "layer_int4")
GPT_VARIANTS = ("reference", "int8", "int4_rtn", "int4_awq")
VARIANTS = LAYER_VARIANTS + GPT_VARIANTS
CACHE_DIR = REPO_ROOT / ".lab_cache" / "quant_quality"
# TrainConfig fields that change what is measured about a run, not the weights it ends with
NOT_IN_CACHE_KEY = ("eval_every", "eval_tokens", "profile_steps", "timing_warmup")
HALF_STEP = 0.5
BOUND_SLACK = 1e-5             # fp32 division in the ratio itself


# ------------------------------------------------------------------------------ part 1: one layer
def weight_error(weights: dict, prefix: str) -> dict:
    """The dequantized weight against the bf16 one, element by element, in fp32."""
    w = weights["bf16"].float()
    qw = weights[prefix].weight_format
    deq = qw.dequantize(torch.float32)
    if prefix == "w8":
        step = qw.scales.float()[:, None].expand_as(w)
    else:
        step = qw.scales.float().t()[:, torch.arange(w.shape[1], device=w.device) // qw.group_size]
    diff = (deq - w).abs()
    w_norm = float(w.double().norm())
    out = {"max_abs_weight_error": float(diff.max()),
           "max_abs_weight_error_over_scale": float((diff / step).max()),
           "mean_abs_weight_error_over_scale": float((diff / step).double().mean()),
           "weight_rel_error": float(diff.double().norm()) / w_norm,
           "predicted_rel_error": math.sqrt(float(step.double().pow(2).sum()) / 12) / w_norm,
           "weight_bytes": qw.nbytes(), "bits_per_weight": 8 * qw.nbytes() / w.numel()}
    del deq, diff, step
    return out


def layer_rows(ctx, params) -> list[dict]:
    todo = [v for v in LAYER_VARIANTS if ctx.wants(v)]
    if not todo:
        return []
    rows, g, m = [], params["layer_group_size"], params["layer_batch"]
    for matrix in ctx.track(params["matrices"], "matrices"):
        k_in, n_out = qk.matrix_shape(params["layer_model"], matrix)
        weights = qk.make_matrix(matrix, k_in, n_out, g, ctx.device)
        gen = torch.Generator(device=ctx.device).manual_seed(m * 31 + k_in)
        x = torch.randn(m, k_in, device=ctx.device, generator=gen).to(torch.bfloat16).float()
        y = x @ weights["bf16"].float().t()
        y_norm = float(y.double().norm())
        for variant in todo:
            prefix = "w8" if variant == "layer_int8" else "w4"
            size = {"model": params["layer_model"], "matrix": matrix, "k_in": k_in, "n_out": n_out, "batch": m,
                    "format": "int8" if prefix == "w8" else "int4",
                    "group_size": g if prefix == "w4" else None, "dtype": "bf16"}
            y_q = x @ weights[prefix].weight_format.dequantize(torch.float32).t()
            metrics = {"rel_error_output": float((y_q - y).double().norm()) / y_norm, **weight_error(weights, prefix)}
            del y_q
            worst = metrics["max_abs_weight_error_over_scale"]
            ok = worst <= HALF_STEP * (1 + BOUND_SLACK)
            check = {"reference": "each dequantized weight within half a step (its scale) of the bf16 weight",
                     "metric": "max_abs_error_over_scale", "precision": None, "tolerance": HALF_STEP,
                     "rel_l2_error": metrics["weight_rel_error"], "max_abs_error": metrics["max_abs_weight_error"],
                     "passed": ok, "reason": None if ok else f"a weight is {worst:.4f} steps from its original"}
            rows.append(row(variant, size, "ok" if ok else "failed", check["reason"], check=check, metrics=metrics))
        del weights, x, y
        if ctx.is_cuda:
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------ part 2: the model
def plan(params: dict):
    """(model config, training config) of the reference model."""
    cfg = model_config(params["gpt"], params["block_size"], params["vocab_multiple"])
    return cfg, train_config(params)


def cache_key(cfg, tc, data_hashes: dict, device_type: str) -> str:
    blob = {"model": cfg.as_dict(), "train": {k: v for k, v in tc.as_dict().items() if k not in NOT_IN_CACHE_KEY},
            "data": data_hashes, "device": device_type}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:20]


def trained_model(ctx, params, cfg, tc, data_dir, splits) -> tuple[GPT, dict]:
    """The reference GPT: from the cache when it holds this exact run, else trained (and cached)."""
    key = cache_key(cfg, tc, D.verify(data_dir, (D.TRAIN, D.VAL)), ctx.device.type)
    path = CACHE_DIR / f"{key}.pt"
    info = {"cache_key": key, "cache_file": relative_to_repo(path)}
    if params["use_cache"] and path.is_file():
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
            model = GPT(cfg)
            model.load_state_dict(blob["state_dict"])
            return model.to(ctx.device), {**blob["train"], **info, "from_cache": True}
        except Exception as exc:  # noqa: BLE001 - a damaged cache file: train again, and say so
            info["cache_error"] = f"unreadable ({type(exc).__name__}): trained again"   # no message: it may hold a path
    res = train(cfg, tc, splits, ctx.device, keep_model=True)
    model = res.pop("model")
    last = res["evals"][-1] if res["evals"] else [None, None, None]
    trained = {"steps": res["steps"], "wall_s": res["wall_s"], "stopped": res["stopped"],
               "first_nonfinite_step": res["first_nonfinite_step"], "final_train_loss": last[1],
               "final_val_loss": last[2], "best_val_loss": res["best_val_loss"], "best_val_step": res["best_val_step"],
               "curve": res["evals"], "tokens_per_step": res["tokens_per_step"], "device": ctx.device.type}
    info["from_cache"] = False
    if params["use_cache"] and res["first_nonfinite_step"] is None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            torch.save({"state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                        "train": clean(trained)}, tmp)
            tmp.replace(path)
        except OSError as exc:
            info["cache_error"] = f"not written: {exc.strerror}"
    return model, {**trained, **info}


def block_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every nn.Linear inside the transformer blocks (the embedding and the tied head stay)."""
    return [(n, m) for n, m in model.named_modules() if n.startswith("blocks.") and isinstance(m, nn.Linear)]


@contextlib.contextmanager
def swapped(model: nn.Module, replacements: dict):
    """The model with the named submodules replaced, restored afterwards."""
    originals = {}
    try:
        for name, new in replacements.items():
            parent, attr = name.rsplit(".", 1)
            owner = model.get_submodule(parent)
            originals[name] = (owner, attr, getattr(owner, attr))
            setattr(owner, attr, new)
        yield model
    finally:
        for owner, attr, old in originals.values():
            setattr(owner, attr, old)


@torch.no_grad()
def calibration_inputs(model: GPT, x: torch.Tensor, batch_size: int) -> dict:
    """name -> every input row each block linear sees on the windows x, fp32 [tokens, K] (the
    unquantized model, evaluated as evaluate() runs it)."""
    seen = {name: [] for name, _ in block_linears(model)}
    hooks = [m.register_forward_pre_hook(
        lambda mod, args, name=name: seen[name].append(args[0].detach().reshape(-1, args[0].shape[-1]).float()))
        for name, m in block_linears(model)]
    model.eval()
    try:
        for i in range(0, len(x), batch_size):
            with autocast(x.device):
                model(x[i:i + batch_size])
    finally:
        for h in hooks:
            h.remove()
        model.train()
    return {name: torch.cat(chunks) for name, chunks in seen.items()}


def unigram_loss(train_ids: np.ndarray, val_ids: np.ndarray, vocab: int) -> float:
    """Cross-entropy of the validation split under the train split's token frequencies (add-one
    smoothed): the loss of a model that ignores context."""
    counts = np.bincount(train_ids.astype(np.int64), minlength=vocab).astype(np.float64) + 1.0
    return float(-np.log(counts[val_ids.astype(np.int64)] / counts.sum()).mean())


def quantized_weight_stats(model: GPT, modules: dict) -> dict:
    """Bytes and relative error of the quantized block weights (AWQ: the weight it effectively
    multiplies x by, Q(W s) / s) against the model's own."""
    err2 = ref2 = 0.0
    nbytes = n = 0
    for name, lin in block_linears(model):
        q = modules[name]
        w = lin.weight.detach().float()
        eff = q.weight_format.dequantize(torch.float32)
        if q.input_scale is not None:
            eff = eff * q.input_scale.float()[None, :]
        err2 += float((eff - w).double().pow(2).sum())
        ref2 += float(w.double().pow(2).sum())
        nbytes += q.weight_format.nbytes() + (0 if q.input_scale is None else q.input_scale.numel() * 2)
        n += w.numel()
    return {"weight_rel_error": math.sqrt(err2 / ref2) if ref2 else None, "weight_bytes": nbytes,
            "bits_per_weight": 8 * nbytes / n if n else None, "bf16_weight_bytes": 2 * n,
            "layers_quantized": len(modules)}


LOGIT_CHUNK = 2**25            # logits held at once by divergence(): 128 MiB in fp32


@torch.no_grad()
def divergence(model: GPT, variants: dict, x: torch.Tensor) -> dict:
    """label -> mean KL(reference || quantized) of the next-token distributions (nats per token)
    and the fraction of tokens whose most likely next token is unchanged, on the windows x. The
    reference's log-probabilities are computed once per chunk of windows and compared with every
    variant's (modules swapped in), so no variant needs a copy of the model. KL is >= 0 and grows
    with the square of a small perturbation, so it ranks formats where a loss difference (first
    order in the perturbation, either sign) is still noise."""
    vocab = model.cfg.vocab_size
    chunk = max(1, LOGIT_CHUNK // (x.shape[1] * model.cfg.padded_vocab))
    kl = {k: torch.zeros((), dtype=torch.float64, device=x.device) for k in variants}
    same = {k: torch.zeros((), dtype=torch.int64, device=x.device) for k in variants}
    model.eval()
    try:
        for i in range(0, len(x), chunk):
            with autocast(x.device):
                logits, _ = model(x[i:i + chunk])
            ref = torch.log_softmax(logits[..., :vocab].float(), dim=-1)
            del logits
            ref_top = ref.argmax(-1)
            for key, modules in variants.items():
                with swapped(model, modules), autocast(x.device):
                    logits, _ = model(x[i:i + chunk])
                q = torch.log_softmax(logits[..., :vocab].float(), dim=-1)
                del logits
                kl[key] += (ref.exp() * (ref - q)).sum(-1).double().sum()
                same[key] += (q.argmax(-1) == ref_top).sum()
                del q
    finally:
        model.train()
    n = x.numel()
    return {k: {"kl_vs_reference": float(kl[k]) / n, "top1_agreement": int(same[k]) / n} for k in variants}


def quantized_sets(params, model: GPT, todo: list[str], batches: Batches, eval_batch: int) -> list[tuple]:
    """(variant, row params, {linear name: QuantizedLinear}, extra metrics) for each quantized row."""
    linears = block_linears(model)
    out = []
    if "int8" in todo:
        out.append(("int8", {"bits": 8, "group_size": None},
                    {n: quantize.QuantizedLinear.from_linear(lin, 8, path="naive") for n, lin in linears}, {}))
    if "int4_rtn" in todo:
        for g in params["group_sizes"]:
            out.append(("int4_rtn", {"bits": 4, "group_size": g},
                        {n: quantize.QuantizedLinear.from_linear(lin, 4, g, path="naive") for n, lin in linears}, {}))
    if "int4_awq" in todo:
        cx, _ = batches.windows("train", params["calib_tokens"])
        inputs = calibration_inputs(model, cx, eval_batch)
        grid = awq.alpha_grid(params["awq_grid"])
        for g in params["group_sizes"]:
            modules, found = {}, {}
            for n, lin in linears:
                modules[n], search = awq.awq_linear(lin, inputs[n], g, "naive", grid)
                found[n] = search.as_dict()
            ratios = [f["loss_over_rtn"] for f in found.values() if f["loss_over_rtn"] is not None]
            extra = {"calibration_tokens": cx.numel(), "calibration_split": "train", "awq_grid": len(grid),
                     "alpha_per_layer": {n: f["alpha"] for n, f in found.items()},
                     "calibration_loss_over_rtn_mean": float(np.mean(ratios)) if ratios else None,
                     "calibration_loss_over_rtn_max": max(ratios) if ratios else None,
                     "layers": {n: {k: f[k] for k in ("alpha", "loss_over_rtn", "relative_loss", "relative_rtn_loss",
                                                      "losses")} for n, f in found.items()}}
            out.append(("int4_awq", {"bits": 4, "group_size": g, "calibration_tokens": cx.numel()}, modules, extra))
        del inputs
    return out


def gpt_rows(ctx, params) -> tuple[list[dict], dict]:
    todo = [v for v in GPT_VARIANTS if ctx.wants(v)]
    if not todo:
        return [], {}
    data_dir, splits, _ = setup(ctx, params)
    cfg, tc = plan(params)
    model, training = trained_model(ctx, params, cfg, tc, data_dir, splits)
    batches = Batches(splits[0], splits[1], cfg.block_size, ctx.device, tc.seed)
    vx, vy = batches.windows("val", params["eval_tokens"])
    eval_batch = params["batch_size"]
    dtype = "bf16 autocast" if ctx.is_cuda else "fp32"
    base = {"gpt": cfg.as_dict(), "dtype": dtype, "path": "naive", "eval_tokens": vy.numel()}
    ref_loss = evaluate(model, vx, vy, eval_batch)
    unigram = unigram_loss(splits[0], splits[1], cfg.vocab_size)
    linears = block_linears(model)
    n_weights = sum(lin.weight.numel() for _, lin in linears)
    rows = []

    def add(variant, extra_params, loss, metrics):
        ok = math.isfinite(loss)
        m = {"val_loss": loss, "perplexity": math.exp(loss) if ok and loss < 700 else None,
             "delta_loss_vs_reference": loss - ref_loss,
             "perplexity_ratio_vs_reference": math.exp(loss - ref_loss) if ok and loss - ref_loss < 700 else None,
             **metrics}
        if m["perplexity"] is not None:
            m["delta_perplexity_vs_reference"] = m["perplexity"] - math.exp(ref_loss)
        rows.append(row(variant, {**base, **extra_params}, "ok" if ok else "failed",
                        None if ok else f"validation loss is not finite ({loss})", metrics=clean(m)))

    if "reference" in todo:
        add("reference", {"bits": None, "group_size": None}, ref_loss,
            {"bf16_weight_bytes": 2 * n_weights, "below_unigram_by": unigram - ref_loss,
             "kl_vs_reference": 0.0, "top1_agreement": 1.0})
    sets = list(ctx.track(quantized_sets(params, model, todo, batches, eval_batch), "quantized models"))
    diverged = divergence(model, {i: modules for i, (_, _, modules, _) in enumerate(sets)}, vx)
    for i, (variant, extra_params, modules, extra) in enumerate(sets):
        stats = quantized_weight_stats(model, modules)
        with swapped(model, modules):
            loss = evaluate(model, vx, vy, eval_batch)
        add(variant, extra_params, loss, {**diverged[i], **stats, **extra})
    del sets

    summary = {"reference_model": {"shape": params["gpt"], "block_size": cfg.block_size,
                                   "params_total": param_formula(replace(cfg, vocab_multiple=1))["total"],
                                   "params_quantized": n_weights, "val_loss": ref_loss,
                                   "training": training},       # its own evaluations: eval_tokens then
               "data": D.label_of(data_dir), "unigram_val_loss": unigram,
               "reference_below_unigram": ref_loss < unigram, "eval": dtype}
    summary.update(compare(rows))
    del model
    if ctx.is_cuda:
        torch.cuda.empty_cache()
    return rows, summary


def label(r: dict) -> str:
    g = r["params"].get("group_size")
    return r["variant"] + (f"_g{g}" if g else "")


def compare(rows: list[dict]) -> dict:
    """The exercise's comparisons, from the rows: loss increase of each format, int8 against
    int4 RTN, and AWQ against RTN at each group size."""
    ok = {label(r): r["metrics"] for r in rows if r["status"] == "ok" and r["variant"] in GPT_VARIANTS}
    out = {"perplexity": {k: m.get("perplexity") for k, m in ok.items()},
           "delta_loss_vs_reference": {k: m.get("delta_loss_vs_reference") for k, m in ok.items()},
           "kl_vs_reference": {k: m.get("kl_vs_reference") for k, m in ok.items()}}
    rtn = {k: m for k, m in ok.items() if k.startswith("int4_rtn")}
    if "int8" in ok and rtn:
        out["int8_closer_than_every_int4_rtn"] = all(abs(ok["int8"]["delta_loss_vs_reference"]) <
                                                      abs(m["delta_loss_vs_reference"]) for m in rtn.values())
        out["int8_lower_kl_than_every_int4_rtn"] = all(ok["int8"]["kl_vs_reference"] < m["kl_vs_reference"]
                                                        for m in rtn.values())
    awq_gain, awq_kl = {}, {}
    for k, m in ok.items():
        if k.startswith("int4_awq"):
            twin = ok.get(k.replace("int4_awq", "int4_rtn"))
            if twin:
                g = k.removeprefix("int4_awq_")
                awq_gain[g] = twin["delta_loss_vs_reference"] - m["delta_loss_vs_reference"]
                awq_kl[g] = m["kl_vs_reference"] / twin["kl_vs_reference"] if twin["kl_vs_reference"] else None
    if awq_gain:
        out["awq_loss_reduction_vs_rtn"] = awq_gain            # > 0: AWQ's model is closer to the reference
        out["awq_kl_over_rtn_kl"] = awq_kl                     # < 1: AWQ's distributions are closer
    return out


def layer_summary(rows: list[dict]) -> dict:
    return {f"{r['params']['matrix']} {r['params']['format']}": r["metrics"]["rel_error_output"]
            for r in rows if r["status"] == "ok" and r["variant"] in LAYER_VARIANTS}


def run(ctx, params):
    rows = layer_rows(ctx, params)
    summary = {"layer_rel_error_output": layer_summary(rows)}
    more, gpt_summary = gpt_rows(ctx, params)
    rows += more
    summary.update(gpt_summary)
    summary["reference_convention"] = ("part 1: fp32 math on the bf16 weight and bf16-rounded random activations; "
                                       "part 2: the unquantized trained model, evaluated the same way")
    return Result(clean(rows), clean(summary))


# ------------------------------------------------------------------------------ declaration
def footprint_bytes(p: dict) -> float:
    """The larger of the two parts. Part 1: per weight the bf16 copy, both formats, and ~5 fp32
    temporaries (the fp32 weight, its dequantized copy, the difference, the per-element step and
    one more); plus x and y. Part 2: a training step of the GPT, a second copy of the block
    weights (the quantized modules with their dequantized temporaries) and the calibration
    inputs of every block linear (7 x n_embd fp32 values per token per layer)."""
    layer = 0
    for matrix in p["matrices"]:
        k_in, n_out = qk.matrix_shape(p["layer_model"], matrix)
        layer = max(layer, 24 * k_in * n_out + 12 * p["layer_batch"] * (k_in + n_out))
    shape = p["gpt"]
    cfg = model_config(shape, p["block_size"], p["vocab_multiple"])
    blocks = param_formula(cfg)["blocks"]
    calib_tokens = min(p["calib_tokens"], len_train_tokens()) + p["block_size"]
    calib = 4 * 7 * shape["n_embd"] * shape["n_layer"] * calib_tokens
    gpt = training_bytes(shape, p["block_size"], p["batch_size"], p["vocab_multiple"]) + 12 * blocks + calib
    return max(layer, gpt)


def len_train_tokens() -> int:
    from phases.phase7_gpt import seed
    return seed.DATA["train_tokens"]


EXERCISE = Exercise(
    id="phase5.quant_quality",
    title="Weight-only int8/int4 quality: layer error on the 8B matrices, GPT perplexity with RTN and AWQ",
    run=run, needs=Needs(),
    params={"layer_model": Choice("llama-3.1-8b", tuple(SHAPES), help="whose projection matrices (part 1)"),
            "matrices": Choice(list(qk.MATRICES), qk.MATRICES, many=True, help="projections, K x N in the docstring"),
            "layer_batch": Int(256, min=1, unit="random activation rows (part 1)"),
            "layer_group_size": Int(128, choices=quantize.GROUP_SIZES, unit="int4 inputs per (scale, zero), part 1"),
            "data_dir": DATA_DIR, "seed": SEED, "gpt": Shape(SHAPE_30M), "block_size": BLOCK_SIZE,
            "vocab_multiple": VOCAB_MULTIPLE,
            "batch_size": Int(64, min=1, unit="sequences per training step and per evaluation batch"),
            "max_iters": Int(300, min=1, unit="training steps"), "warmup_iters": Int(30, min=0, unit="steps"),
            "lr": Float(1e-3, min=0, max=1, unit="peak learning rate"),
            "eval_every": Int(100, min=1, unit="steps between the training run's evaluations"),
            "eval_tokens": Int(None, min=1, nullable=True, unit="validation tokens; null: the whole split"),
            "calib_tokens": Int(4096, min=1, unit="train-split tokens AWQ calibrates on"),
            "group_sizes": Int([128, 32], choices=quantize.GROUP_SIZES, many=True, unit="int4 inputs per group (part 2)"),
            "awq_grid": Int(awq.GRID_POINTS, min=2, max=1000, unit="alphas from 0 to 1"),
            "use_cache": Bool(True, help="reuse a trained model from <repo>/.lab_cache/quant_quality/ (and save one)")},
    cpu_params={"layer_model": "tiny", "layer_batch": 16, "gpt": {"n_layer": 2, "n_head": 2, "n_embd": 64},
                "block_size": 32, "batch_size": 8, "max_iters": 60, "warmup_iters": 6, "lr": 3e-3,
                "eval_every": 60, "eval_tokens": 2048, "calib_tokens": 1024, "vocab_multiple": 1},
    quick_params={"layer_model": "tiny", "matrices": ["o"], "layer_batch": 4,
                  "gpt": {"n_layer": 1, "n_head": 2, "n_embd": 32}, "block_size": 16, "batch_size": 4,
                  "max_iters": 12, "warmup_iters": 2, "eval_every": 12, "eval_tokens": 512, "calib_tokens": 256,
                  "vocab_multiple": 1, "awq_grid": 5},
    variants=VARIANTS, footprint_bytes=footprint_bytes)


if __name__ == "__main__":
    run_alone(EXERCISE, {})
