"""The ``Dispatcher``: routes requests over the ``WorkerClient``s (``gateway.worker_client``), one
per engine worker. This module re-exports the client and the errors (``gateway.dispatch_errors``).

Routing: with a ``router`` (``gateway.routing``; ``agentgate serve --router``, default
"agentgate"), the dispatcher asks it: the candidates are the live workers not excluded (a retry's
tried ones), the request a ``RouteRequest`` (prompt page hashes, affinity key; see
``gateway.generation.route_request``), and the router hears of each attempt's dispatch, first
token and end (also on errors, aborts and retries). ``gateway.router_link`` keeps its worker set
and KV index in step with the workers. With a session store (``affinity``), the worker an
affinity key was last sent to is read from it (``RouteRequest.sticky_worker``) and the decision
written back, so gateway replicas sharing a Redis store keep a session's turns on one worker.
With an ``AdmissionGate``, a routed request waits for admission before it is sent, with the
priority admission gives it (``Generate.priority``).

Without a router (``router=None``, the built-in policy): a session stays on its worker while
that worker is alive. Otherwise the dispatcher picks the live worker with the fewest requests in
flight; on a tie, the one with the fewest sessions assigned, then the next in round-robin order
after the last pick (so that sessions started one at a time spread over the workers).

Retries: a request moves to another worker (at most ``max_retries`` times) only when it failed
for a reason of the worker's, before it streamed a token:

    | failure                                           | retried? | error when not        |
    |---------------------------------------------------|----------|-----------------------|
    | WorkerDead, started=False (lost, silent, restart) | yes      | WorkerDead            |
    | WorkerDead, started=True                          | migrated | WorkerDead (502)      |
    | WorkerError "overloaded"                          | yes      | WorkersBusy (429)     |
    | any other WorkerError: invalid_grammar,           | never    | WorkerError: the      |
    |   invalid_request, context_too_long, internal...  |          | same on every worker  |
    | DispatchTimeout, StreamOverflow                   | never    | as raised             |

A retry goes to a worker not yet tried, or to a tried one that has come back since (a new
connection or process; not to one that refused it as overloaded). When no live worker is left
for a retry after a worker was lost, it waits up to ``retry_wait_s`` for one to come (back) up.
A retry uses the wire request id ``<id>.retry<n>``, so that a late reply to the first attempt can
never be taken for one of the retry's.

Migration: a request whose worker is lost after it streamed tokens goes on on another worker, at
most ``migration_limit`` times (``gateway.attempts``): the tokens streamed so far are appended to
its prompt and the worker told they are its own output, so greedy and seeded output is what the
lost worker would have streamed, and the caller's stream goes on as if nothing happened. Once
the limit is spent (or with ``migration_limit=0``), ``WorkerDead`` ends the stream as before.
"""

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any

import msgspec

from engine.protocol import Finished, Generate, TokenDelta
from gateway.affinity import SharedAffinity
from gateway.attempts import (
    DEFAULT_MIGRATION_LIMIT,
    Attempt,
    Migrate,
    Retry,
    already_done,
    as_original,
    is_retryable,
    resume_request,
)
from gateway.builtin_policy import BuiltinPolicy
from gateway.dispatch_errors import (
    DispatchError,
    DispatchTimeout,
    HandshakeError,
    NoWorkerAvailable,
    StreamOverflow,
    WorkerDead,
    WorkerError,
)
from gateway.metrics import RoutingStats, StreamStats
from gateway.request_stream import Push
from gateway.router_link import RouterFactory, RouterLink
from gateway.routing.chain import DEFAULT_MAX_KEYS, PrefixHasher
from gateway.routing.index import DEFAULT_MAX_PAGES, KVIndex
from gateway.routing.types import Decision, RouteRequest, WorkerInfo
from gateway.worker_client import StreamItem, WorkerClient

if TYPE_CHECKING:
    from gateway.admission_gate import AdmissionGate

__all__ = [
    "DispatchError", "DispatchTimeout", "Dispatcher", "HandshakeError",
    "NoWorkerAvailable", "StreamItem", "StreamOverflow", "WorkerClient", "WorkerDead",
    "WorkerError", "WorkersBusy", "is_retryable",
]

logger = logging.getLogger(__name__)

