"""A workload (an attention call, a decode step, a training step) predicted as the sum of its kernels.

Each kernel is timed by its own calibrated roofline, from ceilings `phase1.ceilings` measured on the
same machine (never fitted to the rows they predict):

    kernel_ms = count x (launch floor + max(FLOPs / its rate + exps / exp rate,  bytes / bandwidth))

* FLOPs go against the sustained matmul rate of their dtype (tensor-core kinds: MATMUL) or the
  CUDA-core rate (ELEMENTWISE: the fp32 rate with TF32 off, the SGEMM `phase1.ceilings` measures).
  A skinny matmul (GEMV: a decode step's projections) is its own regime: it reads its weight once
  at 1 FLOP per byte, and its bytes go at the GEMV bandwidth `phase1.ceilings` measures (a bf16
  one-row product of a Llama-sized weight), which need not be the copy rate, after a fixed part
  (the first bytes' latency, the last wave's tail: `phase1.ceilings` times two sizes, and a 30 MB
  projection is slower per byte than a 200 MB one; 0, said so, where unmeasured); its FLOPs at its
  dtype's matmul rate (a few rows through cuBLAS) or, with no dtype, the CUDA-core rate (a one-row
  Triton GEMV does not use the tensor cores).
* exps (softmax's exponentials) go against the special-function rate. A kernel whose products and
  exponentials run in the same warps one after the other (FlashAttention-2's loop) adds the two
  (`overlap=False`); a warp-specialised kernel (FlashAttention-3's ping-pong) overlaps them (max).
* the launch floor is that of how the kernel starts: a PyTorch op, a Triton kernel, a kernel inside
  a replayed CUDA graph. It ADDS to the kernel's work, as in the lab's one-roof calibrated model: the
  floor is what the harness's CUDA events show around an empty kernel (the device-side cost of
  starting one and seeing it end), and a kernel with work pays it before its work. `launch_adds=False`
  makes the floor a third roof instead (max): the choice for kernels whose launches hide under the
  previous kernel's work; on the committed phase 3 records the added floor is the closer one (the
  accuracy figures give both: common/workload_accuracy.py).
* an op of an eager training step (AUTOGRAD) also costs the host its dispatch under autograd: the
  forward op, its graph node, its backward op. While that exceeds the kernel, the GPU waits for the
  host, so such a kernel takes max(host time per autograd op, launch floor + its work); the host
  time is what `phase1.ceilings` measures for a chain of tiny autograd ops.

A workload's prediction is the sum over its kernels, plus host time where the host is on the
critical path (a synchronize per step, a copy the next step waits for): `host` lists those, each
named; plus collectives (a tensor-parallel step's all-reduces), each at a time measured on the
same machine (`collectives`: what, ms, count), not a roofline of ours. The one-roof prediction (every FLOP and byte in one roofline, one launch floor per kernel
added: `roofline.calibrated`) stays beside it, the seed's claim tested.

A ceiling not measured on this machine yet falls back to a stated value, and the prediction says
which in `fallbacks`: the exp rate to the spec sheet's (fp32 peak / 16: 16 exponentials against 128
fp32 FMAs per SM per clock on compute capability 8.x and 9.0, CUDA C++ Programming Guide's
arithmetic-instruction throughput table; FlashAttention-3's paper quotes 3.9 TFLOPS of special
functions on an H100 SXM5), a Triton kernel's launch floor and the host time of an autograd op to
the PyTorch op's floor, the GEMV bandwidth to the HBM copy rate, its fixed part to 0.

Torch-free: `lab predict` and the report use it without a GPU. Units in the names: ms, us, bytes.
"""
from dataclasses import dataclass, field, replace

from . import roofline

MATMUL, ELEMENTWISE, GEMV = "matmul", "elementwise", "gemv"   # where a kernel's FLOPs run, and GEMV's bytes
TORCH, TRITON, GRAPH, AUTOGRAD = "torch", "triton", "graph", "autograd"   # how a kernel starts
KINDS, LAUNCHES = (MATMUL, ELEMENTWISE, GEMV), (TORCH, TRITON, GRAPH, AUTOGRAD)
SFU_PER_FP32_FLOP = 1 / 16      # exp2 results per fp32 FLOP per SM per clock: 16 / (128 FMA x 2), sm_80 / sm_90
EXP_SPEC_SOURCE = ("spec sheet: fp32 peak / 16 (16 exp2 vs 128 fp32 FMA per SM per clock, CUDA C++ Programming "
                   "Guide throughput table); not measured on this machine yet")


@dataclass(frozen=True)
class Kernel:
    """One kernel a workload launches (`count` times, each identical). flops and bytes per launch:
    FLOPs, the fewest bytes through device memory, exponentials. `in_l2`: its working set is known to
    stay in L2 (read at the L2 copy rate)."""
    name: str
    kind: str
    flops: float
    bytes: float
    dtype: str | None = "bf16"
    exps: float = 0.0
    launch: str = TORCH
    count: int = 1
    overlap: bool = False                 # products and exponentials overlap (max) instead of adding
    in_l2: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kernel {self.name!r}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.launch not in LAUNCHES:
            raise ValueError(f"kernel {self.name!r}: launch {self.launch!r} is not one of {', '.join(LAUNCHES)}")
        if min(self.flops, self.bytes, self.exps) < 0 or self.count < 0:
            raise ValueError(f"kernel {self.name!r}: FLOPs, bytes, exps and count must be >= 0")


