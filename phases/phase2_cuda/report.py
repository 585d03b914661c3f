"""Phase 2's README blocks, declared (rendered by common/render.py): goals, tables, plots, findings."""
import pandas as pd

from common.above_roof import bandwidth_pct
from common.formats import elements, num, num4, pct, ratio
from common.frame import by_hardware, find, value
from common.spec import Goal, Goals, Phase, Plot, Table, Text, col, ident

from . import plots
from .analysis import ladder_sizes, ladder_steps, tiling_reduction
from .findings import softmax_findings
from .rows import MM, SM, TR, VA, row_length
from .rungs import BASELINES, FP32_RUNGS, MMA_RUNGS, RUNGS, VARIANTS, WGMMA_RUNGS


def _groups(rows: pd.DataFrame):
    """(source, hardware) -> its rows: one record's rows each, as Frame.latest gives them."""
    return rows.groupby(["source", "hardware"], sort=False) if len(rows) else []


def _of_library(r) -> str:
    lib = RUNGS[r["variant"]].library if r["variant"] in RUNGS else None
    return f"{pct(value(r, 'metrics.pct_of_library'))} of {lib}" if lib else "(baseline)"


def _metrics(r) -> dict:
    return {k.removeprefix("metrics."): v for k, v in r.items() if k.startswith("metrics.")}


# ------------------------------------------------------------------------------ tables
VECTOR_ADD = Table("phase2.vector_add", VA, columns=(
    ident("kernel", "variant"), ident("elements", "params.n", elements), col("ms", "metrics.ms", num4),
    col("GB/s", "metrics.gbps", num), col("% of spec BW", bandwidth_pct),
    col("% of copy (same run)", "metrics.pct_of_copy_bandwidth", pct)))


def ladder_rows(view) -> pd.DataFrame:
    """Every rung at the two largest sizes all of them ran, in ladder order, with what each bought
    over the rung it builds on (analysis.ladder_steps, the function the exercise stores it with)."""
    out = []
    for _, mine in _groups(view.latest(MM)):
        ok = mine[(mine["status"] == "ok") & mine["variant"].isin(VARIANTS)]
        points = list(zip(ok["variant"], ok["params.n"], ok["metrics.tflops"]))
        steps = ladder_steps(points)
        for n in ladder_sizes(points):
            at = ok[ok["params.n"] == n]
            at = at.assign(**{"ladder.base": [steps[(v, n)][0] for v in at["variant"]],
                              "ladder.factor": [steps[(v, n)][1] for v in at["variant"]],
                              "ladder.rank": [VARIANTS.index(v) for v in at["variant"]]})
            out.append(at.sort_values("ladder.rank"))
    return pd.concat(out) if out else pd.DataFrame()


def _bought(r) -> str:
    base = value(r, "ladder.base")
    return f"{ratio(r['ladder.factor'])} over {base}" if base else "(first rung)"


def largest_size(rows: pd.DataFrame) -> pd.DataFrame:
    """Per GPU, the ladder at its largest size (the CSV has both sizes)."""
    return pd.concat([g[g["params.n"] == g["params.n"].max()] for _, g in rows.groupby("hardware", sort=True)])


LADDER = Table("phase2.ladder", MM, rows=ladder_rows, prediction=False, brief=largest_size, columns=(
    ident("N", "params.n", num), ident("rung", "variant"), ident("dtype", "params.dtype"),
    col("TFLOP/s", "metrics.tflops", num), col("what it bought", _bought),
    col("% of cuBLAS (same run)", _of_library)))


def closest_to_library(rows: pd.DataFrame) -> pd.DataFrame:
    """At each size, the rung with the highest share of each cuBLAS baseline."""
    keep = []
    for _, mine in _groups(rows):
        ok = mine[(mine["status"] == "ok") & mine["variant"].isin(VARIANTS) & mine["metrics.pct_of_library"].notna()]
        for n in sorted(set(ok["params.n"])):
            for lib in BASELINES:
                d = ok[(ok["params.n"] == n) & (ok["variant"].map(lambda v: RUNGS[v].library) == lib)]
                if len(d):
                    keep.append(d["metrics.pct_of_library"].astype(float).idxmax())
    return rows.loc[keep]


