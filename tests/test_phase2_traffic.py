"""phase2.traffic on a CPU machine: the predicted byte counts, the counter arithmetic on canned
ncu output, and a profiling failure as one line."""
import subprocess

import pytest

from common import ncu
from common.errors import LabError
from phases.phase2_cuda import traffic

NCU_CSV = '''==PROF== Connected to process 1
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python3","h","matmul_tiled","1","7","(16, 16, 1)","(256, 256, 1)","0","9.0","Command line profiler metrics","l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum","sector","1,048,576"
"0","1","python3","h","matmul_tiled","1","7","(16, 16, 1)","(256, 256, 1)","0","9.0","Command line profiler metrics","l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum","request","262,144"
"0","1","python3","h","matmul_tiled","1","7","(16, 16, 1)","(256, 256, 1)","0","9.0","Command line profiler metrics","lts__t_sectors_srcunit_tex_op_read.sum","sector","524,288"
"0","1","python3","h","matmul_tiled","1","7","(16, 16, 1)","(256, 256, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","2,097,152"
"0","1","python3","h","matmul_tiled","1","7","(16, 16, 1)","(256, 256, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","1,048,576"
"0","1","python3","h","matmul_tiled","1","7","(16, 16, 1)","(256, 256, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","250,000"
'''


def test_predicted_bytes():
    assert traffic.predicted_global_load_bytes("vector_add", 2**20) == 8_388_608      # the seed's 2 x 1M x 4
    n = 4096
    naive, tiled = (traffic.predicted_global_load_bytes(k, n) for k in ("naive", "tiled"))
    assert naive == 4 * n**3 and tiled == n**3 // 2 and naive // tiled == 8
    assert traffic.compulsory_dram_bytes("tiled", n) == 3 * n * n * 4
    with pytest.raises(ValueError, match="unknown kernel"):
        traffic.predicted_global_load_bytes("fastest", n)


def test_metrics_from_counters():
    kernels = ncu.parse_csv(NCU_CSV)
    m = traffic.metrics_of("tiled", 256, kernels)
    assert m["global_load_bytes"] == 1_048_576 * 32
    assert m["predicted_global_load_bytes"] == 256**3 // 2
    assert m["measured_over_predicted"] == pytest.approx(1_048_576 * 32 / (256**3 / 2))
    assert m["l2_read_bytes"] == 524_288 * 32
    assert m["dram_bytes"] == 3 * 2**20 and m["dram_over_compulsory"] == pytest.approx(3 * 2**20 / (3 * 256 * 256 * 4))
    assert m["ncu_kernel_ms"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="expected one profiled kernel"):
        traffic.metrics_of("tiled", 256, kernels * 2)


def test_run_reports_the_tiling_reduction(spec_ctx, monkeypatch):
    def fake_profile(kind, n, timeout_s):
        [k] = ncu.parse_csv(NCU_CSV)
        scale = 8.0 if kind == "naive" else 1.0
        return [{**k, **{m: k[m] * scale for m in traffic.METRICS[:3]}}]

    monkeypatch.setattr(traffic, "profile", fake_profile)
    result = traffic.run(spec_ctx(), {"vector_add_sizes": [1024], "matmul_n": 256, "timeout_s": 1})
    assert [r["variant"] for r in result.rows] == ["vector_add", "naive", "tiled"]
    assert result.summary["tiling_global_load_reduction"] == pytest.approx(8.0)
    assert result.summary["predicted_global_load_reduction"] == pytest.approx(8.0)
    assert all(r["timing"] is None for r in result.rows)


def test_profile_failure_is_one_line(monkeypatch):
    def fake_run(cmd, **kw):
        assert cmd[cmd.index("--clock-control") + 1] == "none"
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="==ERROR== ERR_NVGPUCTRPERM - no permission\n")

    monkeypatch.setattr(ncu.subprocess, "run", fake_run)
    with pytest.raises(LabError) as info:
        traffic.profile("naive", 256, 10)
    assert "ERR_NVGPUCTRPERM" in str(info.value) and "\n" not in str(info.value)
