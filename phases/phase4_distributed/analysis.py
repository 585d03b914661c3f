"""Phase 4's goals, verdicts and derived numbers: pure functions of result rows (no torch).

The exercises call these and store what they return in the record (row metrics, and the summary's
`analysis` per world size); the report calls the same functions for records made before they
existed. A row is a record's row: {"variant", "status", "params", "metrics", "prediction"}.
"""
import statistics

# The goals (the report's Goal specs read them; their anchors are written there)
NCCL_BUSBW_GOAL_GBPS = {2: 340.0, 4: 355.0}    # NCCL all-reduce busbw on n GPUs, best size from 1 GiB
NCCL_GOAL_MIN_SIZE = 2**30
H200_LINK_GBPS = 450          # hardware.yaml's h200_sxm interconnect_one_way_gbps, the figure those bars were set against
RING_GOAL_RATIO, RING_GOAL_MIN_SIZE = 0.85, 256 * 2**20   # our ring / NCCL busbw, at every size from 256 MiB
HIDDEN_GOAL = 0.70                              # DDP: share of the all-reduce hidden, at the fastest step

# The findings' thresholds
HOST_BOUND = 0.9              # CPU time to enqueue a step / its GPU time from which the CPU sets the pace
P2P_JUMP, P2P_JUMP_FROM = 1.5, 16 * 2**20   # a send/recv busbw step up by this factor, from this size
CE_LESS, CE_MORE = 0.8, 1.2   # copy-engine hook's exposed time / NCCL's: "less" below, "more" above
BYTES_COST, SM_COST = 0.7, 0.5   # copy-engine slowdown / NCCL's: the bytes' cost from 0.7, the SMs' below 0.5
SETTING_KEYS = ("bucket_cap_mb", "nccl_max_channels", "nccl_high_priority", "sm_carveout", "comm_hook")


def ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["status"] == "ok"]


def m(r: dict | None, key: str):
    return None if r is None else (r.get("metrics") or {}).get(key)


def _size(r: dict) -> int:
    return r["params"]["size_bytes"]


# ------------------------------------------------------------------------------ the ring against NCCL
def worst_over_nccl(rows: list[dict], min_size: int = RING_GOAL_MIN_SIZE) -> dict[str, float]:
    """{variant: its worst ours/NCCL busbw over sizes >= min_size}, one world size's rows: the goal
    takes one configuration that holds at every size, not the best configuration per size."""
    worst: dict = {}
    for r in ok(rows):
        x = m(r, "ours_over_nccl_busbw")
        if x is not None and _size(r) >= min_size:
            worst[r["variant"]] = min(worst.get(r["variant"], float("inf")), x)
    return worst


def sweep_facts(rows: list[dict]) -> dict:
    """What the interconnect findings say, for one world size's rows of phase4.interconnect."""
    def by(op):
        return sorted((r for r in ok(rows) if r["params"].get("op") == op), key=_size)
    ar, sr = by("all_reduce"), by("sendrecv")
    ours = [r for r in by("ring_allreduce") if m(r, "ours_over_nccl_busbw") is not None]
    if not ar:
        return {}
    big, small, best = ar[-1], ar[0], max(m(r, "busbw_gbps") for r in ar)
    out = {"size": _size(big), "busbw_gbps": m(big, "busbw_gbps"), "algo": m(big, "algo"), "proto": m(big, "proto"),
           "pct_of_link": m(big, "pct_of_link"), "link_gbps": m(big, "link_gbps"),
           "smallest_size": _size(small), "smallest_ms": m(small, "ms"), "smallest_busbw_gbps": m(small, "busbw_gbps"),
           "half_best_size": next(_size(r) for r in ar if m(r, "busbw_gbps") >= best / 2)}
    if sr:
        out["sendrecv"] = {"size": _size(sr[-1]), "busbw_gbps": m(sr[-1], "busbw_gbps"),
                           "pct_of_link": m(sr[-1], "pct_of_link"),
                           "allreduce_over_sendrecv": m(big, "busbw_gbps") / m(sr[-1], "busbw_gbps")}
        up = [r for r in sr if _size(r) >= P2P_JUMP_FROM]
        jump = next(((a, b) for a, b in zip(up, up[1:]) if m(b, "busbw_gbps") >= P2P_JUMP * m(a, "busbw_gbps")), None)
        if jump:
            out["sendrecv_jump"] = {"from_size": _size(jump[0]), "from_gbps": m(jump[0], "busbw_gbps"),
                                    "to_size": _size(jump[1]), "to_gbps": m(jump[1], "busbw_gbps")}
    if ours:
        nccl_ms = {_size(r): m(r, "ms") for r in ar}
        out["ours"] = {"size": _size(ours[-1]), "busbw_gbps": m(ours[-1], "busbw_gbps"),
                       "over_nccl": m(ours[-1], "ours_over_nccl_busbw"), "graph": bool(m(ours[-1], "ring_graph")),
                       "p2p_chunk_bytes": m(ours[-1], "ring_p2p_chunk_bytes"),
                       "smallest_size": _size(ours[0]), "smallest_ms": m(ours[0], "ms"),
                       "smallest_nccl_ms": nccl_ms.get(_size(ours[0])),
                       "smallest_over_nccl": m(ours[0], "ours_over_nccl_busbw")}
    return out


