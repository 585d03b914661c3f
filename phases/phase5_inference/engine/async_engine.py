"""The engine behind an asyncio server: LLMEngine is not thread-safe and its step() blocks, so ONE
background thread owns it and steps it while any request is unfinished; the server's event loop only
queues adds and aborts for that thread and receives each step's outputs back through
`loop.call_soon_threadsafe` (one call per step, not per request).

`generate()` is an async iterator of a request's StepOutputs; closing or cancelling it early (a
client that disconnected) aborts the request, which frees its KV blocks at the engine's next turn.
The thread sleeps on a condition variable when there is nothing to do, so an idle server uses no CPU.

It also keeps the engine's own time per step (LLMEngine.last_step["ms"]) and the wrapper's time
around it, so a benchmark can put the client's TPOT beside the engine's decode step time.
"""
import asyncio
import itertools
import threading
import time
import uuid
from collections import deque

import numpy as np

STEP_HISTORY = 8192                  # steps kept for the stats summaries


class QueueFull(Exception):
    """More requests in flight than `max_queue` (the server answers 503)."""


class EngineStopped(Exception):
    """The engine thread has stopped (shutdown, or the engine raised): the request cannot finish."""


class AsyncEngine:
    """One LLMEngine, stepped by one thread, serving requests from one asyncio event loop."""

    def __init__(self, engine, max_queue: int = 1024):
        self.engine = engine
        self.max_queue = max_queue
        self._cond = threading.Condition()
        self._pending_adds: list[tuple[str, list[int], object, str | None]] = []     # guarded by _cond
        self._pending_aborts: list[str] = []                             # guarded by _cond
        self._stopping = False                                           # guarded by _cond
        self._queues: dict[str, asyncio.Queue] = {}    # in-flight requests; touched on the loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stats_lock = threading.Lock()
        self._steps: deque = deque(maxlen=STEP_HISTORY)     # (kind, num_seqs, num_tokens, engine_ms, turn_wall_ms)
        self._step_count = {"prefill": 0, "decode": 0}
        self._count_ids = itertools.count()
        self.error: BaseException | None = None   # what stopped the engine thread, if it failed
        self.num_aborted = 0                      # requests whose consumer left before they finished

    # ------------------------------------------------------------------ the loop's side
    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Bind to the running event loop and start the engine thread (generate() does it too)."""
        loop = asyncio.get_running_loop()
        if self._loop is not None and self._loop is not loop:
            raise RuntimeError("AsyncEngine serves one event loop; it is bound to another")
        self._loop = loop
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="llm-engine", daemon=True)
            self._thread.start()

    async def generate(self, prompt_ids: list[int], params, request_id: str | None = None,
                       sample_group: str | None = None):
        """Yield the request's StepOutputs until one is finished (sample_group: the engine's key of
        n samples of one prompt, which share its KV blocks). Raises QueueFull before queueing
        anything, ValueError if the engine rejects the request (first iteration), EngineStopped if
        the engine thread stops. Leaving early aborts the request."""
        self.start()
        if self._stopping or (self._thread is not None and not self._thread.is_alive()):
            raise EngineStopped("the engine is not running")
        if len(self._queues) >= self.max_queue:
            raise QueueFull(f"{len(self._queues)} requests in flight (max_queue={self.max_queue})")
        request_id = request_id or f"req-{next(self._count_ids)}-{uuid.uuid4().hex[:8]}"
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        with self._cond:
            self._pending_adds.append((request_id, list(prompt_ids), params, sample_group))
            self._cond.notify()
        done = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    done = True                  # the engine never held it, or has dropped it
                    raise item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not done:
                self.num_aborted += 1
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to abort a request (idempotent; its blocks are freed there)."""
        with self._cond:
            self._pending_aborts.append(request_id)
            self._cond.notify()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread after its current step; unfinished requests get EngineStopped."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _deliver(self, outputs) -> None:
        """On the loop: hand each StepOutput (or exception) to its request's queue."""
        for request_id, item in outputs:
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(item)

    def _fail_all(self, exc: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(type(exc)(*exc.args))       # one instance per request: each is raised once

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        active: set[str] = set()          # ids the engine holds (this thread's view)
        try:
            while True:
                with self._cond:
                    while not (self._pending_adds or self._pending_aborts or self._stopping or active):
                        self._cond.wait()
                    if self._stopping:
                        break
                    adds, self._pending_adds = self._pending_adds, []
                    aborts, self._pending_aborts = self._pending_aborts, []
                started = time.perf_counter()
                rejected = []
                for request_id, prompt_ids, params, group in adds:     # adds first: an abort may follow its add
                    try:
                        self.engine.add_request(prompt_ids, params, request_id, sample_group=group)
                        active.add(request_id)
                    except ValueError as exc:
                        rejected.append((request_id, exc))
                for request_id in aborts:
                    self.engine.abort(request_id)
                    active.discard(request_id)
                if rejected:
                    self._post(rejected)
                if not active:
                    continue
                before = getattr(self.engine, "last_step", None)
                outputs = self.engine.step()
                for out in outputs:
                    if out.finished:
                        active.discard(out.request_id)
                if outputs:
                    self._post([(out.request_id, out) for out in outputs])
                if getattr(self.engine, "last_step", None) is not before:    # a model step ran
                    self._record((time.perf_counter() - started) * 1e3)
        except BaseException as exc:        # an engine bug: fail the requests rather than hang them
            self.error = exc
            for request_id in active:
                try:
                    self.engine.abort(request_id)
                except Exception:
                    pass
            self._post_fail(EngineStopped(f"engine failed: {type(exc).__name__}: {exc}"))
            return
        self._post_fail(EngineStopped("the engine is shutting down"))

    def _post(self, outputs) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver, outputs)
        except RuntimeError:                # the loop is closed: nobody is waiting any more
            pass

    def _post_fail(self, exc: BaseException) -> None:
        try:
            self._loop.call_soon_threadsafe(self._fail_all, exc)
        except RuntimeError:
            pass

    def _record(self, wall_ms: float) -> None:
        last = self.engine.last_step or {}
        kind = last.get("kind", "decode")
        with self._stats_lock:
            self._step_count[kind] = self._step_count.get(kind, 0) + 1
            self._steps.append((kind, last.get("num_seqs", 0), last.get("num_tokens", 0),
                                last.get("ms", wall_ms), wall_ms))

    # ------------------------------------------------------------------ stats
    def reset_stats(self) -> None:
        """Forget the step history (a benchmark calls it after its warmup)."""
        with self._stats_lock:
            self._steps.clear()
            self._step_count = {"prefill": 0, "decode": 0}

    def stats(self, include_steps: bool = False) -> dict:
        """Step counts and per-kind step times (the engine's own ms, and the thread's wall ms per
        turn: queued adds and aborts, step(), handing outputs to the loop) since the last reset, over the last STEP_HISTORY steps; the engine's telemetry."""
        with self._stats_lock:
            steps = list(self._steps)
            counts = dict(self._step_count)
        out = {"steps": sum(counts.values()), "prefill_steps": counts.get("prefill", 0),
               "decode_steps": counts.get("decode", 0), "num_in_flight": len(self._queues),
               "num_aborted": self.num_aborted,
               "num_preemptions": getattr(self.engine, "num_preemptions", 0),
               "num_free_kv_blocks": getattr(self.engine, "num_free_blocks", None),
               "engine_alive": self.alive, "engine_error": repr(self.error) if self.error else None}
        for kind in ("prefill", "decode"):
            mine = [s for s in steps if s[0] == kind]
            out[f"{kind}_step_ms"] = _summary([s[3] for s in mine])
            out[f"{kind}_step_wall_ms"] = _summary([s[4] for s in mine])
            out[f"{kind}_step_mean_seqs"] = float(np.mean([s[1] for s in mine])) if mine else None
        out["telemetry"] = getattr(self.engine, "telemetry", {})
        if include_steps:
            out["recent_steps"] = [{"kind": k, "num_seqs": n, "num_tokens": t, "ms": ms, "wall_ms": w}
                                   for k, n, t, ms, w in steps]
        return out


def _summary(values: list[float]) -> dict:
    if not values:
        return {"count": 0, "mean": None, "median": None, "p99": None}
    arr = np.asarray(values, dtype=float)
    return {"count": len(values), "mean": float(arr.mean()), "median": float(np.median(arr)),
            "p99": float(np.percentile(arr, 99))}
