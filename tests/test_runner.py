"""common/runner.py, common/exercise.py, common/registry.py: run, skip, fail, select."""
import pytest
import torch

from common.errors import LabError
from common.exercise import Context, Exercise, Needs, Result, measure, row
from common.records import problems, write_record
from common.params import Int
from common.registry import all_exercises, select
from common.runner import checked_params, make_context, parse_overrides, run_one, validate_selection
from conftest import cpu_only


def exercise(ex_id):
    [ex] = select([ex_id])
    return ex


def _run(ex, ctx, static, **kw):
    params = checked_params([ex], ctx, kw.pop("overrides", {}))[ex.id]
    return run_one(ex, ctx, params, static, kw.pop("rate", None), kw.pop("source", None))


# ------------------------------------------------------------------------------ crashes and failures
def test_a_crashing_exercise_is_recorded_not_raised(spec_ctx, static_for, tmp_path):
    def run(ctx, params):
        raise ValueError("boom: the kernel exploded\nsecond line of detail")

    ex = Exercise(id="phase9.crash", title="crashes", run=run)
    ctx = spec_ctx()
    rec = _run(ex, ctx, static_for(ctx))
    assert rec["status"] == "failed"
    assert rec["reason"] == "ValueError: boom: the kernel exploded"
    assert "\n" not in rec["reason"]
    assert rec["rows"] == [] and rec["summary"] == {"error": rec["reason"]}
    assert problems(rec) == []
    assert write_record(rec, tmp_path).is_file()


def test_a_lab_error_inside_an_exercise_fails_it(spec_ctx, static_for):
    def run(ctx, params):
        raise LabError("ncu could not profile elementwise: ERR_NVGPUCTRPERM")

    ctx = spec_ctx()
    rec = _run(Exercise(id="phase9.labby", title="t", run=run), ctx, static_for(ctx))
    assert rec["status"] == "failed" and "ERR_NVGPUCTRPERM" in rec["reason"]


def test_unmet_needs_skip_with_the_reason(spec_ctx, static_for):
    called = []
    ex = Exercise(id="phase9.tool", title="t", run=lambda c, p: called.append(1),
                  needs=Needs(tools=("definitely-not-installed-tool-xyz",)))
    ctx = spec_ctx()
    rec = _run(ex, ctx, static_for(ctx))
    assert called == []
    assert rec["status"] == "skipped"
    assert rec["reason"] == "needs `definitely-not-installed-tool-xyz` on PATH; not found"
    assert problems(rec) == []


@pytest.mark.parametrize("needs, words", [
    (Needs(cuda=True), "needs a CUDA GPU"),
    (Needs(modules=("no_such_module_xyz",)), "no_such_module_xyz"),
    (Needs(env=("LAB_TEST_NEVER_SET_XYZ",)), "LAB_TEST_NEVER_SET_XYZ"),
])
def test_needs_unmet_reasons(spec_ctx, needs, words):
    if needs.cuda and torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    reason = needs.unmet(spec_ctx())
    assert words in reason and "\n" not in reason
    assert Needs().unmet(spec_ctx()) is None


def test_failed_check_gives_a_failed_row_without_timing(spec_ctx):
    timed = []
    verdict = {"reference": "r", "metric": "rel_l2", "precision": "fp32", "tolerance": 5e-5,
               "rel_l2_error": 0.5, "max_abs_error": 1.0, "passed": False,
               "reason": "relative error 5.00e-01 > tolerance 5e-05"}
    r = measure(spec_ctx(), "bad", {"n": 4}, fn=lambda: timed.append(1), check=lambda: verdict,
                flops=4, bytes_moved=48, dtype="fp32")
    assert timed == []                                    # never timed
    assert r["status"] == "failed" and r["reason"] == verdict["reason"]
    assert r["timing"] is None and r["prediction"] is None and r["metrics"] == {}
    assert r["check"] is verdict


