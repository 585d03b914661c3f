"""Fusion made visible: what XLA compiled, read from the optimized HLO text of a jitted function.

    executable, text, temp_bytes = hlo.compiled(f, *args)     # jax.jit(f).lower(*args).compile().as_text()

An HLO module is a set of computations. The entry computation (and the loop bodies, branches and
command buffers it calls) holds the instructions that run as kernels; each of their results is a
buffer in device memory. A `fusion` instruction names a fused computation whose instructions live
in registers and shared memory inside one kernel: nothing in a fused body is materialized, only the
fusion's own result. A `custom-call` hands work to a library (cuBLAS, cuDNN). So:

* fusions and custom calls are counted in the computations that run, with their kinds and targets;
* every other instruction there that does work counts as a kernel as well (parameters, constants,
  bitcasts and tuples do none);
* the attention question, "is an S x S score matrix ever in device memory?", is answered from the
  buffers those instructions produce: any result with two dimensions equal to S, or as many
  elements as B x H x S x S, is one. memory_analysis()'s temp bytes corroborate it;
* and "did XLA fuse matmul, softmax and matmul?" from the fusions' bodies: one fusion holding two
  dots and an exponential. A fusion is one kernel on a GPU (its S x S intermediates stay in
  registers and shared memory); a library fusion (XLA:CPU's YNNPACK/XNNPACK subgraphs, cuDNN
  graphs) runs inside the library, whose own scratch the HLO does not show.
"""
import re
from dataclasses import dataclass, field

FREE_OPS = {"parameter", "constant", "bitcast", "tuple", "get-tuple-element", "after-all", "partition-id",
            "replica-id", "opt-barrier", "add-dependency", "domain"}
SCALAR_CALLERS = {"reduce", "reduce-window", "scatter", "select-and-scatter", "sort", "map", "all-reduce",
                  "reduce-scatter", "all-reduce-start"}      # their to_apply is a scalar function, not a kernel
ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
            "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}

HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\)\s*->\s*.*)?\{\s*$")
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
SHAPE = re.compile(r"\b(pred|[su]\d+|f\d+|bf16|f8\w*|c\d+)\[([\d,]*)\]")
CALLED = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
TARGET = re.compile(r'custom_call_target="([^"]+)"')
FUSION_KIND = re.compile(r"\bkind=(k\w+)")
BACKEND_KIND = re.compile(r'"kind":"(__[\w$]+)"')


@dataclass
class Instruction:
    name: str
    op: str
    shapes: list[tuple[str, tuple[int, ...]]]      # (element type, dims) of each result array
    rest: str

    def calls(self) -> list[tuple[str, str]]:
        out = [(m.group(1), m.group(2)) for m in CALLED.finditer(self.rest)]
        for m in BRANCHES.finditer(self.rest):
            out += [("branch", b.strip().lstrip("%")) for b in m.group(1).split(",") if b.strip()]
        return out


@dataclass
class Analysis:
    """What one compiled module holds (counts over the computations that run)."""
    fusions: int = 0
    fusion_kinds: dict = field(default_factory=dict)     # kLoop / kInput / kOutput / kCustom (and its backend kind)
    custom_calls: int = 0
    custom_call_targets: dict = field(default_factory=dict)
    kernels: int = 0                                     # fusions + custom calls + other instructions that do work
    unfused_ops: dict = field(default_factory=dict)      # those other instructions, by op
    buffers: list = field(default_factory=list)          # (instruction, op, dtype, dims, bytes) of every result
    inside: list = field(default_factory=list)           # (fusion, its label, {op: count}, [dims]) of each fusion's body

    def as_dict(self) -> dict:
        return {"fusions": self.fusions, "fusion_kinds": dict(sorted(self.fusion_kinds.items())),
                "custom_calls": self.custom_calls, "custom_call_targets": dict(sorted(self.custom_call_targets.items())),
                "kernels": self.kernels, "unfused_ops": dict(sorted(self.unfused_ops.items()))}


def parse(text: str) -> tuple[dict[str, list[Instruction]], str | None]:
    """Computation name -> its instructions, and the entry computation's name."""
    computations, entry, current = {}, None, None
    for line in text.splitlines():
        if current is None:
            m = HEADER.match(line)
            if m and not line.startswith((" ", "\t")):
                current = m.group(2)
                computations[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = INSTRUCTION.match(line)
        if m:
            shapes = [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in SHAPE.findall(m.group(2))]
            computations[current].append(Instruction(m.group(1), m.group(3), shapes, m.group(4)))
    return computations, entry


def walk(computations: dict, roots: list[str], follow) -> list[str]:
    """The computations reachable from `roots` through the calls of the instructions `follow` accepts."""
    seen, todo = [], list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in computations:
            continue
        seen.append(name)
        for ins in computations[name]:
            if follow(ins):
                todo += [callee for _, callee in ins.calls()]
    return seen


def running_computations(computations: dict, entry: str | None) -> list[str]:
    """The entry and what it calls as control flow (loop bodies, branches, `call`s, command buffers),
    never a fused body or a reduction's scalar function."""
    return walk(computations, [entry] if entry else [],
                lambda ins: ins.op not in ("fusion", "custom-call") and ins.op not in SCALAR_CALLERS)


def fused_body(computations: dict, names: list[str]) -> list[Instruction]:
    """Every instruction of a fused computation, nested fusions and calls included."""
    return [ins for name in walk(computations, names, lambda ins: ins.op not in SCALAR_CALLERS)
            for ins in computations[name]]


def analyze(text: str) -> Analysis:
    computations, entry = parse(text)
    out = Analysis()
    for name in running_computations(computations, entry):
        for ins in computations[name]:
            if ins.op in FREE_OPS:
                continue
            for dtype, dims in ins.shapes:
                elements = 1
                for d in dims:
                    elements *= d
                out.buffers.append((ins.name, ins.op, dtype, dims, elements * ITEMSIZE.get(dtype, 1)))
            if ins.op in ("call", "while", "conditional"):
                continue                                   # their bodies' instructions are counted
            out.kernels += 1
            if ins.op == "fusion":
                out.fusions += 1
                kind = FUSION_KIND.search(ins.rest)
                backend = BACKEND_KIND.search(ins.rest)
                label = (kind.group(1) if kind else "?") + (f" {backend.group(1)}" if backend else "")
                out.fusion_kinds[label] = out.fusion_kinds.get(label, 0) + 1
                body = fused_body(computations, [c for how, c in ins.calls() if how == "calls"])
                ops: dict = {}
                for inner in body:
                    ops[inner.op] = ops.get(inner.op, 0) + 1
                out.inside.append((ins.name, label, ops, [dims for inner in body for _, dims in inner.shapes]))
            elif ins.op == "custom-call":
                out.custom_calls += 1
                target = TARGET.search(ins.rest)
                label = target.group(1) if target else "?"
                out.custom_call_targets[label] = out.custom_call_targets.get(label, 0) + 1
            else:
                out.unfused_ops[ins.op] = out.unfused_ops.get(ins.op, 0) + 1
    return out


def score_buffers(analysis: Analysis, batch: int, heads: int, seq: int) -> list[tuple]:
    """The buffers that hold an S x S score (or probability) matrix: two dimensions equal to S, or
    a flattened B x H x S x S."""
    whole = batch * heads * seq * seq
    found = []
    for name, op, dtype, dims, nbytes in analysis.buffers:
        elements = nbytes // ITEMSIZE.get(dtype, 1)
        if sum(d == seq for d in dims) >= 2 or (seq in dims and elements >= whole):
            found.append((name, op, dtype, dims, nbytes))
    return found


def attention_report(text: str, batch: int, heads: int, seq: int, temp_bytes: int | None) -> dict:
    """The record's fusion block for one attention implementation."""
    a = analyze(text)
    scores = score_buffers(a, batch, heads, seq)
    largest = max(scores, key=lambda b: b[4]) if scores else None
    whole = batch * heads * seq * seq
    one = next(((name, label) for name, label, ops, _ in a.inside
                if ops.get("dot", 0) >= 2 and ops.get("exponential", 0) >= 1), None)
    inside = any(sum(d == seq for d in dims) >= 2 for _, _, _, shapes in a.inside for dims in shapes)
    library = [t for t in a.custom_call_targets if "fmha" in t.lower() or "attention" in t.lower()]
    return {**a.as_dict(), "score_materialized": bool(scores), "score_buffers": len(scores),
            "attention_in_one_fusion": one[1] if one else None,
            "scores_inside_a_fusion": inside, "library_attention": ", ".join(library) or None,
            "largest_score_buffer": (f"{largest[1]} {largest[2]}[{','.join(map(str, largest[3]))}]"
                                     if largest else None),
            "largest_score_buffer_bytes": largest[4] if largest else 0,
            "temp_bytes": temp_bytes,
            "temp_over_bf16_scores": temp_bytes / (2 * whole) if temp_bytes is not None else None}


def compiled(fn, *args):
    """jax.jit(fn) compiled for these arguments: the executable (what is then checked and timed),
    its optimized HLO text, and its temp bytes (None where the backend gives no memory analysis)."""
    import jax
    executable = jax.jit(fn).lower(*args).compile()
    try:
        stats = executable.memory_analysis()
        temp = int(stats.temp_size_in_bytes) if stats is not None else None
    except Exception:  # noqa: BLE001 - some backends do not implement it
        temp = None
    return executable, executable.as_text(), temp
