"""Greedy tokens of two runs that should agree, compared honestly under batch variance.

Two engine runs that batch rows differently (chunked prefill on and off, a prefix cached or not)
run their 16-bit matmuls and attention over different shapes, which round differently. Where the
best logits of a step are nearly tied, that rounding can swap them; the greedy token flips and
everything after it follows from a different prefix. That is not a wrong kernel.

So the comparison, sequence by sequence: equal tokens pass. At the first position where they differ
the sequence is replayed (its prompt plus the reference's tokens before that position, one prefill
asking for the top REPLAY_CANDIDATES logprobs), once under the reference's setting and, where the
caller gives one, once under the other run's setting. The divergence is a near-tie, and accepted,
only when both runs' tokens there are among the reference replay's candidates and each is within
this divergence's tolerance of that replay's best logit (logprob differences: the log-softmax shifts
every logit by the same amount). Not only the best two: a bf16 model with 128k logits can have three
or more within a few ulps of the top. Later tokens of that sequence are not compared. Any other
divergence fails the check.

The tolerance is measured, not guessed. A fixed 4 bf16 ulps (0.125 at a logit of 8) failed an H200
run: a stream flipped at a margin of 0.156, and nothing said whether that was rounding or a bug. Now
the two replays measure the rounding noise itself at the divergent position: the largest
|logprob under one setting - logprob under the other| over the candidates both replays list. (A
logprob is the logit minus the log-sum-exp, and the log-sum-exp moves too, by the probability-weighted
mean of the logits' moves: a logprob difference is a logit's noise less that mean, so it measures the
noise only approximately.) A flip of tokens a and b needs the noise in lp_a - lp_b to exceed their
margin, and that noise is at most the sum of the two tokens' noises: so the tolerance is
NOISE_FACTOR = 2 times the measured noise, never below the static floor tie_tolerance(dtype). The
replays reproduce each setting, not the runs' exact batches (they run one sequence), so the noise is
a sample of the rounding's size at that position, not the runs' own; two replays may even round
alike and measure 0 where the runs' shapes did not, and then the floor alone applies (a check that
can fail a true tie, never pass a clear divergence).

A wrong kernel must not inflate its own tolerance: if the measured noise exceeds
noise_cap(floor) = NOISE_CAP_OVER_FLOOR x the floor (bf16: 0.5, 16 ulps at a logit of 8), the check
fails, saying the two settings move the logits by that much at this position, which is not rounding.
Rounding is of the order of the floor (the H200 run's flips, margins up to 0.156, need a noise of
~0.08 per token); a wrong kernel (chunked prefill corrupting a later chunk's KV, a cached block read
from the wrong place) moves logits by their whole spread (~1 for the random-weight models, std 1.28).
The cap sits between, so the tolerance never exceeds 2 x the cap and any divergence it accepts is
one the measured noise at that very position explains.

The floor is NEAR_TIE_ULPS units in the last place of the dtype at a logit of 8, the top of [4, 8)
where the random-weight models' best logits lie (normal(0, 0.02) weights over a unit-RMS 4,096-wide
hidden state: logits with std 1.28, the best of 128k about 6). Real checkpoints' logits are larger
and round coarser: there the floor and the cap are stricter than their ulps, so they can fail a true
tie, never pass a clear divergence. fp32: the floor is ~2e-6 and the cap ~8e-6, in effect the strict
comparison (no flip is expected at fp32).
"""
import math

import torch

NEAR_TIE_ULPS = 4
REPLAY_CANDIDATES = 8                  # logprobs a replay asks for: a near-tie among more than two fits
LOGIT_BINADE_LOW = 4.0                 # the random-weight models' best logits lie in [4, 8)
NOISE_FACTOR = 2.0                     # a swap of a and b needs noise(lp_a - lp_b) <= noise(a) + noise(b)
NOISE_CAP_OVER_FLOOR = 4.0             # measured noise above 4 floors (bf16: 0.5) is not rounding


def tie_tolerance(dtype: str) -> float:
    """The static floor of the near-tie tolerance (largest margin below the best logit at which a
    flipped greedy token is accepted without a measured noise), for 'bf16' / 'fp16' / 'fp32'."""
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    ulp = torch.finfo(torch_dtype).eps * LOGIT_BINADE_LOW        # eps: the spacing at 1; in [4, 8) it is 4x that
    return NEAR_TIE_ULPS * ulp


def noise_cap(floor: float) -> float:
    """The largest measured noise still taken for rounding; above it the two settings disagree."""
    return NOISE_CAP_OVER_FLOOR * floor


