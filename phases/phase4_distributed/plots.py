"""Phase 4's plot: bus bandwidth against size, every collective and our ring, one panel per GPU
count, with the link's one-way bandwidth. matplotlib is imported only when a plot is drawn."""
from common.plotting import pyplot, save

STYLES = {"all_reduce": ("o-", "tab:blue", 2.0, "all-reduce (NCCL)"), "ring_allreduce": ("s-", "tab:red", 2.0, "all-reduce (ours: ring)"),
          "all_gather": ("^--", "tab:green", 1.0, "all-gather"), "reduce_scatter": ("v--", "tab:purple", 1.0, "reduce-scatter"),
          "sendrecv": ("d:", "tab:gray", 1.0, "send/recv shift")}


def busbw(rows, hw: str, path) -> None:
    """rows: report.groups() of phase4.interconnect; the preferred group per GPU count of `hw`."""
    plt = pyplot()
    mine = rows[(rows["hardware"] == hw) & rows["preferred"] & (rows["status"] == "ok")]
    panels = sorted(set(mine["ranks"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
    for ax, n in zip(axes[0], panels):
        g = mine[mine["ranks"] == n].sort_values("params.size_bytes")
        for op, (style, color, width, label) in STYLES.items():
            pts = g[g["params.op"] == op]
            if len(pts):
                ax.plot(pts["params.size_bytes"], pts["metrics.busbw_gbps"], style, color=color, lw=width, ms=4,
                        label=label if g.iloc[0]["gpu"] else label.replace("NCCL", "gloo"))
        link = g["metrics.link_gbps"].dropna()
        if len(link) and g.iloc[0]["gpu"]:
            ax.axhline(link.iloc[0], color="black", ls="--", lw=1,
                       label=f"link, one way: {link.iloc[0]:,.0f} GB/s (hardware.yaml)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes, nccl-tests convention)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(g.iloc[0]["hardware_name"])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    save(fig, path)
