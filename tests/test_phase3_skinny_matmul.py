"""The tall-skinny Triton matmul (issue 37, skinny_matmul.py): B read in place by masked loads,
never copied, split-K by a rule of (M, N, K, SM count), partial sums added in a fixed order.

The rule and the exercise's predictions run here; the kernels run again in a child pytest under
Triton's interpreter (TRITON_INTERPRET=1), checked against float64 with the precision's
tolerance at irregular M (1, 3, 17, 33, 64), odd N and K, fp16 and bf16, aligned and unaligned
rows, strided operands. The split-K reduction is checked for its order (the output is the fp32
partial sums added s = 0, 1, ... bit for bit) and determinism, and a variant that drops the last
K run is shown to fail the same check. Triton 3.9's interpreter multiplies bf16 tiles as raw
uint16 bits in tl.dot (a 16 x 16 dot is off by 1e10), so the bf16 cases run with that one
operation mended (bf16 widened to fp32 first, as the tensor cores do); loads, masks, stores and
the kernel's own code are the interpreter's. Speed is the GPU's to show (see the module).
"""
import pytest
import torch
from conftest import INTERPRETED, in_child, in_parent, kernels_pass_in_an_interpreter_child, needs_triton

LAB_SKINNY = [(8, 4097, 14336), (13, 14335, 4096), (32, 5003, 8192), (64, 8191, 4104)]   # bench_matmul_shapes


@in_parent
@needs_triton
def test_skinny_kernels_under_the_interpreter():
    kernels_pass_in_an_interpreter_child("tests/test_phase3_skinny_matmul.py", timeout_s=800)


