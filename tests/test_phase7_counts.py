"""Phase 7's cost model (phases/phase7_gpt/cost.py) against hand computations on an irregular shape:
FLOPs, the fewest bytes and the kernels of one step; the kernel estimate's per-block structure against
the aten ops a CPU dispatches; `lab predict` for every timed exercise; the report's recount of older rows."""
from collections import Counter

import pandas as pd
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common import roofline
from phases.phase7_gpt.cost import (
    GPTConfig,
    flops_per_token,
    multi_tensor_launches,
    param_formula,
    step_bytes,
    step_cost,
    step_kernels,
)

# 3 layers, 5 heads of 8 channels, a 24-token window, a 101-row vocabulary padded to 104
ODD = GPTConfig(vocab_size=101, block_size=24, n_layer=3, n_head=5, n_embd=40, vocab_multiple=8)
TOKENS = 3 * 24


def test_parameters_and_flops_by_hand():
    # wte 104 x 40, wpe 24 x 40, blocks 3 x (12 x 40^2 + 4 x 40), ln_f 2 x 40
    assert param_formula(ODD)["total"] == 4160 + 960 + 3 * 19360 + 80 == 63280
    # 6 x (3 x 19360 + 80) + 12 x 3 x 40 x 24 + 6 x 40 x 101 (the real vocabulary)
    assert flops_per_token(ODD)["total"] == 348960 + 34560 + 24240 == 407760
    assert step_cost(ODD, 3, "bf16")["flops"] == 407760 * 72


def test_step_bytes_by_hand():
    state = 44 * 63280               # weights read twice (8), gradient written (4), its norm read (4), AdamW (28)
    # saved per token: 7 residual-stream rows of 40 fp32 (3 block inputs, 3 mid-blocks, the final LayerNorm's
    # input), 3 layers x 8 bf16 rows of 40 (q, k, v, attention output, 4d MLP pre-activation), 3 x 5 fp32 log-sum-exp
    saved = 7 * 40 * 4 + 3 * 8 * 40 * 2 + 3 * 5 * 4
    assert saved == 3100
    b = step_bytes(ODD, TOKENS, "bf16")
    assert b["activations"] == 2 * saved * 72 == 446400            # written in the forward, read in the backward
    assert b["batch"] == 16 * 72
    assert b["total"] == state + 446400 + 1152 == 3231872
    # a CPU run: every activation fp32
    assert step_bytes(ODD, TOKENS, "fp32")["total"] == state + 2 * (7 * 40 * 4 + 3 * 8 * 40 * 4 + 60) * 72 + 1152
    # forward + backward only (the sdpa rows): weights twice and the gradient, 12 bytes a parameter
    assert step_bytes(ODD, TOKENS, "bf16", optimizer=False)["total"] == 12 * 63280 + 446400 + 1152
    # no residual adds: the stream after the first block is the linears' bf16 output
    flat = GPTConfig(**{**ODD.as_dict(), "residual": False})
    assert step_bytes(flat, TOKENS, "bf16")["activations"] == 2 * (160 + 6 * 40 * 2 + 3 * 8 * 40 * 2 + 60) * 72


def test_multi_tensor_launches_follow_aten_limits():
    chunk = 65536
    assert multi_tensor_launches([320 * chunk], 110) == 1           # 320 chunks: one full launch
    assert multi_tensor_launches([320 * chunk + 1], 110) == 2       # the 321st chunk starts another
    assert multi_tensor_launches([1] * 110, 110) == 1
    assert multi_tensor_launches([1] * 111, 110) == 2               # 110 tensors fill a launch's list
    assert multi_tensor_launches([1] * 37, 36) == 2
    assert multi_tensor_launches([300 * chunk, 30 * chunk], 110) == 2
    assert multi_tensor_launches([0, 5, 0], 36) == 1                # empty tensors are skipped


def test_step_kernels_by_hand():
    # eager: embedding 4 + 3 blocks x 16 + head 7 forward; seed 1 + head 10 + 3 x 27 + embeddings 6 backward
    # (position sum, 2 per embedding backward: 72 ids need no sort, the tied gradient's add)
    # 28 gradients of at most 6,400 elements: one foreach launch each for the norm and the clip multiply:
    # norm 1 + 1 + 1 + 2, clip 4 + 1; AdamW 2 groups of 14 tensors: 1 step increment + 1 launch each
    k = step_kernels(ODD, TOKENS)
    assert (k["forward"], k["backward"], k["grad_norm"], k["optimizer"], k["data"], k["bookkeeping"]) == \
        (4 + 48 + 7, 1 + 10 + 81 + 6, 10, 4, 5, 2)
    assert k["total"] == 178
    assert step_kernels(ODD, TOKENS, clip=False)["total"] == 178 - 5
    assert step_kernels(ODD, 200 * 24)["total"] == 178 + 13                 # 4,800 ids: the sorted backward
    # compiled: 5 + 3 x 12 forward, 13 + 3 x 23 backward; the rest as eager
    assert step_kernels(ODD, TOKENS, compiled=True)["total"] == 41 + 82 + 10 + 4 + 5 + 2
    # the sdpa rows: forward + backward only; math attention 19 + the transpose's copy forward, 14 backward
    assert step_kernels(ODD, TOKENS, optimizer=False, data=False)["total"] == 59 + 98
    assert step_kernels(ODD, TOKENS, optimizer=False, data=False, attention="math")["total"] == \
        (4 + 3 * (16 - 1 + 20) + 7) + (1 + 10 + 3 * (27 - 3 + 14) + 6)
    assert step_cost(ODD, 3, "bf16", compiled=True)["launches"] == 144


