"""int4 checkpoints quantized elsewhere, converted at load into the engine's own layout
(weight_formats.Int4Weight: int32 [N, K/8] packed along K in plain nibble order, scales and uint8 zero
points [G, N]), so `lab serve --model DIR` serves an AutoAWQ or GPTQ folder.

The two layouts found on the Hugging Face Hub (for a linear layer y = x W^T, K inputs, N outputs,
groups of G consecutive inputs; "[K, N]" is transformers' in x out orientation):

AutoAWQ, GEMM version (`quantization_config: {quant_method: awq, bits: 4, group_size, zero_point:
true, version: gemm}`), per projection `<name>.qweight`, `.qzeros`, `.scales`:
    qweight  int32 [K, N/8]: packed along N; word c of row k holds outputs 8c .. 8c + 7, nibble i
             (bits 4i .. 4i+3) holding output 8c + AWQ_ORDER[i], AWQ_ORDER = 0,2,4,6,1,3,5,7
    qzeros   int32 [K/G, N/8], the same packing; the zero points as they are
    scales   fp16 [K/G, N]
    W[n, k] = (q[k, n] − z[k // G, n]) · s[k // G, n]

GPTQ (`quant_method: gptq`, `bits: 4`, `group_size` (−1: per-channel), `sym`, `desc_act`,
`checkpoint_format` gptq (v1, the default) or gptq_v2), per projection `.qweight`, `.qzeros`,
`.scales`, `.g_idx`:
    qweight  int32 [K/8, N]: packed along K; word r of column n holds inputs 8r .. 8r + 7, nibble j
             holding input 8r + j (plain order): its transpose is the engine's layout exactly
    qzeros   int32 [K/G, N/8]: packed along N, plain order; v1 stores zero − 1 (v2 the zero)
    scales   fp16 [K/G, N]
    g_idx    int32 [K]: the group of each input; act-order (desc_act) permutes it, which the
             engine's contiguous groups cannot express: refused unless it is k // G
    W[n, k] = (q[k, n] − z[g_idx[k], n]) · s[g_idx[k], n]

Scales keep the checkpoint's dtype (the kernels read them as fp32; fp16 -> bf16 would round them).
Anything else in quantization_config (other bits, other versions or formats, other methods) is
refused by name, as are tensors the engine would not use (a bias).
"""
from dataclasses import dataclass
from pathlib import Path

import torch

from common.errors import LabError

from .weight_formats import INT4_MAX, NIBBLES_PER_WORD, Int4Weight, pack_int4, unpack_int4_words
from .shapes import LlamaShape

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)          # output 8c + AWQ_ORDER[i] sits in nibble i of word c
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

# quantization_config keys that do not change the stored numbers' meaning: how they were made
# (calibration), and kernel or fusion choices of other loaders.
AWQ_HARMLESS = frozenset({"do_fuse", "fuse_max_seq_len", "modules_to_fuse", "backend", "exllama_config"})
GPTQ_HARMLESS = frozenset({
    "damp_percent", "damp_auto_increment", "true_sequential", "static_groups", "model_name_or_path",
    "model_file_base_name", "dataset", "tokenizer", "use_cuda_fp16", "meta", "use_exllama", "exllama_config",
    "max_input_length", "cache_block_outputs", "batch_size", "module_name_preceding_first_block",
    "block_name_to_quantize", "backend", "quantizer", "disable_exllama", "model_seqlen", "pad_token_id"})


@dataclass(frozen=True)
class Int4CheckpointFormat:
    """What a checkpoint's quantization_config says, once checked."""
    method: str                     # "awq" or "gptq"
    group_size: int                 # inputs per group; per-channel is the projection's K
    per_channel: bool = False       # GPTQ's group_size −1
    zeros_minus_one: bool = False   # GPTQ v1 stores each zero point minus one
    symmetric: bool = False         # GPTQ sym (informational: the stored zero points are used as they are)

    def group_for(self, in_features: int) -> int:
        return in_features if self.per_channel else self.group_size

    def label(self) -> str:
        group = "per-channel" if self.per_channel else f"g{self.group_size}"
        return f"int4 {group} ({self.method})"


def _refuse(name: str, key: str, value, why: str) -> LabError:
    return LabError(f"{name}: config.json quantization_config.{key}={value!r} is not supported ({why})")


