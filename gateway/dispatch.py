"""The ``Dispatcher``: routes requests over the ``WorkerClient``s (``gateway.worker_client``), one
per engine worker. This module re-exports the client and the errors (``gateway.dispatch_errors``).

Routing: a session stays on its worker while that worker is alive. Otherwise (a new session, a
request without one, or a session whose worker is gone) the dispatcher picks the live worker with
the fewest requests in flight; on a tie, the one with the fewest sessions assigned, then the next
in round-robin order after the last pick (so that sessions started one at a time, when no worker
has load yet, spread over the workers instead of all landing on the first one).

Retries: a request moves to another worker (at most ``max_retries`` times) only when it failed
for a reason of the worker's, before it streamed a token:

    | failure                                           | retried? | error when not        |
    |---------------------------------------------------|----------|-----------------------|
    | WorkerDead, started=False (lost, silent, restart) | yes      | WorkerDead            |
    | WorkerDead, started=True                          | never    | WorkerDead (502)      |
    | WorkerError "overloaded"                          | yes      | WorkersBusy (429)     |
    | any other WorkerError: invalid_grammar,           | never    | WorkerError: the      |
    |   invalid_request, context_too_long, internal...  |          | same on every worker  |
    | DispatchTimeout, StreamOverflow                   | never    | as raised             |

A retry goes to a worker not yet tried, or to a tried one that has come back since (a new
connection or process; not to one that refused it as overloaded). When no live worker is left
for a retry after a worker was lost, it waits up to ``retry_wait_s`` for one to come (back) up.
A retry uses the wire request id ``<id>.retry<n>``, so that a late reply to the first attempt can
never be taken for one of the retry's.
"""

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Iterable

import msgspec

from engine.protocol import Generate, TokenDelta
from gateway.dispatch_errors import (
    DispatchError,
    DispatchTimeout,
    HandshakeError,
    NoWorkerAvailable,
    StreamOverflow,
    WorkerDead,
    WorkerError,
)
from gateway.metrics import StreamStats
from gateway.worker_client import StreamItem, WorkerClient

__all__ = [
    "DispatchError", "DispatchTimeout", "Dispatcher", "HandshakeError", "NoWorkerAvailable",
    "StreamItem", "StreamOverflow", "WorkerClient", "WorkerDead", "WorkerError", "WorkersBusy",
    "is_retryable",
]

logger = logging.getLogger(__name__)

# NOTE: the only worker error codes worth another worker; every other code is about the request
RETRYABLE_CODES = frozenset({"overloaded"})


class WorkersBusy(DispatchError):
    """Every live worker refused the request as overloaded (their queues are full): the client
    should retry later (429 + Retry-After)."""


