"""What one step of the GPT asks of the machine, counted from its shape before anything runs.

    param_formula(cfg)      the parameters, in closed form
    flops_per_token(cfg)    training FLOPs per token (PaLM's convention, below)
    step_bytes(cfg, ...)    the fewest bytes one step must move through device memory, by part
    step_kernels(cfg, ...)  the kernels one step launches on a CUDA GPU, by part (an estimate)
    step_cost(cfg, ...)     the three together: what a timed row records and `work()` lists

Torch-free on purpose: the exercises call these when they run and list their rows (`lab predict`),
and the report calls them again for records written before a count was corrected (report.py).
"""
from dataclasses import asdict, dataclass

CHUNK, MAX_BLOCKS = 65536, 320                      # ATen's multi_tensor_apply: elements per chunk, chunks per launch
MAX_TENSORS = {1: 110, 4: 36}                       # ... tensors per launch, by lists per call (1: norm, mul; 4: AdamW)
SORTED_EMBEDDING_BACKWARD = 3072                    # above this many ids ATen sorts them for the embedding's backward
MATH_ATTENTION = {"forward": 19, "backward": 14}    # kernels of the math SDPA path in bf16 on CUDA (step_kernels)


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    block_size: int = 256
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    tie_weights: bool = True
    residual: bool = True
    layernorm: bool = True
    vocab_multiple: int = 1      # pad the embedding/logit rows to a multiple of this (64: faster matmuls)

    @property
    def padded_vocab(self) -> int:
        m = max(1, self.vocab_multiple)
        return -(-self.vocab_size // m) * m

    def as_dict(self) -> dict:
        return asdict(self)


def param_formula(cfg: GPTConfig) -> dict:
    """The parameter counts in closed form (gpt.param_breakdown counts the module; they must agree)."""
    d, V = cfg.n_embd, cfg.padded_vocab
    ln = 2 * d if cfg.layernorm else 0                  # one LayerNorm: weight + bias
    per_block = 12 * d * d + 2 * ln                     # 4d^2 attention + 8d^2 MLP + two LayerNorms
    out = {"wte": V * d, "wpe": cfg.block_size * d, "blocks": cfg.n_layer * per_block, "ln_f": ln,
           "lm_head": 0 if cfg.tie_weights else V * d}
    out["total"] = sum(out.values())
    out["non_embedding"] = out["blocks"] + out["ln_f"]
    out["layernorm"] = (2 * cfg.n_layer + 1) * ln
    return out


def param_numels(cfg: GPTConfig) -> list[tuple[int, int]]:
    """(elements, dimensions) of every parameter tensor, in `model.parameters()` order."""
    d = cfg.n_embd
    ln = [(d, 1), (d, 1)] if cfg.layernorm else []
    block = ln + [(3 * d * d, 2), (d * d, 2)] + ln + [(4 * d * d, 2), (4 * d * d, 2)]
    head = [] if cfg.tie_weights else [(cfg.padded_vocab * d, 2)]
    return [(cfg.padded_vocab * d, 2), (cfg.block_size * d, 2)] + block * cfg.n_layer + ln + head


def flops_per_token(cfg: GPTConfig) -> dict:
    """Training FLOPs per token, forward + backward (the PaLM paper's appendix B convention):

        6 N        every non-embedding weight: a multiply-add (2 FLOPs) forward, two backward
      + 12 L d T   attention scores and weighted values: 2 matmuls x 2T d FLOPs per token per layer
                   forward, x3 with backward; counted for the full T x T window, as PaLM does,
                   though causal flash attention skips the masked half
      + 6 d V      the lm head, d x V (the real vocabulary, not the padded rows)

    The embedding lookups are gathers, not matmuls: no FLOPs."""
    d, L, T, V = cfg.n_embd, cfg.n_layer, cfg.block_size, cfg.vocab_size
    n = param_formula(cfg)["non_embedding"]
    out = {"non_embedding": 6 * n, "attention": 12 * L * d * T, "lm_head": 6 * d * V}
    out["total"] = sum(out.values())
    return out


def activation_bytes(dtype: str) -> int:
    """Bytes of one activation element: bf16 under CUDA autocast, fp32 on a CPU."""
    return 2 if dtype in ("bf16", "fp16") else 4


def step_bytes(cfg: GPTConfig, tokens: int, dtype: str = "bf16", *, optimizer: bool = True) -> dict:
    """The fewest bytes one step must move through device memory, by part (P: parameters allocated,
    the padded vocabulary rows included; fp32 master weights, gradients and AdamW state):

      weights      8 P   read in the forward and again in the backward (the step's state is far
                         larger than any L2, so nothing survives from one pass to the next)
      gradients    4 P   written once
      grad_norm    4 P   read once for the global norm, which the loop measures every step (and
                         clipping needs before any update); training steps only
      optimizer   28 P   AdamW reads weight, gradient and both moments, writes weight and moments;
                         training steps only (the forward + backward rows have no optimizer)
      activations        what the backward needs that only a matmul could recompute, written
                         once in the forward and read once in the backward: per token, each
                         block's input and its mid-block residual stream (fp32 under autocast,
                         as the embedding sum and the residual adds are), q, k, v, the attention
                         output and the MLP's 4d pre-activation (bf16: 8 d values) and attention's
                         log-sum-exp (fp32, one per head); plus the final LayerNorm's input.
                         LayerNorm and GELU outputs are elementwise recomputations, the T x T
                         scores never need to exist (flash attention), and neither do the logits
                         (a fused head + cross-entropy keeps them on chip), so none are counted;
                         neither are the activation gradients, which a fused backward streams
      batch       16 per token: the int64 inputs and targets, read once

    Every variant of one problem (flash or math attention, compiled or eager) moves at least
    this; what a variant moves beyond it is its measured time over this prediction."""
    n = param_formula(cfg)["total"]
    a = activation_bytes(dtype)
    stream = 4 if cfg.residual else a        # without residual adds the stream is the linears' output
    d, L, H = cfg.n_embd, cfg.n_layer, cfg.n_head
    saved = 4 * d + 2 * L * stream * d + L * (8 * d * a + 4 * H)       # per token: the embedding sum is fp32
    out = {"weights": 8 * n, "gradients": 4 * n, "grad_norm": 4 * n if optimizer else 0,
           "optimizer": 28 * n if optimizer else 0, "activations": 2 * saved * tokens, "batch": 16 * tokens}
    out["total"] = sum(out.values())
    return out


def bytes_per_step(cfg: GPTConfig, tokens: int, dtype: str = "bf16", *, optimizer: bool = True) -> int:
    """step_bytes' total."""
    return step_bytes(cfg, tokens, dtype, optimizer=optimizer)["total"]


def multi_tensor_launches(numels: list[int], max_tensors: int) -> int:
    """Kernels one ATen foreach / fused-optimizer call launches over tensors of these sizes: a launch
    each time a launch's list of tensors (max_tensors) or of 65,536-element chunks (320) fills up,
    and one for the rest (ATen's multi_tensor_apply)."""
    launches = tensors = blocks = 0
    sizes = [n for n in numels if n]
    for i, n in enumerate(sizes):
        tensors += 1
        chunks = -(-n // CHUNK)
        for c in range(chunks):
            blocks += 1
            last_chunk = c == chunks - 1
            if (tensors == max_tensors and last_chunk) or blocks == MAX_BLOCKS or (last_chunk and i == len(sizes) - 1):
                launches += 1
                blocks = 0
                tensors = 0 if last_chunk else 1          # a tensor cut mid-way starts the next launch
    return launches


def step_kernels(cfg: GPTConfig, tokens: int, *, compiled: bool = False, optimizer: bool = True, clip: bool = True,
                 attention: str = "flash", data: bool = True) -> dict:
    """The kernels one step launches on a CUDA GPU under bf16 autocast, by part: an estimate from the
    model's structure, each op counted as the kernels ATen (eager) or Inductor (compiled) launches
    for it. The forward and backward's aten ops per block are what a CPU dispatches (10 and 15:
    tests/test_phase7_model.py counts them); CUDA adds autocast's casts and ops of several kernels.

    Eager, per block (LayerNorm and residual on): forward 16 = 2 LayerNorms + 4 matmuls + their 4
    weight casts to bf16 and 2 input casts + attention + GELU + 2 residual adds; backward 27 = 8
    matmuls + 4 gradient casts to fp32 + 2 input-cast backwards + 2 output-gradient casts to bf16
    + 2 LayerNorm backwards of 2 kernels (input; weight and bias) + GELU + attention + the cat of
    dq, dk, dv + 2 residual accumulations. Flash attention: 1 kernel forward, 3 backward (dot(dO,
    O), the main loop, dq's conversion); the math path: MATH_ATTENTION (its 14 aten ops forward and
    10 backward, plus the fp32 up-cast of bf16 inputs and outputs, and the transpose's copy).
    Embedding 4 forward (arange, 2 gathers, add); backward: the position gradient's sum over the
    batch, 2 per embedding backward (zero, scatter), 15 when more than 3,072 ids must be sorted
    first, and 1 add where the head's gradient joins the tied embedding's. Head: LayerNorm, 2 casts,
    the matmul, the fp32 logits, log-softmax and NLL forward (7); backward the seed, NLL (2),
    log-softmax, 2 casts, 2 matmuls, the gradient cast, LayerNorm (2).

    Compiled (Inductor, no CUDA graphs), per block: forward 12 = 4 matmuls + attention + 4 weight
    casts + 3 fused kernels (residual add + LayerNorm + cast, twice; GELU + cast); backward 23 =
    8 matmuls + 4 gradient casts + attention (3) + cat + GELU + 2 fused LayerNorm backwards with
    the residual accumulation + 2 x 2 split reductions for LayerNorm's weight and bias. Head 5
    forward (LayerNorm, cast, matmul, 2 cross-entropy reductions) and 13 backward with the
    embeddings (seed, cross-entropy, 2 matmuls, the tied gradient's cast-and-add, LayerNorm 3,
    zero + scatter for each embedding, the batch sum).

    Outside the model, both ways: the batch (randint, 2 index adds, 2 gathers); the gradient norm
    (zero, the foreach norm's launches, its cleanup, stack, vector norm) and, with clipping, the
    coefficient (add, reciprocal, multiply, clamp) and the foreach multiply's launches; fused
    AdamW per parameter group (step increment, then its launches); the loss and the norm stored (2).
    Foreach launches follow multi_tensor_apply's limits (multi_tensor_launches)."""
    L = cfg.n_layer
    ln, res = (1 if cfg.layernorm else 0), (1 if cfg.residual else 0)
    if compiled:
        fwd_block = 4 + 1 + 4 + 3
        bwd_block = 8 + 4 + 3 + 1 + 1 + 2 + 4 * ln
        forward, backward = 5 + L * fwd_block, 13 - 2 * (1 - ln) + L * bwd_block
    else:
        attn_f, attn_b = ((1, 3) if attention == "flash" else
                          (MATH_ATTENTION["forward"] + 1, MATH_ATTENTION["backward"]))
        fwd_block = 2 * ln + 3 + attn_f + 2 + 2 * res + 3 + 1 + 2
        bwd_block = 2 + 3 + 1 + 4 + 2 * 2 * ln + 3 + attn_b + 1 + 4 + 2 * res
        emb_b = 1 + 2 + (15 if tokens > SORTED_EMBEDDING_BACKWARD else 2) + (1 if cfg.tie_weights else 0)
        forward = 4 + L * fwd_block + (ln + 3 + 1 + 2)
        backward = 1 + (2 + 1 + 1 + 3 + 1 + 2 * ln) + L * bwd_block + emb_b
    out = {"forward": forward, "backward": backward, "grad_norm": 0, "optimizer": 0, "data": 0, "bookkeeping": 0}
    if optimizer:
        grads = [n for n, _ in param_numels(cfg)]
        norm = 1 + multi_tensor_launches(grads, MAX_TENSORS[1]) + 1 + 2
        out["grad_norm"] = norm + (4 + multi_tensor_launches(grads, MAX_TENSORS[1]) if clip else 0)
        groups = [[n for n, dim in param_numels(cfg) if (dim >= 2) == decay] for decay in (True, False)]
        out["optimizer"] = sum(-(-len(g) // MAX_TENSORS[1]) + multi_tensor_launches(g, MAX_TENSORS[4])
                               for g in groups if g)
        out["bookkeeping"] = 2
    if data:
        out["data"] = 5
    out["total"] = sum(out.values())
    return out


def step_cost(cfg: GPTConfig, batch: int, dtype: str, *, compiled: bool = False, optimizer: bool = True,
              clip: bool = True, attention: str = "flash", data: bool = True) -> dict:
    """One step of `batch` windows of cfg.block_size tokens: {"flops", "bytes", "launches"} and the parts."""
    tokens = batch * cfg.block_size
    fpt = flops_per_token(cfg)
    nbytes = step_bytes(cfg, tokens, dtype, optimizer=optimizer)
    kernels = step_kernels(cfg, tokens, compiled=compiled, optimizer=optimizer, clip=clip, attention=attention,
                           data=data)
    return {"flops": fpt["total"] * tokens, "bytes": nbytes["total"], "launches": kernels["total"],
            "tokens": tokens, "flops_parts": fpt, "bytes_parts": nbytes, "launches_parts": kernels}
