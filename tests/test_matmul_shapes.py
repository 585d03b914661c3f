"""`--param shapes=MxNxK,...` on the matmul exercises: parsed, checked before any work (one line,
exit 2, no record), and the seeded irregular shapes the benchmark script draws."""
import subprocess
import sys
from pathlib import Path

import pytest

from common.matmul_shapes import irregular_shapes, parse_shapes, shape_text

ROOT = Path(__file__).resolve().parent.parent


def test_parse_shapes_reads_each_product():
    assert parse_shapes("4000x5000x6008, 13X4096x14336") == [(4000, 5000, 6008), (13, 4096, 14336)]
    assert parse_shapes(shape_text([(8, 9, 10)])) == [(8, 9, 10)]


@pytest.mark.parametrize("text,why", [("4000x50", "is not MxNxK"), ("0x5x6", "at least 1"), ("", "expected"),
                                      ("8x8x8,abc", "'abc' is not MxNxK"), ("100000x100000x8", r"fewer than 2\^31")])
def test_parse_shapes_says_what_is_wrong(text, why):
    with pytest.raises(ValueError, match=why):
        parse_shapes(text)


def test_irregular_shapes_are_seeded_large_and_fit_no_tile():
    shapes = irregular_shapes(6, seed=37)
    assert shapes == irregular_shapes(6, seed=37) != irregular_shapes(6, seed=38)
    for m, n, k in shapes:
        assert all(4000 <= v < 8192 and v % 64 for v in (m, n, k)) and k % 8 == 0


@pytest.mark.parametrize("exercise", ["phase2.matmul", "phase3.matmul"])
@pytest.mark.parametrize("value", ["4000x50", "4000", "8x8x8,0x1x1"])
def test_a_bad_shapes_value_is_one_line_and_exit_2(tmp_path, exercise, value):
    proc = subprocess.run([sys.executable, "-m", "common.cli", "run", exercise, "--param", f"shapes={value}",
                           "--results", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--param shapes=" in lines[0] and "Traceback" not in proc.stderr
    assert not list(tmp_path.rglob("*.json"))


def test_the_shapes_benchmark_passes_the_exercises_parameter_checks(tmp_path):
    """scripts/bench_matmul_shapes.py on this (GPU-less) machine: both exercises accept its shapes
    (no parameter error; they skip for want of a GPU) and it ends with where the records are."""
    proc = subprocess.run([sys.executable, "scripts/bench_matmul_shapes.py", "--results", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out
    assert "run phase2.matmul" in out and "run phase3.matmul" in out and f"records: {tmp_path}" in out
    assert "--param shapes=" not in proc.stderr                   # no parameter was refused


def test_the_benchmark_shapes_are_irregular_tall_skinny_and_tma_readable():
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_matmul_shapes as bench
    shapes = bench.shapes(37, 4)
    assert len(set(shapes)) == len(shapes) == 4 + len(bench.FIXED_ODD) + len(bench.SKINNY)
    assert parse_shapes(shape_text(shapes)) == shapes
    assert all(k % 8 == 0 for _, _, k in shapes)                  # the TMA rungs read every one
    assert {m for m, _, _ in bench.SKINNY} == {8, 13, 32, 64}
    assert any(n % 2 for _, n, _ in shapes) and any(k % 64 for _, _, k in shapes) and any(k % 64 == 0 for *_, k in shapes)


def test_the_benchmark_table_prints_a_refused_row_with_its_reason():
    """A refused or failed row has no TFLOP/s: the line says '-' and why, it does not crash."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_matmul_shapes as bench
    line = bench.row_line("8x4097x14336", "triton_tma", None, None, "skipped", "needs a Hopper GPU")
    assert line.split()[:3] == ["8x4097x14336", "triton_tma", "-"] and line.endswith("skipped needs a Hopper GPU")
    line = bench.row_line("4001x5003x4104", "triton", 231.96, 98.44, "ok", None)
    assert line.split() == ["4001x5003x4104", "triton", "232.0", "98.4%", "ok"]