class Dispatcher:
    """Routes requests over several ``WorkerClient``s (see the module docstring).

    Args:
        max_retries: how many other workers a request may move to (see the retry table).
        max_sessions: the bound of the session -> worker map (least recently used go first).
        retry_wait_s: how long a retry waits for a live worker when none is left.

    Attributes:
        num_retries: retries by reason ("worker_lost", "overloaded").
    """

    def __init__(
        self,
        clients: Iterable[WorkerClient],
        *,
        max_retries: int = 2,
        max_sessions: int = 100_000,
        retry_wait_s: float = 10.0,
    ) -> None:
        self.clients = list(clients)
        assert self.clients, "a Dispatcher needs at least one WorkerClient"
        assert max_retries >= 0 and max_sessions > 0 and retry_wait_s >= 0
        self.max_retries = max_retries
        self.max_sessions = max_sessions
        self.retry_wait_s = retry_wait_s
        self.stats = StreamStats()
        self.num_retries: Counter[str] = Counter()
        self._sessions: OrderedDict[str, WorkerClient] = OrderedDict()
        self._num_sessions: Counter[WorkerClient] = Counter()  # NOTE: of each worker
        self._next = 0  # NOTE: where the round robin of ties starts
        # NOTE: wire request id -> the worker that finished it, for Retain (bounded, LRU)
        self._finished_on: OrderedDict[str, WorkerClient] = OrderedDict()
        self._finished_wire_id: dict[str, str] = {}
        self._alive_waiters: list[asyncio.Future[None]] = []
        for client in self.clients:
            client.alive_listeners.append(self._wake)

    def pick(
        self, session_id: str | None = None, exclude: Iterable[WorkerClient] = ()
    ) -> WorkerClient:
        """The session's worker if it is alive, else the least loaded live worker (ties: fewest
        sessions, then round robin).

        Raises:
            NoWorkerAvailable: every worker is dead or excluded.
        """
        excluded = set(exclude)
        if (sticky := self._sticky(session_id, excluded)) is not None:
            return sticky
        n = len(self.clients)
        live = [i for i, c in enumerate(self.clients) if c.is_alive and c not in excluded]
        if not live:
            raise NoWorkerAvailable(f"no live worker among {n}")
        best = min(live, key=lambda i: (self.clients[i].num_in_flight,
                                        self._num_sessions[self.clients[i]], (i - self._next) % n))
        self._next = (best + 1) % n
        client = self.clients[best]
        if session_id is not None:
            self._remember(session_id, client)
        return client

    async def generate(self, request: Generate, **timeouts: float) -> AsyncIterator[StreamItem]:
        """``WorkerClient.generate`` on ``pick(request.session_id)``, moved to another worker
        as the retry table says.

        Raises:
            WorkerDead: with ``started=True``, or when every retry's worker was lost too.
            WorkersBusy: every live worker was overloaded.
            NoWorkerAvailable, WorkerError, DispatchTimeout, ...: as ``WorkerClient.generate``.
        """
        tried: list[tuple[WorkerClient, int]] = []  # NOTE: (client, its epoch when tried)
        last_error: DispatchError | None = None
        stats = self.stats
        # NOTE: token timings mean something only when the worker sends every step's tokens
        timed = request.stream_interval_s == 0
        last_s = time.perf_counter()  # NOTE: the dispatch time, then the last delta's
        for attempt in itertools.count():
            client = await self._pick_for_attempt(request.session_id, tried, last_error)
            tried.append((client, client.epoch))
            if last_error is not None:
                reason = "overloaded" if isinstance(last_error, WorkerError) else "worker_lost"
                self.num_retries[reason] += 1
            wire = request if attempt == 0 else msgspec.structs.replace(
                request, request_id=f"{request.request_id}.retry{attempt}")
            started = False
            try:
                async with contextlib.aclosing(client.generate(wire, **timeouts)) as stream:
                    async for item in stream:
                        now_s = time.perf_counter()
                        if type(item) is TokenDelta:
                            if timed:
                                (stats.itl if started else stats.ttft).observe(now_s - last_s)
                            last_s = now_s
                        else:
                            stats.finished(item)
                            self._note_finished(item.request_id, client)
                        started = True
                        yield item
                return
            except (WorkerDead, WorkerError) as exc:
                if started or not is_retryable(exc):
                    raise
                if attempt >= self.max_retries:
                    if isinstance(exc, WorkerError):
                        raise WorkersBusy(f"every worker tried is overloaded: {exc}") from exc
                    raise
                last_error = exc
                logger.warning("retrying %s elsewhere: %s", request.request_id, exc)

    def retain(self, request_id: str, ttl_s: float) -> bool:
        """Send ``Retain(ttl_s)`` for a request that finished lately (its wire id: a retry's is
        ``<id>.retry<n>``; the original id finds it too) to the worker that ran it; ``ttl_s=0``
        releases. False when that worker is unknown (long ago) or not reachable now."""
        client = self._finished_on.get(request_id)
        if client is None:
            return False
        return client.retain(self._finished_wire_id.get(request_id, request_id), ttl_s)

    def _note_finished(self, wire_id: str, client: WorkerClient) -> None:
        base = wire_id.split(".retry", 1)[0]
        for key in {base, wire_id}:
            self._finished_on[key] = client
            self._finished_on.move_to_end(key)
            self._finished_wire_id[key] = wire_id
        while len(self._finished_on) > self.max_sessions:
            key, _ = self._finished_on.popitem(last=False)
            self._finished_wire_id.pop(key, None)

    async def _pick_for_attempt(
        self,
        session_id: str | None,
        tried: list[tuple[WorkerClient, int]],
        last_error: DispatchError | None,
    ) -> WorkerClient:
        """The first attempt's worker, or a retry's: never one that failed this request and
        has not come back since. A retry after a lost worker waits for one to come up.

        NOTE: returns without suspending when a worker is free, so that the request is in
        flight on it before any other pick runs (the least-loaded choice stays true).
        """
        deadline = time.monotonic() + self.retry_wait_s
        while True:
            excluded = [c for c, epoch in tried if c.epoch == epoch]
            try:
                return self.pick(session_id, exclude=excluded)
            except NoWorkerAvailable as exc:
                if isinstance(last_error, WorkerError):
                    raise WorkersBusy(f"every live worker is overloaded: {last_error}") from exc
                if last_error is None or (left_s := deadline - time.monotonic()) <= 0:
                    raise
            await self._some_worker_alive(left_s)

    async def _some_worker_alive(self, timeout_s: float) -> None:
        """Return when a worker turns alive (or after ``timeout_s``).

        NOTE: woken by the clients (``alive_listeners``), not by polling: after a worker is lost,
        every one of its requests may be waiting here at once."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._alive_waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            pass
        finally:
            if waiter in self._alive_waiters:
                self._alive_waiters.remove(waiter)

    def _wake(self) -> None:
        for waiter in self._alive_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._alive_waiters.clear()

    def _sticky(self, session_id: str | None, excluded: set[WorkerClient]) -> WorkerClient | None:
        if session_id is None or (client := self._sessions.get(session_id)) is None:
            return None
        if not client.is_alive or client in excluded:
            return None
        self._sessions.move_to_end(session_id)
        return client

    def _remember(self, session_id: str, client: WorkerClient) -> None:
        if (previous := self._sessions.get(session_id)) is not None:
            self._num_sessions[previous] -= 1
        self._sessions[session_id] = client
        self._num_sessions[client] += 1
        self._sessions.move_to_end(session_id)
        if len(self._sessions) > self.max_sessions:
            _, evicted = self._sessions.popitem(last=False)
            self._num_sessions[evicted] -= 1


def is_retryable(exc: DispatchError) -> bool:
    """Whether a request that failed with ``exc`` before streaming may go to another worker:
    only for the worker's own trouble, never for the request's (see the module docstring)."""
    if isinstance(exc, WorkerDead):
        return not exc.started
    return isinstance(exc, WorkerError) and exc.code in RETRYABLE_CODES

