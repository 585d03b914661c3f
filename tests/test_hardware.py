"""hardware.yaml and common/hardware.py: the spec sheets, their sources, and matching a GPU."""
import re

import pytest
import yaml

from common.errors import LabError
from common.hardware import DTYPES, get_spec, load_hardware, match_gpu, slug
from common.paths import hardware_yaml
from common.roofline import ridge_point

REQUIRED = ["h200_sxm", "h100_sxm", "a100_sxm_40gb", "a100_sxm_80gb", "rtx_4090", "mi300x",
            "tpu_v5e", "wormhole_n300", "groq_lpu"]


@pytest.fixture(scope="module")
def raw():
    return yaml.safe_load(hardware_yaml().read_text())


def _figures(entry):
    """(name, raw figure) for every figure of an entry, peak_tflops.* included."""
    for k, v in entry.items():
        if k in ("name", "vendor", "kind", "match"):
            continue
        if k == "peak_tflops":
            for d, f in (v or {}).items():
                yield f"peak_tflops.{d}", f
        else:
            yield k, v


def test_yaml_loads(specs):
    assert len(specs) >= len(REQUIRED)
    for spec in specs.values():
        assert spec.name and isinstance(spec.kind, str) and spec.kind


def test_every_required_part_is_present(specs):
    assert set(REQUIRED) <= set(specs)


def test_every_source_names_a_key_under_sources(raw):
    sources = raw["sources"]
    for key, src in sources.items():
        assert src.get("title") and src.get("url") and src.get("date"), key
    unknown, cited = [], 0
    for hw, entry in raw["hardware"].items():
        for name, fig in _figures(entry):
            if isinstance(fig, dict):
                assert "value" in fig, f"{hw}.{name}"
                if fig.get("value") is not None:
                    assert fig.get("source"), f"{hw}.{name} has a value but no source"
                if fig.get("source") is not None:
                    cited += 1
                    if fig["source"] not in sources:
                        unknown.append(f"{hw}.{name}: {fig['source']}")
            else:
                assert fig is None, f"{hw}.{name} is a bare number without a source"
    assert unknown == []
    assert cited > 50


def test_every_gpu_has_the_two_roofline_numbers(specs):
    for key in REQUIRED:
        spec = specs[key]
        assert spec.figure("memory_bandwidth_gbps").value > 0, key
        assert any(spec.peak(d).value for d in DTYPES), key
        assert spec.cite(spec.figure("memory_bandwidth_gbps")), key


def test_match_patterns_compile(specs):
    for spec in specs.values():
        for pattern in spec.match:
            re.compile(pattern)


@pytest.mark.parametrize("device_name, key", [
    ("NVIDIA H200", "h200_sxm"),
    ("NVIDIA H100 80GB HBM3", "h100_sxm"),
    ("NVIDIA A100-SXM4-40GB", "a100_sxm_40gb"),
    ("NVIDIA A100-SXM4-80GB", "a100_sxm_80gb"),
    ("NVIDIA GeForce RTX 4090", "rtx_4090"),
    ("AMD Instinct MI300X", "mi300x"),
    ("NVIDIA Foo 9000", None),
    # siblings that must not collide with an entry they are not
    ("NVIDIA GH200 480GB", None),
    ("NVIDIA H200 NVL", None),
    ("NVIDIA H100 PCIe", None),
    ("NVIDIA A100 80GB PCIe", None),
    ("NVIDIA GeForce RTX 4090 D", None),
    ("NVIDIA GeForce RTX 4090 Laptop GPU", None),
])
def test_match_gpu(specs, device_name, key):
    spec = match_gpu(device_name, specs)
    assert (spec.key if spec else None) == key


def test_h200_ridge_from_the_file(specs):
    h200 = specs["h200_sxm"]
    ridge = ridge_point(h200.peak("fp16").value, h200.figure("memory_bandwidth_gbps").value)
    assert ridge == pytest.approx(206, abs=1)


def test_spec_summary_and_citation(specs):
    s = specs["h200_sxm"].summary()
    assert s["key"] == "h200_sxm" and s["memory_bandwidth_gbps"] == 4800
    assert set(s["peak_tflops"]) == set(DTYPES) and s["source"] == "hardware.yaml"
    cite = specs["h200_sxm"].cite(specs["h200_sxm"].figure("memory_bandwidth_gbps"))
    assert "AnandTech" in cite and cite.endswith("(2023-11-13)")


def test_get_spec(specs):
    assert get_spec("rtx_4090", specs).key == "rtx_4090"
    with pytest.raises(LabError, match="unknown hardware key 'nope'.*h200_sxm"):
        get_spec("nope", specs)


def test_missing_and_invalid_yaml(tmp_path):
    with pytest.raises(LabError, match="not found"):
        load_hardware(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("hardware: [unclosed\n")
    with pytest.raises(LabError, match="not valid YAML"):
        load_hardware(bad)


def test_env_var_points_at_another_file(tmp_path, monkeypatch):
    other = tmp_path / "hw.yaml"
    other.write_text("sources: {}\nhardware:\n  toy:\n    name: Toy\n    match: ['Toy GPU']\n"
                     "    memory_bandwidth_gbps: {value: 10}\n")
    monkeypatch.setenv("LAB_HARDWARE_YAML", str(other))
    specs = load_hardware()
    assert list(specs) == ["toy"] and specs["toy"].figure("memory_bandwidth_gbps").value == 10
    assert match_gpu("My Toy GPU", specs).key == "toy"


def test_slug():
    assert slug("NVIDIA Foo 9000") == "nvidia_foo_9000"
    assert slug("???") == "unknown"
