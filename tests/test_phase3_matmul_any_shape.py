"""The Triton matmuls at shapes nobody tuned for (issue 37): rows that are not 16-byte aligned
(triton_tma pads them: tma_padding.py), tall-skinny products (M = 1 .. 64, split-K by rule), odd
M, N and K, checked on a CPU through Triton's interpreter against float64 with the precision's
tolerance; and the padding and split rules themselves, with no kernel run.

The interpreter runs the TMA descriptors (bounds and zero-fill included) but not the hardware's
alignment demands: those, and the speed, are test_phase3_gpu.py's (marked gpu). Nor bf16: Triton
3.9's interpreter gets tl.dot of bf16 tiles wrong (a bare 16 x 16 dot is off by 1e10), so the
interpreted cases are fp16 and fp32 and bf16 is checked on the GPU. Like
test_phase3_interpreter.py, the kernel tests run in a child pytest with TRITON_INTERPRET=1 set
before Triton is imported. Each path meets a wrong twin the same checker must reject: a
persistent kernel told a K rounded down to the tile (the K tail dropped) and a descriptor that
reads a padded operand's pad.
"""

import pytest
import torch
from conftest import in_child, in_parent, INTERPRETED, kernels_pass_in_an_interpreter_child, needs_triton


@in_parent
@needs_triton
def test_matmul_any_shape_kernels_under_the_interpreter():
    kernels_pass_in_an_interpreter_child("tests/test_phase3_matmul_any_shape.py", timeout_s=800)


# ------------------------------------------------------------------------------ the rules (no kernel runs)
@in_parent
def test_padding_copies_only_what_a_descriptor_cannot_read():
    from phases.phase3_triton.tma_padding import padded_for_tma, padded_pitch, tma_readable
    assert [padded_pitch(c, 2) for c in (1, 8, 4097, 5003)] == [8, 8, 4104, 5008]
    assert padded_pitch(77, 4) == 80 and padded_pitch(3, 1) == 16
    aligned = torch.randn(5, 24).half()
    assert tma_readable(aligned) and padded_for_tma(aligned) is aligned
    for t in (torch.randn(7, 13).half(), torch.randn(13, 7).half().t(), torch.randn(9, 40).half()[:, 3:20],
              torch.randn(6, 5)):
        p = padded_for_tma(t)
        assert not tma_readable(t) and tma_readable(p), t.stride()
        assert p.shape == t.shape and torch.equal(p, t) and p.stride(1) == 1
        assert (p.stride(0) * p.element_size()) % 16 == 0 and p.stride(0) - t.shape[1] < 16 // t.element_size()


@in_parent
def test_only_tiles_up_to_128_columns_shift_the_last_tile_column(monkeypatch):
    """matmul() asks the kernel for the shifted last column at BLOCK_N <= SHIFT_MAX_BLOCK_N only
    (shifted 128x256 tiles measured far slower than masked ones); the launch is recorded, not run."""
    from phases.phase3_triton import matmul as mm
    seen = {}

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.update(kwargs)
    monkeypatch.setattr(mm, "matmul_kernel", Recorder())
    monkeypatch.setattr(mm, "require", lambda *tensors: None)
    a, b = torch.randn(300, 96).half(), torch.randn(96, 1000).half()          # N: no multiple of 64
    for block_n, shifts in ((64, True), (128, True), (256, False)):
        mm.matmul(a, b, config=mm._cfg(128, block_n, 64, 8, 3))
        assert (seen["SHIFT_N"] > 0) == shifts and not seen["EVEN_N"], (block_n, seen)
    mm.matmul(a, b[:, :768], config=mm._cfg(128, 256, 64, 8, 3))
    assert seen["EVEN_N"] and seen["SHIFT_N"] == 0


