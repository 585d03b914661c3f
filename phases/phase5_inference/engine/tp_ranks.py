"""Tensor parallelism: one model split over N processes started by torchrun, Megatron-style.

What each rank holds:
  attention   the q, k and v rows of its heads (column-parallel) and o's columns of the same heads
              (row-parallel); with fewer KV heads than ranks, each KV head is held by N / KV ranks
  MLP         gate's and up's rows of its slice of the intermediate size, down's columns of that slice
  KV cache    K and V of its KV heads only; each rank sizes the pool from its own free memory and
              every rank takes the smallest count, so a block number means the same on all of them
  norms       whole
  embedding   whole: a lookup reads one row per token, so a copy costs memory, never time, where a
              split embedding would add a third all-reduce to every step
  LM head     its slice of the vocabulary (padded to a multiple of N rows): the head is read whole
              every step, so splitting it divides those bytes; the fp32 logits are all-gathered
o and down leave partial sums: one all-reduce after attention and one after the MLP in every layer.

The all-reduce is NCCL's (torch.distributed.all_reduce) or a one-shot all-reduce through PyTorch
symmetric memory (torch.ops.symm_mem.one_shot_all_reduce_copy_out, one kernel): each rank copies its
partial sums into its symmetric buffer, meets the others at a barrier, loads every rank's buffer over
NVLink with plain peer loads and adds them in rank order, so all ranks get the same bits; a second
barrier lets the buffer be reused. Nothing uses NVLink multicast (NVLS stays off). `auto` times both
inside CUDA graphs at every size from 2 KiB to 8 MiB when the engine starts (the slowest rank's time,
so every rank makes the same choice) and takes the faster per size.

Who decides: every rank runs the same LLMEngine. Its scheduler and sampler are deterministic and
their only input from the model is the all-gathered logits (the same on every rank), so ranks given
the same calls in the same order take the same steps. A benchmark makes the same calls on every rank
and pays nothing per step; behind the server, rank 0 alone receives requests, so DrivenEngine sends
the adds and aborts of each step to the other ranks (one small gloo broadcast per step), which run
`follow()`.
"""
import datetime
import pickle

import torch
import torch.distributed as dist

from common.errors import LabError

from .fused_ops import logits_into
from .shapes import LlamaShape
from .tp_shards import local_shape, shard, shard_shapes

# NVLink multicast (NVLS) stays off on the lab's machines: these are set in every process the lab starts
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ALLREDUCE_MODES = ("auto", "nccl", "one-shot")
COMPARE_SIZES = tuple(2**k for k in range(11, 24))       # 2 KiB .. 8 MiB: decode's all-reduces and more
ONE_SHOT_MAX_BYTES = COMPARE_SIZES[-1]                   # larger all-reduces always go to NCCL
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)       # what torch's one-shot kernel takes
COMPARE_CALLS, COMPARE_REPS = 16, 8                       # all-reduces per captured graph, timed replays


# ------------------------------------------------------------------------------ all-reduce implementations
class SymmetricOneShot:
    """torch's one-shot all-reduce over a symmetric buffer of `max_bytes` (peer loads, no multicast)."""

    def __init__(self, max_bytes: int, dtype: torch.dtype, device: torch.device, group):
        from torch.distributed import _symmetric_memory as symm_mem
        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group)
        self.group_name = group.group_name
        self.copy_out = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)
        self.out_op = torch.ops.symm_mem.one_shot_all_reduce_out

    def fits(self, x: torch.Tensor) -> bool:
        return (x.dtype == self.dtype and x.numel() <= self.max_numel and x.is_contiguous()
                and (x.numel() * x.element_size()) % 4 == 0 and x.storage_offset() == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        out = torch.empty_like(x)
        if self.copy_out is not None:
            self.copy_out(self.buffer[:n], x.view(-1), "sum", self.group_name, out.view(-1))
        else:                                            # an older torch: copy in, then the kernel
            self.buffer[:n].copy_(x.view(-1))
            self.out_op(self.buffer[:n], "sum", self.group_name, out.view(-1))
        return out


class EmulatedOneShot:
    """The one-shot algorithm over gloo on CPU processes (its semantics, for tests): every rank
    gets every rank's partials and adds them in rank order itself."""

    def __init__(self, tp: "TensorParallel"):
        self.tp = tp

    def fits(self, x: torch.Tensor) -> bool:
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.tp.size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp.group)
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out


