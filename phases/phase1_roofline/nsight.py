"""Hardware counters for the two anchors: DRAM and SM throughput, and the bytes that really moved.

    lab run phase1.nsight          (needs `ncu`, Nsight Compute, and a GPU whose counters it can read)

Nsight Compute replays one kernel of each anchor and reads:
- dram__throughput: DRAM traffic as a percentage of the peak DRAM throughput,
- sm__throughput: the busiest SM unit as a percentage of its peak ("compute throughput"),
- dram__bytes_read / dram__bytes_write: bytes that crossed the HBM interface.
The roofline's byte count is checked against the counters: the multiply should move exactly
3 x N x 4 bytes; a large matmul moves somewhat more than the ideal 3 N^2 x 2, because its tiles
re-read A and B from HBM whenever L2 cannot hold them.
Clocks are left as found (`--clock-control none`); the lab never changes a GPU's settings.
"""
from common import ncu
from common.exercise import Exercise, Needs, Result, row
from common.params import Float, Int
from common.standalone import run_alone

METRICS = ("dram__throughput.avg.pct_of_peak_sustained_elapsed",
           "sm__throughput.avg.pct_of_peak_sustained_elapsed",
           "dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")


def profile(kind: str, n: int, timeout_s: float) -> list[dict]:
    return ncu.profile("phases.phase1_roofline.nsight_target", [kind, str(n)], METRICS, timeout_s, kind)


def run(ctx, params):
    anchors = [("elementwise", params["elementwise_n"], params["elementwise_n"],
                3 * params["elementwise_n"] * 4),
               ("matmul_fp16", params["matmul_n"], 2 * params["matmul_n"] ** 3, 3 * params["matmul_n"] ** 2 * 2)]
    rows = []
    for kind, n, flops, ideal_bytes in ctx.track(anchors, "ncu anchors"):
        if not ctx.wants(kind):
            continue
        kernels = profile(kind, n, params["timeout_s"])
        read = sum(k.get("dram__bytes_read.sum") or 0 for k in kernels)
        write = sum(k.get("dram__bytes_write.sum") or 0 for k in kernels)
        main = max(kernels, key=lambda k: k.get("gpu__time_duration.sum") or 0)
        metrics = {
            "kernel_names": [k["kernel"] for k in kernels],
            "kernels_profiled": len(kernels),
            "dram_throughput_pct": main.get(METRICS[0]),
            "sm_throughput_pct": main.get(METRICS[1]),
            "dram_bytes_read": read, "dram_bytes_write": write, "dram_bytes": read + write,
            "ideal_bytes": ideal_bytes, "dram_bytes_over_ideal": (read + write) / ideal_bytes,
            "flops": flops, "intensity_ideal_flop_per_byte": flops / ideal_bytes,
            "intensity_measured_flop_per_byte": flops / (read + write) if read + write else None,
            "ncu_kernel_ms": (main.get("gpu__time_duration.sum") or 0) / 1e6,   # ns -> ms
        }
        rows.append(row(kind, {"kernel": kind, "n": n}, metrics=metrics))
    return Result(rows)


EXERCISE = Exercise(id="phase1.nsight", title="Nsight Compute: DRAM and SM throughput of the two anchors",
                    run=run, needs=Needs(cuda=True, nvidia=True, tools=("ncu",)),
                    params={"elementwise_n": Int(33554432, min=1, unit="fp32 elements"),
                            "matmul_n": Int(8192, min=1, max=65536, unit="rows = columns"),
                            "timeout_s": Float(300, min=1, max=86400, unit="seconds per profiled anchor")},
                    quick_params={"elementwise_n": 1 << 20, "matmul_n": 256},
                    variants=("elementwise", "matmul_fp16"),
                    footprint_bytes=lambda p: max(3 * 4 * p["elementwise_n"], 3 * 2 * p["matmul_n"] ** 2))


if __name__ == "__main__":
    run_alone(EXERCISE, {"elementwise_n": 1_000_003, "matmul_n": 333})
