"""A GPT in the style of nanoGPT, written for this lab: small enough to read in one sitting.

    tokens -> token embedding + position embedding
           -> n_layer x [ x + attn(LN(x)) ; x + mlp(LN(x)) ]     (pre-LayerNorm blocks)
           -> final LN -> lm head (tied to the token embedding by default) -> logits

Linear layers carry no bias; LayerNorms carry weight and bias: with that choice the seed's
published parameter counts come out exactly (tests/test_phase7_model.py checks them), and its
total only adds up with a *tied* head, so tying is the default (`tie_weights=False` unties it).

Two switches break the model on purpose (exercise 7.5), each really removing its part:
`residual=False` drops the `x +` of both sublayers; `layernorm=False` replaces every LayerNorm
by the identity. Per block (d = n_embd): attention 4 d^2, MLP 8 d^2, two LayerNorms 4 d
(`param_formula`); FLOPs, bytes and kernels per training step: cost.py.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# the config and every count live in cost.py (torch-free, so the report can use them); re-exported here
from .cost import GPTConfig, bytes_per_step, flops_per_token, param_formula, step_bytes, step_cost  # noqa: F401


def _norm(cfg: GPTConfig) -> nn.Module:
    return nn.LayerNorm(cfg.n_embd) if cfg.layernorm else nn.Identity()


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must divide into n_head heads"
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # One fused kernel: on a CUDA GPU in bf16 this dispatches to FlashAttention, which never
        # writes the T x T score matrix to memory (phase 3's subject).
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.residual = cfg.residual
        self.ln_1, self.attn = _norm(cfg), CausalSelfAttention(cfg)
        self.ln_2, self.mlp = _norm(cfg), MLP(cfg)

    def forward(self, x):
        if self.residual:
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))
        # No skip path: every layer's output is only what the sublayer makes of its input.
        return self.mlp(self.ln_2(self.attn(self.ln_1(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.padded_vocab, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = _norm(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight        # one matrix reads tokens in and writes them out
        self.apply(self._init)
        for name, p in self.named_parameters():          # GPT-2: scale the residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        assert T <= self.cfg.block_size, f"sequence of {T} tokens > block_size {self.cfg.block_size}"
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None):
        """Sample one token at a time: one full forward pass per new token (no KV cache here;
        phase 5 is where the cache earns its keep)."""
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.cfg.block_size:]
            logits, _ = self(ctx)
            logits = logits[:, -1, : self.cfg.vocab_size].float() / max(temperature, 1e-6)
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


# ------------------------------------------------------------------------------ counting
def param_breakdown(model: GPT) -> dict:
    """Parameters counted from the module itself (a tied head is one matrix, counted once)."""
    seen, out = set(), {"wte": 0, "wpe": 0, "blocks": 0, "ln_f": 0, "lm_head": 0}
    for name, p in model.named_parameters():            # named_parameters() skips shared tensors
        if id(p) in seen:
            continue
        seen.add(id(p))
        out[name.split(".")[0]] += p.numel()
    out["total"] = sum(out.values())
    out["non_embedding"] = out["blocks"] + out["ln_f"]
    out["layernorm"] = sum(m.weight.numel() + m.bias.numel() for m in model.modules() if isinstance(m, nn.LayerNorm))
    return out
