"""The HLO fusion counter (phases/phase6_hardware/hlo.py): on hand-written HLO whose answer is known
(a score matrix inside one fusion, the same matrix left between kernels, a loop body, a library
call), and on what JAX's CPU backend really compiles (an elementwise chain fused into one kernel; a
matmul, tanh, matmul chain left as three; attention's scores in device memory)."""
import pytest

from phases.phase6_hardware import hlo

B, H, S, D = 2, 4, 96, 16

FUSED = """HloModule fused_attention

%fused_attention (p0: bf16[2,4,96,16], p1: bf16[2,4,96,16], p2: bf16[2,4,96,16]) -> bf16[2,4,96,16] {
  %p0 = bf16[2,4,96,16]{3,2,1,0} parameter(0)
  %p1 = bf16[2,4,96,16]{3,2,1,0} parameter(1)
  %p2 = bf16[2,4,96,16]{3,2,1,0} parameter(2)
  %s = f32[2,4,96,96]{3,2,1,0} dot(%p0, %p1), lhs_contracting_dims={3}, rhs_contracting_dims={3}
  %e = f32[2,4,96,96]{3,2,1,0} exponential(%s)
  %c = bf16[2,4,96,96]{3,2,1,0} convert(%e)
  ROOT %o = bf16[2,4,96,16]{3,2,1,0} dot(%c, %p2), lhs_contracting_dims={3}, rhs_contracting_dims={2}
}

ENTRY %main (q: bf16[2,4,96,16], k: bf16[2,4,96,16], v: bf16[2,4,96,16]) -> bf16[2,4,96,16] {
  %q = bf16[2,4,96,16]{3,2,1,0} parameter(0)
  %k = bf16[2,4,96,16]{3,2,1,0} parameter(1)
  %v = bf16[2,4,96,16]{3,2,1,0} parameter(2)
  ROOT %fusion = bf16[2,4,96,16]{3,2,1,0} fusion(%q, %k, %v), kind=kCustom, calls=%fused_attention, backend_config={"fusion_backend_config":{"kind":"__triton"}}
}
"""

UNFUSED = """HloModule unfused_attention

%region_max (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %m = f32[] maximum(%a, %b)
}

%fused_softmax (p0: f32[8,96,96]) -> bf16[8,96,96] {
  %p0 = f32[8,96,96]{2,1,0} parameter(0)
  ROOT %c = bf16[8,96,96]{2,1,0} convert(%p0)
}

ENTRY %main (q: bf16[8,96,16], k: bf16[8,96,16], v: bf16[8,96,16]) -> bf16[8,96,16] {
  %q = bf16[8,96,16]{2,1,0} parameter(0)
  %k = bf16[8,96,16]{2,1,0} parameter(1)
  %v = bf16[8,96,16]{2,1,0} parameter(2)
  %gemm = (f32[8,96,96]{2,1,0}, s8[4194304]{0}) custom-call(%q, %k), custom_call_target="__cublas$lt$matmul"
  %scores = f32[8,96,96]{2,1,0} get-tuple-element(%gemm), index=0
  %init = f32[] constant(-inf)
  %max = f32[8,96]{1,0} reduce(%scores, %init), dimensions={2}, to_apply=%region_max
  %probs = bf16[8,96,96]{2,1,0} fusion(%scores), kind=kLoop, calls=%fused_softmax
  %gemm.1 = (bf16[8,96,16]{2,1,0}, s8[4194304]{0}) custom-call(%probs, %v), custom_call_target="__cublas$lt$matmul"
  ROOT %out = bf16[8,96,16]{2,1,0} get-tuple-element(%gemm.1), index=0
}
"""