def measured_noise(top: list[tuple[int, float]], other_top: list[tuple[int, float]]) -> float:
    """The largest |logprob difference| between two replays over the tokens both list; inf if none."""
    other = dict(other_top)
    return max((abs(lp - other[t]) for t, lp in top if t in other), default=math.inf)


def first_difference(reference: list[int], other: list[int]) -> int | None:
    """The first position, over the length both made, where the two token lists differ; None if none."""
    return next((k for k, (a, b) in enumerate(zip(reference, other)) if a != b), None)


def compare_greedy(sequences: list[dict], replay_top, tolerance: float, what: str, replay_other=None) -> dict:
    """sequences: {"name", "prompt", "reference", "other"} (token ids); replay_top(prompt + tokens) ->
    [(id, logprob), ...], the best next tokens, best first (at least two), under the reference's setting;
    replay_other the same under the other run's setting (None: no noise measured, the floor applies).
    tolerance: the floor (tie_tolerance). Every divergence is replayed under the reference's setting
    first, then under the other's (a caller holding one engine at a time builds each once).
    A check dict: passed, reason (the first failing sequence), near_ties (one {name, position, margin,
    noise, tolerance, tokens} per accepted divergence; margin: the best logit minus the lower of the two
    runs' tokens'; noise: measured_noise, None without replay_other; tolerance: the one applied), the
    floor as near_tie_tolerance, the noise factor and cap, and how many sequences were compared."""
    divergences = []
    for seq in sequences:
        k = first_difference(seq["reference"], seq["other"])
        if k is not None:
            divergences.append((seq, k, list(seq["prompt"]) + list(seq["reference"][:k])))
    tops = [replay_top(tokens) for _, _, tokens in divergences]
    others = [replay_other(tokens) for _, _, tokens in divergences] if replay_other else [None] * len(tops)
    near_ties = []
    for (seq, k, _), top, other_top in zip(divergences, tops, others):
        tie, reason = judge_divergence(seq, k, top, other_top, tolerance, what)
        if reason:
            return _check(False, reason, near_ties, tolerance, what, len(sequences))
        near_ties.append(tie)
    return _check(True, None, near_ties, tolerance, what, len(sequences))


def judge_divergence(seq: dict, k: int, top: list, other_top: list | None, floor: float,
                     what: str) -> tuple[dict | None, str | None]:
    """(the near-tie record, None) for a divergence at position k that rounding explains, else (None, reason)."""
    a, b = seq["reference"][k], seq["other"][k]
    logprob = dict(top)
    where = f"{seq['name']}'s greedy token {k} differs between {what} ({a} vs {b})"
    if a not in logprob or b not in logprob:
        best = ", ".join(str(t) for t, _ in top[:3])
        return None, f"{where}, not both among a replay's best {len(top)} (best: {best})"
    noise = None if other_top is None else measured_noise(top, other_top)
    if noise is not None and noise > noise_cap(floor):
        moved = (f"by {noise:.4g}" if math.isfinite(noise)
                 else f"so far that no token of their best {len(top)} is shared")
        return None, (f"{where}: a replay under each setting moves the logits {moved} at this position, "
                      f"over the {noise_cap(floor):.4g} rounding can explain: not rounding")
    tolerance = floor if noise is None else max(floor, NOISE_FACTOR * noise)
    margin = top[0][1] - min(logprob[a], logprob[b])
    if margin > tolerance:
        measured = "" if noise is None else f", {NOISE_FACTOR:g} x the measured noise {noise:.4g}"
        return None, (f"{where} at a logit margin of {margin:.4g} below the best (over the near-tie "
                      f"tolerance {tolerance:.4g}: the floor {floor:.4g}{measured})")
    return {"name": seq["name"], "position": k, "margin": margin, "noise": noise, "tolerance": tolerance,
            "tokens": [a, b]}, None


def _check(passed: bool, reason: str | None, near_ties: list, floor: float, what: str, compared: int) -> dict:
    return {"passed": passed, "reason": reason,
            "reference": f"greedy tokens, {what}; a divergence accepted only at a near-tie at the top (both "
                         f"tokens within max({floor:.4g}, {NOISE_FACTOR:g} x the noise a replay under each setting "
                         f"measures there) of the best logit, a noise over {noise_cap(floor):.4g} failing), later "
                         "tokens of that sequence not compared",
            "near_tie_tolerance": floor, "near_tie_noise_factor": NOISE_FACTOR,
            "near_tie_noise_cap": noise_cap(floor), "sequences_compared": compared,
            "near_tie_divergences": len(near_ties), "near_ties": near_ties}
