"""The gateway's Prometheus metrics: plain counters and histograms updated on the hot path, and one
``GatewayMetrics`` per app that turns them (plus the workers' and the prompt cache's state, read
at scrape time) into the Prometheus text format on its own ``CollectorRegistry``.

The hot path never touches ``prometheus_client``: its ``Histogram.observe`` takes a lock per call
(~0.7 us), while ``Histogram.observe`` here is a bisect and two adds (~0.15 us), which matters at
one observation per token delta. Everything runs on the gateway's event loop, so no locks.

    | metric (agentgate_...)                     | type      | labels           | source        |
    |--------------------------------------------|-----------|------------------|---------------|
    | requests_total                             | counter   | endpoint, status | middleware    |
    | request_duration_seconds                   | histogram | endpoint         | middleware    |
    | time_to_first_token_seconds                | histogram |                  | Dispatcher    |
    | inter_token_latency_seconds                | histogram |                  | Dispatcher    |
    | {prompt,cached_prompt,generated}_tokens_total | counter |               | Finished      |
    | cached_prompt_tokens_by_tier_total         | counter   | tier             | Finished      |
    | request_cached_token_ratio                 | histogram |                  | Finished      |
    | worker_up, worker_in_flight_requests       | gauge     | worker           | WorkerClient  |
    | worker_running_requests, worker_waiting_requests | gauge | worker       | LoadReport    |
    | worker_{reconnects,new_instances}_total    | counter   | worker           | WorkerClient  |
    | worker_mtp_{verify_steps,draft_tokens,accepted_tokens}_total | counter | worker | LoadReport |
    | dispatch_retries_total                     | counter   | reason           | Dispatcher    |
    | dispatch_migrations_total                  | counter   |                  | Dispatcher    |
    | worker_requests_total                      | counter   | worker           | Dispatcher    |
    | worker_{prompt,cached_prompt,generated}_tokens_total | counter | worker | Finished      |
    | routing_decisions_total                    | counter   | router, reason   | Router        |
    | routing_index_pages, routing_index_workers | gauge     |                  | KVIndex       |
    | routing_index_{host,storage}_pages         | gauge     |                  | KVIndex       |
    | prompt_cache_{hits,misses,fallbacks,evictions,reused_tokens}_total | counter | | PromptCache |
    | prompt_cache_entries, prompt_cache_tokens  | gauge     |                  | PromptCache   |
    | sessions_{created,deleted}_total           | counter   |                  | SessionManager |
    | admission_* (queue, drain rate, waits)     | mixed     |                  | AdmissionGate |
    | retention_* (retains, releases, resumed turns and their cached tokens; per worker:
    |   retained pages, expired retentions)      | mixed     | worker           | tool_pauses   |
    | session_turns_total                        | counter   | outcome          | SessionManager |

TTFT is measured from the dispatch of the request (after templating and tokenizing, which the
request duration includes) to its first ``TokenDelta``, retries included; inter-token latency is
the gap between consecutive ``TokenDelta`` messages of one request. A worker that is not alive
(lost, reconnecting) shows ``worker_up 0`` and no running/waiting samples (they are not kept
stale); they come back with its first report after it reconnects.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from gateway.routing.types import REASONS

if TYPE_CHECKING:
    from engine.protocol import Finished
    from gateway.dispatch import Dispatcher
    from gateway.prompt_cache import PromptCache
    from sessions.manager import SessionStats

PREFIX = "agentgate_"
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                     5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                 0.5, 1.0, 2.5)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


class Histogram:
    """Cumulative-on-export bucket counts: ``counts[i]`` holds values in (bounds[i-1], bounds[i]],
    ``counts[-1]`` those above the last bound (the ``+Inf`` bucket)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        assert list(bounds) == sorted(set(bounds)), f"bounds must increase: {bounds}"
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        """Count ``value`` ``n`` times."""
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n

    @property
    def count(self) -> int:
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, float]]:
        """Prometheus ``le`` buckets (cumulative), ``+Inf`` last."""
        out, total = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts):
            total += n
            out.append((bound, total))
        return out


