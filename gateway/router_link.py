"""``RouterLink``: the dispatcher's side of a ``gateway.routing`` policy. It keeps the router's
worker set in step with the ``WorkerClient``s (``add_worker`` when one turns alive, from its
``Welcome``; ``remove_worker`` when it is lost or restarts), feeds the KV index from the workers'
events (``gateway.kv_feed``), and makes every router call under the index's lock.

The router and the index are made at the first ``Welcome``: the index hashes with the workers'
page size, which only a worker can tell. A worker whose page size differs from the first one's
is never routed to (logged): its page hashes would never match.

NOTE: routers are not thread-safe. Every call here runs on the event loop; the lock is the one
the subscribers' threads hold while they apply events to the index.
"""

import inspect
import logging
import time
from collections.abc import Callable, Sequence

from engine.cost import CostModel
from engine.protocol import LoadReport
from gateway.kv_feed import KVFeed
from gateway.routing.index import DEFAULT_MAX_PAGES, KVIndex
from gateway.routing.types import Decision, Router, RouteRequest, WorkerInfo
from gateway.worker_client import WorkerClient

logger = logging.getLogger(__name__)

RouterFactory = Callable[[KVIndex], Router]
DEFAULT_MAX_BATCHED_TOKENS = 512  # NOTE: WorkerInfo's default, for a worker that did not say


class RouterLink:
    """One router over ``clients`` (see the module docstring).

    Args:
        factory: makes the router over the index (``gateway.routing.registry.make_router``).
        name: the router's name (metrics), known before it is made.
        index_max_pages: the KV index's bound.
        on_worker_added, on_worker_removed: told the worker id (admission's worker set).
    """

    def __init__(
        self,
        clients: Sequence[WorkerClient],
        factory: RouterFactory,
        name: str,
        *,
        index_max_pages: int = DEFAULT_MAX_PAGES,
        on_worker_added: Callable[[str, WorkerInfo], None] | None = None,
        on_worker_removed: Callable[[str], None] | None = None,
    ) -> None:
        self.name = name
        self.router: Router | None = None
        self._route_takes_now = False  # NOTE: the Router protocol's route has no clock
        self.feed: KVFeed | None = None
        self._factory, self._max_pages = factory, index_max_pages
        self._on_added, self._on_removed = on_worker_added, on_worker_removed
        self._ids: dict[WorkerClient, str] = {}  # NOTE: the routable ones only
        self._clients: dict[str, WorkerClient] = {}
        self._ranks = {client: i for i, client in enumerate(clients)}  # NOTE: ties' order
        for client in clients:
            client.alive_listeners.append(lambda c=client: self._alive(c))
            client.lost_listeners.append(lambda c=client: self._lost(c))
            client.load_listeners.append(lambda r, c=client: self._load(c, r))

    @property
    def index(self) -> KVIndex | None:
        return None if self.feed is None else self.feed.index

    def worker_id(self, client: WorkerClient) -> str | None:
        """The router's name for ``client``; None while it is not routable."""
        return self._ids.get(client)

    def client(self, worker_id: str) -> WorkerClient | None:
        return self._clients.get(worker_id)

    def route(self, req: RouteRequest, candidates: Sequence[WorkerClient]
              ) -> tuple[WorkerClient, Decision] | None:
        """The router's pick among the routable ``candidates``; None when none is routable."""
        ids = [wid for c in candidates if (wid := self._ids.get(c)) is not None]
        if not ids or self.router is None or self.feed is None:
            return None
        with self.feed.lock:
            if self._route_takes_now:  # NOTE: exact optimistic-entry ages after an idle spell
                decision = self.router.route(req, ids, now_s=time.monotonic())  # type: ignore[call-arg]
            else:
                decision = self.router.route(req, ids)
        client = self._clients.get(decision.worker_id)
        if client is None or decision.worker_id not in ids:
            logger.error("router %s picked %r, not a candidate: using %s", self.name,
                         decision.worker_id, ids[0])
            client = self._clients[ids[0]]
            decision = Decision(ids[0], reason="load")
        return client, decision

    def dispatched(self, req: RouteRequest, worker_id: str) -> None:
        self._call(lambda r: r.dispatched(req, worker_id, time.monotonic()))

    def first_token(self, request_id: str) -> None:
        self._call(lambda r: r.first_token(request_id, time.monotonic()))

    def finished(self, request_id: str) -> None:
        self._call(lambda r: r.finished(request_id, time.monotonic()))

    async def close(self) -> None:
        """Stop every KV event subscriber (their threads are joined)."""
        if self.feed is not None:
            await self.feed.close()

    # ---------------------------------------------------------------- private

    def _call(self, call: Callable[[Router], None]) -> None:
        if self.router is not None and self.feed is not None:
            with self.feed.lock:
                call(self.router)

    def _alive(self, client: WorkerClient) -> None:
        welcome = client.welcome
        assert welcome is not None
        if self.feed is None:
            self.feed = KVFeed(welcome.page_size, self._max_pages)
            self.router = self._factory(self.feed.index)
            params = inspect.signature(self.router.route).parameters
            self._route_takes_now = "now_s" in params
        if welcome.page_size != self.feed.index.page_size:
            logger.error("worker %s at %s: page size %d, not %d as the others: not routed to",
                         welcome.worker_id, client.endpoint, welcome.page_size,
                         self.feed.index.page_size)
            return
        wid = self._unique_id(client, welcome.worker_id)
        info = WorkerInfo(
            wid, welcome.page_size, welcome.cost or CostModel(),
            welcome.max_batched_tokens or DEFAULT_MAX_BATCHED_TOKENS, welcome.sliding_window,
            rank=self._ranks.get(client), swa_page_events=welcome.swa_page_events,
        )
        self._ids[client], self._clients[wid] = wid, client
        self._call(lambda r: r.add_worker(info))
        self.feed.start(wid, welcome, client.endpoint, curve=client.curve)
        if self._on_added is not None:
            self._on_added(wid, info)

    def _lost(self, client: WorkerClient) -> None:
        wid = self._ids.pop(client, None)
        if wid is None:
            return
        self._clients.pop(wid, None)
        self._call(lambda r: r.remove_worker(wid))
        if self.feed is not None:
            self.feed.stop(wid)
        if self._on_removed is not None:
            self._on_removed(wid)

    def _load(self, client: WorkerClient, report: LoadReport) -> None:
        if (wid := self._ids.get(client)) is not None:
            self._call(lambda r: r.load_report(wid, report, time.monotonic()))

    def _unique_id(self, client: WorkerClient, worker_id: str) -> str:
        """``worker_id``, unless another client already routes under it (two workers started
        with the same ``--worker-id``): then ``worker_id@endpoint``."""
        other = self._clients.get(worker_id)
        if other is None or other is client:
            return worker_id
        logger.warning("two workers call themselves %s: %s is routed as %s@%s", worker_id,
                       client.endpoint, worker_id, client.endpoint)
        return f"{worker_id}@{client.endpoint}"
