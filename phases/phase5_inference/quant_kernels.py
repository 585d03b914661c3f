"""Exercise 5.3: weight-only quantized matmuls (W4A16, W8A16) against bf16 cuBLAS, at the model's
projection matrices and decode-to-prefill batch sizes.

    lab run phase5.quant_kernels [--param batches=[1,16] --param matrices=[gate_up]]

y [M, N] = x [M, K] @ W^T with K the input and N the output features. Llama-3.1-8B's matrices, as
K x N: qkv 4096 x 6144, o 4096 x 4096, gate_up 4096 x 28672, down 14336 x 4096 (M is the batch).
The same seeded bf16 weight is quantized once per format (engine/quantize.py: int4 group 128 with
zero points, int8 per output row), then every variant is checked against fp32
dequantize-then-matmul of that format (bf16_cublas: against fp32 x @ W^T) before it is timed:
  bf16_cublas     F.linear on the bf16 weight: the baseline of every ratio
  w4_fused        quant_gemm's Triton W4A16 kernel (GEMV-shaped with split-K for M <= 16, tiled above)
  w4_naive        dequantize the whole weight to bf16 in memory, then F.linear (the seed's slow path)
  w4_library      torch._weight_int4pack_mm (tinygemm) in its own packed format, converted once
  w4_cuda_bulk    the CUDA kernel (engine/int4_mma.cu: tensor-core mma on weights re-laid at load),
                  weights streamed with bulk copies into shared memory (Hopper's copy engine)
  w4_cuda         the kernel by its rule of M (int4_mma.kernel_of): up to 16 rows the mma tiling (a
                  cp.async ring at batch 1, a ring of 16-byte loads in registers above: both measured
                  faster than the bulk copies), 17 to 128 rows the rows tiling (activation windows
                  shared by the block, two tiles per warp), above that dequantize-once + cuBLAS: the
                  path the engine takes (QuantizedLinear path "cuda")
  w8_fused, w8_naive, w8_library: the same for int8 (torch._weight_int8pack_mm)
Counts: FLOPs = 2·M·N·K for every variant; bytes = the format's packed weight + scales (+ zeros)
+ x read and y written (quant_analysis.matmul_bytes; tinygemm's int4 keeps a bf16 scale and a bf16
zero per group, and the CUDA kernel a 4-byte (scale, zero) per row and group on tiles of 16 rows and
64 inputs: each its own bytes). The naive path's algorithm_bytes add the bf16 copy it writes and
reads back (so do w4_cuda's above 128 rows; its tilings add a weight read per 64 rows past the first). Rows carry ms, GB/s of those bytes, % of the roofline (its time over the measured),
and speedup_vs_bf16_cublas from the same run (int4 rows also speedup_vs_w4_fused, the Triton rung, and
speedup_vs_w4_library, tinygemm); the summary has, per matrix and variant, the batch
where time stops being flat (measured) beside the ridge's prediction.
"""
import torch
import torch.nn.functional as F

from common.checks import CHECK_CHUNK
from common.exercise import Exercise, Needs, Result, Work, reference_check
from common.params import Bool, Choice, Int
from common.standalone import run_alone
from common.variant_rows import attempt, skipped

from .predictions import kernel_lists
from .predictions import quant_analysis as qa
from .decode_attention import measure_as_engine, time_alternatives
from .engine import SHAPES, int4_mma, named, quant_gemm, quantize

REFERENCE = "fp32 x @ dequantize(W)^T (the variant's own format; bf16: the bf16 weight)"
VARIANTS = ("bf16_cublas", "w4_naive", "w4_fused", "w4_cuda_bulk", "w4_cuda", "w4_library", "w8_fused",
            "w8_naive", "w8_library")
