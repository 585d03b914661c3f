"""Exercise 7.2: the model, counted and checked before it trains.

    lab run phase7.model

  params_30m, params_7m   where the parameters sit (token and position embeddings, blocks, final
                          LayerNorm, head), counted from the module and from gpt.param_formula;
                          the two must agree exactly
  params_30m_untied       the same shape with its own output head: what weight tying saves
  init_loss               an untrained model predicts about uniformly: its loss must sit near
                          ln(vocabulary), its logits must be (B, T, vocabulary)
  sdpa_flash, sdpa_math   one forward + backward with attention forced onto the flash kernel,
                          then onto the math path that writes the T x T scores to memory; each
                          backend first checked against float64 attention. One problem: the same
                          FLOPs and fewest bytes (sdpa_cost); the kernels differ

Also the shared declarations of the training exercises: shapes, the data folder, memory estimates.
"""
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from common.exercise import Exercise, Result, Work, reference_check, row, throughput_metrics
from common.params import Folder, Int, Record
from common.standalone import run_alone

from . import seed
from . import kernel_lists
from .gpt import GPT, GPTConfig, param_breakdown, param_formula, step_cost
from .train import autocast, clean, count_kernels, setup

# ------------------------------------------------------------------------------ declarations
SHAPE = {"n_layer": Int(None, min=1, max=96, unit="layers"),       # a model shape: every key required
         "n_head": Int(None, min=1, max=128, unit="heads"),
         "n_embd": Int(None, min=1, max=16384, unit="channels")}
SHAPE_30M = {"n_layer": 6, "n_head": 6, "n_embd": 384}


def heads_divide_width(shape: dict) -> str | None:
    """Attention splits n_embd channels evenly across n_head heads."""
    if shape["n_embd"] % shape["n_head"]:
        return f"n_embd {shape['n_embd']} is not a multiple of n_head {shape['n_head']}"
    return None


def Shape(default, *, many=False, extra=None) -> Record:
    """A model shape parameter (every key required; heads must divide the width)."""
    return Record(default, {**(extra or {}), **SHAPE}, many=many, rule=heads_divide_width)
SHAPE_7M = {"n_layer": 4, "n_head": 4, "n_embd": 128}

# shared with the training exercises (overfit.COMMON). block_size <= 8,192: the 33,803-token
# validation split must hold failures.py's probe of 4 windows and at least one evaluation window
DATA_DIR = Folder(None)
SEED = Int(1337, min=0, max=2**64 - 1)
BLOCK_SIZE = Int(256, min=1, max=8192, unit="tokens")
VOCAB_MULTIPLE = Int(64, min=1, unit="vocabulary rows (pad to a multiple of this)")

DATA_BYTES = 16 * seed.DATA["tokens"]     # both splits as int64 on the device, plus evaluation windows


def training_bytes(shape: dict, block_size: int, batch_size: int, vocab_multiple: int = 1,
                   optimizer: bool = True) -> float:
    """Rough peak device bytes of one training step (fp32 state, bf16 activations, fp32 logits)."""
    cfg = GPTConfig(block_size=block_size, vocab_multiple=vocab_multiple, **shape)
    n = param_formula(cfg)["total"]                     # allocated: the padded vocabulary rows included
    tokens = batch_size * block_size
    state = n * (16 if optimizer else 8)                # weights, grads (+ AdamW's two moments), fp32
    activations = tokens * cfg.n_embd * cfg.n_layer * 34            # bf16, saved for the backward
    logits = tokens * cfg.padded_vocab * 4 * 2                      # fp32 logits and their gradient
    return state + activations + logits + DATA_BYTES


def _count_row(variant: str, cfg: GPTConfig, compare_seed: bool) -> dict:
    with torch.device("meta"):                       # shapes only: no memory, no initialization
        model = GPT(cfg)
    counted, formula = param_breakdown(model), param_formula(cfg)
    agree = counted == formula
    check = {"reference": "closed-form count (model.param_formula)", "metric": "exact", "precision": None,
             "tolerance": 0, "rel_l2_error": None,
             "max_abs_error": max(abs(counted[k] - formula[k]) for k in formula), "passed": agree,
             "reason": None if agree else f"module {counted} != formula {formula}"}
    metrics = {"counted": counted, "formula": formula, "total": counted["total"],
               "non_embedding": counted["non_embedding"],
               "wte_pct_of_total": 100 * counted["wte"] / counted["total"],
               "per_block": formula["blocks"] // max(1, cfg.n_layer),
               "tied": cfg.tie_weights}
    if compare_seed:
        metrics["seed"] = seed.MODEL_30M
        metrics["seed_citation"] = seed.CITATION
    return row(variant, {"model": cfg.as_dict()}, "ok" if agree else "failed", check["reason"],
               check=check, metrics=metrics)


ATTENTION = {"sdpa_flash": (SDPBackend.FLASH_ATTENTION, "flash"), "sdpa_math": (SDPBackend.MATH, "math")}


