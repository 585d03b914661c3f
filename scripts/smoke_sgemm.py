"""GPU smoke test for the fp32 CUDA-core matmul rungs (phases/phase2_cuda/matmul.cu: naive, tiled,
regblock_1d, coalesced_regblock, warptiled_1stage, warptiled), for a first run where GPU time is
scarce. Well under a minute on an H200.

    python scripts/smoke_sgemm.py                # correctness at irregular shapes, then timing
    python scripts/smoke_sgemm.py --no-timing
    python scripts/smoke_sgemm.py --rungs warptiled,coalesced_regblock

Builds matmul.cu once for this GPU (nvcc) and prints the ptxas report of its kernels. Then, one case
at a time: correctness of each rung against a float64 matmul of the same inputs (relative Frobenius
error printed; fp32 tolerance 5e-5, below what TF32 gives), at shapes that take the scalar path (K
or N not a multiple of 4, views offset by one element) and the float4 path (with M, N, K tails);
then timing at 4096^3 (and 8192^3) against torch.matmul with TF32 off (cuBLAS fp32), with CUDA
events (2 warm-up calls, then the median of the reps), printing TFLOP/s and the percentage of
cuBLAS. The 4096 output of every timed rung is checked against float64 too. `naive` is checked at
the small shapes only and not timed (about a second per 4096 call).

Cases run in a child process; a kernel fault poisons that process's CUDA context, so when a child
dies the parent reports the case and resumes in a fresh child at the next one.
"""
import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from isolated_cases import context_alive, report, run_in_children  # noqa: E402  (scripts/ is on the path)

RUNGS = ("naive", "tiled", "regblock_1d", "coalesced_regblock", "warptiled_1stage", "warptiled")
# (M, N, K, offset): offset 1 = A, B and C are views starting one element into their storage.
CHECKS = [(1, 1, 1, 0), (17, 33, 9, 0), (65, 130, 31, 0), (1000, 777, 555, 0), (64, 64, 64, 1),   # scalar
          (64, 64, 64, 0), (1000, 776, 556, 0), (300, 4, 1036, 0), (130, 264, 200, 0),             # float4
          (1000, 776, 556, 1), (2048, 2048, 2048, 0)]
NAIVE_MAX = 1000 * 1000 * 1000            # naive only where M * N * K is at most this
TIMED = [(4096, 10), (8192, 3)]
NOT_TIMED = {"naive"}
CHILD_TIMEOUT_S = 120


def cases(rungs: tuple, timing: bool) -> list[dict]:
    out = [{"kind": "build"}]
    out += [{"kind": "check", "rung": r, "shape": s} for s in CHECKS for r in rungs
            if r != "naive" or s[0] * s[1] * s[2] <= NAIVE_MAX]
    if timing:
        out += [{"kind": "time", "n": n, "reps": reps} for n, reps in TIMED]
    return out