def parse_quantization_config(qc: dict, name: str) -> Int4CheckpointFormat:
    """The checkpoint's int4 format, or one line naming the first key the engine does not implement."""
    if not isinstance(qc, dict):
        raise LabError(f"{name}: config.json quantization_config must be an object")
    method = qc.get("quant_method")
    if method not in ("awq", "gptq"):
        raise _refuse(name, "quant_method", method, "the engine loads awq (GEMM) and gptq int4 checkpoints")
    if qc.get("bits") != 4:
        raise _refuse(name, "bits", qc.get("bits"), "int4 only")
    group = qc.get("group_size")
    if isinstance(group, bool) or not isinstance(group, int) or not (group > 0 or (method == "gptq" and group == -1)):
        raise _refuse(name, "group_size", group, "a positive group size" + (", or -1" if method == "gptq" else ""))
    if method == "awq":
        known = {"quant_method", "bits", "group_size", "zero_point", "version", "modules_to_not_convert"} | AWQ_HARMLESS
        if str(qc.get("version", "gemm")).lower() != "gemm":
            raise _refuse(name, "version", qc.get("version"), "AutoAWQ's GEMM layout only")
        if qc.get("zero_point", True) is not True:
            raise _refuse(name, "zero_point", qc.get("zero_point"), "AWQ with zero points only")
        if qc.get("modules_to_not_convert") not in (None, []):
            raise _refuse(name, "modules_to_not_convert", qc.get("modules_to_not_convert"),
                          "every projection of every layer must be int4")
        fmt = Int4CheckpointFormat("awq", group)
    else:
        known = {"quant_method", "bits", "group_size", "sym", "desc_act", "checkpoint_format", "pack_dtype",
                 "lm_head", "is_marlin_format", "modules_in_block_to_quantize"} | GPTQ_HARMLESS
        checkpoint_format = qc.get("checkpoint_format", "gptq")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise _refuse(name, "checkpoint_format", checkpoint_format, "gptq (v1) or gptq_v2 only")
        for key, supported in (("pack_dtype", "int32"), ("lm_head", False), ("is_marlin_format", False),
                               ("modules_in_block_to_quantize", None)):
            if qc.get(key, supported) != supported:
                raise _refuse(name, key, qc[key], f"only {supported!r}")
        for key in ("sym", "desc_act"):
            if not isinstance(qc.get(key, False), bool):
                raise _refuse(name, key, qc[key], "true or false")
        fmt = Int4CheckpointFormat("gptq", group, per_channel=group == -1,
                                   zeros_minus_one=checkpoint_format == "gptq", symmetric=qc.get("sym", False))
    unknown = sorted(set(qc) - known)
    if unknown:
        raise LabError(f"{name}: config.json quantization_config.{unknown[0]} is not implemented by the engine: "
                       "refused")
    return fmt


