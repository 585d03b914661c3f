"""Phase 5's plots, one PNG per GPU from its newest record: the batching curve (throughput and TPOT
against concurrency, measured beside predicted), the bandwidth each way to decode reaches,
quantized decode's tok/s against the bytes each token reads, and speculative decoding's speedup
against k. matplotlib is imported only when a plot is drawn."""
from common.plotting import pyplot, save

from .goal_model import of_8b


def _ok_rows(view, exercise: str, hw: str, only_8b: bool = False) -> list[dict]:
    """The newest ok rows of `exercise` on `hw`; with `only_8b`, only those measured on the 8B shape."""
    rows = view.latest(exercise, measured_only=True)
    rows = rows[(rows["hardware"] == hw) & (rows["status"] == "ok")]
    return [r for _, r in (of_8b(rows) if only_8b else rows).iterrows()]


def batching(view, hw: str, path) -> None:
    plt = pyplot()
    rows = sorted(_ok_rows(view, "phase5.batching", hw), key=lambda r: r["params.concurrency"])
    c = [r["params.concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    ax.plot(c, [r["metrics.output_tok_s"] for r in rows], "o-", color="tab:blue", label="output tok/s, measured")
    ax.plot(c, [r["metrics.predicted_output_tok_s"] for r in rows], "--", color="tab:blue", label="output tok/s, roofline")
    if all("metrics.calibrated_output_tok_s" in r and r["metrics.calibrated_output_tok_s"] == r["metrics.calibrated_output_tok_s"]
           for r in rows):
        ax.plot(c, [r["metrics.calibrated_output_tok_s"] for r in rows], ":", color="tab:blue",
                label="output tok/s, calibrated roofline")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    right = ax.twinx()
    right.plot(c, [r["metrics.tpot_median_ms"] for r in rows], "s-", color="tab:red", label="median TPOT, measured")
    right.plot(c, [r["prediction.predicted_ms"] for r in rows], "--", color="tab:red", label="TPOT, roofline")
    right.set_ylabel("ms per output token", color="tab:red")
    right.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize=8)
    ax.set_title(f"Continuous batching, {rows[0]['params.model']} ({rows[0]['hardware_name']})")
    save(fig, path)


def decode_bandwidth(view, hw: str, path) -> None:
    plt = pyplot()
    rows = [r for r in _ok_rows(view, "phase5.ttft_decode", hw) if "metrics.gbps" in r and r["metrics.gbps"] == r["metrics.gbps"]
            and r["variant"] != "lab-engine-prefill"]
    labels = [f"{r['variant']}\n{r['params.model']}" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    ax.bar(labels, [r["metrics.gbps"] for r in rows], color="tab:blue")
    copy = rows[0]["metrics.copy_gbps"] if rows else None
    if copy:
        ax.axhline(copy, color="black", linestyle="--", label=f"copy bandwidth measured in the run ({copy:,.0f} GB/s)")
        ax.legend(fontsize=8)
    for i, r in enumerate(rows):
        ax.text(i, r["metrics.gbps"], f"{r['metrics.pct_of_copy_roofline']:.0f}%", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("GB/s of weights + KV read per token")
    ax.set_title(f"Batch-1 decode bandwidth ({rows[0]['hardware_name'] if rows else hw})")
    save(fig, path)


def quant_tok_s(view, hw: str, path) -> None:
    """Decode tok/s of the 8B shape (batch / step time) against bytes read per token (the step's weight
    and KV bytes over the batch) for every variant and batch, and the roofline tok/s = bandwidth / bytes: a
    point on the line moves its bytes at the copy bandwidth measured in the run."""
    plt = pyplot()
    rows = _ok_rows(view, "phase5.quant_engine", hw, only_8b=True)
    fig, ax = plt.subplots(figsize=(8, 5.2))
    colors = {"bf16": "black", "int8_fused": "tab:green", "int4_fused": "tab:blue", "int4_cuda": "tab:orange",
              "int4_library": "tab:purple", "int4_naive": "tab:red"}
    markers = {1: "o", 8: "s", 64: "^"}
    for r in rows:
        batch = int(r["params.batch"])
        ax.scatter(r["metrics.bytes_per_token"] / 1e9, r["metrics.decode_tok_s"], color=colors.get(r["variant"], "gray"),
                   marker=markers.get(batch, "D"), s=40, zorder=3)
    for variant, color in colors.items():
        ax.scatter([], [], color=color, label=variant)
    for batch, marker in markers.items():
        ax.scatter([], [], color="gray", marker=marker, label=f"batch {batch}")
    copy = rows[0]["metrics.copy_gbps"] if rows else None
    if copy:
        xs = [min(r["metrics.bytes_per_token"] for r in rows) / 1e9 / 1.5, max(r["metrics.bytes_per_token"] for r in rows) / 1e9 * 1.5]
        ax.plot(xs, [copy / x for x in xs], "--", color="gray", label=f"roofline: {copy:,.0f} GB/s / bytes per token")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("GB read per output token (weights in the format + KV cache, over the batch)")
    ax.set_ylabel("decode tokens / s")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"Weight-only quantization in the engine, {rows[0]['params.model'] if rows else ''} "
                 f"({rows[0]['hardware_name'] if rows else hw})")
    save(fig, path)


def quant_ladder(view, hw: str, path) -> None:
    """The int4 rungs (naive, Triton, CUDA register ring, CUDA bulk copies, tinygemm) as bars of
    % of their roofline, per 8B matrix, one panel per batch (1 and 16): how far each implementation
    of the same method gets from the bytes it promises."""
    plt = pyplot()
    rows = [r for r in _ok_rows(view, "phase5.quant_kernels", hw, only_8b=True)
            if r["variant"].startswith("w4_")]
    rungs = [v for v in ("w4_naive", "w4_fused", "w4_cuda_bulk", "w4_cuda", "w4_library")
             if any(r["variant"] == v for r in rows)]
    matrices = [m for m in ("qkv", "o", "gate_up", "down") if any(r["params.matrix"] == m for r in rows)]
    batches = [b for b in (1, 16) if any(int(r["params.batch"]) == b for r in rows)]
    fig, axes = plt.subplots(1, max(1, len(batches)), figsize=(5.5 * max(1, len(batches)), 4.2), squeeze=False)
    width = 0.8 / max(1, len(rungs))
    for ax, batch in zip(axes[0], batches):
        for i, rung in enumerate(rungs):
            heights = [next((r["metrics.pct_of_roofline"] for r in rows if r["variant"] == rung
                             and r["params.matrix"] == m and int(r["params.batch"]) == batch), 0) for m in matrices]
            ax.bar([x + (i - (len(rungs) - 1) / 2) * width for x in range(len(matrices))], heights, width, label=rung)
        ax.axhline(100, color="gray", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(matrices)), matrices)
        ax.set_ylabel("% of the roofline (own bytes at the bandwidth)")
        ax.set_title(f"batch {batch}")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"int4 W4A16 kernels, Llama-3.1-8B matrices ({rows[0]['hardware_name'] if rows else hw})")
    save(fig, path)


