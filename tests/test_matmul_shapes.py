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
