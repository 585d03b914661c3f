"""Phase 6's plot: every accelerator's roofline on one log-log chart (bf16, or fp16 where no bf16
peak is published), with what the lab measured (filled) and what others reported (hollow) placed
at their arithmetic intensity. matplotlib is imported only when the plot is drawn.

Built on phase 5: its Llama shapes (engine/shapes.py)."""
from common.plotting import pyplot, save
from phases.phase5_inference.engine import SHAPES

from . import seed
from .architectures import MATMUL_N, architectures
from .cross_arch import measured_decode, measured_matmul

MATMUL_INTENSITY = 2 * MATMUL_N**3 / (3 * MATMUL_N**2 * 2)


def decode_point(model: str, tok_s: float) -> tuple[float, float]:
    """(FLOP/byte, TFLOP/s) of batch-1 decode at tok_s: weights read once per token."""
    shape = SHAPES[model]
    flops, nbytes = shape.flops_per_token(0), shape.decode_weight_bytes()
    return flops / nbytes, tok_s * flops / 1e12


def rooflines(view, hw: str, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 6))
    colors = plt.get_cmap("tab10")
    x = [0.1 * 1.25**i for i in range(60)]                                 # 0.1 to about 6,000 FLOP/byte
    lab_mm, lab_decode = measured_matmul(view), measured_decode(view)
    for i, a in enumerate(architectures()):
        if not a.peak_tflops or not a.bandwidth_gbps:
            continue
        color = colors(i % 10)
        ax.plot(x, [min(a.peak_tflops, xi * a.bandwidth_gbps / 1e3) for xi in x], color=color, lw=1.4,
                label=f"{a.name}" + (" (fp16 peak)" if a.peak_dtype == "fp16" else ""))
        for label, tflops in lab_mm.get(a.key, {}).items():
            ax.plot(MATMUL_INTENSITY, tflops, "o", color=color, ms=7)
        for model in ("llama-3.1-8b", "llama-3.3-70b"):
            if (a.key, model) in lab_decode:
                ax.plot(*decode_point(model, lab_decode[(a.key, model)]), "o", color=color, ms=7)
            quote = seed.DECODE_TOK_S.get((a.key, model))
            if quote is not None and quote.devices == 1 and a.decode.get(model) and a.decode[model].fits:
                ax.plot(*decode_point(model, quote.value), "o", mfc="none", color=color, ms=8, mew=1.5)
        quote = seed.MATMUL_TFLOPS.get(a.key)
        if quote is not None:
            ax.plot(MATMUL_INTENSITY, quote.value, "D", mfc="none", color=color, ms=8, mew=1.5)
            if quote.low is not None:
                ax.vlines(MATMUL_INTENSITY, quote.low, quote.high, color=color, lw=1)
    ax.plot([], [], "ko", label="measured by this lab (matmul N = 8192; batch-1 decode)")
    ax.plot([], [], "kD", mfc="none", label="quoted matmul (seed or community; size not given)")
    ax.plot([], [], "ko", mfc="none", label="quoted batch-1 decode, one device")
    ax.axvline(MATMUL_INTENSITY, color="grey", ls=":", lw=1)
    ax.text(MATMUL_INTENSITY, 0.12, " bf16 matmul\n N = 8192", fontsize=7, color="grey")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(0.1, 3000)
    ax.set_xlabel("arithmetic intensity (FLOP / byte of device memory)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title("Every accelerator in hardware.yaml on one roofline (spec sheets)")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="major", alpha=0.3)
    save(fig, path)
