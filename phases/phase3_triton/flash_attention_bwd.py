"""Exercise 3.5: flash attention backward, checked against autograd through naive attention and
timed against each SDPA backend's backward.

    lab run phase3.flash_attention_bwd [--param sizes=[4096] --param head_dims=[128]]

The kernels are in flash_attention.py: a preprocess (delta = rowsum(dO * O)), a dK/dV kernel that
owns a block of keys and loops over queries, and a dQ kernel that owns a block of queries and loops
over keys. Both recompute P from the forward's saved row statistics: no N x N matrix is written.
FLOPs by the usual convention: five N² matmuls, 2.5x the forward's 4·B·H·N²·D (halved when causal).
These kernels do seven (S and dP recomputed in both, which avoids atomic adds on dQ), so our TFLOP/s
is comparable with published figures and understates the arithmetic done. On a GPU the exercise
also tunes FlashAttention-2's scheme (the dK/dV kernel adds each key block's dS K into an fp32
dQ by relaxed atomics: five matmuls, four launches) and times whichever of the two is faster;
`metrics.scheme` says which ran. Bytes: Q, K, V, O, dO
and the forward's fp32 LSE read, dQ, dK, dV written, 8·B·H·N·D elements + 4·B·H·N bytes, the same
for every variant. Launches: our backward is 3 kernels; SDPA's are counted from their sources
(counts.py). The check compares dQ, dK and dV of the first and last head with float64 autograd on
the same inputs and dO, and reports the worst of the three.
"""
import math

import torch

from common.checks import CHECK_CHUNK, TORCH_DTYPES, compare
from common.errors import LabError
from common.exercise import Exercise, Needs, Result, Work, measure
from common.params import Bool, Choice, Int
from common.standalone import run_alone
from common.triton_shim import interpreting
from common.triton_tuner import label, tune, tuning_summary
from common.variant_rows import attempt, compare_to_library, skipped

from . import counts
from . import kernel_lists
from . import flash_attention as fa


def reference_grads(q, k, v, do, causal, sm_scale, heads) -> dict:
    """float64 autograd through naive attention, per selected head: {'dq': (len(heads), N, D), ...},
    plus 'dq_terms' and 'dk_terms': sm_scale (P * dP) K and sm_scale (P * dP)^T Q, the products dQ
    and dK are the difference of (dS = P * (dP - delta)). Where that difference cancels (one key: dQ
    and dK are exactly zero) a correct kernel's rounding is measured against these terms."""
    out = {"dq": [], "dk": [], "dv": [], "dq_terms": [], "dk_terms": []}
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    for b, h in heads:
        qq, kk, vv = (x[b, h].double().requires_grad_() for x in (q, k, v))
        o = fa.naive_attention(qq, kk, vv, causal, sm_scale)
        dq, dk, dv = torch.autograd.grad(o, (qq, kk, vv), do[b, h].double())
        out["dq"].append(dq)
        out["dk"].append(dk)
        out["dv"].append(dv)
        with torch.no_grad():
            scores = qq @ kk.transpose(-1, -2) * sm_scale
            if causal:
                n = scores.shape[-1]
                scores.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=scores.device).triu(1), float("-inf"))
            p_dp = torch.softmax(scores, dim=-1) * (do[b, h].double() @ vv.transpose(-1, -2))
            out["dq_terms"].append(sm_scale * p_dp @ kk)
            out["dk_terms"].append(sm_scale * p_dp.transpose(-1, -2) @ qq)
        del qq, kk, vv, o
    return {name: torch.stack(x) for name, x in out.items()}


