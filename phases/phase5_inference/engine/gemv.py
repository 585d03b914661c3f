"""The batch-1 GEMV: one 16-bit row times a weight matrix in one Triton kernel, where cuBLAS may split
K and launch a reduction. Optionally it takes SiLU(gate) * up of its input on the fly (the MLP's down
projection without a kernel of its own), or the residual add and RMSNorm of its input (QKV,
gate_up and the LM head without a norm kernel before them; the LM head's also finds each
program's largest logit, so the argmax is one small kernel more). fused_ops.py dispatches to it.
"""
import torch

try:
    import triton
    import triton.language as tl
except ImportError:                      # CPU-only installs: fused_ops' torch versions serve
    triton = None


if triton is not None:
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
