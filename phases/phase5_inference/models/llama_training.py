"""A trainable Llama in plain PyTorch, its training loop and its checkpoint writer: how the lab makes
Llama checkpoints of its own (a target and drafts for speculative decoding) that the engine loads as
it loads any Hugging Face folder.

The module's parameters carry Hugging Face's LlamaForCausalLM names (`model.embed_tokens.weight`,
`model.layers.{i}.self_attn.q_proj.weight`, ..., `model.norm.weight`, `lm_head.weight` only when the
head is not tied), so `state_dict()` is a checkpoint as it stands: the same keys and sizes as
`engine.weights.tensor_shapes(shape)`. The math is the engine's (engine/model.py), written for
[batch, time] training batches: RMSNorm in fp32 then cast back, RoPE with the rotate-half layout
from `engine.rope.inverse_frequencies`, causal grouped-query attention through SDPA, SiLU(gate) x up,
a final RMSNorm, the LM head (the embedding when tied), logits in fp32.

Training follows phase 7's loop (phases/phase7_gpt/train.py, whose schedule, optimizer and batches
are reused): AdamW (fused on CUDA) with weight decay on matrices only, a cosine learning rate after
a linear warmup, gradient clipping, bf16 autocast on CUDA (fp32 on a CPU), random windows of the
train split. Losses stay on the device and are read every CHECK_EVERY steps, so the loop does not
wait for the GPU each step; a non-finite loss stops the run with a LabError.

Distillation (a `teacher` given to train_llama): the loss becomes
    (1 - distill_weight) x cross-entropy(targets) + distill_weight x KL(teacher || student)
over the same windows, the teacher's distribution from its forward pass without gradients. A
speculative draft is accepted when it predicts what the target would, so a draft taught the
target's distribution (DistillSpec, Zhou et al. 2023; Llama 3.2 1B learnt from 8B and 70B
logits) is accepted more often than one taught the text alone.

Built on phase 7: its training loop (train.py) trains the lab's Llamas.
"""
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from common.errors import LabError
from phases.phase7_gpt.train import Batches, TrainConfig, autocast, evaluate, lr_at, make_optimizer

from ..engine.rope import inverse_frequencies
from ..engine import LlamaShape, hf_config

INIT_STD = 0.02              # Hugging Face's initializer_range for Llama, and GPT-2's
CHECK_EVERY = 10             # steps between reads of the loss buffer (a host-device sync)
LAST_LOSS_STEPS = 10         # last_loss: the mean over this many final steps (one step's loss is noisy)
CURVE_POINTS = 100           # loss_curve holds at most this many [step, loss] points
CONFIG, WEIGHTS, TRAIN_INFO = "config.json", "model.safetensors", "train.json"