def test_passing_check_gives_a_timed_row_with_prediction(spec_ctx):
    verdict = {"reference": "r", "metric": "exact", "precision": None, "tolerance": 0.0,
               "rel_l2_error": None, "max_abs_error": None, "passed": True, "reason": None}
    x = torch.rand(1000)
    y = torch.empty_like(x)
    r = measure(spec_ctx(), "copy", {"n": 1000}, fn=lambda: y.copy_(x), check=lambda: verdict,
                flops=0, bytes_moved=8000, dtype=None)
    assert r["status"] == "ok" and r["timing"]["samples"] >= 3
    p = r["prediction"]
    assert p["roofs_source"] == "hardware.yaml:h200_sxm" and p["bytes"] == 8000
    assert p["measured_ms"] == r["timing"]["median_ms"] == r["metrics"]["ms"]
    assert p["measured_over_predicted"] == pytest.approx(p["measured_ms"] / p["predicted_ms"])
    assert r["metrics"]["gbps"] == pytest.approx(8000 / (r["metrics"]["ms"] * 1e6))
    assert r["metrics"]["peak_bandwidth_gbps"] == 4800


def test_one_failed_row_fails_the_record(spec_ctx, static_for):
    bad = {"passed": False, "reason": "3 NaN elements (unwritten or invalid output)"}

    def run(ctx, params):
        return Result([row("good", {}, metrics={"x": 1.0}),
                       measure(ctx, "bad", {}, fn=lambda: None, check=lambda: bad, flops=0, bytes_moved=1,
                               dtype=None)])

    ctx = spec_ctx()
    rec = _run(Exercise(id="phase9.mixed", title="t", run=run), ctx, static_for(ctx))
    assert rec["status"] == "failed"
    assert rec["reason"] == "1 of 2 rows failed; first: bad: 3 NaN elements (unwritten or invalid output)"
    assert problems(rec) == []


# ------------------------------------------------------------------------------ variants
def test_variant_filter_runs_only_that_variant(spec_ctx, static_for):
    ctx = spec_ctx(variants=("mul",))
    rec = _run(exercise("phase1.elementwise"), ctx, static_for(ctx), overrides={"sizes": [1000]})
    assert [r["variant"] for r in rec["rows"]] == ["mul"]
    assert rec["provenance"]["variants"] == ["mul"]
    assert rec["status"] == "ok"


def test_no_variant_selected_is_a_skip(spec_ctx, static_for):
    ex = Exercise(id="phase9.v", title="t", run=lambda c, p: Result([]), variants=("a",))
    ctx = spec_ctx(variants=("b",))
    rec = _run(ex, ctx, static_for(ctx))
    assert rec["status"] == "skipped" and rec["reason"] == "no variant selected"


def test_run_must_return_one_type(spec_ctx, static_for):
    """A run() that returns a bare list (the old convention) fails its record, naming the contract."""
    ex = Exercise(id="phase9.old", title="t", run=lambda c, p: [row("a", {}, metrics={"x": 1.0})])
    ctx = spec_ctx()
    rec = _run(ex, ctx, static_for(ctx))
    assert rec["status"] == "failed" and "must return a common.exercise.Result" in rec["reason"]


def test_gates_honour_the_variant_filter(spec_ctx, static_for):
    ctx = spec_ctx(variants=("torch_version",))
    rec = _run(exercise("phase0.gates"), ctx, static_for(ctx))
    assert [r["variant"] for r in rec["rows"]] == ["torch_version"]


@cpu_only
def test_a_record_whose_rows_all_skipped_says_why(spec_ctx, static_for):
    ctx = spec_ctx(variants=("tf32",))                  # TF32 does not exist on a CPU
    rec = _run(exercise("phase0.matmul_baseline"), ctx, static_for(ctx))
    assert rec["status"] == "skipped"
    assert rec["reason"]


# ------------------------------------------------------------------------------ params
def test_resolve_params_precedence():
    ex = Exercise(id="phase9.p", title="t", run=None, params={"n": Int(4096, min=1), "reps": Int(20, min=1)},
                  cpu_params={"n": 512}, quick_params={"n": 64})
    assert ex.resolve_params(False, False, {}) == {"n": 4096, "reps": 20}
    assert ex.resolve_params(True, False, {}) == {"n": 512, "reps": 20}
    assert ex.resolve_params(True, True, {}) == {"n": 64, "reps": 20}
    assert ex.resolve_params(True, True, {"n": 7, "other": 1}) == {"n": 7, "reps": 20}
    assert (ex.phase, ex.name) == (9, "p")


def test_parse_overrides():
    assert parse_overrides(["sizes=[1024, 2048]", "n=8", "dtype=fp16", "x = 1.5"]) == {
        "sizes": [1024, 2048], "n": 8, "dtype": "fp16", "x": 1.5}
    with pytest.raises(LabError, match="KEY=VALUE"):
        parse_overrides(["nokey"])
    with pytest.raises(LabError, match="cannot parse"):
        parse_overrides(["sizes=[1, 2"])