class StreamStats:
    """What the ``Dispatcher`` measures per request (one ``GatewayMetrics`` reads it)."""

    __slots__ = ("ttft", "itl", "cached_ratio", "prompt_tokens", "cached_tokens",
                 "cached_tokens_host", "cached_tokens_storage", "generated_tokens",
                 "num_finished", "pushed_tokens")

    def __init__(self) -> None:
        self.ttft = Histogram(LATENCY_BUCKETS_S)
        self.itl = Histogram(ITL_BUCKETS_S)
        self.cached_ratio = Histogram(RATIO_BUCKETS)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.cached_tokens_host = 0  # NOTE: of cached_tokens; the device's is the rest
        self.cached_tokens_storage = 0
        self.generated_tokens = 0
        self.num_finished = 0
        self.pushed_tokens = 0  # NOTE: written from the worker's reply (Dispatcher.push_to)

    def finished(self, item: Finished) -> None:
        self.num_finished += 1
        self.prompt_tokens += item.prompt_tokens
        self.cached_tokens += item.cached_tokens
        # NOTE: clamped as the worker does (engine.worker.publisher), so the device's share
        # (cached - host - storage) never goes below 0
        storage = min(item.cached_tokens_storage, item.cached_tokens)
        self.cached_tokens_storage += storage
        self.cached_tokens_host += min(item.cached_tokens_host, item.cached_tokens - storage)
        self.generated_tokens += item.completion_tokens
        if item.prompt_tokens:
            self.cached_ratio.observe(item.cached_tokens / item.prompt_tokens)


class WorkerTokens:
    """One worker's request and token counters (``RoutingStats.workers``)."""

    __slots__ = ("requests", "prompt_tokens", "cached_tokens", "generated_tokens")

    def __init__(self) -> None:
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generated_tokens = 0


class RoutingStats:
    """What the ``Dispatcher`` counts per routing decision and per worker.

    Attributes:
        decisions: (router name, reason) -> requests routed so (every attempt, retries too).
        workers: worker label (its endpoint) -> its counters: requests sent to it (every
            attempt), and the prompt, cached and generated tokens of those that finished there.
    """

    __slots__ = ("decisions", "workers")

    def __init__(self) -> None:
        self.decisions: dict[tuple[str, str], int] = {}
        self.workers: dict[str, WorkerTokens] = {}

    def decided(self, router: str, reason: str, worker: str) -> None:
        key = (router, reason)
        self.decisions[key] = self.decisions.get(key, 0) + 1
        self.worker(worker).requests += 1

    def finished(self, worker: str, item: Finished) -> None:
        tokens = self.worker(worker)
        tokens.prompt_tokens += item.prompt_tokens
        tokens.cached_tokens += item.cached_tokens
        tokens.generated_tokens += item.completion_tokens

    def worker(self, worker: str) -> WorkerTokens:
        if (tokens := self.workers.get(worker)) is None:
            tokens = self.workers[worker] = WorkerTokens()
        return tokens


class HttpStats:
    """Responses by (endpoint, status) and their duration by endpoint (the middleware's)."""

    __slots__ = ("requests", "durations")

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = {}
        self.durations: dict[str, Histogram] = {}

    def count(self, endpoint: str, status: int) -> None:
        key = (endpoint, status)
        self.requests[key] = self.requests.get(key, 0) + 1

    def observe(self, endpoint: str, status: int, duration_s: float) -> None:
        self.count(endpoint, status)
        if (hist := self.durations.get(endpoint)) is None:
            hist = self.durations[endpoint] = Histogram(LATENCY_BUCKETS_S)
        hist.observe(duration_s)


