"""Speculative decoding's speedup predicted from the summed model, before the run's own part timings:
E[tokens per verify] x t_target / t_speculative_step, each step time the sum of its kernels
(kernel_lists.decode_step and speculative_step at the machine's phase1.ceilings), E[tokens] from
the row's measured acceptance rate (an input, as the draft's quality is: the model does not predict
it) by kernel_lists.expected_tokens_per_verify (1 + acceptance x proposals per verify). Beside it the measured speedup and the exercise's own
prediction (from its measured part times, metrics.predicted_speedup).

    python -m phases.phase5_inference.predictions.speculative_speedup [--results DIR]

Torch-free.
"""
import argparse

from common import workload
from common.calibration import ceilings_for
from common.hardware import load_hardware

from . import kernel_lists as kl
from .analysis import mean_decode_context


def speedup_rows(records: list[dict]) -> list[dict]:
    """One dict per ok draft row of the newest measured "lab" speculative record of each GPU."""
    newest: dict = {}
    for rec in records:
        if rec["exercise"]["id"] == "phase5.speculative" and rec.get("source", {}).get("kind", "measured") == "measured" \
                and (rec.get("params") or {}).get("models") == "lab":
            newest[rec["hardware"]["key"]] = rec            # records come oldest first
    specs, out = load_hardware(), []
    for hw, rec in sorted(newest.items()):
        ceilings = ceilings_for(records, hw, rec["provenance"].get("started_utc"))
        if not ceilings:
            continue
        fp32 = specs[hw].peak("fp32").value if hw in specs else None
        for r in rec["rows"]:
            p, m = r["params"], r["metrics"]
            if r["status"] != "ok" or r["variant"] == "target" or m.get("acceptance_rate") is None:
                continue
            c, k = p["concurrency"], p["k"]
            context = mean_decode_context(p["prompt_tokens"], p["output_tokens"])
            draft = None if r["variant"] == "ngram" else kl.SPECULATIVE_SHAPES[r["variant"]]
            step = kl.speculative_step(kl.SPECULATIVE_TARGET, draft, c, k, context,
                                       m.get("proposed_per_verify") if draft is None else None)
            t_step = workload.predict(step, ceilings, fp32)["predicted_ms"]
            t_target = workload.predict(kl.decode_step(kl.SPECULATIVE_TARGET, c, context), ceilings, fp32)["predicted_ms"]
            proposed = k if draft is not None else m.get("proposed_per_verify") or k
            tokens = kl.expected_tokens_per_verify(m["acceptance_rate"], proposed)
            predicted = tokens * t_target / t_step
            out.append({"hardware": hw, "variant": r["variant"], "temperature": p["temperature"], "concurrency": c,
                        "k": k, "acceptance": m["acceptance_rate"], "expected_tokens": tokens,
                        "measured_tokens": m.get("tokens_per_verify"), "measured_speedup": m["speedup_vs_target"],
                        "summed_speedup": predicted, "parts_speedup": m.get("predicted_speedup"),
                        "measured_over_summed": m["speedup_vs_target"] / predicted})
    return out


def main(argv: list[str] | None = None) -> int:
    import statistics

    from common.paths import results_dir
    from common.records import is_smoke, load_records
    p = argparse.ArgumentParser(prog="python -m phases.phase5_inference.predictions.speculative_speedup",
                                description=__doc__.split("\n")[0])
    p.add_argument("--results", help="results folder (default: results/)")
    args = p.parse_args(argv)
    rows = speedup_rows([r for r in load_records(results_dir(args.results)) if not is_smoke(r)])
    print(f"{'hw':9} {'variant':10} {'T':>4} {'c':>3} {'k':>2} {'accept':>6} {'E[tok]':>6} {'tok':>5} "
          f"{'measured':>8} {'summed':>7} {'parts':>6} {'meas/sum':>8}")
    for r in rows:
        print(f"{r['hardware']:9} {r['variant']:10} {r['temperature']:4} {r['concurrency']:3} {r['k']:2} "
              f"{r['acceptance']:6.3f} {r['expected_tokens']:6.2f} {r['measured_tokens'] or 0:5.2f} "
              f"{r['measured_speedup']:8.3f} {r['summed_speedup']:7.3f} {r['parts_speedup'] or 0:6.3f} "
              f"{r['measured_over_summed']:8.3f}")
    if rows:
        err = [abs(r["measured_over_summed"] - 1) for r in rows]
        within = sum(e <= 0.15 for e in err)
        print(f"\n{len(rows)} rows: median abs(measured/summed - 1) {100 * statistics.median(err):.1f}%, "
              f"{within} within 15%, worst {100 * max(err):.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
