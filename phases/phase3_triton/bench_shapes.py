"""Flash attention and softmax at shapes nobody tuned for, against the library, in one command:

    python -m phases.phase3_triton.bench_shapes [--only attention|softmax] [--json out.json]
    python -m phases.phase3_triton.bench_shapes --only softmax   # softmax alone

Issue 37's check, on one GPU in under three minutes. Each kernel runs the config its rule picks
(`forward_config`, `backward_config`, `softmax.plan`: what a user gets when passing no config),
never a tuned one. Every timed kernel is first checked against float64 (attention: the last head;
softmax: the whole tensor); a failed check prints FAILED and no time.

* Attention (bf16): N in 1000, 1537, 4096, 7000, 16384, head dims 64 and 128, causal and not, at
  16,384 tokens (B = 16384 // N) and model width 2048 (H = 2048 // D). Forward and backward
  TFLOP/s (the usual convention: 4·B·H·N²·D forward, 2.5x that backward, halved when causal) and
  the percentage of SDPA's fastest backend (cuDNN, flash), timed in the same run. The backward
  twice: the rule's two kernels (7 matmuls), and FlashAttention-2's atomic-dQ scheme (5 matmuls,
  `atomic_config`), so the faster can become the rule.
* Softmax (fp32): widths 64 to 262,144, odd ones included, 2^27 elements per tensor. GB/s of
  the problem's bytes (read x, write y) and the percentage of a copy of the same tensor.

Goals: forward >= 90% of SDPA's best, backward >= 80%, softmax >= 90% of copy. The
last lines count the shapes that meet each. Timings: the lab's harness (CUDA events, L2 flushed
before each sample, median).
"""
import argparse
import json
import math
import sys
import time

import torch

from common.checks import compare
from common.timing import benchmark

ATTN_SIZES = (1000, 1537, 4096, 7000, 16384)
ATTN_HEAD_DIMS = (64, 128)
TOKENS, MODEL_DIM = 16384, 2048
SOFTMAX_WIDTHS = (64, 100, 101, 333, 1000, 1537, 4096, 8192, 10000, 32768, 32769, 50000, 65536, 100000, 131072, 200000,
                  262144)
SOFTMAX_ELEMENTS = 2**27
GOALS_PCT = {"fwd": 90.0, "bwd": 80.0, "softmax": 90.0}


def timed_ms(fn, device) -> float:
    """Median ms of `fn` with the lab's harness, short runs (many rows, a 3-minute budget)."""
    return benchmark(fn, device, warmup_ms=10.0, target_ms=40.0, min_samples=5, max_samples=200).median_ms