def run_config(params: dict) -> GPTConfig:
    """The model that runs here: model_run (the 30M shape on a GPU, a small one on a CPU)."""
    return GPTConfig(block_size=params["block_size"], vocab_multiple=params["vocab_multiple"], **params["model_run"])


def sdpa_cost(cfg: GPTConfig, batch: int, dtype: str, variant: str) -> dict:
    """One sdpa_* call: forward + backward of `batch` windows, no optimizer and no batch sampling
    (cost.step_cost: 6N + attention + head FLOPs per token; 12 bytes per parameter, the saved
    activations and the ids; the eager kernels of that attention path). Flash and math are one
    problem: the same FLOPs and the same fewest bytes; the math path's T x T scores are its excess."""
    return step_cost(cfg, batch, dtype, optimizer=False, data=False, attention=ATTENTION[variant][1])


def work(params: dict) -> list[Work]:
    """The two timed rows on a GPU (bf16 autocast), per call, timed without an L2 flush."""
    cfg, B = run_config(params), params["sdpa_batch"]
    return [Work(f"{v} {B} x {cfg.block_size} tokens", c["flops"], c["bytes"], "bf16", warm=True, launches=c["launches"])
            for v in ATTENTION for c in [sdpa_cost(cfg, B, "bf16", v)]]


def _attention_check(ctx, backend, shape, dtype) -> dict:
    """The backend's causal attention against float64 math on the same random q, k, v."""
    g = torch.Generator(device=ctx.device).manual_seed(7)
    q, k, v = (torch.randn(*shape, device=ctx.device, generator=g) for _ in range(3))
    T = shape[2]
    mask = torch.ones(T, T, dtype=torch.bool, device=ctx.device).tril()
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(shape[-1])
    ref = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v.double()
    t = torch.bfloat16 if dtype == "bf16" else torch.float32
    q, k, v = q.to(t), k.to(t), v.to(t)
    out = torch.empty(*shape, device=ctx.device, dtype=t)

    def attend():
        with sdpa_kernel([backend]):
            out.copy_(F.scaled_dot_product_attention(q, k, v, is_causal=True))

    return reference_check(ctx, out, attend, ref, f"float64 causal softmax attention, shape {tuple(shape)}",
                           precision=dtype)()


