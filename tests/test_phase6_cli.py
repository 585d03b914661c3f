"""Phase 6 through `lab`: bad parameters refused in one line (exit 2, no record), Groq without a key
skipped with its reason (exit 3, the skip recorded), a quick JAX run written as records, and
`lab list` naming what each phase 6 exercise needs."""
import pytest

from conftest import assert_one_line_error, json_files, read_json


@pytest.mark.parametrize("args, words", [
    (["phase6.jax_attention", "--param", "shapes=[[1,2,16,16]]"], "S=16 equals another dimension"),
    (["phase6.jax_attention", "--param", "shapes=[[1,2,16]]"], "--param shapes="),
    (["phase6.jax_matmul", "--param", "sizes=0"], "--param sizes=0"),
    (["phase6.jax_matmul", "--param", "dtype=fp8"], "one of bf16, fp16"),
    (["phase6.groq_api", "--param", "hardware=nope"], "no hardware.yaml entry 'nope'"),
    (["phase6.groq_api", "--param", "base_url=ftp://example.org"], "not an http(s) URL"),
    (["phase6.groq_api", "--param", "base_url=http://127.0.0.1:9"], "no route to http://127.0.0.1:9"),
    (["phase6.groq_api", "--param", "runs=0"], "--param runs=0"),
])
def test_bad_parameters_are_one_line_refusals(lab, tmp_path, args, words):
    rc, out, err = lab("run", *args, "--results", tmp_path)
    assert rc == 2
    assert_one_line_error(rc, err, tmp_path)
    assert words in err


def test_groq_without_a_key_is_skipped_with_the_reason(lab, tmp_path, monkeypatch):
    monkeypatch.delenv("GROQ_API_KEY", raising=False)
    rc, out, err = lab("run", "phase6.groq_api", "--results", tmp_path)
    assert rc == 3 and "GROQ_API_KEY" in out and "Traceback" not in out + err
    [f] = json_files(tmp_path)
    rec = read_json(f)
    assert rec["status"] == "skipped" and rec["reason"] == "needs the environment variable GROQ_API_KEY; not set"


def test_a_quick_jax_run_writes_its_records(lab, tmp_path):
    pytest.importorskip("jax")
    rc, out, err = lab("run", "phase6.jax_matmul", "--quick", "--param", "sizes=[48]", "--variant", "jax_jit",
                       "--variant", "torch", "--results", tmp_path)
    assert rc == 0, out + err
    [f] = json_files(tmp_path)
    rec = read_json(f)
    assert f.parent.name == "cpu" and rec["source"]["kind"] == "measured"
    assert {r["variant"]: r["status"] for r in rec["rows"]} == {"torch": "ok", "jax_jit": "ok"}
    assert rec["software"]["jax"]


def test_lab_list_names_what_phase6_needs(lab):
    rc, out, err = lab("list")
    assert rc == 0, err
    groq = next(ln for ln in out.splitlines() if "phase6.groq_api" in ln)
    assert "GROQ_API_KEY" in groq
    assert any("phase6.jax_attention" in ln for ln in out.splitlines())
