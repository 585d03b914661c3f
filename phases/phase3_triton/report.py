"""Phase 3's README blocks, declared (rendered by common/render.py): each Triton kernel's table
beside the same run's library rows, the goals, two plots, the findings and the headline."""
import pandas as pd

from common.formats import elements, missing, num, pct, ratio, size_bytes
from common.frame import by_hardware, value
from common.spec import Goal, Goals, Phase, Plot, Table, Text, col, ident

from . import analysis, counts, plots
from .findings import findings
from .rows import ADD, BWD, FWD, MATMUL, SOFTMAX, attn_top, group, largest, lib, matmul_best, square, triton_rows

ATTN_KEYS = ["params.dtype", "params.head_dim", "params.causal", "params.n"]


def beside(exercise: str, ours: tuple, others: tuple, on: list, sort: list | None = None):
    """Rows of our variants, each with columns 'variant:metric' (e.g. 'torch:metrics.gbps') from the
    same record's ok row of that variant with the same `on` params: the library beside the kernel."""
    def rows(view):
        df = view.latest(exercise)
        if not len(df):
            return df
        out = df[df["variant"].isin(ours)]
        keys = [c for c in on if c in df.columns]       # a record set with no shape rows has no params.m
        for key in others:
            variant, metric = key.split(":")
            lib_rows = df[(df["variant"] == variant) & (df["status"] == "ok")]
            out = out.merge(lib_rows[["path", *keys, metric]].rename(columns={metric: key}), on=["path", *keys], how="left")
        return out.sort_values(sort, kind="stable") if sort else out
    return rows


def not_timed(view, rows) -> str:
    """The library rows of these records that did not run (skipped or failed), so no table hides them."""
    df = view.frame.df
    df = df[df["path"].isin(set(rows["path"])) & (df["status"] != "ok") & ~df["variant"].isin(set(rows["variant"]))]
    if "params.group" in rows:
        df = df[df["params.group"].isin(set(rows["params.group"]))]
    counts = df.groupby(["variant", "status", "reason"], dropna=False).size()
    items = [f"`{v}` {s} in {k} row{'s' * (k > 1)} ({why})" for (v, s, why), k in counts.items()]
    return "Not timed: " + "; ".join(items) + "." if items else ""


def yes_no(x) -> str:
    return "-" if missing(x) else ("yes" if x else "no")


def batch_heads(r) -> str:
    return f"{int(r['params.batch'])} x {int(r['params.heads'])}"


CONFIG = col("config", "metrics.config")
def per_gpu(keep):
    """A brief (the CSV keeps every row): `keep(rows of one GPU)` for each GPU."""
    return lambda rows: pd.concat([keep(g) for _, g in rows.groupby("hardware", sort=True)]) if len(rows) else rows


def _largest(k: int, key: str):
    return per_gpu(lambda g: g[g[key].isin(sorted(set(g[key]))[-k:])])


VECTOR_ADD = Table(ADD, ADD, rows=beside(ADD, ("triton",), ("copy:metrics.gbps", "torch:metrics.gbps"), ["params.n"],
                                         sort=["params.n"]), note=not_timed, brief=_largest(3, "params.n"), columns=(
    ident("elements", "params.n", elements), ident("working set", "params.working_set_bytes", size_bytes),
    col("copy GB/s", "copy:metrics.gbps", num), col("torch.add GB/s", "torch:metrics.gbps", num),
    col("Triton GB/s", "metrics.gbps", num), col("% of copy", "metrics.pct_of_copy_bandwidth", pct),
    col("% of torch.add", "metrics.pct_of_library", pct), CONFIG))

SOFTMAX_SEED = Table("phase3.softmax_seed", SOFTMAX, where=group("seed"), columns=(
    ident("shape", lambda r: f"{num(r['params.rows'])} x {num(r['params.cols'])}"), ident("variant", "variant"),
    col("bytes formula (its own)", lambda r: analysis.own(r, "bytes_formula")),
    col("bytes it moved", lambda r: analysis.own(r, "bytes"), size_bytes),
    col("time (µs)", lambda r: 1000 * r["metrics.ms"], num), col("GB/s (its own bytes)", lambda r: analysis.own(r, "gbps"), num),
    col("effective GB/s", "metrics.effective_gbps", num), col("% of copy (effective)", "metrics.pct_of_copy_effective", pct)))

SOFTMAX_SWEEP = Table(SOFTMAX, SOFTMAX, where=group("sweep"), note=not_timed,
                      brief=per_gpu(lambda g: g[g["params.cols"].isin([32, 512, 8192, 65536])]), rows=beside(
    SOFTMAX, ("triton",), ("torch:metrics.gbps", "unfused:metrics.effective_gbps"), ["params.rows", "params.cols"]), columns=(
    ident("row length", "params.cols", num), ident("rows", "params.rows", num),
    col("torch.softmax GB/s", "torch:metrics.gbps", num), col("unfused GB/s (effective)", "unfused:metrics.effective_gbps", num),
    col("Triton GB/s", "metrics.gbps", num), col("% of copy", "metrics.pct_of_copy_bandwidth", pct),
    col("% of torch.softmax", "metrics.pct_of_library", pct),
    col("kernel: config", lambda r: f"{value(r, 'metrics.kernel', '-')}: {value(r, 'metrics.config', '-')}")))

