"""The router's interface: what the dispatcher (live) and ``agentgate replay`` (virtual time) ask
and tell a routing policy. Every policy, ours and the baselines, implements ``Router``; both
callers drive it through the same calls, so a replay measures the code that serves.

Life of a request, as the caller reports it::

    decision = router.route(RouteRequest(...), candidates)   # pick a worker
    router.dispatched(req, decision.worker_id, now_s)        # sent (after admission)
    router.first_token(req.request_id, now_s)                # its prefill is done
    router.finished(req.request_id, now_s)                   # ended (also on error or abort)

Clocks are seconds on the caller's clock (``time.monotonic()`` live, virtual in a replay); a
router never reads a clock itself. Routers are not thread-safe; the caller serializes calls (the
KV index has its own lock for the event threads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.cost import CostModel
from engine.protocol import LoadReport


@dataclass(slots=True)
class RouteRequest:
    """One request to place.

    Attributes:
        request_id: unique among requests in flight.
        num_tokens: prompt tokens.
        page_hashes: chained hashes (``engine.hashing``, salted by ``cache_salt``) of the
            prompt's full pages that a worker could serve from cache: the first
            ``(num_tokens - 1) // page_size`` (the last prompt token is always computed).
        affinity_key: what ties this request to earlier ones: a session id, an ``X-Session-ID``
            header, ``prompt_cache_key``, or ``user`` (the caller picks, in that order).
        sticky_worker: the worker the affinity key was last sent to, as the session store
            knows it (shared by gateway replicas); None to use the router's own memory.
        tenant: who pays (the key's tenant); "" for none.
        max_new_tokens: the output budget (decode load estimate).
    """

    request_id: str
    num_tokens: int
    page_hashes: Sequence[int] = ()
    affinity_key: str | None = None
    sticky_worker: str | None = None
    tenant: str = ""
    max_new_tokens: int = 0


# NOTE: routing-decision reasons, also the labels of the routing metrics
REASONS = ("affinity", "prefix", "load", "moved_for_load", "cold")


@dataclass(frozen=True, slots=True)
class Decision:
    """Where to send a request, and why.

    Attributes:
        cached_tokens: prompt tokens the router expects the worker to serve from cache (window-
            safe credit; 0 for policies that do not know).
        reason: one of ``REASONS``: kept its affinity, followed a prefix match, went by load
            alone, moved off its sticky worker for load, or had nothing to go by.
        predicted_ttft_s: the policy's prediction (0 for policies without one).
    """

    worker_id: str
    cached_tokens: int = 0
    reason: str = "load"
    predicted_ttft_s: float = 0.0


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker announced in ``Welcome``.

    Attributes:
        rank: the worker's place in the routers' tie-break order: the gateway's configured
            order, so that ties do not depend on which worker's ``Welcome`` came first. None:
            after the ranked ones, in the order added.
        swa_page_events: its KV events announce SWA per page (``Welcome.swa_page_events``).
    """

    worker_id: str
    page_size: int
    cost: CostModel = field(default_factory=CostModel)
    max_batched_tokens: int = 512
    sliding_window: int | None = None
    rank: int | None = None
    swa_page_events: bool = False


class Router(Protocol):
    """A routing policy (see the module docstring for the call order)."""

    name: str

    def add_worker(self, info: WorkerInfo) -> None: ...

    def remove_worker(self, worker_id: str) -> None:
        """The worker left or restarted: forget what it held and what was in flight on it."""

    def route(self, req: RouteRequest, candidates: Sequence[str]) -> Decision:
        """Pick one of ``candidates`` (live, not excluded; never empty)."""

    def dispatched(self, req: RouteRequest, worker_id: str, now_s: float) -> None: ...

    def first_token(self, request_id: str, now_s: float) -> None: ...

    def finished(self, request_id: str, now_s: float) -> None: ...

    def load_report(self, worker_id: str, report: LoadReport, now_s: float) -> None:
        """A worker's own view of its load (from its events socket), for drift correction."""


@dataclass(slots=True)
class _InFlight:
    worker_id: str
    prefill_tokens: int  # NOTE: uncached prompt tokens, until the first token
    decoding: bool = False


class LoadTracker:
    """The router's own count of each worker's work in flight, from the calls it gets.

    A worker's ``prefill_tokens`` are the uncached prompt tokens of its requests that have not
    produced a first token yet (queued or prefilling); ``num_decoding`` its requests past their
    first token. Counting at dispatch, not at the next load report, is what keeps a burst from
    all landing on the worker that looked idle a moment ago.
    """

    def __init__(self) -> None:
        self._requests: dict[str, _InFlight] = {}
        self._prefill: dict[str, int] = {}
        self._decoding: dict[str, int] = {}
        self._in_flight: dict[str, int] = {}

    def add_worker(self, worker_id: str) -> None:
        for counts in (self._prefill, self._decoding, self._in_flight):
            counts.setdefault(worker_id, 0)

    def remove_worker(self, worker_id: str) -> None:
        for rid in [r for r, f in self._requests.items() if f.worker_id == worker_id]:
            del self._requests[rid]
        for counts in (self._prefill, self._decoding, self._in_flight):
            counts.pop(worker_id, None)

    def dispatched(self, request_id: str, worker_id: str, uncached_tokens: int) -> None:
        if worker_id not in self._in_flight:
            self.add_worker(worker_id)
        if request_id in self._requests:
            self.finished(request_id)
        self._requests[request_id] = _InFlight(worker_id, uncached_tokens)
        self._prefill[worker_id] += uncached_tokens
        self._in_flight[worker_id] += 1

    def first_token(self, request_id: str) -> None:
        f = self._requests.get(request_id)
        if f is None or f.decoding:
            return
        self._prefill[f.worker_id] -= f.prefill_tokens
        self._decoding[f.worker_id] += 1
        f.prefill_tokens, f.decoding = 0, True

    def finished(self, request_id: str) -> None:
        f = self._requests.pop(request_id, None)
        if f is None:
            return
        self._prefill[f.worker_id] -= f.prefill_tokens
        self._decoding[f.worker_id] -= f.decoding
        self._in_flight[f.worker_id] -= 1

    def worker_of(self, request_id: str) -> str | None:
        f = self._requests.get(request_id)
        return None if f is None else f.worker_id

    def prefill_tokens(self, worker_id: str) -> int:
        return self._prefill.get(worker_id, 0)

    def num_decoding(self, worker_id: str) -> int:
        return self._decoding.get(worker_id, 0)

    def num_in_flight(self, worker_id: str) -> int:
        return self._in_flight.get(worker_id, 0)
