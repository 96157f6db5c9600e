"""KV-event baselines: NVIDIA Dynamo's KV router and llm-d's "sticky until saturated" scheduler.

Both read the same KV index as ours but credit the RAW prefix match (``full_pages``): Dynamo's
indexer drops SWA cache groups and llm-d's SWA scorer is unfinished, so neither can see a hit
that the sliding window already lost. Blocks are our pages.
"""

from __future__ import annotations

import math
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

from engine.cost import CostModel
from gateway.routing.baselines import IndexedRouter
from gateway.routing.index import KVIndex, MatchResult
from gateway.routing.types import Decision, RouteRequest


class DynamoRouter(IndexedRouter):
    """Dynamo KV router, default ("linear") cost, temperature 0 (current docs and
    ``lib/kv-router`` ``potential_blocks_and_tokens``). Per candidate w::

        overlap  = raw device match in pages (max with the predicted side index, when on)
        prefill  = (active prefill tokens[w] + prompt tokens) / page - credit x overlap
        decode   = active blocks[w] + blocks of this request not already active on w
        cost[w]  = prefill_load_scale x max(prefill, 0) + decode          -> argmin

    Active prefill tokens are the uncached tokens of w's requests before their first token;
    active blocks are the distinct full pages of w's requests in flight (prefilling or
    decoding: Dynamo adds a request's blocks when it routes it). Ties go to a seeded random
    pick, as Dynamo's sampler does at temperature 0.

    ``predicted_ttl_s`` (Dynamo ``--router-predicted-ttl-secs``; off by default, as there):
    a side index of routed-but-unconfirmed pages, each kept that long.
    """

    name = "dynamo"

    def __init__(self, index: KVIndex, *, overlap_score_credit: float = 1.0,
                 prefill_load_scale: float = 1.0, predicted_ttl_s: float | None = None,
                 seed: int = 0) -> None:
        super().__init__(index)
        self.overlap_score_credit = overlap_score_credit
        self.prefill_load_scale = prefill_load_scale
        self.predicted_ttl_s = predicted_ttl_s
        self._rng = random.Random(seed)
        self._active: dict[str, Counter[int]] = {}  # worker -> page hash -> requests holding it
        self._requests: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._side: dict[str, OrderedDict[int, float]] = {}  # worker -> page hash -> expiry
        self._now_s = 0.0

    def remove_worker(self, worker_id: str) -> None:
        super().remove_worker(worker_id)
        self._active.pop(worker_id, None)
        self._side.pop(worker_id, None)
        self._requests = {r: v for r, v in self._requests.items() if v[0] != worker_id}

    def route(self, req: RouteRequest, candidates: Sequence[str]) -> Decision:
        matches = self._match(req, fresh=True)
        costs = {w: self.cost(req, w, matches) for w in self._ordered(candidates)}
        best = min(costs.values())
        pick = self._rng.choice([w for w, c in costs.items() if c == best])
        cached = self._cached_tokens(req, pick)
        return Decision(pick, cached_tokens=cached, reason="prefix" if cached else "load")

    def active_blocks(self, worker_id: str) -> int:
        """Distinct pages held by ``worker_id``'s requests in flight (Dynamo's active blocks)."""
        return len(self._active.get(worker_id, ()))

    def cost(self, req: RouteRequest, worker_id: str, matches: dict[str, MatchResult]) -> float:
        """Dynamo's cost of sending ``req`` to ``worker_id`` (in blocks)."""
        page = self.page_size
        overlap = self._overlap(req, worker_id, matches)
        prefill = ((self.load.prefill_tokens(worker_id) + req.num_tokens) / page
                   - self.overlap_score_credit * overlap)
        active = self._active.get(worker_id, Counter())
        new_blocks = len(req.page_hashes) - _depth(req.page_hashes, active.__contains__)
        decode = self.active_blocks(worker_id) + new_blocks
        return self.prefill_load_scale * max(prefill, 0.0) + decode

    def dispatched(self, req: RouteRequest, worker_id: str, now_s: float) -> None:
        self._now_s = now_s
        super().dispatched(req, worker_id, now_s)
        hashes = tuple(req.page_hashes)
        self._requests[req.request_id] = (worker_id, hashes)
        self._active.setdefault(worker_id, Counter()).update(hashes)
        if self.predicted_ttl_s is not None:
            side = self._side.setdefault(worker_id, OrderedDict())
            for h in hashes:
                side[h] = now_s + self.predicted_ttl_s
                side.move_to_end(h)
            self._prune(now_s)

    def first_token(self, request_id: str, now_s: float) -> None:
        self._now_s = now_s
        super().first_token(request_id, now_s)

    def finished(self, request_id: str, now_s: float) -> None:
        self._now_s = now_s
        super().finished(request_id, now_s)
        worker_id, hashes = self._requests.pop(request_id, ("", ()))
        active = self._active.get(worker_id)
        if active is not None:
            for h in hashes:
                n = active.get(h, 0) - 1
                if n > 0:
                    active[h] = n
                else:
                    active.pop(h, None)

    # ---------------------------------------------------------------- helpers

    def _cached_tokens(self, req: RouteRequest, worker_id: str) -> int:
        overlap = self._overlap(req, worker_id, self._match(req))
        return min(overlap * self.page_size, req.num_tokens)

    def _overlap(self, req: RouteRequest, worker_id: str,
                 matches: dict[str, MatchResult]) -> int:
        m = matches.get(worker_id)
        overlap = 0 if m is None else m.full_pages
        side = self._side.get(worker_id)
        if side:
            now_s = self._now_s
            overlap = max(overlap, _depth(req.page_hashes, lambda h: side.get(h, -1.0) > now_s))
        return overlap

    def _prune(self, now_s: float) -> None:
        for side in self._side.values():
            while side and next(iter(side.values())) <= now_s:
                side.popitem(last=False)