def check_grads(fill, shape_like, ref: dict, heads, precision: str, which=("dq", "dk", "dv")) -> dict:
    """Poison dQ, dK, dV; `fill(dq, dk, dv)` writes them; compare each selected gradient with the
    float64 reference. The verdict is the worst of them, with every gradient's error attached."""
    grads = {name: torch.full_like(shape_like, float("nan")) for name in ("dq", "dk", "dv")}
    fill(grads["dq"], grads["dk"], grads["dv"])
    if shape_like.is_cuda:
        torch.cuda.synchronize(shape_like.device)
    def verdict(name):
        got = torch.stack([grads[name][b, h] for b, h in heads])
        terms = ref.get(f"{name}_terms")
        if terms is None:
            return compare(got, ref[name], precision, "float64 autograd through naive attention")
        # the same difference, over the gradient and the terms it is the difference of together
        return compare(torch.cat([got.double(), terms]), torch.cat([ref[name], terms]), precision,
                       "float64 autograd through naive attention")
    verdicts = {name: verdict(name) for name in which}
    name, worst = max(verdicts.items(), key=lambda kv: (not kv[1]["passed"], kv[1]["rel_l2_error"] or 0.0))
    out = dict(worst)
    out["reference"] = f"float64 autograd through naive attention ({', '.join(which)}), heads {heads}"
    out["reason"] = None if worst["passed"] else f"{name}: {worst['reason']}"
    out["rel_l2_by_gradient"] = {n: v["rel_l2_error"] for n, v in verdicts.items()}
    return out


backward_bytes = counts.backward_bytes           # Q, K, V, O, dO, LSE read; dQ, dK, dV written
VARIANTS = (*fa.SDPA_BACKENDS, "triton")


