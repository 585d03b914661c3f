"""GPU smoke test for the mma.sync rungs (phases/phase2_cuda/matmul_mma.cu: mma_bf16 and
mma_bf16_pipelined), for a first run where GPU time is scarce. Well under a minute on an H200.

    python scripts/smoke_mma.py                # correctness at irregular shapes, then timing
    python scripts/smoke_mma.py --no-timing

Builds matmul_mma.cu once for this GPU (nvcc) and prints the ptxas report of its kernels. Then,
one case at a time: correctness of each rung against a float64 matmul of the same bf16 inputs
(relative Frobenius error printed, bf16 tolerance 2e-2), at shapes that take the scalar-load path
(K or N not a multiple of 8, views offset by one element) and the cp.async path (with M, N, K
tails); then timing at 4096^3 and 8192^3 against torch.matmul on the same bf16 inputs (cuBLAS),
with CUDA events (2 warm-up calls, then the median of 10 at 4096, 5 at 8192), printing TFLOP/s and
the percentage of cuBLAS. mma_bf16_pipelined is also timed with its ring forced to 3 and to 4
stages (launch_matmul_mma_bf16_pipelined_stages; the rung itself picks 4 where the GPU allows
192 KB of shared memory per block).

Cases run in a child process; a kernel fault poisons that process's CUDA context, so when a child
dies the parent reports the case and resumes in a fresh child at the next one.
"""
import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from isolated_cases import context_alive, report, run_in_children  # noqa: E402  (scripts/ is on the path)

RUNGS = ("mma_bf16", "mma_bf16_pipelined")
# (M, N, K, offset): offset 1 = A, B and C are views starting one element into their storage.
CHECKS = [(1, 1, 1, 0), (17, 33, 9, 0), (65, 130, 31, 0), (1000, 777, 555, 0), (64, 64, 64, 1),  # scalar path
          (128, 256, 64, 0), (130, 264, 200, 0), (1000, 776, 552, 0), (300, 8, 1032, 0),          # cp.async path
          (1000, 776, 552, 1), (2048, 2048, 2048, 0)]
TIMED = [(4096, 10), (8192, 5)]
CHILD_TIMEOUT_S = 90


def cases(timing: bool) -> list[dict]:
    out = [{"kind": "build"}]
    out += [{"kind": "check", "rung": r, "shape": s} for s in CHECKS for r in RUNGS]
    if timing:
        out += [{"kind": "time", "n": n, "reps": reps} for n, reps in TIMED]
    return out


