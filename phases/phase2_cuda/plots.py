"""Phase 2's plots: every matmul rung's TFLOP/s against N beside cuBLAS, and every softmax kernel's
share of copy bandwidth against row length. matplotlib is imported only when a plot is drawn."""
from common.plotting import pyplot, save

from .rungs import BASELINES, RUNGS, VARIANTS


def _mine(view, exercise: str, hw: str):
    rows = view.latest(exercise, measured_only=True)
    rows = rows[(rows["hardware"] == hw) & (rows["status"] == "ok")] if len(rows) else rows
    return rows



def matmul(view, hw: str, path) -> None:
    """Two panels (fp32 on CUDA cores, bf16 on tensor cores): TFLOP/s against N, cuBLAS dashed."""
    plt = pyplot()
    rows = _mine(view, "phase2.matmul", hw)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, precision in zip(axes, ("fp32", "bf16")):
        for variant in (*BASELINES, *VARIANTS):
            base = variant in BASELINES
            if (base and (variant == "cublas_fp32") != (precision == "fp32")) or \
                    (not base and RUNGS[variant].precision != precision):
                continue
            pts = rows[rows["variant"] == variant].sort_values("params.n")
            if len(pts):
                ax.plot(pts["params.n"], pts["metrics.tflops"], "--" if base else "-o", label=variant,
                        color="black" if variant == "cublas_bf16" else None, markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (N x N x N)")
        ax.set_ylabel("TFLOP/s (median)")
        ax.set_title(f"{precision} rungs and cuBLAS, same run")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save(fig, path)


def softmax(view, hw: str, path) -> None:
    """Two panels (fp32, bf16): % of a same-run copy against row length, one line per kernel."""
    plt = pyplot()
    rows = _mine(view, "phase2.softmax", hw)
    rows = rows[rows["params.group"] == "sweep"] if len(rows) else rows
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    for ax, dtype in zip(axes, ("fp32", "bf16")):
        mine = rows[rows["params.dtype"] == dtype] if len(rows) else rows
        for variant in dict.fromkeys(mine["variant"]) if len(mine) else ():
            if variant == "copy":
                continue
            pts = mine[mine["variant"] == variant].sort_values("params.cols")
            style = "--" if variant == "torch" else ("-o" if variant == "cuda" else ":.")
            ax.plot(pts["params.cols"], pts["metrics.pct_of_copy_bandwidth"], style, label=variant,
                    linewidth=2.5 if variant == "cuda" else 1, color="black" if variant == "torch" else None)
        ax.axhline(100, color="tab:gray", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("row length (columns), 2^28 elements per tensor")
        ax.set_title(f"{dtype}: % of a copy of the same tensor, same run")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("% of copy bandwidth")
    save(fig, path)
