"""GPU-only checks of the harness's CUDA paths (run on a GPU machine: pytest -m gpu).

They check properties of the measurement, with loose bounds, not performance: the numbers
themselves are recorded by `lab run` (phase0.timer_check compares the harness with do_bench).
"""
import pytest
import torch

from common.checks import compare
from common.cli import main
from common.records import load_records
from common.registry import select
from common.timing import benchmark
from phases.phase0_environment.matmul_baseline import matmul_precision

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_graph_replay_gives_the_per_call_time_of_a_direct_launch():
    # 256 MiB per operand: long enough that launch overhead is negligible either way.
    a = torch.rand(2**26, device="cuda")
    b = torch.empty_like(a)
    fn = lambda: torch.mul(a, 2.0, out=b)  # noqa: E731
    direct = benchmark(fn, "cuda", flush_l2=False).median_ms
    graphed = benchmark(fn, "cuda", flush_l2=False, graph_reps=8).median_ms
    assert 0.8 < graphed / direct < 1.2


def test_l2_flush_makes_an_l2_sized_working_set_cold():
    # 8 MiB in + 8 MiB out fits in any recent L2: warm repeats run from L2, flushed ones from HBM.
    a = torch.rand(2**21, device="cuda")
    b = torch.empty_like(a)
    fn = lambda: b.copy_(a)  # noqa: E731
    warm = benchmark(fn, "cuda", flush_l2=False, graph_reps=32).median_ms
    cold = benchmark(fn, "cuda", flush_l2=True).median_ms
    assert cold > warm


def test_the_fp32_checker_rejects_a_half_precision_matmul_on_the_gpu():
    a, b = torch.randn(1000, 777, device="cuda"), torch.randn(777, 555, device="cuda")
    ref = a.double() @ b.double()
    with matmul_precision("highest"):
        assert compare(a @ b, ref, "fp32", "float64")["passed"]
    with matmul_precision("high"):                      # TF32: a low-precision shortcut
        assert not compare(a @ b, ref, "fp32", "float64")["passed"]
    assert not compare((a.half() @ b.half()).float(), ref, "fp32", "float64")["passed"]


def test_phases_0_and_1_run_and_pass_their_checks_on_cuda(tmp_path):
    assert main(["run", "0", "1", "--quick", "--results", str(tmp_path)]) == 0
    records = load_records(tmp_path)
    assert sorted(r["exercise"]["id"] for r in records) == sorted(ex.id for ex in select(["0", "1"]))
    for rec in records:
        assert rec["status"] in ("ok", "skipped"), (rec["exercise"]["id"], rec["reason"])
        assert rec["hardware"]["device"] == "cuda"
        for row in rec["rows"]:
            if row["timing"]:                           # predicted, or excluded with its reason (a ceiling's row)
                pred = row["prediction"]
                assert (pred.get("measured_over_predicted") or 0) > 0 or pred.get("excluded"), (rec["exercise"]["id"], pred)