# ------------------------------------------------------------------------------ conversion
def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int32 [R, 8C], nibble j of word c at column 8c + j (plain order)."""
    return unpack_int4_words(packed.to(torch.int32))


def _check_shape(what: str, tensor: torch.Tensor, size: tuple, dtype=None) -> None:
    if tuple(tensor.shape) != size:
        raise LabError(f"{what} has shape {tuple(tensor.shape)}, expected {size}")
    if dtype is not None and tensor.dtype != dtype:
        raise LabError(f"{what} has dtype {tensor.dtype}, expected {dtype}")


def _groups(what: str, in_features: int, group_size: int) -> int:
    if in_features % group_size or in_features % NIBBLES_PER_WORD:
        raise LabError(f"{what}: K={in_features} is not a multiple of the group size {group_size} and of 8")
    return in_features // group_size


def awq_to_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                what: str = "awq weight") -> Int4Weight:
    """AutoAWQ GEMM tensors (module docstring) -> Int4Weight, exactly (no value changes)."""
    k_in, words = qweight.shape
    n_out = words * NIBBLES_PER_WORD
    groups = _groups(what, k_in, group_size)
    _check_shape(f"{what}.qweight", qweight, (k_in, words), torch.int32)
    _check_shape(f"{what}.qzeros", qzeros, (groups, words), torch.int32)
    _check_shape(f"{what}.scales", scales, (groups, n_out))
    # column 8c + AWQ_ORDER[i] is nibble i: the plain column 8c + j is nibble AWQ_ORDER.index(j)
    nibble_of = torch.tensor([AWQ_ORDER.index(j) for j in range(NIBBLES_PER_WORD)])
    plain = (torch.arange(words)[:, None] * NIBBLES_PER_WORD + nibble_of[None, :]).reshape(-1).to(qweight.device)
    q = unpack_columns(qweight)[:, plain]                 # [K, N]
    zeros = unpack_columns(qzeros)[:, plain]              # [G, N]
    return Int4Weight(pack_int4(q.t()), scales.contiguous(), zeros.to(torch.uint8).contiguous(), k_in, group_size)


def gptq_to_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                 fmt: Int4CheckpointFormat, what: str = "gptq weight") -> Int4Weight:
    """GPTQ tensors (module docstring) -> Int4Weight, exactly. Act-order (a g_idx other than k // G)
    and a v1 stored zero of 15 (a zero point of 16, outside 0..15) are refused with the reason."""
    words, n_out = qweight.shape
    k_in = words * NIBBLES_PER_WORD
    group_size = fmt.group_for(k_in)
    groups = _groups(what, k_in, group_size)
    _check_shape(f"{what}.qweight", qweight, (words, n_out), torch.int32)
    _check_shape(f"{what}.qzeros", qzeros, (groups, -(-n_out // NIBBLES_PER_WORD)), torch.int32)
    _check_shape(f"{what}.scales", scales, (groups, n_out))
    if g_idx is not None:
        _check_shape(f"{what}.g_idx", g_idx, (k_in,))
        contiguous = torch.arange(k_in, device=g_idx.device) // group_size
        if not torch.equal(g_idx.to(torch.int64), contiguous):
            raise LabError(f"{what}.g_idx is not k // {group_size}: an act-order (desc_act) checkpoint permutes the "
                           "inputs across groups, which the engine's contiguous groups cannot express: refused")
    zeros = unpack_columns(qzeros)[:, :n_out]
    if fmt.zeros_minus_one:
        zeros = zeros + 1
        if bool((zeros > INT4_MAX).any()):
            raise LabError(f"{what}.qzeros holds a GPTQ v1 stored zero of 15 (a zero point of 16, outside 0..15; "
                           "v1 cannot store a zero point of 0): refused")
    return Int4Weight(qweight.t().contiguous(), scales.contiguous(), zeros.to(torch.uint8).contiguous(), k_in,
                      group_size)


def checkpoint_format(config: dict, name: str) -> Int4CheckpointFormat | None:
    """The int4 format config.json declares, or None for a 16-bit checkpoint."""
    qc = config.get("quantization_config")
    return None if qc is None else parse_quantization_config(qc, name)


def checkpoint_quantization(config):
    """The QuantizationConfig an engine config (config.EngineConfig) gets from its checkpoint: None for
    a 16-bit one or a named shape; an int4 checkpoint's own format on config.quant_path. A
    --quantization that conflicts with the checkpoint's (int8, or int4 of another group size) is
    refused with one line: the engine does not re-quantize quantized weights."""
    from .model import QuantizationConfig
    from .shapes import read_config
    from .checkpoint_files import resolve

    _, folder = resolve(config.model)
    if folder is None:
        return None
    fmt = checkpoint_format(read_config(folder), folder.name)
    if fmt is None:
        return None
    if config.quantization not in ("none", "int4"):
        raise LabError(f"--quantization {config.quantization} conflicts with {folder.name}, an {fmt.label()} "
                       "checkpoint: leave --quantization off to serve its own int4 weights")
    if config.quantization == "int4" and (fmt.per_channel or config.quant_group_size != fmt.group_size):
        group = "per-channel" if fmt.per_channel else fmt.group_size
        raise LabError(f"--quantization int4 with group size {config.quant_group_size} conflicts with "
                       f"{folder.name}, an {fmt.label()} checkpoint (group size {group}): leave --quantization off")
    return QuantizationConfig(bits=4, path=config.quant_path, group_size=fmt.group_size, prequantized=fmt)


def load_int4_checkpoint(folder: Path, shape: LlamaShape, qc: dict, dtype: torch.dtype,
                         device: str | torch.device = "cpu") -> dict:
    """An AWQ or GPTQ folder as the engine's weights dict: every projection's `<name>.weight` an
    Int4Weight (on `device`), every other tensor in `dtype`, all names and shapes checked."""
    from .checkpoint_files import check_tensor_names, drop_tied_head, read_safetensors, tensor_shapes

    folder = Path(folder)
    fmt = parse_quantization_config(qc, folder.name)
    expected = tensor_shapes(shape)
    parts = ("qweight", "qzeros", "scales") + (("g_idx",) if fmt.method == "gptq" else ())
    quantized = {f"model.layers.{i}.{p}.weight" for i in range(shape.num_hidden_layers) for p in PROJECTIONS}
    wanted = {n: size for n, size in expected.items() if n not in quantized}
    wanted.update({w[: -len("weight")] + part: None for w in quantized for part in parts})
    tensors = dict(read_safetensors(folder, "cpu"))
    drop_tied_head(folder, tensors, shape)
    check_tensor_names(folder, tensors, wanted)
    out = {}
    for name, size in expected.items():
        if name not in quantized:
            if tuple(tensors[name].shape) != size:
                raise LabError(f"{folder}: {name} has shape {tuple(tensors[name].shape)}, config says {size}")
            out[name] = tensors[name].to(device=device, dtype=dtype)
            continue
        base = name[: -len(".weight")]
        what = f"{folder.name}: {base}"
        if fmt.method == "awq":
            weight = awq_to_int4(tensors[base + ".qweight"], tensors[base + ".qzeros"], tensors[base + ".scales"],
                                 fmt.group_size, what)
        else:
            weight = gptq_to_int4(tensors[base + ".qweight"], tensors[base + ".qzeros"], tensors[base + ".scales"],
                                  tensors[base + ".g_idx"], fmt, what)
        if (weight.out_features, weight.in_features) != size:
            raise LabError(f"{what} holds a [{weight.out_features}, {weight.in_features}] weight, config says "
                           f"{list(size)}")
        out[name] = weight.to(device)
    return out
