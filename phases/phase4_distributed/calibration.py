"""Phase 4's calibrated model: a collective's time from two constants measured on the same machine.

    time(size) = alpha + size x busbw_factor / beta          (common.roofline.alpha_beta_ms)

alpha (µs) is what one call costs however small the message: the median time of the smallest
messages. beta (GB/s) is the bus bandwidth the largest messages reach: the best busbw over the
largest sizes (each size timed by its median). Both come from a `phase4.link_ceilings` record,
per collective, backend and world size; never from the rows they predict. The bound is the larger
term: "latency" (alpha) or "communication" (the bytes on the bus over beta). Our ring all-reduce
is predicted with NCCL's all-reduce constants: the same bytes must cross the same links.

Torch-free: the report's calibrator (report.py) and the exercises (at run time) use the same
functions. Sizes follow nccl-tests (collectives.py); the bus-bandwidth factor rules live here.
"""
import math

from common import roofline

EXERCISE = "phase4.link_ceilings"
EXCLUDED = ("calibration: this row measures a link ceiling (alpha from the smallest messages, beta from the "
            "largest), so it cannot test the model built from it")
# Rows of the phase that are no test of a model (prediction.excluded; report.py for older records)
NAIVE_LESSON = ("lesson: the naive blocking order (every rank sends, then receives) is run to show that it "
                "deadlocks; it is killed, never timed")
# A DDP step is not one kernel: forward, backward, the optimizer and the gradient all-reduce overlapped.
# Its prediction is the perfect-overlap bound, whose bytes are link bytes: neither the calibrated
# roofline (HBM, launch floor, matmul rate) nor the alpha-beta model of one collective describes it.
STEP_EXCLUDED = ("not a test of the model: a whole DDP training step (forward, backward, optimizer, the gradient "
                 "all-reduce overlapped); its prediction is the perfect-overlap bound max(FLOPs / peak, gradient "
                 "bytes on the wire / link), not one kernel's or one collective's")
# nccl-tests' bus-bandwidth factors: the bytes each rank's link carries per byte of `size`
FACTOR_RULES = {"all_reduce": "2(n-1) / n", "all_gather": "(n-1) / n", "reduce_scatter": "(n-1) / n", "sendrecv": "1"}
OPS = tuple(FACTOR_RULES)
ALPHA, BETA = "alpha", "beta"


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor for `op` on n ranks ('ring_allreduce' is an all-reduce)."""
    op = model_op(op)
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op == "sendrecv":
        return 1.0
    raise ValueError(f"unknown collective '{op}'")


def model_op(op: str) -> str:
    """The collective whose constants predict `op`: our ring is an all-reduce."""
    return "all_reduce" if op == "ring_allreduce" else op


# ------------------------------------------------------------------------------ the constants
def ceilings_of(rows: list[dict]) -> dict:
    """{op: {str(world_size): {alpha_us, beta_busbw_gbps, busbw_factor, ...}}} from a link-ceilings
    run's rows (each with params.role 'alpha' or 'beta'). alpha: the median over the smallest sizes
    of each size's time (the slowest rank's median); beta: the best busbw over the largest sizes.
    A collective and world size with no ok row of either role is left out."""
    out: dict = {}
    groups: dict = {}
    for r in rows:
        p = r["params"]
        if r["status"] == "ok" and p.get("role") in (ALPHA, BETA):
            groups.setdefault((p["op"], p["world_size"]), []).append(r)
    for (op, n), rs in sorted(groups.items()):
        small = sorted(r["metrics"]["ms"] for r in rs if r["params"]["role"] == ALPHA)
        large = [r for r in rs if r["params"]["role"] == BETA]
        if not small or not large:
            continue
        best = max(large, key=lambda r: r["metrics"]["busbw_gbps"])
        out.setdefault(op, {})[str(n)] = {
            "alpha_us": 1e3 * _median(small), "beta_busbw_gbps": best["metrics"]["busbw_gbps"],
            "busbw_factor": FACTOR_RULES[op],
            "alpha_sizes_bytes": sorted(r["params"]["size_bytes"] for r in rs if r["params"]["role"] == ALPHA),
            "beta_size_bytes": best["params"]["size_bytes"],
            "beta_sizes_bytes": sorted(r["params"]["size_bytes"] for r in large)}
    return out


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    k = len(xs) // 2
    return xs[k] if len(xs) % 2 else (xs[k - 1] + xs[k]) / 2


def index(records: list[dict]) -> dict:
    """(hardware, backend, op, world size) -> the newest measured link-ceilings entry, with the
    record that holds it as `record` ("results/<path>"). Records come oldest first."""
    out = {}
    for rec in records:
        if rec["exercise"]["id"] != EXERCISE or rec.get("status") == "skipped" \
                or rec.get("source", {}).get("kind", "measured") != "measured":
            continue
        summary = rec.get("summary") or {}
        for op, per_n in (summary.get("link_ceilings") or {}).items():
            for n, entry in per_n.items():
                if entry.get("alpha_us") is not None and entry.get("beta_busbw_gbps"):
                    out[(rec["hardware"]["key"], summary.get("backend"), op, int(n))] = \
                        {**entry, "record": f"results/{rec['_path']}"}
    return out


def run_time_index(ctx) -> dict:
    """index() of the link-ceilings records in this run's results folder (where ctx.ceilings() looks)."""
    from common.paths import results_dir
    from common.records import load_records
    return index(load_records(results_dir(ctx.results), exercise=EXERCISE, hardware=ctx.hardware_key))