def matmul_shape(r) -> str:
    """N for an N x N x N row, M x N x K for a user's shape (`--param shapes=`)."""
    m, k = value(r, "params.m"), value(r, "params.k")
    return num(r["params.n"]) if m is None else f"{num(m)} x {num(r['params.n'])} x {num(k)}"


MATMUL_TABLE = Table(MATMUL, MATMUL, rows=beside(MATMUL, ("triton", "triton_tma"), ("cublas:metrics.tflops",),
                                                 ["params.m", "params.n", "params.k", "params.dtype"]), note=not_timed,
                     brief=per_gpu(lambda g: largest(square(g))), columns=(
    ident("dtype", "params.dtype"), ident("N (or M x N x K)", matmul_shape), ident("variant", "variant"),
    col("TFLOP/s", "metrics.tflops", num), col("cuBLAS TFLOP/s", "cublas:metrics.tflops", num),
    col("% of cuBLAS", "metrics.pct_of_library", pct), col("% of peak", "metrics.pct_of_peak_tflops", pct), CONFIG))

FWD_SEED = Table("phase3.flash_attention_seed", FWD, where=group("seed"), note=not_timed, rows=beside(
    FWD, ("triton",), ("naive:metrics.ms", "naive:metrics.tflops"), ["params.group", *ATTN_KEYS]), columns=(
    ident("N", "params.n", num), ident("naive's N x N matrix", "metrics.attn_matrix_bytes", size_bytes),
    col("naive ms", "naive:metrics.ms", num), col("Triton ms", "metrics.ms", num),
    col("Triton speedup", "metrics.speedup_vs_naive", ratio), col("Triton TFLOP/s", "metrics.tflops", num),
    col("naive TFLOP/s", "naive:metrics.tflops", num),
    col("fastest SDPA backend (fp32)", lambda r: f"{lib(value(r, 'metrics.library'))}: {num(value(r, 'metrics.library_ms'))} ms")))

