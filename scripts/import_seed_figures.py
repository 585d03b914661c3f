#!/usr/bin/env python3
"""Store the original lab's published phase 0-1 figures (RTX 4090) as external records.

    python scripts/import_seed_figures.py [--results DIR]

The figures are quoted from the seed write-up (shared/seeds/000_d50e6b73398ffa0d.txt) and stored
with source.kind = "external" and a citation, so the README tables can show them beside the lab's
own runs, always labelled. Only what the write-up reports is stored; the roofline prediction is
the lab's own, computed from hardware.yaml's rtx_4090 entry. Re-running adds nothing that is
already there.
"""
import argparse
import datetime as dt
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import env, roofline  # noqa: E402
from common.exercise import row, throughput_metrics  # noqa: E402
from common.hardware import DTYPES, load_hardware  # noqa: E402
from common.paths import results_dir  # noqa: E402
from common.records import SCHEMA_VERSION, load_records, write_record  # noqa: E402

CITATION = "seed write-up (shared/seeds/000_d50e6b73398ffa0d.txt)"

# (exercise id, title, variant, params, reported metrics, flops, bytes, dtype, where in the seed)
FIGURES = [
    ("phase0.matmul_baseline", "4096 x 4096 FP32 matmul baseline vs spec peak", "fp32",
     {"n": 4096, "dtype": "fp32", "tf32_allowed": None}, {"ms": 1.67, "tflops": 82.4},
     2 * 4096**3, 3 * 4096**2 * 4, "fp32", "Phase 0, baseline matmul benchmark (100-iteration average)"),
    ("phase1.elementwise", "Memory-bound anchor: fp32 element-wise multiply vs copy", "mul",
     {"n": 33554432, "dtype": "fp32", "working_set_bytes": 3 * 33554432 * 4}, {"gbps": 947.5},
     33554432, 3 * 33554432 * 4, "fp32", "Phase 1, memory-bound operation: element-wise multiply, 32M FP32"),
    ("phase1.matmul_fp16", "Compute-bound anchor: FP16 matmul at N=8192", "fp16",
     {"n": 8192, "dtype": "fp16"}, {"tflops": 158.1},
     2 * 8192**3, 3 * 8192**2 * 2, "fp16", "Phase 1, compute-bound operation: FP16 matmul, N=8192"),
]
NSIGHT = {"title": "Nsight Compute: DRAM and SM throughput of the two anchors",
          "rows": [("elementwise", {"kernel": "elementwise", "n": 33554432}, {"dram_throughput_pct": 92.0, "sm_throughput_pct": 2.6}),
                   ("matmul_fp16", {"kernel": "matmul_fp16", "n": 8192}, {"dram_throughput_pct": 13.0, "sm_throughput_pct": 47.0})],
          "where": "Phase 1, ncu DRAM and SM throughput of the two anchors"}


def base_record(ex_id, title, spec, rows, where):
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "schema_version": SCHEMA_VERSION,
        "exercise": {"id": ex_id, "phase": int(ex_id[5]), "name": ex_id.split(".", 1)[1], "title": title,
                     "bench_version": 1},
        "status": "ok", "reason": None, "params": {}, "rows": rows, "summary": {},
        "source": {"kind": "external", "citation": f"{CITATION}, {where}"},
        "conditions": None,
        "hardware": {"key": spec.key, "device": "cuda", "name": spec.name, "spec": spec.summary(),
                     "spec_matched": True, "gpu": None, "host": None},
        "software": {"note": "as reported by the seed: RTX 4090, CUDA 12.1-13.1, PyTorch 2.4-2.10"},
        "provenance": {**env.git_info(), "command": "scripts/import_seed_figures.py", "started_utc": now,
                       "duration_s": None, "quick": False, "variants": None},
        "cost": {"usd_per_hour": None, "rate_source": None, "gpus": 1, "seconds": None, "usd": None},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results")
    args = ap.parse_args()
    res = results_dir(args.results)
    spec = load_hardware()["rtx_4090"]
    roofs = roofline.Roofs(spec.figure("memory_bandwidth_gbps").value, {d: spec.peak(d).value for d in DTYPES},
                           "hardware.yaml:rtx_4090", spec.cite(spec.figure("memory_bandwidth_gbps")),
                           {d: spec.cite(spec.peak(d)) for d in DTYPES})
    have = {(r["exercise"]["id"], r["hardware"]["key"]) for r in load_records(res)
            if r.get("source", {}).get("kind") == "external"}
    written = []
    for ex_id, title, variant, params, reported, flops, nbytes, dtype, where in FIGURES:
        if (ex_id, "rtx_4090") in have:
            continue
        # The write-up gives time or rate; the other follows from the FLOPs/bytes (stated in the row).
        ms = reported.get("ms") or (flops / (reported["tflops"] * 1e9) if "tflops" in reported else nbytes / (reported["gbps"] * 1e6))
        metrics = throughput_metrics(ms, flops, nbytes, roofs, dtype)
        metrics.update({f"reported_{k}": v for k, v in reported.items()})
        metrics["derived_from_reported"] = sorted(set(("ms", "gbps", "tflops")) - set(reported))
        r = row(variant, params, metrics=metrics, prediction=roofline.predict(flops, nbytes, roofs, dtype, ms))
        written.append(write_record(base_record(ex_id, title, spec, [r], where), res))
    if ("phase1.nsight", "rtx_4090") not in have:
        rows = [row(k, p, metrics=m) for k, p, m in NSIGHT["rows"]]
        written.append(write_record(base_record("phase1.nsight", NSIGHT["title"], spec, rows, NSIGHT["where"]), res))
    for p in written:
        print(p.relative_to(res.parent) if res.parent in p.parents else p)
    print(f"{len(written)} external record(s) written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