def problems(params) -> list[dict]:
    """The user's shapes when given, else the sweep at a fixed token count and model width."""
    if params.get("shapes"):
        return [{k: v for k, v in p.items() if k != "group"} for p in fa.user_problems(params)]
    return [{"n": n, "batch": max(1, params["tokens"] // n), "heads": max(1, params["model_dim"] // d),
             "head_dim": d, "dtype": dtype, "causal": causal}
            for dtype in params["dtypes"] for d in params["head_dims"] for causal in params["causal"]
            for n in params["sizes"]]


def work(params) -> list[Work]:
    """Every row run() would time (an SDPA backend that refuses the inputs is skipped at run time)."""
    return [Work(f"{variant} {p['dtype']} d={p['head_dim']} causal={p['causal']} n={p['n']} {p['batch']}x{p['heads']}",
                 c.flops, c.bytes, c.dtype, launches=c.launches)
            for p in problems(params) for variant in VARIANTS
            for c in [counts.backward_count(variant, p["batch"], p["heads"], p["n"], p["head_dim"], p["dtype"], p["causal"])]]


def problem_footprint(p: dict) -> int:
    """Device bytes one problem holds at once (see footprint_bytes)."""
    b, h, n, d = p["batch"], p["heads"], p["n"], p["head_dim"]
    s, bhnd, k = TORCH_DTYPES[p["dtype"]].itemsize, b * h * n * d, len(fa.check_heads(b, h))
    held = 4 * s * bhnd + 3 * 8 * k * n * d             # q, k, v, dO; float64 dQ, dK, dV of k heads
    reference = 4 * 8 * n * n + 2 * n * n + 8 * 8 * n * d   # one head's float64 autograd: P, dP and temporaries
    rows = 10 * s * bhnd + 2 * 4 * b * h * n + 3 * 8 * min(k * n * d, CHECK_CHUNK)   # SDPA: clones, O, grads twice
    return held + max(reference, rows)


def footprint_bytes(p: dict) -> int:
    """Largest problem: q, k, v, dO, the library's or our O and gradients, float64 autograd of the checked heads."""
    return max(problem_footprint(x) for x in problems(p))


def run(ctx, params):
    rows, tuning = [], {}
    p_all = problems(params)
    for p in ctx.track(p_all, "attention backward problems"):
        t = TORCH_DTYPES[p["dtype"]]
        b, h, n, d, causal = p["batch"], p["heads"], p["n"], p["head_dim"], p["causal"]
        g = torch.Generator(device=ctx.device).manual_seed(n * 1000 + d + 7)
        q, k, v, do = (torch.randn(b, h, n, d, device=ctx.device, generator=g).to(t) for _ in range(4))
        sm_scale = 1.0 / math.sqrt(d)
        heads = fa.check_heads(b, h)
        ref = reference_grads(q, k, v, do, causal, sm_scale, heads)
        precision = fa.PRECISION[t]
        def cost(variant):                        # one problem: the same FLOPs, bytes and dtype for every variant
            c = counts.backward_count(variant, b, h, n, d, p["dtype"], causal)
            return {"flops": c.flops, "bytes_moved": c.bytes, "dtype": c.dtype, "launches": c.launches}

        here = []
        timing = None if ctx.quick else {"target_ms": 100.0}   # many rows: 100 ms of samples each

        def sdpa_row(variant):
            why = fa.sdpa_unsupported(variant, q, k, v, causal)
            if why:
                return skipped(variant, p, why)
            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
            with fa.sdpa_context(variant):
                try:
                    out = fa.sdpa(qg, kg, vg, causal)
                    torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)
                except RuntimeError as exc:           # a backend whose forward runs but backward does not
                    return skipped(variant, p, f"backward unavailable: {str(exc).splitlines()[0][:160]}")

                def grad():
                    return torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)

                def fill(dq, dk, dv):
                    for dst, src in zip((dq, dk, dv), grad()):
                        dst.copy_(src)

                try:
                    return measure(ctx, variant, p, fn=grad, check=lambda: check_grads(fill, q, ref, heads, precision),
                                   timing=timing, **cost(variant))
                except RuntimeError as exc:           # a library path that refuses this size: not our failure
                    return skipped(variant, p, f"{fa.SDPA_BACKENDS[variant]} raised: {str(exc).splitlines()[0][:160]}")

        def triton_row():
            fwd_cfg = fa._WINNERS.get((d, causal, n)) if t == torch.bfloat16 else None   # tuned by 3.4 in this run
            o, lse = fa.attention_forward(q, k, v, causal, sm_scale, fwd_cfg or fa.fallback_forward_config(d))
            picked = {}
            rule = fa.backward_config(d, causal, n, b * h, **fa.gpu_limits(ctx.device))
            for part, cands in (("dkdv", fa.dkdv_candidates(d, rule["dkdv"])), ("dq", fa.dq_candidates(d, rule["dq"]))):
                cands = [fa.INTERPRETER_BWD[part]] if interpreting() else cands
                which = ("dk", "dv") if part == "dkdv" else ("dq",)

                def cfg_for(c, part=part):                # only this part's kernel runs while tuning
                    return {part: c}

                picked[part], trials = tune(
                    ctx, ("attn_bwd", part, p["dtype"], b, h, n, d, causal, ctx.device.type), cands,
                    launch=lambda c, part=part: fa.attention_backward(q, k, v, o, lse, do, causal, sm_scale,
                                                                      cfg_for(c), parts=(part,)),
                    check=lambda c, part=part, which=which: check_grads(
                        lambda dq, dk, dv: fa.attention_backward(q, k, v, o, lse, do, causal, sm_scale, cfg_for(c),
                                                                 grads=(dq, dk, dv), parts=(part,)),
                        q, ref, heads, precision, which))
                tuning[f"{part} {p['dtype']} d={d} causal={causal} n={n}"] = tuning_summary(trials)
            cfg = {"dkdv": picked["dkdv"], "dq": picked["dq"]}
            scheme = "two kernels: dK/dV over queries, dQ over keys (7 matmuls)"
            if not interpreting():                    # FlashAttention-2's atomic dQ (5 matmuls): the faster one runs
                try:
                    atomic, trials = tune(
                        ctx, ("attn_bwd", "atomic", p["dtype"], b, h, n, d, causal, ctx.device.type),
                        [{"atomic": c} for c in fa.atomic_candidates(d)],
                        launch=lambda c: fa.attention_backward(q, k, v, o, lse, do, causal, sm_scale, c),
                        check=lambda c: check_grads(
                            lambda dq, dk, dv: fa.attention_backward(q, k, v, o, lse, do, causal, sm_scale, c,
                                                                     grads=(dq, dk, dv)), q, ref, heads, precision))
                    tuning[f"atomic {p['dtype']} d={d} causal={causal} n={n}"] = tuning_summary(trials)
                except LabError as exc:               # no atomic config ran correctly: the two kernels it is
                    tuning[f"atomic {p['dtype']} d={d} causal={causal} n={n}"] = str(exc)[:400]
                    atomic = None

                def whole_ms(c):
                    return ctx.time(lambda: fa.attention_backward(q, k, v, o, lse, do, causal, sm_scale, c),
                                    warmup_ms=5.0, target_ms=25.0, min_samples=5, max_samples=50).median_ms
                if atomic is not None and whole_ms(atomic) < whole_ms(cfg):
                    cfg, scheme = atomic, "one kernel: dK/dV over queries, dQ added by fp32 atomics (5 matmuls)"
            costs = cost("triton")
            if "atomic" in cfg:                       # delta, zeroing the fp32 dQ, the kernel, its copy out
                costs["launches"] = 4
            r = measure(ctx, "triton", p,
                        fn=lambda: fa.attention_backward(q, k, v, o, lse, do, causal, sm_scale, cfg),
                        check=lambda: check_grads(
                            lambda dq, dk, dv: fa.attention_backward(q, k, v, o, lse, do, causal, sm_scale, cfg,
                                                                     grads=(dq, dk, dv)),
                            q, ref, heads, precision), timing=timing, **costs)
            r["metrics"]["config"] = (f"atomic: {label(cfg['atomic'])}" if "atomic" in cfg else
                                      f"dkdv: {label(cfg['dkdv'])}; dq: {label(cfg['dq'])}")
            r["metrics"]["scheme"] = scheme
            r["metrics"]["rule_config"] = f"dkdv: {label(rule['dkdv'])}; dq: {label(rule['dq'])}"   # untuned
            return r

        for variant in fa.SDPA_BACKENDS:
            if ctx.wants(variant):
                here.append(attempt(variant, p, lambda variant=variant: sdpa_row(variant)))
        if ctx.wants("triton"):
            here.append(attempt("triton", p, triton_row))
        for r in here:
            r["metrics"]["flops_formula"] = "2.5 · 4·B·H·N²·D" + (" / 2 (causal)" if causal else "")
            r["metrics"]["bytes_formula"] = "8·B·H·N·D·bytes + 4·B·H·N (Q, K, V, O, dO, fp32 LSE read; dQ, dK, dV written)"
        compare_to_library(here, "triton", tuple(fa.SDPA_BACKENDS), "tflops")
        rows += here
    return Result(rows, {"tuning": tuning,
                         "flops_convention": "2.5 x the forward's 4·B·H·N²·D (five N² matmuls), halved when causal",
                         "launches": {v: counts.backward_launches(v) for v in VARIANTS}})