def speculative_speedup(view, hw: str, path) -> None:
    """Speedup over the target alone against k: one panel per temperature (rows) and concurrency
    (columns), a colour per draft, measured solid and predicted dashed, 1x the line to beat."""
    plt = pyplot()
    rows = [r for r in _ok_rows(view, "phase5.speculative", hw) if r["variant"] != "target"]
    temperatures = sorted({r["params.temperature"] for r in rows})
    concurrency = sorted({int(r["params.concurrency"]) for r in rows})
    colors = {"matched": "tab:blue", "distilled": "tab:green", "mismatched": "tab:red", "ngram": "tab:purple"}
    fig, axes = plt.subplots(len(temperatures), len(concurrency), figsize=(4.2 * len(concurrency), 3.4 * len(temperatures)),
                             sharex=True, sharey=True, squeeze=False)
    for i, t in enumerate(temperatures):
        for j, c in enumerate(concurrency):
            ax = axes[i][j]
            for variant, color in colors.items():
                mine = sorted((r for r in rows if r["variant"] == variant and r["params.temperature"] == t
                               and int(r["params.concurrency"]) == c), key=lambda r: r["params.k"])
                if not mine:
                    continue
                k = [int(r["params.k"]) for r in mine]
                ax.plot(k, [r["metrics.speedup_vs_target"] for r in mine], "o-", color=color, ms=3,
                        label=f"{variant}, measured")
                ax.plot(k, [r["metrics.predicted_speedup"] for r in mine], "--", color=color, alpha=0.7,
                        label=f"{variant}, predicted")
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_title(f"T = {t:g}, {c} at once", fontsize=9)
            if i == len(temperatures) - 1:
                ax.set_xlabel("k (tokens proposed per step)")
            if j == 0:
                ax.set_ylabel("x the target alone")
    axes[0][-1].legend(fontsize=6, ncol=2, loc="upper right")
    fig.suptitle(f"Speculative decoding, the lab's trained models ({rows[0]['hardware_name'] if rows else hw})")
    save(fig, path)