class GatewayMetrics:
    """One app's metrics on its own registry (several apps in one process never clash).

    Args:
        http: filled by the HTTP middleware.
        dispatcher: its ``stats`` and its clients' state are read at each scrape.
        prompt_cache: its ``stats`` and size are read at each scrape.
        sessions: the session manager's counters (None: no sessions metrics).
    """

    def __init__(
        self,
        http: HttpStats,
        dispatcher: Dispatcher,
        prompt_cache: PromptCache,
        sessions: SessionStats | None = None,
    ) -> None:
        self.http = http
        self.dispatcher = dispatcher
        self.prompt_cache = prompt_cache
        self.sessions = sessions
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def render(self) -> bytes:
        """The Prometheus text exposition of everything above."""
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        yield from self._http()
        yield from self._streams()
        yield from self._workers()
        yield from self._prompt_cache()
        yield from self._sessions()

    def _sessions(self) -> Iterator[Metric]:
        stats = self.sessions
        if stats is None:
            return
        yield _counter("sessions_created", "Sessions created", value=stats.created)
        yield _counter("sessions_deleted", "Sessions deleted", value=stats.deleted)
        turns = _counter("session_turns", "Session turns by outcome: a finish reason, "
                         "in_progress (409), aborted (worker failed) or dropped", ["outcome"])
        for reason, n in sorted(stats.turns_finished.items()):
            turns.add_metric([reason], n)
        for outcome in ("in_progress", "aborted", "dropped"):
            turns.add_metric([outcome], getattr(stats, f"turns_{outcome}"))
        yield turns

    def _http(self) -> Iterator[Metric]:
        requests = _counter("requests", "HTTP responses by endpoint and status", ["endpoint",
                                                                                  "status"])
        for (endpoint, status), n in sorted(self.http.requests.items()):
            requests.add_metric([endpoint, str(status)], n)
        yield requests
        duration = HistogramMetricFamily(
            PREFIX + "request_duration_seconds", "HTTP request duration, to the last body byte",
            labels=["endpoint"])
        for endpoint, hist in sorted(self.http.durations.items()):
            duration.add_metric([endpoint], hist.buckets(), hist.sum)
        yield duration

    def _streams(self) -> Iterator[Metric]:
        stats = self.dispatcher.stats
        yield _histogram("time_to_first_token_seconds",
                         "From dispatch to the first token delta (retries included)", stats.ttft)
        yield _histogram("inter_token_latency_seconds",
                         "Per generated token after a request's first: the gap since the "
                         "previous one as the gateway received them (0 for tokens that came "
                         "in one message)", stats.itl)
        yield _histogram("request_cached_token_ratio",
                         "Per finished request: worker-cached prompt tokens / prompt tokens",
                         stats.cached_ratio)
        yield _counter("prompt_tokens", "Prompt tokens of finished requests",
                       value=stats.prompt_tokens)
        yield _counter("cached_prompt_tokens",
                       "Prompt tokens of finished requests found in a worker's prefix cache",
                       value=stats.cached_tokens)
        yield self._cached_by_tier()
        yield _counter("generated_tokens", "Completion tokens of finished requests",
                       value=stats.generated_tokens)
        yield _counter("stream_pushed_tokens",
                       "Streamed tokens written to their client straight from the worker's "
                       "reply (chat and session-turn SSE streams without stop strings or logprobs; "
                       "the rest pass the stream's layers)",
                       value=stats.pushed_tokens)

    def _cached_by_tier(self) -> CounterMetricFamily:
        stats = self.dispatcher.stats
        host, storage = stats.cached_tokens_host, stats.cached_tokens_storage
        tiers = _counter("cached_prompt_tokens_by_tier",
                         "cached_prompt_tokens_total split by where the worker found their KV: "
                         "device (its GPU prefix cache, L1), host (its host memory, L2) or "
                         "storage (the shared GCache, L3, loaded through L2); the three sum to "
                         "cached_prompt_tokens_total", ["tier"])
        tiers.add_metric(["device"], stats.cached_tokens - host - storage)
        tiers.add_metric(["host"], host)
        tiers.add_metric(["storage"], storage)
        return tiers

    def _workers(self) -> Iterator[Metric]:
        """NOTE: a worker that is not alive (lost, reconnecting) has ``worker_up`` 0 and no
        running/waiting samples at all (no stale load); they come back with its next report."""
        labels = ["worker"]
        up = _gauge("worker_up", "1 while the worker answers, 0 while lost or reconnecting",
                    labels)
        in_flight = _gauge("worker_in_flight_requests", "Requests this gateway has on it", labels)
        running = _gauge("worker_running_requests", "num_running of its last LoadReport", labels)
        waiting = _gauge("worker_waiting_requests", "num_waiting of its last LoadReport", labels)
        reconnects = _counter("worker_reconnects", "Times the worker answered again after it "
                              "was lost (connection lost, silent, restarted)", labels)
        # NOTE: not worker_restarts_total: agentgate serve's Supervisor counts the restarts of
        # the workers it spawned under that name; this one also sees attached workers
        new_instances = _counter("worker_new_instances", "Times another worker process "
                                 "(instance_id) answered on the worker's endpoint", labels)
        # NOTE: MTP (--mtp K): acceptance length = 1 + accepted / verify_steps
        mtp = {name: _counter(f"worker_mtp_{name}", help_, labels) for name, help_ in (
            ("verify_steps", "Request-steps that verified MTP drafts (its last LoadReport)"),
            ("draft_tokens", "MTP draft tokens verified (its last LoadReport)"),
            ("accepted_tokens", "MTP draft tokens accepted (its last LoadReport)"))}
        hints = _counter("worker_unsupported_hints", "Retention hints (Retain, retain_ttl_s) "
                         "the worker's backend accepted and ignored (the sglang backend has no "
                         "retention; its last LoadReport)", labels)
        for client in self.dispatcher.clients:
            key = [client.endpoint]
            up.add_metric(key, float(client.is_alive))
            in_flight.add_metric(key, client.num_in_flight)
            reconnects.add_metric(key, client.num_reconnects)
            new_instances.add_metric(key, client.num_new_instances)
            if client.is_alive and (load := client.last_load) is not None:
                running.add_metric(key, load.num_running)
                waiting.add_metric(key, load.num_waiting)
                if load.unsupported_hints:
                    hints.add_metric(key, load.unsupported_hints)
                if load.mtp_verify_steps:
                    for name, value in (("verify_steps", load.mtp_verify_steps),
                                        ("draft_tokens", load.mtp_draft_tokens),
                                        ("accepted_tokens", load.mtp_accepted_tokens)):
                        mtp[name].add_metric(key, value)
        yield from (up, in_flight, running, waiting, reconnects, new_instances, hints,
                    *mtp.values())
        retries = _counter("dispatch_retries", "Requests moved to another worker before their "
                           "first token, by reason (worker_lost, overloaded)", ["reason"])
        for reason in ("worker_lost", "overloaded"):
            retries.add_metric([reason], self.dispatcher.num_retries[reason])
        yield retries
        yield _counter("dispatch_migrations", "Streams moved to another worker after their first "
                       "token, their worker lost (gateway.attempts)",
                       value=self.dispatcher.num_migrations)
        yield from self._routing()

    def _routing(self) -> Iterator[Metric]:
        """Per-worker counters (a worker's label: its endpoint, as ``worker_up``), routing
        decisions by router and reason, and the KV index's size."""
        routing = self.dispatcher.routing
        labels = ["worker"]
        requests = _counter("worker_requests", "Requests sent to the worker (retries too)",
                            labels)
        prompt = _counter("worker_prompt_tokens", "Prompt tokens of requests finished on the "
                          "worker", labels)
        cached = _counter("worker_cached_prompt_tokens", "Prompt tokens of requests finished on "
                          "the worker that its prefix cache served", labels)
        generated = _counter("worker_generated_tokens", "Completion tokens of requests finished "
                             "on the worker", labels)
        for client in self.dispatcher.clients:  # NOTE: every worker, 0 until it serves
            routing.worker(client.endpoint)
        for worker, tokens in sorted(routing.workers.items()):
            requests.add_metric([worker], tokens.requests)
            prompt.add_metric([worker], tokens.prompt_tokens)
            cached.add_metric([worker], tokens.cached_tokens)
            generated.add_metric([worker], tokens.generated_tokens)
        yield from (requests, prompt, cached, generated)
        decisions = _counter("routing_decisions", "Routing decisions by router and reason "
                             "(affinity, prefix, load, moved_for_load, cold)", ["router", "reason"])
        router = self.dispatcher.router_name
        for reason in REASONS:  # NOTE: every reason of the router in use, 0 until it happens
            routing.decisions.setdefault((router, reason), 0)
        for (name, reason), n in sorted(routing.decisions.items()):
            decisions.add_metric([name, reason], n)
        yield decisions
        yield _gauge("routing_index_pages", "KV pages the router's index holds over all "
                     "workers", value=self.dispatcher.index_pages)
        yield _gauge("routing_index_workers", "Workers whose KV events feed the index",
                     value=self.dispatcher.index_workers)
        yield _gauge("routing_index_host_pages", "Host-memory (L2) KV pages the router's index "
                     "holds over all workers", value=self.dispatcher.index_host_pages)
        yield _gauge("routing_index_storage_pages", "KV pages of the shared GCache (L3) the "
                     "router's index holds, as of its last KV event or match (entries age out "
                     "unconfirmed after its storage TTL)",
                     value=self.dispatcher.index_storage_pages)
        if (gate := self.dispatcher.gate) is not None:
            yield from gate.collect()  # NOTE: agentgate_admission_* (gateway.admission_gate)
        yield from self._retention()

    def _retention(self) -> Iterator[Metric]:
        """``agentgate_retention_*`` (``gateway.tool_pauses``); a worker not alive has none."""
        from gateway.tool_pauses import retention_of

        loads = [(c.endpoint, c.last_load if c.is_alive else None)
                 for c in self.dispatcher.clients]
        yield from retention_of(self.dispatcher).collect(loads)

    def _prompt_cache(self) -> Iterator[Metric]:
        cache = self.prompt_cache
        stats = cache.stats
        help_ = {
            "hits": "Prompts that extended a cached conversation",
            "misses": "Prompts rendered and tokenized in full",
            "fallbacks": "Misses because a cut or prefix check failed",
            "evictions": "Conversations dropped from the cache",
            "reused_tokens": "Prompt tokens taken from the cache instead of tokenized",
            "tokenized_tokens": "Prompt tokens tokenized (not taken from the cache)",
            "cpu_seconds": "CPU time spent rendering and tokenizing prompts",
        }
        for name, text in help_.items():
            value = stats.cpu_s if name == "cpu_seconds" else getattr(stats, name)
            yield _counter(f"prompt_cache_{name}", text, value=value)
        yield _gauge("prompt_cache_entries", "Conversations held", value=cache.num_entries)
        yield _gauge("prompt_cache_tokens", "Token ids held over all entries",
                     value=cache.num_tokens)


def _counter(
    name: str, text: str, labels: list[str] | None = None, value: float | None = None
) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, text, labels=labels, value=value)


def _gauge(
    name: str, text: str, labels: list[str] | None = None, value: float | None = None
) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, text, labels=labels, value=value)


def _histogram(name: str, text: str, hist: Histogram) -> HistogramMetricFamily:
    return HistogramMetricFamily(PREFIX + name, text, buckets=hist.buckets(), sum_value=hist.sum)
