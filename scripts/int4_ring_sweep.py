"""Sweep the int4 kernel's weight stream: cp.async ring depth x K split, per matrix and batch, beside
bf16 cuBLAS and a device copy in the same run, and print each config's GB/s and % of the copy.

    python scripts/int4_ring_sweep.py [--depths 4,8] [--shapes 8b,unseen,held_out,small] [--batches 1,4]
                                      [--json FILE]

The ring depth only matters at batch 1 (from 2 rows the weights stream through registers).

Why: if the kernel at batch 1 were bound by the bytes it keeps in flight (Little's law: bandwidth x
latency / SMs per SM), a deeper ring (chunks of 512 B per warp, a compile-time constant) or a finer
K split (more warps per SM) would speed it; this sweep measures both, so the launch rule is set from
measurements rather than guessed. Each config is checked against fp32 x @ dequantize(W)^T before it is
timed (a wrong result prints 'wrong', no time). Weights rotate over copies that together exceed L2
four times, so every call streams from DRAM as in the engine; times are CUDA-graph replays of 20
calls (common.timing's harness), the copy common.exercise's.
"""
import argparse
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common.exercise import measure_copy_gbps  # noqa: E402
from common.timing import benchmark  # noqa: E402
from phases.phase2_cuda import build  # noqa: E402
from phases.phase5_inference.engine import int4_mma as im  # noqa: E402
from phases.phase5_inference.engine import quantize as qz  # noqa: E402

SHAPES = {  # name -> (N, K): the 8B's matrices, and matrices of models the launch rule never saw
    "8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
    "unseen": [("q7_qkv", 4608, 3584), ("q7_o", 3584, 3584), ("q7_gate_up", 37888, 3584),
               ("q7_down", 3584, 18944), ("l13_o", 5120, 5120), ("l13_down", 5120, 13824),
               ("s2_o", 2048, 2048), ("s2_up", 16384, 2048)],
    # Held out: matrices the batch-1 rule was not set on (Llama-3.2-3B-, Phi-3-mini-, Mistral-Nemo- and
    # Llama-70B-like), to test it rather than fit it.
    "held_out": [("l3_qkv", 5120, 3072), ("l3_o", 3072, 3072), ("l3_gate_up", 16384, 3072), ("l3_down", 3072, 8192),
                 ("phi3_qkv", 9216, 3072), ("nemo_qkv", 6144, 5120), ("nemo_o", 5120, 4096),
                 ("l70_qkv", 10240, 8192), ("l70_o", 8192, 8192), ("l70_down", 8192, 28672)],
    # Small: few tiles and a short K (Llama-3.2-1B- and Qwen2-0.5B-like), where the tiles alone leave
    # SMs without a block unless K is split.
    "small": [("l1_qkv", 3072, 2048), ("l1_o", 2048, 2048), ("l1_gate_up", 16384, 2048), ("l1_down", 2048, 8192),
              ("q05_qkv", 1152, 896), ("q05_down", 896, 4864)],
}
CALLS_PER_GRAPH = 20


def depth_source(depth: int, folder: Path) -> Path:
    path = folder / f"int4_mma_depth{depth}.cu"
    path.write_text(f"#define LAB_ASYNC_DEPTH {depth}\n" + im.SOURCE.read_text())
    return path


def per_call_ms(calls, device) -> float:
    """Median ms per call of `calls` run back to back in one CUDA graph (rotating weights), timed by
    the lab's harness without an L2 flush: the rotation already keeps the weights out of L2."""
    t = benchmark(lambda: [call() for call in calls], device, warmup_ms=5.0, target_ms=50.0, flush_l2=False,
                  graph_reps=1)
    return t.median_ms / len(calls)


def parsed(args) -> tuple[list[int], list[float], list[tuple], list[int]]:
    """(depths, split factors, shapes, batches) from the command line; ValueError naming what is wrong."""
    try:
        depths = [int(d) for d in args.depths.split(",")]
        factors = [float(f) for f in args.splits.split(",")]
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise ValueError(f"--depths and --batches take integers and --splits numbers, got {args.depths!r}, "
                         f"{args.batches!r} and {args.splits!r}") from None
    if any(b < 1 or b > im.MMA_MAX_M for b in batches):
        raise ValueError(f"--batches: rows from 1 to {im.MMA_MAX_M} (the tensor-core kernel's), got {args.batches}")
    if any(d < 2 or d & (d - 1) or d > 16 for d in depths):
        raise ValueError(f"--depths: powers of two from 2 to 16 (the ring's slot index is a mask), got {args.depths}")
    if any(f <= 0 for f in factors):
        raise ValueError(f"--splits: factors > 0 on the rule's K split, got {args.splits}")
    unknown = [key for key in args.shapes.split(",") if key not in SHAPES]
    if unknown:
        raise ValueError(f"--shapes: unknown set {unknown[0]!r}; known: {', '.join(SHAPES)}")
    return depths, factors, [s for key in args.shapes.split(",") for s in SHAPES[key]], batches


