"""Phase 4's findings: sentences over each group's stored facts (analysis.py), per GPU count."""
from common.formats import bullets, num, pct, size_bytes

from . import analysis
from .groups import (
    DDP_SINCE,
    EX_DDP,
    EX_SWEEP,
    bucket_label,
    facts,
    frac,
    groups,
    preferred_groups,
)


def _sweep_finding(label: str, f: dict) -> str:
    s = [f"NCCL's all-reduce of {size_bytes(f['size'])} reached {num(f['busbw_gbps'])} GB/s of bus "
         f"bandwidth ({f.get('algo') or 'algorithm not observed'}{' / ' + f['proto'] if f.get('proto') else ''}): "
         f"{pct(f['pct_of_link'])} of the {num(f['link_gbps'])} GB/s one-way link figure in hardware.yaml."]
    if f.get("sendrecv"):
        sr = f["sendrecv"]
        s.append(f"A send/recv shift, with no reduction and no step-to-step synchronisation, moved "
                 f"{num(sr['busbw_gbps'])} GB/s at {size_bytes(sr['size'])} ({pct(sr['pct_of_link'])} of the link): "
                 f"the transport alone loses {pct(100 - sr['pct_of_link'])} of the link, and the all-reduce keeps "
                 f"{frac(sr['allreduce_over_sendrecv'])} of what send/recv achieves.")
    s.append(f"Small messages never see the link: the {size_bytes(f['smallest_size'])} all-reduce took "
             f"{num(1e3 * f['smallest_ms'])} µs ({num(f['smallest_busbw_gbps'])} GB/s), and busbw first reached half "
             f"of its best at {size_bytes(f['half_best_size'])}; below that, a call's fixed cost sets the time.")
    o = f.get("ours")
    if o:
        s.append(f"Our ring, built from isend/irecv in Python, reached {num(o['busbw_gbps'])} GB/s at "
                 f"{size_bytes(o['size'])}: {frac(o['over_nccl'])} of NCCL in the same run" +
                 ("." if o["graph"] else f"; at {size_bytes(o['smallest_size'])} it managed {frac(o['smallest_over_nccl'])}, "
                  f"paying a Python call per transfer where NCCL runs the whole ring in one kernel."))
        if o["graph"]:
            s.append(f"Our ring ran as one CUDA graph replay per all-reduce while NCCL's rows are eager calls, so where the "
                     f"launch is most of the time the comparison favours ours: at {size_bytes(o['smallest_size'])} it "
                     f"took {num(1e3 * o['smallest_ms'])} µs against NCCL's "
                     f"{num(1e3 * (o['smallest_nccl_ms'] or float('nan')))} µs.")
    if f.get("sendrecv_jump"):
        j, chunk = f["sendrecv_jump"], (o or {}).get("p2p_chunk_bytes")
        s.append(f"The send/recv shift jumped from {num(j['from_gbps'])} GB/s at {size_bytes(j['from_size'])} to "
                 f"{num(j['to_gbps'])} GB/s at {size_bytes(j['to_size'])}: NCCL starts a send on fewer channels the more "
                 f"ranks share the communicator and adds channels only once each one's part exceeds 32 chunks of "
                 f"NCCL_P2P_NVL_CHUNKSIZE.")
        s.append("A ring step sends size/n, so this is the ring's bottleneck"
                 + (f"; its sends ran with NCCL_P2P_NVL_CHUNKSIZE={chunk} (the NCCL rows keep the default)." if chunk else "."))
    return bullets(s, f"{label}:")


WHY = {"bytes": "nearly as much to a transfer that uses no SM: that cost comes with moving the bytes (HBM and L2 "
                "traffic, power), and no channel cap or carve-out removes it",
       "sms": "much less to the copy engines: most of what NCCL costs it is the SMs NCCL's channels hold",
       "partly_sms": "less to the copy engines: part of what NCCL costs it is the SMs NCCL's channels hold"}
CE = {"less": "less exposed time: freeing the SMs paid", "more": "more exposed time",
      "same": "about as much exposed time: freeing the SMs did not buy the time back"}


def _slow(x) -> str:
    return f"{100 * x:+.0f}%"


