"""Phase 5's paged decode attention on a CPU: the Triton kernel through Triton's interpreter, the
FlexAttention variant in eager mode, both against the reference (gather + SDPA per sequence).

Triton decides between compiling and interpreting when a kernel is defined, so the kernel tests
run in a child pytest started with TRITON_INTERPRET=1 (as test_phase3_interpreter.py does); in
this parent process they skip, and the shape-only tests run. Contexts are irregular (1, a block
minus one, a block, a block plus one, several blocks), block tables are shuffled and their entries
past a sequence's blocks point at other sequences' blocks, so a kernel that reads past the end or
ignores the table reads real but wrong data. A deliberately broken twin (tail block dropped,
block table ignored) must fail the same check.
"""

import pytest
import torch
from conftest import HAS_TRITON, in_child, INTERPRETED, passes_under_the_interpreter

from phases.phase5_inference.engine import paged_attention as attn

LENGTHS = [1, 15, 16, 17, 50, 83]                  # block_size 16: every tail case, several blocks


def make_problem(lengths, heads, kv_heads, head_dim=32, block_size=16, dtype=torch.float32, seed=0):
    """q, shuffled K/V pool with spare blocks, tables whose unused entries point at other blocks."""
    g = torch.Generator().manual_seed(seed)
    owned = [-(-n // block_size) for n in lengths]
    pool = sum(owned) + 5
    order = torch.randperm(pool, generator=g)
    tables = torch.randint(0, pool, (len(lengths), max(owned) + 2), generator=g, dtype=torch.int32)
    start = 0
    for b, n in enumerate(owned):
        tables[b, :n] = order[start:start + n].to(torch.int32)
        start += n
    q = torch.randn(len(lengths), heads, head_dim, generator=g).to(dtype)
    k = torch.randn(pool, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(pool, block_size, kv_heads, head_dim, generator=g).to(dtype)
    return q, k, v, tables, torch.tensor(lengths, dtype=torch.int32), head_dim ** -0.5


def reference(q, k, v, tables, lens, scale):
    return attn.paged_decode_attention_reference(q.float(), k, v, tables, lens, scale)


# ------------------------------------------------------------------------------ parent: shapes only
@pytest.mark.skipif(INTERPRETED, reason="this is the parent test")
@pytest.mark.skipif(not HAS_TRITON, reason="needs the Python package `triton`")
def test_kernels_under_the_interpreter():
    passes_under_the_interpreter("tests/test_phase5_attention.py", allowed_skips=("parent test", "lets CPU tensors through"))


def test_splits_follow_shapes_only():
    """Batch 1 with 8 KV heads splits long contexts to fill the GPU; a big batch does not split;
    a short block table caps the splits; nothing depends on the context lengths' values."""
    assert attn.choose_num_splits(1, 8, 8192, 132) == attn.MAX_SPLITS
    assert attn.choose_num_splits(1, 8, 4096, 132) == 4096 // attn.MIN_TOKENS_PER_SPLIT
    assert attn.choose_num_splits(1, 8, 300, 132) == 1
    assert attn.choose_num_splits(256, 8, 8192, 132) == 1
    assert attn.choose_num_splits(8, 8, 8192, 132) == 5                 # ceil(264 / 64)


def test_auto_backend_on_a_cpu_is_the_reference():
    q, k, v, tables, lens, scale = make_problem(LENGTHS, 8, 2)
    got = attn.paged_decode_attention(q, k, v, tables, lens, scale)
    assert torch.equal(got, attn.paged_decode_attention_reference(q, k, v, tables, lens, scale))
    with pytest.raises(ValueError, match="unknown attention backend"):
        attn.paged_decode_attention(q, k, v, tables, lens, scale, backend="cudnn")


@pytest.mark.skipif(INTERPRETED, reason="the interpreter lets CPU tensors through")
@pytest.mark.skipif(not HAS_TRITON, reason="needs the Python package `triton`")
def test_triton_backend_refuses_cpu_tensors_without_the_interpreter():
    q, k, v, tables, lens, scale = make_problem([5], 4, 4)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        attn.paged_decode_attention(q, k, v, tables, lens, scale, backend="triton")


def test_exercise_counts_and_needs():
    from common.exercise import Needs
    from phases.phase5_inference import decode_attention as ex
    assert ex.EXERCISE.needs == Needs(cuda=True, modules=("triton",))
    p = ex.problems(ex.EXERCISE.params)[0]
    lengths = ex.context_lengths(p["batch"], p["context"])
    assert all(abs(n - p["context"]) <= p["context"] // ex.LENGTH_SPREAD for n in lengths)
    assert lengths == ex.context_lengths(p["batch"], p["context"])           # seeded: work() and run() agree
    tokens = sum(lengths)
    assert ex.problem_bytes(p) == (2 * tokens * 8 + 2 * p["batch"] * 32) * 128 * 2
    assert ex.problem_flops(p) == 4 * 32 * 128 * tokens
    assert len(ex.work(ex.EXERCISE.params)) == 3 * len(ex.problems(ex.EXERCISE.params))


# ------------------------------------------------------------------------------ child: the kernels
if INTERPRETED:
    import triton
    import triton.language as tl

    from common.exercise import Context, reference_check

    CTX = Context(torch.device("cpu"), None, "cpu")

    def check(out, fill, ref, precision) -> dict:
        """The exercise's own gate: poison `out`, run `fill`, compare with the fp32 reference."""
        return reference_check(CTX, out, fill, ref, "fp32 reference", precision)()

    @triton.jit
    def decode_with_bug(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale, stride_table, num_heads,
                        group, kv_heads, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BUG: tl.constexpr):
        """A plain one-head-per-program paged decode, right with BUG="none"; "skip_tail" drops a
        partial last block, "no_table" takes logical block j to be physical block j."""
        seq = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // group
        n = tl.load(lens_ptr + seq)
        dims = tl.arange(0, HEAD_DIM)
        slots = tl.arange(0, BLOCK_SIZE)
        q = tl.load(q_ptr + (seq * num_heads + head) * HEAD_DIM + dims)
        m = float("-inf")
        l_sum = 0.0
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        n_blocks = n // BLOCK_SIZE if BUG == "skip_tail" else tl.cdiv(n, BLOCK_SIZE)
        for j in range(0, n_blocks):
            if BUG == "no_table":
                page = j
            else:
                page = tl.load(tables_ptr + seq * stride_table + j)
            valid = j * BLOCK_SIZE + slots < n
            rows = ((page * BLOCK_SIZE + slots) * kv_heads + kv_head) * HEAD_DIM
            k = tl.load(k_ptr + rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
            s = tl.where(valid, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 0))
            p = tl.exp(s - m_new)
            alpha = tl.exp(m - m_new)
            l_sum = l_sum * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            m = m_new
        tl.store(out_ptr + (seq * num_heads + head) * HEAD_DIM + dims, acc / l_sum)

    @in_child
    @pytest.mark.parametrize("dtype, precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
    @pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])            # GQA ratios 1 and 4
    def test_triton_matches_reference_at_irregular_lengths(dtype, precision, heads, kv_heads):
        q, k, v, tables, lens, scale = make_problem(LENGTHS, heads, kv_heads, dtype=dtype)
        ref = reference(q, k, v, tables, lens, scale)
        out = torch.empty_like(q)
        for splits, block_n in ((1, 16), (3, 32), (None, 16)):              # None: the engine's own choice
            v_ = check(out, lambda: attn.paged_decode_attention_triton(
                q, k, v, tables, lens, scale, num_splits=splits, config={"BLOCK_N": block_n}, out=out), ref, precision)
            assert v_["passed"], (splits, block_n, v_)

    @in_child
    @pytest.mark.parametrize("block_size, block_n", [(8, 32), (32, 16)])     # tiles spanning pages, pages spanning tiles
    def test_triton_with_tiles_and_blocks_of_different_sizes(block_size, block_n):
        q, k, v, tables, lens, scale = make_problem([1, 7, 8, 9, 33, 70], 8, 2, block_size=block_size)
        ref = reference(q, k, v, tables, lens, scale)
        out = torch.empty_like(q)
        v_ = check(out, lambda: attn.paged_decode_attention_triton(
            q, k, v, tables, lens, scale, num_splits=2, config={"BLOCK_N": block_n}, out=out), ref, "fp32")
        assert v_["passed"], v_

    @in_child
    def test_engine_entry_point_with_a_strided_q_and_an_empty_slot():
        """q sliced out of a fused qkv projection (batch stride > heads x dim), and a padding slot
        with context 0 (as a captured batch has) that must come out as zeros, never NaN."""
        q, k, v, tables, lens, scale = make_problem([0, 17, 40], 8, 2)
        qkv = torch.randn(3, 8 * 32 + 2 * 2 * 32)
        q = qkv[:, : 8 * 32].view(3, 8, 32)
        ref = reference(q[1:], k, v, tables[1:], lens[1:], scale)
        out = torch.empty_like(q)
        v_ = check(out, lambda: out.copy_(attn.paged_decode_attention(q, k, v, tables, lens, scale, backend="triton")),
                   torch.cat([torch.zeros(1, 8, 32), ref]), "fp32")
        assert v_["passed"], v_
        assert torch.equal(out[0], torch.zeros_like(out[0]))

    @in_child
    def test_checker_rejects_a_kernel_that_drops_the_tail_or_ignores_the_table():
        q, k, v, tables, lens, scale = make_problem(LENGTHS, 8, 2)
        ref = reference(q, k, v, tables, lens, scale)
        out = torch.empty_like(q)
        verdicts = {}
        for bug in ("none", "skip_tail", "no_table"):
            verdicts[bug] = check(out, lambda b=bug: decode_with_bug[(len(LENGTHS), 8)](
                q, k, v, tables, lens, out, scale, tables.stride(0), 8, 4, 2, HEAD_DIM=32, BLOCK_SIZE=16, BUG=b),
                ref, "fp32")
        assert verdicts["none"]["passed"], verdicts["none"]
        assert not verdicts["skip_tail"]["passed"] and not verdicts["no_table"]["passed"], verdicts

    @in_child
    def test_flex_attention_mask_matches_reference():
        """Eager flex evaluates mask_mod at every (sequence, pool token): the block-table mask must be
        exact there, and stale table entries must not unmask another sequence's block."""
        q, k, v, tables, lens, scale = make_problem(LENGTHS, 8, 2)
        ref = reference(q, k, v, tables, lens, scale)
        out = torch.empty_like(q)
        v_ = check(out, lambda: out.copy_(attn.paged_decode_attention(q, k, v, tables, lens, scale, backend="flex")),
                   ref, "fp32")
        assert v_["passed"], v_

    @in_child
    def test_exercise_runs_end_to_end(spec_ctx):
        from phases.phase5_inference import decode_attention as ex
        params = ex.EXERCISE.resolve_params(on_cpu=True, quick=False, overrides={"flex_on_cpu": True})
        res = ex.run(spec_ctx(), params)
        assert [r["variant"] for r in res.rows] == ["gather_sdpa", "triton", "flex"] * 2
        assert all(r["status"] == "ok" for r in res.rows), [(r["variant"], r["reason"]) for r in res.rows]
        for r in res.rows:
            p = {k: r["params"][k] for k in ("model", "batch", "context", "heads", "kv_heads", "head_dim",
                                              "block_size", "dtype")}
            assert r["prediction"]["bytes"] == ex.problem_bytes(p) and r["params"]["kv_tokens"] == ex.kv_tokens(p)
        assert "speedup_vs_gather_sdpa" in res.rows[1]["metrics"]