# ------------------------------------------------------------------------------ child
def child(rungs: tuple, start: int, timing: bool) -> int:
    import torch

    from common.checks import compare
    from phases.phase2_cuda import build
    from phases.phase2_cuda import matmul as mm

    torch.backends.cuda.matmul.allow_tf32 = False          # cuBLAS fp32: the same arithmetic as the rungs
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    todo = cases(rungs, timing)

    def view(t: torch.Tensor, offset: int) -> torch.Tensor:
        """The same values, stored `offset` elements into a fresh buffer (contiguous view)."""
        if not offset:
            return t
        buf = torch.empty(t.numel() + offset, device=t.device, dtype=t.dtype)
        v = buf[offset:].view(t.shape)
        v.copy_(t)
        return v

    def time_ms(fn, reps):
        """Median and best of `reps` calls, each between two CUDA events. No synchronization between
        the calls: each is queued while the previous one runs, so the Python wrapper's overhead
        (tens of microseconds) is not in the milliseconds measured."""
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for s, e in events:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in events)
        return times[len(times) // 2], times[0]

    for i in range(start, len(todo)):
        case = todo[i]
        report(i, status="started")
        t0 = time.perf_counter()
        try:
            if case["kind"] == "build":
                _, b = build.load("matmul.cu", mm.signatures("matmul.cu"))
                report(i, status="ok", arch=b.arch, cached=b.cached, resources=b.resources,
                       seconds=round(time.perf_counter() - t0, 1))
            elif case["kind"] == "check":
                m, n, k, off = case["shape"]
                a32, b32 = mm.operands(m, n, k, dev, seed=m + n + k)
                a, b = view(a32, off), view(b32, off)
                out = view(torch.full((m, n), float("nan"), device=dev), off)
                mm.matmul(a, b, case["rung"], out)
                torch.cuda.synchronize()
                v = compare(out, a.double() @ b.double(), "fp32", "float64 of the same inputs")
                report(i, status="ok" if v["passed"] else "FAIL", rel=v["rel_l2_error"], reason=v["reason"])
            else:
                n, reps = case["n"], case["reps"]
                a, b = mm.operands(n, n, n, dev, seed=n)
                out = torch.empty(n, n, device=dev)
                fns = {"cublas_fp32": lambda: torch.matmul(a, b, out=out)}
                for r in rungs:
                    if r not in NOT_TIMED:
                        fns[r] = (lambda r=r: mm.matmul(a, b, r, out))
                ref = (a.double() @ b.double()) if n <= 4096 else None
                flops = 2 * n ** 3
                rows, lib_tflops = {}, None
                for name, fn in fns.items():
                    try:
                        ms, best = time_ms(fn, reps)
                        tflops = flops / ms / 1e9
                        lib_tflops = tflops if name == "cublas_fp32" else lib_tflops
                        row = {"ms": round(ms, 4), "tflops": round(tflops, 1), "best_tflops": round(flops / best / 1e9, 1),
                               "pct_of_cublas": round(100 * tflops / lib_tflops, 1) if lib_tflops else None}
                        if ref is not None:                 # the timed output, checked too
                            torch.cuda.synchronize()
                            v = compare(out, ref, "fp32", "float64")
                            row["rel"], row["passed"] = v["rel_l2_error"], v["passed"]
                        rows[name] = row
                    except Exception as e:                     # noqa: BLE001 - report and go on
                        rows[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
                del ref
                wrong = any(r.get("passed") is False for r in rows.values())   # a timed output off
                report(i, status="FAIL" if wrong else "ok", rows=rows, seconds=round(time.perf_counter() - t0, 1))
        except Exception as e:                                 # noqa: BLE001 - one line per failed case
            report(i, status="ERROR", error=f"{type(e).__name__}: {e}"[:400])
            if not context_alive(dev):                         # a fault poisons the context: stop here
                return 3
    return 0


# ------------------------------------------------------------------------------ parent
def describe(case: dict) -> str:
    if case["kind"] == "build":
        return "build matmul.cu"
    if case["kind"] == "check":
        m, n, k, off = case["shape"]
        return f"check {case['rung']:<19s} {m}x{n}x{k}" + (" (views offset by 1 element)" if off else "")
    return f"time  n={case['n']} (median of {case['reps']})"


def print_result(case: dict, status: str, r: dict) -> None:
    head = f"[{status:5s}] {describe(case)}"
    if case["kind"] == "check" and "rel" in r:
        rel = r["rel"]
        print(f"{head:<72s} rel err {rel:.2e}" if rel is not None else head,
              ("" if status == "ok" else f"  {r.get('reason')}"))
    elif case["kind"] == "time" and "rows" in r:
        print(f"{head}  ({r['seconds']} s)")
        for name, row in r["rows"].items():
            if "error" in row:
                print(f"    {name:<20s} ERROR {row['error']}")
                continue
            pct = f"{row['pct_of_cublas']:5.1f}% of cuBLAS" if row["pct_of_cublas"] else " " * 16
            rel = f"  rel err {row['rel']:.1e}" if row.get("rel") is not None else ""
            rel += "  WRONG OUTPUT" if row.get("passed") is False else ""
            print(f"    {name:<20s} {row['ms']:9.3f} ms  {row['tflops']:6.1f} TFLOP/s (best {row['best_tflops']:5.1f})"
                  f"  {pct}{rel}")
    elif case["kind"] == "build" and "resources" in r:
        print(f"{head}  arch {r['arch']}, cached {r['cached']}, {r['seconds']} s")
        for kernel, res in sorted(r["resources"].items()):
            print(f"    {kernel:<32s} {res.get('registers')!s:>4} regs  {res.get('smem_bytes')!s:>6} B smem  "
                  f"spills {res.get('spill_stores_bytes')}/{res.get('spill_loads_bytes')}  stack {res.get('stack_bytes')}")
    else:
        print(head, json.dumps(r))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--rungs", default=",".join(RUNGS), help="comma-separated subset of " + ",".join(RUNGS))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    rungs = tuple(r for r in args.rungs.split(",") if r)
    unknown = [r for r in rungs if r not in RUNGS]
    if unknown:
        print(f"unknown rung(s) {', '.join(unknown)}; choose from {', '.join(RUNGS)}")
        return 2
    timing = not args.no_timing
    if args.child:
        return child(rungs, args.start, timing)

    import torch
    if not torch.cuda.is_available():
        print("needs a CUDA GPU; none is visible on this machine")
        return 2
    todo, t_all = cases(rungs, timing), time.perf_counter()
    failures = run_in_children(
        todo, lambda i: [sys.executable, __file__, "--child", "--start", str(i), "--rungs", ",".join(rungs)]
        + (["--no-timing"] if not timing else []), CHILD_TIMEOUT_S, print_result, describe)
    print(f"{'all ok' if not failures else f'{failures} case(s) failed'} in {time.perf_counter() - t_all:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