CUDA_VARIANTS = ("w4_cuda_bulk", "w4_cuda")
MATRICES = ("qkv", "o", "gate_up", "down")
FORMAT_OF = {"bf16": "bf16", "w4": "int4", "w8": "int8"}
NAIVE_LAUNCHES = {"w4": 7, "w8": 4}    # torch ops of dequantize() (approximate) and the matmul
FLAT_FACTOR = 1.25                     # "memory-bound" while time stays within this factor of batch 1's
BYTES_FORMULA = "packed weight + scales (+ zeros) + 2·M·(K + N) (x read, y written, bf16)"
FLOPS_FORMULA = "2·M·N·K"


# ------------------------------------------------------------------------------ the problems
def matrix_shape(model: str, matrix: str) -> tuple[int, int]:
    """(K in, N out) of one of the model's projections (q, k and v fused; gate and up fused)."""
    s = named(model)
    return {"qkv": (s.hidden_size, s.q_size + 2 * s.kv_size), "o": (s.q_size, s.hidden_size),
            "gate_up": (s.hidden_size, 2 * s.intermediate_size), "down": (s.intermediate_size, s.hidden_size)}[matrix]


def problems(params) -> list[dict]:
    out = []
    for matrix in params["matrices"]:
        k_in, n_out = matrix_shape(params["model"], matrix)
        for batch in params["batches"]:
            out.append({"model": params["model"], "matrix": matrix, "k_in": k_in, "n_out": n_out, "batch": batch,
                        "group_size": params["group_size"], "dtype": "bf16"})
    return out


def variant_weight_bytes(p: dict, variant: str) -> int:
    prefix = variant.split("_")[0]
    if variant == "w4_library":                      # tinygemm: packed nibbles + bf16 (scale, zero) pairs
        return p["n_out"] * p["k_in"] // 2 + 4 * p["n_out"] * -(-p["k_in"] // p["group_size"])
    if variant in CUDA_VARIANTS:                     # tiles of 16 x 64 nibbles + 4 bytes per (row, group)
        n_pad = int4_mma.cdiv(p["n_out"], int4_mma.TILE_N) * int4_mma.TILE_N
        k_pad = int4_mma.cdiv(p["k_in"], int4_mma.CHUNK_K) * int4_mma.CHUNK_K
        return n_pad * k_pad // 2 + 4 * n_pad * -(-p["k_in"] // p["group_size"])
    return qa.weight_bytes(FORMAT_OF[prefix], p["n_out"], p["k_in"], p["group_size"])


def problem_bytes(p: dict, variant: str) -> int:
    """The fewest bytes this variant's format must move (its roofline's bytes)."""
    return variant_weight_bytes(p, variant) + qa.ACTIVATION_BYTES * p["batch"] * (p["k_in"] + p["n_out"])


def algorithm_bytes(p: dict, variant: str) -> int:
    """What the variant's algorithm moves: the naive path (and the CUDA rule's dequantized path above
    ROWS_MAX_M rows) also writes and reads a bf16 copy; the CUDA tilings read the weights once per 64 rows."""
    extra = 2 * 2 * p["n_out"] * p["k_in"] if variant.endswith("_naive") else 0
    if variant == "w4_cuda":
        if int4_mma.uses_dequantized(p["batch"]):
            extra = 2 * 2 * p["n_out"] * p["k_in"]
        else:
            extra = (int4_mma.weight_reads(p["batch"]) - 1) * variant_weight_bytes(p, variant)
    return problem_bytes(p, variant) + extra


def problem_flops(p: dict) -> int:
    return qa.matmul_flops(p["batch"], p["n_out"], p["k_in"])


def fused_config(p: dict, variant: str, sms: int) -> dict:
    bits = 4 if variant.startswith("w4") else 8
    return quant_gemm.default_config(bits, p["batch"], p["n_out"], p["k_in"], p["group_size"], sms)


def variant_launches(p: dict, variant: str, sms: int) -> int:
    if variant == "w4_cuda":
        return int4_mma.launches(p["batch"])
    if variant.endswith("_fused"):
        return quant_gemm.launches(fused_config(p, variant, sms))
    if variant.endswith("_naive"):
        return NAIVE_LAUNCHES[variant.split("_")[0]]
    return 1