# ------------------------------------------------------------------------------ DDP
def timed(rows: list[dict]) -> list[dict]:
    return [r for r in ok(rows) if r["variant"].startswith("bucket_")]


def setting(r: dict) -> dict:
    """A timed bucket row's settings and what it measured."""
    p = r["params"]
    host = m(r, "ddp_host_ms")
    return {**{k: p.get(k) for k in SETTING_KEYS},
            **{k: m(r, k) for k in ("ddp_ms", "comm_ms", "nocomm_ms", "compute_ms", "bookkeeping_ms", "tflops",
                                    "peak_tflops", "mfu_vs_peak", "phase1_ceiling_tflops", "mfu_vs_phase1_ceiling")},
            "hidden": m(r, "hidden_fraction_vs_nocomm"), "hidden_vs_no_sync": m(r, "hidden_fraction"),
            "exposed_ms": m(r, "exposed_vs_nocomm_ms"), "host_ms": host,
            "host_share": None if host is None else host / m(r, "ddp_ms")}


def launch_key(p: dict) -> tuple:
    """The process-wide settings of a row (one launch each)."""
    return (p.get("nccl_max_channels") or 0, bool(p.get("nccl_high_priority")), p.get("sm_carveout") or 0)


def fastest_flags(rows: list[dict]) -> dict[str, bool]:
    """{variant: whether it is the fastest DDP step}, over one world size's timed bucket rows: the
    goal is judged there, since a slower all-reduce can hide a bigger share of a longer time."""
    t = timed(rows)
    if not t:
        return {}
    best = min(t, key=lambda r: m(r, "ddp_ms"))
    return {r["variant"]: r is best for r in t}


def judge(n: int, rows: list[dict]) -> dict:
    """The DDP goal's verdict for one world size (judged at the fastest step), and the setting that
    hid the largest share beside it."""
    t = timed(rows)
    fastest = min(t, key=lambda r: m(r, "ddp_ms"))
    most = max(t, key=lambda r: m(r, "hidden_fraction_vs_nocomm"))
    return {"world_size": n, "judged_on": "fastest_step", **setting(fastest),
            "met": m(fastest, "hidden_fraction_vs_nocomm") >= HIDDEN_GOAL, "most_hidden": setting(most)}


def copy_engine_vs_nccl(t: list[dict]) -> dict | None:
    """The copy-engine hook at its fastest step against DDP's builtin (NCCL) hook with the same
    buckets and launch settings: exposed time, and a verdict."""
    ce = [r for r in t if r["params"].get("comm_hook") == "copy_engine"]
    if not ce:
        return None
    c = min(ce, key=lambda r: m(r, "ddp_ms"))
    twin = next((r for r in t if (r["params"].get("comm_hook") or "builtin") == "builtin"
                 and r["params"]["bucket_cap_mb"] == c["params"]["bucket_cap_mb"]
                 and launch_key(r["params"]) == launch_key(c["params"])), None)
    if twin is None:
        return None
    x = m(c, "exposed_vs_nocomm_ms") / m(twin, "exposed_vs_nocomm_ms") if m(twin, "exposed_vs_nocomm_ms") else None
    verdict = None if x is None else "less" if x < CE_LESS else "more" if x > CE_MORE else "same"
    return {"copy_engine": setting(c), "nccl": setting(twin), "verdict": verdict}