def pattern(numel: int, rank: int, dtype, device) -> torch.Tensor:
    """Small integers (exact in bf16 when summed over up to 8 ranks), different on every rank."""
    i = torch.arange(numel, device=device, dtype=torch.int64)
    return (((i % 13) * 5 + (i % 7) + 3 * rank) % 17 - 8).to(dtype)


# ------------------------------------------------------------------------------ the communicator
class TensorParallel:
    """This rank's place in the tensor-parallel group (torch.distributed's default group, which
    torchrun set up) and the collectives the model calls: all_reduce, gather_logits, min_int."""

    def __init__(self, size: int, device: torch.device, dtype: torch.dtype, mode: str = "auto"):
        if mode not in ALLREDUCE_MODES:
            raise LabError(f"allreduce {mode!r}: choose one of {', '.join(ALLREDUCE_MODES)}")
        if not (dist.is_available() and dist.is_initialized()):
            raise LabError(f"tensor_parallel {size} needs {size} processes started by torchrun "
                           f"(`lab serve --tensor-parallel {size}` starts them)")
        self.group = dist.group.WORLD
        self.size, self.rank = dist.get_world_size(), dist.get_rank()
        if self.size != size:
            raise LabError(f"tensor_parallel {size}, but torchrun started {self.size} processes")
        self.backend = dist.get_backend()
        self.device, self.dtype, self.mode = torch.device(device), dtype, mode
        if (self.device.type == "cuda") != (self.backend == "nccl"):
            raise LabError(f"a {self.device.type} engine needs the {'nccl' if self.device.type == 'cuda' else 'gloo'} "
                           f"backend; the process group uses {self.backend}")
        self.noop = False            # all-reduces skipped (timing a step without them; results are wrong)
        self.one_shot = None
        self.one_shot_why: str | None = None
        self.choices: list[tuple[int, str]] = []          # (up to this many bytes, "one-shot" or "nccl")
        self.table: list[dict] = []
        if mode != "nccl":
            self._start_one_shot()
        if self.one_shot is None and mode == "one-shot":
            raise LabError(f"allreduce one-shot is not available here: {self.one_shot_why}")
        if mode == "auto" and self.one_shot is not None and self.device.type == "cuda":
            self.table = self.compare(COMPARE_SIZES)
            self.choices = [(r["size_bytes"], r["faster"]) for r in self.table]

    def local_shape(self, shape: LlamaShape) -> LlamaShape:
        return local_shape(shape, self.size)

    def shard(self, shape: LlamaShape, items) -> dict[str, torch.Tensor]:
        return shard(items, shape, self.rank, self.size, self.dtype, self.device)

    def shard_shapes(self, shape: LlamaShape) -> dict[str, tuple[int, ...]]:
        return shard_shapes(shape, self.size)

    # ------------------------------------------------------------------ agreement
    def _agree(self, ok: bool) -> bool:
        """True on every rank if `ok` on every rank (so no rank enters a collective alone)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=self._flag_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def _flag_device(self):
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def line_up(self) -> None:
        """Every rank idle and leaving together: what follows starts on all of them at once."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def min_int(self, value: int) -> int:
        t = torch.tensor([int(value)], dtype=torch.int64, device=self._flag_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def _start_one_shot(self) -> None:
        """The one-shot all-reduce where every rank can run it and it is exact, else the reason why not."""
        if self.device.type != "cuda":
            self.one_shot = EmulatedOneShot(self) if self.mode == "one-shot" else None
            self.one_shot_why = None if self.one_shot else "on CPU processes the one-shot algorithm is only emulated (allreduce one-shot)"
            return
        why = None
        if self.dtype not in ONE_SHOT_DTYPES:
            why = f"torch's one-shot kernel takes bf16 and fp32, not {self.dtype}"
        else:
            try:
                import torch.distributed._symmetric_memory  # noqa: F401
                torch.ops.symm_mem.one_shot_all_reduce_out   # noqa: B018 - raises where the op is missing
            except Exception as exc:                         # noqa: BLE001
                why = f"no symmetric-memory one-shot all-reduce in this torch ({type(exc).__name__})"
        if not self._agree(why is None):
            self.one_shot_why = why or "another rank cannot run it"
            return
        try:
            candidate = SymmetricOneShot(ONE_SHOT_MAX_BYTES, self.dtype, self.device, self.group)
        except Exception as exc:                             # noqa: BLE001
            candidate, why = None, f"symmetric memory failed: {type(exc).__name__}: {_first_line(exc)}"
        if not self._agree(candidate is not None):
            self.one_shot_why = why or "symmetric memory failed on another rank"
            return
        wrong = self._check(candidate)
        if not self._agree(wrong == 0):
            self.one_shot_why = f"one-shot all-reduce results wrong ({wrong} elements on this rank)" if wrong \
                else "one-shot all-reduce results wrong on another rank"
            return
        self.one_shot = candidate

    def _check(self, one_shot) -> int:
        """Elements the one-shot gets wrong against exact sums, at a small, an odd and the largest size."""
        wrong = 0
        for numel in (8, 4104, one_shot.max_numel):
            try:
                x = pattern(numel, self.rank, self.dtype, self.device)
                expected = sum(pattern(numel, r, torch.float32, self.device) for r in range(self.size))
                got = one_shot(x)
                torch.cuda.synchronize(self.device)
                wrong += int((got.float() != expected).sum())
            except Exception:                                # noqa: BLE001 - a failing kernel counts as wrong
                wrong += numel
        return wrong

    # ------------------------------------------------------------------ the model's collectives
    def use_one_shot(self, nbytes: int) -> bool:
        if self.one_shot is None:
            return False
        if self.mode == "one-shot":
            return True
        for size, faster in self.choices:
            if nbytes <= size:
                return faster == "one-shot"
        return False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (x may be reused as the result)."""
        if self.noop:
            return x
        if self.use_one_shot(x.numel() * x.element_size()) and self.one_shot.fits(x):
            return self.one_shot(x)
        dist.all_reduce(x, group=self.group)
        return x

    def gather_logits(self, local: torch.Tensor, vocab: int, out: torch.Tensor | None = None,
                      argmax_out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's slice of the logits [rows, vocab / N] side by side: [rows, vocab], into `out`
        when given, with their argmax into argmax_out when given."""
        rows, width = local.shape
        gathered = torch.empty(self.size, rows, width, dtype=local.dtype, device=local.device)
        if self.backend == "nccl":
            dist.all_gather_into_tensor(gathered, local.contiguous(), group=self.group)
        else:
            dist.all_gather(list(gathered.unbind(0)), local.contiguous(), group=self.group)
        return logits_into(gathered.permute(1, 0, 2).reshape(rows, self.size * width)[:, :vocab], out, argmax_out)

    # ------------------------------------------------------------------ NCCL against one-shot, per size
    def compare(self, sizes, calls: int = COMPARE_CALLS, reps: int = COMPARE_REPS) -> list[dict]:
        """Per size: µs per all-reduce of NCCL and of the one-shot, each `calls` back to back in a
        CUDA graph replayed `reps` times (the slowest rank's time), and which is faster. Every rank
        calls it with the same sizes."""
        out = []
        for size in sizes:
            numel = size // self.dtype.itemsize
            x = torch.zeros(numel, dtype=self.dtype, device=self.device)
            nccl_us = self._graph_us(lambda: dist.all_reduce(x, group=self.group), calls, reps)
            one_us = None
            if self.one_shot is not None and self.one_shot.fits(x):
                one_us = self._graph_us(lambda: self.one_shot(x), calls, reps)
            slowest = torch.tensor([nccl_us, one_us if one_us is not None else -1.0], device=self.device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.group)
            nccl_us, one_us = float(slowest[0]), (float(slowest[1]) if one_us is not None else None)
            out.append({"size_bytes": size, "nccl_us": nccl_us, "one_shot_us": one_us,
                        "faster": "one-shot" if one_us is not None and one_us < nccl_us else "nccl"})
            del x
        torch.cuda.empty_cache()
        return out

    def _graph_us(self, fn, calls: int, reps: int) -> float:
        fn()                                                  # warm-up (and NCCL's lazy set-up) outside the graph
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(calls):
                fn()
        graph.replay()
        self.line_up()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        us = 1e3 * start.elapsed_time(end) / (reps * calls)
        del graph
        return us

    def time_all_reduce(self, numel: int, calls: int = COMPARE_CALLS, reps: int = COMPARE_REPS) -> float:
        """ms per all_reduce of `numel` elements of the model's dtype as the model calls it (the
        implementation chosen for that size), back to back: in a CUDA graph on GPUs (the slowest
        rank's time), eager calls timed by perf_counter on CPU processes. Every rank calls it."""
        x = torch.zeros(numel, dtype=self.dtype, device=self.device)
        if self.device.type == "cuda":
            us = torch.tensor([self._graph_us(lambda: self.all_reduce(x), calls, reps)], device=self.device)
            dist.all_reduce(us, op=dist.ReduceOp.MAX, group=self.group)
            return float(us) / 1e3
        import time
        self.all_reduce(x)
        self.line_up()
        start = time.perf_counter()
        for _ in range(calls * reps):
            self.all_reduce(x)
        return (time.perf_counter() - start) * 1e3 / (calls * reps)

    def describe(self) -> dict:
        return {"tensor_parallel": self.size, "allreduce_mode": self.mode, "tp_backend": self.backend,
                "one_shot_available": self.one_shot is not None, "one_shot_unavailable_reason": self.one_shot_why,
                "allreduce_choices": [list(c) for c in self.choices], "allreduce_table": self.table}


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


# ------------------------------------------------------------------------------ rank 0 drives, the others follow
class Channel:
    """Rank 0's per-step messages to the other ranks, pickled, over a gloo group (host memory). All
    ranks make it at the same point (a collective); its timeout is long: an idle server waits."""

    def __init__(self, timeout_s: float = 7 * 24 * 3600):
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.rank = dist.get_rank()

    def send(self, obj) -> None:
        payload = pickle.dumps(obj) if obj else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.group)

    def recv(self):
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        if int(size) == 0:
            return []
        buf = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        return pickle.loads(buf.numpy().tobytes())


