"""Print every row of the records under a results folder, one line each: for exploratory runs
(`lab run ... --results /tmp/x`) whose records are read, not committed.

    python scripts/show_rows.py /tmp/x [substring of the exercise id]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.records import load_records  # noqa: E402

KEYS = ("ms", "gbps", "busbw_gbps", "tflops", "pct_of_copy", "pct_of_library", "ours_over_nccl_busbw",
        "compute_ms", "nocomm_ms", "comm_ms", "ddp_ms", "exposed_vs_nocomm_ms", "hidden_fraction",
        "hidden_fraction_vs_nocomm", "ddp_host_ms", "nocomm_host_ms", "comm_host_ms")
PARAMS = ("world_size", "size_bytes", "op", "lanes", "depth", "bucket_cap_mb", "comm_hook", "copy_engine_graphs", "nccl_max_channels",
          "nccl_high_priority", "cols", "rows", "n", "dtype")


def line(r: dict) -> str:
    p = " ".join(f"{k}={r['params'][k]}" for k in PARAMS if r["params"].get(k) is not None)
    m = " ".join(f"{k}={v:.4g}" for k in KEYS if isinstance(v := (r.get("metrics") or {}).get(k), (int, float)))
    pred = (r.get("prediction") or {}).get("measured_over_predicted")
    return f"{r['variant']:<28} {r['status']:<7} {p} | {m}" + (f" m/p={pred:.3g}" if pred else "") + \
        (f" | {r['reason']}" if r.get("reason") else "")


def main(argv: list[str]) -> int:
    want = argv[2] if len(argv) > 2 else ""
    for rec in load_records(Path(argv[1])):
        if want in rec["exercise"]["id"]:
            print(f"== {rec['exercise']['id']} ({rec['status']}) {rec['_path']}")
            for r in rec["rows"]:
                print(line(r))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
