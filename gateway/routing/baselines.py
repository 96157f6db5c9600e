"""Baseline routers: what other gateways do, behind our ``Router`` interface, so that
``agentgate replay`` and the live dispatcher compare them with ours on the same calls.

Each one models a published policy's default configuration, including its blind spots:

    | name                 | models                                  | file                   |
    |----------------------|-----------------------------------------|------------------------|
    | round-robin          | every gateway's ``round_robin``         | here                   |
    | least-loaded         | agentgate's dispatcher before issue 9   | here                   |
    | session-hash         | vLLM production-stack ``session``       | here                   |
    | lmetric              | LMetric (SMG / Dynamo ``lmetric``)      | here                   |
    | sglang-cache-aware   | SGLang router ``cache_aware``           | baselines_sglang.py    |
    | dynamo               | Dynamo KV router, linear cost           | baselines_kv.py        |
    | llm-d                | llm-d EPP "sticky until saturated"      | baselines_kv.py        |

Routers that read the KV index credit the RAW prefix match (``MatchResult.full_pages``): none of
the real ones can see a hit lost to the SWA window. ``Decision.cached_tokens`` is what the policy
believes it will hit, not what the engine will give. Load is the router's own count of work in
flight (``LoadTracker``), as the real ones keep it; none of them polls worker load in its default
configuration, so ``load_report`` is ignored.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

from engine.protocol import LoadReport
from gateway.routing.index import KVIndex, MatchResult
from gateway.routing.types import Decision, LoadTracker, RouteRequest, WorkerInfo

RING_POINTS_PER_WORKER = 160  # NOTE: uhashring's ketama default (40 vnodes x 4 replicas)
MAX_SESSIONS = 100_000  # the dispatcher's default bound of its session -> worker map


class BaselineRouter:
    """What the baselines share: the worker list in tie-break order (by ``WorkerInfo.rank``,
    then in the order added), the router-side ``LoadTracker``, and the life-cycle calls.

    Subclasses implement ``route`` and, when they know a prefix match, ``_cached_tokens``.
    """

    name = ""

    def __init__(self) -> None:
        self.load = LoadTracker()
        self.workers: dict[str, WorkerInfo | None] = {}

    def add_worker(self, info: WorkerInfo) -> None:
        self.workers[info.worker_id] = info
        self.load.add_worker(info.worker_id)
        if info.rank is not None:  # NOTE: stable: unranked ones keep their order, last
            ranks = {w: i.rank for w, i in self.workers.items() if i is not None}
            self.workers = dict(sorted(
                self.workers.items(),
                key=lambda kv: (1, 0) if ranks.get(kv[0]) is None else (0, ranks[kv[0]])))

    def remove_worker(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)
        self.load.remove_worker(worker_id)

    def route(self, req: RouteRequest, candidates: Sequence[str]) -> Decision:
        raise NotImplementedError

    def dispatched(self, req: RouteRequest, worker_id: str, now_s: float) -> None:
        self._known(worker_id)
        uncached = max(req.num_tokens - self._cached_tokens(req, worker_id), 0)
        self.load.dispatched(req.request_id, worker_id, uncached)

    def first_token(self, request_id: str, now_s: float) -> None:
        self.load.first_token(request_id)

    def finished(self, request_id: str, now_s: float) -> None:
        self.load.finished(request_id)

    def load_report(self, worker_id: str, report: LoadReport, now_s: float) -> None:
        """Ignored: the modeled policies count load themselves (see the module docstring)."""

    # ---------------------------------------------------------------- helpers

    def _cached_tokens(self, req: RouteRequest, worker_id: str) -> int:
        """Prompt tokens the policy believes ``worker_id`` holds (its in-flight prefill load)."""
        return 0

    def _known(self, worker_id: str) -> None:
        # NOTE: a candidate the caller never announced still gets a place in the order
        if worker_id not in self.workers:
            self.workers[worker_id] = None
            self.load.add_worker(worker_id)

    def _ordered(self, candidates: Sequence[str]) -> list[str]:
        """``candidates`` in the tie-break order (``self.workers``')."""
        for w in candidates:
            self._known(w)
        wanted = set(candidates)
        return [w for w in self.workers if w in wanted]

    def _least_in_flight(self, candidates: Sequence[str]) -> str:
        return min(self._ordered(candidates), key=self.load.num_in_flight)


class IndexedRouter(BaselineRouter):
    """A baseline that reads the KV index's raw (SWA-blind) match."""

    def __init__(self, index: KVIndex) -> None:
        super().__init__()
        self.index = index
        self.page_size = index.page_size
        self._last: tuple[str, dict[str, MatchResult]] | None = None

    def _match(self, req: RouteRequest, fresh: bool = False) -> dict[str, MatchResult]:
        """``index.match`` of the request (``fresh``: asked again), kept for the ``dispatched``
        call that follows, so the load counted there is what the route believed."""
        if not fresh and self._last is not None and self._last[0] == req.request_id:
            return self._last[1]
        matches = self.index.match(req.page_hashes) if req.page_hashes else {}
        self._last = (req.request_id, matches)
        return matches

    def _raw_cached(self, matches: dict[str, MatchResult], worker_id: str, num_tokens: int) -> int:
        m = matches.get(worker_id)
        return 0 if m is None else min(m.full_pages * self.page_size, num_tokens)

    def _cached_tokens(self, req: RouteRequest, worker_id: str) -> int:
        return self._raw_cached(self._match(req), worker_id, req.num_tokens)


class RoundRobinRouter(BaselineRouter):
    """Cycles over the workers in the order added, skipping those not among the candidates."""

    name = "round-robin"

    def __init__(self) -> None:
        super().__init__()
        self._last: str | None = None

    def route(self, req: RouteRequest, candidates: Sequence[str]) -> Decision:
        self._ordered(candidates)
        order = list(self.workers)
        start = order.index(self._last) + 1 if self._last in self.workers else 0
        wanted = set(candidates)
        pick = next(order[(start + i) % len(order)] for i in range(len(order))
                    if order[(start + i) % len(order)] in wanted)
        self._last = pick
        return Decision(pick, reason="load")


class LeastLoadedRouter(BaselineRouter):
    """``gateway/dispatch.py`` ``Dispatcher.pick`` before issue 9: a session stays on its worker
    while that worker is a candidate; otherwise the fewest requests in flight, then the fewest
    sessions assigned, then the next worker in round-robin order after the last pick."""

    name = "least-loaded"

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        super().__init__()
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._num_sessions: dict[str, int] = {}
        self._next = 0

    def remove_worker(self, worker_id: str) -> None:
        super().remove_worker(worker_id)
        self._num_sessions.pop(worker_id, None)

    def route(self, req: RouteRequest, candidates: Sequence[str]) -> Decision:
        key = req.affinity_key
        sticky = req.sticky_worker or (self._sessions.get(key) if key is not None else None)
        if sticky is not None and sticky in candidates:
            if key is not None and key in self._sessions:
                self._sessions.move_to_end(key)
            return Decision(sticky, reason="affinity")
        self._ordered(candidates)
        order = list(self.workers)
        n, wanted = len(order), set(candidates)
        best = min((i for i, w in enumerate(order) if w in wanted),
                   key=lambda i: (self.load.num_in_flight(order[i]),
                                  self._num_sessions.get(order[i], 0), (i - self._next) % n))
        self._next = (best + 1) % n
        if key is not None:
            self._remember(key, order[best])
        moved = sticky is not None  # NOTE: its worker is gone or excluded
        return Decision(order[best], reason="moved_for_load" if moved else "load")

    def _remember(self, key: str, worker_id: str) -> None:
        if (previous := self._sessions.get(key)) is not None:
            self._num_sessions[previous] = self._num_sessions.get(previous, 0) - 1
        self._sessions[key] = worker_id
        self._num_sessions[worker_id] = self._num_sessions.get(worker_id, 0) + 1
        self._sessions.move_to_end(key)
        if len(self._sessions) > self.max_sessions:
            _, evicted = self._sessions.popitem(last=False)
            self._num_sessions[evicted] = self._num_sessions.get(evicted, 0) - 1


class SessionHashRouter(BaselineRouter):
    """vLLM production-stack ``session``: a consistent-hash ring over the workers (ketama-like,
    ``RING_POINTS_PER_WORKER`` points each) keyed by the affinity key; requests without one go
    to the fewest in flight (production-stack: lowest QPS). A key whose worker is not a
    candidate goes to the next point clockwise that is, which is what rebuilding the ring over
    the live workers gives."""

    name = "session-hash"

    def __init__(self, points_per_worker: int = RING_POINTS_PER_WORKER) -> None:
        super().__init__()
        self.points_per_worker = points_per_worker
        self._ring: list[tuple[int, str]] = []

    def add_worker(self, info: WorkerInfo) -> None:
        super().add_worker(info)
        self._rebuild()

    def remove_worker(self, worker_id: str) -> None:
        super().remove_worker(worker_id)
        self._rebuild()

    def route(self, req: RouteRequest, candidates: Sequence[str]) -> Decision:
        if req.affinity_key is None:
            return Decision(self._least_in_flight(candidates), reason="cold")
        if any(w not in self.workers for w in candidates):
            self._ordered(candidates)
            self._rebuild()
        wanted = set(candidates)
        start = bisect.bisect(self._ring, (_hash64(req.affinity_key), ""))
        n = len(self._ring)
        pick = next(w for i in range(n) if (w := self._ring[(start + i) % n][1]) in wanted)
        return Decision(pick, reason="affinity")

    def _rebuild(self) -> None:
        self._ring = sorted((_hash64(f"{w}-{i}"), w)
                            for w in self.workers for i in range(self.points_per_worker))


class LMetricRouter(IndexedRouter):
    """LMetric (arXiv 2603.15202; SMG's and Dynamo's ``lmetric``): score = this request's
    uncached prefill tokens on w x (requests in flight on w + 1), argmin; ties: fewer in
    flight, then the order added. Credit is the raw prefix match."""

    name = "lmetric"

    def route(self, req: RouteRequest, candidates: Sequence[str]) -> Decision:
        matches = self._match(req, fresh=True)
        order = self._ordered(candidates)

        def score(w: str) -> tuple[int, int]:
            uncached = req.num_tokens - self._raw_cached(matches, w, req.num_tokens)
            return uncached * (self.load.num_in_flight(w) + 1), self.load.num_in_flight(w)

        pick = min(order, key=score)
        cached = self._raw_cached(matches, pick, req.num_tokens)
        return Decision(pick, cached_tokens=cached, reason="prefix" if cached else "load")


def _hash64(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode("utf-8"))
