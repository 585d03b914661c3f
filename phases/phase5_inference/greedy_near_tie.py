"""Greedy tokens of two runs that should agree, compared honestly under batch variance.

Two engine runs that batch rows differently (chunked prefill on and off, a prefix cached or not)
run their 16-bit matmuls and attention over different shapes, which round differently. Where the
best two logits of a step are nearly tied, that rounding can swap them; the greedy token flips and
everything after it follows from a different prefix. That is not a wrong kernel.

So the comparison, sequence by sequence: equal tokens pass. At the first position where they differ
the sequence is replayed (its prompt plus the reference's tokens before that position, one prefill
asking for the top REPLAY_CANDIDATES logprobs). The divergence is a near-tie, and accepted, only when
both runs' tokens there are among the replay's candidates and each is within the dtype's tolerance of
the replay's best logit (logprob differences: the log-softmax shifts every logit by the same amount).
Not only the best two: a bf16 model with 128k logits can have three or more within a few ulps of the
top (an H200 run flipped to a token outside the replay's best two). Later tokens of that sequence
are not compared. Any other divergence fails the check.

The tolerance is NEAR_TIE_ULPS units in the last place of the dtype at a logit of 8, the top of
[4, 8) where the random-weight models' best logits lie (normal(0, 0.02) weights over a unit-RMS
4,096-wide hidden state: logits with std 1.28, the best of 128k about 6). bf16: 0.125, where a
flip needs a margin of the order of bf16's rounding of the hidden state carried into a logit
(~0.01-0.03); a wrong kernel moves logits by their whole spread (~1) and shows up as a divergence
with a clear margin. Real checkpoints' logits are larger (ulps of 0.0625-0.125): there the bound
is stricter than 4 ulps, so it can fail a true tie, never pass a clear divergence. fp32: ~2e-6, in
effect the strict comparison (no flip is expected at fp32).
"""
import torch

NEAR_TIE_ULPS = 4
REPLAY_CANDIDATES = 8                  # logprobs a replay asks for: a near-tie among more than two fits
LOGIT_BINADE_LOW = 4.0                 # the random-weight models' best logits lie in [4, 8)


def tie_tolerance(dtype: str) -> float:
    """The largest margin below the best logit at which a flipped greedy token is accepted, for 'bf16' / 'fp32'."""
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    ulp = torch.finfo(torch_dtype).eps * LOGIT_BINADE_LOW        # eps: the spacing at 1; in [4, 8) it is 4x that
    return NEAR_TIE_ULPS * ulp


def first_difference(reference: list[int], other: list[int]) -> int | None:
    """The first position, over the length both made, where the two token lists differ; None if none."""
    return next((k for k, (a, b) in enumerate(zip(reference, other)) if a != b), None)


def compare_greedy(sequences: list[dict], replay_top, tolerance: float, what: str) -> dict:
    """sequences: {"name", "prompt", "reference", "other"} (token ids); replay_top(prompt + tokens) ->
    [(id, logprob), ...], the best next tokens, best first (at least two). A check dict: passed, reason
    (the first failing sequence), near_ties (one {name, position, margin, tokens} per accepted
    divergence; margin: the best logit minus the lower of the two runs' tokens'), the tolerance, and how
    many sequences were compared."""
    near_ties = []
    for seq in sequences:
        k = first_difference(seq["reference"], seq["other"])
        if k is None:
            continue
        a, b = seq["reference"][k], seq["other"][k]
        top = replay_top(list(seq["prompt"]) + list(seq["reference"][:k]))
        logprob = dict(top)
        best_lp = top[0][1]
        where = f"{seq['name']}'s greedy token {k} differs between {what} ({a} vs {b})"
        if a not in logprob or b not in logprob:
            best = ", ".join(str(t) for t, _ in top[:3])
            return _check(False, f"{where}, not both among a replay's best {len(top)} (best: {best})",
                          near_ties, tolerance, what, len(sequences))
        margin = best_lp - min(logprob[a], logprob[b])
        if margin > tolerance:
            return _check(False, f"{where} at a logit margin of {margin:.4g} below the best (over the near-tie "
                                 f"tolerance {tolerance:.4g})", near_ties, tolerance, what, len(sequences))
        near_ties.append({"name": seq["name"], "position": k, "margin": margin, "tokens": [a, b]})
    return _check(True, None, near_ties, tolerance, what, len(sequences))


def _check(passed: bool, reason: str | None, near_ties: list, tolerance: float, what: str, compared: int) -> dict:
    return {"passed": passed, "reason": reason,
            "reference": f"greedy tokens, {what}; a divergence accepted only at a near-tie at the top (both "
                         f"tokens within {tolerance:.4g} of the best logit in a replay), later tokens of that sequence "
                         "not compared",
            "near_tie_tolerance": tolerance, "sequences_compared": compared,
            "near_tie_divergences": len(near_ties), "near_ties": near_ties}