# ------------------------------------------------------------------------------ child
def child(start: int, timing: bool) -> int:
    import torch

    from common.checks import compare
    from phases.phase2_cuda import build
    from phases.phase2_cuda import matmul as mm

    dev = torch.device("cuda")
    todo = cases(timing)

    def lib_and_build():
        lib, b = build.load("matmul_mma.cu", mm.signatures("matmul_mma.cu"))
        fn = lib.launch_matmul_mma_bf16_pipelined_stages
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4 + [ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return lib, b

    def view(t: torch.Tensor, offset: int) -> torch.Tensor:
        """The same values, stored `offset` elements into a fresh buffer (contiguous view)."""
        if not offset:
            return t
        buf = torch.empty(t.numel() + offset, device=t.device, dtype=t.dtype)
        v = buf[offset:].view(t.shape)
        v.copy_(t)
        return v

    def time_ms(fn, reps):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        return sorted(times)[len(times) // 2]

    for i in range(start, len(todo)):
        case = todo[i]
        report(i, status="started")
        t0 = time.perf_counter()
        try:
            if case["kind"] == "build":
                _, b = lib_and_build()
                res = {k: v for k, v in b.resources.items() if k.startswith("matmul_mma")}
                report(i, status="ok", arch=b.arch, cached=b.cached, resources=res,
                       seconds=round(time.perf_counter() - t0, 1))
            elif case["kind"] == "check":
                m, n, k, off = case["shape"]
                rung = mm.RUNGS[case["rung"]]
                a32, b32 = mm.operands(m, n, k, dev, seed=m + n + k)
                a, b = view(a32.bfloat16(), off), view(b32.bfloat16(), off)
                out = view(torch.full((m, n), float("nan"), device=dev, dtype=rung.out_dtype), off)
                mm.matmul(a, b, case["rung"], out)
                torch.cuda.synchronize()
                v = compare(out, a.double() @ b.double(), "bf16", "float64 of the same bf16 inputs")
                report(i, status="ok" if v["passed"] else "FAIL", rel=v["rel_l2_error"], reason=v["reason"])
            else:
                n, reps = case["n"], case["reps"]
                lib, _ = lib_and_build()
                a32, b32 = mm.operands(n, n, n, dev, seed=n)
                a, b = a32.bfloat16(), b32.bfloat16()
                del a32, b32
                outs = {torch.float32: torch.empty(n, n, device=dev),
                        torch.bfloat16: torch.empty(n, n, device=dev, dtype=torch.bfloat16)}
                stream = build.stream(dev)

                def staged(stages):
                    def fn():
                        code = lib.launch_matmul_mma_bf16_pipelined_stages(
                            build.ptr(a), build.ptr(b), build.ptr(outs[torch.bfloat16]), n, n, n, stages, stream)
                        build.check(lib, code, f"mma_bf16_pipelined stages={stages}")
                    return fn

                fns = {"cublas_bf16": lambda: torch.matmul(a, b, out=outs[torch.bfloat16])}
                for r in RUNGS:
                    fns[r] = (lambda r=r: mm.matmul(a, b, r, outs[mm.RUNGS[r].out_dtype]))
                fns["mma_bf16_pipelined(stages=3)"] = staged(3)
                fns["mma_bf16_pipelined(stages=4)"] = staged(4)
                flops = 2 * n ** 3
                rows, lib_tflops = {}, None
                for name, fn in fns.items():
                    try:
                        ms = time_ms(fn, reps)
                        tflops = flops / ms / 1e9
                        lib_tflops = tflops if name == "cublas_bf16" else lib_tflops
                        rows[name] = {"ms": round(ms, 4), "tflops": round(tflops, 1),
                                      "pct_of_cublas": round(100 * tflops / lib_tflops, 1) if lib_tflops else None}
                    except Exception as e:                     # noqa: BLE001 - report and go on
                        rows[name] = {"error": f"{type(e).__name__}: {e}"}
                # The timed output is checked too (the last variant run wrote outs[bf16]: recompute).
                mm.matmul(a, b, "mma_bf16_pipelined", outs[torch.bfloat16])
                torch.cuda.synchronize()
                ref = torch.matmul(a.float(), b.float())
                rel = float((outs[torch.bfloat16].float() - ref).norm() / ref.norm())
                report(i, status="ok", rows=rows, rel_vs_fp32_matmul=rel, seconds=round(time.perf_counter() - t0, 1))
        except Exception as e:                                 # noqa: BLE001 - one line per failed case
            report(i, status="ERROR", error=f"{type(e).__name__}: {e}"[:400])
            if not context_alive(dev):                         # a fault poisons the context: stop here
                return 3
    return 0


# ------------------------------------------------------------------------------ parent
def describe(case: dict) -> str:
    if case["kind"] == "build":
        return "build matmul_mma.cu"
    if case["kind"] == "check":
        m, n, k, off = case["shape"]
        return f"check {case['rung']:<19s} {m}x{n}x{k}" + (" (views offset by 1 element)" if off else "")
    return f"time  n={case['n']}"


def show(case: dict, status: str, r: dict) -> None:
    head = f"[{status:5s}] {describe(case)}"
    if case["kind"] == "check" and "rel" in r:
        rel = r["rel"]
        print(f"{head:<70s} rel err {rel:.2e}" if rel is not None else head,
              ("" if status == "ok" else f"  {r.get('reason')}"))
    elif case["kind"] == "time" and "rows" in r:
        print(f"{head}  (timed output rel err vs fp32 matmul {r['rel_vs_fp32_matmul']:.1e})")
        for name, row in r["rows"].items():
            if "error" in row:
                print(f"    {name:<30s} ERROR {row['error']}")
            else:
                pct = f"{row['pct_of_cublas']:5.1f}% of cuBLAS" if row["pct_of_cublas"] else ""
                print(f"    {name:<30s} {row['ms']:9.3f} ms  {row['tflops']:7.1f} TFLOP/s  {pct}")
    else:
        print(head, json.dumps(r))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    timing = not args.no_timing
    if args.child:
        return child(args.start, timing)

    import torch
    if not torch.cuda.is_available():
        print("needs a CUDA GPU; none is visible on this machine")
        return 2
    todo, t_all = cases(timing), time.perf_counter()
    failures = run_in_children(
        todo, lambda i: [sys.executable, __file__, "--child", "--start", str(i)] + (["--no-timing"] if not timing else []),
        CHILD_TIMEOUT_S, show, describe)
    print(f"{'all ok' if not failures else f'{failures} case(s) failed'} in {time.perf_counter() - t_all:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