class _Ops(TorchDispatchMode):
    """Counts the aten ops that compute (views, allocations and metadata left out)."""
    FREE = {"view", "_unsafe_view", "transpose", "t", "expand", "permute", "split", "split_with_sizes", "select",
            "slice", "unsqueeze", "squeeze", "as_strided", "alias", "detach", "_reshape_alias", "reshape", "unbind",
            "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "is_same_size",
            "_local_scalar_dense", "lift_fresh"}

    def __init__(self):
        super().__init__()
        self.n = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in self.FREE:
            self.n[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _cpu_ops(layers: int, **switches) -> tuple[int, int]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from phases.phase7_gpt.gpt import GPT
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=97, block_size=16, n_layer=layers, n_head=2, n_embd=16, **switches))
    x = torch.randint(0, 97, (2, 16))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        with _Ops() as f:
            _, loss = model(x, x.roll(1, 1))
        with _Ops() as b:
            loss.backward()
    return sum(f.n.values()), sum(b.n.values())


@pytest.mark.parametrize("switches, cpu, cuda_extra", [
    # per block on a CPU: 4 matmuls, 2 LayerNorms, attention, GELU, 2 residual adds forward; 8 matmuls, 2
    # LayerNorm backwards, attention, GELU, the cat of dq, dk, dv, 2 residual accumulations backward.
    # CUDA adds 6 casts forward (4 weights, 2 inputs); 4 gradient casts, 2 input-cast backwards, 2 output-gradient
    # casts, a second kernel per LayerNorm backward and 2 more in flash attention's backward
    ({}, (10, 15), (6, 12)),
    ({"layernorm": False}, (8, 13), (6, 10)),
    ({"residual": False}, (8, 13), (6, 12)),
])
def test_kernel_estimate_per_block_matches_the_modules_ops(switches, cpu, cuda_extra):
    (f1, b1), (f3, b3) = _cpu_ops(1, **switches), _cpu_ops(3, **switches)
    assert ((f3 - f1) // 2, (b3 - b1) // 2) == cpu
    cfg = GPTConfig(vocab_size=97, block_size=16, n_layer=1, n_head=2, n_embd=16, **switches)
    one = step_kernels(cfg, 32, optimizer=False, data=False)
    three = step_kernels(GPTConfig(**{**cfg.as_dict(), "n_layer": 3}), 32, optimizer=False, data=False)
    assert ((three["forward"] - one["forward"]) // 2, (three["backward"] - one["backward"]) // 2) == \
        (cpu[0] + cuda_extra[0], cpu[1] + cuda_extra[1])


# ------------------------------------------------------------------------------ the exercises
def _works(exercise, params):
    return {w.label: w for w in exercise.work(exercise.resolve_params(False, False, params))}


def test_work_lists_every_timed_row_with_the_shared_formulas():
    from phases.phase7_gpt import failures, model, overfit, scaling
    from phases.phase7_gpt.train import TrainConfig
    w = _works(model.EXERCISE, {"model_run": {"n_layer": 3, "n_head": 5, "n_embd": 40}, "block_size": 24,
                                "vocab_multiple": 8, "sdpa_batch": 3})
    flash, math_ = w["sdpa_flash 3 x 24 tokens"], w["sdpa_math 3 x 24 tokens"]
    # ODD's shape with GPT-2's 50,257 rows (padded to 50,264): 2,069,680 parameters
    n = 50264 * 40 + 960 + 3 * 19360 + 80
    assert (flash.flops, flash.bytes, flash.launches) == ((348960 + 34560 + 6 * 40 * 50257) * 72,
                                                          12 * n + 446400 + 1152, 157)
    assert (math_.flops, math_.bytes) == (flash.flops, flash.bytes) and math_.launches == 247
    assert flash.dtype == "bf16" and flash.warm
    # GPT-2's 50,257-row vocabulary padded to a multiple of 8; throughput, large and reproducibility are one problem
    w = _works(overfit.EXERCISE, {"model_large": {"n_layer": 3, "n_head": 5, "n_embd": 40}, "block_size": 24,
                                  "batch_size": 3, "vocab_multiple": 8})
    assert set(w) == set(overfit.VARIANTS)
    big = GPTConfig(block_size=24, n_layer=3, n_head=5, n_embd=40, vocab_multiple=8)
    for v, compiled in (("throughput", True), ("throughput_eager", False), ("large", True)):
        c = step_cost(big, 3, "bf16", compiled=compiled)
        assert (w[v].flops, w[v].bytes, w[v].launches) == (c["flops"], c["bytes"], c["launches"]), v
    assert w["throughput"].launches < w["throughput_eager"].launches
    w = _works(failures.EXERCISE, {})
    assert w["no_clip"].launches < w["control"].launches and w["no_clip"].bytes == w["control"].bytes
    assert w["no_layernorm"].flops < w["control"].flops
    w = _works(scaling.EXERCISE, {})
    assert list(w) == [s["name"] for s in scaling.SIZES]
    from phases.phase7_gpt.train import step_work
    assert step_work("x", big, TrainConfig(batch_size=3, grad_clip=0.0), "bf16").launches == \
        step_cost(big, 3, "bf16", clip=False)["launches"]


@pytest.mark.parametrize("exercise", ["phase7.model", "phase7.overfit", "phase7.scaling", "phase7.failures"])
def test_lab_predict_lists_the_rows(exercise, tmp_path, capsys):
    from common.cli import main
    assert main(["predict", exercise, "--hardware", "h200_sxm", "--results", str(tmp_path)]) == 0
    assert exercise in capsys.readouterr().out


# ------------------------------------------------------------------------------ older records
CEILINGS = {"hbm_gbps": 4000.0, "l2_gbps": 8000.0, "l2_fit_bytes": 30 * 2**20, "launch_us": 5.0, "graph_launch_us": 1.0,
            "matmul_tflops": {"bf16": 700.0, "fp16": 700.0, "tf32": 350.0, "fp32": 50.0}}
RECORDS = [{"exercise": {"id": "phase1.ceilings"}, "status": "ok", "summary": {"ceilings": CEILINGS},
            "source": {"kind": "measured"}, "hardware": {"key": "h200_sxm"}, "_path": "phase1/ceilings/x.json"}]


def _old(exercise, variant, **params):
    """A frame row as committed before cost.py: bytes without activations, no launches."""
    return pd.Series({"exercise": exercise, "variant": variant, "hardware": "h200_sxm", "source": "measured",
                      "metrics.ms": 10.0, "prediction.measured_ms": 10.0, "prediction.bytes": 1.2e9,
                      "timing.median_ms": 10.0, "timing.flush_l2": False, "timing.graph_reps": float("nan"),
                      "metrics.compile_error": None, **{f"params.{k}": v for k, v in params.items()}})


def test_older_rows_are_calibrated_from_the_recounted_costs():
    from phases.phase7_gpt.report import PHASE, recount
    assert set(PHASE.calibrators) == {"phase7.model", "phase7.overfit", "phase7.scaling", "phase7.failures"}
    cfg = GPTConfig(vocab_multiple=64)
    train = {"batch_size": 64, "compile": True, "grad_clip": 1.0}
    got = recount(_old("phase7.overfit", "throughput", model=cfg.as_dict(), train=train, dtype="bf16"), RECORDS)
    c = step_cost(cfg, 64, "bf16", compiled=True)
    want = roofline.calibrated(c["flops"], c["bytes"], "bf16", CEILINGS, 10.0, working_set_bytes=c["bytes"], warm=True,
                               launches=c["launches"])
    assert got["predicted_ms"] == pytest.approx(want["predicted_ms"]) and got["computed"].startswith("at report time")
    assert got["latency_ms"] == pytest.approx(c["launches"] * 5e-3)
    eager = recount(_old("phase7.overfit", "throughput_eager", model=cfg.as_dict(), train={**train, "compile": False},
                         dtype="bf16"), RECORDS)
    assert eager["latency_ms"] > got["latency_ms"]
    math_ = recount(_old("phase7.model", "sdpa_math", model=cfg.as_dict(), batch=[32, 256], dtype="bf16"), RECORDS)
    c = step_cost(cfg, 32, "bf16", optimizer=False, data=False, attention="math")
    assert math_["latency_ms"] == pytest.approx(c["launches"] * 5e-3)
    assert recount(_old("phase7.model", "params_30m", model=cfg.as_dict(), dtype="bf16"), RECORDS) is None
    assert recount(_old("phase7.overfit", "large", model=cfg.as_dict(), train=train, dtype="bf16"), []) is None
