"""A phase 7 training step as a workload (common/workload.py): forward, backward and optimizer
kernels of the GPT (model.py's blocks) under bf16 autocast, logits included. Torch-free.

Per block, forward: LayerNorm, the four weight casts to bf16, QKV, causal flash attention (two
products and the exponentials, added as phase 3's kernel_lists.py says why), the output projection,
the residual add, LayerNorm, the MLP's two matmuls with GELU between, the residual add, two input
casts. Backward: each matmul twice (dX and dW, together twice its forward FLOPs), attention's
backward (2.5x the forward's products, the exponentials recomputed once), LayerNorm, GELU and cast
backwards, the gradient casts to fp32, the residual accumulations.

The head is where one roof goes most wrong: the logits are batch x context x vocabulary. The
forward writes them in bf16 from the LM-head matmul, up-casts them to fp32 (autocast runs
log-softmax in fp32), takes log-softmax (one exponential each) and NLL; the backward writes the
NLL gradient, the log-softmax backward (an exponential each again), casts to bf16 and runs two
matmuls. Each of those passes reads or writes the whole N x V matrix through memory, and PyTorch's
log-softmax kernels read their input more than once (SOFTMAX_PASSES: what its code does, not
the fewest bytes). Compiled,
Inductor fuses the cross-entropy into two reductions over the bf16 logits forward and one kernel
backward (cost.step_kernels' count), so the logits cross memory fewer times.

Optimizer (training steps only): the gradient norm reads every fp32 gradient, clipping rescales
them, fused AdamW reads weight, gradient and two moments and writes three (cost.step_bytes).

Every other kernel cost.step_kernels counts (embedding gathers and scatters, foreach launches,
bookkeeping) is a launch floor with no work. Eager, the model's ops are dispatched one by one by
the host under autograd (common/workload.py's AUTOGRAD: a kernel shorter than the host's time per
op waits for it); the optimizer's are plain PyTorch ops. Under torch.compile the fused element-wise
kernels are Triton launches (the byte counts stay the eager ones except the cross-entropy's: an
upper bound for what Inductor fuses). A training step reads its loss once (one synchronize).
"""
import math

from common.workload import AUTOGRAD, ELEMENTWISE, MATMUL, TORCH, TRITON, Kernel, Workload

from .cost import GPTConfig, activation_bytes, param_formula, step_kernels

TILE = 128                       # flash attention's query tile (phase 3's kernel_lists.py)
# Passes over an fp32 row of the logits that PyTorch's eager log-softmax makes when a row is wider
# than its one-warp (<= 1024 elements) and shared-memory paths (aten/src/ATen/native/cuda/SoftMax.cu,
# cunn_SoftMaxForward / cunn_SoftMaxBackward; a 50,304-wide fp32 row is 201 KB): forward, the row
# read for its max, again for its sum of exponentials, again to write the output, and the output
# written; backward, the incoming gradient read for its sum, then it and the output read and the
# gradient written. Counted at the HBM rate: the rows in flight at once (a block each) hold more
# than the L2, so a row's second read does not find its first in cache.
SOFTMAX_PASSES, SOFTMAX_BACKWARD_PASSES = 4, 4


