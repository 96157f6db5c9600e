"""Tool-pause KV retention: keep a turn's resume point on its worker while a tool runs.

When a turn ends in tool calls, its session (or stateless conversation) will most likely come
back with the tool results, and the next prompt starts with this turn's whole prompt and answer.
The worker holds that prefix's end SWA checkpoint (the window a hit needs) only as long as
nothing evicts it; ``Retain(request_id, ttl_s)`` asks it to keep it ``ttl_s`` more seconds::

    ttl_s = tracker.paused(key, request_id, tenant, tool_names, now_s)   # sends Retain(ttl_s)
    pause = tracker.resumed(key, now_s)       # next turn arrived: learn the pause
    ...                                       # its request is dispatched (it hit the checkpoint)
    tracker.release(pause)                    # sends Retain(0)
    tracker.forget(key)                       # session deleted: release now

``PauseLearner`` picks the TTL per (tenant, tool name): the ``quantile`` (p90) of the recent pauses
observed, capped at ``max_ttl_s``, and ``default_ttl_s`` until ``min_samples`` pauses are known.
A key with few samples falls back to the tenant's pauses over all tools, then to the tool's over
all tenants. Memory is bounded: ``max_samples`` pauses per key (a ring), ``max_keys`` keys (LRU).

Pure (no clock reads: callers pass ``now_s``); the ``send_retain`` callback is
``Dispatcher.retain`` live and the sim's retain in a replay.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.protocol import LoadReport

# NOTE: published agent traces: median pause ~2 s, p99 ~11 min (routers.md §6, §10). A 10 min
# cap keeps ~98-99 % of returns warm for tools that are slow, while an abandoned session holds
# its pages at most 10 min; retained pages are a hint the engine evicts last, not a pin.
DEFAULT_TTL_S = 60.0
MAX_TTL_S = 600.0
MIN_TTL_S = 1.0


class PauseLearner:
    """TTLs from observed tool pauses (see the module docstring).

    Args:
        default_ttl_s: the TTL while a key has fewer than ``min_samples`` pauses.
        max_ttl_s, min_ttl_s: the clamp of every learned TTL.
        quantile: which quantile of the recent pauses (0.9: p90).
        min_samples: pauses a key needs before its own quantile is trusted.
        max_samples: recent pauses kept per key.
        max_keys: keys kept (least recently used go first).
    """

    def __init__(
        self,
        default_ttl_s: float = DEFAULT_TTL_S,
        max_ttl_s: float = MAX_TTL_S,
        quantile: float = 0.9,
        min_samples: int = 8,
        *,
        min_ttl_s: float = MIN_TTL_S,
        max_samples: int = 64,
        max_keys: int = 4096,
    ) -> None:
        assert 0 <= min_ttl_s <= max_ttl_s and default_ttl_s >= 0, (min_ttl_s, max_ttl_s)
        assert 0 < quantile <= 1 and 1 <= min_samples <= max_samples and max_keys > 0
        self.default_ttl_s = min(default_ttl_s, max_ttl_s)
        self.max_ttl_s, self.min_ttl_s = max_ttl_s, min_ttl_s
        self.quantile, self.min_samples = quantile, min_samples
        self.max_samples, self.max_keys = max_samples, max_keys
        self._pauses: OrderedDict[tuple[str, ...], deque[float]] = OrderedDict()

    def observe(self, tenant: str, tool_names: Iterable[str], pause_s: float) -> None:
        """A turn that ended in calls of ``tool_names`` was followed by the next one after
        ``pause_s`` seconds (ignored when negative or not finite)."""
        if not math.isfinite(pause_s) or pause_s < 0:
            return
        keys = {("tenant", tenant)}
        for name in set(tool_names):
            keys.update({("tool", tenant, name), ("any", name)})
        for key in keys:
            self._ring(key).append(pause_s)

    def ttl_s(self, tenant: str, tool_names: Iterable[str],
              default_ttl_s: float | None = None) -> float:
        """How long to retain after a turn that called ``tool_names``: the longest of their
        learned TTLs (the next turn waits for every result); ``default_ttl_s`` (else the
        learner's) until enough pauses are known."""
        names = set(tool_names) or {""}
        default = self.default_ttl_s if default_ttl_s is None else default_ttl_s
        return max(self._ttl_of(tenant, name, min(default, self.max_ttl_s)) for name in names)

    @property
    def num_keys(self) -> int:
        return len(self._pauses)

    def _ttl_of(self, tenant: str, name: str, default_ttl_s: float) -> float:
        for key in (("tool", tenant, name), ("tenant", tenant), ("any", name)):
            pauses = self._pauses.get(key)
            if pauses is not None and len(pauses) >= self.min_samples:
                self._pauses.move_to_end(key)
                return self._clamp(quantile_of(pauses, self.quantile))
        return default_ttl_s

    def _clamp(self, ttl_s: float) -> float:
        return min(self.max_ttl_s, max(self.min_ttl_s, ttl_s))

    def _ring(self, key: tuple[str, ...]) -> deque[float]:
        ring = self._pauses.get(key)
        if ring is None:
            ring = self._pauses[key] = deque(maxlen=self.max_samples)
            while len(self._pauses) > self.max_keys:
                self._pauses.popitem(last=False)
        self._pauses.move_to_end(key)
        return ring


def quantile_of(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (nearest rank, the smallest value with at least ``q`` of the values at
    or below it)."""
    ordered = sorted(values)
    assert ordered, "quantile of nothing"
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True, slots=True)
class Pause:
    """A turn that ended in tool calls, whose resume point is retained."""

    request_id: str
    tenant: str
    tool_names: tuple[str, ...]
    since_s: float
    ttl_s: float


class ToolPauseRetention:
    """Which conversations are paused in a tool call, and their Retains (module docstring).

    Args:
        learner: the TTLs.
        send_retain: ``(request_id, ttl_s) -> sent``; ``Dispatcher.retain`` live.
        max_paused: conversations tracked at once (the oldest is released past it).

    Attributes (for /metrics): ``num_retains`` (Retains sent), ``num_releases``, ``num_resumed``
    (turns that followed a tool pause), ``resumed_prompt_tokens``, ``resumed_cached_tokens``
    (their prompt tokens, and those a worker served from cache: the hits after a pause).
    """

    def __init__(self, learner: PauseLearner | None = None,
                 send_retain: Callable[[str, float], bool] | None = None,
                 max_paused: int = 100_000) -> None:
        assert max_paused > 0
        self.learner = learner or PauseLearner()
        self.send_retain = send_retain or (lambda _rid, _ttl: False)
        self.max_paused = max_paused
        self._paused: OrderedDict[str, Pause] = OrderedDict()
        # NOTE: requests that followed a tool pause, until their end is counted (bounded: one
        # that never reports its end is dropped oldest first)
        self._resumed_requests: OrderedDict[str, None] = OrderedDict()
        self.num_retains = 0
        self.num_releases = 0
        self.num_resumed = 0
        self.resumed_prompt_tokens = 0
        self.resumed_cached_tokens = 0

    def paused(self, key: str, request_id: str, tenant: str, tool_names: Sequence[str],
               now_s: float, default_ttl_s: float | None = None) -> float | None:
        """Turn ``request_id`` of conversation ``key`` ended in calls of ``tool_names``: retain
        its resume point for the learned TTL (``default_ttl_s`` until one is learned). Returns
        the TTL sent (None: not sent)."""
        self.forget(key)  # NOTE: an earlier pause of the same conversation is superseded
        ttl_s = self.learner.ttl_s(tenant, tool_names, default_ttl_s)
        if ttl_s <= 0 or not self.send_retain(request_id, ttl_s):
            return None
        self.num_retains += 1
        self._paused[key] = Pause(request_id, tenant, tuple(tool_names), now_s, ttl_s)
        while len(self._paused) > self.max_paused:
            _, oldest = self._paused.popitem(last=False)
            self.release(oldest)
        return ttl_s

    def resumed(self, key: str, now_s: float) -> Pause | None:
        """The next turn of ``key`` arrived: learn the pause. The caller releases the returned
        pause once the new turn is dispatched (its prefill found the checkpoint)."""
        pause = self._paused.pop(key, None)
        if pause is not None:
            self.learner.observe(pause.tenant, pause.tool_names, now_s - pause.since_s)
        return pause

    def resumed_request(self, request_id: str) -> None:
        """``request_id`` followed a tool pause: count its cache hit at ``request_ended``."""
        self._resumed_requests[request_id] = None
        while len(self._resumed_requests) > self.max_paused:
            self._resumed_requests.popitem(last=False)

    def request_ended(self, request_id: str, prompt_tokens: int, cached_tokens: int) -> None:
        if self._resumed_requests.pop(request_id, 0) is None:
            self.hit_after_pause(prompt_tokens, cached_tokens)

    def hit_after_pause(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A turn that followed a tool pause got ``cached_tokens`` of its prompt from cache."""
        self.num_resumed += 1
        self.resumed_prompt_tokens += prompt_tokens
        self.resumed_cached_tokens += cached_tokens

    def release(self, pause: Pause | None) -> None:
        if pause is not None and self.send_retain(pause.request_id, 0.0):
            self.num_releases += 1

    def forget(self, key: str) -> None:
        """The conversation ended (session deleted): release its retention now."""
        self.release(self._paused.pop(key, None))

    def is_paused(self, key: str) -> bool:
        return key in self._paused

    @property
    def num_paused(self) -> int:
        return len(self._paused)

    def num_retained(self, now_s: float) -> int:
        """The paused conversations whose retention has not expired at ``now_s``. NOTE: an
        expired pause stays tracked (``num_paused``) so that a late resume still teaches the
        learner how long the pause really was; a scan, for scrapes only."""
        return sum(1 for p in self._paused.values() if p.since_s + p.ttl_s > now_s)

    def collect(self, loads: Iterable[tuple[str, LoadReport | None]] = (), *,
                now_s: float | None = None) -> Iterator[Metric]:
        """The retention metrics (``agentgate_retention_*``); ``loads``: (worker, its last
        LoadReport) for the workers' retained pages and expiries; ``now_s``: the clock the
        pauses were given (``time.monotonic()`` by default)."""
        p = "agentgate_retention_"
        now_s = time.monotonic() if now_s is None else now_s
        yield GaugeMetricFamily(p + "paused_conversations", "Conversations paused in a tool "
                                "call with their resume point retained (TTL not run out)",
                                value=self.num_retained(now_s))
        for name, text, value in (
            ("retains", "Retain messages sent after a turn ended in tool calls",
             self.num_retains),
            ("releases", "Retains released (next turn dispatched, session deleted)",
             self.num_releases),
            ("resumed_turns", "Turns that followed a tool pause", self.num_resumed),
            ("resumed_prompt_tokens", "Prompt tokens of turns that followed a tool pause",
             self.resumed_prompt_tokens),
            ("resumed_cached_tokens", "Of those, tokens served from a worker's cache (hits "
             "after a pause)", self.resumed_cached_tokens),
        ):
            yield CounterMetricFamily(p + name, text, value=value)
        pages = GaugeMetricFamily(p + "worker_retained_pages", "Pages a worker holds only for "
                                  "retentions (its last LoadReport)", labels=["worker"])
        expired = CounterMetricFamily(p + "worker_expired", "Retentions whose TTL ran out before "
                                      "a request used them (its last LoadReport)",
                                      labels=["worker"])
        for worker, load in loads:
            if load is not None:
                pages.add_metric([worker], load.retained_pages)
                expired.add_metric([worker], load.retains_expired)
        yield pages
        yield expired