def predicted_sms() -> int:
    from .decode_attention import predicted_sms as sms
    return sms()


def work(params) -> list[Work]:
    sms = predicted_sms()
    return [Work(f"{v} {p['matrix']} {p['k_in']}x{p['n_out']} batch={p['batch']}", problem_flops(p),
                 problem_bytes(p, v), "bf16", launches=variant_launches(p, v, sms))
            for p in problems(params) for v in VARIANTS]


def predicted_workloads(params) -> list:
    """`lab predict`'s summed rows: each call from its counts, its weight read at the GEMV rate (kernel_lists)."""
    return kernel_lists.stored_count_workloads(EXERCISE.id, [(w, {}) for w in work(params)])


def footprint_bytes(params) -> int:
    """Largest matrix: bf16 weight (2 B/weight), an fp32 dequantized reference (4), the naive path's
    temporaries (int32 nibbles and bf16 copies, ~10), both quantized formats and tinygemm's copies
    (~3), the CUDA kernel's re-laid copy (~1), plus x, y and the fp32 reference output of the largest batch."""
    most = 0
    for p in problems(params):
        weights = p["n_out"] * p["k_in"]
        acts = p["batch"] * (p["k_in"] + p["n_out"]) * (2 + 4) + min(CHECK_CHUNK, p["batch"] * p["n_out"]) * 8 * 3
        most = max(most, 20 * weights + acts)
    return most


# ------------------------------------------------------------------------------ the exercise
def make_matrix(matrix: str, k_in: int, n_out: int, group_size: int, device) -> dict:
    """The seeded bf16 weight and its two quantized formats, made once per matrix."""
    g = torch.Generator(device=device).manual_seed(MATRICES.index(matrix) * 7919 + k_in + n_out)
    w = (torch.randn(n_out, k_in, device=device, generator=g) * 0.02).to(torch.bfloat16)
    return {"bf16": w, "w4": quantize.QuantizedLinear(quantize.quantize_int4(w, group_size)),
            "w8": quantize.QuantizedLinear(quantize.quantize_int8(w))}


def dequantized_fp32(weights: dict, prefix: str) -> torch.Tensor:
    return weights["bf16"].float() if prefix == "bf16" else weights[prefix].weight_format.dequantize(torch.float32)


def fused_launcher(x, module, prefix: str):
    """config -> one fused call on this problem's weight."""
    qw = module.weight_format
    if prefix == "w4":
        return lambda cfg: quant_gemm.w4a16_matmul(x, qw.qweight, qw.scales, qw.zeros, qw.group_size, cfg)
    return lambda cfg: quant_gemm.w8a16_matmul(x, qw.qweight, qw.scales, cfg)


