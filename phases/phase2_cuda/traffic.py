"""Exercise 2.4: the bytes the kernels really move, read from Nsight Compute's counters and set
against the counts the code predicts.

    lab run phase2.traffic          (needs `ncu` and a GPU whose counters it can read)
    python -m phases.phase2_cuda.traffic

Three counters per kernel, clocks left as found: global-load sectors at L1 (what the SMs ask for;
x 32 = global-load bytes), L2 read sectors requested by L1 (what reached L2), and DRAM bytes read
and written (what crossed the HBM interface). Global-load bytes have an exact prediction from the
code (`predicted_global_load_bytes`: the seed's vector add, the naive and the 16x16 tiled matmul,
whose ratio is the 8x that tiling buys); DRAM bytes depend on what L2 keeps, so they are set against
the compulsory minimum, each input read once and the output written once.
"""
from common import ncu
from common.exercise import Exercise, Needs, Result, row
from common.params import Float, Int
from common.standalone import run_alone

from .analysis import tiling_reduction
from .matmul import MAX_N

METRICS = ("l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum", "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
           "lts__t_sectors_srcunit_tex_op_read.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
           "gpu__time_duration.sum")
SECTOR_BYTES = 32


def predicted_global_load_bytes(kind: str, n: int) -> int:
    """fp32, 32-byte sectors, N a multiple of 16 (every tile full).
    - vector add, n elements: a warp reads 32 consecutive floats of a and of b, 4 sectors each: 8 n.
    - naive matmul, 16 x 16 blocks: a warp is 2 rows x 16 columns of C; per k it needs 2 floats of A
      (a sector each) and 16 consecutive floats of B (2 sectors, shared by both rows): 4 sectors,
      128 B; N^2 / 32 warps x N steps x 128 B = 4 N^3 (8 N^3 counted per thread).
    - tiled, T = 16: per tile step a warp loads 2 rows x 16 floats of A and of B, 8 sectors, 256 B;
      N^2 / 32 warps x N / 16 steps x 256 B = N^3 / 2: 8x fewer than naive."""
    if kind == "vector_add":
        return 2 * n * 4
    if kind == "naive":
        return 4 * n**3
    if kind == "tiled":
        return n**3 // 2
    raise ValueError(f"unknown kernel '{kind}'")


def compulsory_dram_bytes(kind: str, n: int) -> int:
    return 3 * n * 4 if kind == "vector_add" else 3 * n * n * 4


def profile(kind: str, n: int, timeout_s: float) -> list[dict]:
    return ncu.profile("phases.phase2_cuda.traffic_target", [kind, str(n)], METRICS, timeout_s, f"{kind} at {n}")


def metrics_of(kind: str, n: int, kernels: list[dict]) -> dict:
    """One profiled kernel's counters -> bytes, with the predictions and their ratios."""
    if len(kernels) != 1:
        raise ValueError(f"expected one profiled kernel for {kind}, got {[k['kernel'] for k in kernels]}")
    [k] = kernels
    load_bytes = k[METRICS[0]] * SECTOR_BYTES
    predicted = predicted_global_load_bytes(kind, n)
    dram = (k[METRICS[3]] or 0) + (k[METRICS[4]] or 0)
    compulsory = compulsory_dram_bytes(kind, n)
    return {"kernel": k["kernel"], "global_load_bytes": load_bytes,
            "global_load_requests": k[METRICS[1]],
            "predicted_global_load_bytes": predicted, "measured_over_predicted": load_bytes / predicted,
            "l2_read_bytes": k[METRICS[2]] * SECTOR_BYTES,
            "dram_bytes_read": k[METRICS[3]], "dram_bytes_write": k[METRICS[4]], "dram_bytes": dram,
            "compulsory_dram_bytes": compulsory, "dram_over_compulsory": dram / compulsory,
            "ncu_kernel_ms": (k[METRICS[5]] or 0) / 1e6}                    # ns -> ms


def footprint_bytes(p: dict) -> int:
    """What the profiled target allocates (fp32): a, b, c of the largest vector add, or A, B, C of the matmul."""
    return max(3 * 4 * max(p["vector_add_sizes"]), 3 * 4 * p["matmul_n"] ** 2)


def run(ctx, params):
    cases = [("vector_add", n) for n in params["vector_add_sizes"]] + \
            [(kind, params["matmul_n"]) for kind in ("naive", "tiled")]
    rows = []
    for kind, n in ctx.track(cases, "ncu kernels"):
        if ctx.wants(kind):
            rows.append(row(kind, {"kernel": kind, "n": n}, metrics=metrics_of(kind, n, profile(kind, n, params["timeout_s"]))))
    by = {(r["variant"], r["params"]["n"]): r["metrics"] for r in rows}
    naive, tiled = by.get(("naive", params["matmul_n"])), by.get(("tiled", params["matmul_n"]))
    return Result(rows, tiling_reduction(naive, tiled) if naive and tiled else {})


EXERCISE = Exercise(
    id="phase2.traffic", title="Nsight Compute: global-load, L2 and DRAM bytes of vector add, naive and tiled matmul",
    run=run, needs=Needs(cuda=True, nvidia=True, tools=("nvcc", "ncu")),
    params={"vector_add_sizes": Int([2**20], min=1, unit="fp32 elements", many=True),
            # The predicted counts assume N a multiple of 16 (full tiles); the kernels take any N.
            "matmul_n": Int(4096, min=1, max=MAX_N, unit="rows = columns (N x N < 2^31 elements)"),
            "timeout_s": Float(300, min=1, max=86400, unit="seconds per profiled kernel")},
    cpu_params={}, quick_params={"vector_add_sizes": [2**20], "matmul_n": 256, "timeout_s": 120},
    variants=("vector_add", "naive", "tiled"), footprint_bytes=footprint_bytes)


if __name__ == "__main__":
    run_alone(EXERCISE, {"vector_add_sizes": [2**20], "matmul_n": 512})
