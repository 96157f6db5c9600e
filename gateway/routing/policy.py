"""``AgentgateRouter``: window-safe prefix credit, predicted time to first token, sticky until
saturated, and optimistic entries for bursts.

For each candidate worker ``w`` and request ``r``, with ``m = index.match(r.page_hashes)[w]``::

    cached_w  = (m.usable_pages                                          (never full_pages)
                 - (1 - host_credit) * m.host_pages                      (loaded from its L2)
                 - (1 - storage_credit) * m.storage_pages) * page_size   (fetched from L3)
    ttft_w    = cost.predict_ttft_s(w's CostModel, its in-flight prefill and decodes, r's
                                    uncached = num_tokens - cached_w)
    score_w   = ttft_w + work_weight * prefill_work_s(r's uncached on w)

The pick is the lowest score; scores within ``tie_steps`` step overheads of it tie, and ties go to
the fewest requests in flight, then round robin from the last pick. A credit whose prefill saving
is no more than ``tie_steps`` step overheads does not score at all (noise), so cold requests, and
new sessions whose shared system prompt saves less than a step, spread over idle workers.
``work_weight`` charges the prefill work a choice adds to the worker (what it delays everyone
after it by): between two near-equal TTFTs the one that computes less wins.

Sticky until saturated: a request with an ``affinity_key`` stays on the worker the key was last
sent to (``sticky_worker`` when the caller knows it from the session store, else the router's
own memory) while that worker's predicted TTFT is within ``margin_s`` seconds OR within
``margin_ratio`` times the best candidate's; past both it moves (``reason="moved_for_load"``).

With ``prefix_affinity`` (default 0.3), a request without a sticky worker is held the same way
on the candidate with the most credit, when that credit covers at least that fraction of its
prompt (the prefix owner: llm-d's affinity, released at saturation). ``history_credit`` (default
0) also credits that fraction of the full-KV pages past the window-safe point: a bet on SWA
history the engine keeps while memory allows, which the events do not show.

Tier credit: a usable page the worker must load from a tier below its device counts as a
fraction of a device hit (``host_credit``, ``storage_credit``; see their defaults), so with equal
load a worker holding the prefix on its device beats one holding it in host memory, which beats
one that can only fetch it from the shared store, which beats one that must recompute it. The
discounted figure is the ``cached_tokens`` of the ``Decision`` (admission's "uncached" work).

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
from typing import NamedTuple

from engine.cost import CostModel
from engine.protocol import LoadReport
from gateway.routing.cost import prefill_qk_pairs, prefill_work_s, ttft_s
from gateway.routing.index import KVIndex, MatchResult
from gateway.routing.types import Decision, LoadTracker, RouteRequest, WorkerInfo

DEFAULT_MARGIN_S = 0.5
DEFAULT_MARGIN_RATIO = 1.5
DEFAULT_OPTIMISTIC_TTL_S = 5.0
DEFAULT_WORK_WEIGHT = 8.0
DEFAULT_PREFIX_AFFINITY = 0.3
DEFAULT_TIE_STEPS = 1.0
# NOTE: work_weight 8: once the index saw history SWA (SwaBlocksStored), weighing a choice's own
# prefill work more kept more hits. Replaying conversation_trace.jsonl (8 workers, h200, 0.6M
# tokens of KV each, admission on), work_weight 1 / 8 / 12 / 16 gave hit 29.7 / 30.7 / 30.9 /
# 30.9 %, TTFT mean 0.578 / 0.574 / 0.575 / 0.577 s and p99 3.996 / 4.031 / 4.058 / 4.063 s:
# past 8 the hits no longer pay for the queueing. At 1M tokens a worker, 1 -> 12 took hit
# 31.2 -> 32.3 % and the mean 0.568 -> 0.566 s; the agent workload is unchanged (its turns
# follow their session). prefix_affinity 0.3 came from the same trace.
# NOTE: tier credit, from load costs (per token, relative to recomputing it: 1 = free). An L2
# hit is a host -> device copy over PCIe (~25-50 GB/s, overlapped layer by layer with compute;
# a 16-token page of a hybrid model's KV is ~0.1-1 MB, so tens of us a page against ms of
# prefill), plus the device pages it needs (eviction) and the chance that L2 evicts it before
# the request lands: worth about half a device hit. An L3 hit adds a network fetch (Redis or a
# shared file: ~1-10 GB/s and a round trip, during which the request waits in the queue) and a
# belief the router cannot refresh (L3 never reports removals; entries age out by a TTL): a
# quarter. Both stay far above 0, since both are far cheaper than recompute, and below each
# other, so the order device > host > storage > nothing holds at equal load.
DEFAULT_HOST_CREDIT = 0.5
DEFAULT_STORAGE_CREDIT = 0.25
DEFAULT_MAX_AFFINITY_KEYS = 100_000
DEFAULT_MAX_BATCHED_TOKENS = 512


class _Consts(NamedTuple):
    cost: CostModel
    batch: int  # max_batched_tokens


_DEFAULT_CONSTS = _Consts(CostModel(), DEFAULT_MAX_BATCHED_TOKENS)


@dataclass(slots=True)
class _Estimate:
    worker_id: str
    cached_tokens: int  # NOTE: tier-discounted credit (what the worker's work is counted as)
    full_tokens: int
    ttft_s: float
    score: float
    qk_pairs: int
    tier_tokens: int = 0  # NOTE: the tier discount taken off cached_tokens (usable = the sum)


# (worker, its match, window-safe cached tokens, predicted TTFT s, qk pairs of the prefill)
_Pick = tuple[str, MatchResult | None, int, float, int]


@dataclass(slots=True)
class _Sent:
    worker_id: str
    uncached_tokens: int
    qk_pairs: int
    prefilling: bool = True


# NOTE: a worker's load as route() reads it, one list per worker: LoadTracker's counts (kept in
# step with it: the property test checks) plus the (query, key) pairs of the prefills ahead
PREFILL, QK, DECODING, IN_FLIGHT = range(4)
_IDLE = (0, 0, 0, 0)


class AgentgateRouter:
    """Our policy (module docstring). Implements ``gateway.routing.types.Router``.

    Args:
        index: the KV index the workers' events feed.
        margin_s, margin_ratio: stickiness (see above); a sticky worker is left only when its
            TTFT exceeds the best by more than both.
        optimistic_ttl_s: lifetime of optimistic entries (0 disables them).
        work_weight: weight of a choice's own prefill work in the score (0: TTFT alone).
        max_affinity_keys: affinity keys remembered (least recently used dropped).
        history_credit: fraction (0..1) of the full-KV pages beyond the window-safe point
            credited anyway, betting on SWA history the engine keeps while memory allows (the
            events do not show it). 0 (the default): window-safe credit only.
        prefix_affinity: a request without a sticky worker stays on the candidate with the
            most credit when that covers at least this fraction of its prompt, within the same
            margins (0: off, the lowest score decides).
        tie_steps: scores within this many step overheads of the best one tie (then fewest
            in flight, then round robin); also the least a prefix must save to make its owner
            sticky under ``prefix_affinity``.
        host_credit, storage_credit: what a usable page counts for when the worker must load
            it from its host memory (L2) / the shared store (L3), as a fraction of a device
            hit (1 >= host_credit >= storage_credit >= 0; defaults in the NOTE above them).
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
        history_credit: float = 0.0,
        prefix_affinity: float = DEFAULT_PREFIX_AFFINITY,
        tie_steps: float = DEFAULT_TIE_STEPS,
        host_credit: float = DEFAULT_HOST_CREDIT,
        storage_credit: float = DEFAULT_STORAGE_CREDIT,
        lock: contextlib.AbstractContextManager | None = None,
    ) -> None:
        if margin_s < 0 or margin_ratio < 1 or optimistic_ttl_s < 0 or work_weight < 0:
            raise ValueError(f"margin_s={margin_s} (>= 0), margin_ratio={margin_ratio} (>= 1), "
                             f"optimistic_ttl_s={optimistic_ttl_s} (>= 0), "
                             f"work_weight={work_weight} (>= 0)")
        if not 1 >= host_credit >= storage_credit >= 0:
            raise ValueError(f"host_credit={host_credit}, storage_credit={storage_credit}: "
                             "need 1 >= host_credit >= storage_credit >= 0")
        self.index = index
        self.page_size = index.page_size
        self.margin_s, self.margin_ratio = margin_s, margin_ratio
        self.optimistic_ttl_s, self.work_weight = optimistic_ttl_s, work_weight
        self.max_affinity_keys = max_affinity_keys
        self.history_credit = history_credit
        self.prefix_affinity = prefix_affinity
        self.tie_steps = tie_steps
        # NOTE: what a page loaded from L2 / L3 is short of a device hit, in pages
        self._tier_discount = (1.0 - host_credit, 1.0 - storage_credit)
        self.host_credit, self.storage_credit = host_credit, storage_credit
        self.load = LoadTracker()
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self._workers: dict[str, WorkerInfo] = {}
        self._consts: dict[str, _Consts] = {}
        self._interned: dict[_Consts, _Consts] = {}
        self._order: dict[str, int] = {}  # worker -> position in the ring (WorkerInfo.rank)
        self._next_position = 0
        self._rr = 0
        self._wl: dict[str, list[int]] = {}
        self._sent: dict[str, _Sent] = {}
        self._routed: OrderedDict[str, _Estimate] = OrderedDict()  # route() -> dispatched()
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._now_s = 0.0

    # ---------------------------------------------------------------- membership

    def add_worker(self, info: WorkerInfo) -> None:
        self._workers[info.worker_id] = info
        # NOTE: one object per distinct (cost, batch): route() shares figures between workers
        # by the object's id
        c = _Consts(info.cost, info.max_batched_tokens)
        self._consts[info.worker_id] = self._interned.setdefault(c, c)
        if info.worker_id not in self._order:
            position = self._next_position if info.rank is None else info.rank
            self._order[info.worker_id] = position
            self._next_position = max(self._next_position, position + 1)
        self.load.add_worker(info.worker_id)
        self._wl.setdefault(info.worker_id, [0, 0, 0, 0])
        with self._lock:
            # NOTE: what the index knows already (events, or whoever built it) stands
            if self.index.window_pages(info.worker_id) is None:
                self.index.add_worker(info.worker_id, window_pages=_window_pages(info),
                                      per_page_swa=info.swa_page_events)
            else:
                self.index.add_worker(info.worker_id, per_page_swa=info.swa_page_events)

    def remove_worker(self, worker_id: str) -> None:
        """Forget the worker: its load, its in-flight requests, affinities to it, its pages."""
        self._workers.pop(worker_id, None)
        self._consts.pop(worker_id, None)
        self._order.pop(worker_id, None)
        self.load.remove_worker(worker_id)
        self._wl.pop(worker_id, None)
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
        sticky = self._sticky_worker(req)
        best, mine, owner = self._pick(req, candidates, matches, sticky)
        chosen = best
        reason = "prefix" if best[2] else ("load" if owner is not None else "cold")
        if mine is None and owner is not None and owner is not best and self.prefix_affinity \
                and owner[2] >= self.prefix_affinity * req.num_tokens \
                and self._keeps(owner[3], best[3]):
            chosen, reason = owner, "prefix"  # NOTE: the prefix owner is sticky too
        if mine is not None:
            if self._keeps(mine[3], best[3]):
                chosen, reason = mine, "affinity"
            else:
                reason = "moved_for_load"
        w, m, cached, ttft, qk = chosen
        full = 0 if m is None else m.full_pages * self.page_size
        tier = 0 if m is None else _tier_discount_tokens(m, self._tier_discount, self.page_size)
        chosen = _Estimate(w, max(0, cached), full, ttft, 0.0, qk, tier)
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
        self._release(req.request_id)  # NOTE: as LoadTracker: a re-sent id ends the old one
        self._sent[req.request_id] = _Sent(worker_id, uncached, est.qk_pairs)
        wl = self._wl.get(worker_id)
        if wl is None:
            wl = self._wl[worker_id] = [0, 0, 0, 0]
        wl[PREFILL] += uncached
        wl[QK] += est.qk_pairs
        wl[IN_FLIGHT] += 1
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
        s = self._sent.get(request_id)
        if s is not None and s.prefilling:
            s.prefilling = False
            wl = self._wl.get(s.worker_id)
            if wl is not None:
                wl[PREFILL] -= s.uncached_tokens
                wl[QK] -= s.qk_pairs
                wl[DECODING] += 1

    def finished(self, request_id: str, now_s: float) -> None:
        self._now_s = max(self._now_s, now_s)
        self.load.finished(request_id)
        self._release(request_id)
        self._routed.pop(request_id, None)

    def load_report(self, worker_id: str, report: LoadReport, now_s: float) -> None:
        """Only advances the clock: the router's own counts are exact for what it sent; a
        worker shared with other gateways is not modelled (TODO(issue 9): drift correction)."""
        self._now_s = max(self._now_s, now_s)

    def sticky_worker(self, affinity_key: str) -> str | None:
        """The worker ``affinity_key`` was last sent to, as this router remembers it."""
        return self._affinity.get(affinity_key)

    # ---------------------------------------------------------------- internals

    def _pick(
        self, req: RouteRequest, candidates: Sequence[str], matches: dict[str, MatchResult],
        sticky: str | None,
    ) -> tuple[_Pick, _Pick | None, _Pick | None]:
        """The lowest-scoring candidate, the sticky one's figures (None if not a candidate),
        and the one with the most credit (None if none has any; ties: the lower score)."""
        mine = None
        picks: list[_Pick] = []
        scores: list[float] = []
        top = 0  # the most credit a candidate has
        # NOTE: the per-candidate work is inlined (no call, no tuple but the pick): it runs for
        # every worker on every request (loadtest/bench_router.py); the tie-breaks after the
        # loop look only at the candidates they concern
        memo: dict[tuple[int, int, int, int, int], tuple[float, int, float]] = {}
        consts, wls, ww = self._consts, self._wl, self.work_weight
        hc, p, num_tokens = self.history_credit, self.page_size, req.num_tokens
        last, steps, discount = num_tokens - 1, self.tie_steps, self._tier_discount
        for w in candidates:
            m = matches.get(w)
            c = consts.get(w, _DEFAULT_CONSTS)
            scored = cached = 0
            if m is not None:
                cached = (m[1] if hc == 0 else _credit_pages(m, hc)) * p
                if m[2] or m[3]:
                    cached -= _tier_discount_tokens(m, discount, p)
                if cached > last:
                    cached = last  # NOTE: the last prompt token is always computed
                # NOTE: a credit that saves no more than tie_steps step overheads is noise and
                # does not score (else work_weight times it outweighs the tie band, and a
                # one-page shared system prompt pulls every new session onto its owner)
                cost = c.cost
                if cached * cost.prefill_s_per_token > steps * cost.step_overhead_s:
                    scored = cached
            wl = wls.get(w, _IDLE)
            # NOTE: workers alike in cost, credit and load share one figure (a fleet's idle
            # workers that hold only the shared system prompt: most of them, most of the time)
            key = (scored, id(c), wl[PREFILL], wl[QK], wl[DECODING])
            fig = memo.get(key)
            if fig is None:
                fig = memo[key] = self._figures(c, scored, num_tokens, wl, ww)
            pick = (w, m, cached, fig[0], fig[1])
            picks.append(pick)
            scores.append(fig[2])
            if w == sticky:
                mine = pick
            if cached > top:
                top = cached
        tie = self._tie
        # NOTE: the lowest (score, tie) sets the band; scores within it tie (a cached page that
        # saves less than a step's overhead is noise) and the ties spread: fewest in flight,
        # then round robin. Without the band a one-page shared system prompt pulls every new
        # session onto its owner.
        low = min(scores)
        first = scores.index(low)
        if scores.count(low) > 1:
            first = min((i for i, s in enumerate(scores) if s == low),
                        key=lambda i: tie(picks[i][0]))
        band = self.tie_steps * consts.get(picks[first][0], _DEFAULT_CONSTS).cost.step_overhead_s
        limit = low + band
        inside = [i for i, s in enumerate(scores) if s <= limit]
        if len(inside) > 1:
            inside[0] = min(inside, key=lambda i: (tie(picks[i][0]), picks[i][0]))
        best = picks[inside[0]]
        if top <= 0:
            return best, mine, None
        # NOTE: the prefix owner: the most credit, ties to the lower (score, tie)
        owners = [i for i, pick in enumerate(picks) if pick[2] == top]
        if len(owners) > 1:
            owners[0] = min(owners, key=lambda i: (scores[i], tie(picks[i][0])))
        owner = picks[owners[0]]
        if owner[0] == best[0]:
            owner = best
        elif top * consts.get(owner[0], _DEFAULT_CONSTS).cost.prefill_s_per_token <= band:
            owner = None  # NOTE: its prefix saves less than a step: not worth sticking to
        return best, mine, owner

    def _estimate(self, req: RouteRequest, worker_id: str, m: MatchResult | None) -> _Estimate:
        """``route``'s figures for one worker (for a request sent somewhere ``route`` did not
        pick)."""
        c = self._consts.get(worker_id, _DEFAULT_CONSTS)
        cached = 0 if m is None else min(
            _credit_pages(m, self.history_credit) * self.page_size
            - _tier_discount_tokens(m, self._tier_discount, self.page_size),
            req.num_tokens - 1)
        wl = self._wl.get(worker_id, _IDLE)
        ttft, qk, score = self._figures(c, cached, req.num_tokens, wl, self.work_weight)
        full = 0 if m is None else m.full_pages * self.page_size
        tier = 0 if m is None else _tier_discount_tokens(m, self._tier_discount, self.page_size)
        return _Estimate(worker_id, max(0, cached), full, ttft, score, qk, tier)

    def _keeps(self, mine_s: float, best_s: float) -> bool:
        """Whether the sticky worker's TTFT is within either margin of the best one's."""
        return mine_s <= best_s + self.margin_s or mine_s <= best_s * self.margin_ratio

    @staticmethod
    def _figures(
        c: _Consts, cached: int, num_tokens: int, wl: Sequence[int], work_weight: float
    ) -> tuple[float, int, float]:
        """(predicted TTFT s, qk pairs of the prefill, score) on a worker like ``c`` with load
        ``wl`` for a request with ``cached`` of its ``num_tokens`` cached."""
        uncached, qk, work_s = _own_prefill(c, cached, num_tokens)
        ttft = ttft_s(c.cost, c.batch, uncached, qk, wl[PREFILL], wl[QK], wl[DECODING])
        return ttft, qk, ttft + work_weight * work_s

    def _tie(self, worker_id: str) -> tuple[int, int]:
        """The tie-break among equal scores: requests in flight, then the distance round the
        ring from the last pick."""
        ring = max(1, self._next_position)
        return (self._wl.get(worker_id, _IDLE)[IN_FLIGHT],
                (self._order.get(worker_id, ring) - self._rr) % ring)

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

    def _release(self, request_id: str) -> None:
        s = self._sent.pop(request_id, None)
        wl = None if s is None else self._wl.get(s.worker_id)
        if s is None or wl is None:
            return
        if s.prefilling:
            wl[PREFILL] -= s.uncached_tokens
            wl[QK] -= s.qk_pairs
        else:
            wl[DECODING] -= 1
        wl[IN_FLIGHT] -= 1

    def _predict(self, req: RouteRequest, worker_id: str, est: _Estimate, now_s: float) -> None:
        p = self.page_size
        n = len(req.page_hashes)
        raw = min(n, est.full_tokens // p)  # NOTE: confirmed or predicted: the engine's raw match
        ends = [n]
        if (est.cached_tokens + est.tier_tokens) // p < raw < n:
            ends.append(raw)  # NOTE: an observed branch point (module docstring)
        with self._lock:
            # NOTE: pages already confirmed need no entry (a 100k-token turn adds only its delta)
            confirmed = self.index.confirmed_pages(worker_id, req.page_hashes, hint=raw)
            self.index.predict(worker_id, req.page_hashes, now_s + self.optimistic_ttl_s,
                               from_page=confirmed, checkpoint_pages=ends)


def _credit_pages(m: MatchResult, history_credit: float) -> int:
    """Window-safe pages, plus ``history_credit`` of the full-KV pages past them."""
    if history_credit == 0 or m.full_pages == m.usable_pages:
        return m.usable_pages
    return m.usable_pages + int(history_credit * (m.full_pages - m.usable_pages))


def _tier_discount_tokens(m: MatchResult, discount: tuple[float, float], page_size: int) -> int:
    """The tokens a match's lower-tier pages fall short of device hits (0 without them)."""
    if not (m.host_pages or m.storage_pages):
        return 0
    return int((discount[0] * m.host_pages + discount[1] * m.storage_pages) * page_size)


def _own_prefill(c: _Consts, cached_tokens: int, num_tokens: int) -> tuple[int, int, float]:
    """(uncached tokens, their qk pairs, their prefill work in seconds) on a worker like ``c``."""
    uncached = max(1, num_tokens - cached_tokens)
    qk = prefill_qk_pairs(cached_tokens, uncached, c.batch)
    return uncached, qk, prefill_work_s(c.cost, uncached, qk)


def _window_pages(info: WorkerInfo) -> int | None:
    """k = ceil(W / page) pages, 0 for a model without SWA layers."""
    if info.sliding_window is None:
        return 0
    return -(-info.sliding_window // info.page_size)