MATMUL = Table("phase2.matmul", MM, brief=lambda rows: closest_to_library(rows[rows["params.n"] == rows["params.n"].max()]),
               columns=(
    ident("variant", "variant"), ident("N", "params.n", num), ident("dtype", "params.dtype"),
    ident("B stored", lambda r: "column-major" if value(r, "params.b_layout") == "col" else "row-major"),
    col("ms", "metrics.ms", num4), col("TFLOP/s", "metrics.tflops", num),
    col("% of cuBLAS (same run)", _of_library)))

SOFTMAX = Table("phase2.softmax", SM, brief=lambda rows: rows[(rows["variant"] == "cuda") & (rows["params.dtype"] == "fp32")],
                columns=(
    ident("dtype", "params.dtype"), ident("rows x cols", lambda r: f"{num(r['params.rows'])} x {num(r['params.cols'])}"),
    ident("variant (kernel)", lambda r: f"{r['variant']} ({r['metrics.kernel']})" if value(r, "metrics.kernel") else r["variant"]),
    col("ms", "metrics.ms", num4), col("GB/s", "metrics.gbps", num),
    col("% of copy (same run)", "metrics.pct_of_copy_bandwidth", pct),
    col("speedup vs torch", "metrics.speedup_vs_torch", ratio)))


def tiling_note(view, rows) -> str:
    out = []
    for _, mine in _groups(rows):
        naive = find(mine, "naive")
        tiled = find(mine, "tiled", n=naive["params.n"]) if naive is not None else None
        if tiled is not None:
            t = tiling_reduction(_metrics(naive), _metrics(tiled))
            out.append(f"Naive over tiled on the {naive['hardware_name']} at N = {num(naive['params.n'])}: global-load "
                       f"bytes {ratio(t['tiling_global_load_reduction'])} (predicted "
                       f"{ratio(t['predicted_global_load_reduction'])}), L2 read bytes "
                       f"{ratio(t['tiling_l2_read_reduction'])}, DRAM bytes {ratio(t['tiling_dram_reduction'])}.")
    return "\n\n".join(out)


TRAFFIC = Table("phase2.traffic", TR, prediction=False, note=tiling_note, columns=(
    ident("kernel", "variant"), ident("n (elements or N)", "params.n", num),
    col("global-load bytes (ncu)", "metrics.global_load_bytes", num),
    col("predicted", "metrics.predicted_global_load_bytes", num),
    col("measured/predicted", "metrics.measured_over_predicted", lambda x: num(x, 3)),
    col("L2 read bytes", "metrics.l2_read_bytes", num), col("DRAM bytes", "metrics.dram_bytes", num),
    col("DRAM / compulsory", "metrics.dram_over_compulsory", lambda x: num(x, 3))))

META = ("exercise", "hardware", "hardware_name", "source", "citation", "started", "commit", "path", "order")


def build_rows(view) -> pd.DataFrame:
    """One row per kernel: the ptxas report stored in the newest matmul and vector-add records."""
    out = []
    for ex in (MM, VA):
        for _, mine in _groups(view.latest(ex)):
            first = mine.iloc[0]
            build = (view.record(first["path"]).get("summary") or {}).get("build") or {}
            for kernel, res in sorted((build.get("resources") or {}).items()):
                if isinstance(res, dict):
                    out.append({**{k: first[k] for k in META}, "variant": kernel, "status": "ok", "reason": None,
                                **{f"build.{k}": v for k, v in res.items()},
                                "build.arch": res.get("arch") or build.get("arch")})
    return pd.DataFrame(out)


def newest_build(rows: pd.DataFrame) -> pd.DataFrame:
    """The newest build only: every GPU here runs the same sm_90a binary (the CSV has each GPU's)."""
    return rows[rows["path"] == rows.sort_values("started")["path"].iloc[-1]] if len(rows) else rows


BUILD = Table("phase2.build", MM, rows=build_rows, prediction=False, brief=newest_build, columns=(
    ident("kernel", "variant"), col("arch", "build.arch"), col("registers", "build.registers", num),
    col("shared memory bytes", "build.smem_bytes", num), col("spill stores bytes", "build.spill_stores_bytes", num),
    col("spill loads bytes", "build.spill_loads_bytes", num)))

MATMUL_PLOT = Plot("phase2.matmul_plot", "phase2_matmul", (MM,), plots.matmul,
                   "Every matmul rung against N on the {name}, cuBLAS dashed")
SOFTMAX_PLOT = Plot("phase2.softmax_plot", "phase2_softmax", (SM,), plots.softmax,
                    "Every softmax kernel's share of copy bandwidth against row length on the {name}")


