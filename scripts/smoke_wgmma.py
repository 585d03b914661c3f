"""GPU smoke test for the Hopper wgmma rungs (phases/phase2_cuda/matmul_wgmma.cu), for a first run on
an H100/H200 where GPU time is scarce.

    python scripts/smoke_wgmma.py                    # every wgmma rung: correctness, then timing
    python scripts/smoke_wgmma.py --rungs wgmma_tma_ws --no-timing
    python scripts/smoke_wgmma.py --rungs wgmma_tma_ws_tma_store --versus wgmma_tma_ws   # the two epilogues, same rounds

Builds the source once (nvcc, sm_90a), then runs each rung in its own child process, one case at a
time: first correctness at irregular shapes against a float64 matmul of the same bf16 inputs (the
relative error is printed), then timing at 4096^3 and 8192^3 against torch.matmul(a, b_col) (cuBLAS
with B column-major, the storage the rungs read) with CUDA events, in interleaved rounds (each round
times every contender once, in rotating order; the median round counts), so clock drift hits all
alike. With --versus, each rung is also timed against that rung in the same rounds.
A kernel fault poisons the CUDA context of its process, and a hung kernel would hold it forever (the kernels trap after a 4 s
barrier wait, and each child has a time limit), so when a child dies the parent reports the case it
was on and starts a fresh child at the next case: one failure never hides the others.
"""
import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from isolated_cases import context_alive, report, run_in_children  # noqa: E402  (scripts/ is on the path)

RUNGS = ("wgmma_tma", "wgmma_tma_ws", "wgmma_tma_ws_cluster", "wgmma_tma_ws_tma_store")
# (M, N, K): tiny, odd, tails in every dimension, exact tiles, more tiles than SMs, then the timed sizes.
# N % 8 == 0 with partial tiles and boxes (17x40, 300x296, 1000x776, 2500x4000) exercises the TMA-store
# epilogue's clipping; N % 8 != 0 (33, 130, 777) its fallback.
CHECKS = [(1, 1, 8), (17, 33, 8), (17, 40, 64), (65, 130, 24), (128, 256, 64), (300, 296, 200), (1000, 776, 552),
          (1000, 777, 552), (2500, 4000, 136), (4096, 4096, 4096), (8192, 8192, 8192)]
TIMED = [4096, 8192]
CHILD_TIMEOUT_S = 60
ROUNDS = 7                      # interleaved timing rounds


def cases(timing: bool) -> list[dict]:
    out = [{"kind": "check", "shape": s} for s in CHECKS]
    if timing:
        out += [{"kind": "time", "n": n} for n in TIMED]
    return out