def attention_rows(device, sizes, head_dims, causals, tokens: int = TOKENS, model_dim: int = MODEL_DIM,
                   dtype: torch.dtype = torch.bfloat16, atomic: bool = True) -> list[dict]:
    """One row per (D, causal, N): our forward and backward (rule configs), checked then timed,
    and SDPA's cuDNN and flash backends timed on the same tensors."""
    from . import counts
    from . import flash_attention as fa
    from . import flash_attention_bwd as fab
    out = []
    for d in head_dims:
        for causal in causals:
            for n in sizes:
                b, h = max(1, tokens // n), max(1, model_dim // d)
                g = torch.Generator(device=device).manual_seed(n * 7 + d)
                q, k, v, do = (torch.randn(b, h, n, d, device=device, generator=g).to(dtype) for _ in range(4))
                precision = fa.PRECISION[dtype]
                scale = 1.0 / math.sqrt(d)
                heads = [(b - 1, h - 1)]
                limits = fa.gpu_limits(device)
                fcfg = fa.forward_config(dtype, d, causal, n, b * h, **limits)
                bcfg = fa.backward_config(d, causal, n, b * h, **limits)
                row = {"n": n, "head_dim": d, "causal": causal, "batch": b, "heads": h,
                       "fwd_config": fa.label(fcfg), "bwd_config": f"dkdv {fa.label(bcfg['dkdv'])}; dq {fa.label(bcfg['dq'])}"}
                fwd_flops = counts.attention_flops(b, h, n, d, causal)
                bwd_flops = counts.backward_flops(b, h, n, d, causal)
                verdict = fa.check_forward(lambda o: fa.attention_forward(q, k, v, causal, scale, fcfg, out=o),
                                           q, k, v, causal, scale, precision, heads=heads)
                o, lse = fa.attention_forward(q, k, v, causal, scale, fcfg)
                if verdict["passed"]:
                    ms = timed_ms(lambda: fa.attention_forward(q, k, v, causal, scale, fcfg), device)
                    row["fwd_tflops"] = fwd_flops / (ms * 1e9)
                else:
                    row["fwd_failed"] = verdict["reason"]
                ref = fab.reference_grads(q, k, v, do, causal, scale, heads)
                verdict = fab.check_grads(lambda gq, gk, gv: fa.attention_backward(q, k, v, o, lse, do, causal, scale,
                                                                                   bcfg, grads=(gq, gk, gv)),
                                          q, ref, heads, precision)
                if verdict["passed"]:
                    ms = timed_ms(lambda: fa.attention_backward(q, k, v, o, lse, do, causal, scale, bcfg), device)
                    row["bwd_tflops"] = bwd_flops / (ms * 1e9)
                else:
                    row["bwd_failed"] = verdict["reason"]
                acfg = {"atomic": fa.atomic_config(d, n, b * h, limits["sms"])}     # FlashAttention-2's scheme
                row["bwd_atomic_config"] = fa.label(acfg["atomic"]) if atomic else "not run"
                verdict = {"passed": False, "reason": "not run"} if not atomic else fab.check_grads(lambda gq, gk, gv: fa.attention_backward(q, k, v, o, lse, do, causal, scale,
                                                                                   acfg, grads=(gq, gk, gv)),
                                          q, ref, heads, precision)
                del ref
                if verdict["passed"]:
                    ms = timed_ms(lambda: fa.attention_backward(q, k, v, o, lse, do, causal, scale, acfg), device)
                    row["bwd_atomic_tflops"] = bwd_flops / (ms * 1e9)
                elif atomic:
                    row["bwd_atomic_failed"] = verdict["reason"]
                for variant in ("sdpa_cudnn", "sdpa_flash"):
                    if fa.sdpa_unsupported(variant, q, k, v, causal):
                        continue
                    with fa.sdpa_context(variant):
                        row[f"{variant}_fwd_tflops"] = fwd_flops / (timed_ms(lambda: fa.sdpa(q, k, v, causal), device) * 1e9)
                        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
                        try:
                            res = fa.sdpa(qg, kg, vg, causal)
                            ms = timed_ms(lambda: torch.autograd.grad(res, (qg, kg, vg), do, retain_graph=True), device)
                            row[f"{variant}_bwd_tflops"] = bwd_flops / (ms * 1e9)
                        except RuntimeError:
                            pass
                        del qg, kg, vg
                for part, lib_part in (("fwd", "fwd"), ("bwd", "bwd"), ("bwd_atomic", "bwd")):
                    libs = {v: row[f"{v}_{lib_part}_tflops"] for v in ("sdpa_cudnn", "sdpa_flash")
                            if f"{v}_{lib_part}_tflops" in row}
                    if libs and f"{part}_tflops" in row:
                        best = max(libs, key=libs.get)
                        row[f"{part}_library"] = best
                        row[f"{part}_pct_of_library"] = 100 * row[f"{part}_tflops"] / libs[best]
                out.append(row)
                print(attention_line(row), flush=True)
                del q, k, v, do, o, lse
                torch.cuda.empty_cache()
    return out


def attention_line(r: dict) -> str:
    def part(p, name):
        if f"{p}_failed" in r:
            return f"{name} FAILED ({r[p + '_failed']})"
        lib = r.get(f"{p}_library", "-")
        lib_part = "fwd" if p == "fwd" else "bwd"
        return (f"{name} {r.get(p + '_tflops', float('nan')):5.0f} TFLOP/s {r.get(p + '_pct_of_library', float('nan')):5.1f}%"
                + ("" if p == "bwd_atomic" else f" of {lib} ({r.get(lib + '_' + lib_part + '_tflops', float('nan')):4.0f})"))
    return (f"attn d={r['head_dim']:3d} causal={int(r['causal'])} N={r['n']:5d} {r['batch']:2d}x{r['heads']:2d} | "
            f"{part('fwd', 'fwd')} | {part('bwd', 'bwd')} | {part('bwd_atomic', 'atomic-dQ bwd')} | "
            f"fwd [{r['fwd_config']}] bwd [{r['bwd_config']}] atomic [{r['bwd_atomic_config']}]")


def softmax_rows(device, widths, elements: int = SOFTMAX_ELEMENTS) -> list[dict]:
    """One row per width: copy, torch.softmax and ours (plan()'s config, checked then timed)."""
    from . import softmax as sm
    from common.triton_shim import sm_count
    out = []
    for n in widths:
        m = max(1, elements // n)
        g = torch.Generator(device=device).manual_seed(n)
        x = torch.randn(m, n, device=device, generator=g) * 4
        y = torch.empty_like(x)
        cfg = sm.plan(m, n, sm_count(device))
        gbytes = sm.bytes_fused(m, n) / 1e9
        row = {"cols": n, "rows": m, "config": sm.label(cfg)}
        y.fill_(float("nan"))
        sm.softmax(x, y)                              # no config: the rule's, as a user gets it
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        verdict = compare(y, lambda a, b: _softmax_ref_chunk(x, a, b), "fp32", sm.REFERENCE, expected_shape=tuple(x.shape))
        copy_ms = timed_ms(lambda: y.copy_(x), device)
        row["copy_gbps"] = gbytes / (copy_ms * 1e-3)
        row["torch_gbps"] = gbytes / (timed_ms(lambda: torch.softmax(x, dim=1), device) * 1e-3)
        if verdict["passed"]:
            row["gbps"] = gbytes / (timed_ms(lambda: sm.softmax(x, y), device) * 1e-3)
            row["pct_of_copy"] = 100 * row["gbps"] / row["copy_gbps"]
        else:
            row["failed"] = verdict["reason"]
        row["torch_pct_of_copy"] = 100 * row["torch_gbps"] / row["copy_gbps"]
        out.append(row)
        print(softmax_line(row), flush=True)
        del x, y
        torch.cuda.empty_cache()
    return out


def _softmax_ref_chunk(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """float64 softmax of the rows holding flat elements [start, stop), sliced to them."""
    n = x.shape[1]
    r0, r1 = start // n, -(-stop // n)
    ref = torch.softmax(x[r0:r1].double(), dim=1).reshape(-1)
    return ref[start - r0 * n: stop - r0 * n]


def softmax_line(r: dict) -> str:
    ours = (f"FAILED ({r['failed']})" if "failed" in r else
            f"{r['gbps']:6.0f} GB/s = {r['pct_of_copy']:5.1f}% of copy")
    return (f"softmax cols={r['cols']:6d} rows={r['rows']:7d}  triton {ours} ({r['copy_gbps']:5.0f})  "
            f"torch {r['torch_pct_of_copy']:5.1f}%  [{r['config']}]")


def summary(attn: list[dict], soft: list[dict]) -> list[str]:
    lines = []
    for part in ("fwd", "bwd", "bwd_atomic"):
        got = [r for r in attn if f"{part}_pct_of_library" in r]
        if got:
            worst = min(got, key=lambda r: r[f"{part}_pct_of_library"])
            goal = GOALS_PCT["bwd" if part == "bwd_atomic" else part]
            met = sum(r[f"{part}_pct_of_library"] >= goal for r in got)
            lines.append(f"attention {part}: {met}/{len(got)} shapes >= {goal:.0f}% of SDPA's best; worst "
                         f"{worst[f'{part}_pct_of_library']:.1f}% (d={worst['head_dim']} causal={worst['causal']} "
                         f"N={worst['n']})")
    failed = [r for r in attn if any(k.endswith("_failed") for k in r)] + [r for r in soft if "failed" in r]
    got = [r for r in soft if "pct_of_copy" in r]
    if got:
        worst = min(got, key=lambda r: r["pct_of_copy"])
        met = sum(r["pct_of_copy"] >= GOALS_PCT["softmax"] for r in got)
        lines.append(f"softmax: {met}/{len(got)} widths >= {GOALS_PCT['softmax']:.0f}% of copy; worst "
                     f"{worst['pct_of_copy']:.1f}% (cols={worst['cols']})")
    lines.append(f"checks failed: {len(failed)}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["attention", "softmax"])
    p.add_argument("--sizes", type=int, nargs="+", default=list(ATTN_SIZES), help="attention N")
    p.add_argument("--head-dims", type=int, nargs="+", default=list(ATTN_HEAD_DIMS), choices=[64, 128])
    p.add_argument("--widths", type=int, nargs="+", default=list(SOFTMAX_WIDTHS), help="softmax columns")
    p.add_argument("--no-atomic", action="store_true", help="skip the atomic-dQ backward (fewer compiles)")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_shapes needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    if any(n < 1 for n in args.sizes) or any(w < 1 for w in args.widths):
        print("--sizes and --widths take positive integers", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    start = time.perf_counter()
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    attn = [] if args.only == "softmax" else attention_rows(device, args.sizes, args.head_dims, (False, True),
                                                            atomic=not args.no_atomic)
    print(f"# attention: {time.perf_counter() - start:.0f} s (compiling included)", flush=True)
    soft = [] if args.only == "attention" else softmax_rows(device, args.widths)
    lines = summary(attn, soft)
    print("\n".join(lines) + f"\n# {time.perf_counter() - start:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "attention": attn, "softmax": soft,
                       "summary": lines}, f, indent=1)
    failed = any("failed" in k for r in attn + soft for k in r)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
