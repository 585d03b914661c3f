"""Phase 3 on a real GPU (marked gpu: `pytest -m gpu tests/test_phase3_gpu.py`): every candidate
config of every kernel, compiled for this GPU and checked at real sizes with the same checker the
exercises use, then `lab run 3 --quick` end to end. On the H200 this takes a few minutes, most of
it compiling."""
import importlib.util
import math

import pytest
import torch

from common.checks import TORCH_DTYPES

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")]

if torch.cuda.is_available():
    from common.exercise import Context, reference_check
    from phases.phase3_triton import flash_attention as fa
    from phases.phase3_triton import flash_attention_bwd as fab
    from phases.phase3_triton import matmul as mm
    from phases.phase3_triton import softmax as sm
    from phases.phase3_triton import vector_add as va
    from common.triton_tuner import label

DEV = "cuda"


def check(out, fill, ref, reference, precision=None) -> dict:
    """The exercises' own gate: poison `out`, run `fill`, synchronize, compare (bit-exact without a precision)."""
    return reference_check(Context(torch.device(DEV), None, "gpu"), out, fill, ref, reference, precision)()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("n", [98432, 2**24 + 3])
def test_vector_add_every_config(n):
    x, y = torch.randn(n, device=DEV), torch.randn(n, device=DEV)
    out, ref = torch.empty_like(x), x + y
    for cfg in va.CONFIGS:
        v = check(out, lambda c=cfg: va.add(x, y, out, c), ref, va.REFERENCE)
        assert v["passed"], (label(cfg), v)


@pytest.mark.parametrize("m, n", [(1024, 2048), (1000, 1537), (1024, 16384), (256, 32768), (256, 65536), (77, 70001)])
def test_softmax_every_candidate(m, n):
    x = torch.randn(m, n, device=DEV) * 4
    ref, out = sm.reference(x), torch.empty_like(x)
    refused = []
    for cfg in sm.candidates(n):
        try:
            v = check(out, lambda c=cfg: sm.softmax(x, out, c), ref, sm.REFERENCE, "fp32")
        except ValueError as exc:           # a cooperative config this Triton build makes too big to co-reside
            assert "an SM holds only" in str(exc), exc
            refused.append(label(cfg))
            continue
        assert v["passed"], (label(cfg), v)
    assert len(refused) < len(sm.candidates(n)), refused


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_matmul_every_config(dtype):
    t = TORCH_DTYPES[dtype]
    a, b = torch.randn(2048, 2048, device=DEV).to(t), torch.randn(2048, 2048, device=DEV).to(t)
    ref = a.double() @ b.double()
    c = torch.empty(2048, 2048, device=DEV, dtype=t)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    for impl, tma in ((mm.matmul, False), (mm.matmul_tma, True)):
        for cfg in mm.candidates(2048, 2048, 2048, 2, sms, tma=tma):
            v = check(c, lambda k=cfg, impl=impl: impl(a, b, c, k), ref, mm.REFERENCE, dtype)
            assert v["passed"], (impl.__name__, label(cfg), v)


MATMUL_GPU_SHAPES = [(1000, 777, 1537), (4001, 4103, 4104), (8, 4096, 14336), (13, 14336, 4096), (32, 5003, 4104),
                     (64, 8191, 8192), (1, 4096, 4096), (333, 65, 20000)]


