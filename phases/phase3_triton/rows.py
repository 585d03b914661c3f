"""What phase 3's report and its findings both read: the exercise ids, the library names, and
which rows a goal, a finding and the headline pick.

Its own module so that report.py (which declares the findings block) and findings.py (which
writes it) import it without importing each other.
"""
from common.formats import missing

ADD, SOFTMAX, MATMUL = "phase3.vector_add", "phase3.softmax", "phase3.matmul"
FWD, BWD = "phase3.flash_attention", "phase3.flash_attention_bwd"
LIBRARY = {"torch": "torch.add", "cublas": "cuBLAS", "sdpa_flash": "SDPA flash", "sdpa_cudnn": "SDPA cuDNN",
           "sdpa_efficient": "SDPA efficient"}


def lib(x) -> str:
    return "-" if missing(x) else LIBRARY.get(x, x)


def group(name):
    return lambda d: d[d["params.group"] == name]


def triton_rows(d, variants=("triton",), **params):
    """Our ok rows with these params (e.g. dtype="bf16"), as a goal, the findings and the headline pick them."""
    if not len(d):
        return d
    keep = d["variant"].isin(variants) & (d["status"] == "ok")
    for k, v in params.items():
        keep &= d[f"params.{k}"].eq(v)
    return d[keep]


def largest(d):
    return d[d["params.n"] == d["params.n"].max()] if len(d) else d


def square(d):
    """matmul rows of N x N x N products: the sweep's sizes, and a user's shape only where M = N = K (a
    tall-skinny or irregular user shape is not "the largest N" of the sweep: cuBLAS's regime differs)."""
    if not len(d) or "params.m" not in d:
        return d
    m, k = d["params.m"], d["params.k"] if "params.k" in d else d["params.n"]
    return d[m.isna() | (m.eq(d["params.n"]) & k.eq(d["params.n"]))]


def attn_top(d):
    return largest(triton_rows(d, group="main", dtype="bf16", head_dim=128, causal=False))


def matmul_best(d):
    d = largest(square(triton_rows(d, ("triton", "triton_tma"), dtype="bf16")))
    return d.loc[d["metrics.tflops"].idxmax()] if len(d) else None