class LlmDRouter(IndexedRouter):
    """llm-d EPP's default since 2026-08, "sticky until saturated", with the precise prefix
    scorer (raw match from KV events)::

        hit(w)     = matched pages / the prompt's full pages
        sticky     = {w : hit(w) >= affinity_threshold}
        candidates = sticky, unless the best sticky w has more uncached tokens in flight than
                     tau(w), or an exploration draw (probability exploration_probability) fires
        score(w)   = -(uncached tokens in flight on w + prompt tokens x (1 - hit(w)))
        pick       = max score (ties: seeded random)

    tau(w) = peak prefill throughput x ``max_ttft_penalty_s`` (llm-d: peakPrefillThroughput x
    maxTTFTPenaltyMs, default 5000 ms). Peak prefill throughput comes from the worker's
    ``CostModel``: a full step of ``max_batched_tokens`` prefill tokens, B / step_time(B).
    With the ``h200`` preset and B = 8192 that is ~19,070 tok/s, so tau ~ 95,000 tokens.
    Uncached tokens in flight are the router's own count, until each request's first token.
    """

    name = "llm-d"

    def __init__(self, index: KVIndex, *, affinity_threshold: float = 0.8,
                 max_ttft_penalty_s: float = 5.0, exploration_probability: float = 0.01,
                 seed: int = 0) -> None:
        super().__init__(index)
        self.affinity_threshold = affinity_threshold
        self.max_ttft_penalty_s = max_ttft_penalty_s
        self.exploration_probability = exploration_probability
        self._rng = random.Random(seed)

    def saturation_tokens(self, worker_id: str) -> float:
        """tau: uncached tokens in flight past which a sticky worker counts as saturated."""
        info = self.workers.get(worker_id)
        cost = info.cost if info is not None else CostModel()
        batch = info.max_batched_tokens if info is not None else 512
        step_s = cost.step_time(batch, 0, 0)
        return math.inf if step_s <= 0 else batch / step_s * self.max_ttft_penalty_s

    def route(self, req: RouteRequest, candidates: Sequence[str]) -> Decision:
        matches = self._match(req, fresh=True)
        order = self._ordered(candidates)
        num_pages = len(req.page_hashes)

        def hit(w: str) -> float:
            m = matches.get(w)
            return 0.0 if m is None or num_pages == 0 else m.full_pages / num_pages

        def score(w: str) -> float:
            return -(self.load.prefill_tokens(w) + req.num_tokens * (1.0 - hit(w)))

        pool, reason = order, "load"
        sticky = [w for w in order if hit(w) >= self.affinity_threshold]
        if sticky and self._rng.random() >= self.exploration_probability:
            best = max(sticky, key=score)
            if self.load.prefill_tokens(best) > self.saturation_tokens(best):
                reason = "moved_for_load"
            else:
                pool, reason = sticky, "prefix"
        top = max(score(w) for w in pool)
        pick = self._rng.choice([w for w in pool if score(w) == top])
        if reason == "load" and pick in matches:
            reason = "prefix"
        return Decision(pick, cached_tokens=self._raw_cached(matches, pick, req.num_tokens),
                        reason=reason)


def _depth(page_hashes: Sequence[int], held: Callable[[int], bool]) -> int:
    """How many leading pages of the chain ``held`` says yes to."""
    depth = 0
    for h in page_hashes:
        if not held(h):
            break
        depth += 1
    return depth