@dataclass(frozen=True)
class Workload:
    """Kernels in launch order, and host work on the critical path: (what, ms, count) triples, the
    ms a number or a ceiling key in µs resolved from the ceilings (e.g. ("synchronize", "sync_us", 1))."""
    name: str
    kernels: tuple[Kernel, ...]
    host: tuple[tuple[str, float | str, int], ...] = ()
    notes: tuple[str, ...] = field(default=())
    collectives: tuple[tuple[str, float, int], ...] = ()     # (what, ms each, count): measured, on the GPU's path

    def scaled(self, times: int, name: str | None = None) -> "Workload":
        """The same workload run `times` times back to back (a request's decode steps)."""
        return Workload(name or f"{times} x {self.name}",
                        tuple(replace(k, count=k.count * times) for k in self.kernels),
                        tuple((what, v, n * times) for what, v, n in self.host), self.notes,
                        tuple((what, ms, n * times) for what, ms, n in self.collectives))

    def timed_as(self, *, graph: bool = False, in_l2: bool = False) -> "Workload":
        """The workload as a harness timed it: replayed in a CUDA graph (every kernel at the graph
        floor), and/or with its working set warm in L2 (no flush between calls, and it fits)."""
        return replace(self, kernels=tuple(replace(k, launch=GRAPH if graph else k.launch, in_l2=in_l2 or k.in_l2)
                                           for k in self.kernels))

    def totals(self) -> dict:
        return {"flops": sum(k.flops * k.count for k in self.kernels),
                "bytes": sum(k.bytes * k.count for k in self.kernels),
                "exps": sum(k.exps * k.count for k in self.kernels),
                "launches": sum(k.count for k in self.kernels)}


def rates(ceilings: dict, spec_fp32_tflops: float | None = None) -> tuple[dict, list[str]]:
    """The rates the sum reads, from a ceilings summary, and the fallbacks taken (stated)."""
    fallbacks = []
    exp_per_s = ceilings.get("exp_per_s")
    if not exp_per_s:
        if not spec_fp32_tflops:
            raise ValueError("no measured exp rate (exp_per_s) and no spec fp32 peak to fall back to")
        exp_per_s = spec_fp32_tflops * 1e12 * SFU_PER_FP32_FLOP
        fallbacks.append(f"exp rate {exp_per_s / 1e12:.3g}e12/s: {EXP_SPEC_SOURCE}")
    triton_us = ceilings.get("triton_launch_us")
    if not triton_us:
        triton_us = ceilings["launch_us"]
        fallbacks.append(f"Triton launch floor {triton_us:.3g} us: the PyTorch op's measured floor stands in "
                         "(phase1.ceilings has no triton_launch row on this machine yet)")
    gemv_gbps, gemv_fixed_us = ceilings.get("gemv_slope_gbps"), ceilings.get("gemv_fixed_us")
    if not gemv_gbps or gemv_fixed_us is None:
        gemv_gbps, gemv_fixed_us = ceilings.get("gemv_gbps"), 0.0
        if not gemv_gbps:
            gemv_gbps = ceilings["hbm_gbps"]
            fallbacks.append(f"GEMV bandwidth {gemv_gbps:.4g} GB/s: the HBM copy rate stands in (phase1.ceilings has "
                             "no gemv row on this machine yet)")
        fallbacks.append("GEMV fixed time: unmeasured, taken as 0 (phase1.ceilings has no gemv_small row on this "
                         "machine yet; every GEMV at the large one's bytes per second)")
    autograd_us = ceilings.get("autograd_op_us")
    if not autograd_us:
        autograd_us = ceilings["launch_us"]
        fallbacks.append(f"autograd op host time {autograd_us:.3g} us: the PyTorch op's measured floor stands in "
                         "(phase1.ceilings has no autograd_op row on this machine yet)")
    graph_us = ceilings.get("graph_launch_us") or ceilings["launch_us"]
    if not ceilings.get("graph_launch_us"):
        fallbacks.append("graph replay floor: the PyTorch op's measured floor stands in (no graph_launch row)")
    out = {"hbm_gbps": ceilings["hbm_gbps"], "l2_gbps": ceilings.get("l2_gbps") or ceilings["hbm_gbps"],
           "gemv_gbps": gemv_gbps, "gemv_fixed_us": gemv_fixed_us, "matmul_tflops": dict(ceilings.get("matmul_tflops") or {}), "exp_per_s": exp_per_s,
           "launch_us": {TORCH: ceilings["launch_us"], TRITON: triton_us, GRAPH: graph_us, AUTOGRAD: ceilings["launch_us"]},
           "autograd_op_us": autograd_us}
    return out, fallbacks


