"""Shared fixtures for the CPU-only suite.

Nothing here writes into the repository's results/: every results folder is a tmp_path, and an
autouse fixture points LAB_RESULTS_DIR at a throwaway folder so a forgotten --results cannot
reach the real one.
"""
import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from common import roofline
from common.cost import cost_block
from common.exercise import Context
from common.hardware import load_hardware
from common.records import SCHEMA_VERSION, load_records
from common.timing import summarize

REPO = Path(__file__).resolve().parent.parent
LAB_VARS = ("LAB_RESULTS_DIR", "LAB_USD_PER_HOUR", "LAB_HARDWARE_YAML", "LAB_GIT_COMMIT", "LAB_DATA_DIR",
            "LAB_API_KEY")

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts CPU-only behaviour")

# The Triton-interpreter test files run twice: their rule tests here, their kernel tests again in a
# child pytest with TRITON_INTERPRET=1 (kernels_pass_in_an_interpreter_child).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
in_child = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter child")
in_parent = pytest.mark.skipif(INTERPRETED, reason="runs in the parent process")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs the Python package `triton` (pip install triton)")


# ------------------------------------------------------------------------------ environment
@pytest.fixture(scope="session", autouse=True)
def _temp_files_in_pytests_folder(tmp_path_factory):
    """Every temporary file of the run, the children's included (torchrun's torchelastic_* logs,
    engines' scratch files), goes under pytest's own temp folder, which a passing run removes
    (pyproject.toml: tmp_path_retention_policy = "failed"); a failing run keeps it to look at."""
    folder = tmp_path_factory.mktemp("tmp")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = None                      # re-read TMPDIR
    yield folder
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch, tmp_path_factory):
    for var in LAB_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LAB_RESULTS_DIR", str(tmp_path_factory.mktemp("guard-results")))


@pytest.fixture(scope="module")
def two_torch_threads():
    """At most two CPU threads for torch while a module's engine tests run (the CI machine has two
    cores); use with `pytestmark = pytest.mark.usefixtures("two_torch_threads")`."""
    import torch
    previous = torch.get_num_threads()
    torch.set_num_threads(min(2, previous))
    yield
    torch.set_num_threads(previous)


def tiny_transformers_llama(weights: dict):
    """transformers' LlamaForCausalLM of the lab's 'tiny' shape holding `weights` (the engine's
    correctness reference; skips where transformers is missing)."""
    transformers = pytest.importorskip("transformers")
    from phases.phase5_inference.engine import hf_config, named
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(named("tiny")))).eval()
    model.load_state_dict(weights, strict=False)
    return model


def clean_env(**extra) -> dict:
    """os.environ without the lab's variables (for subprocesses), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in LAB_VARS}
    env.update(extra)
    return env


def passes_under_the_interpreter(test_file: str, allowed_skips: tuple[str, ...], timeout_s: int = 300) -> None:
    """Run `test_file` again in a child pytest with TRITON_INTERPRET=1 (it must be set before triton
    is imported, so the parent cannot switch it on) and assert that the child passed and skipped
    nothing but the tests whose skip reasons contain one of `allowed_skips`."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-rs", "-p", "no:cacheprovider", test_file],
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=timeout_s,
                          env=clean_env(TRITON_INTERPRET="1", PYTHONWARNINGS="ignore"))
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout, tail
    skips = [ln for ln in proc.stdout.splitlines() if ln.startswith("SKIPPED")]
    assert all(any(reason in ln for reason in allowed_skips) for ln in skips), tail


