"""The model's small element-wise steps, each one kernel on a GPU: RMSNorm (fused with the
residual add before it), SiLU(gate) * up, and RoPE fused with the store of K and V into the paged
cache; and the dispatch of the model's matmuls. At batch-1 decode every launch costs about as much
as it computes, so fewer kernels per layer is decode speed. For the same reason a one-row matmul
(batch-1 decode) goes to the Triton GEMV (gemv.py), with SiLU(gate) * up or the residual add and
RMSNorm of its input taken on the fly.

Each op has a Triton kernel (CUDA tensors) and a torch version (everything else); both round like
Hugging Face's Llama (a sum is rounded to the model's dtype before it is normed, the norm's output
before it is scaled by the weight). The `*_triton` functions are called directly by the
interpreter test.
"""
import torch
import torch.nn.functional as F

from .gemv import add_rms_norm_gemv_triton, gemv_triton

try:
    import triton
    import triton.language as tl
except ImportError:                      # CPU-only installs: the torch versions serve
    triton = None


# ------------------------------------------------------------------------------ torch versions
def rms_norm_torch(x, weight, eps: float):
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm_torch(x, residual, weight, eps: float):
    """residual += x (in place); returns RMSNorm(residual)."""
    residual.add_(x)
    return rms_norm_torch(residual, weight, eps)


