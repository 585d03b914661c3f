"""The model's small element-wise steps, each one kernel on a GPU: RMSNorm (fused with the
residual add before it), SiLU(gate) * up, and RoPE fused with the store of K and V into the paged
cache. At batch-1 decode every launch costs about as much as it computes, so fewer kernels per
layer is decode speed. For the same reason a one-row matmul (batch-1 decode) is a Triton GEMV:
one kernel where cuBLAS may split K and launch a reduction, optionally taking SiLU(gate) * up of
its input on the fly (the MLP's down projection without a kernel of its own), and a GEMV that
takes the residual add and RMSNorm of its input on the fly (QKV, gate_up and the LM head without
a norm kernel before them; the LM head's also finds each program's largest logit, so the argmax
is one small kernel more).

Each op has a Triton kernel (CUDA tensors) and a torch version (everything else); both round like
Hugging Face's Llama (a sum is rounded to the model's dtype before it is normed, the norm's output
before it is scaled by the weight). The `*_triton` functions are called directly by the
interpreter test.
"""
import torch
import torch.nn.functional as F

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


    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, n_rows, n_cols, w_stride, SILU_MUL: tl.constexpr,
                     EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """y[n] = sum_k x[k] w[n, k] for BLOCK_N rows of w per program, fp32 accumulation. SILU_MUL:
        x is [gate | up] of 2·n_cols and the input is SiLU(gate) * up, rounded as silu_and_mul."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n_rows
        w_rows = w_ptr + rows[:, None].to(tl.int64) * w_stride
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            if EVEN_K:
                w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None], other=0.0)
                x = tl.load(x_ptr + cols)
            else:
                col_ok = cols < n_cols
                w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
                x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
            if SILU_MUL:
                if EVEN_K:
                    up = tl.load(x_ptr + n_cols + cols)
                else:
                    up = tl.load(x_ptr + n_cols + cols, mask=col_ok, other=0.0)
                g = x.to(tl.float32)
                activated = (g / (1.0 + tl.exp(-g))).to(x.dtype).to(tl.float32)
                x = (activated * up.to(tl.float32)).to(x.dtype)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=row_ok)


    @triton.jit
    def _add_rms_norm_gemv_kernel(x_ptr, residual_ptr, norm_ptr, w_ptr, y_ptr, residual_out_ptr,
                                  best_value_ptr, best_index_ptr, n_rows, n_cols, w_stride, eps,
                                  HAS_RESIDUAL: tl.constexpr, ARGMAX: tl.constexpr, EVEN_K: tl.constexpr,
                                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
        """y[n] = sum_k RMSNorm(h)[k] w[n, k] with h = x + residual (HAS_RESIDUAL) or x, rounded as
        rms_norm_triton: every program recomputes h and its RMS from the whole row (from L2), then
        norms and scales each BLOCK_K slice of h as it loads it; program 0 alone writes h to
        residual_out (a separate buffer: the others still read the old residual). ARGMAX: each
        program also writes the largest y of its rows (y as stored, ties to the lowest row) and
        that row, for _argmax_of_partials_kernel."""
        program = tl.program_id(0)
        all_cols = tl.arange(0, BLOCK_H)
        all_ok = all_cols < n_cols
        h = tl.load(x_ptr + all_cols, mask=all_ok, other=0.0)
        if HAS_RESIDUAL:
            whole_residual = tl.load(residual_ptr + all_cols, mask=all_ok, other=0.0)   # not `r`: the loop's r is
            h = (h.to(tl.float32) + whole_residual.to(tl.float32)).to(whole_residual.dtype)   # a slice (one type per name)
            if program == 0:
                tl.store(residual_out_ptr + all_cols, h, mask=all_ok)
        hf = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / n_cols + eps)

        rows = program * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n_rows
        w_rows = w_ptr + rows[:, None].to(tl.int64) * w_stride
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            if EVEN_K:
                w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None], other=0.0)
                x = tl.load(x_ptr + cols)
                g = tl.load(norm_ptr + cols)
                if HAS_RESIDUAL:
                    r = tl.load(residual_ptr + cols)
            else:
                col_ok = cols < n_cols
                w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
                x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
                g = tl.load(norm_ptr + cols, mask=col_ok, other=0.0)
                if HAS_RESIDUAL:
                    r = tl.load(residual_ptr + cols, mask=col_ok, other=0.0)
            if HAS_RESIDUAL:
                x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
            normed = (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)
            x = (normed * g.to(tl.float32)).to(x.dtype)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, 1).to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows, y, mask=row_ok)
        if ARGMAX:
            values = tl.where(row_ok, y.to(tl.float32), float("-inf"))
            best = tl.max(values, axis=0)
            tl.store(best_value_ptr + program, best)
            tl.store(best_index_ptr + program, tl.min(tl.where(values == best, rows, n_rows), axis=0))

    @triton.jit
    def _argmax_of_partials_kernel(best_value_ptr, best_index_ptr, out_ptr, n_partials, BLOCK: tl.constexpr):
        """One program: the row of the largest of the partial maxima (ties: the lowest row, as
        torch.argmax), written to out[0] as int64."""
        offs = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        best_index = tl.full([BLOCK], 2147483647, dtype=tl.int32)
        for start in range(0, n_partials, BLOCK):
            ok = start + offs < n_partials
            value = tl.load(best_value_ptr + start + offs, mask=ok, other=float("-inf"))
            index = tl.load(best_index_ptr + start + offs, mask=ok, other=2147483647)
            better = (value > best) | ((value == best) & (index < best_index))
            best = tl.where(better, value, best)
            best_index = tl.where(better, index, best_index)
        top = tl.max(best, axis=0)
        tl.store(out_ptr, tl.min(tl.where(best == top, best_index, 2147483647), axis=0).to(tl.int64))


def gemv_config(n_rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of the GEMV, by the number of output rows: the
    fastest of a sweep over the 8B shape's projections on an H200."""
    if n_rows >= 16384:
        return 16, 256, 4, 4
    if n_rows > 4096:
        return 16, 512, 4, 3
    return 16, 1024, 8, 2


