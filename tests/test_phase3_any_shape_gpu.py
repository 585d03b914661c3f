"""Flash attention and softmax at irregular shapes on a real GPU (marked gpu:
`pytest -m gpu tests/test_phase3_any_shape_gpu.py`): the configs the rules pick, as a user who
passes none gets them, checked against float64 torch with the exercises' own checkers."""
import importlib.util
import math

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")]

if torch.cuda.is_available():
    from common.checks import compare
    from phases.phase3_triton import flash_attention as fa
    from phases.phase3_triton import flash_attention_bwd as fab
    from phases.phase3_triton import softmax as sm
    from common.triton_tuner import label

DEV = "cuda"
SHAPES = [(2, 8, 1000, 128), (1, 16, 1537, 64), (1, 4, 7000, 128), (3, 5, 77, 64), (1, 2, 1, 128), (1, 3, 130, 128)]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_forward_and_backward_rule_configs_at_irregular_shapes(shape, causal):
    b, h, n, d = shape
    q, k, v, do = (torch.randn(b, h, n, d, device=DEV).bfloat16() for _ in range(4))
    scale = 1 / math.sqrt(d)
    heads = fa.check_heads(b, h)
    verdict = fa.check_forward(lambda o: fa.attention_forward(q, k, v, causal, scale, out=o), q, k, v, causal, scale,
                               "bf16", heads=heads)
    assert verdict["passed"], (fa.label(fa.forward_config(q.dtype, d, causal, n, b * h, **fa.gpu_limits(q.device))),
                               verdict)
    o, lse = fa.attention_forward(q, k, v, causal, scale)
    assert fa.check_lse(lse, fa.reference_lse(q, k, causal, scale, heads), heads)["passed"]
    ref = fab.reference_grads(q, k, v, do, causal, scale, heads)
    verdict = fab.check_grads(lambda gq, gk, gv: fa.attention_backward(q, k, v, o, lse, do, causal, scale,
                                                                       grads=(gq, gk, gv)), q, ref, heads, "bf16")
    assert verdict["passed"], (fa.backward_config(d, causal, n, b * h, **fa.gpu_limits(q.device)), verdict)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_every_forward_candidate_at_n_1537(d, causal):
    b, h, n = 2, 1024 // d, 1537
    q, k, v = (torch.randn(b, h, n, d, device=DEV).bfloat16() for _ in range(3))
    heads = fa.check_heads(b, h)
    ref = fa.reference_forward(q, k, v, causal, 1 / math.sqrt(d), heads)
    for cfg in fa.forward_candidates(torch.bfloat16, d, causal, n=n, batch_heads=b * h, **fa.gpu_limits(q.device)):
        verdict = fa.check_forward(lambda o, c=cfg: fa.attention_forward(q, k, v, causal, None, c, out=o),
                                   q, k, v, causal, 1 / math.sqrt(d), "bf16", ref=ref, heads=heads)
        assert verdict["passed"], (label(cfg), verdict)


@pytest.mark.parametrize("m, n", [(3000, 64), (1000, 100), (1000, 101), (600, 333), (999, 1537), (64, 20000),
                                  (8, 30000), (40, 32769), (30, 50000), (21, 100000), (9, 100004), (5, 262144),
                                  (1, 262144), (2, 2**23)])
def test_softmax_rule_at_any_width(m, n):
    x = torch.randn(m, n, device=DEV) * 4
    out = torch.full_like(x, float("nan"))
    sm.softmax(x, out)
    torch.cuda.synchronize()
    v = compare(out, sm.reference(x), "fp32", sm.REFERENCE)
    assert v["passed"], (label(sm.plan(m, n, torch.cuda.get_device_properties(0).multi_processor_count)), v)


@pytest.mark.parametrize("width, start", [(100, 1), (100, 2), (100, 4), (40000, 1), (40000, 4)])
def test_softmax_rule_on_views_whose_rows_are_not_16_byte_aligned(width, start):
    """Columns [start, start + width) of a wider tensor: rows 16-byte aligned only when start and
    the stride are multiples of 4, so the kernels must load element-wise or in 8-byte vectors."""
    base = torch.randn(300, width + 8, device=DEV) * 4
    x = base[:, start:start + width]
    out = torch.full_like(base, float("nan"))[:, 2:2 + width]
    sm.softmax(x, out)
    torch.cuda.synchronize()
    v = compare(out, sm.reference(x), "fp32", sm.REFERENCE)
    assert v["passed"], (sm.vector_elems(x, out), v)


@pytest.mark.parametrize("m, n", [(77, 100000), (300, 40000)])
def test_softmax_every_split_candidate_at_odd_widths(m, n):
    x = torch.randn(m, n, device=DEV) * 4
    ref = sm.reference(x)
    ran = 0
    for cfg in (c for c in sm.candidates(n) if c["kind"] == "split"):
        out = torch.full_like(x, float("nan"))
        try:
            sm.softmax(x, out, cfg)
        except ValueError as exc:           # a config this build makes too big to co-reside: refused, never run
            assert "an SM holds only" in str(exc) or "do not fit" in str(exc), exc
            continue
        torch.cuda.synchronize()
        v = compare(out, ref, "fp32", sm.REFERENCE)
        assert v["passed"], (label(cfg), v)
        ran += 1
    assert ran


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1000, 2048])
def test_attention_backward_atomic_dq_every_candidate(d, causal, n):
    b, h = 1, 512 // d
    q, k, v, do = (torch.randn(b, h, n, d, device=DEV).bfloat16() for _ in range(4))
    scale = 1 / math.sqrt(d)
    heads = fa.check_heads(b, h)
    ref = fab.reference_grads(q, k, v, do, causal, scale, heads)
    o, lse = fa.attention_forward(q, k, v, causal, scale)
    for c in [*fa.atomic_candidates(d), fa.atomic_config(d, n, b * h)]:
        verdict = fab.check_grads(lambda gq, gk, gv, c=c: fa.attention_backward(
            q, k, v, o, lse, do, causal, scale, {"atomic": c}, grads=(gq, gk, gv)), q, ref, heads, "bf16")
        assert verdict["passed"], (c, verdict)
