"""An all-reduce whose bytes the GPUs' copy engines move, as a DDP comm hook.

NCCL's all-reduce is a kernel whose channels hold SMs while backward's matmuls want them all; a copy
engine moves bytes between GPUs with no SM. Each rank owns chunk r of a bucket and a symmetric
workspace (PyTorch symmetric memory) of n + 1 chunk slots, and per bucket:
    1. push:   my chunk j -> rank j's slot r, for every j               (cudaMemcpy: copy engines)
    2. barrier (a one-block kernel)
    3. reduce: slot n = mean of my chunk and the n-1 slots, copied back into my chunk (one SM kernel)
    4. barrier
    5. pull:   rank j's slot n -> my chunk j, for every j               (copy engines)
Bytes per rank are a ring all-reduce's 2 (n-1)/n N; every chunk is reduced once, by its owner, so
all ranks end with the same bits. Stream order makes a third barrier unnecessary: my next push
follows my barrier 4, which rank j passes only after its reduce read its slots.
"""
import math
import os

import torch
import torch.distributed as dist

ALIGN = 64            # chunk boundaries on 256-byte multiples (fp32), where copies run at full speed


def unavailable(backend: str, world: int, local_gpus: int) -> str | None:
    """None if `world` ranks on this host can run the copy-engine all-reduce, else why not, in one line."""
    if backend != "nccl":
        return f"the copy-engine all-reduce needs CUDA GPUs (it moves bytes with their copy engines); this run uses {backend}"
    if world > local_gpus:
        return (f"the copy-engine all-reduce needs every rank on one host, in reach of NVLink peer copies "
                f"({world} ranks, {local_gpus} GPUs here)")
    return None


def chunk_bounds(numel: int, world: int) -> list[tuple[int, int]]:
    """[lo, hi) of each rank's chunk: equal, ALIGN-rounded, the last ones short or empty."""
    c = math.ceil(math.ceil(numel / world) / ALIGN) * ALIGN
    return [(min(j * c, numel), min((j + 1) * c, numel)) for j in range(world)]