def _ddp_finding(label: str, f: dict) -> str:
    b, lo, hi = f["fastest"], f["least_hidden"], f["most_hidden"]
    s = [f"The fastest step, {num(b['ddp_ms'])} ms, came with {bucket_label(b, ' MB buckets')}: "
         f"{frac(b['hidden'])} of the {num(b['comm_ms'])} ms gradient all-reduce ran under backward.",
         f"The same step took {num(b['nocomm_ms'])} ms with its communication removed and {num(b['compute_ms'])} ms under "
         f"no_sync. The {num(b['bookkeeping_ms'])} ms between those two is DDP's own work, above all copying every new "
         f"gradient into its bucket; charged to the communication too, the hidden share would be "
         f"{frac(b['hidden_vs_no_sync'])}.",
         f"With {bucket_label(lo, ' MB buckets')} only {frac(lo['hidden'])} hid."]
    if not f["most_hidden_is_fastest"]:
        s.append(f"The largest share, {frac(hi['hidden'])}, came with {bucket_label(hi, ' MB buckets')}: it left "
                 f"{num(hi['exposed_ms'])} ms exposed against {num(b['exposed_ms'])} ms at the fastest step"
                 + (", a bigger part of a longer time, not a saving." if f["most_hidden_exposes_more"] else "."))
    if b.get("mfu_vs_peak") is not None:
        s.append(f"The step ran at {num(b['tflops'])} TFLOP/s of model FLOPs: MFU {frac(b['mfu_vs_peak'])} of the "
                 f"{num(b['peak_tflops'])} TFLOP/s spec peak" + (
                     f", {frac(b['mfu_vs_phase1_ceiling'])} of the {num(b['phase1_ceiling_tflops'])} TFLOP/s best matmul "
                     f"phase 1 measured." if b.get("mfu_vs_phase1_ceiling") is not None else "."))
    if f.get("copy_engine") and f["copy_engine"]["verdict"]:
        c, t = f["copy_engine"]["copy_engine"], f["copy_engine"]["nccl"]
        s.append(f"The copy-engine hook all-reduced {num(c['bucket_cap_mb'])} MB buckets alone in {num(c['comm_ms'])} ms "
                 f"against NCCL's {num(t['comm_ms'])} ms with the same buckets and stream priority.")
        s.append(f"Under backward the copy-engine hook left {num(c['exposed_ms'])} ms exposed against NCCL's "
                 f"{num(t['exposed_ms'])} ms ({CE[f['copy_engine']['verdict']]}), and its step took {num(c['ddp_ms'])} ms "
                 f"against {num(t['ddp_ms'])} ms.")
    if b.get("host_share") is not None:
        hb = f.get("host_bound")
        s.append(f"The CPU took {num(b['host_ms'])} ms to enqueue the fastest step ({frac(b['host_share'])} of its GPU "
                 f"time).")
        if hb:
            s.append(f"{hb['settings']} of the {f['settings']} settings kept the CPU busy for at least "
                     f"{frac(analysis.HOST_BOUND)} of their GPU step, where the GPU waits for launches (the most: "
                     f"{bucket_label(hb['most'], ' MB buckets')}, {num(hb['most']['host_ms'])} of "
                     f"{num(hb['most']['ddp_ms'])} ms).")
    if f.get("overrun"):
        ov = f["overrun"]
        s.append(f"{ov['settings']} of the {f['settings']} settings left more time exposed than their whole all-reduce "
                 f"takes alone (the worst, {bucket_label(ov['worst'], ' MB buckets')}, {num(ov['worst']['exposed_ms'])} "
                 f"ms): no overlap explains that.")
        if ov["python_hooks_only"]:
            s.append("Every one of those settings used a comm hook written in Python, which runs for every bucket on the "
                     "thread that also launches backward's kernels.")
        if ov.get("host_share"):
            s.append(f"In those settings the CPU took {frac(ov['host_share'][0])} to {frac(ov['host_share'][1])} of the "
                     f"GPU step time to enqueue a step: the CPU, not the GPU, set their pace.")
    cap = f["at_fastest_cap"]
    if cap["settings"] > 1:
        s.append(f"Across the {cap['settings']} settings tried with {num(b['bucket_cap_mb'])} MB buckets the hidden share "
                 f"ranged from {frac(cap['min'])} to {frac(cap['max'])} (median {frac(cap['median'])}).")
    if f.get("probe"):
        slow = f["probe"]["slowdown"]

        def listing(bg):
            return ", ".join(f"{k} {_slow(x)}" for k, x in slow.get(bg, {}).items())
        s.append(f"Why: timed alone and then under the gradients' NCCL all-reduce (same settings), backward's kernels "
                 f"slowed: {listing('nccl_all_reduce')}.")
        if "copy_engine" in slow:
            s.append(f"Under the same bytes moved by the copy engines, which use no SM, backward's kernels slowed: "
                     f"{listing('copy_engine')}.")
        for bound, v in f["probe"]["by_bound"].items():
            what = "The compute-bound matmul" if bound == "compute" else "On average the memory-bound kernels"
            s.append(f"{what} lost {_slow(v['nccl'])} under NCCL and {_slow(v['copy_engine'])} under the copy engines, "
                     f"{WHY[v['verdict']]}.")
    if f.get("straggler"):
        st = f["straggler"]
        s.append(f"With the last rank sleeping {num(st['sleep_ms'])} ms per step, local work spread "
                 f"{num(st['local_spread_ms'])} ms across ranks but DDP steps only {num(st['ddp_spread_ms'])} ms: every "
                 f"rank waited in the all-reduce for the slowest.")
    return bullets(s, f"DDP on {label}:")


def findings(view) -> str:
    paras = [_sweep_finding(g.iloc[0]["hardware_name"], f) for _, g in preferred_groups(groups(view, EX_SWEEP), True)
             for f in [facts(view, g, analysis.sweep_facts)] if f]
    paras += [_ddp_finding(g.iloc[0]["hardware_name"], f) for _, g in preferred_groups(groups(view, EX_DDP, DDP_SINCE), True)
              for f in [facts(view, g, analysis.ddp_facts)] if f]
    return "\n\n".join(paras)