def kernels_pass_in_an_interpreter_child(test_file: str, timeout_s: int = 800) -> None:
    """Run `test_file`'s CPU tests again in a child pytest with TRITON_INTERPRET=1 (it must be set
    before triton is imported) and assert they passed; skip when the child says this machine's
    triton interpreter cannot run (interpreter_helpers.py), rather than fail."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-rs", "-p", "no:cacheprovider", "-m", "not gpu",
                           test_file], cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
                          env=clean_env(TRITON_INTERPRET="1", PYTHONWARNINGS="ignore"))
    tail = (proc.stdout + proc.stderr)[-6000:]
    unusable = [ln for ln in proc.stdout.splitlines() if "triton interpreter unusable here" in ln]
    if unusable and " passed" not in proc.stdout:
        pytest.skip(unusable[0][unusable[0].index("triton interpreter"):])
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " failed" not in proc.stdout, tail


def lab_cmd() -> list[str]:
    exe = shutil.which("lab")
    return [exe] if exe else [sys.executable, "-m", "common.cli"]


def run_lab(*args, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    """`lab ARGS` as a user would type it (the console script), output captured."""
    return subprocess.run([*lab_cmd(), *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or REPO, env=clean_env(), timeout=timeout)


@pytest.fixture
def lab(capsys):
    """Call common.cli.main in-process: returns (exit code, stdout, stderr)."""
    from common.cli import main

    def call(*args):
        capsys.readouterr()
        rc = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return rc, out, err

    return call


def json_files(folder: Path) -> list[Path]:
    folder = Path(folder)
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix == ".json") if folder.exists() else []


def assert_one_line_error(rc, err, results: Path | None = None):
    """A user mistake: non-zero exit, exactly one stderr line starting `lab:`, no traceback, no record."""
    assert rc != 0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("lab: "), err
    assert "Traceback" not in err
    if results is not None:
        assert json_files(results) == []


# ------------------------------------------------------------------------------ shared quick run
@pytest.fixture(scope="session")
def quick_run(tmp_path_factory):
    """One `lab run 0 1 --quick` through the console script, shared by every test that reads records."""
    results = tmp_path_factory.mktemp("quick") / "results"
    proc = run_lab("run", "0", "1", "--quick", "--results", results)
    return {"results": results, "rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}


@pytest.fixture(scope="session")
def quick_records(quick_run) -> list[dict]:
    assert quick_run["rc"] == 0, quick_run["stdout"] + quick_run["stderr"]
    return load_records(quick_run["results"])


def as_full_run(record: dict) -> dict:
    """A smoke record made to pass for a full run (`provenance.quick` off): the report never reads
    smoke records, and a full run of phases 0 and 1 takes too long for the report's tests."""
    record = copy.deepcopy(record)
    record["provenance"]["quick"] = False
    return record


@pytest.fixture
def quick_results_copy(quick_run, tmp_path) -> Path:
    """A private copy of the quick run's results, each record passed off as a full run (see
    as_full_run), for the report's tests (those that draw plots write into it)."""
    assert quick_run["rc"] == 0, quick_run["stdout"] + quick_run["stderr"]
    dst = tmp_path / "results"
    shutil.copytree(quick_run["results"], dst)
    for path in json_files(dst):
        path.write_text(json.dumps(as_full_run(json.loads(path.read_text())), indent=2))
    return dst


def by_exercise(records: list[dict], ex_id: str) -> dict:
    [rec] = [r for r in records if r["exercise"]["id"] == ex_id]
    return rec


# ------------------------------------------------------------------------------ contexts
@pytest.fixture(scope="session")
def specs():
    return load_hardware()


@pytest.fixture
def spec_ctx(specs):
    """A CPU context carrying the H200 spec sheet: roofs come from hardware.yaml, so nothing has to
    measure this machine's bandwidth first (fast), and predictions are deterministic."""
    def make(variants=(), quick=True):
        return Context(torch.device("cpu"), specs["h200_sxm"], "h200_sxm", tuple(variants), quick)
    return make


@pytest.fixture
def static_for():
    from common.runner import static_blocks
    return lambda ctx: static_blocks(ctx, ["lab", "run", "test"])


# ------------------------------------------------------------------------------ a record by hand
def _make_record(**overrides) -> dict:
    roofs = roofline.Roofs(bandwidth_gbps=100.0, peak_tflops={"fp32": 1.0}, source="test roofs")
    timing = summarize([0.4, 0.5, 0.6], "cpu perf_counter", warmup_calls=2, flush_l2=False).as_dict()
    row = {
        "variant": "mul", "params": {"n": 1000, "dtype": "fp32"}, "status": "ok", "reason": None,
        "check": {"reference": "float64 product", "metric": "rel_l2", "precision": "fp32",
                  "tolerance": 5e-5, "rel_l2_error": 1e-8, "max_abs_error": 1e-7, "passed": True,
                  "reason": None},
        "timing": timing, "metrics": {"ms": 0.5, "gbps": 24.0, "tokens_per_s": 10.0},
        "prediction": roofline.predict(1000, 12000, roofs, "fp32", 0.5),
    }
    rec = {
        "schema_version": SCHEMA_VERSION,
        "exercise": {"id": "phase1.elementwise", "phase": 1, "name": "elementwise",
                     "title": "Memory-bound anchor", "bench_version": 1},
        "status": "ok", "reason": None, "params": {"sizes": [1000]}, "rows": [row], "summary": {},
        "source": {"kind": "measured", "citation": None},
        "hardware": {"key": "cpu", "device": "cpu", "name": "test cpu", "spec": None},
        "software": {"python": "3.11", "torch": "2.13.0+cpu", "triton": None},
        "provenance": {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": False, "source": "git",
                       "command": "lab run 1", "started_utc": "2026-11-21T12:00:00Z", "duration_s": 1.0},
        "cost": cost_block(None, None, 1.0),
    }
    rec.update(overrides)
    return copy.deepcopy(rec)


@pytest.fixture
def make_record():
    return _make_record


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
