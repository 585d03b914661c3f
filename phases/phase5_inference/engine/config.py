"""EngineConfig: every engine option in one object, checked once and passed whole (nano-vllm's
`Config`): LLMEngine.__init__ settles it (`settled`: the device picked, quant_path "auto" resolved,
what this device cannot run refused in one line before a weight is read), the ModelRunner and the
Scheduler read the fields they need from it, and once the KV pool is sized the engine writes the
pool's num_kv_blocks and the context's max_model_len back into its own copy.
"""
import dataclasses
import sys
from dataclasses import dataclass

import torch

from common.errors import LabError
from common.triton_shim import interpreting

from .model import QuantizationConfig
from .quantize import GROUP_SIZES
from .quantize import PATHS as QUANT_PATHS
from .speculator import MAX_SPECULATIVE_TOKENS

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
QUANTIZATIONS = ("none", "int8", "int4")
DEFAULT_MAX_MODEL_LEN = 8192


@dataclass
class EngineConfig:
    model: str = "tiny"             # a named shape (seeded random weights) or a HF checkpoint folder
    seed: int = 0
    dtype: str = "bfloat16"         # CPU tests use "float32"
    device: str = "auto"            # "auto": cuda if available else cpu
    block_size: int = 16
    gpu_memory_utilization: float = 0.90   # fraction of total GPU memory weights + KV pool + activations may use
    num_kv_blocks: int | None = None       # overrides pool sizing (tests force preemption with few blocks)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None       # default: min(shape.max_position_embeddings, 8192)
    cuda_graphs: bool = True               # decode CUDA graphs at bucketed batch sizes (CUDA only)
    attention_backend: str = "auto"
    quantization: str = "none"             # weight-only: "int8" (per output row), "int4" (group-wise), "none"
    quant_path: str = "auto"               # how quantized projections multiply: auto, naive, fused, library, cuda
    quant_group_size: int = 128            # int4 inputs per (scale, zero point)
    speculative_model: str = "none"        # "none", "ngram" (prompt lookup), or a draft: named shape or checkpoint folder
    num_speculative_tokens: int = 0        # k: tokens proposed per step (1 .. MAX_SPECULATIVE_TOKENS when speculating)
    tensor_parallel: int = 1               # ranks the model is split over (processes started by torchrun)
    allreduce: str = "auto"                # tensor parallel: auto (the faster per size), nccl, one-shot
    enable_chunked_prefill: bool = False   # a step of <= max_num_batched_tokens mixes prefill chunks with decode rows
    enable_prefix_caching: bool = False    # share cached full KV blocks of a common prefix (off until the GPU
                                           # path, prefill over cached blocks, is checked on a GPU)
    async_scheduling: bool | None = None   # decode step n+1 launched before step n's tokens are read (overlap.py);
                                           # None: on where it can run (not speculating, tensor_parallel 1)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def speculative_tokens(self) -> int:
        """k when speculating, else 0: the cache slots a decode step writes past a sequence's last token."""
        return self.num_speculative_tokens if self.speculative_model != "none" else 0

    @property
    def prefix_caching(self) -> bool:
        """Whether prompts reuse cached KV blocks of a prefix seen before (kv_cache.BlockPool)."""
        return self.enable_prefix_caching

    @property
    def decode_rows(self) -> int:
        """Rows of one decode forward: every running sequence, k + 1 rows each when speculating."""
        return self.max_num_seqs * (self.speculative_tokens + 1)

    def check(self) -> None:
        """LabError for settings no engine can run with."""
        if self.dtype not in DTYPES:
            raise LabError(f"dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.quantization not in QUANTIZATIONS:
            raise LabError(f"quantization {self.quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
        if self.quant_path not in ("auto", *QUANT_PATHS):
            raise LabError(f"quant_path {self.quant_path!r}: choose one of auto, {', '.join(QUANT_PATHS)}")
        if self.quantization == "int4" and self.quant_group_size not in GROUP_SIZES:
            raise LabError(f"quant_group_size must be one of {GROUP_SIZES}, got {self.quant_group_size!r}")
        from .paged_attention import BACKENDS
        if self.attention_backend not in BACKENDS:
            raise LabError(f"attention_backend {self.attention_backend!r}: choose one of {', '.join(BACKENDS)}")
        from .tp_ranks import ALLREDUCE_MODES
        if self.allreduce not in ALLREDUCE_MODES:
            raise LabError(f"allreduce {self.allreduce!r}: choose one of {', '.join(ALLREDUCE_MODES)}")
        tp = self.tensor_parallel
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise LabError(f"tensor_parallel must be a positive integer, got {tp!r}")
        if tp > 1 and self.quantization != "none":
            raise LabError("quantization with tensor_parallel > 1 is not supported: quantize on one GPU")
        if tp > 1 and self.speculative_model != "none":
            raise LabError("speculative decoding with tensor_parallel > 1 is not supported")
        if not isinstance(self.enable_prefix_caching, bool):
            raise LabError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if self.enable_prefix_caching and self.speculative_model != "none":
            raise LabError("enable_prefix_caching is not supported with speculative decoding (the draft's cache "
                           "and the verify step's rollback do not share blocks): turn one off")
        if not (self.async_scheduling is None or isinstance(self.async_scheduling, bool)):
            raise LabError(f"async_scheduling must be true, false or unset, got {self.async_scheduling!r}")
        if self.async_scheduling and self.speculative_model != "none":
            raise LabError("async_scheduling is not supported with speculative decoding (its verify step reads "
                           "the accepted tokens on the host): turn one off")
        if self.async_scheduling and tp > 1:
            raise LabError("async_scheduling is not supported with tensor_parallel > 1: turn one off")
        if not isinstance(self.enable_chunked_prefill, bool):
            raise LabError(f"enable_chunked_prefill must be true or false, got {self.enable_chunked_prefill!r}")
        if self.enable_chunked_prefill and self.speculative_model != "none":
            raise LabError("enable_chunked_prefill is not supported with speculative decoding: turn one off")
        if self.speculative_model != "none":
            k = self.num_speculative_tokens
            if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
                raise LabError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}] "
                               f"with speculative_model {self.speculative_model!r}, got {k!r}")
        positive = {"block_size": self.block_size, "max_num_seqs": self.max_num_seqs,
                    "max_num_batched_tokens": self.max_num_batched_tokens}
        if self.num_kv_blocks is not None:
            positive["num_kv_blocks"] = self.num_kv_blocks
        if self.max_model_len is not None:
            positive["max_model_len"] = self.max_model_len
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise LabError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise LabError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")