# ------------------------------------------------------------------------------ the model
class RMSNorm(nn.Module):
    """weight x (x / rms(x)), the normalization in fp32 and cast back to x's dtype before the
    weight, as the engine (fused_ops.rms_norm_torch) and transformers do it."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half layout: the first and second halves of each head are the pair's two
    coordinates. x [B, heads, T, head_dim]; cos, sin fp32 [T, head_dim / 2]. Done in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.heads, self.kv_heads, self.head_dim = shape.num_attention_heads, shape.num_key_value_heads, d
        self.q_proj = nn.Linear(h, shape.q_size, bias=False)
        self.k_proj = nn.Linear(h, shape.kv_size, bias=False)
        self.v_proj = nn.Linear(h, shape.kv_size, bias=False)
        self.o_proj = nn.Linear(shape.q_size, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim ** -0.5,
                                             enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        h, i = shape.hidden_size, shape.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """`model.` in Hugging Face's names: the embedding, the layers and the final norm."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_hidden_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class LlamaForTraining(nn.Module):
    """The Llama of `shape`, trainable; state_dict() keys and sizes are tensor_shapes(shape)'s.

    Weights: normal(0, INIT_STD), the residual-branch outputs (o_proj, down_proj) scaled down by
    sqrt(2 x layers) as GPT-2 does (each layer adds two branches to the residual stream, whose
    variance would otherwise grow with depth), norm weights ones. `seed` draws them from a CPU
    generator, so a seed gives the same initial weights on any device; the module is built on the
    CPU (move it with .to(device)). Keep it in fp32 and train under autocast: the RoPE tables are
    fp32 buffers (not saved) that a .to(bfloat16) would round."""

    def __init__(self, shape: LlamaShape, seed: int | None = 0):
        super().__init__()
        self.shape = shape
        self.model = Backbone(shape)
        self.lm_head = None if shape.tie_word_embeddings else nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        cos, sin = self.rope_tables()
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights(seed)

    def rope_tables(self, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos and sin [max_position_embeddings, head_dim / 2], as engine/model.py's rope_tables."""
        positions = torch.arange(self.shape.max_position_embeddings, dtype=torch.int64, device=device).float()
        freqs = positions[:, None] * inverse_frequencies(self.shape).to(positions.device)[None, :]
        return freqs.cos(), freqs.sin()

    @torch.no_grad()
    def init_weights(self, seed: int | None = 0) -> None:
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        residual_std = INIT_STD / math.sqrt(2 * self.shape.num_hidden_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, residual_std, generator=generator)
            else:
                p.normal_(0.0, INIT_STD, generator=generator)

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx [B, T] int64 -> (logits fp32 [B, T, vocab], mean cross-entropy over targets [B, T] or None)."""
        t = idx.shape[1]
        if t > self.shape.max_position_embeddings:
            raise LabError(f"{self.shape.name}: {t} tokens exceed max_position_embeddings "
                           f"{self.shape.max_position_embeddings}")
        cos, sin = self.rope_cos[:t].float(), self.rope_sin[:t].float()
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        logits = F.linear(x, self.head_weight()).float()
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss


# ------------------------------------------------------------------------------ training
@dataclass(frozen=True)
class TrainSettings:
    """One training run: `steps` updates of `batch_size` random windows of `seq_len` tokens; the
    learning rate warms up linearly over `warmup_steps`, then decays on a cosine to lr x
    min_lr_ratio at the last step. eval_tokens: how much of the validation split val_loss covers
    (None: all of it)."""
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    weight_decay: float = 0.1
    grad_clip: float = 1.0            # 0: no clipping
    seed: int = 0
    eval_tokens: int | None = None
    distill_weight: float = 0.0       # with a teacher: the KL term's share of the loss (module docstring)

    def check(self, shape: LlamaShape) -> None:
        for field_name in ("steps", "batch_size", "seq_len"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LabError(f"{field_name} must be a positive integer, got {value!r}")
        if not self.lr > 0:
            raise LabError(f"lr must be positive, got {self.lr!r}")
        if not 0.0 <= self.distill_weight <= 1.0:
            raise LabError(f"distill_weight must be in [0, 1], got {self.distill_weight!r}")
        if self.seq_len > shape.max_position_embeddings:
            raise LabError(f"seq_len {self.seq_len} exceeds {shape.name}'s max_position_embeddings "
                           f"{shape.max_position_embeddings}")

    def phase7_config(self) -> TrainConfig:
        """The same run in phase 7's terms, for its schedule (lr_at) and optimizer (make_optimizer)."""
        return TrainConfig(batch_size=self.batch_size, max_iters=self.steps, lr=self.lr,
                           min_lr_ratio=self.min_lr_ratio, warmup_iters=self.warmup_steps,
                           weight_decay=self.weight_decay, grad_clip=self.grad_clip, seed=self.seed,
                           eval_tokens=self.eval_tokens)


def downsample(losses: list[float], points: int = CURVE_POINTS) -> list[list]:
    """[step, loss] at up to `points` evenly spaced steps, the first and last included."""
    if not losses:
        return []
    steps = sorted(set(np.linspace(0, len(losses) - 1, min(points, len(losses))).round().astype(int).tolist()))
    return [[s, losses[s]] for s in steps]


def _check_finite(losses: torch.Tensor, start: int, end: int, shape: LlamaShape, settings: TrainSettings) -> None:
    window = losses[start:end]
    bad = (~torch.isfinite(window)).nonzero()
    if len(bad):
        step = start + int(bad[0, 0])
        raise LabError(f"{shape.name}: the training loss went non-finite at step {step} of {settings.steps} "
                       f"(lr {settings.lr:g}): lower the learning rate")


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student), both [..., vocab] fp32 logits."""
    vocab = student_logits.shape[-1]
    return F.kl_div(F.log_softmax(student_logits.view(-1, vocab), dim=-1),
                    F.log_softmax(teacher_logits.view(-1, vocab), dim=-1), log_target=True, reduction="batchmean")


def train_llama(shape: LlamaShape, train_ids: np.ndarray, val_ids: np.ndarray, settings: TrainSettings,
                device: str | torch.device, progress=None, teacher: LlamaForTraining | None = None
                ) -> tuple[LlamaForTraining, dict]:
    """Train a LlamaForTraining of `shape` from scratch on token ids (uint16 arrays); return it
    (on `device`, fp32, in eval mode) and what the run measured:
      first_loss, last_loss (mean of the last LAST_LOSS_STEPS steps), val_loss (evaluate() over
      the validation windows), train_tokens, steps, train_s (the loop's wall time, evaluation
      excluded), tokens_per_s, params, loss_curve ([step, loss], at most CURVE_POINTS points).
    progress(step, steps, loss) is called every CHECK_EVERY steps and after the last one. A
    non-finite loss raises LabError. With a `teacher` (same vocabulary, on `device`) the loss is
    the distillation mix of the module docstring, and the info adds val_kl_to_teacher and
    val_top1_agreement (the student's argmax equal to the teacher's, on the validation windows)."""
    device = torch.device(device)
    settings.check(shape)
    t = settings.seq_len
    for label, ids in (("train", train_ids), ("validation", val_ids)):
        if len(ids) < t + 2:
            raise LabError(f"the {label} split has {len(ids)} tokens, too few for windows of {t}")
    if teacher is not None and teacher.shape.vocab_size != shape.vocab_size:
        raise LabError(f"{shape.name}: its teacher {teacher.shape.name} has another vocabulary")
    if int(max(train_ids.max(), val_ids.max())) >= shape.vocab_size:
        raise LabError(f"token ids reach {int(max(train_ids.max(), val_ids.max()))}, beyond "
                       f"{shape.name}'s vocabulary of {shape.vocab_size}")
    tc = settings.phase7_config()
    model = LlamaForTraining(shape, seed=settings.seed).to(device)
    model.train()
    data = Batches(train_ids, val_ids, t, device, settings.seed)
    opt = make_optimizer(model, tc, device)
    params = list(model.parameters())
    losses = torch.full((settings.steps,), float("nan"), device=device)
    checked = 0
    start = time.perf_counter()
    for step in range(settings.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, tc)
        x, y = data.sample(settings.batch_size)
        with autocast(device):
            logits, loss = model(x, y)
            if teacher is not None and settings.distill_weight > 0:
                with torch.no_grad():
                    teacher_logits, _ = teacher(x)
                w = settings.distill_weight
                loss = (1 - w) * loss + w * distill_loss(logits, teacher_logits)
                del teacher_logits
        del logits
        loss.backward()
        if settings.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, settings.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = loss.detach()
        done = step + 1
        if done % CHECK_EVERY == 0 or done == settings.steps:
            _check_finite(losses, checked, done, shape, settings)
            checked = done
            if progress is not None:
                progress(done, settings.steps, float(losses[step]))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    train_s = time.perf_counter() - start
    vx, vy = data.windows("val", settings.eval_tokens)
    val_loss = evaluate(model, vx, vy, settings.batch_size)
    agreement = compare_to_teacher(model, teacher, vx, settings.batch_size) if teacher is not None else {}
    model.eval()
    loss_list = losses.cpu().tolist()
    train_tokens = settings.steps * settings.batch_size * t
    info = {"first_loss": loss_list[0], "last_loss": float(np.mean(loss_list[-LAST_LOSS_STEPS:])),
            "val_loss": val_loss, "val_tokens": int(vy.numel()), "train_tokens": train_tokens,
            "steps": settings.steps, "train_s": train_s, "tokens_per_s": train_tokens / train_s if train_s > 0 else None,
            "params": sum(p.numel() for p in params), "device": device.type,
            "loss_curve": downsample(loss_list), **agreement}
    return model, info


@torch.no_grad()
def compare_to_teacher(model: LlamaForTraining, teacher: LlamaForTraining, x: torch.Tensor, batch_size: int) -> dict:
    """{val_kl_to_teacher, val_top1_agreement} over the windows x: how close the student's
    distribution is to the teacher's, and how often their argmax agree (a greedy draft's acceptance
    at one proposed token, before the engine measures it)."""
    model.eval()
    kl, agree, n = 0.0, 0, 0
    for i in range(0, len(x), batch_size):
        with autocast(x.device):
            student, _ = model(x[i:i + batch_size])
            master, _ = teacher(x[i:i + batch_size])
        tokens = student.shape[0] * student.shape[1]
        kl += float(distill_loss(student, master)) * tokens
        agree += int((student.argmax(-1) == master.argmax(-1)).sum())
        n += tokens
    model.train()
    return {"val_kl_to_teacher": kl / n, "val_top1_agreement": agree / n}


# ------------------------------------------------------------------------------ checkpoint
def _replace_atomically(path: Path, write) -> None:
    """write(tmp) then rename over `path`: a reader sees the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_checkpoint(model: LlamaForTraining, shape: LlamaShape, folder: Path, dtype: torch.dtype = torch.bfloat16,
                    extra: dict | None = None) -> Path:
    """A Hugging Face checkpoint folder: config.json (hf_config(shape) and torch_dtype),
    model.safetensors (every state_dict tensor in `dtype`, contiguous; tied: the embedding alone)
    and train.json (`extra`). train.json goes first out and last in: a folder whose train.json
    exists was written whole, so an interrupted save is never mistaken for a finished one."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / TRAIN_INFO).unlink(missing_ok=True)
    config = {**hf_config(shape), "torch_dtype": str(dtype).removeprefix("torch.")}
    tensors = {name: t.detach().to(device="cpu", dtype=dtype).contiguous() for name, t in model.state_dict().items()}
    _replace_atomically(folder / CONFIG, lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))
    _replace_atomically(folder / WEIGHTS, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    _replace_atomically(folder / TRAIN_INFO, lambda p: p.write_text(json.dumps(extra or {}, indent=2) + "\n"))
    return folder
