"""Phase 6's rows as workloads (common/workload.py): jax_attention's torch rows (SDPA with a forced
backend, and the Triton kernel) run phase 3's attention forward on the same problem, so their kernel
list is phase 3's: two products and the softmax's exponentials in one kernel, added. The JAX rows
(XLA's fusions, cuDNN through XLA) and jax_matmul's keep their one-roof prediction. Torch-free.

Built on phase 3: its attention kernel list (kernel_lists.attention_forward).
"""
from common.workload import Workload
from phases.phase3_triton import kernel_lists as p3

EXERCISES = ("phase6.jax_attention",)
TORCH_VARIANTS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "triton")


def row_workload(r: dict) -> Workload | None:
    """A jax_attention torch row's attention forward (None: a JAX row, or a row without its shape)."""
    if r["variant"] not in TORCH_VARIANTS:
        return None
    try:
        return p3.attention_forward(r["variant"], int(r["params.batch"]), int(r["params.heads"]), int(r["params.seq"]),
                                    int(r["params.head_dim"]), r["params.dtype"], bool(r["params.causal"]))
    except (KeyError, TypeError, ValueError):
        return None
