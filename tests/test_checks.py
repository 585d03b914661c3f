"""common/checks.py: the checker itself is tested. A wrong kernel must fail it."""
import pytest
import torch

from common.checks import REL_TOLERANCE, compare, exact, poison


@pytest.fixture
def mm():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(96, 80, generator=g)
    b = torch.randn(80, 72, generator=g)                 # irregular shapes, not powers of two
    return a, b, a.double() @ b.double()


def test_correct_fp32_matmul_passes(mm):
    a, b, ref = mm
    v = compare(a @ b, ref, "fp32", "float64 matmul")
    assert v["passed"] is True and v["reason"] is None
    assert v["rel_l2_error"] < REL_TOLERANCE["fp32"]
    assert v["tolerance"] == REL_TOLERANCE["fp32"] and v["metric"] == "rel_l2"
    assert v["reference"] == "float64 matmul" and v["precision"] == "fp32"


def test_all_zeros_output_fails(mm):
    a, b, ref = mm
    v = compare(torch.zeros(96, 72), ref, "fp32", "ref")
    assert v["passed"] is False
    assert v["rel_l2_error"] == pytest.approx(1.0)
    assert "relative error" in v["reason"]


def test_output_left_poisoned_in_part_fails(mm):
    a, b, ref = mm
    out = poison(torch.empty(96, 72))
    out[:50] = (a @ b)[:50]                              # a kernel that wrote only some rows
    v = compare(out, ref, "fp32", "ref")
    assert v["passed"] is False
    assert "NaN" in v["reason"] and str(46 * 72) in v["reason"]


@pytest.mark.parametrize("shortcut", [torch.bfloat16, torch.float16])
def test_low_precision_shortcut_fails_fp32(mm, shortcut):
    a, b, ref = mm
    cheat = (a.to(shortcut) @ b.to(shortcut)).float()     # "fp32" matmul computed in 16 bits
    v = compare(cheat, ref, "fp32", "ref")
    assert v["passed"] is False
    assert v["rel_l2_error"] > REL_TOLERANCE["fp32"]
    # ...while the same output is fine at the precision it really used
    assert compare(cheat, ref, "bf16", "ref")["passed"] is True


def test_tf32_like_rounding_fails_fp32(mm):
    a, b, ref = mm

    def tf32(x):                                        # keep 10 mantissa bits, like TF32 inputs
        return (x.view(torch.int32) & ~0x1FFF).view(torch.float32)

    v = compare(tf32(a) @ tf32(b), ref, "fp32", "ref")
    assert v["passed"] is False
    assert compare(tf32(a) @ tf32(b), ref, "tf32", "ref")["passed"] is True


@pytest.mark.parametrize("rel, passed", [(1e-4, False), (6e-5, False), (1e-5, True)])
def test_small_relative_offset_against_tolerance(mm, rel, passed):
    a, b, ref = mm
    out = (ref * (1 + rel)).float()
    assert compare(out, ref, "fp32", "ref")["passed"] is passed


def test_shape_mismatch_fails(mm):
    a, b, ref = mm
    v = compare((a @ b).T.contiguous(), ref, "fp32", "ref")
    assert v["passed"] is False and "shape" in v["reason"]


@pytest.mark.parametrize("make_out", [
    lambda a, b, ref: a @ b,
    lambda a, b, ref: torch.zeros_like(a @ b),
    lambda a, b, ref: (a.bfloat16() @ b.bfloat16()).float(),
    lambda a, b, ref: (a @ b).index_fill_(0, torch.tensor([3]), float("nan")),
])
def test_chunked_callable_reference_same_verdict(mm, make_out):
    a, b, ref = mm
    out = make_out(a, b, ref)
    flat = ref.reshape(-1)
    seen = []

    def ref_fn(s, e):
        seen.append((s, e))
        return flat[s:e]

    whole = compare(out, ref, "fp32", "ref")
    chunked = compare(out, ref_fn, "fp32", "ref", chunk=1000, expected_shape=ref.shape)
    assert chunked["passed"] == whole["passed"]
    if whole["rel_l2_error"] is not None:
        assert chunked["rel_l2_error"] == pytest.approx(whole["rel_l2_error"], rel=1e-9)
    assert chunked["reason"] == whole["reason"]
    assert len(seen) == -(-out.numel() // 1000)            # really chunked
    assert seen[-1][1] == out.numel()


def test_elementwise_product_with_callable_reference():
    a, b = torch.rand(10_001) + 0.5, torch.rand(10_001) + 0.5
    c = poison(torch.empty_like(a))
    torch.mul(a, b, out=c)
    assert compare(c, lambda s, e: a[s:e].double() * b[s:e].double(), "fp32", "x", chunk=4096,
                   expected_shape=a.shape)["passed"]


def test_exact():
    src = torch.arange(1000, dtype=torch.int32)
    assert exact(src.clone(), src, "src")["passed"] is True
    off = src.clone()
    off[517] += 1
    v = exact(off, src, "src")
    assert v["passed"] is False and v["reason"]
    assert exact(src[:999].clone(), src, "src")["passed"] is False
    f = torch.rand(100)
    g = f.clone()
    g[0] = torch.nextafter(g[0], torch.tensor(2.0))        # one ulp
    assert exact(g, f, "src")["passed"] is False


def test_poison():
    assert torch.isnan(poison(torch.zeros(10))).all()
    assert (poison(torch.zeros(10, dtype=torch.int32)) == -123456789).all()
    assert (poison(torch.zeros(10, dtype=torch.uint8)) == 255).all()


# ------------------------------------------------------------------------------ regressions (bugs found and fixed)
def test_empty_output_fails_against_callable_reference():
    ref = lambda s, e: torch.ones(e - s, dtype=torch.float64)  # noqa: E731
    assert compare(torch.empty(0), ref, "fp32", "ones", expected_shape=(10,))["passed"] is False
    assert compare(torch.ones(7), ref, "fp32", "ones", expected_shape=(10,))["passed"] is False


def test_callable_reference_without_expected_shape_is_a_programming_error():
    with pytest.raises(ValueError):
        compare(torch.ones(3), lambda s, e: torch.ones(e - s), "fp32", "ones")


def test_reference_with_inf_does_not_pass_a_zero_output():
    ref = torch.ones(10, dtype=torch.float64)
    ref[3] = float("inf")
    assert compare(torch.zeros(10), ref, "fp32", "ref")["passed"] is False


@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0)])
def test_an_output_that_holds_nothing_never_passes(shape):
    """An empty output against an empty reference: nothing was compared, so nothing passed."""
    out, ref = torch.empty(shape), torch.empty(shape)
    verdict = compare(out, ref, "fp32", "empty reference")
    assert not verdict["passed"] and "no elements" in verdict["reason"]
    verdict = exact(out, ref, "empty reference")
    assert not verdict["passed"] and "no elements" in verdict["reason"]