@in_parent
def test_padding_bytes_and_launches_are_in_the_prediction():
    from phases.phase3_triton import matmul as mm
    assert mm.padding_cost(4096, 4096, 4096, 2) == (0, 0)
    assert mm.padding_cost(4001, 5003, 4104, 2) == (2 * 4104 * 5003 * 2, 1)          # B only: N odd
    assert mm.padding_cost(13, 14335, 4099, 2) == (2 * (13 * 4099 + 4099 * 14335) * 2, 2)
    p = mm.EXERCISE.resolve_params(False, False, {"sizes": [256], "dtypes": ["bf16"], "shapes": "8x4097x14336"})
    rows = {w.label: w for w in mm.work(p)}
    library = rows["cublas bf16 8x4097x14336"]
    w = rows["triton_tma bf16 8x4097x14336"]                  # triton_tma pads B (N odd)
    split = mm.config_for(8, 4097, 14336, 2, mm.NOMINAL_SMS, tma=True)["SPLIT_K"]
    assert w.bytes - library.bytes == 2 * 14336 * 4097 * 2 + mm.split_k_bytes(8, 4097, split)
    assert w.launches == 3                                    # copy, split-K matmul, sum
    plain = rows["triton bf16 8x4097x14336"]                  # tall-skinny: skinny_matmul reads B in place
    split = mm.config_for(8, 4097, 14336, 2, mm.NOMINAL_SMS)["SPLIT_K"]
    assert plain.bytes - library.bytes == mm.split_k_bytes(8, 4097, split) and plain.launches == 1   # summed in-kernel
    for variant in ("triton", "triton_tma"):
        assert rows[f"{variant} bf16 n=256"].bytes == rows["cublas bf16 n=256"].bytes
    assert all(c["pad_rows"] for c in mm.candidates(4001, 5003, 4104, 2, 132))   # unpadded, it spills (compile_check)
    assert not mm.copies_operands(mm.INTERPRETER_CONFIG, tma=False) and mm.copies_operands({}, tma=True)


@in_parent
def test_the_last_tile_column_shifts_only_where_every_row_of_b_holds_its_columns():
    """matmul_kernel's shifted last tile column reads up to N rounded up to 16 bytes, unmasked:
    only where B's rows are unit-stride, 16-byte pitched, at least that long (the last row inside
    the storage too) and the tile fits; else the masked edge loop."""
    from phases.phase3_triton import matmul as mm
    assert mm.shift_columns(torch.empty(9, 520).half(), 128) == (8, 520)        # contiguous, N % 8 == 0
    assert mm.shift_columns(torch.empty(9, 517).half(), 128) == (0, 517)        # 1,034-byte rows
    assert mm.shift_columns(mm.padded_for_tma(torch.empty(9, 517).half()), 128) == (8, 520)
    assert mm.shift_columns(torch.empty(9, 600).half()[:, :517], 128) == (8, 520)
    assert mm.shift_columns(torch.empty(9, 600).half()[:, 90:600], 128) == (0, 510)  # the last row ends at 600
    assert mm.shift_columns(torch.empty(520, 9).half().t(), 128) == (0, 520)    # column-major
    assert mm.shift_columns(torch.empty(9, 100).half(), 128) == (0, 100)        # narrower than a tile
    assert mm.shift_columns(torch.empty(9, 130), 128) == (0, 130)              # fp32: 520-byte rows
    assert mm.shift_columns(torch.empty(9, 132), 128) == (4, 132)