@pytest.mark.parametrize("shape", MATMUL_GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matmul_irregular_and_skinny_shapes_on_gpu(shape):
    """Every candidate the rule gives (split-K ones included) at shapes no tile fits, tall-skinny
    ones and a few-tile long-K one; triton_tma at every one (padded copies where rows are not 16-byte multiples)."""
    m, n, k = shape
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    a, b = torch.randn(m, k, device=DEV).bfloat16(), torch.randn(k, n, device=DEV).bfloat16()
    c = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
    ref = a.double() @ b.double()
    for impl, tma in ((mm.matmul, False), (mm.matmul_tma, True)):
        for cfg in mm.candidates(m, n, k, 2, sms, tma=tma):
            v = check(c, lambda q=cfg, impl=impl: impl(a, b, c, q), ref, mm.REFERENCE, "bf16")
            assert v["passed"], (impl.__name__, label(cfg), v)
    assert mm.matmul(a, b).equal(mm.matmul(a, b))             # split-K sums in a fixed order


@pytest.mark.parametrize("shape", [(13, 14335, 4096), (64, 8191, 4104), (16, 4096, 14336), (3, 4099, 4101)],
                         ids=lambda s: "x".join(map(str, s)))
def test_skinny_in_kernel_sum_is_the_second_kernels_sum_on_gpu(shape):
    """The tall-skinny kernel's in-kernel split sum (the tile's last run adds the partials, an
    atomic counting arrivals) against the two-kernel form: the same bits on every one of 20
    calls (a missed release/acquire would show as a stale partial, i.e. differing bits), the
    counters all 0 afterwards, and the answer checked against float64."""
    from phases.phase3_triton import skinny_matmul as sk
    from phases.phase3_triton.split_k_sum import tile_counters
    m, n, k = shape
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    a, b = torch.randn(m, k, device=DEV).bfloat16(), torch.randn(k, n, device=DEV).bfloat16()
    cfg = {**sk.skinny_config(m, n, k, 2, sms), "SPLIT_K": max(2, sk.skinny_config(m, n, k, 2, sms)["SPLIT_K"])}
    assert cfg["fixup"]
    c = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
    v = check(c, lambda: sk.skinny_matmul(a, b, c, cfg), a.double() @ b.double(), mm.REFERENCE, "bf16")
    assert v["passed"], (label(cfg), v)
    two = sk.skinny_matmul(a, b, torch.empty_like(c), {**cfg, "fixup": False})
    assert torch.equal(c, two)
    outs = [sk.skinny_matmul(a, b, torch.empty_like(c), cfg) for _ in range(20)]
    torch.cuda.synchronize()
    assert all(torch.equal(o, two) for o in outs)
    assert not tile_counters(a.device, 1).any()


def test_matmul_padded_paths_take_any_layout_on_gpu():
    """The hardware's own TMA demands (16-byte rows and base) met by the padding copies: a
    transposed A, a B sliced out of wider rows at an odd offset, a C inside wider rows (pointer
    store, nothing written outside it), bf16 and fp16; and the skinny split-K product (the plain
    kernel's skinny_matmul, B unpadded; triton_tma's padded) is bit-identical run to run."""
    for dtype, precision in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        a = torch.randn(1537, 1001, device=DEV).to(dtype).t()             # 1001 x 1537, column-major
        b = torch.randn(1537, 3000, device=DEV).to(dtype)[:, 1:2050]       # odd offset: base not 16-byte aligned
        c_buf = torch.full((1001, 2100), 7.0, device=DEV, dtype=dtype)
        c = c_buf[:, 3:2052]
        ref = a.double() @ b.double()
        for impl in (mm.matmul, mm.matmul_tma):
            v = check(c, lambda impl=impl: impl(a, b, c), ref, mm.REFERENCE, precision)
            assert v["passed"], (impl.__name__, v)
            assert (c_buf[:, :3] == 7).all() and (c_buf[:, 2052:] == 7).all()
    a, b = torch.randn(13, 4099, device=DEV).bfloat16(), torch.randn(4099, 14335, device=DEV).bfloat16()
    for impl in (mm.matmul, mm.matmul_tma):
        assert impl(a, b).equal(impl(a, b))


@pytest.mark.parametrize("dtype, d", [(torch.bfloat16, 128), (torch.bfloat16, 64), (torch.float16, 128),
                                      (torch.float32, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_forward_every_candidate(dtype, d, causal):
    n = 4096 if dtype != torch.float32 else 1024
    b, h = 2, 1024 // d
    q, k, v = (torch.randn(b, h, n, d, device=DEV).to(dtype) for _ in range(3))
    heads = fa.check_heads(b, h)
    ref = fa.reference_forward(q, k, v, causal, 1 / math.sqrt(d), heads)
    for cfg in fa.forward_candidates(dtype, d, causal, n=n):
        verdict = fa.check_forward(lambda o, c=cfg: fa.attention_forward(q, k, v, causal, None, c, out=o),
                                   q, k, v, causal, 1 / math.sqrt(d), fa.PRECISION[dtype], ref=ref, heads=heads)
        assert verdict["passed"], (label(cfg), verdict)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_forward_ragged_length(causal):
    q, k, v = (torch.randn(1, 4, 1000, 128, device=DEV).bfloat16() for _ in range(3))
    for cfg in fa.forward_candidates(torch.bfloat16, 128, causal, n=1000):
        verdict = fa.check_forward(lambda o, c=cfg: fa.attention_forward(q, k, v, causal, None, c, out=o),
                                   q, k, v, causal, 1 / math.sqrt(128), "bf16")
        assert verdict["passed"], (label(cfg), verdict)


@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [2048, 1000])
def test_attention_backward_every_candidate(d, causal, n):
    b, h = 1, 512 // d
    q, k, v, do = (torch.randn(b, h, n, d, device=DEV).bfloat16() for _ in range(4))
    scale = 1 / math.sqrt(d)
    heads = fa.check_heads(b, h)
    ref = fab.reference_grads(q, k, v, do, causal, scale, heads)
    o, lse = fa.attention_forward(q, k, v, causal, scale)
    for dkdv, dq in zip(fa.dkdv_candidates(d), fa.dq_candidates(d)):
        cfg = {"dkdv": dkdv, "dq": dq}
        verdict = fab.check_grads(lambda gq, gk, gv, c=cfg: fa.attention_backward(q, k, v, o, lse, do, causal, scale, c,
                                                                                  grads=(gq, gk, gv)),
                                  q, ref, heads, "bf16")
        assert verdict["passed"], (cfg, verdict)


def test_lab_run_3_quick_on_the_gpu(lab, tmp_path):
    from common.records import load_records
    rc, out, err = lab("run", "3", "--quick", "--results", tmp_path)
    records = load_records(tmp_path)
    assert rc == 0, out + err
    assert sorted(r["exercise"]["id"] for r in records) == sorted(
        ["phase3.vector_add", "phase3.softmax", "phase3.matmul", "phase3.flash_attention", "phase3.flash_attention_bwd"])
    for rec in records:
        assert rec["status"] == "ok", (rec["exercise"]["id"], rec["reason"])
        for r in rec["rows"]:
            assert r["status"] in ("ok", "skipped"), (rec["exercise"]["id"], r["variant"], r["reason"])
            if r["status"] == "ok":
                assert r["prediction"]["measured_over_predicted"] and r["check"]["passed"]
        tri = [r for r in rec["rows"] if r["variant"].startswith("triton") and r["status"] == "ok"]
        assert tri and all("pct_of_library" in r["metrics"] for r in tri), rec["exercise"]["id"]