def probe(rows: list[dict], best: dict) -> dict | None:
    """Backward's kernels under NCCL's all-reduce and under copy-engine traffic, at the fastest
    step's launch settings: slowdowns, and per kernel class what the two transfers' ratio says."""
    key = launch_key(best["params"])
    cells = [r for r in ok(rows) if r["variant"].startswith("contention_") and launch_key(r["params"]) == key]
    if not cells:
        return None
    out: dict = {"slowdown": {}, "by_bound": {}}
    for r in cells:
        out["slowdown"].setdefault(r["params"]["background"], {})[r["params"]["kernel"]] = m(r, "slowdown")
    for bound in ("compute", "memory"):
        mean = {bg: statistics.mean(xs) for bg in ("nccl_all_reduce", "copy_engine")
                for xs in [[m(r, "slowdown") for r in cells if r["params"]["background"] == bg
                            and (r.get("prediction") or {}).get("bound") == bound]] if xs}
        nccl, ce = mean.get("nccl_all_reduce"), mean.get("copy_engine")
        if nccl is not None and ce is not None and nccl > 0:
            why = "bytes" if ce >= BYTES_COST * nccl else "sms" if ce <= SM_COST * nccl else "partly_sms"
            out["by_bound"][bound] = {"nccl": nccl, "copy_engine": ce, "verdict": why}
    return out


def ddp_facts(rows: list[dict]) -> dict:
    """What the DDP findings say, for one world size's rows of phase4.ddp."""
    t = timed(rows)
    if not t:
        return {}
    best = min(t, key=lambda r: m(r, "ddp_ms"))
    hidden = lambda r: m(r, "hidden_fraction_vs_nocomm") or 0.0      # noqa: E731
    same_cap = [hidden(r) for r in t if r["params"]["bucket_cap_mb"] == best["params"]["bucket_cap_mb"]]
    most = max(t, key=hidden)
    out = {"settings": len(t), "fastest": setting(best), "most_hidden": setting(most),
           "least_hidden": setting(min(t, key=hidden)), "most_hidden_is_fastest": most is best,
           "most_hidden_exposes_more": (m(most, "exposed_vs_nocomm_ms") or 0) >= (m(best, "exposed_vs_nocomm_ms") or 0),
           "at_fastest_cap": {"settings": len(same_cap), "min": min(same_cap), "max": max(same_cap),
                              "median": statistics.median(same_cap)},
           "copy_engine": copy_engine_vs_nccl(t), "probe": probe(rows, best)}
    shares = [(setting(r)["host_share"], r) for r in t if m(r, "ddp_host_ms") is not None]
    bound = [(x, r) for x, r in shares if x >= HOST_BOUND]
    out["host_bound"] = {"settings": len(bound), "most": setting(max(bound, key=lambda p: p[0])[1])} if bound else None
    over = [r for r in t if (m(r, "exposed_vs_nocomm_ms") or 0) > m(r, "comm_ms")]
    host = [setting(r)["host_share"] for r in over if m(r, "ddp_host_ms") is not None]
    out["overrun"] = None if not over else {
        "settings": len(over), "worst": setting(max(over, key=lambda r: m(r, "exposed_vs_nocomm_ms"))),
        "python_hooks_only": all((r["params"].get("comm_hook") or "builtin") != "builtin" for r in over),
        "host_share": [min(host), max(host)] if host and len(host) == len(over) else None}
    st = next((r for r in ok(rows) if r["variant"] == "per_rank_steps_straggler"), None)
    if st is not None:
        out["straggler"] = {"sleep_ms": st["params"].get("straggler_ms"), "local_spread_ms": m(st, "local_spread_ms"),
                            "ddp_spread_ms": m(st, "ddp_spread_ms")}
    return out