# ------------------------------------------------------------------------------ goals
def _at(n: int, variants: tuple):
    return lambda rows: rows[(rows["params.n"] == n) & rows["variant"].isin(variants)]


def _rung(r) -> str:
    return f"{r['variant']}, {num(r['metrics.tflops'])} TFLOP/s"


def _largest_n(rows):
    return rows[(rows["params.n"] == rows["params.n"].max()) & (rows["variant"] != "copy")]


def _cuda(group: str):
    return lambda rows: rows[(rows["variant"] == "cuda") & (rows["params.group"] == group)]


CUBLAS = "same-run cuBLAS"
BAR = "the lab's bar for a hand-written kernel against the library"
GOALS = Goals("phase2.goals", (
    Goal("CUDA-core FP32 matmul, best rung at N = 4,096: % of cuBLAS FP32 (TF32 off)", MM, "metrics.pct_of_library", 90,
         f"{CUBLAS} FP32, the same arithmetic; {BAR}", where=_at(4096, FP32_RUNGS), detail=_rung),
    *(Goal(f"mma.sync BF16 at N = {n:,}: % of cuBLAS BF16", MM, "metrics.pct_of_library", 55,
           f"{CUBLAS} BF16; lower than the others because mma.sync cannot reach Hopper's tensor-core peak "
           "(see 'Why mma.sync stops short')", where=_at(n, MMA_RUNGS), detail=_rung) for n in (4096, 8192)),
    *(Goal(f"wgmma + TMA BF16 at N = {n:,}: % of cuBLAS BF16 (same B storage)", MM, "metrics.pct_of_library", 90,
           f"{CUBLAS} BF16 with B column-major; {BAR}, parity the stretch", stretch=100, where=_at(n, WGMMA_RUNGS),
           detail=_rung) for n in (4096, 8192)),
    Goal("vector add far beyond L2 (largest n): % of copy (same run)", VA, "metrics.pct_of_copy_bandwidth", 90,
         "a same-run torch copy of the same n: the bandwidth a kernel can reach", where=_largest_n,
         detail=lambda r: f"{r['variant']}, {elements(r['params.n'])} elements"),
    Goal("softmax far beyond L2 (`cuda` dispatcher), worst row length: % of copy (same run)", SM,
         "metrics.pct_of_copy_bandwidth", 90, "a same-run copy of the same tensor: the bytes softmax must move",
         pick="min", where=_cuda("sweep"), detail=row_length),
    Goal("softmax faster than torch.softmax at every row length (worst)", SM, "metrics.speedup_vs_torch", 1.0,
         "same-run torch.softmax: the library to beat", op=">", pick="min", where=_cuda("sweep"), fmt=ratio,
         detail=row_length),
    Goal("the seed's 4,096 x 32 softmax (in L2): speedup over torch.softmax", SM, "metrics.speedup_vs_torch", 1.0,
         "the seed write-up's softmax exercise (phase 2), against same-run torch.softmax", op=">",
         where=_cuda("seed"), fmt=ratio),
))


def headline(view) -> list[str]:
    """Per GPU: the best hand-written rung of each dtype at the largest N, as a share of cuBLAS."""
    out = []
    for _, got in sorted(by_hardware(view.frame, [MM]).items()):
        mine = got[MM]
        mine = mine[(mine["status"] == "ok") & mine["variant"].isin(VARIANTS) & mine["metrics.pct_of_library"].notna()]
        mine = mine[mine["params.n"] == mine["params.n"].max()] if len(mine) else mine
        parts = []
        for dtype in ("fp32", "bf16"):
            d = mine[mine["params.dtype"] == dtype]
            if len(d):
                best = d.loc[d["metrics.pct_of_library"].astype(float).idxmax()]
                parts.append(f"{dtype} `{best['variant']}` {pct(best['metrics.pct_of_library'])} of cuBLAS at "
                             f"N = {num(best['params.n'])}")
        if parts:
            out.append(f"{got[MM].iloc[0]['hardware_name']}: " + ", ".join(parts))
    return out


PHASE = Phase(2, "CUDA kernels", "phase2_cuda",
              blocks=(GOALS, VECTOR_ADD, LADDER, MATMUL, MATMUL_PLOT, SOFTMAX, SOFTMAX_PLOT,
                      Text("phase2.softmax_findings", softmax_findings, "_No phase 2 softmax records yet._"),
                      TRAFFIC, BUILD),
              headline=headline)
