"""Router CPU per request, every registered router side by side: one session turn of NUM_TOKENS
tokens (page PAGE) over NUM_WORKERS workers, one of which holds all but its last 100 pages.
Each request is routed, dispatched, given its first token and finished (the caller's four calls).

    .venv/bin/python loadtest/bench_baselines.py [num_tokens] [page_size]
"""

from __future__ import annotations

import sys
import time

from engine.cost import H200_COST
from engine.hashing import page_hashes
from engine.worker.events import BlockStored, KVEventBatch
from gateway.routing import ROUTER_NAMES, KVIndex, RouteRequest, WorkerInfo, make_router

NUM_TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
PAGE = int(sys.argv[2]) if len(sys.argv) > 2 else 16
NUM_WORKERS = 8
REPS = 200
WINDOW_PAGES = 8


def _index(hashes: list[int], workers: list[str]) -> KVIndex:
    index = KVIndex(PAGE)
    for w in workers:
        index.add_worker(w, window_pages=WINDOW_PAGES)
    held = list(hashes[:-100])
    event = BlockStored(block_hashes=held, parent_block_hash=None,
                        token_ids=[0] * (PAGE * len(held)), block_size=PAGE)
    index.apply(workers[3], 0, KVEventBatch(ts=0.0, events=[event]))
    return index


def bench(name: str, hashes: list[int], workers: list[str]) -> float:
    router = make_router(name, _index(hashes, workers))
    for w in workers:
        router.add_worker(WorkerInfo(w, page_size=PAGE, cost=H200_COST, max_batched_tokens=8192))
    start = time.perf_counter()
    for i in range(REPS):
        now_s = i * 0.01
        req = RouteRequest(request_id=f"r{i}", num_tokens=NUM_TOKENS, page_hashes=hashes,
                           affinity_key="session")
        worker_id = router.route(req, workers).worker_id
        router.dispatched(req, worker_id, now_s)
        router.first_token(req.request_id, now_s)
        router.finished(req.request_id, now_s)
    return (time.perf_counter() - start) / REPS * 1e6


def main() -> None:
    hashes = page_hashes(list(range(NUM_TOKENS)), PAGE, None)[: (NUM_TOKENS - 1) // PAGE]
    workers = [f"w{i}" for i in range(NUM_WORKERS)]
    results = {name: bench(name, hashes, workers) for name in ROUTER_NAMES}
    print(f"{NUM_TOKENS} tokens, page {PAGE}, {NUM_WORKERS} workers: router CPU per request")
    print("  ".join(f"{name} {us:.0f} us" for name, us in results.items()))


if __name__ == "__main__":
    main()