def test_validate_selection():
    exs = select(["1"])
    validate_selection(exs, {"sizes": [1]}, ("mul",))
    with pytest.raises(LabError, match="--param unknownkey"):
        validate_selection(exs, {"unknownkey": 3}, ())
    with pytest.raises(LabError, match="--variant nope.*known: .*mul"):
        validate_selection(exs, {}, ("nope",))


# ------------------------------------------------------------------------------ registry
def test_registry_lists_phases_0_and_1_in_order():
    every = [e.id for e in all_exercises()]
    assert len(set(every)) == len(every)
    assert every == sorted(every, key=lambda i: int(i[5]))          # lab order: by phase
    ids = [i for i in every if i[:6] in ("phase0", "phase1")]
    assert ids == ["phase0.gates", "phase0.matmul_baseline", "phase0.synchronize", "phase0.timer_check",
                   "phase1.ceilings", "phase1.elementwise", "phase1.matmul_fp16", "phase1.regime_sweep",
                   "phase1.cache_sweep", "phase1.nsight"]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("selectors, expected", [
    (["1"], 6), (["phase1"], 6), (["phase1.elementwise"], 1), (["elementwise"], 1),
    (["0", "1"], 10), (["1", "elementwise", "phase1"], 6), (["PHASE1.Elementwise"], 1),
])
def test_select(selectors, expected):
    got = select(selectors)
    assert len(got) == expected and len({e.id for e in got}) == expected


def test_select_all():
    assert [e.id for e in select(["all"])] == [e.id for e in all_exercises()]


@pytest.mark.parametrize("bad, words", [(["9"], "phase 9 has no exercises"), (["nope"], "unknown phase or exercise 'nope'")])
def test_select_errors(bad, words):
    with pytest.raises(LabError, match=words):
        select(bad)


# ------------------------------------------------------------------------------ the context
@cpu_only
def test_make_context_on_cpu():
    ctx = make_context("auto", quick=True)
    assert ctx.device.type == "cpu" and ctx.spec is None and ctx.hardware_key == "cpu"
    assert make_context("cpu").hardware_key == "cpu"


@cpu_only
@pytest.mark.parametrize("kwargs, words", [
    ({"device": "cuda"}, "no CUDA GPU is visible"),
    ({"device": "gpu"}, "--device must be auto, cpu or cuda"),
    ({"hardware": "nope"}, "unknown hardware key 'nope'"),
    ({"hardware": "h200_sxm"}, "names a gpu, but this run is on the CPU"),
])
def test_make_context_errors_on_cpu(kwargs, words):
    with pytest.raises(LabError, match=words):
        make_context(**kwargs)


def _fake_gpu(monkeypatch, name):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: name)


def test_gpu_missing_from_hardware_yaml_is_an_error(monkeypatch):
    _fake_gpu(monkeypatch, "NVIDIA Foo 9000")
    with pytest.raises(LabError) as info:
        make_context()
    msg = str(info.value)
    assert "NVIDIA Foo 9000" in msg and "--hardware" in msg and "hardware.yaml" in msg
    assert "\n" not in msg


def test_known_gpu_is_matched_and_hardware_flag_overrides(monkeypatch):
    _fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    ctx = make_context()
    assert ctx.hardware_key == "h100_sxm" and ctx.device == torch.device("cuda", 0)
    assert ctx.roofs("fp16").peak("fp16") == 989.5 and ctx.roofs().bandwidth_gbps == 3350
    _fake_gpu(monkeypatch, "NVIDIA Foo 9000")
    assert make_context(hardware="h200_sxm").hardware_key == "h200_sxm"


def test_spec_roofs_carry_their_sources(spec_ctx):
    roofs = spec_ctx().roofs("fp16")
    assert roofs.source == "hardware.yaml:h200_sxm"
    assert roofs.bandwidth_gbps == 4800 and roofs.peak("fp16") == 989.5
    assert "AnandTech" in roofs.bandwidth_source and roofs.peak_sources["fp16"]


def test_context_quick_timing_is_short(spec_ctx):
    t = spec_ctx(quick=True).time(lambda: None)
    assert t.samples >= 3 and t.method == "cpu perf_counter"


def test_context_wants():
    ctx = Context(torch.device("cpu"), None, "cpu", variants=("a",))
    assert ctx.wants("a") and not ctx.wants("b")
    assert Context(torch.device("cpu"), None, "cpu").wants("anything")
