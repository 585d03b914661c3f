"""Phase 3's attention forward for the profiler check (common/kernel_trace_check.py): one call of a
variant on one problem beside its kernel list (kernel_lists.attention_forward).

    python -m common.kernel_trace_check --exercise phase3.flash_attention --param variant=triton \\
        --param n=512 --param dtype=fp32
"""
from common.errors import LabError

from . import kernel_lists

PARAMS = {"variant": "triton", "batch": 2, "heads": 4, "n": 512, "head_dim": 64, "dtype": "fp32", "causal": False}
VARIANTS = ("triton", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient")


def attention_step(params: dict, device):
    """(one attention forward, its workload, a label); the seed's fp32 N = 512 case by default."""
    import torch

    from common.checks import TORCH_DTYPES

    from . import flash_attention as fa
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise LabError(f"phase 3's trace step has no parameter '{unknown[0]}' (it takes {', '.join(PARAMS)})")
    p = {**PARAMS, **params}
    if p["variant"] not in VARIANTS:
        raise LabError(f"variant '{p['variant']}': choose one of {', '.join(VARIANTS)}")
    if p["dtype"] not in TORCH_DTYPES:
        raise LabError(f"dtype '{p['dtype']}': choose one of {', '.join(TORCH_DTYPES)}")
    b, h, n, d, causal = int(p["batch"]), int(p["heads"]), int(p["n"]), int(p["head_dim"]), bool(p["causal"])
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device=device, generator=g).to(TORCH_DTYPES[p["dtype"]]) for _ in range(3))
    if p["variant"] == "triton":
        def step():
            fa.attention_forward(q, k, v, causal)
    else:
        def step():
            with fa.sdpa_context(p["variant"]):
                fa.sdpa(q, k, v, causal)
    w = kernel_lists.attention_forward(p["variant"], b, h, n, d, p["dtype"], causal)
    return step, w, f"{p['variant']} attention {b}x{h}x{n}x{d} {p['dtype']}{' causal' if causal else ''}"


TRACE_STEPS = {"phase3.flash_attention": attention_step}