# ------------------------------------------------------------------------------ the prediction
def predict(op: str, size_bytes: float, n: int, ceilings: dict, measured_ms: float | None, computed: str) -> dict:
    """The calibrated block of one collective row from its link-ceilings entry."""
    factor = busbw_factor(op, n)
    alpha, beta = ceilings["alpha_us"], ceilings["beta_busbw_gbps"]
    predicted = roofline.alpha_beta_ms(size_bytes, factor, alpha, beta)
    latency_ms = alpha / 1e3
    comm_ms = predicted - latency_ms
    return {"model": "alpha-beta", "predicted_ms": predicted,
            "bound": roofline.COMMUNICATION if comm_ms > latency_ms else roofline.LATENCY,
            "measured_over_predicted": measured_ms / predicted if measured_ms and predicted else None,
            "ceilings_record": ceilings.get("record"), "computed": computed,
            "alpha_us": alpha, "beta_busbw_gbps": beta, "busbw_factor": factor, "constants_of": model_op(op),
            "latency_ms": latency_ms, "communication_ms": comm_ms}


def row_op(exercise: str, variant: str, op_param) -> str | None:
    """The collective a timed row runs, or None for rows that are no collective's time (checks,
    the deadlock demo)."""
    if exercise == "phase4.ring_allreduce":
        return "all_reduce" if variant == "nccl" else "ring_allreduce" if variant.startswith("ring_") else None
    return op_param if op_param in OPS or op_param == "ring_allreduce" else None


def for_row(exercise: str, r: dict, found: dict, hardware: str, computed: str) -> dict | None:
    """The calibrated block of a result row (as a record holds it), or None: not a timed
    collective, or no link-ceilings entry for its hardware, backend, collective and world size."""
    p = r.get("params") or {}
    op = row_op(exercise, r.get("variant", ""), p.get("op"))
    if op is None or r.get("status") != "ok" or p.get("size_bytes") is None or p.get("world_size") is None:
        return None
    n = int(p["world_size"])
    entry = found.get((hardware, p.get("backend"), model_op(op), n))
    if entry is None:
        return None
    measured = (r.get("prediction") or {}).get("measured_ms") or (r.get("metrics") or {}).get("ms")
    return predict(op, p["size_bytes"], n, entry, measured, computed)


def attach(exercise: str, rows: list[dict], found: dict, hardware: str) -> list[dict]:
    """At run time: every timed collective row gets prediction.calibrated where a link-ceilings
    record of this machine exists (`found`: index() of this run's results folder)."""
    for r in rows:
        block = for_row(exercise, r, found, hardware, "at run time, from the newest phase4.link_ceilings record")
        if block is not None and r.get("prediction"):
            r["prediction"]["calibrated"] = block
    return rows


def value(r, key: str, default=None):
    """r[key] of a frame row, or `default` where it is missing or NaN (common.frame.value, without
    importing pandas into the ranks, which import this module through the exercises)."""
    v = r.get(key, default) if hasattr(r, "get") else default
    return default if v is None or (isinstance(v, float) and math.isnan(v)) else v


_CACHE: list = [None, None]          # [records list, its index]: one report reads one list


def calibrator(r, records: list[dict]) -> dict | None:
    """common.spec.Phase's calibrator for a frame row (pandas): the alpha-beta prediction from the
    newest measured phase4.link_ceilings record of the same hardware, backend, collective and
    world size; None when there is none (no calibrated prediction for that row)."""
    if value(r, "source", "measured") != "measured":
        return None
    if _CACHE[0] is not records:
        _CACHE[:] = [records, index(records)]
    flat = {"variant": value(r, "variant", ""), "status": value(r, "status"),
            "params": {k: value(r, f"params.{k}") for k in ("op", "size_bytes", "world_size", "backend")},
            "prediction": {"measured_ms": value(r, "prediction.measured_ms")}, "metrics": {"ms": value(r, "metrics.ms")}}
    return for_row(r["exercise"], flat, _CACHE[1], r["hardware"],
                   "at report time, from the newest phase4.link_ceilings record and the row's size")