def run(ctx, params):
    data_dir, splits, _ = setup(ctx, params)
    rows = []
    bs, V, seed_bs = params["block_size"], 50257, 256      # the counts use the seed's 256-token window
    for variant, cfg, cmp in (("params_30m", GPTConfig(block_size=seed_bs, **params["model_30m"]), True),
                              ("params_7m", GPTConfig(block_size=seed_bs, **params["model_7m"]), False),
                              ("params_30m_untied", GPTConfig(block_size=seed_bs, tie_weights=False, **params["model_30m"]), False)):
        if ctx.wants(variant):
            rows.append(_count_row(variant, cfg, cmp))

    # The model that runs here: the 30M shape on a GPU, a small one on a CPU.
    cfg = run_config(params)
    torch.manual_seed(params["seed"])
    model = GPT(cfg).to(ctx.device)
    val = torch.from_numpy(splits[1].astype("int64")).to(ctx.device)
    if ctx.wants("init_loss"):
        B, T = params["init_batch"]
        T = min(T, bs)
        starts = torch.arange(B, device=ctx.device) * (T + 1)
        w = val[starts[:, None] + torch.arange(T + 1, device=ctx.device)]
        with torch.no_grad(), autocast(ctx.device):
            logits, loss = model(w[:, :-1], w[:, 1:])
        loss = float(loss)
        shape = list(logits[..., :V].shape)
        want = math.log(V)
        ok = shape == [B, T, V] and math.isfinite(loss) and abs(loss - want) <= 0.3
        check = {"reference": f"ln({V}) = {want:.4f} and logits shape [{B}, {T}, {V}]", "metric": "abs_error",
                 "precision": "bf16" if ctx.is_cuda else "fp32", "tolerance": 0.3, "rel_l2_error": None,
                 "max_abs_error": abs(loss - want) if math.isfinite(loss) else None, "passed": ok,
                 "reason": None if ok else f"loss {loss:.4f}, logits {shape}"}
        rows.append(row("init_loss", {"model": cfg.as_dict(), "batch": [B, T]}, "ok" if ok else "failed",
                        check["reason"], check=check,
                        metrics={"initial_loss": loss, "ln_vocab": want, "gap": loss - want, "logits_shape": shape,
                                 "padded_logits": list(logits.shape),
                                 "params_total": param_formula(GPTConfig(block_size=bs, **params["model_run"]))["total"],
                                 "seed_initial_loss": seed.MODEL_30M["initial_loss"], "seed_citation": seed.CITATION}))

    dtype = "bf16" if ctx.is_cuda else "fp32"
    B = params["sdpa_batch"]
    x = val[torch.arange(B, device=ctx.device)[:, None] * bs + torch.arange(bs, device=ctx.device)]
    y = val[torch.arange(B, device=ctx.device)[:, None] * bs + torch.arange(1, bs + 1, device=ctx.device)]
    for variant, (backend, _) in ATTENTION.items():
        if not ctx.wants(variant):
            continue
        p = {"model": cfg.as_dict(), "batch": [B, bs], "backend": backend.name, "dtype": dtype}
        try:
            verdict = _attention_check(ctx, backend, (B, cfg.n_head, bs, cfg.n_embd // cfg.n_head), dtype)
        except RuntimeError as exc:                  # the backend cannot run here (GPU arch, dtype)
            rows.append(row(variant, p, "skipped", f"{backend.name} unavailable: {str(exc).splitlines()[0][:200]}"))
            continue
        if not verdict["passed"]:
            rows.append(row(variant, p, "failed", verdict["reason"], check=verdict))
            continue

        def step(backend=backend):
            model.zero_grad(set_to_none=True)
            with sdpa_kernel([backend]), autocast(ctx.device):
                _, loss = model(x, y)
            loss.backward()

        t = ctx.time(step, flush_l2=False)
        cost = sdpa_cost(cfg, B, dtype, variant)
        flops, nbytes = cost["flops"], cost["bytes"]
        roofs = ctx.roofs(dtype)
        m = throughput_metrics(t.median_ms, flops, nbytes, roofs, dtype, t.min_ms)
        m["tokens_per_s"] = B * bs / (t.median_ms / 1e3)
        m["attention_scores_bytes_if_materialized"] = B * cfg.n_head * bs * bs * (2 if dtype == "bf16" else 4)
        m["bytes_parts"], m["kernels_parts"] = cost["bytes_parts"], cost["launches_parts"]
        counted = count_kernels(step, ctx.device)                  # after timing: a warm call
        m["kernels_counted"], m["kernels_counted_error"] = counted.n, counted.error
        rows.append(row(variant, p, "ok", None, check=verdict, timing=t, metrics=m,
                        prediction=ctx.predict(flops, nbytes, dtype, t, launches=cost["launches"])))
    model.zero_grad(set_to_none=True)
    flash = [r for r in rows if r["variant"] == "sdpa_flash" and r["status"] == "ok"]
    math_ = [r for r in rows if r["variant"] == "sdpa_math" and r["status"] == "ok"]
    summary = {"flash_speedup_over_math": (math_[0]["metrics"]["ms"] / flash[0]["metrics"]["ms"]) if flash and math_ else None,
               "seed": seed.MODEL_30M, "seed_citation": seed.CITATION}
    return Result(clean(rows), clean(summary))


def footprint_bytes(p: dict) -> float:
    """model_run's forward + backward on sdpa_batch windows, math attention's scores and the fp64 check."""
    shape, T, B = p["model_run"], p["block_size"], p["sdpa_batch"]
    scores = B * shape["n_head"] * T * T
    math_path = shape["n_layer"] * scores * 2 * 3       # bf16 scores, probabilities, their gradient, per layer
    reference = scores * 8 * 3                          # _attention_check: fp64 scores, masked, softmax
    return training_bytes(shape, T, B, p["vocab_multiple"], optimizer=False) + math_path + reference


EXERCISE = Exercise(
    id="phase7.model", title="nanoGPT-style model: parameter breakdown, initial loss, flash attention",
    run=run,
    params={"data_dir": DATA_DIR, "seed": SEED, "block_size": BLOCK_SIZE, "model_30m": Shape(SHAPE_30M),
            "model_7m": Shape(SHAPE_7M), "model_run": Shape(SHAPE_30M),
            "vocab_multiple": VOCAB_MULTIPLE,
            "init_batch": Int([4, 64], min=1, length=2, unit="[sequences, tokens]"),
            "sdpa_batch": Int(32, min=1, unit="sequences")},
    cpu_params={"model_run": {"n_layer": 2, "n_head": 2, "n_embd": 64}, "block_size": 64, "sdpa_batch": 2},
    quick_params={"model_run": {"n_layer": 1, "n_head": 2, "n_embd": 16}, "block_size": 32,
                  "init_batch": [2, 16], "sdpa_batch": 2},
    variants=("params_30m", "params_7m", "params_30m_untied", "init_loss", "sdpa_flash", "sdpa_math"),
    footprint_bytes=footprint_bytes, work=work,
    workloads=lambda p: [(f"sdpa_flash {p['sdpa_batch']} x {p['block_size']} tokens", kernel_lists.training_step(
        run_config(p), p["sdpa_batch"], "bf16", optimizer=False, data=False))])


if __name__ == "__main__":
    run_alone(EXERCISE, {"model_run": {"n_layer": 1, "n_head": 3, "n_embd": 24}, "block_size": 23,
                         "init_batch": [3, 19], "sdpa_batch": 3})