def quantization_of(config: EngineConfig) -> QuantizationConfig | None:
    from .int4_checkpoints import checkpoint_quantization
    if (prequantized := checkpoint_quantization(config)) is not None:     # an AWQ / GPTQ folder's own int4
        return prequantized
    if config.quantization == "none":
        return None
    return QuantizationConfig(bits=int(config.quantization[3:]), path=config.quant_path,
                              group_size=config.quant_group_size)


def resolve_quant_path(config: EngineConfig, device: torch.device) -> str:
    """The path quant_path 'auto' stands for here: int4 (asked for, or an AWQ / GPTQ folder's own)
    through the CUDA kernel where it can run, else the Triton kernel (saying why in one line on
    stderr); int8 through the Triton kernel; on a CPU without the interpreter, naive."""
    if config.quant_path != "auto":
        return config.quant_path
    triton_here = device.type == "cuda" or interpreting()
    from .int4_checkpoints import checkpoint_quantization
    int4 = config.quantization == "int4" or (config.quantization == "none" and checkpoint_quantization(config) is not None)
    if not int4 or config.dtype != "bfloat16":
        return "fused" if triton_here else "naive"
    from .int4_mma import device_unavailable
    why = device_unavailable(device)
    if why is None:
        return "cuda"
    if device.type == "cuda":
        print(f"int4: {why}; using the Triton kernel (quant_path fused)", file=sys.stderr)
    return "fused" if triton_here else "naive"


def fused_path_unavailable(config: EngineConfig, device: torch.device) -> str | None:
    """Why the quantized fused path cannot run on this device (its Triton kernels need a GPU or
    the interpreter; the CUDA path a GPU, bf16 and nvcc), or None."""
    if config.quantization != "none" and config.quant_path == "cuda":
        from .int4_mma import device_unavailable
        if config.quantization != "int4":
            return "quant_path 'cuda' is the int4 kernel; int8 runs quant_path fused"
        if config.dtype != "bfloat16":
            return f"quant_path 'cuda' takes bf16 activations; this engine's dtype is {config.dtype}"
        return device_unavailable(device)
    if config.quantization != "none" and config.quant_path == "fused" and device.type != "cuda" and not interpreting():
        return ("quant_path 'fused' runs Triton kernels: it needs a CUDA GPU (or TRITON_INTERPRET=1); "
                "on a CPU use quant_path naive or library")
    return None


def backend_unavailable(config: EngineConfig, device: torch.device) -> str | None:
    """Why the decode attention backend cannot run on this device (Triton needs a GPU, or the
    interpreter), or None: said at startup, not by the first request."""
    from common.triton_shim import HAVE_TRITON
    if config.attention_backend == "triton" and (not HAVE_TRITON or (device.type != "cuda" and not interpreting())):
        return ("attention_backend 'triton' runs a Triton kernel: it needs a CUDA GPU with triton installed "
                "(or TRITON_INTERPRET=1); on a CPU use reference or auto")
    return None


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise LabError(f"device {name!r}: not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LabError(f"device {name!r}: no CUDA GPU is visible")
    if device.type not in ("cuda", "cpu"):
        raise LabError(f"device {name!r}: the engine runs on cuda or cpu")
    return device


def settled(config: EngineConfig) -> EngineConfig:
    """A checked copy of `config` with its device picked (the current CUDA device under tensor
    parallelism, which torchrun's LOCAL_RANK set) and quant_path "auto" resolved; LabError for a
    setting this device cannot run."""
    config.check()
    device = pick_device(config.device)
    if config.tensor_parallel > 1 and device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    config = dataclasses.replace(config, device=str(device), quant_path=resolve_quant_path(config, device))
    refused = fused_path_unavailable(config, device) or backend_unavailable(config, device)
    if refused:
        raise LabError(refused)
    return config


def draft_config(config: EngineConfig, model: str, seed: int) -> EngineConfig:
    """A speculative draft's runner config, from the target's sized one: its settings on `model`,
    unquantized, its own seed, the target's number of KV blocks (the draft follows the target's
    block tables), rows for two tokens per sequence (its catch-up)."""
    return dataclasses.replace(config, model=model, seed=seed,
                               max_num_seqs=2 * config.max_num_seqs, quantization="none",
                               speculative_model="none", num_speculative_tokens=0, tensor_parallel=1,
                               enable_prefix_caching=False)