def tensor_parallel(rows, hw: str, path) -> None:
    """Left: batch-1 decode tok/s against GPUs per shape, measured beside its prediction and beside
    linear scaling from the shape's smallest TP, with the seed's 70B point on two A100s. Right: µs
    per all-reduce against size, NCCL and the one-shot, per GPU count. The largest machine's record."""
    from . import seed
    plt = pyplot()
    mine = rows[(rows["hardware"] == hw) & rows["largest"] & (rows["status"] == "ok")]
    engine = mine[mine["variant"] == "engine"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    colors = {"llama-3.1-8b": "tab:blue", "llama-3.3-70b": "tab:red"}
    for model, part in engine.groupby("params.model", sort=True):
        part = part.sort_values("params.tp")
        tp, tok = [int(t) for t in part["params.tp"]], list(part["metrics.decode_tok_s"])
        color = colors.get(model, "tab:gray")
        left.plot(tp, tok, "o-", color=color, label=f"{model}, measured")
        left.plot(tp, list(part["metrics.predicted_tok_s"]), "--", color=color, label=f"{model}, predicted")
        left.plot(tp, [tok[0] * t / tp[0] for t in tp], ":", color=color, alpha=0.6,
                  label=f"{model}, linear from TP={tp[0]}")
    left.scatter([2], [seed.DECODE_70B_TP2_TOK_S], marker="x", color="black", zorder=3,
                 label="seed: 70B on 2 x A100, vLLM")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xticks(sorted({int(t) for t in engine["params.tp"]}) or [1, 2, 4])
    left.get_xaxis().set_major_formatter(plt.ScalarFormatter())
    left.set_xlabel("GPUs (tensor-parallel size)")
    left.set_ylabel("batch-1 decode tokens / s")
    left.legend(fontsize=7)
    left.set_title(f"Tensor-parallel decode ({mine.iloc[0]['hardware_name'] if len(mine) else hw})", fontsize=10)
    ar = mine[mine["variant"].str.startswith("allreduce_")]
    styles = {"allreduce_nccl": ("NCCL", "-"), "allreduce_one_shot": ("one-shot (symmetric memory)", "--")}
    for (variant, n), part in ar.groupby(["variant", "params.world_size"], sort=True):
        part = part.sort_values("params.size_bytes")
        name, style = styles.get(variant, (variant, "-"))
        right.plot(part["params.size_bytes"], part["metrics.us"], style, marker="o", markersize=3,
                   color="tab:green" if int(n) == 2 else "tab:purple", label=f"{name}, {int(n)} GPUs")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("all-reduce size (bytes; batch-1 decode: hidden size x 2)")
    right.set_ylabel("µs per all-reduce (CUDA graph, slowest rank)")
    if len(ar):
        right.legend(fontsize=7)
    right.set_title("The all-reduce at decode sizes", fontsize=10)
    save(fig, path)
