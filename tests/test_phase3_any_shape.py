"""Phase 3's softmax and flash attention at shapes nobody tuned for (issue 37), checked on a CPU
through Triton's interpreter: odd lengths (N = 1, 33, 77, 130), causal and not, head dims 16 to
128 with several tile shapes (the masked diagonal, the ragged tail, a tail shorter than a tile), the softmax's multi-program row
path forced at small widths with an odd number of parts, and the configs' rules.

Like test_phase3_interpreter.py, the kernel tests run in a child pytest with TRITON_INTERPRET=1
set before Triton is imported; the rule tests run in this process. Each kernel also meets a
wrong twin (one interpreted launch of the split kernel, a forward that drops the ragged tail,
both backward schemes with the causal mask dropped) that the same checker must reject.
"""
import math
import subprocess
import sys

import pytest
from conftest import clean_env, in_child, in_parent, INTERPRETED, kernels_pass_in_an_interpreter_child, needs_triton, REPO


@in_parent
@needs_triton
def test_any_shape_kernels_under_the_interpreter():
    kernels_pass_in_an_interpreter_child("tests/test_phase3_any_shape.py", timeout_s=800)


# ------------------------------------------------------------------------------ the rules (no kernel runs)
@in_parent
def test_softmax_rule_holds_rows_in_registers_then_splits_them():
    from phases.phase3_triton import softmax as sm
    for sms in (132, 114):
        for n in (64, 100, 1537, 4096, 20000, 32768):
            c = sm.plan(2**27 // n, n, sms)
            assert c["kind"] == "rows" and c["BLOCK_N"] >= n and c["ROWS"] * c["BLOCK_N"] >= 4096, (n, c)
            assert c["ROWS"] * c["BLOCK_N"] // (32 * c["num_warps"]) <= 32          # values per thread
        for n in (32769, 50000, 65536, 100000, 262144, 500_000):
            c = sm.plan(max(1, 2**27 // n), n, sms)
            assert c["kind"] == "split", (n, c)
            assert (c["SPLIT"] - 1) * c["CHUNK"] < n <= c["SPLIT"] * c["CHUNK"]          # no empty part
            assert c["SPLIT"] <= sms * c["programs_per_sm"]                           # a row's parts fit at once
        assert sm.plan(8, 30000, sms)["kind"] == "split"          # too few rows to fill the GPU: split them too
        assert sm.plan(1, 2**26, sms)["kind"] == "online"          # wider than every part could hold
    assert sm.plan(512, 262144, 132)["SPLIT"] == 64 and sm.plan(1342, 100000, 132)["SPLIT"] == 25
    assert sm.plan(4095, 32769, 132)["CHUNK"] == 2048              # 17 parts of 2048, not 9 of 4096 (one column in the last)
    for n in (8192, 100000, 262144):                               # the exercise tunes around the rule's pick
        assert sm.candidates(n, 2**27 // n, 132)[0] == sm.plan(2**27 // n, n, 132)


@in_parent
def test_softmax_unaligned_short_rows_get_one_warp_per_program():
    """Rows not on 16-byte boundaries load one element a lane, so a warp spans 32 columns: the
    rule gives such rows (up to 512 wide) one-warp programs holding whole rows; aligned rows of
    the same width keep the vectorized multi-warp tile."""
    from phases.phase3_triton import softmax as sm
    for n in (1, 33, 63, 101, 333, 511):
        c = sm.plan(2**27 // n, n, 132)
        assert c["kind"] == "rows" and c["num_warps"] == 1, (n, c)
        assert c["ROWS"] * c["BLOCK_N"] == 32 * sm.VALUES_PER_THREAD or c["ROWS"] == 1, (n, c)
    assert sm.plan(2**27 // 100, 100, 132)["num_warps"] == 8          # 100 columns: 16-byte rows
    assert sm.plan(2**27 // 100, 100, 132, vec=1)["num_warps"] == 1   # the same width in a misaligned view
    assert sm.plan(2**27 // 1537, 1537, 132)["num_warps"] > 1         # long rows: several warps, as measured (95%)
    assert sm.plan(2**27 // 100, 100, 132, elem_bytes=2)["num_warps"] == 1   # bf16: 200 bytes, not 16-byte rows
    assert sm.plan(2**27 // 104, 104, 132, elem_bytes=2)["num_warps"] == 8


@in_parent
def test_softmax_vector_width_follows_width_strides_and_start():
    import torch

    from phases.phase3_triton import softmax as sm
    e = torch.empty
    assert [sm.vector_elems(e(3, n)) for n in (100, 101, 102, 128)] == [4, 1, 2, 4]
    assert sm.vector_elems(e(3, 101)[:, 1:]) == 1           # 100 wide, but rows 101 apart
    assert sm.vector_elems(e(3, 104)[:, 4:]) == 4           # 100 wide, 104 apart, starting 16 bytes in
    assert sm.vector_elems(e(3, 104)[:, 2:102]) == 2        # starting 8 bytes in
    assert sm.vector_elems(e(3, 100), e(3, 104)[:, :100]) == 4 and sm.vector_elems(e(3, 100), e(3, 102)[:, :100]) == 2
    assert [sm.contiguous_vector_elems(n) for n in (100, 101, 102, 32769)] == [4, 1, 2, 1]
    assert sm.vector_elems(e(3, 104, dtype=torch.bfloat16)) == 8 and sm.vector_elems(e(3, 100, dtype=torch.bfloat16)) == 4


@in_parent
def test_attention_rule_follows_head_dim_length_and_gpu():
    import torch

    from phases.phase3_triton import flash_attention as fa
    h100 = {"sms": 132, "smem_bytes": 227 * 1024}
    for d in (64, 128):
        for causal in (False, True):
            for n in (77, 1000, 1537, 4096, 7000, 16384):
                c = fa.forward_config(torch.bfloat16, d, causal, n, 16384 // n * (2048 // d), **h100)
                assert c["BLOCK_M"] % c["BLOCK_N"] == 0 and not c["ws"]
                assert fa.forward_smem_bytes(c, d, 2) <= h100["smem_bytes"], c
                b = fa.backward_config(d, causal, n, 16384 // n * (2048 // d), **h100)
                assert b["dkdv"]["BLOCK_N"] % b["dkdv"]["BLOCK_M"] == 0
                assert b["dq"]["BLOCK_M"] % b["dq"]["BLOCK_N"] == 0
    long = fa.forward_config(torch.bfloat16, 128, False, 16384, 16, **h100)
    short = fa.forward_config(torch.bfloat16, 128, False, 1000, 16 * 16, **h100)
    assert long["BLOCK_N"] == 128 and short["BLOCK_N"] == 64          # a short key loop: the smaller tile
    few = fa.forward_config(torch.bfloat16, 128, False, 1000, 2, **h100)
    assert few["BLOCK_M"] == 64                                        # 16 programs of 128 rows: too few for 132 SMs
    small_smem = fa.forward_config(torch.bfloat16, 128, False, 16384, 16, sms=132, smem_bytes=100 * 1024)
    assert fa.forward_smem_bytes(small_smem, 128, 2) <= 100 * 1024    # fewer stages or a smaller tile where shared memory is small
    cpu = torch.device("cpu")                                          # off a GPU: a 50 MiB L2
    assert fa.heads_per_group(256, 1024, 128, 2, True, cpu) == 50      # causal: LPT over heads whose K, V fit half the L2
    assert fa.heads_per_group(16, 16384, 128, 2, True, cpu) == 3
    assert fa.heads_per_group(2, 1000, 64, 2, True, cpu) == 2 and fa.heads_per_group(16, 10**6, 128, 2, True, cpu) == 1
    assert fa.heads_per_group(256, 1024, 128, 2, False, cpu) == 1     # equal tiles: head-major order
    cands = fa.forward_candidates(torch.bfloat16, 128, True, n=7000, batch_heads=32, sms=132)
    assert cands[0] == fa.forward_config(torch.bfloat16, 128, True, 7000, 32, sms=132)
    assert len(cands) == len({fa.label(c) for c in cands})


# ------------------------------------------------------------------------------ the exercises' own shapes
@in_parent
def test_user_shapes_replace_the_sweeps_and_bad_ones_are_refused():
    from common.params import ParamError
    from phases.phase3_triton import flash_attention as fa
    from phases.phase3_triton import flash_attention_bwd as fab
    from phases.phase3_triton import softmax as sm
    p = sm.EXERCISE.resolve_params(False, False, {"shapes": [[1000, 100000], [3, 262144]]})
    assert sm.shapes(p) == [(1000, 100000, "user"), (3, 262144, "user")]
    assert [w.label for w in sm.work(p)][:2] == ["copy user 1000x100000", "torch user 1000x100000"]
    p = fa.EXERCISE.resolve_params(False, False, {"shapes": [[2, 16, 1537, 128]], "causal": [True], "dtypes": ["bf16"]})
    probs = fa.problems(p)
    assert [(x["batch"], x["heads"], x["n"], x["head_dim"], x["causal"], x["group"]) for x in probs] == \
        [(2, 16, 1537, 128, True, "user")]
    assert [v for v in fa.variants_of(probs[0])] == [*fa.SDPA_BACKENDS, "triton"]     # no naive fp32 case
    p = fab.EXERCISE.resolve_params(False, False, {"shapes": [[1, 8, 7000, 64]]})
    assert [(x["batch"], x["heads"], x["n"], x["head_dim"]) for x in fab.problems(p)] == [(1, 8, 7000, 64)] * 2
    for ex, bad in ((fa.EXERCISE, {"shapes": [[2, 16, 1537, 96]]}), (fa.EXERCISE, {"shapes": [[2, 16, 1537]]}),
                    (fab.EXERCISE, {"shapes": [[0, 16, 1537, 64]]}), (sm.EXERCISE, {"shapes": [[10]]}),
                    (sm.EXERCISE, {"shapes": [[10, 2**31]]})):
        with pytest.raises(ParamError) as err:
            ex.resolve_params(False, False, bad)
        assert "--param shapes=" in str(err.value) and "\n" not in str(err.value)


@in_parent
def test_lab_run_refuses_a_bad_shape_with_one_line_and_exit_2(lab, tmp_path):
    rc, out, err = lab("run", "phase3.flash_attention", "--param", "shapes=[[2,16,1537,96]]", "--results", tmp_path)
    assert rc == 2 and "shapes" in (out + err) and "Traceback" not in (out + err), out + err
    rc, out, err = lab("run", "phase3.softmax", "--param", "shapes=[[10,0]]", "--results", tmp_path)
    assert rc == 2 and "shapes" in (out + err) and "Traceback" not in (out + err), out + err


@in_parent
def test_bench_shapes_without_a_gpu_says_so_in_one_line_and_exits_2():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the script would run")
    proc = subprocess.run([sys.executable, "-m", "phases.phase3_triton.bench_shapes"], cwd=REPO, capture_output=True,
                          text=True, env=clean_env(PYTHONWARNINGS="ignore"), timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "CUDA" in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------ child-only tests
if INTERPRETED:
    import torch

    from interpreter_helpers import check, interpreter_seed  # noqa: F401 (autouse: skip or seed)
    from phases.phase3_triton import flash_attention as fa
    from phases.phase3_triton import flash_attention_bwd as fab
    from phases.phase3_triton import softmax as sm

    # -------------------------------------------------------------------------- softmax, split rows
    @pytest.mark.parametrize("rows, cols, chunk", [(7, 300, 64), (9, 1000, 128), (13, 77, 16), (3, 4096, 512),
                                                   (1, 33, 16), (5, 2100, 512), (2, 32769, 2048)])
    @in_child
    def test_softmax_split_path_with_an_odd_number_of_parts(rows, cols, chunk):
        """ceil(cols / chunk) parts: 5, 8, 5, 8, 3, 5 and 17 of them, the last part ragged (but at
        4096; at 32769 the 17th part holds one column)."""
        x = torch.randn(rows, cols) * 4
        cfg = sm.split_config(cols, chunk, 1)
        assert cfg["SPLIT"] > 1
        out = torch.empty_like(x)
        v = check(out, lambda: sm.softmax(x, out, cfg), sm.reference(x), sm.REFERENCE, "fp32")
        assert v["passed"], (cfg, v)

    @in_child
    def test_softmax_split_path_checker_rejects_a_launch_whose_parts_never_meet():
        """One interpreted launch: the first parts of each row combine before the later ones have
        published (zeroed words), so their columns are wrong, and the checker must say so."""
        x = torch.randn(7, 300) * 4
        cfg = sm.split_config(300, 64, 1)
        out = torch.empty_like(x)
        ref = sm.reference(x)
        bad = check(out, lambda: sm.split_softmax(x, out, cfg, launches=1), ref, sm.REFERENCE, "fp32")
        good = check(out, lambda: sm.split_softmax(x, out, cfg), ref, sm.REFERENCE, "fp32")
        assert good["passed"] and not bad["passed"], (good, bad)

    @in_child
    def test_softmax_split_path_refuses_a_chunking_that_does_not_cover_the_row():
        x = torch.randn(2, 300)
        with pytest.raises(ValueError, match="SPLIT = ceil"):
            sm.softmax(x, torch.empty_like(x), {**sm.split_config(300, 64, 1), "SPLIT": 4})
        with pytest.raises(ValueError, match="SPLIT = ceil"):
            sm.softmax(x, torch.empty_like(x), {**sm.split_config(300, 64, 1), "SPLIT": 6})

    @in_child
    def test_softmax_checker_rejects_rows_claimed_aligned_that_are_not():
        """The rows kernel told its 101-column rows are in 4-element vectors (VEC=4 with the width
        and stride divided by 4, as the wrapper does for 100): it then treats them as 100 wide, and
        the checker must reject that; the wrapper's own VEC (1 here) passes."""
        x = torch.randn(7, 101) * 4
        out = torch.empty_like(x)
        ref = sm.reference(x)
        assert sm.vector_elems(x, out) == 1

        def launch(vec):
            sm.softmax_kernel[(2,)](x, out, 7, 101 // vec, 101 // vec, 101 // vec, 2, ROWS=4, BLOCK_N=128, STAGES=1,
                                    VEC=vec, WIDE=False)
        good = check(out, lambda: launch(1), ref, sm.REFERENCE, "fp32")
        bad = check(out, lambda: launch(4), ref, sm.REFERENCE, "fp32")
        assert good["passed"] and not bad["passed"], (good, bad)

    @pytest.mark.parametrize("rows, cols", [(3, 1), (5, 63), (5, 64), (3, 100), (6, 101), (2, 333), (2, 1537),
                                            (4, 5000), (2, 32769)])
    @in_child
    def test_softmax_default_rule_at_odd_widths(rows, cols):
        x = torch.randn(rows, cols) * 4
        out = torch.empty_like(x)
        v = check(out, lambda: sm.softmax(x, out), sm.reference(x), sm.REFERENCE, "fp32")
        assert v["passed"], v

    @in_child
    def test_softmax_exercise_runs_a_users_shapes(spec_ctx):
        res = sm.run(spec_ctx(), {"shapes": [[6, 333]], "seed_shape": [1, 1], "cols": [1], "total_elements": 1})
        assert all(r["status"] == "ok" for r in res.rows), [(r["variant"], r["reason"]) for r in res.rows]
        assert {r["params"]["cols"] for r in res.rows} == {333}
        ours = next(r for r in res.rows if r["variant"] == "triton")
        assert ours["metrics"]["rule_config"] == sm.label(sm.plan(6, 333, 4))

    # -------------------------------------------------------------------------- attention forward
    def _qkv(b, h, n, d, dtype=torch.float16, count=3):
        return tuple(torch.randn(b, h, n, d).to(dtype) for _ in range(count))

    FWD_CFGS = [fa._fwd(32, 16, 4, 1, False), fa._fwd(32, 32, 4, 1, True), fa._fwd(16, 16, 4, 1, False)]

    @pytest.mark.parametrize("n, d", [(77, 16), (130, 32), (1, 16), (33, 64), (130, 64), (77, 128)])
    @pytest.mark.parametrize("causal", [False, True])
    @in_child
    def test_attention_forward_at_odd_lengths(n, d, causal):
        q, k, v = _qkv(1, 2, n, d)
        heads = fa.check_heads(1, 2)
        ref = fa.reference_forward(q, k, v, causal, 1 / math.sqrt(d), heads)
        lse_ref = fa.reference_lse(q, k, causal, 1 / math.sqrt(d), heads)
        for cfg in FWD_CFGS:
            verdict = fa.check_forward(lambda o, c=cfg: fa.attention_forward(q, k, v, causal, None, c, out=o),
                                       q, k, v, causal, 1 / math.sqrt(d), "fp16", ref=ref, heads=heads)
            assert verdict["passed"], (cfg, verdict)
            _, lse = fa.attention_forward(q, k, v, causal, None, cfg)
            assert fa.check_lse(lse, lse_ref, heads)["passed"], cfg

    @in_child
    def test_attention_forward_checker_rejects_a_forward_that_drops_the_ragged_tail():
        """Computed as if N were 64 (the 13 tail keys never seen, the tail rows never written)."""
        q, k, v = _qkv(1, 1, 77, 16)
        heads = fa.check_heads(1, 1)

        def short(o):
            o64, _ = fa.attention_forward(q[:, :, :64].contiguous(), k[:, :, :64].contiguous(),
                                          v[:, :, :64].contiguous(), False, None, FWD_CFGS[0])
            o[:, :, :64] = o64
        verdict = fa.check_forward(short, q, k, v, False, 0.25, "fp16", heads=heads)
        assert not verdict["passed"]

    # -------------------------------------------------------------------------- attention backward
    BWD_CFGS = [fa._bwd(16, 32, 4, 1, 32, 16, 4, 1), fa._bwd(32, 32, 4, 1, 32, 32, 4, 1),
                {"atomic": fa._part(16, 32, 4, 1)}, {"atomic": fa._part(32, 32, 4, 1)}]     # dQ by atomics

    @pytest.mark.parametrize("n, d", [(77, 16), (130, 32), (130, 64), (77, 128)])
    @pytest.mark.parametrize("causal", [False, True])
    @in_child
    def test_attention_backward_at_odd_lengths(n, d, causal):
        q, k, v, do = _qkv(1, 2, n, d, count=4)
        scale = 1 / math.sqrt(d)
        heads = fa.check_heads(1, 2)
        ref = fab.reference_grads(q, k, v, do, causal, scale, heads)
        o, lse = fa.attention_forward(q, k, v, causal, scale, FWD_CFGS[0])
        for cfg in BWD_CFGS:
            verdict = fab.check_grads(lambda dq, dk, dv, c=cfg: fa.attention_backward(
                q, k, v, o, lse, do, causal, scale, c, grads=(dq, dk, dv)), q, ref, heads, "fp16")
            assert verdict["passed"], (cfg, verdict)

    @in_child
    def test_attention_backward_checker_rejects_gradients_without_the_causal_mask_at_n_77():
        q, k, v, do = _qkv(1, 1, 77, 16, count=4)
        heads = fa.check_heads(1, 1)
        ref = fab.reference_grads(q, k, v, do, True, 0.25, heads)
        o, lse = fa.attention_forward(q, k, v, True, 0.25, FWD_CFGS[0])
        for cfg in (BWD_CFGS[0], BWD_CFGS[2]):          # both schemes, without the mask
            verdict = fab.check_grads(lambda dq, dk, dv, c=cfg: fa.attention_backward(
                q, k, v, o, lse, do, False, 0.25, c, grads=(dq, dk, dv)), q, ref, heads, "fp16")
            assert not verdict["passed"], cfg

    @in_child
    def test_attention_exercises_run_a_users_shapes(spec_ctx):
        res = fa.run(spec_ctx(), fa.EXERCISE.resolve_params(True, False, {"shapes": [[1, 2, 77, 32]], "causal": [True],
                                                                          "dtypes": ["fp16"]}))
        ours = [r for r in res.rows if r["variant"] == "triton"]
        assert [r["status"] for r in ours] == ["ok"] and ours[0]["params"]["n"] == 77, [r["reason"] for r in ours]
        assert not any(r["variant"] == "naive" for r in res.rows)
        res = fab.run(spec_ctx(), fab.EXERCISE.resolve_params(True, False, {"shapes": [[1, 2, 77, 32]], "causal": [False],
                                                                            "dtypes": ["fp16"]}))
        ours = [r for r in res.rows if r["variant"] == "triton"]
        assert [r["status"] for r in ours] == ["ok"] and ours[0]["params"]["n"] == 77, [r["reason"] for r in ours]

    # -------------------------------------------------------------------------- the benchmark script's rows
    @in_child
    def test_bench_shapes_rows_check_and_time_on_tiny_shapes():
        """bench_shapes.py's own code path, tiny: checked rows get a rate, SDPA (absent here) none."""
        from phases.phase3_triton import bench_shapes as bench
        cpu = torch.device("cpu")
        rows = bench.attention_rows(cpu, [77], [16], [True], tokens=77, model_dim=32, dtype=torch.float16)
        assert len(rows) == 1 and rows[0]["fwd_tflops"] > 0 and rows[0]["bwd_tflops"] > 0, rows
        assert rows[0]["bwd_atomic_tflops"] > 0 and not any(k.endswith("_failed") for k in rows[0]), rows
        soft = bench.softmax_rows(cpu, [100], elements=700)
        assert soft[0]["rows"] == 7 and soft[0]["pct_of_copy"] > 0 and "failed" not in soft[0], soft
        split = bench.softmax_rows(cpu, [8200], elements=16400)      # 2 rows of 8200 on the interpreter's 4 "SMs"
        assert "kind=split" in split[0]["config"] and "failed" not in split[0], split
        assert any("checks failed: 0" in ln for ln in bench.summary(rows, soft))

    @pytest.mark.parametrize("group", [1, 2, 3, 5])
    @in_child
    def test_attention_causal_tiles_in_groups_of_heads_cover_every_head(group):
        """query_tile's order (longest tiles first across a group of heads) with a ragged last
        group: 5 heads in groups of 2 or 3; every head's every tile written, forward and dQ."""
        q, k, v, do = _qkv(1, 5, 70, 16, count=4)
        heads = fa.check_heads(1, 5)
        assert len(heads) == 2 and heads[1] == (0, 4)
        heads = [(0, i) for i in range(5)]
        verdict = fa.check_forward(lambda o: fa.attention_forward(q, k, v, True, 0.25, FWD_CFGS[0], out=o, group_heads=group),
                                   q, k, v, True, 0.25, "fp16", heads=heads)
        assert verdict["passed"], verdict
        o, lse = fa.attention_forward(q, k, v, True, 0.25, FWD_CFGS[0], group_heads=group)
        ref = fab.reference_grads(q, k, v, do, True, 0.25, heads)
        verdict = fab.check_grads(lambda dq, dk, dv: fa.attention_backward(q, k, v, o, lse, do, True, 0.25, BWD_CFGS[0],
                                                                           grads=(dq, dk, dv), group_heads=group),
                                  q, ref, heads, "fp16")
        assert verdict["passed"], verdict


def test_gradient_check_of_one_key_measures_rounding_against_the_cancelled_terms():
    # one key: P = 1, so dQ and dK are exactly zero (dP - delta cancels); a correct kernel leaves
    # rounding there, which no relative tolerance of zero accepts. Checked against the terms instead,
    # rounding passes and a wrong gradient still fails.
    import torch

    from phases.phase3_triton import flash_attention_bwd as fab
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 1, 32) for _ in range(4))
    heads = [(0, 0), (0, 1)]
    ref = fab.reference_grads(q, k, v, do, False, None, heads)
    assert float(ref["dq"].abs().max()) == 0.0 and float(ref["dq_terms"].abs().max()) > 0

    def writes(dq_of):
        def fill(dq, dk, dv):
            for i, (b, h) in enumerate(heads):
                dq[b, h] = dq_of(i)
                dk[b, h] = ref["dk"][i] + 1e-4 * ref["dk_terms"][i]
                dv[b, h] = ref["dv"][i]
        return fill
    rounded = fab.check_grads(writes(lambda i: 1e-4 * ref["dq_terms"][i]), q, ref, heads, "bf16")
    wrong = fab.check_grads(writes(lambda i: ref["dq_terms"][i]), q, ref, heads, "bf16")
    assert rounded["passed"], rounded
    assert not wrong["passed"], wrong
