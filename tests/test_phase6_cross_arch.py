"""Every accelerator on one roofline: the arithmetic of architectures.py for a made-up hardware entry
added through LAB_HARDWARE_YAML (and for one with no compute peak), the generated tables and the
binding-constraint finding covering it, the plot drawn for all entries, and the quoted records
agreeing with seed.py."""
import json

import pytest
import yaml

from common import render, report
from common.formats import num
from common.paths import REPO_ROOT
from common.records import load_records
from phases.phase6_hardware import architectures, cross_arch, findings, quoted, seed
from phases.phase5_inference.engine import SHAPES

MADE_UP = {"name": "Made-Up Accelerator X1", "vendor": "nobody", "kind": "npu", "match": [],
           "memory_gb": {"value": 8}, "memory_bandwidth_gbps": {"value": 1000},
           "peak_tflops": {"bf16": {"value": 100}}, "interconnect_gbps": {"value": 50}}
NO_PEAK = {"name": "Bandwidth-Only Y2", "kind": "gpu", "match": [], "memory_gb": {"value": 200},
           "memory_bandwidth_gbps": {"value": 2000}, "peak_tflops": {}}


@pytest.fixture
def with_made_up(tmp_path, monkeypatch):
    doc = yaml.safe_load((REPO_ROOT / "hardware.yaml").read_text())
    doc["hardware"]["made_up_x1"] = MADE_UP
    doc["hardware"]["no_peak_y2"] = NO_PEAK
    path = tmp_path / "hardware.yaml"
    path.write_text(yaml.safe_dump(doc))
    monkeypatch.setenv("LAB_HARDWARE_YAML", str(path))


@pytest.fixture(scope="module")
def committed_view():
    records = load_records(REPO_ROOT / "results", strict=True)
    return render.View(report.frame_of(records), REPO_ROOT / "phases" / "phase6_hardware" / "README.md",
                       REPO_ROOT / "results")


def test_a_made_up_entry_gets_every_prediction(with_made_up):
    by_key = {a.key: a for a in architectures.architectures()}
    a = by_key["made_up_x1"]
    assert a.ridge == pytest.approx(100.0)                                    # 100 TFLOP/s over 1,000 GB/s
    n = architectures.MATMUL_N
    assert a.matmul_ms == pytest.approx(2 * n**3 / 100e12 * 1e3) and a.matmul_bound == "compute"
    eight, seventy = a.decode["llama-3.1-8b"], a.decode["llama-3.3-70b"]
    w8 = SHAPES["llama-3.1-8b"].weight_bytes()
    assert not eight.fits and eight.min_devices == -(-int(w8) // int(8e9)) == 3
    assert eight.tok_s == pytest.approx(1000e9 / SHAPES["llama-3.1-8b"].decode_weight_bytes())
    assert eight.tok_s_parallel == pytest.approx(3 * eight.tok_s) and eight.binds.startswith("capacity")
    assert seventy.min_devices == 18 and "18 devices of 8 GB" in seventy.binds
    assert "compute" in architectures.matmul_binds(a)
    # a sheet with no compute peak: memory-side only, no invented time
    y = by_key["no_peak_y2"]
    assert (y.peak_tflops, y.ridge, y.matmul_ms) == (None, None, None)
    assert architectures.matmul_binds(y).startswith("unknown") and y.decode["llama-3.1-8b"].fits


def test_the_tables_and_finding_cover_every_entry_including_a_new_one(with_made_up, committed_view):
    names = [a.name for a in architectures.architectures()]
    roof, decode = cross_arch.roofline_table(committed_view), cross_arch.decode_table(committed_view)
    binding = findings.binding(committed_view)
    for name in names:
        assert f"| {name} |" in roof and f"| {name} |" in decode and f"**{name}**" in binding, name
    line = next(ln for ln in roof.splitlines() if ln.startswith("| Made-Up Accelerator X1 |"))
    assert "| 1,000 | 100 | 100 | 11 (100) | compute |" in line
    rows = [ln for ln in decode.splitlines() if ln.startswith("| Made-Up Accelerator X1 |")]
    assert len(rows) == 2 and "no: 3 devices" in rows[0] and "no: 18 devices" in rows[1]
    assert "| Bandwidth-Only Y2 | gpu | 2,000 | - | - | - |" in roof


def test_measured_and_quoted_figures_sit_beside_their_entry(committed_view):
    roof, decode = cross_arch.roofline_table(committed_view), cross_arch.decode_table(committed_view)
    tpu = next(ln for ln in roof.splitlines() if ln.startswith("| Google Cloud TPU v5e |"))
    assert "142.3 (the seed)" in tpu
    a100 = next(ln for ln in decode.splitlines() if ln.startswith("| NVIDIA A100 SXM4 80GB | 70B |"))
    assert "21.2 on 2 devices (the seed)" in a100
    names = {a.key: a.name for a in architectures.architectures()}
    for (hw, model), tok_s in cross_arch.measured_decode(committed_view).items():   # the lab's own phase 5 runs
        if hw in names and model in architectures.DECODE_MODELS:
            line = next(ln for ln in decode.splitlines()
                        if ln.startswith(f"| {names[hw]} | {cross_arch.MODEL_LABEL[model]} |"))
            assert f"| {num(tok_s)} |" in line


def test_the_roofline_plot_draws_every_entry(with_made_up, committed_view, tmp_path):
    spec = next(b for b in report.blocks().values() if b.id == "phase6.rooflines")
    assert spec.hardware(committed_view) == ["all"]
    path = tmp_path / "rooflines.png"
    spec.draw(committed_view, "all", path)
    assert path.stat().st_size > 10_000


def test_quoted_records_are_what_seed_py_says(committed_view):
    """The committed quoted records hold seed.py's figures: changing one without the other fails."""
    committed = [r for r in load_records(REPO_ROOT / "results", phase=6) if r["source"]["kind"] == "quoted"]
    built = quoted.records()
    assert len(committed) == len(built)
    for rec in built:
        assert any(quoted.same(json.loads(json.dumps(rec)), old) for old in committed), rec["hardware"]["key"]
    for rec in committed:
        assert rec["source"]["citation"].startswith("seed write-up") and rec["rows"]
        assert all(r["timing"] is None for r in rec["rows"])           # nothing was timed here
    assert seed.MATMUL_TFLOPS["tpu_v5e"].value == 142.3 and seed.GROQ_RUNS["groq_lpu"]["llama-3.1-8b"] == (672.9, 130.8)