def run_problem(ctx, params, p: dict, weights: dict, sms: int, tuning: dict) -> list[dict]:
    g = torch.Generator(device=ctx.device).manual_seed(p["batch"] * 31 + p["k_in"])
    x = torch.randn(p["batch"], p["k_in"], device=ctx.device, generator=g).to(torch.bfloat16)
    out = torch.empty(p["batch"], p["n_out"], dtype=torch.bfloat16, device=ctx.device)
    size = {k: p[k] for k in ("model", "matrix", "k_in", "n_out", "batch", "group_size", "dtype")}
    refs: dict = {}

    def reference(prefix):
        if prefix not in refs:
            refs.clear()                                     # one fp32 reference alive at a time
            refs[prefix] = x.float() @ dequantized_fp32(weights, prefix).t()
        return refs[prefix]

    def call(variant):
        if variant in CUDA_VARIANTS:
            mw = weights["w4_mma"]
            if variant == "w4_cuda":
                return lambda: int4_mma.multiply(x, mw)
            cfg = int4_mma.plan(p["batch"], p["n_out"], p["k_in"], sms, bulk=True)
            return lambda: int4_mma.matmul(x, mw, cfg)
        prefix, path = variant.split("_")
        if prefix == "bf16":
            return lambda: F.linear(x, weights["bf16"])
        module = weights[prefix]
        if path == "fused":
            launch, cfg = fused_launcher(x, module, prefix), fused_config(p, variant, sms)
            return lambda: launch(cfg)

        def forward(m=module, mode=path):
            m.path = mode
            return m(x)
        return forward

    rows = []
    for variant in VARIANTS:
        if not ctx.wants(variant):
            continue
        prefix = variant.split("_")[0]
        if variant.endswith("_library"):
            why = quantize.library_unavailable(weights[prefix].weight_format, x)
            if why:
                rows.append(skipped(variant, size, why))
                continue
        if variant in CUDA_VARIANTS:
            why = int4_mma.unavailable(weights["w4"].weight_format, x)
            if not why and variant == "w4_cuda_bulk" and not int4_mma.bulk_copies(x.device):
                why = "the bulk-copy stream needs compute capability 9.0 (Hopper) or newer"
            if why:
                rows.append(skipped(variant, size, why))
                continue
            if "w4_mma" not in weights:
                weights["w4_mma"] = int4_mma.relayout(weights["w4"].weight_format)
        cost = {"flops": problem_flops(p), "bytes_moved": problem_bytes(p, variant), "dtype": "bf16",
                "launches": variant_launches(p, variant, sms)}

        def make_row(variant=variant, prefix=prefix, cost=cost):
            fn = call(variant)
            fn()                                             # library formats converted, kernels compiled
            check = reference_check(ctx, out, lambda: out.copy_(fn()), reference(prefix), REFERENCE, precision="bf16")
            return measure_as_engine(ctx, params, variant, size, fn, check, cost)
        r = attempt(variant, size, make_row)
        r["metrics"]["bytes_formula"] = BYTES_FORMULA
        r["metrics"]["flops_formula"] = FLOPS_FORMULA
        r["metrics"]["algorithm_bytes"] = algorithm_bytes(p, variant)
        if variant in CUDA_VARIANTS and ctx.is_cuda:
            r["metrics"]["config"] = (int4_mma.plan(p["batch"], p["n_out"], p["k_in"], sms, bulk=True)
                                      if variant == "w4_cuda_bulk" else
                                      int4_mma.chosen_config(p["batch"], p["n_out"], p["k_in"], p["group_size"], sms))
            r["metrics"]["dequantized_then_cublas"] = variant == "w4_cuda" and int4_mma.uses_dequantized(p["batch"])
        if variant.endswith("_fused"):
            r["metrics"]["config"] = fused_config(p, variant, sms)
            if params["tune"] and r["status"] == "ok":
                launch, bits = fused_launcher(x, weights[prefix], prefix), 4 if prefix == "w4" else 8
                candidates = quant_gemm.candidate_configs(bits, p["batch"], p["n_out"], p["k_in"], p["group_size"], sms)
                tuning[f"{variant} {p['matrix']} batch={p['batch']}"] = time_alternatives(
                    ctx, params, candidates, launch,
                    lambda cfg, launch=launch, prefix=prefix: reference_check(
                        ctx, out, lambda: out.copy_(launch(cfg)), reference(prefix), REFERENCE, precision="bf16")())
        rows.append(r)
    add_ratios(ctx, p, rows)
    return rows


