"""What weight-only quantization should buy, before anything runs (no torch: the report and
`lab predict` use it): the bytes a [N out, K in] weight occupies in each format, in the layouts of
engine/weight_formats.py, and the batch below which a matmul over it stays memory-bound.

Decode reads every weight once per step, so at small batch a matmul's time is its bytes over the
bandwidth: the speedup over bf16 is bf16's bytes over the format's. FLOPs are 2·M·N·K whatever the
format (dequantization work is not counted as FLOPs), so fewer bytes per weight also move the
ridge: a quantized matmul becomes compute-bound at a smaller batch.
"""
FORMATS = ("bf16", "int8", "int4")
SCALE_BYTES = 2                       # scales stored in bf16
ZERO_BYTES = 1                        # int4 zero points: one uint8 per (group, output row)
ACTIVATION_BYTES = 2                  # bf16 activations in and out


def weight_bytes(fmt: str, n_out: int, k_in: int, group_size: int = 128) -> int:
    """Bytes of one weight in `fmt`: bf16 2·N·K; int8 N·K + a scale per row; int4 4 bytes per 8
    values along K (rows padded to whole int32 words) + a scale and a zero per (group, row)."""
    if fmt == "bf16":
        return 2 * n_out * k_in
    if fmt == "int8":
        return n_out * k_in + SCALE_BYTES * n_out
    if fmt == "int4":
        groups = -(-k_in // group_size)
        return 4 * n_out * (-(-k_in // 8)) + (SCALE_BYTES + ZERO_BYTES) * n_out * groups
    raise ValueError(f"unknown weight format {fmt!r}; choose one of {FORMATS}")


def bytes_per_weight(fmt: str, n_out: int, k_in: int, group_size: int = 128) -> float:
    """weight_bytes per weight: 2, ~1 and ~0.52 (group 128) for bf16, int8, int4."""
    return weight_bytes(fmt, n_out, k_in, group_size) / (n_out * k_in)


def matmul_bytes(fmt: str, batch: int, n_out: int, k_in: int, group_size: int = 128) -> int:
    """The fewest bytes one y = x @ W^T must move: the weight once, x read, y written."""
    return weight_bytes(fmt, n_out, k_in, group_size) + ACTIVATION_BYTES * batch * (k_in + n_out)


def matmul_flops(batch: int, n_out: int, k_in: int) -> int:
    return 2 * batch * n_out * k_in


def predicted_ms(fmt: str, batch: int, n_out: int, k_in: int, group_size: int, peak_tflops: float,
                 bandwidth_gbps: float) -> float:
    """The roofline's time: the slower of moving the bytes and doing the FLOPs."""
    memory_ms = matmul_bytes(fmt, batch, n_out, k_in, group_size) / (bandwidth_gbps * 1e6)
    compute_ms = matmul_flops(batch, n_out, k_in) / (peak_tflops * 1e9)
    return max(memory_ms, compute_ms)


def memory_bound_until_batch(fmt: str, n_out: int, k_in: int, group_size: int, peak_tflops: float,
                             bandwidth_gbps: float) -> float:
    """The batch M at which 2·M·N·K / bytes(M) reaches the ridge peak / bandwidth: below it the
    roofline is the bandwidth. Solved exactly (the activations' bytes grow with M too)."""
    ridge_flops_per_byte = peak_tflops * 1e12 / (bandwidth_gbps * 1e9)
    fixed = weight_bytes(fmt, n_out, k_in, group_size)
    per_row = ACTIVATION_BYTES * (k_in + n_out)
    denominator = 2 * n_out * k_in - ridge_flops_per_byte * per_row
    return float("inf") if denominator <= 0 else ridge_flops_per_byte * fixed / denominator


def speedup_over_bf16(fmt: str, batch: int, n_out: int, k_in: int, group_size: int, peak_tflops: float,
                      bandwidth_gbps: float) -> float:
    """The roofline's prediction of bf16's time over the format's, at this batch."""
    return (predicted_ms("bf16", batch, n_out, k_in, group_size, peak_tflops, bandwidth_gbps)
            / predicted_ms(fmt, batch, n_out, k_in, group_size, peak_tflops, bandwidth_gbps))


def projection_shapes(shape) -> list[tuple[int, int]]:
    """(N out, K in) of one layer's quantized projections: fused qkv, o, fused gate_up, down."""
    h, i = shape.hidden_size, shape.intermediate_size
    return [(shape.q_size + 2 * shape.kv_size, h), (h, shape.q_size), (2 * i, h), (h, i)]


def projection_bytes_saved(shape, fmt: str, group_size: int = 128) -> float:
    """Bytes the model's projections take in bf16 minus what they take in `fmt`, all layers."""
    per_layer = sum(2 * n * k - weight_bytes(fmt, n, k, group_size) for n, k in projection_shapes(shape))
    return per_layer * shape.num_hidden_layers


def decode_weight_bytes(shape, fmt: str, group_size: int = 128) -> float:
    """Bytes of weights one decode step reads with every layer's projections in `fmt` and the rest
    (LM head, norms, the embedding rows) in bf16, as the engine holds them."""
    return shape.decode_weight_bytes() - projection_bytes_saved(shape, fmt, group_size)


def model_bytes(shape, fmt: str, group_size: int = 128) -> float:
    """All the weights the engine holds (the whole embedding table included)."""
    return shape.weight_bytes() - projection_bytes_saved(shape, fmt, group_size)


def decode_parts(shape, fmt: str, batch: int, mean_context: float, group_size: int = 128) -> list[tuple[float, float]]:
    """(FLOPs, bytes) of a decode step's weight matmuls (weights in `fmt`) and of its attention
    over the bf16 cache: analysis.decode_parts with the format's weight bytes."""
    matmul_flops = batch * shape.flops_per_token(0)
    attention_flops = batch * shape.flops_per_token(int(mean_context)) - matmul_flops
    return [(matmul_flops, decode_weight_bytes(shape, fmt, group_size)),
            (attention_flops, batch * mean_context * shape.kv_bytes_per_token())]