class DrivenEngine:
    """Rank 0's engine behind the server: add_request and abort act at once and are queued; step()
    sends the queue to the other ranks, which apply it and step too (follow). Everything else is the
    engine's own."""

    def __init__(self, engine, channel: Channel):
        self.engine = engine
        self.channel = channel
        self._pending: list[tuple] = []

    def add_request(self, prompt_token_ids, params, request_id=None, sample_group=None) -> str:
        request_id = self.engine.add_request(prompt_token_ids, params, request_id, sample_group=sample_group)
        self._pending.append(("add", list(prompt_token_ids), params, request_id, sample_group))
        return request_id

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._pending.append(("abort", request_id))

    def step(self):
        pending, self._pending = self._pending, []
        self.channel.send(pending)
        return self.engine.step()

    def generate(self, prompts, params):
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, q) for p, q in zip(prompts, params_list)]
        seqs = [self.engine._requests[i] for i in ids]
        while not all(s.is_finished for s in seqs):
            self.step()
        return [s.output_token_ids for s in seqs]

    def stop(self) -> None:
        """Tell the other ranks to leave follow()."""
        self.channel.send([("stop",)])

    def __getattr__(self, name):
        return getattr(self.engine, name)


def follow(engine, channel: Channel) -> None:
    """A rank other than 0: apply rank 0's adds and aborts of each step, then step, until told to stop."""
    while True:
        commands = channel.recv()
        for command in commands:
            if command[0] == "stop":
                return
            if command[0] == "add":
                engine.add_request(command[1], command[2], command[3], sample_group=command[4])
            elif command[0] == "abort":
                engine.abort(command[1])
        engine.step()
