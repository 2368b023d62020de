"""Prometheus metrics for the server: vLLM-compatible names plus a `ddtree_` namespace.

The `vllm:` series keep vLLM's names and labels so its dashboards and `vllm bench serve` (which reads the
spec-decode counters before and after a run) work unchanged. Latency histograms get buckets fine enough
for batch-1 speculative decoding, where a token arrives every 1-5 ms. Each `ServerMetrics` owns its own
registry, so several servers (or tests) in one process never share counters.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ddtree import __version__

# Per-token / per-round latencies (s): vLLM's ITL buckets start at 10 ms, which would put every DDTree token
# into the first bucket.
FINE_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
                0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
# vLLM's TTFT buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM's request-latency buckets (0.3 ... 7680 s) with a fine low end: short requests and queue waits on a
# fast model are milliseconds.
REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0,
                   10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TOKENS_PER_SECOND_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
PHASES = ("draft", "tree_build", "verify", "commit", "total")
# The engine's phase keys -> the exposed `phase` label.
_ENGINE_PHASES = {"draft": "draft", "tree": "tree_build", "verify": "verify", "commit": "commit"}


# Window of ddtree_generation_tokens_per_second: long enough to smooth bursts, short enough to scale on.
THROUGHPUT_WINDOW_SECONDS = 30


class TokenThroughput:
    """The generated-tokens counter plus its recent rate: tokens per second over the last `window` seconds,
    kept in one-second buckets. Autoscalers scale on the rate as a gauge, which a custom metrics API
    (prometheus-adapter) serves without rate rules."""

    def __init__(self, counter: Counter, window: int = THROUGHPUT_WINDOW_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._counter, self._window, self._clock = counter, window, clock
        self._buckets: deque[list[float]] = deque()  # [second, tokens], oldest first
        self._lock = threading.Lock()

    def inc(self, amount: float = 1) -> None:
        """Count generated tokens (what the reply calls as it writes them to its client)."""
        self._counter.inc(amount)
        second = int(self._clock())
        with self._lock:
            if self._buckets and self._buckets[-1][0] == second:
                self._buckets[-1][1] += amount
            else:
                self._buckets.append([second, amount])
            self._expire(second)

    def rate(self) -> float:
        """Tokens per second over the window (read when /metrics is scraped)."""
        with self._lock:
            self._expire(int(self._clock()))
            return sum(tokens for _, tokens in self._buckets) / self._window

    def _expire(self, now: int) -> None:
        while self._buckets and self._buckets[0][0] <= now - self._window:
            self._buckets.popleft()


def one_two_five_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return tuple(out)
            out.append(step * scale)
        scale *= 10


class ServerMetrics:
    """Every series the server exposes, and the observation code the scheduler calls."""

    def __init__(self, model_name: str, *, method: str, budget: int | None, block_size: int,
                 max_model_len: int) -> None:
        self.registry = CollectorRegistry()
        self.block_size = block_size
        labels = {"model_name": model_name, "engine": "0"}
        names = list(labels)
        reg = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*names, *extra], registry=reg)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=reg)

        def histogram(name: str, doc: str, buckets, extra: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, [*names, *extra], buckets=buckets, registry=reg)

        # Scheduler state.
        self.running = gauge("vllm:num_requests_running", "Requests being decoded.").labels(**labels)
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting in the queue.").labels(**labels)
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "Share of KV cache blocks in use (0-1).").labels(
            **labels)
        self.preemptions = counter("vllm:num_preemptions",
                                   "Requests preempted (caches dropped, recomputed later).").labels(**labels)
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.").labels(**labels)
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache (not prefilled).").labels(**labels)
        # Throughput counters (exposed with the `_total` suffix).
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.").labels(**labels)
        self.generation_tokens = TokenThroughput(counter("vllm:generation_tokens",
                                                         "Generated tokens returned to clients.").labels(**labels))
        gauge("ddtree_generation_tokens_per_second",
              f"Generated tokens per second over the last {THROUGHPUT_WINDOW_SECONDS} s (what the operator's "
              "autoscaling.target.tokensPerSecond scales on).").labels(**labels).set_function(
            self.generation_tokens.rate)
        self._success = counter("vllm:request_success", "Finished requests by finish reason.",
                                ("finished_reason",))
        self._labels = labels
        for reason in ("stop", "length", "abort"):
            self._success.labels(**labels, finished_reason=reason)
        self._rejected = counter("ddtree_requests_rejected", "Requests refused before decoding, by reason.",
                                 ("reason",))
        # Request latencies.
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first token.",
                              TTFT_BUCKETS).labels(**labels)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Time between successive outputs (one per verify round).",
                             FINE_BUCKETS).labels(**labels)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Per request: decode time / (output tokens - 1).", FINE_BUCKETS).labels(**labels)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.",
                             REQUEST_BUCKETS).labels(**labels)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Time waiting in the queue.",
                                    REQUEST_BUCKETS).labels(**labels)
        self.inference_time = histogram("vllm:request_inference_time_seconds", "Scheduled to last token.",
                                        REQUEST_BUCKETS).labels(**labels)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", "Scheduled to first token.",
                                      REQUEST_BUCKETS).labels(**labels)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "First token to last token.",
                                     REQUEST_BUCKETS).labels(**labels)
        token_buckets = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.",
                                               token_buckets).labels(**labels)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Generated tokens per request.", token_buckets).labels(**labels)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Tokens processed by the target per engine step.",
                                          ITERATION_TOKEN_BUCKETS).labels(**labels)
        # Speculative decoding, vLLM names.
        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Verify rounds (per request).").labels(**labels)
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                        "Draft tree nodes verified, root excluded.").labels(**labels)
        self.num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens",
                                           "Accepted draft tokens, bonus excluded.").labels(**labels)
        per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                          "Rounds whose accepted depth reached position + 1.", ("position",))
        self.accepted_per_pos = [per_pos.labels(**labels, position=str(p)) for p in range(block_size)]
        # DDTree namespace.
        self.accepted_length = histogram("ddtree_spec_accepted_length",
                                         "Tokens committed per verify round, bonus included.",
                                         tuple(range(1, block_size + 1))).labels(**labels)
        node_buckets = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, *([budget] if budget else [])})
        self.tree_nodes = histogram("ddtree_tree_nodes", "Draft nodes verified per round.",
                                    node_buckets).labels(**labels)
        self._round_seconds = histogram("ddtree_round_seconds", "Seconds per round phase.", FINE_BUCKETS,
                                        ("phase",))
        self.round_seconds = {p: self._round_seconds.labels(**labels, phase=p) for p in PHASES}
        self.token_itl = histogram("ddtree_inter_token_latency_seconds",
                                   "Per token: a round of n tokens adds n observations of interval / n.",
                                   FINE_BUCKETS).labels(**labels)
        self.verify_batch_tokens = histogram("ddtree_verify_batch_tokens",
                                             "Rows one verify forward takes: every request's root and tree.",
                                             ITERATION_TOKEN_BUCKETS).labels(**labels)
        self.batch_size = histogram("ddtree_batch_size", "Requests whose round ran in one engine step.",
                                    ITERATION_TOKEN_BUCKETS).labels(**labels)
        self.step_draft_nodes = histogram("ddtree_step_draft_nodes",
                                          "Draft nodes one engine step verified over all its requests (the batch "
                                          "budget's choice).", ITERATION_TOKEN_BUCKETS).labels(**labels)
        self.batch_budget = gauge("ddtree_batch_budget",
                                  "Draft nodes the last engine step verified over all its requests.").labels(**labels)
        self.tokens_per_second = histogram("ddtree_request_tokens_per_second",
                                           "Per request: decode tokens per second.",
                                           TOKENS_PER_SECOND_BUCKETS).labels(**labels)
        gauge("ddtree_tree_budget", "Configured DDTree node budget.").labels(**labels).set(budget or 0)
        gauge("ddtree_block_size", "Drafter block size.").labels(**labels).set(block_size)
        Gauge("ddtree_info", "Server configuration.", [*names, "method", "version"],
              registry=reg).labels(**labels, method=method, version=__version__).set(1)

    def finished(self, reason: str) -> None:
        """Count a request that ended: `stop`, `length` or `abort`."""
        self._success.labels(**self._labels, finished_reason=reason).inc()

    def rejected(self, reason: str) -> None:
        """Count a request refused before it reached the engine (`queue_full`, `draining`, ...)."""
        self._rejected.labels(**self._labels, reason=reason).inc()

    def observe_step(self, step) -> None:
        """Record one engine step (engine/batch.py StepStats): tokens, batch size, the batch budget's choice,
        preemptions, the prefix cache's lookups and the phases of its rounds."""
        self.prefix_cache_queries.inc(step.prefix_queries)
        self.prefix_cache_hits.inc(step.prefix_hits)
        if step.sequences == 0 and step.prefill_tokens == 0:
            return
        self.iteration_tokens.observe(step.prefill_tokens + step.verified_tokens)
        self.preemptions.inc(step.preempted)
        if step.sequences == 0:
            return
        self.verify_batch_tokens.observe(step.verified_tokens)
        self.batch_size.observe(step.sequences)
        self.step_draft_nodes.observe(step.draft_nodes)
        self.batch_budget.set(step.draft_nodes)
        total = 0.0
        for key, seconds in step.phase_seconds.items():
            phase = _ENGINE_PHASES.get(key)
            if phase is not None:
                self.round_seconds[phase].observe(seconds)
                total += seconds
        self.round_seconds["total"].observe(total)

    def observe_round(self, *, draft_nodes: int, accepted: int) -> None:
        """Record one request's verify round (never the prefill): what it drafted and accepted."""
        if draft_nodes == 0:  # autoregressive step: nothing was drafted
            return
        self.num_drafts.inc()
        self.num_draft_tokens.inc(draft_nodes)
        self.num_accepted_tokens.inc(accepted)
        for pos in range(min(accepted, self.block_size)):  # the accepted nodes form one root path
            self.accepted_per_pos[pos].inc()
        self.accepted_length.observe(accepted + 1)
        self.tree_nodes.observe(draft_nodes)

    def exposition(self) -> bytes:
        """The Prometheus text format of every series."""
        return generate_latest(self.registry)
