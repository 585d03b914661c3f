"""`lab predict EXERCISE` prints the summed prediction (common/workload.py) of phases 3, 5 and 7 before
anything runs, from a GPU's committed ceilings record (read, never written), with the top kernels."""
import pytest
from conftest import assert_one_line_error

from common.paths import REPO_ROOT

RESULTS = REPO_ROOT / "results"                     # the committed H200 / H100 ceilings records: read only


@pytest.mark.parametrize("exercise, words", [
    ("phase3.flash_attention_bwd", "attention backward (5 products, P recomputed)"),
    ("phase5.batching", "llama-3.1-8b decode step at batch 64"),
    ("phase5.ttft_decode", "prefill of 100 tokens"),
    ("phase7.scaling", "log-softmax backward"),
    ("phase5.speculative", "draft x 1 + verify"),
    ("phase5.tensor_parallel", "at TP=2"),
    ("phase5.decode_attention", "combine the splits"),
    ("phase5.quant_kernels", "w4_cuda projection"),
])
def test_the_summed_prediction_and_its_top_kernels_come_before_running(lab, exercise, words):
    if not any((RESULTS / "phase1" / "ceilings" / "h200_sxm").glob("*.json")):
        pytest.skip("no committed H200 ceilings record in this checkout")
    rc, out, err = lab("predict", exercise, "--hardware", "h200_sxm", "--results", RESULTS)
    assert rc == 0, err
    assert "summed prediction" in out and words in out and "%" in out
    assert "fallback: exp rate" not in out          # the newest committed H200 ceilings measure it


def test_a_ceilings_record_without_the_exp_rate_names_its_fallback(lab, tmp_path):
    import json
    records = sorted((RESULTS / "phase1" / "ceilings" / "h200_sxm").glob("*.json"))
    older = [r for r in records if "exp_per_s" not in json.loads(r.read_text()).get("summary", {}).get("ceilings", {})]
    if not older:
        pytest.skip("every committed H200 ceilings record measures the exp rate")
    target = tmp_path / "phase1" / "ceilings" / "h200_sxm"
    target.mkdir(parents=True)
    (target / older[-1].name).write_text(older[-1].read_text())
    rc, out, err = lab("predict", "phase3.flash_attention_bwd", "--hardware", "h200_sxm", "--results", tmp_path)
    assert rc == 0, err
    assert "fallback: exp rate" in out


def test_without_a_ceilings_record_it_says_what_is_missing(lab, tmp_path):
    rc, out, err = lab("predict", "phase5.batching", "--hardware", "h200_sxm", "--results", tmp_path)
    assert rc == 0, err
    assert "summed prediction: needs a GPU's phase1.ceilings record" in out


@pytest.mark.parametrize("args, words", [
    (["phase5.batching", "--param", "concurrency=[0]"], "concurrency"),
    (["phase7.scaling", "--param", "nope=1"], "--param nope"),
])
def test_bad_input_is_one_line_and_exit_2(lab, args, words):
    rc, out, err = lab("predict", *args, "--hardware", "h200_sxm", "--results", RESULTS)
    assert_one_line_error(rc, err)
    assert rc == 2 and words in err
