"""Builders for the router tests: a hand-fed KVIndex, requests over page-hash chains, and the
caller's side of the ``Router`` life cycle."""

from __future__ import annotations

from collections.abc import Sequence

from engine.cost import CostModel
from engine.worker.events import BlockStored, KVEvent, KVEventBatch, SwaCheckpointStored
from gateway.routing import KVIndex, Router, RouteRequest, WorkerInfo

PAGE = 4
WINDOW_PAGES = 2


def chain(start: int, num_pages: int) -> list[int]:
    """A stand-in page-hash chain (distinct ints are enough: the index never rehashes)."""
    return list(range(start, start + num_pages))


def make_request(rid: str, hashes: Sequence[int], *, key: str | None = None,
                 num_tokens: int | None = None) -> RouteRequest:
    """A request whose routable pages are ``hashes`` (one token more than they cover)."""
    if num_tokens is None:
        num_tokens = len(hashes) * PAGE + 1
    return RouteRequest(request_id=rid, num_tokens=num_tokens, page_hashes=tuple(hashes),
                        affinity_key=key)


def make_index(*worker_ids: str, window_pages: int | None = WINDOW_PAGES) -> KVIndex:
    index = KVIndex(PAGE)
    for w in worker_ids:
        index.add_worker(w, window_pages=window_pages)
    return index


def feed(index: KVIndex, worker_id: str, *events: KVEvent) -> None:
    """One batch on ``worker_id``'s live stream, in order."""
    seq = index.next_seq(worker_id)
    assert index.apply(worker_id, seq, KVEventBatch(ts=0.0, events=list(events))) is None


def stored(hashes: Sequence[int], parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent,
                       token_ids=[0] * (PAGE * len(hashes)), block_size=PAGE)


def checkpoint(*hashes: int) -> SwaCheckpointStored:
    return SwaCheckpointStored(block_hashes=list(hashes), window=WINDOW_PAGES * PAGE)


def add_workers(router: Router, *worker_ids: str, cost: CostModel | None = None,
                max_batched_tokens: int = 512) -> None:
    for w in worker_ids:
        router.add_worker(WorkerInfo(worker_id=w, page_size=PAGE, cost=cost or CostModel(),
                                     max_batched_tokens=max_batched_tokens))


def send(router: Router, req: RouteRequest, candidates: Sequence[str], now_s: float = 0.0) -> str:
    """Route and dispatch ``req`` (the caller's two calls); returns the worker."""
    worker_id = router.route(req, candidates).worker_id
    router.dispatched(req, worker_id, now_s)
    return worker_id
