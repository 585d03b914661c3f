"""One training loop for every phase 7 exercise, and the row it becomes in a record.

AdamW (fused on CUDA), a cosine learning-rate schedule with linear warmup, optional gradient
clipping, bf16 autocast and TF32 on CUDA, optional torch.compile. Every step's loss and gradient
norm go into a device buffer (no host sync per step); they are read at evaluation points, which
synchronize anyway. Each step is bracketed by two CUDA events, so its time is measured on the
GPU's own clock without slowing the loop. A few dedicated steps (`profile_steps`) add events
between data, forward, backward and optimizer, and synchronize before and after themselves, so
the breakdown says where a step's time goes; those steps are left out of the timing statistics.

Data: the whole split lives on the device (a few MB as int64); a batch is B random
windows drawn with a seeded torch.Generator, so the same seed gives the same batches.
Evaluation uses fixed windows (all of the validation split by default), so it draws no random
numbers and two runs with the same seed see identical batches whatever they evaluate.
"""
import contextlib
import math
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from common.exercise import Work, row, throughput_metrics
from common.timing import summarize

from . import analysis
from . import data as D
from .cost import step_cost
from .gpt import (
    GPT,
    GPTConfig,
    flops_per_token,
    param_breakdown,
    param_formula,
)

LOG_POINTS = 500         # curves in a record are downsampled to at most this many points


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 64
    max_iters: int = 1000            # the schedule's length
    stop_at: int | None = None       # stop after this many updates (the schedule still spans max_iters)
    lr: float = 1e-3
    min_lr_ratio: float = 0.1        # cosine decays to lr x this
    warmup_iters: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0           # 0: no clipping (the norm is still measured every step)
    eval_every: int = 50
    eval_tokens: int | None = None   # None: the whole validation split
    patience: int | None = None      # early stop after this many evaluations without a new best
    seed: int = 1337
    compile: bool = False
    profile_steps: int = 3
    timing_warmup: int = 5           # steps left out of the timing statistics

    def as_dict(self) -> dict:
        return asdict(self)


def lr_at(step: int, tc: TrainConfig) -> float:
    if step < tc.warmup_iters:
        return tc.lr * (step + 1) / (tc.warmup_iters + 1)
    span = max(1, tc.max_iters - tc.warmup_iters)
    progress = min(1.0, (step - tc.warmup_iters) / span)
    floor = tc.lr * tc.min_lr_ratio
    return floor + 0.5 * (1 + math.cos(math.pi * progress)) * (tc.lr - floor)