def gemv_triton(x, weight, silu_mul: bool = False):
    """x [1, K] (silu_mul: [1, 2K], the input being SiLU(gate) * up) times weight [N, K]^T -> [1, N]."""
    n_rows, n_cols = weight.shape
    assert x.shape[0] == 1 and x.stride(-1) == 1 and weight.stride(1) == 1
    assert x.shape[1] == (2 if silu_mul else 1) * n_cols, "x does not match the weight's columns"
    out = torch.empty(1, n_rows, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = gemv_config(n_rows)
    block_k = min(block_k, triton.next_power_of_2(n_cols))
    _gemv_kernel[(triton.cdiv(n_rows, block_n),)](x, weight, out, n_rows, n_cols, weight.stride(0),
                                                  SILU_MUL=silu_mul, EVEN_K=n_cols % block_k == 0,
                                                  BLOCK_N=block_n, BLOCK_K=block_k,
                                                  num_warps=warps, num_stages=stages)
    return out


def add_rms_norm_gemv_triton(x, residual, norm_weight, eps: float, weight, out=None, argmax_out=None):
    """One kernel for one row: (RMSNorm(x + residual) @ weight.T, x + residual) with residual, or
    (RMSNorm(x) @ weight.T, x) with residual None; the residual is left as it was (the sum is a new
    tensor). out: where y goes (its dtype may differ: y is rounded to x's first, as
    `linear(...).float()`); argmax_out: y's argmax is written to argmax_out[0] by a second, one-program
    kernel."""
    n_rows, n_cols = weight.shape
    assert x.shape == (1, n_cols) and x.stride(-1) == 1 and weight.stride(1) == 1
    assert residual is None or (residual.shape == x.shape and residual.stride(-1) == 1)
    out = torch.empty(1, n_rows, dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == (1, n_rows) and out.stride(-1) == 1
    new_residual = x if residual is None else torch.empty_like(residual)
    block_n, block_k, warps, stages = gemv_config(n_rows)
    block_k = min(block_k, triton.next_power_of_2(n_cols))
    programs = triton.cdiv(n_rows, block_n)
    if argmax_out is not None:
        best_value = torch.empty(programs, dtype=torch.float32, device=x.device)
        best_index = torch.empty(programs, dtype=torch.int32, device=x.device)
    else:
        best_value = best_index = out                         # not touched without ARGMAX
    _add_rms_norm_gemv_kernel[(programs,)](
        x, x if residual is None else residual, norm_weight, weight, out, new_residual, best_value, best_index,
        n_rows, n_cols, weight.stride(0), eps, HAS_RESIDUAL=residual is not None, ARGMAX=argmax_out is not None,
        EVEN_K=n_cols % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_H=triton.next_power_of_2(n_cols),
        num_warps=warps, num_stages=stages)
    if argmax_out is not None:
        _argmax_of_partials_kernel[(1,)](best_value, best_index, argmax_out, programs,
                                         BLOCK=min(1024, triton.next_power_of_2(programs)), num_warps=4)
    return out, new_residual


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
