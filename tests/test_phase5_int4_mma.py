"""The CUDA int4 kernel (engine/int4_mma): its load-time re-layout, the arithmetic its lanes do
(emulated on the CPU from PTX's mma fragment layout), its launch rule, its build, its refusals;
and on a GPU, the kernel itself against fp32 x @ dequantize(W)^T, shown to fail when fed a wrong
weight."""
import random
import shutil

import pytest
import torch

from common.checks import compare
from common.errors import LabError
from phases.phase5_inference.engine import int4_mma as im
from phases.phase5_inference.engine import quantize as qz

SHAPES = [  # (N, K, group size): N not a tile multiple, K not a chunk multiple, every group kind
    (40, 96, 32), (33, 200, 64), (24, 264, 128), (24, 136, 136), (17, 512, 512)]


def int4_weight(n: int, k: int, group: int, symmetric: bool = False, fp16: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    if group >= k:                                      # per-channel: one group per row
        qw = qz.quantize_int4(w, 128)
        q = qz.unpack_int4(qw.qweight, k).float()
        w_min = torch.minimum(w.float().amin(1), torch.zeros(n))
        w_max = torch.maximum(w.float().amax(1), torch.zeros(n))
        scale = ((w_max - w_min) / 15).clamp(min=1e-8)
        zero = torch.round(-w_min / scale).clamp(0, 15)
        q = (torch.round(w.float() / scale[:, None]) + zero[:, None]).clamp(0, 15)
        qw = qz.Int4Weight(qz.pack_int4(q.to(torch.uint8)), scale[None].to(torch.bfloat16),
                           zero[None].to(torch.uint8), k, k)
    else:
        qw = qz.quantize_int4(w, group)
    if symmetric:
        qw.zeros.fill_(8)
    if fp16:
        qw.scales = qw.scales.to(torch.float16)
    return qw


def emulate(x: torch.Tensor, mw: im.MmaInt4Weight, nibble_order=tuple(range(8))) -> torch.Tensor:
    """y = x @ W^T computed the way the kernel's lanes do, from PTX's m16n8k16 fragment layout: each
    lane's word gives register i = nibbles (i, i + 4) of rows g + 8 (i % 2), logical columns
    2t + 8 (i // 2) + {0, 1}; the B fragment comes from the 16-byte activation vector of inputs
    8t .. 8t + 7 of the 32-input block; the group's scale multiplies each mma's fp32 sum.
    `nibble_order` reads the nibbles in another order (a wrong kernel, for the checker)."""
    m, k = x.shape
    words = mw.wq.to(torch.int64) & 0xFFFFFFFF
    nibbles = (words[..., None] >> (4 * torch.tensor(nibble_order))) & 15
    meta = mw.meta.to(torch.int64) & 0xFFFFFFFF
    y = torch.zeros(m, mw.n_tiles * 16, dtype=torch.float64)
    xp = torch.zeros(m, mw.k_chunks * 64, dtype=torch.float64)
    xp[:, :k] = x.double()
    lanes = torch.arange(32)
    g, t = lanes // 4, lanes % 4
    for tile in range(mw.n_tiles):
        for c in range(mw.k_chunks):
            for s in range(4):
                h = s // 2
                group = min((2 * c + h) >> mw.log2_blocks_per_group, mw.groups - 1)
                a = torch.zeros(16, 16, dtype=torch.float64)
                for p in range(8):
                    reg, half = p % 4, p // 4
                    rows, cols = g + 8 * (reg % 2), 2 * t + 8 * (reg // 2) + half
                    zero = (meta[tile, group, g, reg % 2] >> 16) & 0xFF
                    a[rows, cols] = (nibbles[tile, c, lanes, s, p] - zero).double()
                b = torch.zeros(16, m, dtype=torch.float64)
                base = c * 64 + h * 32
                e = 4 * (s & 1)
                for lane_t in range(4):
                    vec = xp[:, base + 8 * lane_t: base + 8 * lane_t + 8]
                    b[2 * lane_t], b[2 * lane_t + 1] = vec[:, e], vec[:, e + 1]
                    b[2 * lane_t + 8], b[2 * lane_t + 9] = vec[:, e + 2], vec[:, e + 3]
                bits = (meta[tile, group] & 0xFFFF).to(torch.int32).to(torch.int16)
                scale = bits.view(torch.float16 if mw.fp16_scales else torch.bfloat16).double()
                row_scale = torch.cat([scale[:, 0], scale[:, 1]])
                y[:, tile * 16:(tile + 1) * 16] += ((a @ b) * row_scale[:, None]).t()
    return y[:, :mw.out_features]


@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("symmetric,fp16", [(False, False), (True, True)])
def test_relayout_loses_nothing(n, k, group, symmetric, fp16):
    qw = int4_weight(n, k, group, symmetric, fp16)
    mw = im.relayout(qw)
    assert mw.wq.shape == (im.cdiv(n, 16), im.cdiv(k, 64), 32, 4) and mw.wq.dtype == torch.int32
    assert torch.equal(im.dequantize_relaid(mw), qw.dequantize(torch.float32))


@pytest.mark.parametrize("n,k,group", SHAPES[:3] + SHAPES[4:])
def test_the_lanes_arithmetic_is_x_times_w(n, k, group):
    qw = int4_weight(n, k, group)
    mw = im.relayout(qw)
    x = torch.randn(3, k).to(torch.bfloat16)
    ref = x.double() @ qw.dequantize(torch.float32).double().t()
    assert torch.allclose(emulate(x, mw), ref, rtol=1e-9, atol=1e-9)


def test_the_check_fails_a_kernel_that_reads_nibbles_out_of_order():
    qw = int4_weight(40, 128, 32)
    mw = im.relayout(qw)
    x = torch.randn(2, 128).to(torch.bfloat16)
    ref = (x.float() @ qw.dequantize(torch.float32).t())
    good = compare(emulate(x, mw).float(), ref, "bf16", "fp32 x @ W^T")
    swapped = compare(emulate(x, mw, (1, 0, 2, 3, 4, 5, 6, 7)).float(), ref, "bf16", "fp32 x @ W^T")
    assert good["passed"] and not swapped["passed"], (good, swapped)


def test_the_launch_rule_is_a_rule_of_the_shape():
    rng = random.Random(0)
    for _ in range(300):
        m, n, k, sms = rng.randint(1, 300), rng.randint(1, 40000), 8 * rng.randint(1, 4000), rng.choice([78, 114, 132])
        cfg = im.plan(m, n, k, sms)
        assert cfg["wn"] * cfg["wk"] == im.WARPS and cfg["splits"] >= 1
        k_split = cfg["wk"] * cfg["splits"]
        assert k_split & (k_split - 1) == 0, cfg
        blocks = im.cdiv(im.cdiv(n, 16) * k_split, im.WARPS)
        filling = blocks <= sms and k_split <= im.WARPS          # from 2 rows: slices shortened to fill the SMs
        shortest = im.MIN_CHUNKS_PER_WARP_ONE_ROW if m == 1 or filling else im.MIN_CHUNKS_PER_WARP
        assert k_split == 1 or im.cdiv(k, 64) // k_split >= shortest, (m, n, k, cfg)
        assert cfg["mb"] in (1, 2, 4, 8) and 8 * cfg["mb"] >= min(m, im.MMA_MAX_M)
    # batch 1: K is split until the warps fill WAVE_FILL of a wave of resident warps, within a block
    # unless the tiles alone leave more than half the SMs without one; from 2 rows at most one wave.
    # A small N with a long K is split across blocks; a large N keeps whole tiles in a warp
    assert im.plan(1, 512, 65536, 132)["splits"] > 1
    big = im.plan(1, 28672, 4096, 132)
    assert big["splits"] == 1 and big["wk"] == 1
    for m, n, k in [(1, 4096, 14336), (1, 6144, 4096), (1, 5120, 13824), (1, 16384, 2048)]:
        cfg = im.plan(m, n, k, 132)
        slots = 132 * im.RESIDENT_WARPS_PER_SM
        warps = im.cdiv(n, 16) * cfg["wk"] * cfg["splits"]
        assert cfg["splits"] == 1 and im.WAVE_FILL * slots <= warps < 2 * im.WAVE_FILL * slots, (m, n, k, cfg)
    for m, n, k in [(4, 4096, 14336), (8, 6144, 4096), (16, 16384, 3072)]:
        cfg = im.plan(m, n, k, 132)
        warps = im.cdiv(n, 16) * cfg["wk"] * cfg["splits"]
        assert 132 * im.RESIDENT_WARPS_PER_SM // 2 < warps <= 132 * im.RESIDENT_WARPS_PER_SM, (m, n, k, cfg)
    # from 2 rows, few tiles and a short K (a 1B model's qkv and o): slices shorten within a block until
    # every SM has one; never across blocks for that (the 1B's down keeps 8 warps along K, 128 blocks)
    for m, n, k in [(4, 3072, 2048), (16, 3072, 2048), (2, 4096, 4096)]:
        cfg = im.plan(m, n, k, 132)
        k_split = cfg["wk"] * cfg["splits"]
        assert im.cdiv(im.cdiv(n, 16) * k_split, im.WARPS) >= 132 and cfg["splits"] == 1, (m, n, k, cfg)
        assert im.cdiv(k, 64) // k_split < im.MIN_CHUNKS_PER_WARP, (m, n, k, cfg)
    assert im.plan(4, 2048, 8192, 132) == {**im.plan(4, 2048, 8192, 132), "wk": 8, "splits": 1}
    assert im.uses_dequantized(im.ROWS_MAX_M + 1) and not im.uses_dequantized(im.ROWS_MAX_M)
    # the weights' stream: the cp.async ring at batch 1 only, the register ring above, bulk copies on request
    assert im.plan(1, 4096, 4096, 132)["stream"] == "async"
    assert {im.plan(m, 4096, 4096, 132)["stream"] for m in (2, 8, 33, 64)} == {"registers"}
    assert im.plan(1, 4096, 4096, 132, bulk=True)["stream"] == "bulk"


def test_the_rows_rule_is_a_rule_of_the_shape():
    """M picks the tiling; (M, N, K, SMs) the rows partition: powers-of-two splits that keep a few
    windows per split, more splits where N alone leaves SMs idle, none where it fills them."""
    assert [im.kernel_of(m) for m in (1, 8, 16, 17, 64, 128, 129)] == ["mma"] * 3 + ["rows"] * 3 + ["dequantized"]
    assert im.weight_reads(64) == 1 and im.weight_reads(65) == 2 and im.weight_reads(129) == 1
    rng = random.Random(1)
    for _ in range(300):
        m, n, k = rng.randint(17, 128), rng.randint(1, 40000), 8 * rng.randint(1, 4000)
        sms, small = rng.choice([78, 114, 132]), rng.random() < 0.3
        cfg = im.rows_plan(m, n, k, sms, small)
        assert cfg["kernel"] == "rows" and cfg["tw"] in im.ROWS_TILES_PER_WARP
        assert cfg["mb"] in (2, 4, 8) and 8 * cfg["mb"] >= min(m, im.MMA_MAX_M) and 8 * cfg["mb"] < 2 * max(m, 16), (m, cfg)
        s_ = cfg["splits"]
        assert s_ & (s_ - 1) == 0 and s_ <= 16
        assert s_ == 1 or im.cdiv(k, 64) // s_ >= im.ROWS_WINDOW * im.ROWS_MIN_WINDOWS_PER_SPLIT, (m, n, k, cfg)
    # a wide N fills the SMs with whole K ranges; a narrow N with a long K is split along K
    assert im.rows_plan(64, 28672, 4096, 132)["splits"] == 1
    assert im.rows_plan(64, 4096, 14336, 132)["splits"] >= 4
    # the record names the path multiply takes
    assert im.chosen_config(1, 4096, 4096, 128, 132)["kernel"] == "mma"
    assert im.chosen_config(33, 4096, 4096, 128, 132)["kernel"] == "rows"
    assert im.chosen_config(200, 4096, 4096, 128, 132) == {"kernel": "dequantized"}


@pytest.mark.parametrize("k,group,why", [(100, 32, "multiple of 8"), (256, 16, "powers of two"),
                                         (288, 48, "powers of two")])
def test_shapes_it_cannot_take_are_refused(k, group, why):
    qw = qz.Int4Weight(torch.zeros(4, im.cdiv(k, 8), dtype=torch.int32), torch.ones(im.cdiv(k, group), 4),
                       torch.zeros(im.cdiv(k, group), 4, dtype=torch.uint8), k, group)
    assert why in im.format_unsupported(qw)
    with pytest.raises(LabError, match=why):
        im.relayout(qw)


def test_quantized_linear_cuda_path_says_why_on_a_cpu():
    m = qz.QuantizedLinear(int4_weight(40, 128, 32), path="cuda")
    with pytest.raises(LabError, match="path 'cuda': the CUDA int4 kernel runs on a CUDA GPU"):
        m(torch.randn(2, 128).to(torch.bfloat16))
    m8 = qz.QuantizedLinear(qz.quantize_int8(torch.randn(8, 64)), path="cuda")
    with pytest.raises(LabError, match="int4 weights only"):
        m8(torch.randn(2, 64))


def test_engine_picks_its_int4_path_by_what_runs_here():
    from phases.phase5_inference.engine import EngineConfig, LLMEngine
    from phases.phase5_inference.engine.config import resolve_quant_path
    cpu = torch.device("cpu")
    auto = EngineConfig(model="tiny", device="cpu", dtype="float32", quantization="int4")
    assert resolve_quant_path(auto, cpu) in ("naive", "fused")
    assert resolve_quant_path(EngineConfig(model="tiny", quantization="int4", quant_path="library"), cpu) == "library"
    with pytest.raises(LabError, match="runs on a CUDA GPU"):
        LLMEngine(EngineConfig(model="tiny", device="cpu", dtype="bfloat16", quantization="int4", quant_path="cuda"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_kernel_builds_for_hopper_without_spills(tmp_path):
    from phases.phase2_cuda import build
    b = build.build(im.SOURCE, "sm_90", cache_dir=tmp_path)
    kernels = {name: res for name, res in b.resources.items() if "w4a16_mma" in name or "dequantize" in name}
    assert len(kernels) == 19, sorted(kernels)    # 4 batch widths x 2 group kinds x 2 streams, the batch-1 cp.async ring x 2, dequantize
    rows = {name: res for name, res in b.resources.items() if "w4a16_rows" in name}
    assert len(rows) == 12, sorted(rows)          # 3 row blocks x 2 group kinds x bf16 or fp16 scales
    kernels.update(rows)
    for name, res in kernels.items():
        assert res["spill_stores_bytes"] == 0 and res["spill_loads_bytes"] == 0, (name, res)


# ------------------------------------------------------------------------------ on a GPU
@pytest.mark.gpu
@pytest.mark.parametrize("n,k,group", [(4096, 4096, 128), (1000, 4096, 64), (6144, 4096, 32), (4096, 14336, 128),
                                       (1536, 1000, 128), (2048, 4096, 4096), (40, 96, 32)])
def test_kernel_matches_fp32_at_irregular_batches(n, k, group):
    dev = torch.device("cuda")
    qw = int4_weight(n, k, group, symmetric=group == 64, fp16=group == 32)
    qw = qw.to(dev)
    mw = im.relayout(qw)
    dense = qw.dequantize(torch.float32)
    for m in (1, 3, 17, 33, 64, 100):
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        ref = x.float() @ dense.t()
        streams = ["registers"] + (["bulk"] if im.bulk_copies(dev) else []) + (["async"] if m <= 8 else [])
        for stream in streams:
            cfg = dict(im.plan(m, n, k, im.sm_count(dev), bulk=stream == "bulk"), stream=stream)
            if stream == "async":
                cfg["mb"] = 1
            verdict = compare(im.matmul(x, mw, cfg), ref, "bf16", "fp32 x @ dequantize(W)^T")
            assert verdict["passed"], (m, stream, verdict)
        assert compare(im.multiply(x, mw), ref, "bf16", "fp32 x @ dequantize(W)^T")["passed"], m
        if m > 1:                           # the rows tiling at every M, its rule's splits and odd ones
            for splits in (None, 3):
                cfg = None if splits is None else dict(im.rows_plan(m, n, k, im.sm_count(dev)), splits=splits)
                verdict = compare(im.rows_matmul(x, mw, cfg), ref, "bf16", "fp32 x @ dequantize(W)^T")
                assert verdict["passed"], (m, "rows", splits, verdict)


@pytest.mark.gpu
def test_the_gpu_check_fails_a_wrong_weight():
    dev = torch.device("cuda")
    qw = int4_weight(4096, 4096, 128).to(dev)
    x = torch.randn(5, 4096, device=dev).to(torch.bfloat16)
    ref = x.float() @ qw.dequantize(torch.float32).t()
    mw = im.relayout(qw)
    assert compare(im.matmul(x, mw), ref, "bf16", "ref")["passed"]
    flipped = im.MmaInt4Weight(mw.wq ^ 0x0F0F0F0F, mw.meta, mw.out_features, mw.in_features, mw.group_size, False)
    assert not compare(im.matmul(x, flipped), ref, "bf16", "ref")["passed"]        # every other nibble wrong
    shifted = im.MmaInt4Weight(mw.wq, mw.meta.roll(1, 1), mw.out_features, mw.in_features, mw.group_size, False)
    assert not compare(im.matmul(x, shifted), ref, "bf16", "ref")["passed"]        # scales of the wrong group
    x33 = torch.randn(33, 4096, device=dev).to(torch.bfloat16)
    ref33 = x33.float() @ qw.dequantize(torch.float32).t()
    assert compare(im.rows_matmul(x33, mw), ref33, "bf16", "ref")["passed"]
    assert not compare(im.rows_matmul(x33, flipped), ref33, "bf16", "ref")["passed"]
    assert not compare(im.rows_matmul(x33, shifted), ref33, "bf16", "ref")["passed"]


@pytest.mark.gpu
def test_quantized_linear_cuda_path_and_graph_capture():
    dev = torch.device("cuda")
    lin = torch.nn.Linear(4096, 1024, bias=True, device=dev, dtype=torch.bfloat16)
    m = qz.QuantizedLinear.from_linear(lin, 4, group_size=128, path="cuda")
    x = torch.randn(3, 4096, device=dev, dtype=torch.bfloat16)
    ref = x.float() @ m.weight_format.dequantize().t() + lin.bias.float()
    y = m(x)
    assert compare(y, ref, "bf16", "ref")["passed"]
    graph, out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        out = m(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert compare(out, x.float() @ m.weight_format.dequantize().t() + lin.bias.float(), "bf16", "ref")["passed"]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1000, 1000)])
def test_fused_prologues_match_the_kernels_they_replace(n, k):
    """RMSNorm (with and without the residual add) and SiLU * up staged inside the kernel give the
    unfused kernels' bf16 row times W; the check fails a reference that leaves the prologue out."""
    from phases.phase5_inference.engine import fused_ops
    dev = torch.device("cuda")
    qw = int4_weight(n, k, 128).to(dev)
    mw = im.relayout(qw)
    dense = qw.dequantize(torch.float32)
    assert im.prologue_fits(1, mw, im.sm_count(dev))
    x, res = (torch.randn(1, k, device=dev).to(torch.bfloat16) for _ in range(2))
    gamma = (torch.rand(k, device=dev) + 0.5).to(torch.bfloat16)
    for residual in (None, res):
        h = x if residual is None else (x.float() + residual.float()).to(torch.bfloat16)
        normed = fused_ops.rms_norm_torch(h, gamma, 1e-5)
        y, new_residual = im.add_rms_norm_matmul(x, residual, gamma, 1e-5, mw)
        assert compare(y, normed.float() @ dense.t(), "bf16", "RMSNorm(x + r) @ W^T")["passed"]
        assert torch.equal(new_residual, h)
        assert not compare(y, h.float() @ dense.t(), "bf16", "no norm")["passed"]
    gate_up = torch.randn(1, 2 * k, device=dev).to(torch.bfloat16)
    y = im.silu_mul_matmul(gate_up, mw)
    assert compare(y, fused_ops.silu_and_mul_torch(gate_up).float() @ dense.t(), "bf16", "SiLU(g) * u @ W^T")["passed"]
    assert not compare(y, (gate_up[:, :k].float() * gate_up[:, k:].float()) @ dense.t(), "bf16", "no SiLU")["passed"]
    with pytest.raises(LabError, match="one row"):
        im.silu_mul_matmul(torch.randn(2, 2 * k, device=dev).to(torch.bfloat16), mw)


@pytest.mark.gpu
def test_dependent_launches_read_the_previous_kernels_output():
    """A chain of kernels each reading the one before (PDL on Hopper: each is launched while the one
    before runs, and waits on it before its activations), eagerly and replayed from a CUDA graph,
    including a K split whose counters the next call reuses."""
    dev = torch.device("cuda")
    a = im.relayout(int4_weight(1024, 16384, 128, seed=1).to(dev))          # K split across blocks
    b = im.relayout(int4_weight(16384, 1024, 128, seed=2).to(dev))
    assert im.plan(1, 1024, 16384, im.sm_count(dev))["splits"] > 1
    dense = {id(a): im.dequantize_relaid(a).to(dev), id(b): im.dequantize_relaid(b).to(dev)}
    x = torch.randn(1, 16384, device=dev).to(torch.bfloat16)

    def chain(x0):
        outs, h = [], x0
        for w in (a, b, a, b, a, b):
            h = im.matmul(h, w)
            outs.append(h)
        return outs
    for outs in (chain(x),):
        h = x
        for w, out in zip((a, b) * 3, outs):
            assert compare(out, h.float() @ dense[id(w)].t(), "bf16", "x @ W^T")["passed"]
            h = out
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    h = x
    for w, out in zip((a, b) * 3, outs):
        assert compare(out, h.float() @ dense[id(w)].t(), "bf16", "x @ W^T (graph)")["passed"]
        h = out


@pytest.mark.gpu
def test_the_engine_ops_fuse_into_the_int4_projection():
    """fused_ops.add_rms_norm_linear takes the fused kernel for one row through a CUDA int4
    QuantizedLinear and gives what the unfused ops give (two rows stay unfused); silu_and_mul_linear
    (not fused for int4) still gives the unfused result."""
    from phases.phase5_inference.engine import fused_ops
    dev = torch.device("cuda")
    lin = torch.nn.Linear(4096, 2 * 4096, bias=False, device=dev, dtype=torch.bfloat16)
    q = qz.QuantizedLinear.from_linear(lin, 4, group_size=128, path="cuda")
    down = qz.QuantizedLinear.from_linear(torch.nn.Linear(4096, 4096, bias=False, device=dev, dtype=torch.bfloat16),
                                          4, group_size=128, path="cuda")
    gamma = (torch.rand(4096, device=dev) + 0.5).to(torch.bfloat16)
    x, res = (torch.randn(1, 4096, device=dev).to(torch.bfloat16) for _ in range(2))
    assert q.fuses_input(x) and not q.fuses_input(torch.cat([x, x]))
    y, new_res = fused_ops.add_rms_norm_linear(x, res.clone(), gamma, 1e-5, q)
    unfused_res = res.clone()
    ref = q(fused_ops.add_rms_norm(x, unfused_res, gamma, 1e-5))
    assert compare(y, ref.float(), "bf16", "unfused")["passed"] and torch.equal(new_res, unfused_res)
    z = fused_ops.silu_and_mul_linear(y, down)
    assert compare(z, down(fused_ops.silu_and_mul(y)).float(), "bf16", "unfused")["passed"]


def test_ring_sweep_script_refuses_bad_input_in_one_line():
    """scripts/int4_ring_sweep.py: a depth the ring cannot take, an unknown shape set, a split that is
    not a number: exit 2 with one line naming it, before any GPU work; no GPU: exit 2 saying so."""
    import subprocess
    import sys

    from conftest import REPO, clean_env
    script = [sys.executable, str(REPO / "scripts" / "int4_ring_sweep.py")]
    for args, says in ((["--depths", "6"], "--depths"), (["--shapes", "8b,nope"], "'nope'"),
                       (["--splits", "x"], "--splits"), (["--splits", "0"], "--splits")):
        run = subprocess.run(script + args, capture_output=True, text=True, env=clean_env(), timeout=120)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], run.stderr
    if not torch.cuda.is_available():
        run = subprocess.run(script, capture_output=True, text=True, env=clean_env(), timeout=120)
        assert run.returncode == 2 and run.stderr.strip() == "error: int4_ring_sweep needs a CUDA GPU; none is visible"