def kernel_terms(k: Kernel, r: dict) -> dict:
    """One launch's roofs in ms: compute (FLOPs and exps, added or overlapped), memory, launch."""
    rate = k.dtype if k.kind == MATMUL or (k.kind == GEMV and k.dtype) else "fp32"
    peak = r["matmul_tflops"].get(rate) if k.flops else None
    if k.flops and not peak:
        raise ValueError(f"kernel {k.name!r}: no measured {rate} rate")
    products = roofline.compute_ms(k.flops, peak) if k.flops else 0.0
    exps = k.exps / r["exp_per_s"] * 1e3 if k.exps else 0.0
    compute = max(products, exps) if k.overlap else products + exps
    bandwidth = r["l2_gbps"] if k.in_l2 else r["gemv_gbps"] if k.kind == GEMV else r["hbm_gbps"]
    memory = roofline.memory_ms(k.bytes, bandwidth) if k.bytes else 0.0
    if k.kind == GEMV and k.bytes and not k.in_l2:
        memory += r["gemv_fixed_us"] / 1e3             # its first bytes' latency and last wave's tail
    return {"compute": compute, "products": products, "exps": exps, "memory": memory,
            "launch": r["launch_us"][k.launch] / 1e3}


def kernel_ms(k: Kernel, r: dict, launch_adds: bool = True) -> tuple[float, str]:
    """(ms of all `count` launches, the largest term: compute, exp, memory, launch, or host)."""
    t = kernel_terms(k, r)
    roofs = {"compute" if t["products"] >= t["exps"] else "exp": t["compute"], "memory": t["memory"],
             "launch": t["launch"]}
    bound = max(roofs, key=roofs.get)
    work = max(t["compute"], t["memory"])
    one = t["launch"] + work if launch_adds else max(t["launch"], work)
    if k.launch == AUTOGRAD and r["autograd_op_us"] / 1e3 > one:
        one, bound = r["autograd_op_us"] / 1e3, "host"
    return k.count * one, bound


def predict(w: Workload, ceilings: dict, spec_fp32_tflops: float | None = None, measured_ms: float | None = None,
            top: int = 3, launch_adds: bool = True) -> dict:
    """The summed prediction block: predicted_ms, its parts, the `top` kernels by time with their
    share, the one-roof prediction beside it, and the fallbacks taken."""
    r, fallbacks = rates(ceilings, spec_fp32_tflops)
    parts, by_bound = [], {}
    for k in w.kernels:
        ms, bound = kernel_ms(k, r, launch_adds)
        parts.append((k.name, ms, bound))
        by_bound[bound] = by_bound.get(bound, 0.0) + ms
    host = [(what if n == 1 else f"{what} (x{n})", n * (v if isinstance(v, (int, float)) else ceilings[v] / 1e3))
            for what, v, n in w.host]
    host_ms = sum(ms for _, ms in host)
    comm = [(what if n == 1 else f"{what} (x{n})", n * ms) for what, ms, n in w.collectives]
    comm_ms = sum(ms for _, ms in comm)
    predicted = sum(ms for _, ms, _ in parts) + host_ms + comm_ms
    if host_ms:
        by_bound["host"] = host_ms
    if comm_ms:
        by_bound["communication"] = comm_ms
    by_name: dict = {}                # a kernel of many steps (an offline run's) ranked as one
    for name, ms, bound in parts + [(what, ms, "host") for what, ms in host] + \
            [(what, ms, "communication") for what, ms in comm]:
        total, top_ms, top_bound = by_name.get(name, (0.0, -1.0, bound))
        by_name[name] = (total + ms, *((ms, bound) if ms > top_ms else (top_ms, top_bound)))
    ranked = sorted(((n, total, b) for n, (total, _, b) in by_name.items()), key=lambda p: -p[1])
    t = w.totals()
    main = max(w.kernels, key=lambda k: k.flops * k.count).dtype if w.kernels and t["flops"] else None
    one = roofline.calibrated(t["flops"], t["bytes"], main, ceilings, measured_ms, launches=t["launches"])
    return {"model": "summed roofline: each kernel its launch floor " + ("+" if launch_adds else "or")
                     + " max(compute + exp, memory), plus host",
            "workload": w.name, "predicted_ms": predicted,
            "bound": max(by_bound, key=by_bound.get) if by_bound else None,
            "by_bound_ms": by_bound, "host_ms": host_ms, "communication_ms": comm_ms, "kernels": len(w.kernels), **t,
            "top": [{"kernel": n, "ms": ms, "share": ms / predicted if predicted else None, "bound": b}
                    for n, ms, b in ranked[:top]],
            "one_roof_ms": one["predicted_ms"], "one_roof_bound": one["bound"],
            "measured_ms": measured_ms,
            "measured_over_predicted": measured_ms / predicted if measured_ms and predicted else None,
            "one_roof_measured_over_predicted": one["measured_over_predicted"],
            "fallbacks": fallbacks, "notes": list(w.notes), "ceilings_record": ceilings.get("record")}
