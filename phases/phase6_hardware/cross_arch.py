"""The cross-architecture tables: every hardware.yaml entry's roofline predictions (architectures.py)
beside what the lab measured on it (newest records) and what the seed or others reported
(seed.py), each figure labelled with where it comes from. Torch-free, for `lab report`."""
from common.formats import bullets, markdown, num

from . import seed
from .architectures import DECODE_MODELS, MATMUL_N, architectures, matmul_binds

MODEL_LABEL = {"llama-3.1-8b": "8B", "llama-3.3-70b": "70B"}


def _ok(view, exercise: str):
    rows = view.latest(exercise, measured_only=True)
    return rows[rows["status"] == "ok"] if len(rows) else rows


def measured_matmul(view) -> dict:
    """hardware key -> {label: TFLOP/s} of bf16 N = 8192 matmuls the lab timed there."""
    out: dict = {}
    for exercise, variants in (("phase3.matmul", {"cublas": "cuBLAS (phase 3)"}),
                               ("phase6.jax_matmul", {"torch": "torch (phase 6)", "jax_jit": "JAX (phase 6)"})):
        rows = _ok(view, exercise)
        if not len(rows):
            continue
        rows = rows[(rows["params.n"] == MATMUL_N) & (rows["params.dtype"] == "bf16") & rows["variant"].isin(list(variants))]
        for _, r in rows.iterrows():
            out.setdefault(r["hardware"], {})[variants[r["variant"]]] = r["metrics.tflops"]
    return out


def measured_decode(view) -> dict:
    """(hardware key, model shape) -> batch-1 decode tok/s of the lab's engine (phase 5)."""
    rows = _ok(view, "phase5.ttft_decode")
    if not len(rows):
        return {}
    rows = rows[rows["variant"] == "lab-engine"]
    return {(r["hardware"], r["params.model"]): r["metrics.decode_tok_s"] for _, r in rows.iterrows()}


def peak_text(a) -> str:
    if a.peak_tflops is None:
        return "-"
    return num(a.peak_tflops) + (" (fp16)" if a.peak_dtype == "fp16" else "")


def roofline_table(view) -> str:
    measured = measured_matmul(view)
    lines = []
    for a in architectures():
        lab = measured.get(a.key, {})
        quote = seed.MATMUL_TFLOPS.get(a.key)
        lines.append([a.name, a.kind, num(a.bandwidth_gbps), peak_text(a), num(a.ridge),
                      f"{num(a.matmul_ms)} ({num(a.matmul_tflops)})" if a.matmul_ms else "-",
                      matmul_binds(a).split(":")[0],
                      ", ".join(f"{k} {num(v)}" for k, v in lab.items()) or "-",
                      f"{quote.text()} ({quote.by})" if quote else "-"])
    header = ["hardware", "kind", "bandwidth GB/s", "peak TFLOP/s", "ridge FLOP/byte",
              f"bf16 {MATMUL_N} matmul: predicted ms (TFLOP/s)", "binds", "lab measured TFLOP/s",
              "quoted TFLOP/s (source)"]
    return markdown(lines, header) + (
        f"\n\nPredicted from hardware.yaml alone (bf16 dense peak, or fp16's where the vendor gives no bf16 figure; "
        f"each figure's source and date are in the file): time = max(2N³ / peak, 3N² x 2 bytes / bandwidth), N = "
        f"{MATMUL_N}. \"Lab measured\" is the newest record of this lab's own runs on that hardware; \"quoted\" figures "
        f"are others' (seed.py names each source), never measured here.")


def decode_table(view) -> str:
    measured = measured_decode(view)
    lines = []
    for a in architectures():
        for model in DECODE_MODELS:
            d = a.decode.get(model)
            if d is None:
                continue
            quote = seed.DECODE_TOK_S.get((a.key, model))
            lab = measured.get((a.key, model))
            lines.append([a.name, MODEL_LABEL[model], f"{d.weight_bytes / 1e9:.1f}", num(a.memory_gb),
                          "yes" if d.fits else f"no: {d.min_devices} devices",
                          num(d.tok_s), num(d.tok_s_parallel) if d.min_devices > 1 else "-",
                          num(lab) if lab is not None else "-",
                          f"{quote.text()} ({quote.by})" if quote else "-",
                          d.binds.split(":")[0]])
    header = ["hardware", "model", "bf16 weights GB", "memory GB", "fits one device", "predicted tok/s (one device's bandwidth)",
              "tensor-parallel ideal tok/s", "lab measured tok/s", "quoted tok/s (source)", "binds"]
    return markdown(lines, header) + "\n\n" + bullets([
        "Batch-1 decode reads every weight once per token (all but the embedding table, about 1 FLOP per byte), "
        "so its roofline is bytes per token over bandwidth.",
        "Weights that do not fit one device's memory need the fewest devices that hold them: split by layers a token "
        "still runs at one device's bandwidth; split within layers (tensor parallel) at most that many times faster, "
        "before the links' own cost.",
        "Lab measured: phase 5's engine (`phase5.ttft_decode`).",
        "Quoted decode figures run on the devices their source used (the A100's 70B on two GPUs; Groq's API on an "
        "unpublished number of chips)."])