SDPA = tuple(f"{v}:metrics.tflops" for v in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient"))
ATTN_COLUMNS = (
    ident("dtype", "params.dtype"), ident("head dim", "params.head_dim", num), ident("causal", "params.causal", yes_no),
    ident("N", "params.n", num), ident("batch x heads", batch_heads), col("Triton TFLOP/s", "metrics.tflops", num),
    col("fastest library", "metrics.library", lib), col("% of fastest", "metrics.pct_of_library", pct))
ATTN_MORE = (*(col(f"{lib(k.split(':')[0])} TFLOP/s", k, num) for k in SDPA), CONFIG)      # the CSV's
FWD_MAIN = Table(FWD, FWD, where=group("main"), note=not_timed, columns=ATTN_COLUMNS, more=ATTN_MORE,
                 rows=beside(FWD, ("triton",), SDPA, ["params.group", *ATTN_KEYS]),
                 brief=lambda rows: rows[(rows["params.dtype"] == "bf16") & (rows["params.head_dim"] == 128)
                                         & ~rows["params.causal"].astype(bool)])
BWD_TABLE = Table(BWD, BWD, note=not_timed, columns=ATTN_COLUMNS, more=ATTN_MORE, rows=beside(BWD, ("triton",), SDPA, ATTN_KEYS),
                  brief=lambda rows: rows[rows["params.head_dim"] == 128])


# ------------------------------------------------------------------------------ goals
def beyond_l2(d):
    d = triton_rows(d)
    far = [analysis.far_beyond_l2(value(r, "params.working_set_bytes"), value(r, "summary.l2_bytes")) for _, r in d.iterrows()]
    return d[far] if len(d) else d


COPY_ANCHOR = "same-run copy of the same bytes, the practical ceiling; 90% is the lab's bar"
GOALS = Goals("phase3.goals", (
    Goal(f"vector add, working set ≥ {analysis.L2_MULTIPLE}x L2: % of copy", ADD, "metrics.pct_of_copy_bandwidth", 90,
         COPY_ANCHOR, pick="min", where=beyond_l2, detail=lambda r: f"worst, at {elements(r['params.n'])} elements"),
    Goal("fused softmax, row-length sweep: % of copy", SOFTMAX, "metrics.pct_of_copy_bandwidth", 90, COPY_ANCHOR,
         pick="min", where=lambda d: triton_rows(d, group="sweep"), detail=lambda r: f"worst row length: {num(r['params.cols'])}"),
    Goal("fused softmax, row-length sweep: % of torch.softmax", SOFTMAX, "metrics.pct_of_library", 100,
         "same-run torch.softmax: a fused kernel should not lose to the library", pick="min",
         where=lambda d: triton_rows(d, group="sweep"), detail=lambda r: f"worst row length: {num(r['params.cols'])}"),
    Goal("Triton bf16 matmul at the largest square N: % of cuBLAS", MATMUL, "metrics.pct_of_library", 90,
         "same-run cuBLAS; the lab's bar for a hand-written kernel", stretch=95,
         where=lambda d: largest(square(triton_rows(d, ("triton", "triton_tma"), dtype="bf16"))),
         detail=lambda r: f"{r['variant']}, N = {num(r['params.n'])}, {num(r['metrics.tflops'])} TFLOP/s"),
    Goal("flash attention fwd, bf16, d=128, non-causal, largest N: TFLOP/s", FWD, "metrics.tflops", 500,
         "the lab's bar for the H200: about half its 989.5 TFLOP/s dense bf16 peak (hardware.yaml)", stretch=600,
         fmt=num, where=attn_top, detail=lambda r: f"N = {num(r['params.n'])}, {pct(r['metrics.pct_of_library'])} "
                                                   f"of {lib(r['metrics.library'])}"),
))


def headline(view) -> list[str]:
    out = []
    for _, got in sorted(by_hardware(view.frame, [MATMUL, FWD]).items()):
        parts, m = [], matmul_best(got[MATMUL]) if MATMUL in got else None
        if m is not None:
            parts.append(f"bf16 matmul {pct(m['metrics.pct_of_library'])} of cuBLAS at N = {num(m['params.n'])}")
        top = attn_top(got[FWD]) if FWD in got else []
        if len(top):
            t = top.iloc[-1]
            parts.append(f"flash attention fwd {num(t['metrics.tflops'])} TFLOP/s (bf16, d=128, N = {num(t['params.n'])}, "
                         f"{pct(t['metrics.pct_of_library'])} of {lib(t['metrics.library'])})")
        if parts:
            out.append(f"{next(iter(got.values())).iloc[0]['hardware_name']}: " + ", ".join(parts))
    return out


# ------------------------------------------------------------------------------ older records
# Records written before issue 19 stored the unfused softmax's and naive attention's own traffic as
# their bytes (and naive's dtype as fp32), and no launch counts. The calibrated prediction of a row
# without one stored is computed here from counts.py applied to the row's params, not from the
# stored counts. The accuracy groups a problem's variants by their STORED counts (dtype and FLOPs;
# bytes where there are no FLOPs), so a row whose stored counts would set it apart from its problem
# (an old naive row: fp32, not tf32; an old unfused row, had the grouping used bytes) gets no
# calibrated prediction: it is a slower variant of its problem, which the accuracy does not count.
SEPARATED = {(SOFTMAX, "unfused"), (FWD, "naive")}
def recalibrated(r, records) -> dict | None:
    """A phase-3 row's calibrated prediction at report time, from counts.py's formulas."""
    from common import roofline
    from common.calibration import ceilings_for
    ceilings = ceilings_for(records, r["hardware"], value(r, "started"))
    measured = value(r, "prediction.measured_ms") or value(r, "metrics.ms")
    if not ceilings or r["source"] != "measured" or not measured:
        return None
    params = {k[len("params."):]: v for k, v in r.items() if k.startswith("params.") and value(r, k) is not None}
    try:
        c = counts.row_count(r["exercise"], r["variant"], params, {"kernel": value(r, "metrics.kernel")})
    except (KeyError, ValueError):
        return None
    if c is None or (value(r, "prediction.dtype"), value(r, "prediction.flops", 0)) != (c.dtype, c.flops) \
            or ((r["exercise"], r["variant"]) in SEPARATED and value(r, "prediction.bytes") != c.bytes):
        return None
    flush = value(r, "timing.flush_l2")
    out = roofline.calibrated(c.flops, c.bytes, c.dtype, ceilings, measured,
                              working_set_bytes=value(r, "params.working_set_bytes") or c.bytes,
                              warm=flush is not None and not flush, graph_reps=value(r, "timing.graph_reps"),
                              launches=c.launches)
    return {**out, "computed": "at report time, from phase 3's counts.py applied to the row's params"}


PHASE = Phase(3, "Triton kernels", "phase3_triton", headline=headline,
              calibrators={ex: recalibrated for ex in (ADD, SOFTMAX, MATMUL, FWD, BWD)}, blocks=(
    GOALS, VECTOR_ADD, SOFTMAX_SEED, SOFTMAX_SWEEP, MATMUL_TABLE, FWD_SEED, FWD_MAIN, BWD_TABLE,
    Plot("phase3.bandwidth_plot", "phase3_bandwidth", (ADD, SOFTMAX), plots.bandwidth,
         "Vector add and softmax bandwidth on the {name}, beside a copy and PyTorch"),
    Plot("phase3.attention_plot", "phase3_attention", (FWD,), plots.attention,
         "Attention forward TFLOP/s against N on the {name}: Triton and each SDPA backend"),
    Text("phase3.findings", findings, "_No phase 3 records yet._")))
