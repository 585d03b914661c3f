"""Exercise 5.2: decode attention over the paged KV cache, the engine's own kernel against a gather.

    lab run phase5.decode_attention [--param batches=[1,256] --param contexts=[4096]]

One decode step of one layer: every sequence's single new query token attends to its cached
tokens, which sit in 16-token blocks scattered through the pool and are found through its block
table (engine/paged_attention.py has the layout). Llama-3.1-8B's attention: 32 query heads
sharing 8 KV heads (GQA), head_dim 128, bf16. Each sequence's length is drawn around the nominal
context (within an eighth of it), so every row has partial last blocks, and the blocks of the pool
are shuffled, so no sequence is contiguous.

Variants, each checked against the fp32 reference (per sequence: gather its blocks, SDPA) first:
  triton        the engine's kernel with the engine's own choices (tile, splits of the context)
  flex          torch's FlexAttention, compiled, reading the pool through a block-table BlockMask
  gather_sdpa   the baseline: gather every sequence's blocks into a padded [batch, L] K and V,
                then one masked SDPA call, a KV head's query heads as its query rows (what
                paging costs without a paged kernel)
Counts, the same for every variant (one problem): bytes = the K and V of every cached token read
once, plus q read and the output written; FLOPs = 4 x heads x head_dim per cached token (QK^T and
PV). At ~1 FLOP/byte per KV head group this is memory-bound: the roofline is the KV bytes over the
bandwidth. The gather's own traffic (writing and re-reading the padded copy) is its algorithm_bytes.
Every variant is timed as a CUDA-graph replay of one call with L2 flushed before it (the engine
decodes from graphs; eager timing of a 20 µs kernel measures Python's launch overhead instead);
a variant that cannot be captured is timed eagerly and its row says so. The triton row also checks
a graph replay's output, and the summary lists the tile and split alternatives timed beside the
engine's choice.
"""
import math

import torch
import torch.nn.functional as F

from common.checks import CHECK_CHUNK, TORCH_DTYPES
from common.exercise import Exercise, Needs, Result, Work, against_baseline, measure, reference_check
from common.params import Bool, Choice, Int
from common.standalone import run_alone
from common.triton_shim import interpreting
from common.triton_tuner import label
from common.variant_rows import attempt, skipped

from .engine import SHAPES, named
from .engine import paged_attention as attn
from .predictions import kernel_lists

REFERENCE = "fp32 SDPA per sequence on its gathered blocks (engine.paged_attention reference)"
LENGTH_SPREAD = 8                  # each sequence's length is within context / LENGTH_SPREAD of the nominal
SPARE_BLOCKS = 7                   # pool blocks no sequence owns (stale data a wrong index would read)


# ------------------------------------------------------------------------------ the problem
def context_lengths(batch: int, context: int) -> list[int]:
    """Seeded, so work() and run() agree: lengths uniform in context ± context // LENGTH_SPREAD."""
    g = torch.Generator().manual_seed(batch * 100_003 + context)
    spread = context // LENGTH_SPREAD
    return (context + torch.randint(-spread, spread + 1, (batch,), generator=g)).clamp(min=1).tolist()