# ------------------------------------------------------------------------------ data
class Batches:
    def __init__(self, train: np.ndarray, val: np.ndarray, block_size: int, device: torch.device, seed: int):
        self.T, self.device = block_size, device
        self.train = torch.from_numpy(train.astype(np.int64)).to(device)
        self.val = torch.from_numpy(val.astype(np.int64)).to(device)
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.offsets = torch.arange(block_size + 1, device=device)

    def sample(self, batch_size: int):
        ix = torch.randint(len(self.train) - self.T - 1, (batch_size, 1), device=self.device, generator=self.gen)
        # two gathers on the device, both contiguous (a compiled model guards on input strides)
        return self.train[ix + self.offsets[:-1]], self.train[ix + self.offsets[1:]]

    def windows(self, split: str, n_tokens: int | None):
        """Fixed (x, y) windows: back to back over the whole split, or evenly spaced to n_tokens."""
        ids = self.val if split == "val" else self.train
        n_all = (len(ids) - 1) // self.T
        k = n_all if n_tokens is None else max(1, min(n_all, -(-n_tokens // self.T)))
        starts = (torch.arange(k) * self.T if (n_tokens is None or k == n_all) else
                  torch.linspace(0, len(ids) - self.T - 1, k).long()).to(self.device)
        w = ids[starts[:, None] + self.offsets]
        return w[:, :-1], w[:, 1:]


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: GPT, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> float:
    model.eval()
    total, n = torch.zeros((), device=x.device, dtype=torch.float64), 0
    for i in range(0, len(x), batch_size):
        with autocast(x.device):
            _, loss = model(x[i:i + batch_size], y[i:i + batch_size])
        total += loss.double() * y[i:i + batch_size].numel()
        n += y[i:i + batch_size].numel()
    model.train()
    return float(total / n)


# ------------------------------------------------------------------------------ kernels, counted
class KernelCount:
    """The device activities (kernels, memsets, copies) launched between start() and stop() on a
    CUDA GPU, counted by torch.profiler: what the cost model's kernel estimate (cost.step_kernels)
    is checked against. `n` stays None on a CPU, or where the profiler cannot see the device."""

    def __init__(self, device: torch.device):
        self.n, self.error, self._prof = None, None, None
        if device.type != "cuda":
            return
        try:
            from torch.profiler import ProfilerActivity, profile
            torch.cuda.synchronize()
            self._prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self._prof.start()
        except Exception as exc:  # noqa: BLE001 - a count is a bonus: say why there is none
            self._prof, self.error = None, f"{type(exc).__name__}: {exc}"[:200]

    def stop(self) -> "KernelCount":
        if self._prof is None:
            return self
        try:
            torch.cuda.synchronize()
            self._prof.stop()
            device = torch.autograd.DeviceType.CUDA
            self.n = sum(1 for e in self._prof.events() if e.device_type == device) or None
            if self.n is None:
                self.error = "the profiler recorded no device activity"
        except Exception as exc:  # noqa: BLE001
            self.error = f"{type(exc).__name__}: {exc}"[:200]
        self._prof = None
        return self


def count_kernels(fn, device: torch.device) -> KernelCount:
    """One call of fn under the profiler (call it warm: a first call also counts one-time work)."""
    counter = KernelCount(device)
    if device.type == "cuda":
        fn()
    return counter.stop()


# ------------------------------------------------------------------------------ the loop
def _grad_norm(params, clip: float):
    if clip and clip > 0:
        return torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
    grads = [p.grad for p in params if p.grad is not None]
    if hasattr(torch.nn.utils, "get_total_norm"):
        return torch.nn.utils.get_total_norm(grads, foreach=True)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def make_optimizer(model: GPT, tc: TrainConfig, device: torch.device):
    """AdamW; weight decay on the matrices (and embeddings), none on LayerNorm gains and biases."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


class _Clock:
    """Timestamps of a step's phases: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def train(cfg: GPTConfig, tc: TrainConfig, splits, device: torch.device, *, keep_model: bool = False,
          on_eval=None) -> dict:
    """Train one model; return its curves, timings and outcome (NaN stops the run early)."""
    train_ids, val_ids = splits
    torch.manual_seed(tc.seed)                    # same seed -> same initial weights (built on the CPU)
    model = GPT(cfg).to(device)
    data = Batches(train_ids, val_ids, cfg.block_size, device, tc.seed)
    vx, vy = data.windows("val", tc.eval_tokens)
    tx, ty = data.windows("train", vx.numel())
    opt = make_optimizer(model, tc, device)
    params = [p for p in model.parameters()]
    cuda = device.type == "cuda"
    clock = _Clock(device)
    n_steps = min(tc.max_iters, tc.stop_at) if tc.stop_at else tc.max_iters
    out = {"compile_s": None, "compile_error": None}

    prev_precision = torch.get_float32_matmul_precision()
    if cuda:
        torch.set_float32_matmul_precision("high")      # TF32 for any fp32 matmul left outside autocast
    try:
        step_model = model
        if tc.compile:
            step_model, out["compile_s"], out["compile_error"] = _compile(model, cfg, tc, device)

        losses = torch.full((n_steps,), float("nan"), device=device)
        norms = torch.full((n_steps,), float("nan"), device=device)
        marks = []                                            # (step, start, end)
        profiled = set(range(tc.timing_warmup, tc.timing_warmup + tc.profile_steps)) if n_steps > tc.timing_warmup + tc.profile_steps + 2 else set()
        # the last warm-up step (left out of the timing statistics; not step 0, which also builds AdamW's
        # state) runs under the profiler: its kernels counted
        count_at = tc.timing_warmup - 1 if cuda and tc.timing_warmup >= 2 and n_steps > tc.timing_warmup else None
        counted = None
        breakdown = []
        evals, best, best_step, bad, stopped, first_nan = [], math.inf, None, 0, None, None
        zero_grad_fraction = None
        eval_s = 0.0
        t_start = time.perf_counter()

        def do_eval(step):
            nonlocal best, best_step, bad, eval_s
            t0 = time.perf_counter()
            val = evaluate(model, vx, vy, tc.batch_size)
            trn = evaluate(model, tx, ty, tc.batch_size)
            eval_s += time.perf_counter() - t0
            evals.append([step, trn, val])
            if on_eval:
                on_eval(step, trn, val)
            if math.isfinite(val) and val < best:
                best, best_step, bad = val, step, 0
            else:
                bad += 1

        do_eval(0)
        last_checked = done = 0
        for step in range(n_steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, tc)
            prof = step in profiled
            counter = KernelCount(device) if step == count_at else None
            if prof:
                if cuda:
                    torch.cuda.synchronize()
                h = [time.perf_counter()]
                ev = [clock.mark()]
            else:
                start = clock.mark()
            x, y = data.sample(tc.batch_size)
            if prof:
                ev.append(clock.mark()); h.append(time.perf_counter())
            with autocast(device):
                _, loss = step_model(x, y)
            if prof:
                ev.append(clock.mark()); h.append(time.perf_counter())
            loss.backward()
            if prof:
                ev.append(clock.mark()); h.append(time.perf_counter())
            gn = _grad_norm(params, tc.grad_clip)
            if step == 0:
                total = sum(p.grad.numel() for p in params if p.grad is not None)
                zeros = sum(int((p.grad == 0).sum()) for p in params if p.grad is not None)
                zero_grad_fraction = zeros / max(1, total)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[step] = loss.detach()
            norms[step] = gn.detach()
            if counter is not None:
                counted = counter.stop()
            if prof:
                ev.append(clock.mark()); h.append(time.perf_counter())
                if cuda:
                    torch.cuda.synchronize()
                names = ("data", "forward", "backward", "optimizer")
                breakdown.append({f"{n}_ms": clock.ms(ev[i], ev[i + 1]) for i, n in enumerate(names)} |
                                 {f"{n}_host_ms": (h[i + 1] - h[i]) * 1e3 for i, n in enumerate(names)})
            else:
                marks.append((step, start, clock.mark()))
            done = step + 1
            if done % tc.eval_every == 0 or done == n_steps:
                window = losses[last_checked:done]
                if not bool(torch.isfinite(window).all()):          # a sync: only at eval points
                    bad_idx = (~torch.isfinite(window)).nonzero()[0].item()
                    first_nan, stopped = last_checked + bad_idx, "non-finite loss"
                    break
                last_checked = done
                do_eval(done)
                if tc.patience and bad >= tc.patience:
                    stopped = f"early stop: {tc.patience} evaluations without a new best"
                    break
        if cuda:
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - t_start
    finally:
        torch.set_float32_matmul_precision(prev_precision)

    step_ms = [(s, clock.ms(a, b)) for s, a, b in marks]
    timed = [ms for s, ms in step_ms if s >= tc.timing_warmup] or [ms for _, ms in step_ms]
    loss_list = losses.float().cpu().tolist()
    norm_list = norms.float().cpu().tolist()
    steps_run = done
    out.update({
        "steps": steps_run, "stopped": stopped, "first_nonfinite_step": first_nan,
        "tokens_per_step": tc.batch_size * cfg.block_size,
        "evals": evals, "best_val_loss": best if best_step is not None else None, "best_val_step": best_step,
        "loss": loss_list[:steps_run], "grad_norm": norm_list[:steps_run],
        "step_ms": timed, "step_ms_all": [ms for _, ms in step_ms], "breakdown": breakdown,
        "wall_s": wall_s, "eval_s": eval_s, "zero_grad_fraction_step0": zero_grad_fraction,
        # counted with the real vocabulary; the padded rows (never a target) are only allocated
        "params": param_formula(replace(cfg, vocab_multiple=1)), "params_allocated": param_breakdown(model)["total"],
        "kernels_counted": counted.n if counted else None, "kernels_counted_error": counted.error if counted else None,
    })
    if keep_model:
        out["model"] = model
    return out


def _compile(model, cfg, tc, device):
    """torch.compile the training forward, and pay for the compilation up front on a dummy batch
    (zeros: it draws no random numbers, and no optimizer step follows, so the run is unchanged)."""
    t0 = time.perf_counter()
    try:
        compiled = torch.compile(model, dynamic=False)
        x = torch.zeros(tc.batch_size, cfg.block_size, dtype=torch.long, device=device)
        y = torch.zeros_like(x)                   # a distinct tensor: dynamo guards on `idx is targets`
        with autocast(device):
            _, loss = compiled(x, y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return compiled, time.perf_counter() - t0, None
    except Exception as exc:  # noqa: BLE001 - no compiler here: say so and train eagerly
        model.zero_grad(set_to_none=True)
        return model, None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


# ------------------------------------------------------------------------------ activations
@torch.no_grad()
def residual_stream_rms(model: GPT, x: torch.Tensor) -> list[float]:
    """RMS of the activations after the embedding and after each block, in one forward pass:
    where a broken model's signal dies (or explodes) layer by layer."""
    rms = []
    hooks = [b.register_forward_hook(lambda m, i, o: rms.append(float(o.float().pow(2).mean().sqrt())))
             for b in model.blocks]
    with autocast(x.device):
        pos = torch.arange(x.shape[1], device=x.device)
        emb = model.wte(x) + model.wpe(pos)
        model(x)
    for h in hooks:
        h.remove()
    return [float(emb.float().pow(2).mean().sqrt())] + rms


# ------------------------------------------------------------------------------ samples
def longest_verbatim(sample: str, text: str) -> str:
    """The longest substring of `sample` found verbatim in `text` (greedy: O(len(sample)) `in` tests)."""
    best = ""
    for i in range(len(sample)):
        while i + len(best) < len(sample) and sample[i:i + len(best) + 1] in text:
            best = sample[i:i + len(best) + 1]
    return best


def ngram_overlap(ids, train_ngrams: frozenset, n: int = 8) -> float | None:
    raw = D.to_u16(ids).tobytes()
    grams = [raw[2 * i: 2 * i + 2 * n] for i in range(len(raw) // 2 - n + 1)]
    return sum(g in train_ngrams for g in grams) / len(grams) if grams else None


def sample(model: GPT, data_dir, device, *, new_tokens: int = 100, temperature: float = 0.8,
           top_k: int = 200, seed: int = 1337) -> dict:
    """Generate from a newline; measure how much of it is copied from the training text."""
    gen = torch.Generator(device=device).manual_seed(seed)
    start = torch.tensor([[198]], device=device)           # GPT-2's "\n"
    model.eval()
    with autocast(device):
        ids = model.generate(start, new_tokens, temperature=temperature, top_k=top_k, generator=gen)
    model.train()
    new = ids[0, 1:].tolist()
    text = D.decode(new, data_dir)
    copied = longest_verbatim(text, D.train_text(str(data_dir)))
    return {"text": "\n" + text[:300], "new_tokens": len(new), "chars": len(text),
            "temperature": temperature, "top_k": top_k,
            "longest_verbatim_chars": len(copied), "longest_verbatim": ("\n" + copied) if copied else None,
            "longest_verbatim_fraction": len(copied) / max(1, len(text)),
            "train_8gram_fraction": ngram_overlap(new, D.train_ngrams(str(data_dir)), 8)}


# ------------------------------------------------------------------------------ records
def downsample(values: list, points: int = LOG_POINTS) -> list:
    """[[step, value], ...] with at most `points` entries, evenly spaced, last step kept."""
    n = len(values)
    idx = sorted(set(np.linspace(0, n - 1, min(points, n)).round().astype(int).tolist())) if n else []
    return [[i, finite(values[i])] for i in idx]


def clean(obj):
    """A copy of obj with every non-finite float replaced by None (records allow no NaN or inf)."""
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def finite(x):
    """Records hold no NaN or inf: a non-finite number is stored as null (and said so elsewhere)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def init_gate(loss0: float | None, vocab: int, tolerance: float = 0.3, precision: str = "bf16") -> dict:
    """Correctness before timing: an untrained model must be ~uniform over the vocabulary."""
    want = math.log(vocab)
    err = abs(loss0 - want) if loss0 is not None and math.isfinite(loss0) else None
    ok = err is not None and err <= tolerance
    return {"reference": f"ln(vocab) = ln({vocab}) = {want:.4f}: the loss of a uniform prediction",
            "metric": "abs_error", "precision": precision, "tolerance": tolerance, "rel_l2_error": None,
            "max_abs_error": err, "passed": ok,
            "reason": None if ok else f"initial loss {loss0} is not within {tolerance} of ln({vocab})"}


def train_cost(cfg: GPTConfig, tc: TrainConfig, dtype: str, compiled: bool | None = None) -> dict:
    """One training step of `train()` as the roofline sees it: cost.step_cost with this run's batch,
    compilation (default: what tc asks for) and clipping."""
    return step_cost(cfg, tc.batch_size, dtype, compiled=tc.compile if compiled is None else compiled,
                     clip=bool(tc.grad_clip and tc.grad_clip > 0))


def step_work(label: str, cfg: GPTConfig, tc: TrainConfig, dtype: str, compiled: bool | None = None) -> Work:
    """The row `lab predict` lists for a training run: train_cost, timed per step without an L2 flush."""
    c = train_cost(cfg, tc, dtype, compiled)
    return Work(label, c["flops"], c["bytes"], dtype, warm=True, launches=c["launches"])


def run_metrics(ctx, cfg: GPTConfig, tc: TrainConfig, res: dict, dtype: str, ceiling: dict) -> tuple:
    """(timing, metrics, prediction) of one training run."""
    tokens = res["tokens_per_step"]
    fpt = flops_per_token(cfg)
    compiled = analysis.compiled(tc.as_dict(), res["compile_error"])       # a failed compile ran eagerly
    cost = train_cost(cfg, tc, dtype, compiled)
    flops_step, bytes_step = cost["flops"], cost["bytes"]
    method = "cuda events per training step" if ctx.is_cuda else "cpu perf_counter per training step"
    samples = res["step_ms"] or [float("nan")]
    timing = summarize(samples, method, warmup_calls=tc.timing_warmup, flush_l2=False)
    roofs = ctx.roofs(dtype)
    m = throughput_metrics(timing.median_ms, flops_step, bytes_step, roofs, dtype, timing.min_ms)
    tps = tokens / (timing.median_ms / 1e3)
    model_tflops = fpt["total"] * tps / 1e12
    m.update({
        "tokens_per_s": tps, "tokens_per_s_mean": tokens / (timing.mean_ms / 1e3),
        # the whole loop on the host clock, evaluations left out (profiled steps and warm-up included)
        "tokens_per_s_wall": tokens * res["steps"] / (res["wall_s"] - res["eval_s"]) if res["wall_s"] > res["eval_s"] else None,
        "model_tflops": model_tflops,
        "mfu_pct_of_spec": 100 * model_tflops / roofs.peak(dtype) if roofs.peak(dtype) else None,
        "mfu_spec_peak_tflops": roofs.peak(dtype), "mfu_spec_source": (roofs.peak_sources or {}).get(dtype) or roofs.source,
        "mfu_pct_of_phase1": 100 * model_tflops / ceiling["tflops"] if ceiling["tflops"] else None,
        "phase1_ceiling_tflops": ceiling["tflops"], "phase1_ceiling_source": ceiling["source"],
        "flops_per_token": fpt["total"], "flops_per_token_parts": fpt,
        "flops_convention": "6 N_non_embedding + 12 n_layer n_embd block_size + 6 n_embd vocab (PaLM app. B, plus lm head)",
        "tokens_per_step": tokens, "steps": res["steps"], "tokens_trained": tokens * res["steps"],
        "wall_s": res["wall_s"], "eval_s": res["eval_s"], "compile_s": res["compile_s"],
        "compile_error": res["compile_error"], "compiled": compiled,
        "bytes_per_step_parts": cost["bytes_parts"], "kernels_per_step_parts": cost["launches_parts"],
        "kernels_counted": res.get("kernels_counted"), "kernels_counted_error": res.get("kernels_counted_error"),
        "params_total": res["params"]["total"], "params_non_embedding": res["params"]["non_embedding"],
        "params": res["params"], "params_allocated": res.get("params_allocated"),
    })
    m.update(curve_metrics(res))
    if res["breakdown"]:
        parts = ("data", "forward", "backward", "optimizer")
        mean = {f"{p}{s}": float(np.mean([b[f"{p}{s}"] for b in res["breakdown"]]))
                for p in parts for s in ("_ms", "_host_ms")}
        total = sum(mean[f"{p}_ms"] for p in parts)
        mean["total_ms"] = total
        mean.update({f"{p}_pct": 100 * mean[f"{p}_ms"] / total if total else None for p in parts})
        mean["profiled_steps"] = len(res["breakdown"])
        m["step_breakdown"] = mean
    prediction = ctx.predict(flops_step, bytes_step, dtype, timing, launches=cost["launches"])
    return timing, m, prediction


def curve_metrics(res: dict) -> dict:
    loss, gn = res["loss"], res["grad_norm"]
    fin = [g for g in gn if g is not None and math.isfinite(g)]
    last_eval = res["evals"][-1] if res["evals"] else [None, None, None]
    return {
        "curve": [[s, finite(t), finite(v)] for s, t, v in res["evals"]],
        "train_loss_per_step": downsample(loss), "grad_norm_per_step": downsample(gn),
        "grad_norm_min": min(fin) if fin else None, "grad_norm_max": max(fin) if fin else None,
        "grad_norm_max_step": gn.index(max(fin)) if fin else None,
        "grad_norm_final": finite(gn[-1]) if gn else None,
        "grad_norm_zero_steps": sum(1 for g in fin if g == 0.0),
        "zero_grad_fraction_step0": res["zero_grad_fraction_step0"],
        "initial_loss": finite(loss[0]) if loss else None,
        "final_train_loss": finite(last_eval[1]), "final_val_loss": finite(last_eval[2]),
        "final_step": last_eval[0],
        "best_val_loss": finite(res["best_val_loss"]), "best_val_step": res["best_val_step"],
        "stopped": res["stopped"], "first_nonfinite_step": res["first_nonfinite_step"],
    }


def training_row(ctx, variant: str, cfg: GPTConfig, tc: TrainConfig, res: dict, *, ceiling: dict,
                 nan_is_outcome: bool = False, extra: dict | None = None, gate_tolerance: float = 0.3) -> dict:
    """A record row for one run: the init-loss gate first, then timing, metrics and prediction.
    A non-finite loss fails the row, unless the run's purpose was to produce it (exercise 7.5)."""
    dtype = "bf16" if ctx.is_cuda else "fp32"
    params = {"model": cfg.as_dict(), "train": tc.as_dict(), "dtype": dtype,
              "params_total": res["params"]["total"], "params_non_embedding": res["params"]["non_embedding"]}
    gate = init_gate(res["loss"][0] if res["loss"] else None, cfg.vocab_size, gate_tolerance, dtype)
    if not gate["passed"]:
        return row(variant, params, "failed", gate["reason"], check=gate, metrics=curve_metrics(res))
    if res["first_nonfinite_step"] is not None and not nan_is_outcome:
        return row(variant, params, "failed", f"loss became non-finite at step {res['first_nonfinite_step']}",
                   check=gate, metrics=curve_metrics(res))
    timing, metrics, prediction = run_metrics(ctx, cfg, tc, res, dtype, ceiling)
    metrics.update(extra or {})
    return row(variant, params, "ok", None, check=gate, timing=timing, metrics=clean(metrics), prediction=prediction)


def model_config(shape: dict, block_size: int, vocab_multiple: int = 1, **switches) -> GPTConfig:
    return GPTConfig(block_size=block_size, n_layer=shape["n_layer"], n_head=shape["n_head"],
                     n_embd=shape["n_embd"], vocab_multiple=vocab_multiple, **switches)


def train_config(params: dict, **overrides) -> TrainConfig:
    keys = TrainConfig.__dataclass_fields__
    tc = TrainConfig(**{k: params[k] for k in keys if k in params})
    return replace(tc, **overrides)


def setup(ctx, params: dict):
    """Find and verify the data (the record stores data_dir as its declaration says: relative to
    the repository, or a folder name and content hash)."""
    data_dir = D.resolve_data_dir(params.get("data_dir"))
    return data_dir, D.load_splits(data_dir), ctx.phase1_ceiling() or {"tflops": None, "source": None}
