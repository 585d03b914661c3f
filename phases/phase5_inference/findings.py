"""Phase 5's findings: sentences whose every number comes from the newest records per GPU."""
from common.formats import num, pct, ratio
from common.frame import by_hardware, find, value

from . import seed


def findings(view) -> str:
    out = []
    for _, got in sorted(by_hardware(view.frame, ["phase5.startup", "phase5.ttft_decode", "phase5.batching",
                                                  "phase5.offline"]).items()):
        parts = []
        d = got.get("phase5.ttft_decode")
        mine = find(d, "lab-engine", model="llama-3.1-8b")
        comp = find(d, "pytorch-compile", model="llama-3.1-8b")
        eager = find(d, "pytorch-eager", model="llama-3.1-8b")
        name = next(iter(got.values())).iloc[0]["hardware_name"]
        if mine is not None:
            parts.append(f"Batch-1 decode of the 8B shape reads {num(mine['metrics.bytes_per_token'] / 1e9)} GB a token; "
                         f"the engine streams it at {num(mine['metrics.gbps'])} GB/s, "
                         f"{pct(mine['metrics.pct_of_copy_roofline'])} of the {num(mine['metrics.copy_gbps'])} GB/s copy "
                         f"bandwidth of the same run ({num(mine['metrics.decode_tok_s'])} tok/s)"
                         + (f"; plain PyTorch reaches {pct(value(eager, 'metrics.pct_of_copy_roofline'))} eager"
                            if eager is not None else "")
                         + (f" and {pct(value(comp, 'metrics.pct_of_copy_roofline'))} under torch.compile"
                            if comp is not None else "") + ".")
        big = d[(d["variant"] == "lab-engine") & (d["params.model"] == "llama-3.3-70b")] if d is not None else []
        if len(big):
            big = big.iloc[0]
            if big["status"] == "ok":
                parts.append(f"The 70B shape fits one GPU with {num(value(big, 'metrics.kv_pool_gib'))} GiB left for KV "
                             f"({value(big, 'metrics.kv_capacity_tokens'):,.0f} tokens) and decodes at "
                             f"{num(big['metrics.decode_tok_s'])} tok/s, {pct(big['metrics.pct_of_copy_roofline'])} of its "
                             f"roofline (the seed needed two A100s and kept {seed.KV_LEFT_70B_TP2_GIB} GiB, {seed.CITATION}).")
            else:
                parts.append(f"The 70B shape: {big['reason']}.")
        b = got.get("phase5.batching")
        if b is not None:
            ok = b[b["status"] == "ok"]
            eight, one = find(ok, concurrency=8), find(ok, concurrency=1)
            if eight is not None and one is not None:
                parts.append(f"Eight concurrent requests give {ratio(value(eight, 'metrics.x_output_tok_s_vs_1'))} the "
                             f"output of one at {ratio(value(eight, 'metrics.tpot_vs_1'))} its TPOT: decode reads the "
                             "weights once per step, whoever shares it.")
            if len(ok):
                best = ok.loc[ok["metrics.output_tok_s"].idxmax()]
                parts.append(f"The sweep peaks at concurrency {int(best['params.concurrency'])} with "
                             f"{num(best['metrics.output_tok_s'])} tok/s, {pct(best['metrics.pct_of_predicted_tok_s'])} of "
                             f"its prediction; the spec-sheet ridge is at a batch of about "
                             f"{num(value(best, 'summary.ridge_batch_spec'))}.")
        if parts:
            out.append(f"**{name}.** " + " ".join(parts))
    return "\n\n".join(out)