class WorkersBusy(DispatchError):
    """Every live worker refused the request as overloaded (their queues are full), or the
    admission queue is full: the client should retry later (429 + Retry-After).

    Attributes:
        retry_after_s: when to retry, when known (admission's drain-rate estimate)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Dispatcher:
    """Routes requests over several ``WorkerClient``s (see the module docstring).

    Args:
        router: a ``gateway.routing`` policy name (``make_router``), a factory of a router over
            the KV index, or None for the built-in policy.
        router_options: the router's constructor keywords (with a name).
        index_max_pages: the KV index's bound (with a router).
        admission: the admission gate (None: requests are sent as soon as they are routed).
        max_retries: how many other workers a request may move to (see the retry table).
        migration_limit: how many times a request that streamed tokens may move on.
        max_sessions: the bound of the session -> worker map (least recently used go first).
        retry_wait_s: how long a retry waits for a live worker when none is left.

    Attributes:
        num_retries: retries by reason ("worker_lost", "overloaded").
        routing: routing decisions and per-worker counters (``/metrics``).
        affinity: the affinity key -> worker store shared by replicas (set by the sessions
            lifespan; ``gateway.affinity``).
    """

    def __init__(
        self,
        clients: Iterable[WorkerClient],
        *,
        router: str | RouterFactory | None = None,
        router_options: dict[str, Any] | None = None,
        index_max_pages: int = DEFAULT_MAX_PAGES,
        admission: "AdmissionGate | None" = None,
        max_retries: int = 2,
        migration_limit: int = DEFAULT_MIGRATION_LIMIT,
        max_sessions: int = 100_000,
        retry_wait_s: float = 10.0,
    ) -> None:
        self.clients = list(clients)
        assert self.clients, "a Dispatcher needs at least one WorkerClient"
        assert max_retries >= 0 and max_sessions > 0 and retry_wait_s >= 0
        assert migration_limit >= 0, f"{migration_limit=}"
        self.max_retries = max_retries
        self.migration_limit = migration_limit
        self.num_migrations = 0
        self.max_sessions = max_sessions
        self.retry_wait_s = retry_wait_s
        self.stats = StreamStats()
        self.routing = RoutingStats()
        self.num_retries: Counter[str] = Counter()
        self.affinity: SharedAffinity | None = None
        self.gate = admission
        self.link = self._link(router, router_options or {}, index_max_pages)
        self._builtin = BuiltinPolicy(self.clients, max_sessions)
        self.max_hasher_keys = min(max_sessions, DEFAULT_MAX_KEYS)
        self._hasher: PrefixHasher | None = None
        # NOTE: request id -> (the worker that finished it, its wire id), for Retain (bounded, LRU)
        self._finished_on: OrderedDict[str, tuple[WorkerClient, str]] = OrderedDict()
        self._alive_waiters: list[asyncio.Future[None]] = []
        self._active: dict[str, Attempt] = {}  # NOTE: request id -> its attempt in flight
        self._pushes: dict[str, Push] = {}  # NOTE: request id -> its push, for a migration
        # NOTE: (cache_salt, tokens) of each prompt sent and completion finished (the API-key
        # gate's token budgets, gateway.auth_gate)
        self.on_tokens: Callable[[str | None, int], None] | None = None
        for client in self.clients:
            client.alive_listeners.append(self._wake)

    @property
    def router_name(self) -> str:
        return BuiltinPolicy.name if self.link is None else self.link.name

    @property
    def page_size(self) -> int | None:
        """The workers' page size (the router's index); None before any worker answered."""
        index = None if self.link is None else self.link.index
        return None if index is None else index.page_size

    @property
    def hasher(self) -> PrefixHasher | None:
        """The page hasher of the requests' routes (None without a router, or before a worker
        announced its page size)."""
        if self._hasher is None and (page_size := self.page_size) is not None:
            self._hasher = PrefixHasher(page_size, self.max_hasher_keys)
        return self._hasher

    @property
    def index_pages(self) -> int:
        index = None if self.link is None else self.link.index
        return 0 if index is None else index.num_pages

    @property
    def index_host_pages(self) -> int:
        index = None if self.link is None else self.link.index
        return 0 if index is None else index.num_host_pages

    @property
    def index_storage_pages(self) -> int:
        index = None if self.link is None else self.link.index
        return 0 if index is None else index.num_storage_pages

    @property
    def index_workers(self) -> int:
        feed = None if self.link is None else self.link.feed
        return 0 if feed is None else feed.num_subscribers

    def pick(
        self, session_id: str | None = None, exclude: Iterable[WorkerClient] = ()
    ) -> WorkerClient:
        """Where a request of ``session_id`` would go now: the router's pick (a request of no
        tokens), or the built-in policy's (the session's worker if it is alive, else the least
        loaded live worker; ties: fewest sessions, then round robin).

        Raises:
            NoWorkerAvailable: every worker is dead or excluded.
        """
        route = RouteRequest(request_id="pick", num_tokens=0, affinity_key=session_id)
        return self._choose(route, set(exclude))[0]

    async def generate(
        self, request: Generate, route: RouteRequest | None = None, **timeouts: float
    ) -> AsyncIterator[StreamItem]:
        """``WorkerClient.generate`` on the worker the router picks for ``route`` (default:
        the request's session id as its affinity key, no page hashes), moved to another worker
        as the retry table says.

        Raises:
            WorkerDead: with ``started=True``, or when every retry's worker was lost too.
            WorkersBusy: every live worker was overloaded, or the admission queue is full.
            NoWorkerAvailable, WorkerError, DispatchTimeout, ...: as ``WorkerClient.generate``.
        """
        route = route or default_route(request)
        if self.on_tokens is not None:
            self.on_tokens(request.cache_salt, len(request.input_ids))
        if self.link is not None and self.affinity is not None:
            await self.affinity.load(route)
        # NOTE: one loop over the attempts (the first, its retries and its migrations), not a
        # generator of its own: every delta of a queued stream passes through here
        try:
            tried: list[tuple[WorkerClient, int]] = []  # NOTE: (client, its epoch when tried)
            last_error: DispatchError | None = None
            streamed: list[int] = []  # NOTE: the tokens of every attempt so far (a migration's)
            retries = migrations = 0
            moved = False  # NOTE: the last attempt ended in a migration, not a retry
            for attempt in itertools.count():
                wire, attempt_route = request, route
                resumed = len(streamed)
                if attempt:
                    retry_id = f"{request.request_id}.retry{attempt}"
                    wire = resume_request(request, streamed, retry_id) if resumed else \
                        msgspec.structs.replace(request, request_id=retry_id)
                    attempt_route = dataclasses.replace(route, request_id=retry_id,
                                                        num_tokens=len(wire.input_ids))
                client, decision = await self._pick_for_attempt(attempt_route, tried, last_error)
                tried.append((client, client.epoch))
                if self.link is not None and self.affinity is not None:
                    self.affinity.decided(route, decision.worker_id)
                if last_error is not None and not moved:
                    reason = "overloaded" if isinstance(last_error, WorkerError) else "worker_lost"
                    self.num_retries[reason] += 1
                try:
                    async with contextlib.aclosing(
                        self._attempt(client, decision, wire, attempt_route, timeouts,
                                      request.request_id, streamed)
                    ) as stream:
                        async for item in stream:
                            if resumed and type(item) is Finished:
                                item = as_original(item, request, resumed)
                            yield item
                    return
                except Migrate as move:
                    if migrations >= self.migration_limit:
                        raise move.error from None
                    if (done := already_done(request, streamed)) is not None:
                        yield done
                        return
                    migrations += 1
                    self.num_migrations += 1
                    if self.on_tokens is not None:  # NOTE: the lost attempt never said Finished
                        self.on_tokens(request.cache_salt, len(streamed) - resumed)
                    last_error, moved = move.error, True
                    logger.warning("moving %s to another worker after %d tokens: %s",
                                   request.request_id, len(streamed), move.error)
                except Retry as retry:
                    exc = retry.error
                    if retries >= self.max_retries:
                        if isinstance(exc, WorkerError):
                            raise WorkersBusy(f"every worker tried is overloaded: {exc}") from exc
                        raise exc from None
                    retries += 1
                    last_error, moved = exc, False
                    logger.warning("retrying %s elsewhere: %s", request.request_id, exc)
        finally:
            self._pushes.pop(request.request_id, None)

    def retain(self, request_id: str, ttl_s: float) -> bool:
        """Send ``Retain(ttl_s)`` for a request that finished lately to the worker that ran it,
        under the wire id it ran with (a retry's is ``<id>.retry<n>``); ``ttl_s=0`` releases.
        False when that worker is unknown (long ago) or not reachable now."""
        finished = self._finished_on.get(request_id)
        if finished is None:
            return False
        client, wire_id = finished
        return client.retain(wire_id, ttl_s)

    async def close(self) -> None:
        """Stop the KV event subscribers and wait for the affinity writes still running."""
        if self.affinity is not None:
            await self.affinity.settle()
        if self.link is not None:
            await self.link.close()

    # ---------------------------------------------------------------- one attempt

    async def _attempt(
        self,
        client: WorkerClient,
        decision: Decision,
        wire: Generate,
        route: RouteRequest,
        timeouts: dict[str, float],
        request_id: str,
        streamed: list[int],
    ) -> AsyncIterator[StreamItem]:
        """Admit (when gated) and send ``wire`` to ``client``; the router hears of its dispatch,
        first token and end. A failure the retry table retries is raised as ``Retry``, a lost
        worker after the first token as ``Migrate``. ``request_id`` is the client's id
        (``wire``'s is a retry's ``<id>.retry<n>``); its tokens are added to ``streamed``."""
        stats = self.stats
        # NOTE: token timings mean something only when the worker sends every step's tokens
        timed = wire.stream_interval_s == 0
        # NOTE: its last_s is the dispatch time, then the last delta's (pushed ones included)
        attempt = self._active[request_id] = Attempt(client, wire.request_id, timed,
                                                      time.perf_counter(), streamed)
        wid = self.link.worker_id(client) if self.link is not None else None
        rid = wire.request_id
        try:
            wire = await self._admit(wire, route, wid, decision)
            if wid is not None:
                self.link.dispatched(route, wid)  # type: ignore[union-attr]
            self.routing.decided(self.router_name, decision.reason, client.endpoint)
            started = False
            try:
                async with contextlib.aclosing(client.generate(wire, **timeouts)) as stream:
                    async for item in stream:
                        if type(item) is TokenDelta:
                            attempt.delta_came(stats, item, time.perf_counter(), first=not started)
                            if not started:
                                self._first_token(rid, wid)
                                if (push := self._pushes.get(request_id)) is not None:
                                    self.push_to(request_id, push)  # NOTE: a migration's
                        else:
                            stats.finished(item)
                            if self.on_tokens is not None:
                                self.on_tokens(wire.cache_salt, item.completion_tokens)
                            self.routing.finished(client.endpoint, item)
                            self._note_finished(request_id, item.request_id, client)
                        started = True
                        yield item
            except (WorkerDead, WorkerError) as exc:
                if started and isinstance(exc, WorkerDead) and self.migration_limit:
                    raise Migrate(exc) from exc
                if started or not is_retryable(exc):
                    raise
                raise Retry(exc) from exc
        finally:
            if self._active.get(request_id) is attempt:
                del self._active[request_id]
            self._ended(rid, wid)

    def push_to(self, request_id: str, push: Push) -> bool:
        """Let ``push`` take ``request_id``'s next deltas straight from its worker's replies
        while its reader waits (``RequestStream``: a chat stream writes its chunks
        there). Their token timings are observed as the stream's own. False when the request
        is not in flight."""
        attempt = self._active.get(request_id)
        if attempt is None:
            return False
        self._pushes[request_id] = push
        stats = self.stats

        def timed_push(item: TokenDelta) -> bool:
            now_s = time.perf_counter()
            if not push(item):
                return False
            stats.pushed_tokens += len(item.token_ids)
            attempt.delta_came(stats, item, now_s, first=False)
            return True

        return attempt.client.push_to(attempt.wire_id, timed_push)

    async def _admit(
        self, wire: Generate, route: RouteRequest, wid: str | None, decision: Decision
    ) -> Generate:
        """``wire`` with the priority admission gives it, once admitted (no gate: as is).

        Raises:
            WorkersBusy: the admission queue is full (with admission's Retry-After).
        """
        if self.gate is None or wid is None:
            return wire
        from gateway.routing.admission import QueueFull, Ticket

        ticket = Ticket(
            request_id=wire.request_id, worker_id=wid, tenant=route.tenant,
            num_tokens=route.num_tokens, cached_tokens=decision.cached_tokens,
            arrival_s=time.monotonic(),
        )
        try:
            await self.gate.admit(ticket)
        except QueueFull as exc:
            raise WorkersBusy(f"admission queue full: {exc}", exc.retry_after_s) from exc
        if ticket.priority == wire.priority:
            return wire
        return msgspec.structs.replace(wire, priority=ticket.priority)

    def _first_token(self, rid: str, wid: str | None) -> None:
        if wid is not None and self.link is not None:
            self.link.first_token(rid)
        if self.gate is not None and wid is not None:
            self.gate.started(rid)

    def _ended(self, rid: str, wid: str | None) -> None:
        """NOTE: on every end: finished, failed, aborted, retried, refused by admission."""
        if wid is not None and self.link is not None:
            self.link.finished(rid)
        if self.gate is not None and wid is not None:
            self.gate.done(rid)

    def _note_finished(self, request_id: str, wire_id: str, client: WorkerClient) -> None:
        self._finished_on[request_id] = (client, wire_id)
        self._finished_on.move_to_end(request_id)
        while len(self._finished_on) > self.max_sessions:
            self._finished_on.popitem(last=False)

    # ---------------------------------------------------------------- picking

    async def _pick_for_attempt(
        self,
        route: RouteRequest,
        tried: list[tuple[WorkerClient, int]],
        last_error: DispatchError | None,
    ) -> tuple[WorkerClient, Decision]:
        """The first attempt's worker, or a retry's: never one that failed this request and
        has not come back since. A retry after a lost worker waits for one to come up.

        NOTE: returns without suspending when a worker is free, so that the request is in
        flight on it before any other pick runs (the least-loaded choice stays true).
        """
        deadline = time.monotonic() + self.retry_wait_s
        while True:
            excluded = {c for c, epoch in tried if c.epoch == epoch}
            try:
                return self._choose(route, excluded)
            except NoWorkerAvailable as exc:
                if isinstance(last_error, WorkerError):
                    raise WorkersBusy(f"every live worker is overloaded: {last_error}") from exc
                if last_error is None or (left_s := deadline - time.monotonic()) <= 0:
                    raise
            await self._some_worker_alive(left_s)

    def _choose(
        self, route: RouteRequest, excluded: set[WorkerClient]
    ) -> tuple[WorkerClient, Decision]:
        live = [c for c in self.clients if c.is_alive and c not in excluded]
        if not live:
            raise NoWorkerAvailable(f"no live worker among {len(self.clients)}")
        if self.link is None:
            return self._builtin.pick(route.affinity_key, live)
        picked = self.link.route(route, live)
        if picked is None:
            raise NoWorkerAvailable(f"no routable worker among {len(live)} live")
        return picked

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

    def _link(self, router: str | RouterFactory | None, options: dict[str, Any],
              max_pages: int) -> RouterLink | None:
        if router is None:
            return None
        if isinstance(router, str):
            from gateway.routing.registry import make_router

            name = router
            factory: RouterFactory = lambda index: make_router(name, index, **options)  # noqa: E731
            factory(KVIndex(page_size=1))  # NOTE: a bad name or option fails here, not later
        else:
            factory, name = router, getattr(router, "name", "custom")
        return RouterLink(self.clients, factory, name, index_max_pages=max_pages,
                          on_worker_added=self._admission_add,
                          on_worker_removed=self._admission_remove)

    def _admission_add(self, worker_id: str, info: WorkerInfo) -> None:
        if self.gate is not None:
            self.gate.add_worker(worker_id, info.cost, info.max_batched_tokens)

    def _admission_remove(self, worker_id: str) -> None:
        if self.gate is not None:
            self.gate.remove_worker(worker_id)


def default_route(request: Generate) -> RouteRequest:
    """The ``RouteRequest`` of a request nobody built one for: its session id as the affinity
    key, no page hashes (the router goes by affinity and load)."""
    return RouteRequest(
        request_id=request.request_id, num_tokens=len(request.input_ids),
        affinity_key=request.session_id, tenant=request.cache_salt or "",
        max_new_tokens=request.sampling.max_new_tokens,
    )