def silu_and_mul_torch(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_and_store_torch(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping,
                         num_heads: int, num_kv_heads: int, head_dim: int):
    """Rotate q and k of each token by its position (rotate-half layout, as Hugging Face's Llama);
    returns q as a new [tokens, heads, head_dim] tensor, writes the rotated k back into `qkv` and
    stores k and v at their slots of the paged cache (slot -1: not stored)."""
    tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)          # [tokens, 1, half]

    def rotate(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    q_rotated = rotate(q.reshape(tokens, num_heads, head_dim))
    k_rotated = rotate(k.reshape(tokens, num_kv_heads, head_dim))
    k.copy_(k_rotated.reshape(tokens, kv_size))
    v = v.reshape(tokens, num_kv_heads, head_dim)
    if bool((slot_mapping < 0).any()):                       # padding rows: no cache write
        keep = slot_mapping >= 0
        slot_mapping, k_rotated, v = slot_mapping[keep], k_rotated[keep], v[keep]
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k_rotated
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v
    return q_rotated


# ------------------------------------------------------------------------------ Triton kernels
if triton is not None:
    @triton.jit
    def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, x_stride, residual_stride, out_stride,
                         n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
            tl.store(residual_ptr + row * residual_stride + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
        normed = (xf * rstd).to(x.dtype).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, (normed * w.to(tl.float32)).to(x.dtype), mask=mask)

    @triton.jit
    def _silu_and_mul_kernel(gate_up_ptr, out_ptr, gate_up_stride, out_stride, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate = tl.load(gate_up_ptr + row * gate_up_stride + cols, mask=mask, other=0.0)
        up = tl.load(gate_up_ptr + row * gate_up_stride + n_cols + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, (activated * up.to(tl.float32)).to(gate.dtype), mask=mask)

    @triton.jit
    def _rope_and_store_kernel(qkv_ptr, positions_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                               slot_ptr, qkv_stride, num_heads, num_kv_heads,
                               HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
        """Program (token, head): heads [0, num_heads) rotate q; the next num_kv_heads rotate k
        (back into qkv and into the cache) and copy v into the cache. Slot -1: no cache write."""
        token = tl.program_id(0)
        head = tl.program_id(1)
        offs = tl.arange(0, HALF)
        position = tl.load(positions_ptr + token)
        c = tl.load(cos_ptr + position * HALF + offs)
        s = tl.load(sin_ptr + position * HALF + offs)
        row = qkv_ptr + token * qkv_stride
        if head < num_heads:
            src = row + head * HEAD_DIM
            x1 = tl.load(src + offs)
            x2 = tl.load(src + HALF + offs)
            a, b = x1.to(tl.float32), x2.to(tl.float32)
            dst = q_out_ptr + (token * num_heads + head) * HEAD_DIM
            tl.store(dst + offs, (a * c - b * s).to(x1.dtype))
            tl.store(dst + HALF + offs, (b * c + a * s).to(x1.dtype))
        else:
            kv_head = head - num_heads
            src = row + (num_heads + kv_head) * HEAD_DIM
            x1 = tl.load(src + offs)
            x2 = tl.load(src + HALF + offs)
            a, b = x1.to(tl.float32), x2.to(tl.float32)
            k1 = (a * c - b * s).to(x1.dtype)
            k2 = (b * c + a * s).to(x1.dtype)
            tl.store(src + offs, k1)
            tl.store(src + HALF + offs, k2)
            slot = tl.load(slot_ptr + token).to(tl.int64)
            if slot >= 0:
                dst = (slot * num_kv_heads + kv_head) * HEAD_DIM
                tl.store(k_cache_ptr + dst + offs, k1)
                tl.store(k_cache_ptr + dst + HALF + offs, k2)
                v_src = row + (num_heads + num_kv_heads + kv_head) * HEAD_DIM
                tl.store(v_cache_ptr + dst + offs, tl.load(v_src + offs))
                tl.store(v_cache_ptr + dst + HALF + offs, tl.load(v_src + HALF + offs))


def rms_norm_triton(x, weight, eps: float, residual=None):
    """RMSNorm of x's rows, or with `residual`: residual += x in place, then RMSNorm(residual)."""
    rows, n_cols = x.shape
    out = torch.empty_like(x)
    res = residual if residual is not None else x
    _rms_norm_kernel[(rows,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), n_cols, eps,
                              HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n_cols))
    return out


def silu_and_mul_triton(gate_up):
    rows, width = gate_up.shape
    n_cols = width // 2
    out = torch.empty(rows, n_cols, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_and_mul_kernel[(rows, triton.cdiv(n_cols, block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                              n_cols, BLOCK=block)
    return out


def rope_and_store_triton(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping,
                          num_heads: int, num_kv_heads: int, head_dim: int):
    assert head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0, "head_dim / 2 must be a power of 2"
    tokens = qkv.shape[0]
    q_out = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope_and_store_kernel[(tokens, num_heads + num_kv_heads)](
        qkv, positions, cos, sin, q_out, k_cache, v_cache, slot_mapping, qkv.stride(0), num_heads, num_kv_heads,
        HEAD_DIM=head_dim, HALF=head_dim // 2)
    return q_out


# ------------------------------------------------------------------------------ dispatch
def _on_gpu(x) -> bool:
    return x.is_cuda and triton is not None


def rms_norm(x, weight, eps: float):
    return rms_norm_triton(x, weight, eps) if _on_gpu(x) else rms_norm_torch(x, weight, eps)


def add_rms_norm(x, residual, weight, eps: float):
    """residual += x (in place); returns RMSNorm(residual)."""
    if _on_gpu(x):
        return rms_norm_triton(x, weight, eps, residual=residual)
    return add_rms_norm_torch(x, residual, weight, eps)


def silu_and_mul(gate_up):
    return silu_and_mul_triton(gate_up) if _on_gpu(gate_up) else silu_and_mul_torch(gate_up)


def rope_and_store(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, head_dim):
    op = rope_and_store_triton if _on_gpu(qkv) else rope_and_store_torch
    return op(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, head_dim)


def _gemv_fits(x, weight) -> bool:
    """One 16-bit row on a GPU times a plain weight tensor: where the GEMV beats cuBLAS."""
    return (isinstance(weight, torch.Tensor) and _on_gpu(x) and x.shape[0] == 1 and x.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.stride(1) == 1)


def linear(x, weight):
    """x @ weight.T: the Triton GEMV for one 16-bit row on a GPU, F.linear otherwise; a quantized
    weight (quantize.QuantizedLinear, not a tensor) multiplies by its own path."""
    if not isinstance(weight, torch.Tensor):
        return weight(x)
    return gemv_triton(x, weight) if _gemv_fits(x, weight) else F.linear(x, weight)


def add_rms_norm_linear(x, residual, norm_weight, eps: float, weight):
    """(RMSNorm(x + residual) @ weight.T, x + residual); residual None: (RMSNorm(x) @ weight.T, x).
    One kernel for one 16-bit row on a GPU (the returned residual a new tensor), else the norm
    (residual updated in place, as add_rms_norm) and then `linear`."""
    if _gemv_fits(x, weight) and (residual is None or residual.stride(-1) == 1):
        return add_rms_norm_gemv_triton(x, residual, norm_weight, eps, weight)
    if _fuses_input(x, weight) and norm_weight.dtype == x.dtype and (residual is None or residual.shape == x.shape):
        return weight.add_rms_norm_forward(x, residual, norm_weight, eps)
    if residual is None:
        return linear(rms_norm(x, norm_weight, eps), weight), x
    return linear(add_rms_norm(x, residual, norm_weight, eps), weight), residual


def add_rms_norm_logits(x, residual, norm_weight, eps: float, weight, out=None, argmax_out=None):
    """fp32 logits RMSNorm(x + residual) @ weight.T, rounded to x's dtype first (as
    `linear(...).float()`), into `out` when given; argmax_out: their argmax per row written to it.
    One row of 16 bits on a GPU: the norm, the LM head and half the argmax in one kernel."""
    if _gemv_fits(x, weight) and residual.stride(-1) == 1:
        if out is None:
            out = torch.empty(1, weight.shape[0], dtype=torch.float32, device=x.device)
        return add_rms_norm_gemv_triton(x, residual, norm_weight, eps, weight, out=out, argmax_out=argmax_out)[0]
    return logits_into(linear(add_rms_norm(x, residual, norm_weight, eps), weight).float(), out, argmax_out)


def logits_into(logits, out=None, argmax_out=None):
    """`logits`, copied into `out` when given (then `out` is returned), and their argmax per row
    written to argmax_out when given."""
    if out is not None:
        out.copy_(logits)
        logits = out
    if argmax_out is not None:
        torch.argmax(logits, dim=-1, out=argmax_out)
    return logits


def silu_and_mul_linear(gate_up, weight):
    """SiLU(gate) * up, times weight.T: one GEMV kernel for one 16-bit row on a GPU."""
    if _gemv_fits(gate_up, weight):
        return gemv_triton(gate_up, weight, silu_mul=True)
    return linear(silu_and_mul(gate_up), weight)


def _fuses_input(x, weight) -> bool:
    """A quantized projection (QuantizedLinear) that runs the RMSNorm before it inside its own kernel
    (one row through the CUDA int4 kernel, staged with the row). SiLU * up is not fused so: the down
    projection's blocks each span all of K, so every block would recompute the whole row's SiLU
    (measured slower on an H200 than its own kernel; int4_mma.silu_mul_matmul keeps the option)."""
    return not isinstance(weight, torch.Tensor) and hasattr(weight, "fuses_input") and weight.fuses_input(x)