class CopyEngineAllReduce:
    """Averages flat CUDA tensors of up to `max_numel` elements across the default group, in place.
    Collective: every rank builds it, and calls it on its own tensors in the same order.

    graphs: capture each tensor's all-reduce (keyed by its address and length) as a CUDA graph the
    first time and replay it after. Eagerly, one bucket costs a dozen launches' worth of Python on
    the CPU (the copies, two barriers, the reduce), and in a DDP hook that CPU time is taken from
    the thread that launches backward's kernels; a replay is one launch. DDP's buckets keep their
    addresses from step to step, so each is captured once."""

    def __init__(self, max_numel: int, dtype=torch.float32, high_priority: bool = False, graphs: bool = True):
        from torch.distributed import _symmetric_memory as symm_mem
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        why = unavailable(dist.get_backend(), self.world, int(os.environ.get("LOCAL_WORLD_SIZE", self.world)))
        if why:
            raise RuntimeError(why)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.chunk = chunk_bounds(max_numel, self.world)[0][1]            # the longest chunk
        local = symm_mem.empty((self.world + 1) * self.chunk, dtype=dtype, device=self.device)
        self.handle = symm_mem.rendezvous(local, dist.group.WORLD)
        # every rank's workspace as seen from here: slots 0..n-1 receive, slot n holds the reduced chunk
        self.ws = [self.handle.get_buffer(j, (self.world + 1, self.chunk), dtype) for j in range(self.world)]
        priority = -1 if high_priority else 0
        self.stream = torch.cuda.Stream(self.device, priority=priority)
        # one copy at a time, in this order: rank r sends to r+1 while receiving from r-1, so every
        # GPU's link carries one copy in and one out at each moment.
        self.peers = [(self.rank + k) % self.world for k in range(1, self.world)]
        self.plans: dict = {}
        self.graphs: dict | None = {} if graphs else None

    def _views(self, numel: int) -> list:
        """Per peer j: (lo, hi) of chunk j, my slot in j's workspace, j's reduced slot; then my own
        chunk's bounds, my slots and my reduced slot. Built once per bucket length: slicing costs
        microseconds of CPU per call, and a bucket's whole all-reduce is only a few launches, so the
        CPU must stay ahead of the copy engines."""
        if numel not in self.plans:
            bounds, r, n = chunk_bounds(numel, self.world), self.rank, self.world
            peers = [((lo, hi), self.ws[j][r, : hi - lo], self.ws[j][n, : hi - lo])
                     for j in self.peers for lo, hi in [bounds[j]]]
            lo, hi = bounds[r]
            self.plans[numel] = (peers, (lo, hi), self.ws[r][:n, : hi - lo], self.ws[r][n, : hi - lo])
        return self.plans[numel]

    def _enqueue(self, t: torch.Tensor) -> None:
        """The five steps of the module's docstring for `t`, queued on the current stream (self.stream)."""
        peers, (lo, hi), slots, reduced = self._views(t.numel())
        mine = t[lo:hi]
        for (plo, phi), theirs, _ in peers:                                               # 1. push
            theirs.copy_(t[plo:phi])
        self.handle.barrier()                                                             # 2.
        if self.world == 2:                                                               # 3. (mine + theirs) / 2
            torch.lerp(mine, slots[1 - self.rank], 0.5, out=reduced)
        else:                                                     # my chunk into my own slot, then the mean
            slots[self.rank].copy_(mine)
            torch.mean(slots, dim=0, out=reduced)
        mine.copy_(reduced)
        self.handle.barrier()                                                             # 4.
        for (plo, phi), _, their_reduced in peers:                                        # 5. pull
            t[plo:phi].copy_(their_reduced)

    def _graph(self, t: torch.Tensor) -> torch.cuda.CUDAGraph:
        """`t`'s all-reduce as a CUDA graph, captured on first sight of its address and length (a
        replay reads and writes exactly those addresses, so any tensor there is served right)."""
        key = (t.data_ptr(), t.numel())
        if key not in self.graphs:
            g = torch.cuda.CUDAGraph()
            # captured from DDP's autograd thread while other threads (NCCL's watchdog) go on
            # querying events: restrict only this thread's CUDA calls during the capture
            g.capture_begin(capture_error_mode="thread_local")
            try:
                self._enqueue(t)
            finally:
                g.capture_end()
            self.graphs[key] = g
        return self.graphs[key]

    def all_reduce_(self, t: torch.Tensor) -> None:
        """Enqueue the average of `t` across ranks, in place, on the side stream, after the work
        already on the current stream. The current stream does not wait: call wait() for that."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            if self.graphs is None:
                self._enqueue(t)
            else:
                self._graph(t).replay()

    def wait(self) -> None:
        """Make the current stream wait for everything enqueued so far."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def hook(self, state, bucket) -> torch.futures.Future[torch.Tensor]:
        """A DDP comm hook: the bucket averaged in place, the future complete once the side stream is."""
        t = bucket.buffer()
        self.all_reduce_(t)
        fut = torch.futures.Future(devices=[self.device])
        with torch.cuda.stream(self.stream):
            fut.set_result(t)          # marks the result ready after the side stream's work; DDP waits on it
        return fut


CHECK_SIZES = (1, 4097, 1_000_003)       # one element, a short last chunk, and an odd length of ~4 MB
CHECK_TOLERANCE = 1e-5                   # fp32 averages of randn values (|x| < 10): a few ulps apart at most


def max_abs_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    """The checker's one number: how far a result is from its reference, anywhere."""
    return float((result.double() - reference.double()).abs().max())


def check(engine: CopyEngineAllReduce) -> dict:
    """The copy-engine average against NCCL's sum / n, on random data of irregular sizes, and a
    float64 checksum of each result so the caller can confirm every rank ended with the same bits."""
    gen = torch.Generator(device=engine.device).manual_seed(77 + engine.rank)   # different data per rank
    worst, sums = 0.0, []
    for numel in CHECK_SIZES:
        x = torch.randn(numel, device=engine.device, generator=gen)
        reference = x.clone()
        dist.all_reduce(reference)
        reference /= engine.world
        engine.all_reduce_(x)
        engine.wait()
        worst = max(worst, max_abs_error(x, reference))
        sums.append(float(x.double().sum()))
    return {"max_abs_error": worst, "checksums": sums}