def add_ratios(ctx, p: dict, rows: list[dict]) -> None:
    """% of the roofline (its time for the variant's bytes and FLOPs over the measured time) and
    the speedup over bf16 cuBLAS from the same run."""
    roofs = ctx.roofs("bf16")
    base = next((r for r in rows if r["variant"] == "bf16_cublas" and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] != "ok":
            continue
        ms = r["metrics"]["ms"]
        roof_ms = max(problem_bytes(p, r["variant"]) / (roofs.bandwidth_gbps * 1e6),
                      problem_flops(p) / (roofs.peak("bf16") * 1e9))
        r["metrics"]["roofline_ms"] = roof_ms
        r["metrics"]["pct_of_roofline"] = 100 * roof_ms / ms
        if base is not None:
            r["metrics"]["speedup_vs_bf16_cublas"] = base["metrics"]["ms"] / ms
        if r["variant"].startswith("w4_"):
            for rung in ("w4_fused", "w4_library"):
                other = next((o for o in rows if o["variant"] == rung and o["status"] == "ok"), None)
                if other is not None:
                    r["metrics"][f"speedup_vs_{rung}"] = other["metrics"]["ms"] / ms


def memory_bound_summary(ctx, params, rows: list[dict]) -> dict:
    """Per matrix and variant: the first batch whose time exceeds FLAT_FACTOR x the smallest batch's
    (measured), beside the ridge's prediction for the variant's format."""
    roofs = ctx.roofs("bf16")
    out = {}
    for matrix in params["matrices"]:
        k_in, n_out = matrix_shape(params["model"], matrix)
        for variant in VARIANTS:
            timed = sorted((r["params"]["batch"], r["metrics"]["ms"]) for r in rows
                           if r["variant"] == variant and r["params"]["matrix"] == matrix and r["status"] == "ok")
            if not timed:
                continue
            first_ms = timed[0][1]
            stops = next((b for b, ms in timed if ms > FLAT_FACTOR * first_ms), None)
            fmt = FORMAT_OF[variant.split("_")[0]]
            out[f"{matrix} {variant}"] = {
                "measured_first_batch_not_flat": stops,
                "predicted_memory_bound_until_batch": round(qa.memory_bound_until_batch(
                    fmt, n_out, k_in, params["group_size"], roofs.peak("bf16"), roofs.bandwidth_gbps), 1)}
    return out


def run(ctx, params):
    rows, sms, tuning = [], quant_gemm.sm_count(ctx.device), {}
    for matrix in ctx.track(params["matrices"], "matrices"):
        k_in, n_out = matrix_shape(params["model"], matrix)
        weights = make_matrix(matrix, k_in, n_out, params["group_size"], ctx.device)
        for p in [q for q in problems(params) if q["matrix"] == matrix]:
            rows += run_problem(ctx, params, p, weights, sms, tuning)
        del weights
        if ctx.is_cuda:
            torch.cuda.empty_cache()
    return Result(rows, {"memory_bound": memory_bound_summary(ctx, params, rows), "tuning": tuning,
                         "bytes_convention": BYTES_FORMULA + "; naive: + the bf16 copy written and read "
                                                             "(algorithm_bytes)",
                         "flops_convention": FLOPS_FORMULA,
                         "matrices_k_by_n": {m: "x".join(map(str, matrix_shape(params["model"], m)))
                                             for m in params["matrices"]},
                         "flat_factor": FLAT_FACTOR})


EXERCISE = Exercise(
    id="phase5.quant_kernels",
    title="Weight-only int4 and int8 matmuls (naive, Triton, CUDA, tinygemm) vs bf16 cuBLAS, Llama-3.1-8B matrices",
    run=run, needs=Needs(cuda=True, modules=("triton",)),
    params={"model": Choice("llama-3.1-8b", tuple(SHAPES), help="whose projection matrices"),
            "matrices": Choice(list(MATRICES), MATRICES, many=True, help="projections, K x N in the docstring"),
            "batches": Int([1, 4, 16, 64, 256], min=1, max=8192, many=True, unit="activation rows (M)"),
            "group_size": Int(128, choices=quantize.GROUP_SIZES, unit="int4 inputs per (scale, zero)"),
            "cuda_graphs": Bool(True, help="time each call as a CUDA-graph replay (the engine's way); else eagerly"),
            "tune": Bool(False, help="also time quant_gemm.candidate_configs per fused problem (summary.tuning)")},
    cpu_params={"model": "tiny", "batches": [1, 3, 17]},
    quick_params={"matrices": ["o"], "batches": [1, 16]},
    variants=VARIANTS, footprint_bytes=footprint_bytes, work=work, workloads=predicted_workloads)


if __name__ == "__main__":
    run_alone(EXERCISE, {"matrices": ["o", "down"], "batches": [1, 16, 64]})