def blocks_of(n_tokens: int, block_size: int) -> int:
    return -(-n_tokens // block_size)


def problems(params) -> list[dict]:
    shape = named(params["model"])
    out = []
    for context in params["contexts"]:
        for batch in params["batches"]:
            out.append({"model": shape.name, "batch": batch, "context": context, "heads": shape.num_attention_heads,
                        "kv_heads": shape.num_key_value_heads, "head_dim": shape.head_dim,
                        "block_size": params["block_size"], "dtype": params["dtype"]})
    return out


def kv_tokens(p: dict) -> int:
    return sum(context_lengths(p["batch"], p["context"]))


def problem_bytes(p: dict) -> int:
    """K and V of every cached token read once, q read, the output written."""
    item = TORCH_DTYPES[p["dtype"]].itemsize
    return (2 * kv_tokens(p) * p["kv_heads"] + 2 * p["batch"] * p["heads"]) * p["head_dim"] * item


def problem_flops(p: dict) -> int:
    return 4 * p["heads"] * p["head_dim"] * kv_tokens(p)


def gather_bytes(p: dict) -> int:
    """What the baseline moves: the problem's bytes, plus the padded copy of K and V written and read."""
    item = TORCH_DTYPES[p["dtype"]].itemsize
    padded = p["batch"] * blocks_of(max(context_lengths(p["batch"], p["context"])), p["block_size"]) * p["block_size"]
    return problem_bytes(p) + 2 * 2 * padded * p["kv_heads"] * p["head_dim"] * item


BYTES_FORMULA = "(2·tokens·kv_heads + 2·batch·heads)·head_dim·bytes (K, V of each cached token; q; out)"
FLOPS_FORMULA = "4·heads·head_dim·tokens (QK^T and PV for every cached token)"
LAUNCHES = {"gather_sdpa": 6, "flex": 12}          # index, copies, mask and SDPA; flex: the mask's ops and 2 kernels


def triton_launches(splits: int) -> int:
    """The kernel, and the combine when the context is split."""
    return 1 if splits == 1 else 2


def engine_splits(p: dict, sms: int) -> int:
    """The split count the engine picks for this problem (block table as wide as the longest sequence)."""
    max_blocks = blocks_of(max(context_lengths(p["batch"], p["context"])), p["block_size"])
    return attn.choose_num_splits(p["batch"], p["kv_heads"], max_blocks * p["block_size"], sms)


def predicted_sms() -> int:
    """For work(), which has no context: this GPU's SMs, else the H200's from hardware.yaml."""
    if torch.cuda.is_available():
        return attn.sm_count(torch.device("cuda"))
    from common.hardware import load_hardware
    return int(load_hardware()["h200_sxm"].figure("sm_count").value)


def problem_work(p: dict, sms: int) -> list[Work]:
    out = []
    for variant in ("gather_sdpa", "triton", "flex"):
        launches = triton_launches(engine_splits(p, sms)) if variant == "triton" else LAUNCHES[variant]
        out.append(Work(f"{variant} batch={p['batch']} context~{p['context']}", problem_flops(p), problem_bytes(p),
                        p["dtype"], launches=launches))
    return out


def work(params) -> list[Work]:
    sms = predicted_sms()
    return [w for p in problems(params) for w in problem_work(p, sms)]


def predicted_workloads(params) -> list:
    """`lab predict`'s summed rows: the Triton kernel's calls from their counts (kernel_lists)."""
    sms = predicted_sms()
    return kernel_lists.stored_count_workloads(
        EXERCISE.id, [(w, {"head_dim": p["head_dim"]}) for p in problems(params) for w in problem_work(p, sms)])


def footprint_bytes(params) -> int:
    """Largest problem: the pool (K and V), the baseline's padded copies and fp32 scores, outputs."""
    most = 0
    for p in problems(params):
        item = TORCH_DTYPES[p["dtype"]].itemsize
        pool = 2 * (blocks_of(kv_tokens(p), p["block_size"]) + p["batch"] + SPARE_BLOCKS) * p["block_size"]
        padded = p["batch"] * blocks_of(max(context_lengths(p["batch"], p["context"])), p["block_size"]) * p["block_size"]
        row = p["kv_heads"] * p["head_dim"] * item
        scores = 3 * 4 * p["batch"] * p["heads"] * padded // p["batch"]
        most = max(most, pool * row + 2 * padded * row + scores + 8 * p["batch"] * p["heads"] * p["head_dim"] * 4
                   + min(CHECK_CHUNK, p["batch"] * p["heads"] * p["head_dim"]) * 8 * 3)
    return most


def make_inputs(p: dict, device: torch.device):
    """q, the pool's K and V (shuffled blocks, spare ones holding stale data), block tables whose
    entries past a sequence's blocks point at other blocks, and the context lengths."""
    lengths = context_lengths(p["batch"], p["context"])
    bs, kvh, d, dtype = p["block_size"], p["kv_heads"], p["head_dim"], TORCH_DTYPES[p["dtype"]]
    owned = [blocks_of(n, bs) for n in lengths]
    pool = sum(owned) + SPARE_BLOCKS
    g = torch.Generator().manual_seed(p["batch"] * 7919 + p["context"])
    order = torch.randperm(pool, generator=g)
    tables = torch.randint(0, pool, (p["batch"], max(owned)), generator=g, dtype=torch.int32)
    start = 0
    for b, n in enumerate(owned):
        tables[b, :n] = order[start:start + n].to(torch.int32)
        start += n
    dg = torch.Generator(device=device).manual_seed(p["batch"] * 31 + p["context"])
    q = torch.randn(p["batch"], p["heads"], d, device=device, generator=dg).to(dtype)
    k_cache = torch.randn(pool, bs, kvh, d, device=device, generator=dg).to(dtype)
    v_cache = torch.randn(pool, bs, kvh, d, device=device, generator=dg).to(dtype)
    return q, k_cache, v_cache, tables.to(device), torch.tensor(lengths, dtype=torch.int32, device=device)


def gather_sdpa(q, k_cache, v_cache, block_tables, context_lens, scale: float) -> torch.Tensor:
    """The baseline: a padded copy of every sequence's K and V, then one masked SDPA call in which
    each KV head's group of query heads are the query rows (GQA without repeating K and V)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    length = block_tables.shape[1] * block_size
    k = k_cache[block_tables.long()].view(batch, length, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache[block_tables.long()].view(batch, length, num_kv_heads, head_dim).transpose(1, 2)
    mask = (torch.arange(length, device=q.device)[None, :] < context_lens[:, None])[:, None, None, :]
    groups = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(groups, k, v, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def triton_candidates(p: dict, splits: int) -> list[dict]:
    """The engine's choice first, then tiles, warps and split counts around it."""
    base = {**attn.default_config(p["head_dim"]), "splits": splits}
    out = [base]
    for change in ({"BLOCK_N": 32}, {"BLOCK_N": 128}, {"num_warps": 8}, {"num_stages": 3},
                   {"splits": splits * 2}, {"splits": max(1, splits // 2)}, {"splits": 1}):
        cfg = {**base, **change}
        if cfg not in out and cfg["splits"] <= attn.MAX_SPLITS:
            out.append(cfg)
    return out


def graph_replay_check(ctx, fn, out: torch.Tensor, ref: torch.Tensor, precision: str) -> dict:
    """Capture fn (which writes `out`) in a CUDA graph, replay it on a poisoned output, compare."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()                                            # compiled and warm before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return reference_check(ctx, out, graph.replay, ref, REFERENCE, precision=precision)()


def measure_as_engine(ctx, params, variant: str, size: dict, fn, check, cost: dict) -> dict:
    """measure(), timed as a CUDA-graph replay of one call (L2 flushed before each) where the
    parameters ask for it, since the engine decodes from graphs: small problems are otherwise timed
    by Python's launch overhead, not the GPU. A variant that cannot be captured is timed eagerly."""
    mode = "eager"
    if ctx.is_cuda and params["cuda_graphs"]:
        try:
            r = measure(ctx, variant, size, fn=fn, check=check, timing={"graph_reps": 1}, **cost)
            r["metrics"]["timing_mode"] = "CUDA-graph replay"
            return r
        except Exception as exc:  # noqa: BLE001 - not capturable: timed eagerly, and the row says why
            torch.cuda.synchronize()
            mode = f"eager (CUDA-graph capture failed: {type(exc).__name__})"
    r = measure(ctx, variant, size, fn=fn, check=check, **cost)
    r["metrics"]["timing_mode"] = mode
    return r


def time_alternatives(ctx, params, candidates: list[dict], launch, check) -> dict:
    """Each candidate checked, then timed as the rows are: config -> ms, or why it was dropped."""
    graphs = {"graph_reps": 1} if ctx.is_cuda and params["cuda_graphs"] else {}
    out = {}
    for cfg in candidates:
        try:
            verdict = check(cfg)
            if not verdict["passed"]:
                out[label(cfg)] = f"check: {verdict['reason']}"
                continue
            t = ctx.time(lambda: launch(cfg), warmup_ms=5.0, target_ms=25.0, min_samples=5, max_samples=50, **graphs)
            out[label(cfg)] = round(t.median_ms, 5)
        except Exception as exc:  # noqa: BLE001 - a config that cannot run is listed with why
            lines = [ln for ln in str(exc).splitlines() if ln.strip()]
            out[label(cfg)] = f"{type(exc).__name__}: {lines[-1][:200] if lines else ''}"
    return out


# ------------------------------------------------------------------------------ the exercise
def run_problem(ctx, p: dict, params: dict, tuning: dict, graph_checks: dict) -> list[dict]:
    """Every variant on one problem (its tensors are freed when this returns)."""
    q, k_cache, v_cache, tables, lens = make_inputs(p, ctx.device)
    scale = 1.0 / math.sqrt(p["head_dim"])
    ref = attn.paged_decode_attention_reference(q.float(), k_cache, v_cache, tables, lens, scale)
    precision = p["dtype"]
    out = torch.empty_like(q)
    size = {**p, "kv_tokens": int(lens.sum()), "max_blocks_per_seq": tables.shape[1]}
    name = f"batch={p['batch']} context~{p['context']}"
    args = (q, k_cache, v_cache, tables, lens, scale)
    splits = engine_splits(p, attn.sm_count(ctx.device))

    def cost(variant):
        launches = triton_launches(splits) if variant == "triton" else LAUNCHES[variant]
        return {"flops": problem_flops(p), "bytes_moved": problem_bytes(p), "dtype": p["dtype"], "launches": launches}

    def check(fill):
        return reference_check(ctx, out, fill, ref, REFERENCE, precision=precision)

    here = []
    if ctx.wants("gather_sdpa"):
        here.append(attempt("gather_sdpa", size, lambda: measure_as_engine(
            ctx, params, "gather_sdpa", size, lambda: gather_sdpa(*args),
            check(lambda: out.copy_(gather_sdpa(*args))), cost("gather_sdpa"))))
        here[-1]["metrics"]["algorithm_bytes"] = gather_bytes(p)

    def triton_row():
        def launch(cfg):
            return attn.paged_decode_attention_triton(*args, num_splits=cfg["splits"], config=cfg, out=out)

        if params["tune"] and not interpreting():
            tuning[name] = time_alternatives(ctx, params, triton_candidates(p, splits), launch,
                                             lambda c: check(lambda: launch(c))())
        engine = lambda: attn.paged_decode_attention(*args, backend="triton")   # noqa: E731 - what the engine calls
        r = measure_as_engine(ctx, params, "triton", size, engine, check(lambda: out.copy_(engine())), cost("triton"))
        r["metrics"]["config"] = label({**attn.default_config(p["head_dim"]), "splits": splits})
        r["metrics"]["num_splits"] = splits
        if r["status"] == "ok" and ctx.is_cuda:
            verdict = graph_replay_check(ctx, lambda: attn.paged_decode_attention_triton(*args, out=out), out, ref,
                                         precision)
            graph_checks[name] = verdict["passed"] or verdict["reason"]
            r["metrics"]["cuda_graph_replay"] = "passed" if verdict["passed"] else f"failed: {verdict['reason']}"
        return r

    if ctx.wants("triton"):
        here.append(attempt("triton", size, triton_row))
    if ctx.wants("flex"):
        if ctx.is_cuda or params["flex_on_cpu"]:
            here.append(attempt("flex", size, lambda: measure_as_engine(
                ctx, params, "flex", size, lambda: attn.paged_decode_attention_flex(*args),
                check(lambda: out.copy_(attn.paged_decode_attention_flex(*args))), cost("flex"))))
        else:
            here.append(skipped("flex", size, "eager FlexAttention on a CPU scores the whole pool; "
                                              "set flex_on_cpu=true to run it anyway"))
    baseline = next((r for r in here if r["variant"] == "gather_sdpa"), None)
    against_baseline(here, baseline, "gbps", "pct_of_gather_sdpa")
    for r in here:
        r["metrics"]["bytes_formula"] = BYTES_FORMULA
        r["metrics"]["flops_formula"] = FLOPS_FORMULA
        if r["status"] == "ok" and baseline and baseline["status"] == "ok" and r is not baseline:
            r["metrics"]["speedup_vs_gather_sdpa"] = baseline["metrics"]["ms"] / r["metrics"]["ms"]
    return here


def run(ctx, params):
    rows, tuning, graph_checks = [], {}, {}
    for p in ctx.track(problems(params), "decode attention problems"):
        rows += run_problem(ctx, p, params, tuning, graph_checks)
        if ctx.is_cuda:
            torch.cuda.empty_cache()
    return Result(rows, {"tuning": tuning, "cuda_graph_replay": graph_checks,
                         "bytes_convention": BYTES_FORMULA + "; the gather's padded copy is its algorithm_bytes",
                         "flops_convention": FLOPS_FORMULA,
                         "lengths": f"each sequence's length uniform in context ± context/{LENGTH_SPREAD}, seeded"})


EXERCISE = Exercise(
    id="phase5.decode_attention",
    title="Paged decode attention: the engine's Triton kernel and FlexAttention vs gather + SDPA, Llama-3.1-8B heads",
    run=run, needs=Needs(cuda=True, modules=("triton",)),
    params={"model": Choice("llama-3.1-8b", tuple(SHAPES), help="whose attention shape (heads, KV heads, head_dim)"),
            "batches": Int([1, 8, 64, 256], min=1, max=4096, many=True, unit="sequences decoding together"),
            "contexts": Int([512, 4096], min=1, max=131072, many=True,
                            unit="tokens cached per sequence (nominal; lengths vary ±1/8)"),
            "block_size": Int(16, min=1, max=1024, unit="tokens per KV block"),
            "dtype": Choice("bf16", ("bf16", "fp16")),
            "tune": Bool(True, help="also time tile and split alternatives to the engine's choice (summary)"),
            "cuda_graphs": Bool(True, help="time each call as a CUDA-graph replay (the engine's way); else eagerly"),
            "flex_on_cpu": Bool(False, help="run the eager FlexAttention variant on a CPU (slow: scores the pool)")},
    cpu_params={"model": "tiny", "batches": [1, 3], "contexts": [40]},
    quick_params={"batches": [1, 8], "contexts": [700], "tune": False},
    variants=("gather_sdpa", "triton", "flex"), footprint_bytes=footprint_bytes, work=work,
    workloads=predicted_workloads)


if __name__ == "__main__":
    run_alone(EXERCISE, {"batches": [1, 8, 64], "contexts": [777], "tune": False})