@pytest.mark.parametrize("sms", [132, 114, 78, 4])
@in_parent
def test_tall_skinny_split_fills_two_waves_with_the_fullest_last_wave(sms):
    """M <= 64: BLOCK_M the smallest power of two >= M (at least 16), and when the N-tiles are
    fewer than two waves of SMs, a split of K that reaches two waves (as far as K and the partial
    sums' traffic allow) and whose last wave leaves the fewest SMs idle."""
    from phases.phase3_triton import matmul as mm
    for m in (1, 3, 8, 13, 16, 33, 64):
        for n, k in ((4097, 14336), (14335, 4096), (5003, 8192), (8191, 4104), (300, 2048), (1024, 1024)):
            c = mm.config_for(m, n, k, 2, sms, tma=True)
            assert c["BLOCK_M"] == max(16, 1 << (m - 1).bit_length()), (m, c)
            tiles = -(-n // c["BLOCK_N"])
            k_tiles = -(-k // c["BLOCK_K"])
            split = c["SPLIT_K"]
            assert split == 1 or tiles < 2 * sms
            assert split == 1 or k_tiles >= mm.MIN_K_TILES_PER_SPLIT * split
            most = max(1, min(mm.MAX_SPLIT_K, k_tiles // mm.MIN_K_TILES_PER_SPLIT,
                              (m * k + k * n) * 2 // (4 * 8 * m * n)))
            if tiles < 2 * sms:
                assert tiles * split >= 2 * sms or split == most, (m, n, k, c)

                def idle(s):
                    return -(-tiles * s // sms) * sms - tiles * s
                fewest = min(-(-2 * sms // tiles), most)
                assert all(idle(split) / (tiles * split) <= idle(s) / (tiles * s)
                           for s in range(fewest, min(most, 2 * fewest) + 1)), (m, n, k, c)
    assert mm.config_for(8, 4097, 14336, 2, 132, tma=True)["SPLIT_K"] == 6   # 65 tiles x 6 = 390 of 396 slots


# ------------------------------------------------------------------------------ child-only tests
if INTERPRETED:
    from interpreter_helpers import check, interpreter_seed  # noqa: F401 (autouse: skip or seed)
    from phases.phase3_triton import matmul as mm

    def operands(m, n, k, dtype):
        return torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype), torch.empty(m, n, dtype=dtype)

    SHAPES = [(1, 33, 65), (3, 77, 129), (8, 131, 40), (13, 101, 67), (33, 50, 300), (70, 45, 77)]

    @pytest.mark.parametrize("dtype, precision", [(torch.float16, "fp16"), (torch.float32, "tf32")])
    @pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
    @in_child
    def test_both_kernels_at_odd_shapes_with_the_interpreters_configs(shape, dtype, precision):
        """Odd N and K: triton_tma pads A (K odd), B (N odd) or both, and stores C (N odd) by pointer."""
        a, b, c = operands(*shape, dtype)
        ref = a.double() @ b.double()
        for impl in (mm.matmul, mm.matmul_tma):
            v = check(c, lambda impl=impl: impl(a, b, c), ref, mm.REFERENCE, precision)
            assert v["passed"], (impl.__name__, v)

    @pytest.mark.parametrize("shape", [(1, 300, 1000), (8, 257, 2000), (13, 300, 2048), (33, 129, 999),
                                       (64, 200, 1100)], ids=lambda s: "x".join(map(str, s)))
    @in_child
    def test_both_kernels_with_the_rules_tall_skinny_configs(shape):
        """The rule's picks on a 4-SM GPU (split-K in most: partial sums added in a fixed order):
        the plain kernel's are skinny_matmul's (B read in place; test_phase3_skinny_matmul.py),
        triton_tma's pad."""
        m, n, k = shape
        a, b, c = operands(m, n, k, torch.float16)
        ref = a.double() @ b.double()
        for impl, tma in ((mm.matmul, False), (mm.matmul_tma, True)):
            cands = mm.candidates(m, n, k, 2, sms=4, tma=tma, warp_specialize=False)
            for cfg in cands + ([{**cands[0], "pad_rows": False}] if not tma else []):
                v = check(c, lambda impl=impl, cfg=cfg: impl(a, b, c, cfg), ref, mm.REFERENCE, "fp16")
                assert v["passed"], (impl.__name__, cfg, v)
                assert torch.equal(impl(a, b, None, cfg), c)      # the same bits again: no atomics
        assert mm.config_for(8, 257, 2000, 2, sms=4)["SPLIT_K"] > 1

    @pytest.mark.parametrize("split_k", [1, 3])
    @in_child
    def test_plain_kernel_shifts_the_last_tile_column_and_stores_only_c(split_k):
        """N % BLOCK_N != 0 with B's rows long enough: the last tile column starts early (its
        first columns the tile before stores), contiguous, padded and sliced B alike."""
        m, k = 70, 129
        cfg = mm._cfg(32, 64, 32, 4, 1, split_k=split_k)
        for b in (torch.randn(k, 520).half(), mm.padded_for_tma(torch.randn(k, 517).half()),
                  torch.randn(k, 600).half()[:, :517]):
            n = b.shape[1]
            assert mm.shift_columns(b, 64)[0] == 8
            a = torch.randn(m, k).half()
            c_buf = torch.full((m, n + 16), 7.0).half()
            c = c_buf[:, 8:8 + n]
            v = check(c, lambda: mm.matmul(a, b, c, cfg), a.double() @ b.double(), mm.REFERENCE, "fp16")
            assert v["passed"], (b.stride(), v)
            assert (c_buf[:, :8] == 7).all() and (c_buf[:, 8 + n:] == 7).all()

    @in_child
    def test_checker_rejects_a_shifted_column_that_stops_short():
        """Told a row length 8 columns short, the last tile column ends before N: those columns
        are never written, and the checker sees it."""
        m, n, k = 40, 520, 96
        a, b, c = operands(m, n, k, torch.float16)

        def launch(n_read):
            mm.matmul_kernel[(2 * 9, 1)](a, b, c, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                                         c.stride(0), c.stride(1), BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, GROUP_M=8,
                                         SPLIT_K=1, A_ALIGN=16, B_ALIGN=8, C_ALIGN=8, EVEN_N=False, SHIFT_N=8,
                                         n_read=n_read)
        ref = a.double() @ b.double()
        assert check(c, lambda: launch(n), ref, mm.REFERENCE, "fp16")["passed"]
        assert not check(c, lambda: launch(n - 8), ref, mm.REFERENCE, "fp16")["passed"]

    @in_child
    def test_tma_kernel_takes_transposed_and_sliced_operands_and_a_strided_output():
        a = torch.randn(40, 90).half().t()                        # 90 x 40, column-major: copied
        b = torch.randn(40, 200).half()[:, 3:70]                  # 40 x 67 inside 200-wide rows: copied
        c_buf = torch.full((90, 80), 7.0).half()
        c = c_buf[:, 5:72]                                        # 90 x 67 inside 80-wide rows
        v = check(c, lambda: mm.matmul_tma(a, b, c), a.double() @ b.double(), mm.REFERENCE, "fp16")
        assert v["passed"], v
        assert (c_buf[:, :5] == 7).all() and (c_buf[:, 72:] == 7).all()  # nothing written outside C

    @in_child
    def test_checker_rejects_a_persistent_kernel_that_drops_the_k_tail():
        m, n, k = 13, 77, 129
        a, b, c = operands(m, n, k, torch.float16)
        ref = a.double() @ b.double()
        cfg = mm.INTERPRETER_TMA_CONFIG

        def launch(k_seen):
            pa, pb = mm.padded_for_tma(a), mm.padded_for_tma(b)
            mm.matmul_tma_kernel[(4,)](pa, pb, c, torch.empty(1), m, n, k_seen, pa.stride(0), pb.stride(0),
                                       c.stride(0), c.stride(1), BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=8,
                                       SPLIT_K=1, NUM_PROGRAMS=4, SPLIT_EPILOGUE=cfg["split"],
                                       FLATTEN=cfg["flatten"], WARP_SPECIALIZE=False, C_TMA=False)
        assert check(c, lambda: launch(k), ref, mm.REFERENCE, "fp16")["passed"]
        assert not check(c, lambda: launch(k // 32 * 32), ref, mm.REFERENCE, "fp16")["passed"]

    @in_child
    def test_checker_rejects_a_descriptor_that_reads_the_pad():
        """The descriptor's shape is the logical K, so the unwritten pad is never read; told the
        padded K instead, it reads the pad (NaN here) and the answer is wrong."""
        m, n, k = 16, 32, 37
        a, b, c = operands(m, n, k, torch.float16)
        pa = mm.padded_for_tma(a)
        pa.as_strided((m, pa.stride(0)), pa.stride()).fill_(float("nan"))
        pa.copy_(a)
        pb = torch.zeros(pa.stride(0), n, dtype=torch.float16)     # B's extra rows are zeros: only A's pad is wrong
        pb[:k] = b
        cfg = mm.INTERPRETER_TMA_CONFIG

        def launch(k_seen):
            mm.matmul_tma_kernel[(1,)](pa, pb, c, torch.empty(1), m, n, k_seen, pa.stride(0), pb.stride(0),
                                       c.stride(0), c.stride(1), BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=8,
                                       SPLIT_K=1, NUM_PROGRAMS=1, SPLIT_EPILOGUE=cfg["split"],
                                       FLATTEN=cfg["flatten"], WARP_SPECIALIZE=False, C_TMA=False)
        ref = a.double() @ b.double()
        assert check(c, lambda: launch(k), ref, mm.REFERENCE, "fp16")["passed"]
        assert not check(c, lambda: launch(pa.stride(0)), ref, mm.REFERENCE, "fp16")["passed"]

    @in_child
    def test_exercise_times_triton_tma_at_an_unaligned_shape(spec_ctx):
        res = mm.run(spec_ctx(), {"sizes": [], "dtypes": ["fp16"], "shapes": "13x77x129"})
        by_variant = {r["variant"]: r for r in res.rows}
        assert all(r["status"] == "ok" for r in res.rows), [(r["variant"], r["reason"]) for r in res.rows]
        tma = by_variant["triton_tma"]["metrics"]
        assert tma["padded_operands"] == "A,B" and tma["padding_bytes"] == mm.padding_cost(13, 77, 129, 2)[0]
