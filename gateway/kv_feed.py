"""``KVFeed``: the gateway's ``KVIndex``, fed by one ``KVEventSubscriber`` per live worker.

The dispatcher tells it when a worker turns alive (``start``: subscribe to the events endpoint
its ``Welcome`` announced, with its replay endpoint to fill gaps) and when it is lost or restarts
(``stop``: the worker leaves the index). Both run in order per worker on the event loop; a stop
joins the subscriber's thread off the loop. ``close`` stops every subscriber (no thread left).

The subscribers' threads touch the index under ``lock``; whoever calls ``KVIndex.match`` (the
router, from the loop) holds it too.
"""

import asyncio
import logging
import threading
import urllib.parse
from collections.abc import Awaitable, Callable

from engine.protocol import Welcome
from engine.worker.curve import CurveClientKeys
from gateway.routing.index import DEFAULT_MAX_PAGES, KVIndex
from gateway.routing.subscriber import KVEventSubscriber

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0
# NOTE: hosts a worker binds to that mean "every interface": reach it where we reached its ROUTER
WILDCARD_HOSTS = frozenset({"0.0.0.0", "*", "::", "[::]", ""})


class KVFeed:
    """The KV index over the workers' event streams (see the module docstring).

    Args:
        page_size: the workers' page size (from ``Welcome``); the index hashes with it.
        max_pages: the index's bound on page entries over all workers.
    """

    def __init__(self, page_size: int, max_pages: int = DEFAULT_MAX_PAGES) -> None:
        self.index = KVIndex(page_size, max_pages)
        self.lock = threading.Lock()
        self._subscribers: dict[str, KVEventSubscriber] = {}
        self._ops: dict[str, asyncio.Task[None]] = {}  # NOTE: the last op per worker

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def start(self, worker_id: str, welcome: Welcome, connected_to: str,
              curve: CurveClientKeys | None = None) -> None:
        """Follow ``worker_id``'s events (after whatever op on it is still running).

        ``connected_to`` is the endpoint the gateway reached the worker's ROUTER on: a wildcard
        host in the announced endpoints means that host. ``curve``: the keys the gateway
        reached it with (its events and replay sockets want the same)."""
        if welcome.events_endpoint is None:
            logger.warning("worker %s announces no events endpoint: routed without its KV",
                           worker_id)
            return
        events = resolve_endpoint(welcome.events_endpoint, connected_to)
        replay = None if welcome.replay_endpoint is None else resolve_endpoint(
            welcome.replay_endpoint, connected_to)
        window_pages = window_pages_of(welcome)

        async def start() -> None:
            await self._stop(worker_id)  # NOTE: a previous instance's subscriber, if any
            sub = KVEventSubscriber(self.index, worker_id, events, replay_endpoint=replay,
                                    lock=self.lock, curve=curve)
            with self.lock:
                self.index.add_worker(worker_id, window_pages=window_pages)
            sub.start()
            self._subscribers[worker_id] = sub
            logger.info("worker %s: KV events from %s (replay %s)", worker_id, events, replay)

        self._chain(worker_id, start)

    def stop(self, worker_id: str) -> None:
        """Stop following ``worker_id``: it leaves the index."""
        self._chain(worker_id, lambda: self._stop(worker_id))

    async def settle(self) -> None:
        """Wait for every start and stop asked so far (tests, shutdown)."""
        while pending := [t for t in self._ops.values() if not t.done()]:
            await asyncio.wait(pending)

    async def close(self) -> None:
        """Stop every subscriber and join its thread."""
        await self.settle()
        subs = list(self._subscribers.values())
        self._subscribers.clear()
        await asyncio.gather(*(asyncio.to_thread(s.stop, STOP_TIMEOUT_S) for s in subs))

    def _chain(self, worker_id: str, op: Callable[[], Awaitable[None]]) -> None:
        previous = self._ops.get(worker_id)

        async def run() -> None:
            if previous is not None:
                await asyncio.wait([previous])
            try:
                await op()
            except Exception:  # NOTE: routing goes on without this worker's KV
                logger.exception("worker %s: KV event subscriber", worker_id)

        self._ops[worker_id] = asyncio.get_running_loop().create_task(run())

    async def _stop(self, worker_id: str) -> None:
        sub = self._subscribers.pop(worker_id, None)
        if sub is not None:
            await asyncio.to_thread(sub.stop, STOP_TIMEOUT_S)


def resolve_endpoint(announced: str, connected_to: str) -> str:
    """``announced`` (``tcp://host:port`` as the worker bound it) with a wildcard host replaced by
    the host of ``connected_to``; other transports (``ipc://``) unchanged."""
    parts = urllib.parse.urlsplit(announced)
    if parts.scheme != "tcp" or parts.hostname not in WILDCARD_HOSTS and parts.netloc[:1] != "*":
        return announced
    host = urllib.parse.urlsplit(connected_to).netloc.rsplit(":", 1)[0]
    return f"tcp://{host}:{parts.port}"


def window_pages_of(welcome: Welcome) -> int:
    """The index's k: pages one SWA window spans (0 without SWA layers: every page is usable)."""
    if not welcome.sliding_window:
        return 0
    return -(-welcome.sliding_window // welcome.page_size)
