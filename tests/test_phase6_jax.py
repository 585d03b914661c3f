"""Phase 6's JAX exercises on JAX's CPU backend at small sizes: the matmul and attention rows beside
torch's, their counts and predictions, the HLO block each JAX row keeps, implementations the
backend refuses as skipped rows, the checker failing a wrong JAX kernel, valid records, and the
phase 3 Triton rows wired in (under Triton's interpreter, in a child process)."""
import json
import subprocess
import sys

import pytest

pytest.importorskip("jax")

from common.records import problems  # noqa: E402
from common.registry import select  # noqa: E402
from common.runner import run_one  # noqa: E402
from conftest import REPO, clean_env  # noqa: E402
from phases.phase6_hardware import hlo, jax_attention, jax_matmul  # noqa: E402


def by_variant(rows):
    return {r["variant"]: r for r in rows}


def test_matmul_rows_beside_torch(spec_ctx):
    n = 96
    result = jax_matmul.run(spec_ctx(), {"sizes": [n], "dtype": "bf16"})
    rows = by_variant(result.rows)
    assert rows["torch"]["status"] == "ok" and rows["jax_jit"]["status"] == "ok", result.rows
    assert rows["triton"]["status"] == "skipped" and "TRITON_INTERPRET" in rows["triton"]["reason"]
    jax_row = rows["jax_jit"]
    p = jax_row["prediction"]
    assert (p["flops"], p["bytes"], p["dtype"]) == (2 * n**3, 3 * n * n * 2, "bf16")
    assert p["roofs_source"] == "hardware.yaml:h200_sxm"
    assert jax_row["check"]["precision"] == "bf16" and jax_row["check"]["rel_l2_error"] < 1e-2
    assert "wall clock" in jax_row["timing"]["method"] and jax_row["timing"]["flush_l2"] is False
    m = jax_row["metrics"]
    assert m["jax_platform"] == "cpu" and m["hlo_kernels"] >= 1 and m["wall_ms"] == m["ms"]
    assert m["pct_of_torch"] == pytest.approx(100 * rows["torch"]["metrics"]["wall_ms"] / m["wall_ms"])
    assert rows["torch"]["metrics"]["library"] == "CPU BLAS" and rows["torch"]["metrics"]["pct_of_torch"] == 100


def test_a_wrong_jax_matmul_fails_its_check_and_is_not_timed(spec_ctx, monkeypatch):
    real = hlo.compiled
    monkeypatch.setattr(jax_matmul.hlo, "compiled", lambda fn, *args: real(lambda x, y: x.T @ y, *args))
    result = jax_matmul.run(spec_ctx(variants=("jax_jit",)), {"sizes": [80], "dtype": "bf16"})
    [r] = result.rows
    assert r["status"] == "failed" and "relative error" in r["reason"] and r["timing"] is None


def test_attention_rows_fusion_answer_and_refusals(spec_ctx):
    shape = [1, 2, 72, 16]
    result = jax_attention.run(spec_ctx(), {"shapes": [shape], "dtype": "bf16"})
    rows = by_variant(result.rows)
    assert set(rows) == set(jax_attention.VARIANTS)
    for v in ("sdpa_math", "jax_jit_math", "jax_dpa", "jax_dpa_xla"):
        assert rows[v]["status"] == "ok", (v, rows[v]["reason"])
    cudnn = rows["jax_dpa_cudnn"]
    assert cudnn["status"] == "skipped" and "\n" not in cudnn["reason"] and cudnn["timing"] is None
    math_row = rows["jax_jit_math"]
    assert math_row["metrics"]["score_materialized"] is True         # XLA:CPU keeps the scores in memory
    assert math_row["metrics"]["hlo"]["largest_score_buffer_bytes"] >= 2 * 72 * 72 * 2
    assert math_row["prediction"]["flops"] == 4 * 2 * 72 * 72 * 16 and math_row["prediction"]["launches"] >= 3
    assert math_row["metrics"]["pct_of_best_sdpa"] > 0 and math_row["metrics"]["pct_of_best_sdpa_of"].startswith("sdpa")
    answer = result.summary["fusion"]["1x2x72x16"]
    assert answer["xla_fused_attention"] is False and answer["kernels"] == math_row["metrics"]["hlo_kernels"]