def training_step(cfg: GPTConfig, batch: int, dtype: str = "bf16", *, compiled: bool = False, optimizer: bool = True,
                  clip: bool = True, attention: str = "flash", data: bool = True) -> Workload:
    T, d, L, H, V = cfg.block_size, cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.padded_vocab
    N, a = batch * T, activation_bytes(dtype)
    mm = "bf16" if a == 2 else "fp32"
    ew = TRITON if compiled else AUTOGRAD        # eager: each op dispatched by the host under autograd
    mm_launch = TORCH if compiled else AUTOGRAD
    nb = math.ceil(T / TILE)
    scores = batch * H * T * T * (nb + 1) / (2 * nb)
    hd = d // H

    def matmul(name, m, k, n, count=L, backward=False):
        """(m x k) @ (k x n); backward: dX and dW, twice the FLOPs, read the output's gradient too."""
        f = 2 * m * k * n * (2 if backward else 1)
        b = (m * k + k * n + m * n) * a * (2 if backward else 1)
        return Kernel(name, MATMUL, f, b, mm, launch=mm_launch, count=count)

    def elementwise(name, nbytes, flops=0.0, count=L, exps=0.0):
        return Kernel(name, ELEMENTWISE, flops, nbytes, None, exps=exps, launch=ew, count=count)

    w_block = 12 * d * d
    forward = [
        elementwise("LayerNorm (forward)", N * d * (4 + a), 8 * N * d, count=2 * L),
        elementwise("weight casts to bf16", w_block * 6 / 4, count=4 * L),
        elementwise("input casts to bf16", N * d * (4 + a), count=2 * L),
        matmul("QKV", N, d, 3 * d), matmul("attention output projection", N, d, d),
        matmul("MLP up", N, d, 4 * d), matmul("MLP down", N, 4 * d, d),
        Kernel("causal flash attention (forward)", MATMUL, 4 * scores * hd, 4 * N * d * a, mm, exps=scores,
               launch=mm_launch, count=L),
        elementwise("GELU", 2 * N * 4 * d * a, 8 * N * 4 * d),
        elementwise("residual add", 3 * N * d * 4, N * d, count=2 * L),
    ]
    if compiled:                 # Inductor: cross-entropy as two fused reductions over the bf16 logits
        head = [elementwise("final LayerNorm", N * d * (4 + a), 8 * N * d, count=1),
                elementwise("LM head weight cast", V * d * 6, count=1),
                matmul("LM head: logits N x V", N, d, V, count=1),
                elementwise("cross-entropy (2 fused reductions over the logits)", 2 * N * V * a, 4 * N * V, count=2,
                            exps=N * V / 2)]
        logits_backward = [elementwise("cross-entropy backward (fused)", 2 * N * V * a, 4 * N * V, count=1,
                                       exps=N * V)]
    else:
        head = [elementwise("final LayerNorm", N * d * (4 + a), 8 * N * d, count=1),
                elementwise("LM head weight cast", V * d * 6, count=1),
                matmul("LM head: logits N x V", N, d, V, count=1),
                elementwise("logits to fp32", N * V * (a + 4), count=1),
                elementwise("log-softmax over the vocabulary", SOFTMAX_PASSES * N * V * 4, 4 * N * V, count=1,
                            exps=N * V)]
        logits_backward = [elementwise("NLL backward (gradient of the logits)", N * V * 4, count=1),
                           elementwise("log-softmax backward", SOFTMAX_BACKWARD_PASSES * N * V * 4, 4 * N * V, count=1,
                                       exps=N * V),
                           elementwise("logits' gradient to bf16", N * V * (4 + a), count=1)]
    backward = [
        matmul("QKV (backward)", N, d, 3 * d, backward=True),
        matmul("attention output projection (backward)", N, d, d, backward=True),
        matmul("MLP up (backward)", N, d, 4 * d, backward=True),
        matmul("MLP down (backward)", N, 4 * d, d, backward=True),
        Kernel("causal flash attention (backward)", MATMUL, 10 * scores * hd, 8 * N * d * a, mm, exps=scores,
               launch=mm_launch, count=L),
        elementwise("LayerNorm (backward)", N * d * (4 + 2 * a + 4), 10 * N * d, count=2 * L),
        elementwise("GELU (backward)", 3 * N * 4 * d * a, 10 * N * 4 * d),
        elementwise("gradient casts to fp32", w_block * 6 / 4, count=4 * L),
        elementwise("input-cast backwards", N * d * (a + 4), count=2 * L),
        elementwise("residual gradient accumulation", 3 * N * d * 4, N * d, count=2 * L),
        elementwise("cat of dq, dk, dv", 2 * N * 3 * d * a),
        *logits_backward,
        matmul("LM head (backward)", N, d, V, count=1, backward=True),
        elementwise("LM head gradient cast", V * d * 6, count=1),
        # the token embedding's backward (gpt.py: self.wte(idx)): a zeroed fp32 V x d gradient, the
        # tokens' rows scattered into it; tied (gpt.py's lm_head.weight = wte.weight), the head's
        # gradient added to it (cost.step_kernels counts these launches: here their bytes)
        elementwise("token embedding gradient: zero V x d", V * d * 4, count=1),
        elementwise("token embedding gradient: scatter the tokens' rows", 3 * N * d * 4, N * d, count=1),
        *([elementwise("tied weight: the head's gradient added to the embedding's", 3 * V * d * 4, V * d, count=1)]
          if cfg.tie_weights else []),
    ]
    kernels = forward + head + backward
    if optimizer:                            # outside autograd: plain PyTorch ops
        p = param_formula(cfg)["total"]
        kernels += [Kernel("gradient norm (foreach)", ELEMENTWISE, 2 * p, 4 * p, None)]
        if clip:
            kernels += [Kernel("clip: gradients rescaled (foreach)", ELEMENTWISE, p, 8 * p, None)]
        kernels += [Kernel("fused AdamW", ELEMENTWISE, 12 * p, 28 * p, None)]
    counted = step_kernels(cfg, N, compiled=compiled, optimizer=optimizer, clip=clip, attention=attention, data=data)
    rest = counted["total"] - sum(k.count for k in kernels)
    if rest > 0:
        kernels.append(Kernel("other kernels (embedding, foreach launches, bookkeeping)", ELEMENTWISE, 0, 0, None,
                              launch=TRITON if compiled else TORCH, count=rest))
    return Workload(f"GPT {L}x{d} training step, {batch} x {T} tokens" if optimizer else
                    f"GPT {L}x{d} forward + backward, {batch} x {T} tokens", tuple(kernels),
                    host=(("loss read back (synchronize)", "sync_us", 1),) if optimizer else ())


EXERCISES = ("phase7.model", "phase7.overfit", "phase7.scaling", "phase7.failures")


def row_workload(r: dict) -> Workload | None:
    """A frame row's step (as phase7_gpt/report.row_cost reads the row): None for untimed rows."""
    model, dtype = r.get("params.model"), r.get("params.dtype")
    if not isinstance(model, dict) or not isinstance(dtype, str):
        return None
    try:
        cfg = GPTConfig(**model)
    except TypeError:                        # a model dict of another shape: not a GPT this module lists
        return None
    if r["exercise"] == "phase7.model":
        if r["variant"] != "sdpa_flash" or not isinstance(r.get("params.batch"), list):
            return None                      # the math path's T x T passes are not listed here
        return training_step(cfg, r["params.batch"][0], dtype, optimizer=False, data=False)
    tc = r.get("params.train")
    if not isinstance(tc, dict) or "batch_size" not in tc:
        return None
    compile_error = r.get("metrics.compile_error")
    compiled = bool(tc.get("compile")) and not (isinstance(compile_error, str) and compile_error)
    return training_step(cfg, tc["batch_size"], dtype, compiled=compiled, clip=bool(tc.get("grad_clip")))


def training_workloads(runs) -> list[tuple[str, Workload]]:
    """`lab predict`'s rows of a training exercise: (label, model config, train.TrainConfig) each."""
    return [(label, training_step(cfg, tc.batch_size, "bf16", compiled=bool(tc.compile), clip=bool(tc.grad_clip)))
            for label, cfg, tc in runs]