def sweep_matrix(out, name, n, k, m, g, mw, mws, wb, sms, depths, factors, sources, copy) -> None:
    """Time one matrix at `m` rows: bf16 cuBLAS, then each depth x K split factor of the rule's, each
    checked first; print a line per config and append its row to out["rows"]."""
    dev = mw.wq.device
    x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
    ref = x.float() @ im.dequantize_relaid(mw).float().t()
    bf16_ms = per_call_ms([(lambda ww=ww: F.linear(x, ww)) for ww in (wb * CALLS_PER_GRAPH)[:CALLS_PER_GRAPH]], dev)
    rule = im.plan(m, n, k, sms)
    rule_split = rule["wk"] * rule["splits"]
    bytes_ = mw.nbytes() + 2 * m * (k + n)
    print(f"\n{name} N={n} K={k} batch {m}  int4 {bytes_ / 1e6:.1f} MB  bf16 cuBLAS {bf16_ms * 1e3:.1f} us "
          f"({2 * n * k / bf16_ms / 1e6:.0f} GB/s)  rule k_split {rule_split}")
    for d in depths:
        im.SOURCE = sources[d]
        for f in factors:
            ks = max(1, int(rule_split * f))
            if ks & (ks - 1) or ks > im.WARPS * im.MAX_SPLITS or (f != 1 and ks == rule_split):
                continue
            cfg = im.plan(m, n, k, sms, k_split=ks)
            try:
                y = im.matmul(x, mw, cfg)
                err = (y.float() - ref).abs().max().item() / (ref.abs().max().item() + 1e-6)
                if err > 2e-2:
                    print(f"  depth {d:2d} k_split {ks:3d}: wrong (max rel err {err:.3g})")
                    continue
                calls = [(lambda w4=w4, c=cfg: im.matmul(x, w4, c)) for w4 in (mws * CALLS_PER_GRAPH)[:CALLS_PER_GRAPH]]
                ms = per_call_ms(calls, dev)
            except Exception as exc:  # noqa: BLE001 - a config that cannot run is printed with why
                print(f"  depth {d:2d} k_split {ks:3d}: {type(exc).__name__}: {str(exc).splitlines()[-1][:120]}")
                continue
            gbps = bytes_ / ms / 1e6
            tag = " <- rule" if ks == rule_split and d == 4 else ""
            print(f"  depth {d:2d} k_split {ks:3d} (wk {cfg['wk']} splits {cfg['splits']}): {ms * 1e3:6.1f} us "
                  f"{gbps:6.0f} GB/s {100 * gbps / copy:5.1f}% of copy  {bf16_ms / ms:4.2f}x bf16{tag}")
            out["rows"].append({"matrix": name, "n": n, "k": k, "batch": m, "depth": d, "k_split": ks, "us": ms * 1e3,
                                "gbps": gbps, "pct_copy": 100 * gbps / copy, "x_bf16": bf16_ms / ms,
                                "bf16_us": bf16_ms * 1e3})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="4,8")
    ap.add_argument("--shapes", default="8b,unseen")
    ap.add_argument("--splits", default="0.5,1,2,4", help="factors on the rule's K split")
    ap.add_argument("--batches", default="1", help="activation rows (from 2 the depth does not matter)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        depths, factors, shapes, batches = parsed(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: int4_ring_sweep needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    sms = im.sm_count(dev)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    folder = Path(tempfile.mkdtemp(prefix="int4_sweep_"))
    sources = {d: depth_source(d, folder) for d in depths}
    arch = build.device_arch()
    with ThreadPoolExecutor(len(depths)) as pool:         # nvcc in parallel: each build is minutes of templates
        list(pool.map(lambda d: build.build(sources[d], arch), depths))
    copy = measure_copy_gbps(SimpleNamespace(device=dev), 1 << 30)
    print(f"{torch.cuda.get_device_name()}  SMs {sms}  L2 {l2 >> 20} MiB  copy {copy:.0f} GB/s")
    out = {"device": torch.cuda.get_device_name(), "copy_gbps": copy, "rows": []}
    for name, n, k in shapes:
        g = torch.Generator(device=dev).manual_seed(n * 31 + k)
        w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        qw = qz.quantize_int4(w, 128)
        mw = im.relayout(qw).to(dev)
        copies = max(2, -(-4 * l2 // mw.nbytes()))
        mws = [mw] + [im.MmaInt4Weight(mw.wq.clone(), mw.meta.clone(), mw.out_features, mw.in_features,
                                       mw.group_size, mw.fp16_scales) for _ in range(copies - 1)]
        wb = [w] + [w.clone() for _ in range(max(1, -(-4 * l2 // (w.numel() * 2))) - 1)]
        for m in batches:
            sweep_matrix(out, name, n, k, m, g, mw, mws, wb, sms, depths if m == 1 else depths[:1], factors, sources, copy)
        del mws, wb
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