LOOP = """HloModule per_head_loop

%body (t: (s32[], bf16[96,16])) -> (s32[], bf16[96,16]) {
  %t = (s32[], bf16[96,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = bf16[96,16]{1,0} get-tuple-element(%t), index=1
  %s = f32[96,96]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %y = bf16[96,16]{1,0} slice(%x), slice={[0:96], [0:16]}
  ROOT %r = (s32[], bf16[96,16]{1,0}) tuple(%next, %y)
}

%cond (t: (s32[], bf16[96,16])) -> pred[] {
  %t = (s32[], bf16[96,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(8)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: bf16[96,16]) -> (s32[], bf16[96,16]) {
  %x = bf16[96,16]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %t = (s32[], bf16[96,16]{1,0}) tuple(%zero, %x)
  ROOT %w = (s32[], bf16[96,16]{1,0}) while(%t), condition=%cond, body=%body
}
"""


def test_one_fusion_keeps_the_scores_on_chip():
    report = hlo.attention_report(FUSED, B, H, S, temp_bytes=0)
    assert (report["fusions"], report["custom_calls"], report["kernels"]) == (1, 0, 1)
    assert report["fusion_kinds"] == {"kCustom __triton": 1}
    assert report["score_materialized"] is False and report["largest_score_buffer_bytes"] == 0


def test_scores_between_library_calls_are_materialized():
    report = hlo.attention_report(UNFUSED, 2, 4, S, temp_bytes=2 * 8 * S * S * 4)
    assert report["custom_call_targets"] == {"__cublas$lt$matmul": 2} and report["fusions"] == 1
    assert report["kernels"] == 4 and report["unfused_ops"] == {"reduce": 1}      # the reduce runs; its max function does not
    assert report["score_materialized"] is True
    assert report["largest_score_buffer"] == "custom-call f32[8,96,96]"
    assert report["largest_score_buffer_bytes"] == 8 * S * S * 4
    assert report["temp_over_bf16_scores"] == pytest.approx(4.0)


def test_a_loop_body_runs_and_its_buffers_count():
    found = hlo.analyze(LOOP)
    assert found.unfused_ops == {"dot": 1, "add": 1, "slice": 1, "compare": 1}
    assert hlo.score_buffers(found, 1, 8, S)                    # a per-head 96 x 96 score, once per iteration


def test_a_flattened_score_matrix_is_found_too():
    text = UNFUSED.replace("f32[8,96,96]", "f32[768,96]").replace("bf16[8,96,96]", "bf16[768,96]")
    assert hlo.attention_report(text, 2, 4, S, None)["score_materialized"] is True
    assert hlo.attention_report(text, 2, 4, 97, None)["score_materialized"] is False     # another S: not scores


# ------------------------------------------------------------------------------ what JAX really compiles
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


def test_jax_fuses_an_elementwise_chain_into_one_kernel():
    x = jnp.arange(1000, dtype=jnp.float32)
    compiled, text, temp = hlo.compiled(lambda a: jnp.exp(a) * 2.0 + 1.0, x)
    found = hlo.analyze(text)
    assert (found.fusions, found.kernels, found.custom_calls) == (1, 1, 0), found.as_dict()
    assert float(compiled(x)[1]) == pytest.approx(2 * 2.718281828 + 1, rel=1e-5)


def test_jax_leaves_matmul_tanh_matmul_as_three_kernels():
    m = jnp.ones((64, 64), jnp.float32)
    _, text, _ = hlo.compiled(lambda a, b, c: jnp.tanh(a @ b) @ c, m, m, m)
    found = hlo.analyze(text)
    assert found.kernels == 3, found.as_dict()
    assert len([b for b in found.buffers if b[3] == (64, 64)]) == 3        # two intermediates and the result


def test_plain_attention_on_the_cpu_materializes_its_scores():
    from phases.phase6_hardware.jax_attention import plain_math
    q = jnp.ones((B, H, S, D), jnp.bfloat16)
    _, text, temp = hlo.compiled(plain_math, q, q, q)
    report = hlo.attention_report(text, B, H, S, temp)
    assert report["score_materialized"] is True and report["largest_score_buffer_bytes"] >= B * H * S * S * 2
    assert report["kernels"] >= 3