# ------------------------------------------------------------------------------ the rule (no kernel runs)
@pytest.mark.parametrize("sms", [132, 114, 78])
@in_parent
def test_rule_picks_the_skinny_kernel_with_no_padding_and_full_waves(sms):
    """At M <= 64 with B's rows unaligned the plain kernel's config is the skinny kernel's (with them
    aligned, the plain kernel's own: it reads B in place already). The skinny config: one tile row,
    no padding copy, the mask-free pipelined loop exactly when B's rows are 16-byte aligned, and a
    split whose programs fill at least 80% of the slots of the waves they take while the partial
    sums stay within 30% of B's bytes."""
    from phases.phase3_triton import matmul as mm
    from phases.phase3_triton import skinny_matmul as sk
    shapes = LAB_SKINNY + [(1, 4096, 4096), (3, 4099, 4101), (17, 4096, 11008), (33, 11008, 4096), (64, 8192, 8192)]
    for m, n, k in shapes:
        picked = mm.config_for(m, n, k, 2, sms)
        assert (picked.get("kernel") == "skinny") == (n % 8 != 0), (m, n, k, picked)
        cfg = sk.skinny_config(m, n, k, 2, sms)
        assert cfg["kernel"] == "skinny" and not mm.copies_operands(cfg, tma=False), cfg
        assert cfg["BLOCK_M"] >= m and cfg["BLOCK_M"] == max(16, 1 << (m - 1).bit_length())
        assert cfg["mask_free_main"] == (n % 8 == 0)
        tiles, k_tiles, split = -(-n // cfg["BLOCK_N"]), -(-k // cfg["BLOCK_K"]), cfg["SPLIT_K"]
        assert split == 1 or (k_tiles // split >= sk.MIN_K_TILES_PER_SPLIT
                              and -(-k_tiles // -(-k_tiles // split)) == split), (m, n, k, cfg)   # no empty run
        slots = sms * sk.streams_per_sm(cfg["mask_free_main"], cfg["BLOCK_M"])
        units = tiles * split
        assert units / (-(-units // slots) * slots) >= 0.80, (m, n, k, cfg)
        assert mm.split_k_bytes(m, n, split) <= 0.3 * 2 * k * n, (m, n, k, cfg)
        if n % 8:
            assert cfg == picked and mm.candidates(m, n, k, 2, sms)[0] == cfg
    assert mm.config_for(65, 4097, 4096, 2, sms).get("kernel") != "skinny"        # above 64: the tiled kernels
    assert "kernel" not in mm.config_for(8, 4097, 14336, 2, sms, tma=True)      # TMA keeps its own path


@in_parent
def test_split_rule_weighs_idle_slots_against_partial_sums():
    """The split is the least split_cost_bytes: B's stream stretched by idle slots, plus 8 bytes
    per element of C per split. A product whose N tiles already fill the GPU is not split; one
    whose tiles fill a fraction of it is; a K too short for two k-tiles a run is not split."""
    from phases.phase3_triton import skinny_matmul as sk
    assert sk.skinny_config(16, 128 * 132 * 2, 4096, 2, 132)["SPLIT_K"] == 1     # 264 tiles: two full waves
    assert sk.skinny_config(16, 4096, 16384, 2, 132)["SPLIT_K"] > 1              # 32 tiles for 132 SMs
    assert sk.skinny_config(16, 4096, 200, 2, 132)["SPLIT_K"] == 1               # 2 k-tiles of 128
    cost = sk.split_cost_bytes
    assert cost(8, 4096, 4096, 2, 128, 1, 132, 1) == 132 * 4096 * 128 * 2       # 32 programs, one wave of 132
    assert cost(8, 4096, 4096, 2, 128, 4, 132, 1) == 132 * 1024 * 128 * 2 + 8 * 4 * 8 * 4096
    for m, n, k in LAB_SKINNY:                                   # each split beats none by the model's own count
        c = sk.skinny_config(m, n, k, 2, 132)
        streams = sk.streams_per_sm(c["mask_free_main"], c["BLOCK_M"])
        assert c["SPLIT_K"] > 1
        bn = c["BLOCK_N"]
        assert cost(m, n, k, 2, bn, c["SPLIT_K"], 132, streams) < 0.6 * cost(m, n, k, 2, bn, 1, 132, streams)


@in_parent
def test_predictions_count_the_bytes_it_moves_and_no_padding():
    """The exercise's Work rows: a tall-skinny `triton` row moves A, B and C once plus its partial
    sums (written and read back), in one launch (the last split sums them); two for the rule's
    second-kernel neighbour; triton_tma still pays its padding copy."""
    from phases.phase3_triton import counts
    from phases.phase3_triton import matmul as mm
    unaligned = [(m, n, k) for m, n, k in LAB_SKINNY + [(64, 8192, 8191), (5, 1001, 8192)] if n % 8]
    text = ",".join(f"{m}x{n}x{k}" for m, n, k in unaligned)
    p = mm.EXERCISE.resolve_params(False, False, {"sizes": [256], "dtypes": ["bf16"], "shapes": text})
    rows = {w.label: w for w in mm.work(p)}
    for m, n, k in unaligned:
        label = mm.shape_label(m, n, k)
        cfg = mm.config_for(m, n, k, 2, mm.NOMINAL_SMS)
        problem = (m * k + k * n + m * n) * 2
        split = cfg["SPLIT_K"]
        plain = rows[f"triton bf16 {label}"]
        assert plain.bytes == problem + (8 * split * m * n if split > 1 else 0), label
        assert plain.launches == 1 and cfg["fixup"]             # a split is summed in the kernel
        assert rows[f"cublas bf16 {label}"].bytes == problem
        tma = rows[f"triton_tma bf16 {label}"]
        pad = mm.padding_cost(m, n, k, 2)
        assert tma.bytes >= problem + pad[0] and tma.launches >= 1 + pad[1]
        assert mm.launches({**cfg, "fixup": False}) == (2 if split > 1 else 1)
        assert counts.row_count("phase3.matmul", "triton", {"m": m, "n": n, "k": k, "dtype": "bf16"}).bytes == problem


@in_parent
@needs_triton
def test_in_kernel_sum_compiles_to_the_release_acquire_pattern_for_sm90():
    """What the GPU will run, read from the PTX (no GPU needed): the count is one acq_rel atomic at
    GPU scope with a barrier before it (every thread's partial stored first), the partials are
    read back through L2 (ld.global.cg), and the counter is reset by an atomic exchange."""
    import re

    from common.triton_shim import compile_only
    from phases.phase3_triton import skinny_matmul as sk
    from phases.phase3_triton.split_k_sum import tile_counters
    m, n, k = 13, 4097, 14336
    a, b = torch.empty(m, k, dtype=torch.bfloat16), torch.empty(k, n, dtype=torch.bfloat16)
    c = torch.empty(m, n, dtype=torch.bfloat16)
    cfg = sk.skinny_config(m, n, k, 2, 132)
    with compile_only(90) as cc:
        sk.launch_skinny(a, b, c, torch.empty(1), cfg, tile_counters(torch.device("cpu"), 64))
    ptx = cc.built[0][1].asm["ptx"]
    count = re.search(r"@%p\d+ atom\.global\.gpu\.acq_rel\.add", ptx)      # one thread counts, predicated
    assert count and "bar.sync" in ptx[:count.start()]
    after = ptx[count.end():]
    assert "bar.sync" in after[:after.index("ld.global.cg")]                # all threads wait for the count
    assert re.search(r"atom\.global\.gpu\.[a-z_]+\.exch", after)


# ------------------------------------------------------------------------------ child-only tests
if INTERPRETED:
    import numpy as np
    import triton.language as tl
    from interpreter_helpers import check, interpreter_seed  # noqa: F401 (autouse: skip or seed)
    from triton.runtime import interpreter as interp

    from phases.phase3_triton import matmul as mm
    from phases.phase3_triton import skinny_matmul as sk
    from phases.phase3_triton.split_k_sum import partial_sums, sum_splits

    @pytest.fixture
    def bf16_dot_mended(monkeypatch):
        """tl.dot of bf16 tiles with the operands widened to fp32 first (the interpreter's own
        create_dot multiplies bf16's raw uint16 storage)."""
        original = interp.InterpreterBuilder.create_dot

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            def widened(x):
                if x.dtype.scalar == tl.bfloat16:
                    data = interp._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
                    return interp.TensorHandle(data, tl.float32)
                return x
            return original(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)
        monkeypatch.setattr(interp.InterpreterBuilder, "create_dot", create_dot)

    DTYPES = [(torch.float16, "fp16"), (torch.bfloat16, "bf16")]

    def operands(m, n, k, dtype):
        return torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)

    @pytest.mark.parametrize("dtype, precision", DTYPES, ids=["fp16", "bf16"])
    @pytest.mark.parametrize("m", [1, 3, 17, 33, 64])
    @in_child
    def test_skinny_kernel_at_irregular_m_with_odd_n_and_k(m, dtype, precision, bf16_dot_mended):
        """The rule's config on a 4-SM GPU at odd N and K (unaligned rows: one masked loop) and at
        aligned N with odd K (mask-free loop, masked edge column and K tail); B is never copied."""
        from phases.phase3_triton import skinny_matmul as sk
        for n, k in ((131, 517), (256, 300)):
            a, b = operands(m, n, k, dtype)
            c = torch.empty(m, n, dtype=dtype)
            # the plain kernel's rule takes it for unaligned B only; the aligned loop is still checked
            picked = mm.config_for(m, n, k, a.element_size(), 4)
            assert (picked.get("kernel") == "skinny") == (n % 8 != 0), picked
            cfg = picked if n % 8 else sk.skinny_config(m, n, k, a.element_size(), 4)
            assert cfg["kernel"] == "skinny" and cfg["mask_free_main"] == (n % 8 == 0)
            v = check(c, lambda: mm.matmul(a, b, c, cfg), a.double() @ b.double(), mm.REFERENCE, precision)
            assert v["passed"], (m, n, k, cfg, v)

    @pytest.mark.parametrize("dtype, precision", DTYPES, ids=["fp16", "bf16"])
    @in_child
    def test_every_candidate_at_a_lab_like_shape_and_no_padding_copy(dtype, precision, bf16_dot_mended, monkeypatch):
        """13 x 1037 x 1100 (odd N and K): every candidate the tuner may pick is correct, and the
        call never reaches the padding copy."""
        def no_copy(t):
            raise AssertionError("skinny path copied an operand")
        monkeypatch.setattr(mm, "padded_for_tma", no_copy)
        m, n, k = 13, 1037, 1100
        a, b = operands(m, n, k, dtype)
        c = torch.empty(m, n, dtype=dtype)
        ref = a.double() @ b.double()
        cands = mm.candidates(m, n, k, a.element_size(), 4)
        assert len(cands) >= 3 and any(cf["SPLIT_K"] > 1 for cf in cands)
        for cfg in cands:
            v = check(c, lambda cfg=cfg: mm.matmul(a, b, c, cfg), ref, mm.REFERENCE, precision)
            assert v["passed"], (cfg, v)

    @in_child
    def test_skinny_kernel_takes_strided_operands_and_a_strided_output():
        a = torch.randn(150, 17).half().t()                       # 17 x 150, column-major
        b = torch.randn(150, 300).half()[:, 5:136]                # 150 x 131 inside 300-wide rows
        c_buf = torch.full((17, 140), 7.0).half()
        c = c_buf[:, 4:135]
        cfg = {**sk.skinny_config(17, 131, 150, 2, 4), "SPLIT_K": 3}
        v = check(c, lambda: mm.matmul(a, b, c, cfg), a.double() @ b.double(), mm.REFERENCE, "fp16")
        assert v["passed"], v
        assert (c_buf[:, :4] == 7).all() and (c_buf[:, 135:] == 7).all()   # nothing written outside C

    @pytest.mark.parametrize("aligned", [False, True])
    @in_child
    def test_split_k_sum_is_the_ordered_sum_of_the_runs_and_the_same_bits_every_time(aligned):
        """out == fp32 (part[0] + part[1] + ...) cast, bit for bit; each part is its K run's product
        (checked against float64); a second call gives the same bits."""
        m, n, k = 5, (128 if aligned else 133), 1000
        a, b = operands(m, n, k, torch.float16)
        cfg = {**sk.skinny_config(m, n, k, 2, 4), "SPLIT_K": 4}
        bk = cfg["BLOCK_K"]
        parts = partial_sums(m, n, 4, a.device)
        out = torch.empty(m, n, dtype=torch.float16)
        sk.launch_skinny(a, b, out, parts, cfg)
        sum_splits(parts, out, 4)
        ordered = torch.zeros(m, n)
        for s in range(4):
            ordered = ordered + parts[s]
        assert torch.equal(out, ordered.half())
        per = -(-(-(-k // bk)) // 4) * bk                         # k-tiles per run, in elements
        for s in range(4):
            lo, hi = min(s * per, k), min((s + 1) * per, k)
            ref = a[:, lo:hi].double() @ b[lo:hi].double()
            assert torch.allclose(parts[s].double(), ref, rtol=1e-3, atol=1e-3), s
        again = sk.skinny_matmul(a, b, torch.empty_like(out), cfg)
        assert torch.equal(again, out)

    @pytest.mark.parametrize("aligned", [False, True])
    @in_child
    def test_in_kernel_sum_gives_the_second_kernels_bits_and_resets_its_counters(aligned):
        """The last split's ordered sum (one launch) and sum_splits' (two) add the same partials in
        the same order: the same bits; every counter is 0 again after the call."""
        from phases.phase3_triton.split_k_sum import tile_counters
        m, n, k = 17, (256 if aligned else 261), 1000
        a, b = operands(m, n, k, torch.float16)
        cfg = {**sk.skinny_config(m, n, k, 2, 4), "SPLIT_K": 4}
        assert cfg["fixup"] and sk.launches(cfg) == 1
        one = sk.skinny_matmul(a, b, torch.empty(m, n, dtype=torch.float16), cfg)
        two = sk.skinny_matmul(a, b, torch.empty(m, n, dtype=torch.float16), {**cfg, "fixup": False})
        assert torch.equal(one, two)
        assert not tile_counters(a.device, 1).any()
        c = torch.empty(m, n, dtype=torch.float16)
        assert check(c, lambda: sk.skinny_matmul(a, b, c, cfg), a.double() @ b.double(), mm.REFERENCE, "fp16")["passed"]

    @in_child
    def test_checker_rejects_a_sum_that_drops_a_k_run():
        """The same gate the exercise times behind: passes with every run, fails when the sum
        leaves out the last run of K."""
        m, n, k = 17, 131, 517
        a, b = operands(m, n, k, torch.float16)
        c = torch.empty(m, n, dtype=torch.float16)
        cfg = {**sk.skinny_config(m, n, k, 2, 4), "BLOCK_N": 128, "BLOCK_K": 32, "SPLIT_K": 4}
        assert 3 * -(-(-(-k // 32)) // 4) * 32 < k                  # the last run holds part of K
        ref = a.double() @ b.double()

        def run(runs_summed):
            parts = partial_sums(m, n, 4, a.device)
            sk.launch_skinny(a, b, c, parts, cfg)
            sum_splits(parts, c, runs_summed)
        assert check(c, lambda: run(4), ref, mm.REFERENCE, "fp16")["passed"]
        assert not check(c, lambda: run(3), ref, mm.REFERENCE, "fp16")["passed"]

    @in_child
    def test_skinny_refuses_an_m_its_tile_cannot_hold():
        a, b = operands(40, 64, 64, torch.float16)
        with pytest.raises(ValueError, match="BLOCK_M = 32"):
            sk.skinny_matmul(a, b, torch.empty(40, 64, dtype=torch.float16), {**sk.skinny_config(20, 64, 64, 2, 4)})

    @in_child
    def test_exercise_row_runs_skinny_with_no_padding(spec_ctx):
        res = mm.run(spec_ctx(), {"sizes": [], "dtypes": ["fp16"], "shapes": "13x77x129"})
        rows = {r["variant"]: r for r in res.rows}
        assert all(r["status"] == "ok" for r in res.rows), [(r["variant"], r["reason"]) for r in res.rows]
        plain = rows["triton"]["metrics"]
        assert "kernel=skinny" in plain["config"] and plain["padding_bytes"] == 0 and plain["padded_operands"] is None
