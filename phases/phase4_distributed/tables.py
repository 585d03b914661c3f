"""Phase 4's README blocks and plots, written from records only.

Blocks (phases/phase4_distributed/README.md): phase4.goals, phase4.allreduce, phase4.sweep,
phase4.plots, phase4.ring, phase4.ddp, phase4.contention, phase4.findings.
Plots: results/plots/phase4_busbw_<hardware>_<n>gpu.png (NCCL's all-reduce and ours, busbw
against size, with the other collectives and the link's one-way bandwidth), one per world size.

Records are grouped by (hardware, GPUs on the machine, world size): a 4-GPU machine's run holds
2-rank and 4-rank rows, a 2-GPU machine's run 2-rank rows, and all of them are shown, each from
the newest record of its group. Plots and findings use, per world size, the machine with exactly
that many GPUs when there is one. The seed's figures appear only labelled with seed.CITATION.
"""
import statistics
from dataclasses import dataclass
from pathlib import Path

from common.report import NO_RECORDS, View, markdown, num, pct, size_bytes

from . import seed

EX_DDP, EX_RING, EX_SWEEP = "phase4.ddp", "phase4.ring_allreduce", "phase4.interconnect"
OP_ORDER = ["all_reduce", "ring_allreduce", "all_gather", "reduce_scatter", "sendrecv"]
OP_LABEL = {"all_reduce": "all-reduce (NCCL)", "ring_allreduce": "all-reduce (ours: ring)",
            "all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "sendrecv": "send/recv shift"}


# ------------------------------------------------------------------------------ grouping records
@dataclass
class Group:
    hw: str
    hw_name: str
    machine_gpus: int | None
    n: int
    rec: dict

    @property
    def rows(self) -> list[dict]:
        return [r for r in self.rec["rows"] if r["params"].get("world_size") == self.n]

    @property
    def gpu(self) -> bool:
        return self.rec["hardware"].get("device") == "cuda"

    @property
    def label(self) -> str:
        if not self.gpu:
            return f"{self.n} CPU processes (gloo)"
        machine = f", on a {self.machine_gpus}-GPU machine" if self.machine_gpus and self.machine_gpus != self.n else ""
        return f"{self.n} x {self.hw_name}{machine}"

    def row(self, variant: str, **params):
        for r in self.rows:
            if r["variant"] == variant and all(r["params"].get(k) == v for k, v in params.items()):
                return r
        return None


def groups(records: list[dict], exercise: str) -> list[Group]:
    newest: dict = {}
    for rec in records:                        # oldest first: the newest record of a group wins
        if rec["exercise"]["id"] != exercise or rec["status"] == "skipped" or \
                rec.get("source", {}).get("kind", "measured") != "measured":
            continue
        gpus = (rec["hardware"].get("gpu") or {}).get("count")
        name = (rec["hardware"].get("spec") or {}).get("name") or rec["hardware"].get("name") or rec["hardware"]["key"]
        for n in {r["params"].get("world_size") for r in rec["rows"]} - {None}:
            newest[(rec["hardware"]["key"], gpus or 0, n)] = Group(rec["hardware"]["key"], name, gpus, n, rec)
    return [newest[k] for k in sorted(newest)]


def preferred(records: list[dict], exercise: str) -> list[Group]:
    """One group per (hardware, world size): the machine with exactly n GPUs if any, else the newest run."""
    best: dict = {}
    for g in groups(records, exercise):
        key, cur = (g.hw, g.n), best.get((g.hw, g.n))
        exact_fit = g.machine_gpus == g.n
        if cur is None or (exact_fit and cur.machine_gpus != cur.n) or \
                (exact_fit == (cur.machine_gpus == cur.n) and
                 g.rec["provenance"]["started_utc"] > cur.rec["provenance"]["started_utc"]):
            best[key] = g
    return [best[k] for k in sorted(best)]


def _run(v: View, rec: dict) -> str:
    prov = rec["provenance"]
    return f"[{(prov.get('started_utc') or '')[:10]} {(prov.get('commit') or '')[:7]}]({v.link(rec['_path'])})"


def _m(r, key, default=None):
    return default if r is None else r["metrics"].get(key, default)


def _us(ms) -> str:
    return "-" if ms is None else num(ms * 1e3)


def _ratio1(x) -> str:
    """A measured ratio in the goal table: one decimal, so a value at the line reads as what it is."""
    return "-" if x is None else f"{100 * x:.1f}%"


def _ratio(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _ok(r) -> bool:
    return r is not None and r["status"] == "ok"


def _pct(x) -> str:
    """A fraction as a table percentage."""
    return pct(100 * x)


def _opt(x, fmt) -> str:
    """fmt(x), or '-' where an older record has no such metric."""
    return "-" if x is None else fmt(x)


# ------------------------------------------------------------------------------ the sweep
def t_allreduce(v: View) -> str:
    gs = groups(v.records, EX_SWEEP)
    if not gs:
        return NO_RECORDS.format(ex=EX_SWEEP)
    out = []
    for g in gs:
        sizes = sorted({r["params"]["size_bytes"] for r in g.rows if r["params"].get("op") == "all_reduce"})
        rows = []
        for s in sizes:
            a, o = g.row("all_reduce", size_bytes=s), g.row("ring_allreduce", size_bytes=s)
            algo = f"{_m(a, 'algo')} / {_m(a, 'proto')}" if _m(a, "proto") else (_m(a, "algo") or "-")
            rows.append([size_bytes(s), _us(_m(a, "ms")) if _ok(a) else a["status"] if a else "-",
                         num(_m(a, "busbw_gbps")), pct(_m(a, "pct_of_link")), algo,
                         _us(_m(o, "ms")) if _ok(o) else o["status"] if o else "-", num(_m(o, "busbw_gbps")),
                         _ratio(_m(o, "ours_over_nccl_busbw")),
                         f"{_m(a, 'wrong', '-')} / {_m(o, 'wrong', '-')}",
                         num(((a or {}).get("prediction") or {}).get("measured_over_predicted"))])
        link = _m(next((r for r in g.rows if _ok(r)), None), "link_gbps")
        lib = "NCCL" if g.gpu else "gloo"
        roof = "one way per GPU (hardware.yaml)" if g.gpu else "(this machine's copy bandwidth: gloo moves bytes through memory)"
        out.append(f"**{g.label}** ({_run(v, g.rec)}); link roof {num(link)} GB/s {roof}")
        out.append("")
        out.append(markdown(rows, ["size", f"{lib} µs", f"{lib} busbw GB/s", "% of link", f"{lib} algo / proto",
                                   "ours µs", "ours busbw GB/s", f"ours / {lib}", f"#wrong {lib} / ours",
                                   f"{lib} measured/predicted"]))
        out.append("")
    return "\n".join(out)


def t_sweep(v: View) -> str:
    gs = groups(v.records, EX_SWEEP)
    if not gs:
        return NO_RECORDS.format(ex=EX_SWEEP)
    out = []
    for g in gs:
        rows = []
        for r in sorted(g.rows, key=lambda r: (r["params"]["size_bytes"], OP_ORDER.index(r["params"]["op"])
                                               if r["params"].get("op") in OP_ORDER else 99)):
            if "op" not in r["params"]:
                continue
            ok = _ok(r)
            algo = _m(r, "algo") or "-"
            if _m(r, "proto"):
                algo += f" / {_m(r, 'proto')}"
            label = OP_LABEL.get(r["params"]["op"], r["params"]["op"])
            rows.append([size_bytes(r["params"]["size_bytes"]), label if g.gpu else label.replace("NCCL", "gloo"),
                         _us(_m(r, "ms")) if ok else r["status"], num(_m(r, "algbw_gbps")), num(_m(r, "busbw_gbps")),
                         num(_m(r, "busbw_factor"), 3), pct(_m(r, "pct_of_link")),
                         str(_m(r, "wrong", (r.get("check") or {}).get("wrong_elements", "-"))), algo,
                         num((r.get("prediction") or {}).get("measured_over_predicted"))])
        out += [f"<details><summary>{g.label}: every collective and size ({len(rows)} rows)</summary>", "",
                markdown(rows, ["size", "collective", "µs", "algbw GB/s", "busbw GB/s", "factor", "% of link",
                                "#wrong", "algo", "measured/predicted"]),
                "", f"From {_run(v, g.rec)}.", "</details>", ""]
    return "\n".join(out)


# ------------------------------------------------------------------------------ plots
def _plot_path(results: Path, g: Group) -> Path:
    return Path(results) / "plots" / f"phase4_busbw_{g.hw}_{g.n}{'gpu' if g.gpu else 'proc'}.png"


def expected(records, results: Path) -> list[Path]:
    return [_plot_path(results, g) for g in preferred(records, EX_SWEEP)]


def draw(records, results: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for g in preferred(records, EX_SWEEP):
        path = _plot_path(results, g)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig, ax = plt.subplots(figsize=(8, 5))
        styles = {"all_reduce": ("o-", "tab:blue", 2.0), "ring_allreduce": ("s-", "tab:red", 2.0),
                  "all_gather": ("^--", "tab:green", 1.0), "reduce_scatter": ("v--", "tab:purple", 1.0),
                  "sendrecv": ("d:", "tab:gray", 1.0)}
        for op in OP_ORDER:
            pts = sorted((r["params"]["size_bytes"], r["metrics"]["busbw_gbps"]) for r in g.rows
                         if r["params"].get("op") == op and _ok(r))
            if pts:
                style, color, width = styles[op]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, lw=width, ms=4,
                        label=OP_LABEL[op])
        link = next((_m(r, "link_gbps") for r in g.rows if _ok(r)), None)
        if link and g.gpu:
            ax.axhline(link, color="black", ls="--", lw=1, label=f"link, one way: {link:,.0f} GB/s (hardware.yaml)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes, nccl-tests convention)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"Bus bandwidth vs size: {g.label}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
        fig.tight_layout()
        fig.savefig(path, dpi=110, metadata={"Software": None})
        plt.close(fig)
        made.append(path)
    return made


def t_plots(v: View) -> str:
    gs = preferred(v.records, EX_SWEEP)
    if not gs:
        return NO_RECORDS.format(ex=EX_SWEEP)
    lines = []
    for g in gs:
        rel = v.link(_plot_path(Path("."), g).as_posix())
        lines.append(f"![busbw vs size, {g.label}]({rel})")
    return "\n\n".join(lines)


# ------------------------------------------------------------------------------ the ring
def _cfg(r) -> tuple[int, int, int, bool]:
    """(lanes, directions, depth, graph) of a ring row; records from before those existed ran one
    lane in one direction, call by call."""
    p = r["params"]
    return p.get("lanes") or 1, p.get("directions") or 1, p["depth"], bool(p.get("graph"))


def _cfg_words(cfg) -> str:
    lanes, dirs, depth, graph = cfg
    return (f"{lanes} lane{'s' if lanes != 1 else ''}, {dirs} direction{'s' if dirs != 1 else ''}, depth {depth}"
            + (", CUDA graph" if graph else ""))


def _is_ring(r) -> bool:
    return r["variant"].startswith("ring_")


def t_ring(v: View) -> str:
    gs = groups(v.records, EX_RING)
    if not gs:
        return NO_RECORDS.format(ex=EX_RING)
    out = []
    for g in gs:
        checks = [r for r in g.rows if r["variant"].startswith("check_")]
        crow = []
        for cfg in sorted({_cfg(r) for r in checks}):
            rs = [r for r in checks if _cfg(r) == cfg]
            crow.append([str(cfg[0]), str(cfg[1]), str(cfg[2]), "yes" if cfg[3] else "no", ", ".join(f"{r['params']['numel']:,}" for r in rs),
                         "yes" if all(_m(r, "integers_exact") for r in rs) else "NO",
                         num(max((r["check"] or {}).get("max_abs_error") or 0 for r in rs)),
                         num(max((r["check"] or {}).get("rel_l2_error") or 0 for r in rs)),
                         "passed" if all(r["status"] == "ok" for r in rs) else "FAILED"])
        out += [f"**{g.label}** ({_run(v, g.rec)})", "",
                markdown(crow, ["lanes", "directions", "depth", "CUDA graph", "sizes checked (elements)", "integer data: exact, = dist.all_reduce",
                                "random fp32: max |ours - NCCL|", "relative error", "check"]), ""]
        ring_rows = [r for r in g.rows if _is_ring(r)]
        sizes = sorted({r["params"]["size_bytes"] for r in ring_rows + [r for r in g.rows if r["variant"] == "nccl"]})
        trows = [["NCCL all-reduce", "-", "-", "-", "-"] + [num(_m(g.row("nccl", size_bytes=s), "busbw_gbps"))
                                                            for s in sizes]]
        for cfg in sorted({_cfg(r) for r in ring_rows}):
            cells = ["ours: ring", str(cfg[0]), str(cfg[1]), str(cfg[2]), "yes" if cfg[3] else "no"]
            for s in sizes:
                r = next((r for r in ring_rows if _cfg(r) == cfg and r["params"]["size_bytes"] == s), None)
                if not _ok(r):
                    cells.append(r["status"] if r else "-")
                    continue
                pieces = r["params"].get("effective_depth")
                cells.append(f"{num(_m(r, 'busbw_gbps'))} ({_ratio(_m(r, 'ours_over_nccl_busbw'))}"
                             + (f", {pieces} pieces run" if pieces not in (None, cfg[2]) else "") + ")")
            trows.append(cells)
        chunk = next((r["params"].get("p2p_chunk_bytes") for r in ring_rows if r["params"].get("p2p_chunk_bytes")), None)
        out += [markdown(trows, ["all-reduce", "lanes", "directions", "depth", "CUDA graph"] +
                         [f"{size_bytes(s)}: busbw GB/s (of NCCL)" for s in sizes]), ""]
        if chunk:
            out += [f"The ring's sends ran with NCCL_P2P_NVL_CHUNKSIZE={chunk} (NCCL's default: 524288); "
                    f"NCCL's all-reduce in the same job does not read it.", ""]
        for naive in [r for r in g.rows if r["variant"] == "naive_blocking"]:
            out.append(f"Naive blocking order ({naive['params'].get('order')}), {size_bytes(naive['params']['size_bytes'])} "
                       f"per rank on {g.n} ranks over {naive['params'].get('backend')}: "
                       f"**{_m(naive, 'outcome') or naive['status'] + ': ' + str(naive['reason'])}**"
                       + (f"; {_m(naive, 'ranks_returned')} ranks had returned when it was killed." if _m(naive, "killed") else "."))
            out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------------------ DDP
def _settings(p: dict) -> list[str]:
    """The non-default settings of a DDP row (or of the summary's best), in words."""
    ch, sm, hook = p.get("nccl_max_channels"), p.get("sm_carveout"), p.get("comm_hook")
    stream = "copy" if hook == "copy_engine" else "NCCL"         # the stream the gradients' transfers run on
    return (([f"NCCL_MAX_NCHANNELS={ch}"] if ch else []) + ([f"high-priority {stream} stream"] if p.get("nccl_high_priority") else [])
            + ([f"matmuls leave {sm} SMs free"] if sm else []) + ([HOOK_LABEL[hook]] if hook in HOOK_LABEL else []))


HOOK_LABEL = {"avg": "AVG comm hook", "copy_engine": "copy-engine all-reduce hook"}


def _with_settings(text: str, p: dict) -> str:
    """`text`, followed by the row's non-default settings in parentheses if it has any."""
    extra = _settings(p)
    return text + (f" ({', '.join(extra)})" if extra else "")


def _bucket_label(r, unit: str = "") -> str:
    """'25 (NCCL_MAX_NCHANNELS=16, ...)' for a table cell; with unit=' MB buckets', for a sentence."""
    return _with_settings(f"{num(r['params']['bucket_cap_mb'])}{unit}", r["params"])


def _setting_key(p: dict) -> tuple:
    """A row's process-wide settings (one launch each), in a sortable form."""
    return (p.get("nccl_max_channels") or 0, bool(p.get("nccl_high_priority")), p.get("sm_carveout") or 0)


def _ddp_order(r) -> tuple:
    p = r["params"]
    return (*_setting_key(p), p.get("comm_hook") or "builtin", p["bucket_cap_mb"])


def t_ddp(v: View) -> str:
    gs = groups(v.records, EX_DDP)
    if not gs:
        return NO_RECORDS.format(ex=EX_DDP)
    out = []
    for g in gs:
        b, a = g.row("checksum_broadcast"), g.row("checksum_after_steps")
        p = (b or a or g.rows[0])["params"]
        count = g.rec["summary"].get("params_count")
        out.append(f"**{g.label}** ({_run(v, g.rec)}): {p.get('n_layers')} MLP blocks, d = {p.get('d_model')}, "
                   f"{num(count / 1e6) + 'M parameters' if count else ''}, {p.get('tokens_per_rank')} tokens per rank, "
                   f"{p.get('dtype')}.")
        out.append("")
        if b is not None and a is not None:
            before = _m(b, "checksum_before_ddp") or []
            out.append(f"Parameter checksums: {_m(b, 'distinct_before')} distinct values across {g.n} ranks before "
                       f"DDP (each rank seeded its own init); after DDP's broadcast "
                       f"{'identical on every rank' if _m(b, 'identical') else 'NOT identical'} "
                       f"({(_m(b, 'checksum_after_broadcast') or [None])[0]!r}); after {a['params'].get('steps')} steps on "
                       f"different data per rank ({_m(a, 'distinct_first_losses')} distinct first-step losses) "
                       f"{'identical' if _m(a, 'identical') else 'NOT identical'} ({(_m(a, 'checksum_after_steps') or [None])[0]!r})."
                       if before else "")
            out.append("")
        rows = []
        for r in sorted((r for r in g.rows if r["variant"].startswith("bucket_")), key=_ddp_order):
            if not _ok(r):
                rows.append([_bucket_label(r), f"{r['status']}: {r['reason']}"] + ["-"] * 13)
                continue
            pr = r.get("prediction") or {}
            rows.append([_bucket_label(r), str(_m(r, "buckets")), num(_m(r, "compute_ms")), _opt(_m(r, "nocomm_ms"), num),
                         num(_m(r, "comm_ms")), num(_m(r, "ddp_ms")), _opt(_m(r, "ddp_host_ms"), num),
                         _opt(_m(r, "exposed_vs_nocomm_ms"), num),
                         _opt(_m(r, "hidden_fraction_vs_nocomm"), _pct), _pct(_m(r, "hidden_fraction")),
                         num(_m(r, "tflops")), _opt(_m(r, "mfu_vs_peak"), _pct), _opt(_m(r, "mfu_vs_phase1_ceiling"), _pct),
                         num(pr.get("predicted_ms")), num(pr.get("measured_over_predicted"))])
        out += [markdown(rows, ["bucket cap MB", "buckets", "compute ms (no_sync)", "DDP step, no comm ms",
                                "comm ms (buckets alone)", "DDP step ms", "host ms to enqueue it", "exposed ms (vs no comm)",
                                "hidden (vs no comm)", "hidden (vs no_sync)", "TFLOP/s", "MFU (spec peak)",
                                "MFU (phase-1 ceiling)", "predicted ms (perfect overlap)", "measured/predicted"]), ""]
        prow = []
        for variant, what in (("per_rank_steps", "no straggler"), ("per_rank_steps_straggler", "last rank sleeps")):
            r = g.row(variant)
            if r is None:
                continue
            extra = f" {num(r['params'].get('straggler_ms'))} ms" if r["params"].get("straggler_ms") else ""
            prow.append([f"{what}{extra}: local work (no_sync)"] + [num(x) for x in _m(r, "per_rank_local_ms")])
            prow.append([f"{what}{extra}: DDP step"] + [num(x) for x in _m(r, "per_rank_ddp_ms")])
        if prow:
            out += [markdown(prow, ["wall-clock ms per step (median)"] + [f"rank {k}" for k in range(g.n)]), ""]
    return "\n".join(out)


BACKGROUND_LABEL = {"nccl_all_reduce": "NCCL all-reduce", "copy_engine": "copy engines (no SMs)"}


def _contention_rows(g: Group) -> list[dict]:
    return [r for r in g.rows if r["variant"].startswith("contention_")]


def t_contention(v: View) -> str:
    """Backward's kernels alone and under the gradients' transfer: one table of the kernels alone
    (against their roofline), one of slowdowns per transfer and setting."""
    gs = [g for g in groups(v.records, EX_DDP) if _contention_rows(g)]
    if not gs:
        return "_No contention probe in the DDP records yet: run `lab run phase4.ddp` on 2 or more GPUs._"
    out = []
    for g in gs:
        rows = _contention_rows(g)
        kernels = list(dict.fromkeys(r["params"]["kernel"] for r in rows))
        out += [f"**{g.label}** ({_run(v, g.rec)}):", ""]
        first = {}
        for r in rows:
            first.setdefault(r["params"]["kernel"], r)
        alone = []
        for k in kernels:
            r, pr = first[k], first[k].get("prediction") or {}
            alone.append([k, _us(_m(r, "alone_ms")), _us(pr.get("predicted_ms")), num(pr.get("measured_over_predicted")),
                          pr.get("bound") or "-"])
        out += [markdown(alone, ["kernel", "alone µs", "predicted µs (roofline)", "measured/predicted", "bound"]), ""]
        by_setting: dict = {}
        for r in rows:
            key = (r["params"]["background"], _setting_key(r["params"]))
            by_setting.setdefault(key, {})[r["params"]["kernel"]] = r
        table = []
        for (bg, _), cells in sorted(by_setting.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            any_row = next(iter(cells.values()))
            label = _with_settings(BACKGROUND_LABEL.get(bg, bg), any_row["params"])
            transfer = max(_m(any_row, "background_ms") or [0]) or None
            table.append([label, num(transfer)] + [
                (f"{100 * _m(cells[k], 'slowdown'):+.0f}%" if _ok(cells.get(k)) else
                 (cells[k]["status"] if k in cells else "-")) for k in kernels])
        out += [markdown(table, ["transfer in flight", "transfer alone ms"] + [f"{k} slowdown" for k in kernels]), ""]
    return "\n".join(out)


# ------------------------------------------------------------------------------ goals and findings
def _ring_ratio(g: Group, min_size: int, variants) -> tuple[float | None, str | None]:
    """(ratio, variant): the best single configuration among `variants`, judged by its worst ours/NCCL
    busbw over sizes >= min_size (one configuration must hold at every size, not a different one per size)."""
    worst: dict = {}
    for r in g.rows:
        if r["variant"] in variants and _ok(r) and r["params"]["size_bytes"] >= min_size and \
                _m(r, "ours_over_nccl_busbw") is not None:
            worst[r["variant"]] = min(worst.get(r["variant"], float("inf")), _m(r, "ours_over_nccl_busbw"))
    if not worst:
        return None, None
    best = max(worst, key=worst.get)
    return worst[best], best


def t_goals(v: View) -> str:
    rows = []
    for g in [g for g in preferred(v.records, EX_SWEEP) if g.gpu]:
        goal = next((x for x in g.rec["summary"].get("goals", []) if x.get("world_size") == g.n), None)
        if goal:
            rows.append([g.label, "NCCL all-reduce busbw, best at >= 1 GiB", f">= {num(goal['goal_gbps'])} GB/s",
                         f"{goal['best_busbw_gbps_from_1gib']:.1f} GB/s" if goal.get("best_busbw_gbps_from_1gib") else "-",
                         _met(goal.get("met")), _run(v, g.rec)])
        s = g.rec["summary"]
        if s.get("goal_ring_over_nccl"):
            x, _ = _ring_ratio(g, s["goal_ring_min_size_bytes"], ("ring_allreduce",))
            rows.append([g.label, f"our ring / NCCL busbw, worst size >= {size_bytes(s['goal_ring_min_size_bytes'])} (sweep)",
                         f">= {_ratio(s['goal_ring_over_nccl'])}", _ratio1(x),
                         _met(None if x is None else x >= s["goal_ring_over_nccl"]), _run(v, g.rec)])
    for g in [g for g in preferred(v.records, EX_RING) if g.gpu]:
        s = g.rec["summary"]
        if s.get("goal_ours_over_nccl_busbw"):
            variants = {r["variant"] for r in g.rows if _is_ring(r)}
            x, best = _ring_ratio(g, s["goal_min_size_bytes"], variants)
            cfg = next((_cfg(r) for r in g.rows if r["variant"] == best), None)
            rows.append([g.label, f"our ring / NCCL busbw, worst size >= {size_bytes(s['goal_min_size_bytes'])}, "
                                  f"best configuration" + (f" ({_cfg_words(cfg)})" if cfg else ""),
                         f">= {_ratio(s['goal_ours_over_nccl_busbw'])}", _ratio1(x),
                         _met(None if x is None else x >= s["goal_ours_over_nccl_busbw"]), _run(v, g.rec)])
    for g in [g for g in preferred(v.records, EX_DDP) if g.gpu]:
        s = g.rec["summary"]
        best = next((x for x in s.get("best", []) if x.get("world_size") == g.n), None)
        if best:
            share = best.get("hidden_fraction_vs_nocomm")
            against = ("against the DDP step with no communication; "
                       f"{_ratio1(best['hidden_fraction'])} against no_sync" if share is not None else "against no_sync")
            at = "at the fastest DDP step" if best.get("judged_on") == "fastest_step" else "best"
            rows.append([g.label, "DDP: gradient communication hidden under backward, " + against + f" ({at}: "
                                  + ", ".join([f"{num(best['bucket_cap_mb'])} MB buckets"] + _settings(best)) + ")",
                         f">= {_ratio(s.get('goal_hidden_fraction'))}",
                         _ratio1(best["hidden_fraction"] if share is None else share), _met(best.get("met")),
                         _run(v, g.rec)])
    if not rows:
        return "_No phase 4 records yet: run `lab run 4` on 2 or more GPUs, then `lab report`._"
    return markdown(rows, ["ranks", "goal", "target", "measured", "met", "run"])


def _met(x) -> str:
    return "-" if x is None else ("yes" if x else "**no**")


def _largest(g: Group, op: str):
    ok = [r for r in g.rows if r["params"].get("op") == op and _ok(r)]
    return max(ok, key=lambda r: r["params"]["size_bytes"]) if ok else None


def _half_size(g: Group, op: str):
    """The smallest size at which busbw reaches half of its best."""
    ok = sorted((r for r in g.rows if r["params"].get("op") == op and _ok(r)), key=lambda r: r["params"]["size_bytes"])
    if not ok:
        return None
    best = max(_m(r, "busbw_gbps") for r in ok)
    return next(r["params"]["size_bytes"] for r in ok if _m(r, "busbw_gbps") >= best / 2)


def _p2p_jump(g: Group):
    """(row, next row) of the send/recv shift where busbw rose 1.5x or more from one size to the
    next, from 16 MiB up (where the fixed cost no longer dominates); None if it never did."""
    ok = sorted((r for r in g.rows if r["params"].get("op") == "sendrecv" and _ok(r)
                 and r["params"]["size_bytes"] >= 16 * 2**20), key=lambda r: r["params"]["size_bytes"])
    return next(((a, b) for a, b in zip(ok, ok[1:]) if _m(b, "busbw_gbps") >= 1.5 * _m(a, "busbw_gbps")), None)


def _hidden(r) -> float:
    """The goal's measure (against the DDP step with no communication) where the record has it,
    else the older one (against no_sync)."""
    x = _m(r, "hidden_fraction_vs_nocomm")
    return _m(r, "hidden_fraction") if x is None else x


def _exposed(r) -> float:
    x = _m(r, "exposed_vs_nocomm_ms")
    return _m(r, "exposed_comm_ms") if x is None else x


def _carveout_finding(cap, timed: list[dict]) -> list[str]:
    """If the sweep tried an SM carve-out: the exposed time with and without it (same bucket size,
    otherwise default settings), which says whether the SMs NCCL occupies are where the time goes."""
    def exposed(sm):
        rows = [r for r in timed if r["params"]["bucket_cap_mb"] == cap and (r["params"].get("sm_carveout") or 0) == sm
                and not _settings({**r["params"], "sm_carveout": None})]
        return _exposed(rows[0]) if rows else None
    out, without = [], exposed(0)
    for sm in sorted({r["params"].get("sm_carveout") for r in timed if r["params"].get("sm_carveout")}):
        with_ = exposed(sm)
        if with_ is not None and without is not None:
            out.append(f"With the matmuls told to leave {sm} SMs free (cuBLAS's SM carve-out, more SMs than NCCL's "
                       f"channels take), {num(cap)} MB buckets exposed {num(with_)} ms against {num(without)} ms "
                       f"without it.")
    return out


def _probe_finding(g: Group, best: dict) -> list[str]:
    """Sentences from the contention probe run with the best row's settings: how much each kernel
    slowed under NCCL's all-reduce and under the copy engines, and what that says about why."""
    key = _setting_key(best["params"])
    cells = {(r["params"]["background"], r["params"]["kernel"]): r for r in _contention_rows(g)
             if _setting_key(r["params"]) == key and _ok(r)}
    if not cells:
        return []

    def listing(bg):
        return ", ".join(f"{k} {100 * _m(r, 'slowdown'):+.0f}%" for (b, k), r in cells.items() if b == bg)
    out = [f"Why: timed alone and then while the gradients' all-reduce ran on NCCL's stream (same settings), "
           f"backward's kernels at this run's shapes slowed: {listing('nccl_all_reduce')}."]
    if any(b == "copy_engine" for b, _ in cells):
        out.append(f"With the same bytes per GPU moved by the copy engines instead, which use no SM: "
                   f"{listing('copy_engine')}.")
        out += _sm_or_bytes(cells)
    return out


def _sm_or_bytes(cells: dict) -> list[str]:
    """What the two transfers' slowdowns say, for the compute-bound matmul and, on average, the
    memory-bound kernels: a cost that stays when no SM moves the bytes comes with the bytes."""
    def mean(bg, bound):
        xs = [_m(r, "slowdown") for (b, _), r in cells.items()
              if b == bg and (r.get("prediction") or {}).get("bound") == bound]
        return sum(xs) / len(xs) if xs else None
    out = []
    for bound, what in (("compute", "The compute-bound matmul"), ("memory", "On average the memory-bound kernels")):
        nccl, ce = mean("nccl_all_reduce", bound), mean("copy_engine", bound)
        if nccl is None or ce is None or nccl <= 0:
            continue
        if ce >= 0.7 * nccl:
            why = "nearly as much to a transfer that uses no SM: that cost comes with moving the bytes (HBM and " \
                  "L2 traffic, the power the transfer draws), and no channel cap or carve-out removes it"
        elif ce <= 0.5 * nccl:
            why = "much less to the copy engines: most of what NCCL costs it is the SMs NCCL's channels hold"
        else:
            why = "less to the copy engines: part of what NCCL costs it is the SMs NCCL's channels hold"
        out.append(f"{what} lost {100 * nccl:+.0f}% under NCCL and {100 * ce:+.0f}% under the copy "
                   f"engines, {why}.")
    return out


def _copy_engine_finding(timed: list[dict]) -> list[str]:
    """The copy-engine hook against NCCL (DDP's builtin hook) in the same launch, with the same
    buckets, at the copy-engine hook's fastest step: alone, exposed, and the step."""
    ce = [r for r in timed if r["params"].get("comm_hook") == "copy_engine"]
    if not ce:
        return []
    c = min(ce, key=lambda r: _m(r, "ddp_ms"))
    p = c["params"]
    twin = next((r for r in timed if (r["params"].get("comm_hook") or "builtin") == "builtin"
                 and r["params"]["bucket_cap_mb"] == p["bucket_cap_mb"]
                 and _setting_key(r["params"]) == _setting_key(p)), None)
    if twin is None:
        return []
    ce_x, nccl_x = _exposed(c), _exposed(twin)
    verdict = ("less exposed time: freeing the SMs paid" if ce_x < 0.8 * nccl_x else
               "more exposed time" if ce_x > 1.2 * nccl_x else
               "about as much exposed time: freeing the SMs did not buy the time back")
    return [f"The copy-engine hook (copy_engine.py: every byte moved by the copy engines, one small kernel per "
            f"bucket for the sum) all-reduced {num(p['bucket_cap_mb'])} MB buckets alone in {num(_m(c, 'comm_ms'))} ms "
            f"against NCCL's {num(_m(twin, 'comm_ms'))} ms with the same buckets and stream priority; under backward "
            f"it left {num(ce_x)} ms exposed against NCCL's {num(nccl_x)} ms ({verdict}), and its step took "
            f"{num(_m(c, 'ddp_ms'))} ms against {num(_m(twin, 'ddp_ms'))} ms."]


def _overrun_finding(timed: list[dict]) -> list[str]:
    """The settings whose DDP step exposed more than their whole all-reduce takes alone: no overlap
    explains that, so say which hooks they used."""
    over = [r for r in timed if _exposed(r) > _m(r, "comm_ms")]
    if not over:
        return []
    hooks = {r["params"].get("comm_hook") or "builtin" for r in over}
    host = [x for x in map(_host_share, over) if x is not None]
    out = (f"{len(over)} of the {len(timed)} settings left more time exposed than their whole all-reduce takes "
           f"alone (the worst, {_bucket_label(max(over, key=_exposed), ' MB buckets')}, {num(max(map(_exposed, over)))} "
           f"ms): no overlap explains that.")
    if "builtin" not in hooks:
        out += (" Every one of them used a comm hook written in Python, which runs for every bucket on the thread "
                "that also launches backward's kernels; DDP's builtin hook, in C++, never did.")
    if len(host) == len(over):
        out += (f" The CPU took {_ratio(min(host))} to {_ratio(max(host))} of their GPU step time to enqueue a step: "
                f"the CPU, not the GPU, set their pace.")
    elif "builtin" not in hooks:
        out += " The time is most likely CPU time."
    return [out]


# a step whose enqueueing keeps the CPU busy for this share of its GPU time leaves the GPU waiting
# for launches at some point: the CPU, not the GPU, is then what the step's time measures
HOST_BOUND = 0.9


def _host_share(r) -> float | None:
    """The CPU's time to enqueue a DDP step over the step's GPU time (None in older records)."""
    host = _m(r, "ddp_host_ms")
    return None if host is None else host / _m(r, "ddp_ms")


def _host_finding(best: dict, timed: list[dict]) -> list[str]:
    """How long the CPU took to enqueue the fastest step, and which settings the CPU bound."""
    if _host_share(best) is None:
        return []
    bound = [r for r in timed if (_host_share(r) or 0) >= HOST_BOUND]
    out = (f"The CPU took {num(_m(best, 'ddp_host_ms'))} ms to enqueue the fastest step "
           f"({_ratio(_host_share(best))} of its GPU time).")
    if bound:
        worst = max(bound, key=_host_share)
        out += (f" {len(bound)} of the {len(timed)} settings kept the CPU busy for at least {_ratio(HOST_BOUND)} of "
                f"their GPU step, where the GPU waits for launches (the most: {_bucket_label(worst, ' MB buckets')}, "
                f"{num(_m(worst, 'ddp_host_ms'))} of {num(_m(worst, 'ddp_ms'))} ms).")
    return [out]


def _ddp_contention(v: View, g: Group, best: dict, timed: list[dict], goal: float | None) -> list[str]:
    """Sentences on why the exposed time is what it is: the spread over the settings tried at the
    best bucket size, the carve-out, the contention probe, and the last bucket's share."""
    cap = best["params"]["bucket_cap_mb"]
    same = [_hidden(r) for r in timed if r["params"]["bucket_cap_mb"] == cap]
    out = []
    carved = any(r["params"].get("sm_carveout") for r in timed)
    if len(same) > 1:
        out.append(f"Across the {len(same)} settings tried with {num(cap)} MB buckets (NCCL channel cap, stream "
                   f"priority, {'SM carve-out, ' if carved else ''}comm hook) the hidden share ranged from "
                   f"{_ratio1(min(same))} to {_ratio1(max(same))} (median {_ratio1(statistics.median(same))})"
                   + (f": none reached {_ratio(goal)}." if goal and max(same) < goal else "."))
    out += _carveout_finding(cap, timed)
    out += _probe_finding(g, best)
    sweep = next((s for s in preferred(v.records, EX_SWEEP) if s.hw == g.hw and s.n == g.n), None)
    sizes = _m(best, "bucket_bytes") or []
    if sweep is None or not sizes:
        return out
    mean = sum(sizes) / len(sizes)
    rows = [r for r in sweep.rows if r["params"].get("op") == "all_reduce" and _ok(r)]
    if not rows:
        return out
    near = min(rows, key=lambda r: abs(r["params"]["size_bytes"] - mean))
    out.append(f"The last bucket can never hide, but an all-reduce of its size takes only {_us(_m(near, 'ms'))} µs "
               f"({size_bytes(near['params']['size_bytes'])} in the sweep); the rest of the {num(_exposed(best))} ms "
               f"exposed is what backward and the all-reduce cost each other running side by side. NVLink SHARP, "
               f"where the switch does the reduction, would move the reduction's traffic off the GPU; the lab's "
               f"machines keep it off (NCCL_NVLS_ENABLE=0).")
    return out


def t_findings(v: View) -> str:
    paras = []
    for g in preferred(v.records, EX_SWEEP):
        if not g.gpu:
            continue
        ar, sr, ours = _largest(g, "all_reduce"), _largest(g, "sendrecv"), _largest(g, "ring_allreduce")
        if ar is None:
            continue
        smallest = min((r for r in g.rows if r["params"].get("op") == "all_reduce" and _ok(r)),
                       key=lambda r: r["params"]["size_bytes"])
        link = _m(ar, "link_gbps")
        s = [f"**{g.label}.** NCCL's all-reduce of {size_bytes(ar['params']['size_bytes'])} reached "
             f"{num(_m(ar, 'busbw_gbps'))} GB/s of bus bandwidth ({_m(ar, 'algo') or 'algorithm not observed'}"
             f"{' / ' + _m(ar, 'proto') if _m(ar, 'proto') else ''}): {pct(_m(ar, 'pct_of_link'))} of the "
             f"{num(link)} GB/s one-way link figure in hardware.yaml."]
        if sr is not None:
            s.append(f"A plain send/recv shift, where every GPU only sends to one neighbour and receives from the other, "
                     f"moved {num(_m(sr, 'busbw_gbps'))} GB/s at {size_bytes(sr['params']['size_bytes'])} "
                     f"({pct(_m(sr, 'pct_of_link'))} of the link): that is what the transport delivers with no "
                     f"reduction and no step-to-step synchronization, so of the gap between the link figure and the "
                     f"all-reduce, {pct(100 - _m(sr, 'pct_of_link'))} of the link is lost before any algorithm runs "
                     f"and the all-reduce keeps {_ratio(_m(ar, 'busbw_gbps') / _m(sr, 'busbw_gbps'))} of what "
                     f"send/recv achieves.")
        half = _half_size(g, "all_reduce")
        s.append(f"Small messages never see the link: the {size_bytes(smallest['params']['size_bytes'])} all-reduce "
                 f"took {_us(_m(smallest, 'ms'))} µs ({num(_m(smallest, 'busbw_gbps'))} GB/s), and busbw first reached "
                 f"half of its best at {size_bytes(half)}; below that, the fixed cost of a call sets the time.")
        if ours is not None and _m(ours, "ours_over_nccl_busbw") is not None:
            small = min((r for r in g.rows if r["params"].get("op") == "ring_allreduce" and _ok(r)
                         and _m(r, "ours_over_nccl_busbw") is not None), key=lambda r: r["params"]["size_bytes"])
            s.append(f"Our ring, built from isend/irecv in Python, reached {num(_m(ours, 'busbw_gbps'))} GB/s at "
                     f"{size_bytes(ours['params']['size_bytes'])}: {_ratio(_m(ours, 'ours_over_nccl_busbw'))} of NCCL in "
                     f"the same run.")
            if _m(ours, "ring_graph"):
                s.append(f"It ran as a CUDA graph replay, one launch per all-reduce, while each NCCL row is an eager "
                         f"call: where the launch is most of the time the comparison favours ours, so at "
                         f"{size_bytes(small['params']['size_bytes'])} it took {_us(_m(small, 'ms'))} µs against "
                         f"NCCL's {_us(_m(g.row('all_reduce', size_bytes=small['params']['size_bytes']), 'ms'))} µs; "
                         f"NCCL captured in a graph would lose its host cost too.")
            else:
                s.append(f"At {size_bytes(small['params']['size_bytes'])} it managed "
                         f"{_ratio(_m(small, 'ours_over_nccl_busbw'))}, paying a Python call per transfer where NCCL "
                         f"runs the whole ring in one kernel.")
        jump = _p2p_jump(g)
        if jump is not None:
            lo, hi = jump
            cfg = _m(ours, "ring_p2p_chunk_bytes") if ours is not None else None
            s.append(f"The send/recv shift jumped from {num(_m(lo, 'busbw_gbps'))} GB/s at "
                     f"{size_bytes(lo['params']['size_bytes'])} to {num(_m(hi, 'busbw_gbps'))} GB/s at "
                     f"{size_bytes(hi['params']['size_bytes'])}: by NCCL's scheduling rule for point-to-point "
                     f"(enqueue.cc) a send starts on fewer channels the more ranks share the communicator and gets "
                     f"more only once each channel's part exceeds 32 chunks of NCCL_P2P_NVL_CHUNKSIZE (16 MiB at the "
                     f"default 512 KiB). A ring step sends size/{g.n}, so this is the ring's bottleneck"
                     + (f"; its sends ran with NCCL_P2P_NVL_CHUNKSIZE={cfg}, which spreads a 64 MiB send over 32 "
                        f"channels (the NCCL rows keep the default)." if cfg else "."))
        paras.append(" ".join(s))
    for g in preferred(v.records, EX_DDP):
        if not g.gpu:
            continue
        timed = [r for r in g.rows if r["variant"].startswith("bucket_") and _ok(r)]
        if not timed:
            continue
        best = min(timed, key=lambda r: _m(r, "ddp_ms"))           # the goal is judged at the fastest step
        most, worst = max(timed, key=_hidden), min(timed, key=_hidden)
        s = [f"**DDP on {g.label}.** The fastest step, {num(_m(best, 'ddp_ms'))} ms, came with "
             f"{_bucket_label(best, ' MB buckets')}: {_ratio1(_hidden(best))} of the {num(_m(best, 'comm_ms'))} ms "
             f"of gradient all-reduce ran under backward, against "
             + (f"{num(_m(best, 'nocomm_ms'))} ms for the same DDP step with its communication removed "
                f"({g.rec['summary'].get('nocomm_baseline') or 'a comm hook that sends nothing'}), and {num(_m(best, 'compute_ms'))} ms under no_sync. The "
                f"{num(_m(best, 'bookkeeping_ms'))} ms between those two is DDP's own work, above all copying every "
                f"new gradient into its bucket; charged to the communication as well, the hidden share would be "
                f"{_ratio(_m(best, 'hidden_fraction'))}." if _m(best, "nocomm_ms") is not None else
                f"{num(_m(best, 'compute_ms'))} ms with no communication at all.")
             + f" With {_bucket_label(worst, ' MB buckets')} only {_ratio(_hidden(worst))} hid."]
        if most is not best:
            s.append(f"The largest share, {_ratio1(_hidden(most))}, came with {_bucket_label(most, ' MB buckets')}, "
                     f"of a {num(_m(most, 'comm_ms'))} ms all-reduce: it left {num(_exposed(most))} ms exposed against "
                     f"{num(_exposed(best))} ms at the fastest step"
                     + (", a bigger part of a longer time, not a saving." if _exposed(most) >= _exposed(best) else "."))
        if _m(best, "mfu_vs_peak") is not None:
            s.append(f"The step ran at {num(_m(best, 'tflops'))} TFLOP/s of model FLOPs: MFU {_ratio(_m(best, 'mfu_vs_peak'))} "
                     f"of the {num(_m(best, 'peak_tflops'))} TFLOP/s spec peak"
                     + (f", {_ratio(_m(best, 'mfu_vs_phase1_ceiling'))} of the {num(_m(best, 'phase1_ceiling_tflops'))} "
                        f"TFLOP/s best matmul phase 1 measured." if _m(best, "mfu_vs_phase1_ceiling") is not None else "."))
        s += _copy_engine_finding(timed)
        s += _host_finding(best, timed)
        s += _overrun_finding(timed)
        s += _ddp_contention(v, g, best, timed, g.rec["summary"].get("goal_hidden_fraction"))
        st = g.row("per_rank_steps_straggler")
        if st is not None:
            s.append(f"With the last rank sleeping {num(st['params']['straggler_ms'])} ms per step, local work spread "
                     f"{num(_m(st, 'local_spread_ms'))} ms across ranks but DDP steps only {num(_m(st, 'ddp_spread_ms'))} ms: "
                     f"every rank waited in the all-reduce for the slowest.")
        paras.append(" ".join(s))
    if not paras:
        return "_No GPU records yet: run `lab run 4` on 2 or more GPUs, then `lab report`._"
    top = max(b for _, _, b in seed.ALLREDUCE)
    from common.hardware import load_hardware
    a100 = load_hardware().get(seed.HARDWARE_KEY)
    one_way = a100.figure("interconnect_one_way_gbps").value if a100 else None
    if one_way:
        paras.append(f"For comparison, quoted from the {seed.CITATION}: its all-reduce peaked at {num(top)} GB/s busbw and "
                     f"was reported as {pct(100 * top / seed.RATED_GBPS_USED)} of {seed.RATED_GBPS_USED} GB/s. That "
                     f"figure counts both directions, while busbw counts one: against the A100's {num(one_way)} GB/s one "
                     f"way (hardware.yaml) the same number is {pct(100 * top / one_way)}.")
    return "\n\n".join(paras)


TABLES = {"phase4.goals": t_goals, "phase4.allreduce": t_allreduce, "phase4.sweep": t_sweep,
          "phase4.plots": t_plots, "phase4.ring": t_ring, "phase4.ddp": t_ddp, "phase4.contention": t_contention,
          "phase4.findings": t_findings}


def key_result(v: View) -> list[str]:
    """One line per GPU kind for the main README's phase table: NCCL busbw at >= 1 GiB per world size."""
    out = []
    recs = [r for r in v.records if r["exercise"]["id"] == "phase4.interconnect" and r["status"] != "skipped"
            and r.get("source", {}).get("kind", "measured") == "measured"]
    newest = {}
    for r in recs:                                  # records come oldest first
        newest[r["hardware"]["key"]] = r
    for hw, rec in sorted(newest.items()):
        goals = rec["summary"].get("goals") or []
        if goals:
            name = (rec["hardware"].get("spec") or {}).get("name") or hw
            out.append(f"{name}: NCCL all-reduce busbw " + ", ".join(
                f"{num(gl['best_busbw_gbps_from_1gib'])} GB/s on {gl['world_size']} GPUs" for gl in goals))
    return out