EXERCISE = Exercise(
    id="phase3.flash_attention_bwd",
    title="Flash attention backward: dQ, dK, dV vs autograd, timed against SDPA's backward",
    run=run, needs=Needs(cuda=True, modules=("triton",)),
    params={"sizes": Int([1024, 4096, 16384], min=1, many=True, unit="tokens N"),
            "dtypes": Choice(["bf16"], ("bf16", "fp16"), many=True),
            "head_dims": Int([128, 64], choices=fa.EXERCISE_HEAD_DIMS, many=True, unit="head dim D"),
            "causal": Bool([False, True], many=True),
            "tokens": Int(16384, min=1, unit="tokens per problem (B = tokens // N, at least 1)"),
            "model_dim": Int(2048, min=1, unit="H x D (H = model_dim // D, at least 1)"),
            # A user's own sizes: replaces the sweep (dtypes and causal still apply)
            "shapes": Int(None, min=1, many=True, length=4, also=(None,), rule=fa.shape_rule,
                          unit="B, H, N, D: your own shapes (replaces the sweep)")},
    cpu_params={"sizes": [256], "dtypes": ["fp16"], "head_dims": [64], "causal": [True], "tokens": 256,
                "model_dim": 128},
    quick_params={"sizes": [1024], "head_dims": [128], "causal": [True], "tokens": 2048, "model_dim": 256},
    variants=VARIANTS, footprint_bytes=footprint_bytes, work=work,
    workloads=lambda p: kernel_lists.backward_workloads(problems(p), VARIANTS))


if __name__ == "__main__":
    run_alone(EXERCISE, {"sizes": [200], "dtypes": ["fp16"], "head_dims": [32], "causal": [True], "tokens": 200,
                         "model_dim": 64})
