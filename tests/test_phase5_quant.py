"""Phase 5's weight quantization on a CPU: packing, quantize/dequantize bounds, the W4A16 and W8A16
Triton kernels under Triton's interpreter, and QuantizedLinear's three paths.

The kernels are checked as the exercise checks them (poisoned output, relative error against fp32
dequantize-then-matmul) at irregular shapes: K not a multiple of the group size nor of 8 (the
layout allows both: the last group is partial, the last word padded), odd N, M = 1, 3 and 17, with
and without split-K. A twin kernel that reads the scale of the next group must fail that check.
Triton decides between compiling and interpreting when a kernel is defined, so the kernel tests run
in a child pytest started with TRITON_INTERPRET=1 (as test_phase5_attention.py does).
"""

import pytest
import torch
from conftest import HAS_TRITON, in_child, INTERPRETED, passes_under_the_interpreter

from common.errors import LabError
from phases.phase5_inference.predictions import quant_analysis as qa
from phases.phase5_inference.engine import quantize as qz


def random_weight(n_out, k_in, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, k_in, generator=g) * 0.05
    w[0, :5] = 0.0                                    # a run of exact zeros
    w[1] = w[1].abs() + 0.01                          # an all-positive row: the range must still include 0
    return w.to(dtype)


# ------------------------------------------------------------------------------ packing and bounds
@pytest.mark.parametrize("k_in", [8, 13, 64, 131])
def test_int4_pack_unpack_round_trip_is_exact(k_in):
    g = torch.Generator().manual_seed(k_in)
    q = torch.randint(0, 16, (5, k_in), generator=g, dtype=torch.uint8)
    q[0, :] = 15                                      # every bit set: the sign bit of the int32 word
    packed = qz.pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (5, -(-k_in // 8))
    assert torch.equal(qz.unpack_int4(packed, k_in), q)


def test_int4_nibble_order_is_plain_along_k():
    q = torch.arange(16, dtype=torch.uint8).view(1, 16) % 16
    packed = qz.pack_int4(q)
    assert int(packed[0, 0]) == 0x76543210           # k = 0 in the lowest nibble
    assert int(packed[0, 1]) & 0xF == 8 and (int(packed[0, 1]) >> 28) & 0xF == 15


def test_pack_refuses_out_of_range_values():
    with pytest.raises(LabError, match=r"\[0, 15\]"):
        qz.pack_int4(torch.tensor([[16]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_dequantize_error_is_at_most_half_a_scale(dtype):
    w = random_weight(9, 70, dtype)
    qw = qz.quantize_int8(w)
    assert qw.qweight.dtype == torch.int8 and qw.scales.dtype == dtype and qw.scales.shape == (9,)
    assert int(qw.qweight.abs().max()) <= 127
    err = (qw.dequantize() - w.float()).abs()
    assert bool((err <= qw.scales.float()[:, None] / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_in, group", [(256, 128), (200, 64), (37, 16)])
def test_int4_dequantize_error_is_at_most_half_its_groups_scale(dtype, k_in, group):
    w = random_weight(11, k_in, dtype)
    qw = qz.quantize_int4(w, group)
    groups = -(-k_in // group)
    assert qw.scales.shape == (groups, 11) and qw.zeros.shape == (groups, 11) and qw.zeros.dtype == torch.uint8
    scale_of_k = qw.scales.float().t()[:, torch.arange(k_in) // group]
    err = (qw.dequantize() - w.float()).abs()
    assert bool((err <= scale_of_k / 2 * (1 + 1e-6)).all()), float((err / scale_of_k).max())
    assert bool((qw.dequantize()[0, :5] == 0).all())                      # zero stays exactly zero


def test_int4_quantize_refuses_bad_group_sizes():
    with pytest.raises(LabError, match="group_size"):
        qz.quantize_int4(random_weight(4, 64), group_size=48)
    with pytest.raises(LabError, match="bits=4 or bits=8"):
        qz.quantize(random_weight(4, 64), bits=3)


# ------------------------------------------------------------------------------ the module's paths
def test_naive_path_is_dequantize_then_linear():
    lin = torch.nn.Linear(40, 7)
    for bits in (4, 8):
        m = qz.QuantizedLinear.from_linear(lin, bits, group_size=16, path="naive")
        x = torch.randn(2, 3, 40)
        want = torch.nn.functional.linear(x, m.weight_format.dequantize(), lin.bias)
        assert torch.allclose(m(x), want, atol=1e-6) and m(x).shape == (2, 3, 7)


def test_unknown_path_is_refused():
    with pytest.raises(LabError, match="unknown QuantizedLinear path"):
        qz.QuantizedLinear(qz.quantize_int8(random_weight(4, 16)), path="marlin")


@pytest.mark.parametrize("bits", [4, 8])
def test_library_path_agrees_with_naive(bits):
    """torch's tinygemm ops (their CPU twins here) on the same quantized weight."""
    m = qz.QuantizedLinear.from_linear(torch.nn.Linear(256, 32, bias=False), bits, group_size=128, path="library")
    x = torch.randn(3, 256).to(torch.bfloat16)
    why = qz.library_unavailable(m.weight_format, x)
    if why:
        pytest.skip(why)
    got = m(x).float()
    m.path = "naive"
    ref = x.float() @ m.weight_format.dequantize().t()
    assert float((got - ref).norm() / ref.norm()) < 2e-2


def test_library_path_refuses_shapes_tinygemm_cannot_take():
    m = qz.QuantizedLinear.from_linear(torch.nn.Linear(200, 32, bias=False), 4, group_size=64, path="library")
    with pytest.raises(LabError, match="K a multiple of"):
        m(torch.randn(1, 200).to(torch.bfloat16))


def test_module_moves_its_quantized_tensors_and_keeps_their_dtypes():
    m = qz.QuantizedLinear.from_linear(torch.nn.Linear(64, 16), 4, group_size=32)
    m = m.to(torch.bfloat16)
    qw = m.weight_format
    assert qw.qweight.dtype == torch.int32 and qw.zeros.dtype == torch.uint8 and qw.scales.dtype == torch.float32
    assert m.bias.dtype == torch.bfloat16


# ------------------------------------------------------------------------------ predictions
def test_bytes_per_weight_of_each_format():
    assert qa.weight_bytes("bf16", 4096, 4096) == 2 * 4096 * 4096
    assert qa.weight_bytes("int8", 4096, 4096) == 4096 * 4096 + 2 * 4096
    assert qa.weight_bytes("int4", 4096, 4096, group_size=128) == 4096 * 4096 // 2 + 3 * 4096 * 32
    assert qa.bytes_per_weight("int4", 4096, 4096, 128) == pytest.approx(0.5 + 3 / 128)
    assert qa.weight_bytes("int4", 5, 13, group_size=16) == 5 * 2 * 4 + 3 * 5 * 1     # padded words, one group


def test_memory_bound_batch_follows_the_ridge():
    """bf16 at 4.8 TB/s and 989 TFLOP/s: the ridge is ~206 FLOP/byte; with x and y bytes
    growing with the batch, ~229 rows; int4 at about a quarter of that."""
    bf16 = qa.memory_bound_until_batch("bf16", 4096, 4096, 128, peak_tflops=989.0, bandwidth_gbps=4800.0)
    int4 = qa.memory_bound_until_batch("int4", 4096, 4096, 128, peak_tflops=989.0, bandwidth_gbps=4800.0)
    assert 215 < bf16 < 240 and int4 < bf16 / 3


# ------------------------------------------------------------------------------ parent: the child run
@pytest.mark.skipif(INTERPRETED, reason="this is the parent test")
@pytest.mark.skipif(not HAS_TRITON, reason="needs the Python package `triton`")
def test_kernels_under_the_interpreter():
    passes_under_the_interpreter("tests/test_phase5_quant.py", allowed_skips=("parent test", "lets CPU tensors through"))


@pytest.mark.skipif(INTERPRETED, reason="the interpreter lets CPU tensors through")
@pytest.mark.skipif(not HAS_TRITON, reason="needs the Python package `triton`")
def test_fused_path_refuses_cpu_tensors_without_the_interpreter():
    m = qz.QuantizedLinear.from_linear(torch.nn.Linear(64, 16), 8, path="fused")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        m(torch.randn(1, 64))


def test_exercise_counts_and_needs():
    from common.exercise import Needs
    from phases.phase5_inference import quant_kernels as ex
    assert ex.EXERCISE.needs == Needs(cuda=True, modules=("triton",))
    p = {"k_in": 4096, "n_out": 6144, "batch": 16, "group_size": 128}
    assert ex.problem_flops(p) == 2 * 16 * 6144 * 4096
    activations = 2 * 16 * (4096 + 6144)
    assert ex.problem_bytes(p, "w4_fused") == qa.weight_bytes("int4", 6144, 4096, 128) + activations
    assert ex.problem_bytes(p, "bf16_cublas") == 2 * 6144 * 4096 + activations
    assert ex.problem_bytes(p, "w8_naive") == ex.problem_bytes(p, "w8_fused")        # same bytes needed
    assert ex.algorithm_bytes(p, "w8_naive") == ex.problem_bytes(p, "w8_fused") + 2 * 2 * 6144 * 4096
    params = ex.EXERCISE.params
    assert len(ex.work(params)) == len(ex.problems(params)) * len(ex.EXERCISE.variants)


# ------------------------------------------------------------------------------ child: the kernels
if INTERPRETED:
    import triton
    import triton.language as tl

    from common.exercise import Context, reference_check
    from phases.phase5_inference.engine import quant_gemm as qg

    CTX = Context(torch.device("cpu"), None, "cpu")
    SHAPES = [(1, 37, 200, 64), (3, 37, 200, 64), (17, 37, 200, 64), (3, 21, 131, 16), (17, 64, 256, 128)]

    def check(out, fill, ref, precision) -> dict:
        """The exercise's own gate: poison `out`, run `fill`, compare with the fp32 reference."""
        return reference_check(CTX, out, fill, ref, "fp32 dequantize-then-matmul", precision)()

    def configs(m: int, bits: int, group: int) -> list[dict]:
        """The engine's default, a split-K GEMV, a tiled config with several M and N tiles, and
        (int4, M > 1) CUDA-core rows: 2 per program (several M tiles, the last partial) and 8."""
        gemv_m = 1 if m == 1 else 16
        bk = min(32, group) if bits == 4 else 32
        out = [None, {"BLOCK_M": gemv_m, "BLOCK_N": 16, "BLOCK_K": bk, "SPLIT_K": 3},
               {"BLOCK_M": gemv_m, "BLOCK_N": 16, "BLOCK_K": bk, "SPLIT_K": 2, "FIXUP": False},   # a second kernel sums
               {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": max(16, bk // 2), "SPLIT_K": 1}]
        if bits == 4 and m > 1:
            out += [{"BLOCK_M": 2, "BLOCK_N": 16, "BLOCK_K": bk, "SPLIT_K": 2},
                    {"BLOCK_M": 4, "BLOCK_N": 32, "BLOCK_K": 2 * group, "SPLIT_K": 1}]     # a tile of 2 groups
        if bits == 4 and group >= 128:                  # a tl.dot per nibble position (16+ words a tile)
            out.append({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 2})
        if bits == 4 and m == 1:
            out += [{"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 2 * group, "SPLIT_K": 2},
                    {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": bk, "SPLIT_K": 3, "PREFETCH": False}]
        return out

    def problem(m, n, k, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        return random_weight(n, k, seed=seed), (torch.randn(m, k, generator=g)).to(dtype)

    @in_child
    @pytest.mark.parametrize("dtype, precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
    @pytest.mark.parametrize("m, n, k, group", SHAPES)
    def test_w4a16_matches_dequantize_then_matmul(m, n, k, group, dtype, precision):
        w, x = problem(m, n, k, dtype)
        qw = qz.quantize_int4(w, group)
        ref = x.float() @ qw.dequantize().t()
        out = torch.empty(m, n, dtype=dtype)
        for cfg in configs(m, 4, group):
            v = check(out, lambda c=cfg: out.copy_(qg.w4a16_matmul(x, qw.qweight, qw.scales, qw.zeros, group, c)),
                      ref, precision)
            assert v["passed"], (cfg, v)

    @in_child
    @pytest.mark.parametrize("dtype, precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
    @pytest.mark.parametrize("m, n, k", [(1, 37, 200), (3, 37, 131), (17, 37, 200)])
    def test_w8a16_matches_dequantize_then_matmul(m, n, k, dtype, precision):
        w, x = problem(m, n, k, dtype)
        qw = qz.quantize_int8(w)
        ref = x.float() @ qw.dequantize().t()
        out = torch.empty(m, n, dtype=dtype)
        for cfg in configs(m, 8, 0):
            v = check(out, lambda c=cfg: out.copy_(qg.w8a16_matmul(x, qw.qweight, qw.scales, c)), ref, precision)
            assert v["passed"], (cfg, v)

    @in_child
    def test_kernels_refuse_configs_the_layout_cannot_take():
        w, x = problem(1, 8, 64, torch.float32)
        qw = qz.quantize_int4(w, 32)
        with pytest.raises(LabError, match="dividing the group size"):
            qg.w4a16_matmul(x, qw.qweight, qw.scales, qw.zeros, 32, {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 48,
                                                                    "SPLIT_K": 1})
        with pytest.raises(LabError, match="dividing the group size"):       # tl.dot tiles stay inside a group
            qg.w4a16_matmul(x, qw.qweight, qw.scales, qw.zeros, 32, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64,
                                                                    "SPLIT_K": 1})
        with pytest.raises(LabError, match="do not describe"):
            qg.w4a16_matmul(x, qw.qweight, qw.scales, qw.zeros, 16)

    @triton.jit
    def w4_gemv_with_bug(x_ptr, qw_ptr, scales_ptr, zeros_ptr, out_ptr, N, K, n_words, n_groups,
                         GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BUG: tl.constexpr):
        """A plain one-row W4A16 GEMV, right with BUG="none"; "next_group_scale" takes each
        group's scale from the group after it (the last group keeps its own)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = rows < N
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k in range(0, K):
            word = tl.load(qw_ptr + rows * n_words + k // 8, mask=ok, other=0)
            q = ((word >> ((k % 8) * 4)) & 0xF).to(tl.float32)
            group = k // GROUP
            if BUG == "next_group_scale":
                group_of_scale = tl.minimum(group + 1, n_groups - 1)
            else:
                group_of_scale = group
            scale = tl.load(scales_ptr + group_of_scale * N + rows, mask=ok, other=0.0).to(tl.float32)
            zero = tl.load(zeros_ptr + group * N + rows, mask=ok, other=0).to(tl.float32)
            total += (q - zero) * scale * tl.load(x_ptr + k).to(tl.float32)
        tl.store(out_ptr + rows, total, mask=ok)

    @in_child
    def test_checker_rejects_a_kernel_with_the_wrong_groups_scale():
        m, n, k, group = 1, 37, 200, 64
        w, x = problem(m, n, k, torch.float32, seed=3)
        qw = qz.quantize_int4(w, group)
        ref = x.float() @ qw.dequantize().t()
        out = torch.empty(m, n)
        verdicts = {}
        for bug in ("none", "next_group_scale"):
            verdicts[bug] = check(out, lambda b=bug: w4_gemv_with_bug[(triton.cdiv(n, 16),)](
                x, qw.qweight, qw.scales, qw.zeros, out, n, k, qw.qweight.shape[1], qw.scales.shape[0],
                GROUP=group, BLOCK_N=16, BUG=b), ref, "fp32")
        assert verdicts["none"]["passed"], verdicts["none"]
        assert not verdicts["next_group_scale"]["passed"], verdicts
        rolled = check(out, lambda: out.copy_(qg.w4a16_matmul(x, qw.qweight, qw.scales.roll(1, 0), qw.zeros, group)),
                       ref, "bf16")                     # the real kernel, fed its scales one group off
        assert not rolled["passed"], rolled

    @in_child
    @pytest.mark.parametrize("bits", [4, 8])
    def test_quantized_linear_paths_agree(bits):
        lin = torch.nn.Linear(256, 48, bias=True)
        m = qz.QuantizedLinear.from_linear(lin, bits, group_size=128)
        x = torch.randn(2, 3, 256).to(torch.bfloat16)
        ref = x.float() @ m.weight_format.dequantize().t() + lin.bias.detach()
        outs = {}
        for path in qz.PATHS:
            m.path = path
            if path == "library" and qz.library_unavailable(m.weight_format, x.reshape(-1, 256)):
                continue
            if path == "cuda":                           # the CUDA kernel: a GPU's (tests/test_phase5_int4_mma.py)
                with pytest.raises(LabError, match="path 'cuda'"):
                    m(x)
                continue
            outs[path] = m(x).float()
        assert {"naive", "fused"} <= set(outs)
        for path, y in outs.items():
            assert float((y - ref).norm() / ref.norm()) < 2e-2, path
        assert float((outs["fused"] - outs["naive"]).norm() / outs["naive"].norm()) < 2e-2

    @in_child
    def test_exercise_runs_end_to_end_with_tuning(spec_ctx):
        from phases.phase5_inference import quant_kernels as ex
        params = ex.EXERCISE.resolve_params(on_cpu=True, quick=False,
                                            overrides={"matrices": ["o"], "batches": [1, 17], "tune": True})
        res = ex.run(spec_ctx(), params)
        fused = [r for r in res.rows if r["variant"].endswith("_fused")]
        assert fused and all(r["status"] == "ok" for r in fused), [(r["variant"], r["reason"]) for r in fused]
        assert set(res.summary["tuning"]) == {f"{v} o batch={b}" for v in ("w4_fused", "w8_fused") for b in (1, 17)}
        for table in res.summary["tuning"].values():
            assert table and all(isinstance(ms, float) for ms in table.values()), table

    @in_child
    def test_split_k_tile_counters_are_back_to_zero_and_sums_deterministic():
        w, x = problem(17, 37, 200, torch.bfloat16, seed=5)
        qw = qz.quantize_int4(w, 64)
        cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 4}
        first = qg.w4a16_matmul(x, qw.qweight, qw.scales, qw.zeros, 64, cfg)
        again = qg.w4a16_matmul(x, qw.qweight, qw.scales, qw.zeros, 64, cfg)
        two_kernels = qg.w4a16_matmul(x, qw.qweight, qw.scales, qw.zeros, 64, {**cfg, "FIXUP": False})
        assert torch.equal(first, again) and torch.equal(first, two_kernels)      # the same fixed-order sum
        assert int(qg.tile_counters(x.device, 1).abs().sum()) == 0
        assert qg.launches(cfg) == 1 and qg.launches({**cfg, "FIXUP": False}) == 2