def test_wrong_jax_attention_fails_its_check(spec_ctx, monkeypatch):
    monkeypatch.setattr(jax_attention, "plain_math", lambda q, k, v: v)        # skips the attention entirely
    result = jax_attention.run(spec_ctx(variants=("jax_jit_math",)), {"shapes": [[1, 2, 72, 16]], "dtype": "bf16"})
    [r] = result.rows
    assert r["status"] == "failed" and "relative error" in r["reason"] and r["timing"] is None


def test_records_are_valid_and_say_how_they_were_timed(spec_ctx, static_for):
    ctx = spec_ctx(variants=("jax_jit", "torch", "jax_jit_math", "sdpa_math"))
    for ex_id, overrides in (("phase6.jax_matmul", {"sizes": [64]}), ("phase6.jax_attention", {"shapes": [[1, 1, 40, 16]]})):
        [ex] = select([ex_id])
        rec = run_one(ex, ctx, ex.resolve_params(True, True, overrides), static_for(ctx), None, None)
        assert rec["status"] == "ok", rec["reason"]
        assert problems(json.loads(json.dumps(rec))) == []
        assert "wall" in rec["summary"]["timing_note"]


def test_the_phase3_triton_rows_run_under_the_interpreter():
    """The Triton rows of both exercises, through phase 3's tuner and kernels, in fp16 (the
    interpreter does not do bf16), in a child process: TRITON_INTERPRET must be set before import."""
    code = ("from phases.phase6_hardware import jax_matmul as m, jax_attention as a\n"
            "from common.exercise import Context\nfrom common.hardware import load_hardware\nimport torch\n"
            "ctx = Context(torch.device('cpu'), load_hardware()['h200_sxm'], 'h200_sxm', ('triton', 'torch', 'sdpa_math'), True)\n"
            "rows = m.run(ctx, {'sizes': [72], 'dtype': 'fp16'}).rows + a.run(ctx, {'shapes': [[1, 1, 40, 16]], 'dtype': 'fp16'}).rows\n"
            "print([(r['variant'], r['status'], r['reason'], r['metrics'].get('pct_of_torch') or r['metrics'].get('pct_of_best_sdpa')) for r in rows])\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=clean_env(TRITON_INTERPRET="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = eval(proc.stdout.strip().splitlines()[-1])                 # noqa: S307 - our own printout
    triton = [r for r in rows if r[0] == "triton"]
    assert len(triton) == 2 and all(r[1] == "ok" and r[3] > 0 for r in triton), rows


def test_a_tpu_is_held_to_its_own_spec_sheet():
    """On a TPU VM torch sees only the CPU: JAX's rows are predicted from the TPU's hardware.yaml
    entry (matched on JAX's device_kind), torch's rows cannot stand beside them."""
    import torch
    from types import SimpleNamespace
    from common.errors import Skip
    from common.exercise import Context
    from common.timing import summarize
    from phases.phase6_hardware import jax_backend
    ctx = Context(torch.device("cpu"), None, "cpu")
    tpu = SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
    assert "no same-device comparison" in jax_backend.mismatch(ctx, tpu)
    assert jax_backend.spec_of(ctx, tpu).key == "tpu_v5e"
    timing = summarize([1.0, 1.1], "test", 1, flush_l2=False)
    p = jax_backend.predict(ctx, tpu, 2 * 4096**3, 3 * 4096**2 * 2, "bf16", timing)
    assert p["roofs_source"] == "hardware.yaml:tpu_v5e" and p["peak_tflops"] == 197 and p["bound"] == "compute"
    with pytest.raises(Skip, match="no hardware.yaml entry matches"):
        jax_backend.spec_of(ctx, SimpleNamespace(platform="tpu", device_kind="TPU v99"))
    gpu_ctx = Context(torch.device("cuda", 0), None, "gpu")
    assert "JAX found no GPU" in jax_backend.mismatch(gpu_ctx, SimpleNamespace(platform="cpu", device_kind="cpu"))
