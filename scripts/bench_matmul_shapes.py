"""Time the matmul kernels at shapes nobody tuned for, beside cuBLAS in the same run, and print
per shape each kernel's TFLOP/s and % of its cuBLAS row.

    python scripts/bench_matmul_shapes.py [--seed 37] [--irregular 4] [--results DIR] [--only phase2|phase3]

Shapes: `--irregular` large products drawn with a fixed seed (M, N, K in 4000..8191, none a
multiple of 64, K a multiple of 8 for the TMA rungs), fixed odd ones (two of them again with K a
multiple of 64, to separate the cost of odd M and N from that of a row pitch not 128-byte aligned), and tall-skinny ones
(M = 8, 13, 32, 64 against N, K of 4096..14336, odd N). They go to `lab run phase2.matmul` (the
bf16 tensor-core rungs and cuBLAS, plus N = 8192 for the mma.sync rungs' regular-shape rate) and
`lab run phase3.matmul` (bf16, `tune=false`: the rule's config alone, as a user gets it) through
`--param shapes=...`, so every number is an ordinary checked record (correctness gates timing)
under --results (a temporary folder unless given). mma.sync's rows at an odd N run its scalar-load
path (B's rows are not 16-byte aligned): compare them with its rows where N % 8 == 0. Phase 3's
Triton rows at an odd N copy B into 16-byte rows first (their `padded_operands` metric; the copy
is timed and counted in the row's bytes). A row with no TFLOP/s (refused, failed) prints '-' and
why; each exercise's wall time is printed after it.
"""
import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.matmul_shapes import irregular_shapes, shape_text  # noqa: E402
from common.records import load_records  # noqa: E402

# Two odd products, then the same M and N with K a multiple of 64 (128-byte rows): the pair tells
# whether a row pitch that is not 128-byte aligned is what costs the TMA kernels at odd shapes.
FIXED_ODD = [(4001, 5003, 4104), (7777, 6001, 5000), (4001, 5003, 4096), (7777, 6001, 4992)]
SKINNY = [(8, 4097, 14336), (13, 14335, 4096), (32, 5003, 8192), (64, 8191, 4104)]
PHASE2_VARIANTS = ["cublas_bf16", "cublas_bf16_nt", "mma_bf16_pipelined", "wgmma_tma", "wgmma_tma_ws",
                   "wgmma_tma_ws_tma_store", "wgmma_tma_ws_pitch128"]


def shapes(seed: int, irregular: int) -> list[tuple[int, int, int]]:
    return irregular_shapes(irregular, seed) + FIXED_ODD + SKINNY


def run(exercise: str, extra: list[str], results: Path) -> None:
    cmd = [sys.executable, "-m", "common.cli", "run", exercise, "--results", str(results), *extra]
    print("$", " ".join(cmd[1:]), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=False)
    print(f"({exercise}: {time.perf_counter() - start:.0f} s)", flush=True)


def table(results: Path) -> None:
    for rec in load_records(results):
        print(f"\n{rec['exercise']['id']} on {rec['hardware'].get('name', rec['hardware'].get('device'))}")
        print(f"{'M x N x K':>20}  {'kernel':<22} {'TFLOP/s':>9} {'% of cuBLAS':>12}  status")
        for r in rec["rows"]:
            p, m = r["params"], r.get("metrics") or {}
            shape = f"{p.get('m', p['n'])}x{p['n']}x{p.get('k', p['n'])}"
            padded = m.get("padded_operands")
            print(row_line(shape, r["variant"], m.get("tflops"), m.get("pct_of_library"), r["status"],
                           r.get("reason") or (f"(padded {padded})" if padded else None)))


def row_line(shape: str, variant: str, tflops: float | None, pct: float | None, status: str,
             reason: str | None) -> str:
    """One table line; a refused or failed row (no TFLOP/s) shows '-' and its reason."""
    tf = "-" if tflops is None else format(tflops, ".1f")
    pc = "" if pct is None else format(pct, ".1f") + "%"
    return f"{shape:>20}  {variant:<22} {tf:>9} {pc:>12}  {status} {reason or ''}".rstrip()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=37)
    p.add_argument("--irregular", type=int, default=4, help="how many seeded large irregular shapes")
    p.add_argument("--results", help="results folder (default: a temporary one)")
    p.add_argument("--only", choices=["phase2", "phase3"])
    a = p.parse_args()
    results = Path(a.results) if a.results else Path(tempfile.mkdtemp(prefix="bench_matmul_"))
    text = shape_text(shapes(a.seed, a.irregular))
    if a.only in (None, "phase2"):
        run("phase2.matmul", [f"--variant={v}" for v in PHASE2_VARIANTS]
            + ["--param", "sizes=[8192]", "--param", f"shapes={text}"], results)
    if a.only in (None, "phase3"):
        run("phase3.matmul", ["--param", "sizes=[8192]", "--param", "dtypes=[bf16]", "--param", "tune=false",
                              "--param", f"shapes={text}"],
            results)
    table(results)
    print(f"\nrecords: {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
