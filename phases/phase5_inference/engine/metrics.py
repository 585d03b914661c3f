"""The server's Prometheus metrics, written in the text exposition format by hand (a few counters
and two histograms do not need a client library): requests by how they ended, errors by HTTP
status, prompt and generated
tokens, time to first token and time per output token, and, read from the engine at scrape time,
KV blocks in use, preemptions and requests in flight."""
import bisect
import threading

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0)          # vLLM's buckets for vllm:time_to_first_token_seconds
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0)
PREFIX = "lab"


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)       # the last: above every bound (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            out.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum}", f"{name}_count {self.count}"]
        return out


class ServerMetrics:
    """Updated from the event loop (and read by scrapes there); a lock keeps a scrape from a
    thread consistent anyway."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = {}                  # finish reason ("stop", "length", "abort", "error") -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.errors = {}                    # HTTP status of a refused or failed request -> count
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.tpot = Histogram(TPOT_BUCKETS_S)

    def finished(self, reason: str, prompt_tokens: int, generation_tokens: int, ttft_s: float | None,
                 decode_s: float | None) -> None:
        """One choice ended: its tokens, its first token's latency and its mean time per later token."""
        with self._lock:
            self.requests[reason] = self.requests.get(reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens
            if ttft_s is not None:
                self.ttft.observe(ttft_s)
            if decode_s is not None and generation_tokens > 1:
                self.tpot.observe(decode_s / (generation_tokens - 1))

    def refused(self, status: int) -> None:
        with self._lock:
            self.errors[status] = self.errors.get(status, 0) + 1

    def render(self, engine, num_in_flight: int) -> str:
        """The exposition text; `engine`'s KV pool and preemptions are read now."""
        pool = getattr(getattr(engine, "scheduler", None), "block_pool", None)
        total = getattr(pool, "num_blocks", None)
        free = getattr(engine, "num_free_blocks", None)
        with self._lock:
            lines = [f"# HELP {PREFIX}_requests_total Completed choices by finish reason.",
                     f"# TYPE {PREFIX}_requests_total counter"]
            lines += [f'{PREFIX}_requests_total{{finish_reason="{r}"}} {n}' for r, n in sorted(self.requests.items())]
            lines += [f"# HELP {PREFIX}_http_errors_total Requests answered with an error, by HTTP status.",
                      f"# TYPE {PREFIX}_http_errors_total counter"]
            lines += [f'{PREFIX}_http_errors_total{{status="{c}"}} {n}' for c, n in sorted(self.errors.items())]
            lines += [f"# TYPE {PREFIX}_prompt_tokens_total counter",
                      f"{PREFIX}_prompt_tokens_total {self.prompt_tokens}",
                      f"# TYPE {PREFIX}_generation_tokens_total counter",
                      f"{PREFIX}_generation_tokens_total {self.generation_tokens}",
                      f"# HELP {PREFIX}_time_to_first_token_seconds Request arrival to its first token.",
                      f"# TYPE {PREFIX}_time_to_first_token_seconds histogram",
                      *self.ttft.lines(f"{PREFIX}_time_to_first_token_seconds"),
                      f"# HELP {PREFIX}_time_per_output_token_seconds Mean gap between a request's later tokens.",
                      f"# TYPE {PREFIX}_time_per_output_token_seconds histogram",
                      *self.tpot.lines(f"{PREFIX}_time_per_output_token_seconds")]
        lines += [f"# TYPE {PREFIX}_requests_in_flight gauge", f"{PREFIX}_requests_in_flight {num_in_flight}",
                  f"# TYPE {PREFIX}_num_preemptions_total counter",
                  f"{PREFIX}_num_preemptions_total {getattr(engine, 'num_preemptions', 0)}"]
        if total is not None and free is not None:
            lines += [f"# TYPE {PREFIX}_kv_blocks_in_use gauge", f"{PREFIX}_kv_blocks_in_use {total - free}",
                      f"# TYPE {PREFIX}_kv_blocks_total gauge", f"{PREFIX}_kv_blocks_total {total}"]
        return "\n".join(lines) + "\n"
