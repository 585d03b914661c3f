"""Phase 3's plots: bandwidth of vector add and softmax against size, and attention TFLOP/s against
sequence length. matplotlib is imported only when a plot is drawn."""
from common.plotting import pyplot, save


def _rows(view, exercise: str, hw: str) -> list[dict]:
    """The ok rows of the newest measured record of `exercise` on `hw`."""
    latest = view.latest(exercise, measured_only=True)
    latest = latest[latest["hardware"] == hw] if len(latest) else latest
    rec = view.record(latest.iloc[0]["path"]) if len(latest) else {}
    return [r for r in rec.get("rows", []) if r["status"] == "ok"]


def _name(view, hw: str) -> str:
    df = view.frame.df
    return df[df["hardware"] == hw]["hardware_name"].iloc[-1]


def _save(fig, ax, path):
    ax.grid(True, which="both", alpha=0.3)
    save(fig, path)


def bandwidth(view, hw: str, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    add = _rows(view, "phase3.vector_add", hw)
    for variant, style in (("copy", "k--"), ("torch", "s-"), ("triton", "o-")):
        pts = sorted((r["params"]["working_set_bytes"] / 2**20, r["metrics"]["gbps"]) for r in add if r["variant"] == variant)
        if pts:
            ax.plot(*zip(*pts), style, label=f"vector add: {variant}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("vector add working set (MiB)")
    ax.set_ylabel("GB/s")
    handles, labels = ax.get_legend_handles_labels()
    soft = [r for r in _rows(view, "phase3.softmax", hw) if r["params"].get("group") == "sweep"]
    curves = [(variant, style, sorted((r["params"]["cols"], r["metrics"].get("effective_gbps") or 0)
                                      for r in soft if r["variant"] == variant))
              for variant, style in (("torch", "v-"), ("unfused", "x-"), ("triton", "^-"))]
    if any(pts for _, _, pts in curves):
        top = ax.twiny()                    # softmax shares the GB/s axis, on its own x axis
        for variant, style, pts in curves:
            if pts:
                top.plot(*zip(*pts), style, alpha=0.7, label=f"softmax: {variant} (top axis)")
        top.set_xscale("log", base=2)
        top.set_xlabel("softmax row length (elements), effective GB/s = 2·M·N·4 / time")
        h2, l2 = top.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, fontsize=7, loc="lower right")
    ax.set_title(f"Phase 3 bandwidth: {_name(view, hw)}")
    _save(fig, ax, path)


def attention(view, hw: str, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    rows = [r for r in _rows(view, "phase3.flash_attention", hw) if r["params"].get("group") == "main"
            and r["params"].get("dtype") == "bf16" and r["params"].get("head_dim") == 128 and not r["params"].get("causal")]
    for variant, style in (("triton", "o-"), ("sdpa_cudnn", "s--"), ("sdpa_flash", "v--"), ("sdpa_efficient", "x:")):
        pts = sorted((r["params"]["n"], r["metrics"]["tflops"]) for r in rows if r["variant"] == variant)
        if pts:
            ax.plot(*zip(*pts), style, label=variant)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("TFLOP/s (4·B·H·N²·D / time)")
    ax.set_title(f"Attention forward, bf16, head dim 128, non-causal: {_name(view, hw)}")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    _save(fig, ax, path)
