"""``AgentgateRouter``: window-safe prefix credit, predicted time to first token, sticky until
saturated, and optimistic entries for bursts.

For each candidate worker ``w`` and request ``r``::

    cached_w  = index.match(r.page_hashes)[w].usable_pages * page_size    (never full_pages)
    ttft_w    = cost.predict_ttft_s(w's CostModel, its in-flight prefill and decodes, r's
                                    uncached = num_tokens - cached_w)
    score_w   = ttft_w + work_weight * prefill_work_s(r's uncached on w)

The pick is the lowest score; ties go to the fewest requests in flight, then round robin from the
last pick (so cold requests on idle workers spread). ``work_weight`` charges the prefill work a
choice adds to the worker (what it delays everyone after it by): between two near-equal TTFTs the
one that computes less wins.

Sticky until saturated: a request with an ``affinity_key`` stays on the worker the key was last
sent to (``sticky_worker`` when the caller knows it from the session store, else the router's
own memory) while that worker's predicted TTFT is within ``margin_s`` seconds OR within
``margin_ratio`` times the best candidate's; past both it moves (``reason="moved_for_load"``).

Optimistic entries: on ``dispatched`` the request's pages go into the index's side table on its
worker for ``optimistic_ttl_s`` seconds (``KVIndex.predict``), with two predicted resume points
(both are points the engine itself will have a live window at): the end of the routable prompt
(the running request's own window covers it, and a checkpoint stays there), and the end of the
worker's raw match when it lies beyond the usable one (an observed branch point: the engine
recomputes the window there and marks it). Pages in between get full-KV credit only.

Clocks: the router never reads one. ``route`` has no time argument in the ``Router`` protocol, so
it uses the latest ``now_s`` any call brought (``now_s=`` may be passed to ``route`` to be exact).

Not thread-safe: the caller serializes calls; ``lock`` (the ``KVEventSubscriber``'s) is held
around index access.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.cost import CostModel
from engine.protocol import LoadReport
from gateway.routing.cost import predict_ttft_s, prefill_qk_pairs, prefill_work_s
from gateway.routing.index import KVIndex, MatchResult
from gateway.routing.types import Decision, LoadTracker, RouteRequest, WorkerInfo

DEFAULT_MARGIN_S = 0.5
DEFAULT_MARGIN_RATIO = 1.5
DEFAULT_OPTIMISTIC_TTL_S = 5.0
DEFAULT_WORK_WEIGHT = 0.5
DEFAULT_MAX_AFFINITY_KEYS = 100_000
DEFAULT_MAX_BATCHED_TOKENS = 512


@dataclass(slots=True)
class _Estimate:
    worker_id: str
    cached_tokens: int
    full_tokens: int
    ttft_s: float
    score: float
    qk_pairs: int


@dataclass(slots=True)
class _Sent:
    worker_id: str
    qk_pairs: int
    prefilling: bool = True


class AgentgateRouter:
    """Our policy (module docstring). Implements ``gateway.routing.types.Router``.

    Args:
        index: the KV index the workers' events feed.
        margin_s, margin_ratio: stickiness (see above); a sticky worker is left only when its
            TTFT exceeds the best by more than both.
        optimistic_ttl_s: lifetime of optimistic entries (0 disables them).
        work_weight: weight of a choice's own prefill work in the score (0: TTFT alone).
        max_affinity_keys: affinity keys remembered (least recently used dropped).
        lock: held around index reads and writes (``KVEventSubscriber.lock``).
    """

    name = "agentgate"

    def __init__(
        self,
        index: KVIndex,
        *,
        margin_s: float = DEFAULT_MARGIN_S,
        margin_ratio: float = DEFAULT_MARGIN_RATIO,
        optimistic_ttl_s: float = DEFAULT_OPTIMISTIC_TTL_S,
        work_weight: float = DEFAULT_WORK_WEIGHT,
        max_affinity_keys: int = DEFAULT_MAX_AFFINITY_KEYS,
        lock: contextlib.AbstractContextManager | None = None,
    ) -> None:
        if margin_s < 0 or margin_ratio < 1 or optimistic_ttl_s < 0 or work_weight < 0:
            raise ValueError(f"margin_s={margin_s} (>= 0), margin_ratio={margin_ratio} (>= 1), "
                             f"optimistic_ttl_s={optimistic_ttl_s} (>= 0), "
                             f"work_weight={work_weight} (>= 0)")
        self.index = index
        self.page_size = index.page_size
        self.margin_s, self.margin_ratio = margin_s, margin_ratio
        self.optimistic_ttl_s, self.work_weight = optimistic_ttl_s, work_weight
        self.max_affinity_keys = max_affinity_keys
        self.load = LoadTracker()
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self._workers: dict[str, WorkerInfo] = {}
        self._order: dict[str, int] = {}  # worker -> position in the round-robin ring
        self._next_position = 0
        self._rr = 0
        self._queued_qk: dict[str, int] = {}
        self._sent: dict[str, _Sent] = {}
        self._routed: OrderedDict[str, _Estimate] = OrderedDict()  # route() -> dispatched()
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._now_s = 0.0

    # ---------------------------------------------------------------- membership

    def add_worker(self, info: WorkerInfo) -> None:
        self._workers[info.worker_id] = info
        if info.worker_id not in self._order:
            self._order[info.worker_id] = self._next_position
            self._next_position += 1
        self.load.add_worker(info.worker_id)
        self._queued_qk.setdefault(info.worker_id, 0)
        with self._lock:
            # NOTE: what the index knows already (events, or whoever built it) stands
            if self.index.window_pages(info.worker_id) is None:
                self.index.add_worker(info.worker_id, window_pages=_window_pages(info))
            else:
                self.index.add_worker(info.worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget the worker: its load, its in-flight requests, affinities to it, its pages."""
        self._workers.pop(worker_id, None)
        self._order.pop(worker_id, None)
        self.load.remove_worker(worker_id)
        self._queued_qk.pop(worker_id, None)
        for rid in [r for r, s in self._sent.items() if s.worker_id == worker_id]:
            del self._sent[rid]
        for key in [k for k, w in self._affinity.items() if w == worker_id]:
            del self._affinity[key]
        with self._lock:
            self.index.remove_worker(worker_id)

    # ---------------------------------------------------------------- routing

    def route(
        self, req: RouteRequest, candidates: Sequence[str], now_s: float | None = None
    ) -> Decision:
        """Pick one of ``candidates`` (never empty). See the module docstring."""
        if not candidates:
            raise ValueError("route: no candidates")
        if now_s is not None:
            self._now_s = max(self._now_s, now_s)
        with self._lock:
            matches = self.index.match(req.page_hashes, self._now_s) if req.page_hashes else {}
        estimates = [self._estimate(req, w, matches.get(w)) for w in candidates]
        best = min(estimates, key=self._rank_key)
        chosen, reason = best, self._reason(best, estimates)
        sticky = self._sticky_worker(req)
        if sticky is not None:
            mine = next((e for e in estimates if e.worker_id == sticky), None)
            if mine is not None:
                if self._keeps(mine, best):
                    chosen, reason = mine, "affinity"
                else:
                    reason = "moved_for_load"
        self._rr = self._order.get(chosen.worker_id, self._rr) + 1
        self._remember_route(req.request_id, chosen)
        return Decision(chosen.worker_id, chosen.cached_tokens, reason, chosen.ttft_s)

    def dispatched(self, req: RouteRequest, worker_id: str, now_s: float) -> None:
        self._now_s = max(self._now_s, now_s)
        est = self._routed.pop(req.request_id, None)
        if est is None or est.worker_id != worker_id:
            with self._lock:
                match = self.index.match(req.page_hashes, now_s).get(worker_id)
            est = self._estimate(req, worker_id, match)
        uncached = req.num_tokens - est.cached_tokens
        self.load.dispatched(req.request_id, worker_id, uncached)
        self._sent[req.request_id] = _Sent(worker_id, est.qk_pairs)
        self._queued_qk[worker_id] = self._queued_qk.get(worker_id, 0) + est.qk_pairs
        if req.affinity_key is not None:
            self._affinity[req.affinity_key] = worker_id
            self._affinity.move_to_end(req.affinity_key)
            while len(self._affinity) > self.max_affinity_keys:
                self._affinity.popitem(last=False)
        if self.optimistic_ttl_s > 0 and req.page_hashes:
            self._predict(req, worker_id, est, now_s)

    def first_token(self, request_id: str, now_s: float) -> None:
        self._now_s = max(self._now_s, now_s)
        self.load.first_token(request_id)
        self._end_prefill(request_id)

    def finished(self, request_id: str, now_s: float) -> None:
        self._now_s = max(self._now_s, now_s)
        self.load.finished(request_id)
        self._end_prefill(request_id)
        self._sent.pop(request_id, None)
        self._routed.pop(request_id, None)

    def load_report(self, worker_id: str, report: LoadReport, now_s: float) -> None:
        """Only advances the clock: the router's own counts are exact for what it sent; a
        worker shared with other gateways is not modelled (TODO(issue 9): drift correction)."""
        self._now_s = max(self._now_s, now_s)

    def sticky_worker(self, affinity_key: str) -> str | None:
        """The worker ``affinity_key`` was last sent to, as this router remembers it."""
        return self._affinity.get(affinity_key)

    # ---------------------------------------------------------------- internals

    def _estimate(self, req: RouteRequest, worker_id: str, m: MatchResult | None) -> _Estimate:
        info = self._workers.get(worker_id)
        cost = info.cost if info is not None else CostModel()
        batch = info.max_batched_tokens if info is not None else DEFAULT_MAX_BATCHED_TOKENS
        p = self.page_size
        # NOTE: the last prompt token is always computed, whatever the hashes claim
        cached = 0 if m is None else min(m.usable_pages * p, max(0, req.num_tokens - 1))
        full = 0 if m is None else m.full_pages * p
        uncached = max(1, req.num_tokens - cached)
        qk = prefill_qk_pairs(cached, uncached, batch)
        ttft = predict_ttft_s(
            cost, batch, uncached_tokens=uncached, qk_pairs=qk,
            queued_tokens=max(0, self.load.prefill_tokens(worker_id)),
            queued_qk_pairs=max(0, self._queued_qk.get(worker_id, 0)),
            num_decoding=max(0, self.load.num_decoding(worker_id)),
        )
        score = ttft + self.work_weight * prefill_work_s(cost, uncached, qk)
        return _Estimate(worker_id, cached, full, ttft, score, qk)

    def _rank_key(self, e: _Estimate) -> tuple[float, int, int]:
        n = max(1, self._next_position)
        position = (self._order.get(e.worker_id, n) - self._rr) % n
        return (e.score, self.load.num_in_flight(e.worker_id), position)

    def _keeps(self, mine: _Estimate, best: _Estimate) -> bool:
        return (mine.ttft_s <= best.ttft_s + self.margin_s
                or mine.ttft_s <= best.ttft_s * self.margin_ratio)

    @staticmethod
    def _reason(best: _Estimate, estimates: list[_Estimate]) -> str:
        if best.cached_tokens > 0:
            return "prefix"
        if any(e.cached_tokens > 0 for e in estimates):
            return "load"
        return "cold"

    def _sticky_worker(self, req: RouteRequest) -> str | None:
        if req.sticky_worker is not None:
            return req.sticky_worker
        if req.affinity_key is None:
            return None
        return self._affinity.get(req.affinity_key)

    def _remember_route(self, request_id: str, est: _Estimate) -> None:
        self._routed[request_id] = est
        self._routed.move_to_end(request_id)
        # NOTE: a routed request that is never dispatched (shed, client gone) must not pile up
        while len(self._routed) > 4096:
            self._routed.popitem(last=False)

    def _end_prefill(self, request_id: str) -> None:
        s = self._sent.get(request_id)
        if s is not None and s.prefilling:
            s.prefilling = False
            self._queued_qk[s.worker_id] = self._queued_qk.get(s.worker_id, 0) - s.qk_pairs

    def _predict(self, req: RouteRequest, worker_id: str, est: _Estimate, now_s: float) -> None:
        p = self.page_size
        n = len(req.page_hashes)
        raw = min(n, est.full_tokens // p)  # NOTE: confirmed or predicted: the engine's raw match
        ends = [n]
        if est.cached_tokens // p < raw < n:
            ends.append(raw)  # NOTE: an observed branch point (module docstring)
        with self._lock:
            # NOTE: pages already confirmed need no entry (a 100k-token turn adds only its delta)
            confirmed = self.index.confirmed_pages(worker_id, req.page_hashes)
            self.index.predict(worker_id, req.page_hashes, now_s + self.optimistic_ttl_s,
                               from_page=confirmed, checkpoint_pages=ends)


def _window_pages(info: WorkerInfo) -> int | None:
    """k = ceil(W / page) pages, 0 for a model without SWA layers."""
    if info.sliding_window is None:
        return 0
    return -(-info.sliding_window // info.page_size)
