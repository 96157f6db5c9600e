"""Shared affinity: which worker an affinity key (a session, an ``X-Session-ID``, a
``prompt_cache_key``) was last sent to, kept in the session store so that every gateway replica
sharing it (Redis) sends the key's requests to the same worker.

The dispatcher reads the key's worker before it routes (``RouteRequest.sticky_worker``) and, when
the router decided otherwise, writes the decision back in the background: a pick never waits on
the store. A store that fails costs only the affinity (logged); the request is routed anyway.
"""

import asyncio
import logging
from typing import Protocol

from gateway.routing.types import RouteRequest

logger = logging.getLogger(__name__)

MAX_WRITES_IN_FLIGHT = 1024  # NOTE: past it a write-back is skipped (a store that hangs)


class AffinityStore(Protocol):
    """Affinity key -> worker id (``MemorySessionStore``, ``RedisSessionStore``)."""

    async def get_affinity(self, key: str) -> str | None: ...

    async def set_affinity(self, key: str, worker_id: str) -> None: ...


class SharedAffinity:
    """Reads and writes ``RouteRequest.sticky_worker`` through an ``AffinityStore``."""

    def __init__(self, store: AffinityStore) -> None:
        self.store = store
        self.num_failures = 0
        self._writes: set[asyncio.Task[None]] = set()

    async def load(self, route: RouteRequest) -> None:
        """Set ``route.sticky_worker`` from the store (when it has a key and none yet)."""
        if route.affinity_key is None or route.sticky_worker is not None:
            return
        try:
            route.sticky_worker = await self.store.get_affinity(route.affinity_key)
        except Exception as exc:  # NOTE: StoreUnavailable, or a store's own bug
            _reraise_cancellation()
            self.num_failures += 1
            logger.warning("affinity lookup of %s failed: %s", route.affinity_key, exc)
        else:
            _reraise_cancellation()

    def decided(self, route: RouteRequest, worker_id: str) -> None:
        """The router sent ``route`` to ``worker_id``: write it back if the store held another
        worker (or none). Returns at once."""
        key = route.affinity_key
        if key is None or route.sticky_worker == worker_id:
            return
        route.sticky_worker = worker_id  # NOTE: a retry that lands elsewhere writes again
        if len(self._writes) >= MAX_WRITES_IN_FLIGHT:
            logger.warning("affinity write of %s skipped: %d in flight", key, len(self._writes))
            return
        task = asyncio.get_running_loop().create_task(self._write(key, worker_id))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def settle(self, timeout_s: float = 1.0) -> None:
        """Wait (at most ``timeout_s``) for the writes still in flight."""
        if self._writes:
            await asyncio.wait(self._writes, timeout=timeout_s)

    async def _write(self, key: str, worker_id: str) -> None:
        try:
            await self.store.set_affinity(key, worker_id)
        except Exception as exc:  # NOTE: the next request routes without it
            self.num_failures += 1
            logger.warning("affinity write of %s failed: %s", key, exc)


def _reraise_cancellation() -> None:
    """Raise ``CancelledError`` when the running task was cancelled while it awaited the store.

    NOTE: redis-py's asyncio client can turn a cancellation inside a command into a connection
    error (or swallow it), so a cancelled request (a client that left, a WebSocket ``cancel``)
    would otherwise go on to the worker and run to its end."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