# ------------------------------------------------------------------------------ child: one rung, cases from `start`
def child(rung: str, start: int, timing: bool, versus: str = "") -> int:
    import torch

    from common.checks import compare
    from phases.phase2_cuda import build
    from phases.phase2_cuda import matmul as mm

    dev = torch.device("cuda")
    lib, _ = build.load("matmul_wgmma.cu", mm.signatures("matmul_wgmma.cu"))
    launcher = getattr(lib, mm.RUNGS[rung].launcher)
    # With --versus, the rung is also timed against that rung (as well as cuBLAS), in the same rounds.
    ref_name = versus if (versus and versus != rung and versus in mm.RUNGS) else ""
    ref_launcher = getattr(lib, mm.RUNGS[ref_name].launcher) if ref_name else None
    todo = cases(timing)

    for i in range(start, len(todo)):
        case = todo[i]
        report(i, status="started")
        t0 = time.perf_counter()
        try:
            if case["kind"] == "check":
                m, n, k = case["shape"]
                g = torch.Generator(device=dev).manual_seed(m + n + k)
                a = torch.randn(m, k, device=dev, generator=g).bfloat16()
                b = torch.randn(k, n, device=dev, generator=g).bfloat16()
                b_col = mm.column_major(b)
                out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)     # poisoned
                mm.matmul(a, b_col, rung, out)
                torch.cuda.synchronize()
                ref = a.double() @ b.double()
                v = compare(out, ref, "bf16", "float64 matmul of the same bf16 inputs")
                # Where it is wrong tells what is wrong: everywhere (swizzle, descriptor, fragment
                # layout), only tile edges (bounds, OOB fill), only some tiles (scheduling, phases).
                d = torch.nan_to_num((out.double() - ref).abs(), nan=float("inf"))
                bad = d > 0.02 * max(float(ref.pow(2).mean().sqrt()), 1e-6)
                nbad = int(bad.sum())
                first_bad = torch.nonzero(bad)[0].tolist() if nbad else None
                worst = int(d.argmax())
                report(i, status="ok" if v["passed"] else "FAILED", shape=[m, n, k],
                       rel_l2_error=v.get("rel_l2_error"), max_abs_error=v.get("max_abs_error"),
                       nan_outputs=int(torch.isnan(out).sum()), bad_outputs=f"{nbad}/{m * n}",
                       first_bad=first_bad, worst_at=[worst // n, worst % n], reason=v.get("reason"),
                       epilogue=(("tma" if n % 8 == 0 else "fallback") if rung == "wgmma_tma_ws_tma_store" else None),
                       seconds=round(time.perf_counter() - t0, 3))
            else:
                n = case["n"]
                g = torch.Generator(device=dev).manual_seed(n)
                a = torch.randn(n, n, device=dev, generator=g).bfloat16()
                b_col = mm.column_major(torch.randn(n, n, device=dev, generator=g).bfloat16())
                out = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
                stream = build.stream(dev)
                args = (build.ptr(a), build.ptr(b_col), build.ptr(out), n, n, n, stream)

                def launch(fn):
                    def call():
                        code = fn(*args)
                        if code:
                            raise RuntimeError(f"launch error {code}: {lib.lab_error_string(code).decode()}")
                    return call

                def cublas():
                    torch.matmul(a, b_col, out=out)

                fns = {"ours": launch(launcher), "cublas": cublas}
                if ref_launcher is not None:
                    fns["ref"] = launch(ref_launcher)

                def bench(fns, iters):
                    """Interleaved rounds: each round times a batch of `iters` calls of every contender, in
                    an order rotated round by round; per contender the median round, in ms per call."""
                    for fn in fns.values():
                        for _ in range(3):
                            fn()
                    torch.cuda.synchronize()
                    names = list(fns)
                    times = {k: [] for k in names}
                    for r in range(ROUNDS):
                        for k in names[r % len(names):] + names[:r % len(names)]:
                            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            s.record()
                            for _ in range(iters):
                                fns[k]()
                            e.record()
                            torch.cuda.synchronize()
                            times[k].append(s.elapsed_time(e) / iters)
                    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}

                iters = 40 if n <= 4096 else 10
                ms = bench(fns, iters)
                ms_ours, ms_lib = ms["ours"], ms["cublas"]
                tf = lambda t: 2 * n**3 / (t * 1e-3) / 1e12
                extra = {}
                if "ref" in ms:
                    extra = {f"{ref_name}_tflops": round(tf(ms["ref"]), 1),
                             f"{ref_name}_pct_of_cublas": round(100 * ms_lib / ms["ref"], 1),
                             f"speedup_vs_{ref_name}": round(ms["ref"] / ms_ours, 3)}
                report(i, status="ok", n=n, ms=round(ms_ours, 4), tflops=round(tf(ms_ours), 1),
                       cublas_ms=round(ms_lib, 4), cublas_tflops=round(tf(ms_lib), 1),
                       pct_of_cublas=round(100 * ms_lib / ms_ours, 1), **extra,
                       seconds=round(time.perf_counter() - t0, 3))
        except Exception as e:                                   # noqa: BLE001 - report and go on
            report(i, status="ERROR", error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                   seconds=round(time.perf_counter() - t0, 3))
            if not context_alive(dev):
                return 3                                         # the parent restarts us at i + 1
    return 0


# ------------------------------------------------------------------------------ parent
def describe(case: dict) -> str:
    return "check %s" % "x".join(map(str, case["shape"])) if case["kind"] == "check" else f"time {case['n']}^3"


def show(case: dict, status: str, r: dict) -> None:
    print(f"  [{status:>6}] {describe(case):<24} " + ", ".join(f"{k}={v}" for k, v in r.items() if v is not None))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rungs", default=",".join(RUNGS))
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--versus", default="", help="a rung each rung is also timed against, in the same rounds")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    timing = not args.no_timing
    if args.child:
        return child(args.child, args.start, timing, args.versus)

    t_all = time.perf_counter()
    import torch

    from phases.phase2_cuda import build
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs a Hopper GPU (compute capability 9.0) for the sm_90a kernels; "
              f"found {torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA GPU'}")
        return 1
    print(f"GPU: {torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs, "
          f"torch {torch.__version__}")
    t0 = time.perf_counter()
    try:
        b = build.build("matmul_wgmma.cu", "sm_90")             # sm_90a; the children find it in the cache
        print(f"build: {b.arch} {'cached' if b.cached else 'compiled'} in {time.perf_counter() - t0:.1f} s")
        for kernel, res in b.resources.items():
            print(f"  ptxas {kernel}: {res}")
        for line in b.log.splitlines():
            if "warning" in line.lower():
                print("  " + line.strip())
    except Exception as e:                                       # noqa: BLE001
        print(f"build FAILED: {e}")
        return 1

    todo = cases(timing)
    failures = 0
    for rung in [r for r in args.rungs.split(",") if r]:
        print(f"\n== {rung}")
        failures += run_in_children(
            todo, lambda start: [sys.executable, __file__, "--child", rung, "--start", str(start), "--versus",
                                 args.versus] + (["--no-timing"] if not timing else []),
            CHILD_TIMEOUT_S, show, describe, max_restarts=4)
    print(f"\n{'all ok' if failures == 0 else f'{failures} failing case(s)'} in {time.perf_counter() - t_all:.1f} s")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
