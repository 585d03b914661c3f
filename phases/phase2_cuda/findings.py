"""Phase 2's findings: sentences whose every number comes from the records (a thin template)."""
from common.formats import bullets, pct, ratio
from common.frame import by_hardware, find, value

from .rows import SM, row_length


def _copy_share(rows, variant: str, dtype: str, cols: int) -> str:
    r = find(rows, variant, dtype=dtype, cols=cols, group="sweep")
    return pct(value(r, "metrics.pct_of_copy_bandwidth")) if r is not None else "-"


def softmax_findings(view) -> str:
    paras = []
    for _, got in sorted(by_hardware(view.frame, [SM]).items()):
        s = got[SM]
        longest = int(s["params.cols"].max())

        def share(variant: str, dtype: str, cols: int = longest) -> str:
            return _copy_share(s, variant, dtype, cols)

        items = [f"**Registers run out first.** A {longest:,}-column row does not fit one SM's registers; "
                 f"`cluster_row` splits it over 2-16 SMs, each holding its slice until the row's (max, sum) is "
                 f"known: {share('cluster_row', 'fp32')} of copy in fp32, {share('cluster_row', 'bf16')} in bf16."]
        if (s["params.cols"] == 16384).any():
            items.append(f"**Shared memory buys rows in flight.** Staged in shared memory, 3-6 CTAs per SM load while "
                         f"others reduce and write: `block_row_smem` reached {share('block_row_smem', 'fp32', 16384)} "
                         f"(fp32) and {share('block_row_smem', 'bf16', 16384)} (bf16) at 16,384 columns.")
            items.append(f"Split over clusters at {longest:,} columns, `cluster_row_smem` fell to "
                         f"{share('cluster_row_smem', 'fp32')} (fp32) and {share('cluster_row_smem', 'bf16')} (bf16): an SM is refilled "
                         "only when a whole cluster is done.")
        ring = [(d, find(s, "cuda", dtype=d, cols=longest, group="sweep"), find(s, "stream_row", dtype=d, cols=longest))
                for d in ("fp32", "bf16")]
        said = [f"{pct(c['metrics.pct_of_copy_bandwidth'])} of copy in {d} ({ratio(c['metrics.speedup_vs_torch'])} "
                f"torch.softmax, `{c['metrics.kernel']}`)" for d, c, _ in ring if c is not None]
        twice = [f"{pct(c['metrics.pct_of_copy_bandwidth'])} and {pct(t['metrics.pct_of_copy_bandwidth'])} in {d}"
                 for d, c, t in ring if c is not None and t is not None and c["metrics.kernel"] == "stream_row"]
        if said:
            items.append("**A persistent ring keeps the loads going; a ticket counter keeps the SMs busy to the end.** "
                         f"At {longest:,} columns the dispatcher reached " + " and ".join(said) + ".")
            if twice:
                items.append("Timed twice in the same run, as `cuda` and as `stream_row`, the dispatcher read "
                             + "; ".join(twice) + ": the run-to-run spread to allow for.")
        ours = s[(s["variant"] == "cuda") & (s["params.group"] == "sweep") & (s["status"] == "ok")]
        if len(ours):
            w = ours.loc[ours["metrics.speedup_vs_torch"].astype(float).idxmin()]
            t = find(s, "torch", dtype=w["params.dtype"], cols=w["params.cols"], group="sweep")
            items.append(f"**Thin margins.** The narrowest win over torch.softmax is {ratio(w['metrics.speedup_vs_torch'])} "
                         f"({row_length(w)}), where torch.softmax itself runs at "
                         f"{pct(value(t, 'metrics.pct_of_copy_bandwidth'))} of copy.")
        paras.append(bullets(items, f"On the {s.iloc[0]['hardware_name']}:"))
    return "\n\n".join(paras)
