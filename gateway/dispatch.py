"""Async ZeroMQ clients to the engine workers: a ``WorkerClient`` each, a ``Dispatcher`` over all.

A ``WorkerClient`` owns one DEALER socket. An event-loop reader on the socket's FD drains every
reply and routes it by ``request_id`` to that request's queue, so many streams share the socket;
a task sends a ``GetLoad`` heartbeat every ``heartbeat_s``. The socket is a plain (not
``zmq.asyncio``) one, read only in non-blocking calls from the loop: zmq.asyncio costs a Future
and a reader re-registration per message. When nothing at all (a reply or a heartbeat's
``LoadReport``) arrives for ``dead_after_s``, the worker is marked dead and each in-flight request
fails with ``WorkerDead(started)``; any later message marks it alive again.

Every ``generate()`` ends in exactly one way: it yields ``Finished`` last, or raises a
``DispatchError``. Leaving the stream early (``aclose()``, cancellation, a timeout, a slow
consumer) sends ``Abort``, so a client that went away stops costing the worker anything.

The ``Dispatcher`` picks the least loaded live worker (fewest in-flight requests), keeps a session
on its worker while that worker lives, and retries a request on another worker when its worker
died (or was overloaded) before it streamed a token. This module imports only
``engine.protocol`` from the engine: the gateway never loads torch.
"""

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Iterable

import zmq

from engine.protocol import (
    PROTOCOL_VERSION,
    Abort,
    ClientMsg,
    ErrorReply,
    Finished,
    Generate,
    GetLoad,
    Hello,
    LoadReport,
    ProtocolError,
    TokenDelta,
    Welcome,
    decode_worker,
    encode,
)
from gateway.metrics import StreamStats

logger = logging.getLogger(__name__)

StreamItem = TokenDelta | Finished
_client_ids = itertools.count()


class DispatchError(Exception):
    """Base of every error a dispatch call raises."""


class HandshakeError(DispatchError):
    """``connect()`` got no ``Welcome`` in time, or the worker speaks another protocol version."""


class DispatchTimeout(DispatchError):
    """A request waited too long for its first token or its next one; it was aborted."""


class StreamOverflow(DispatchError):
    """The consumer fell more than ``max_pending_deltas`` behind; the request was aborted."""


class NoWorkerAvailable(DispatchError):
    """No live worker is left to take a request."""


class WorkerError(DispatchError):
    """The worker ended the request with ``ErrorReply(code, message)``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class WorkerDead(DispatchError):
    """The worker stopped answering. ``started``: the request had streamed at least one delta."""

    def __init__(self, worker: str, started: bool) -> None:
        super().__init__(f"worker {worker} is not answering (started={started})")
        self.started = started


class _Stream:
    """The routing state of one in-flight request."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[TokenDelta | Finished | ErrorReply | DispatchError] = (
            asyncio.Queue()
        )
        self.started = False
        self.overflowed = False


class WorkerClient:
    """An asyncio client for one worker (see the module docstring).

    Args:
        endpoint: the worker's ROUTER endpoint (``--listen``).
        first_token_timeout_s, idle_timeout_s: defaults for ``generate()``.
        max_pending_deltas: the bound of each request's queue of unread deltas.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        client_id: str | None = None,
        connect_timeout_s: float = 10.0,
        first_token_timeout_s: float = 60.0,
        idle_timeout_s: float = 30.0,
        heartbeat_s: float = 1.0,
        dead_after_s: float = 3.0,
        max_pending_deltas: int = 1024,
    ) -> None:
        assert 0 < heartbeat_s < dead_after_s, f"heartbeat_s={heartbeat_s} < {dead_after_s=}"
        assert min(connect_timeout_s, first_token_timeout_s, idle_timeout_s) > 0
        assert max_pending_deltas > 0, f"{max_pending_deltas=}"
        self.endpoint = endpoint
        self.client_id = client_id or f"gateway-{os.getpid()}-{next(_client_ids)}"
        self.connect_timeout_s = connect_timeout_s
        self.first_token_timeout_s = first_token_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.max_pending_deltas = max_pending_deltas
        self.welcome: Welcome | None = None
        self.last_load: LoadReport | None = None
        self.is_alive = False
        self._sock: zmq.Socket[bytes] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._welcome: asyncio.Future[Welcome] | None = None
        self._streams: dict[str, _Stream] = {}
        # NOTE: the worker answers GetLoads in order; None marks a heartbeat's report.
        self._load_waiters: deque[asyncio.Future[LoadReport] | None] = deque()
        self._tasks: list[asyncio.Task[None]] = []
        self._last_seen = 0.0

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def name(self) -> str:
        return self.welcome.worker_id if self.welcome else self.endpoint

    async def connect(self) -> Welcome:
        """Open the socket, say Hello, start the receive and heartbeat tasks.

        Raises:
            HandshakeError: no Welcome within ``connect_timeout_s``, or a version mismatch.
        """
        assert self._sock is None, "connect() twice"
        loop = self._loop = asyncio.get_running_loop()
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.endpoint)
        self._welcome = loop.create_future()
        loop.add_reader(self._sock.getsockopt(zmq.FD), self._drain)
        self._send(Hello(version=PROTOCOL_VERSION, client_id=self.client_id))
        try:
            self.welcome = await asyncio.wait_for(self._welcome, self.connect_timeout_s)
        except TimeoutError:
            self.close()
            msg = f"no Welcome from {self.endpoint} in {self.connect_timeout_s} s"
            raise HandshakeError(msg) from None
        except HandshakeError:
            self.close()
            raise
        self.is_alive = True
        self._last_seen = time.monotonic()
        self._tasks = [loop.create_task(self._heartbeat())]
        return self.welcome

    async def generate(
        self,
        request: Generate,
        *,
        first_token_timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
    ) -> AsyncIterator[StreamItem]:
        """Stream one request: its ``TokenDelta``s, then its ``Finished``.

        Leaving early (``aclose()``, cancellation, an error below) aborts it on the worker.

        Raises:
            WorkerError: the worker answered ``ErrorReply`` for this request.
            WorkerDead: the worker stopped answering (or was already dead).
            DispatchTimeout, StreamOverflow: the request was aborted.
            DispatchError: not connected, closed, or ``request_id`` already in flight here.
        """
        rid = request.request_id
        self._check_can_send(rid)
        stream = self._streams[rid] = _Stream()
        ended = False
        try:
            if not self._send(request):
                raise WorkerDead(self.name, started=False)
            while True:
                item = await self._next(stream, rid, first_token_timeout_s, idle_timeout_s)
                if isinstance(item, TokenDelta):
                    yield item
                    continue
                # NOTE: a timeout or an overflow leaves the request running: finally aborts it
                ended = isinstance(item, Finished | ErrorReply | WorkerDead)
                if isinstance(item, Finished):
                    yield item
                    return
                if isinstance(item, ErrorReply):
                    raise WorkerError(item.code, item.message)
                raise item
        finally:
            if self._streams.get(rid) is stream:  # NOTE: _fail_all may have removed it
                del self._streams[rid]
            if not ended and self.is_alive and self._sock is not None:
                self._send(Abort(request_id=rid))

    async def abort(self, request_id: str) -> None:
        """Ask the worker to stop ``request_id``; its stream ends with ``Finished("abort")``."""
        if self._sock is not None:
            self._send(Abort(request_id=request_id))

    async def load(self, timeout_s: float = 5.0) -> LoadReport:
        """A fresh ``LoadReport`` (answering a GetLoad sent now).

        Raises:
            DispatchTimeout: no report within ``timeout_s``.
            WorkerDead: the worker is marked dead.
        """
        if not self.is_alive or self._sock is None:
            raise WorkerDead(self.name, started=False)
        waiter: asyncio.Future[LoadReport] = asyncio.get_running_loop().create_future()
        self._load_waiters.append(waiter)
        self._send(GetLoad())
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except TimeoutError:
            raise DispatchTimeout(f"no LoadReport from {self.name} in {timeout_s} s") from None

    def close(self) -> None:
        """Stop the tasks, fail what is in flight, close the socket. Safe to call twice."""
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        self._fail_all(lambda _: DispatchError(f"client of {self.name} closed"))
        self.is_alive = False
        if self._sock is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._sock.getsockopt(zmq.FD))
            self._sock.close(linger=0)
            self._sock = None

    # ------------------------------------------------------------------ private

    def _drain(self) -> None:
        """Read every queued reply (the loop calls this when the socket's FD is readable).

        NOTE: the FD is edge-triggered: reading ``EVENTS`` re-arms it, so read until POLLIN is off.
        """
        sock = self._sock
        while sock is not None and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._on_message(sock.recv(zmq.NOBLOCK))
            sock = self._sock  # NOTE: routing may have closed it

    def _on_message(self, data: bytes) -> None:
        self._last_seen = time.monotonic()
        if not self.is_alive and self.welcome is not None:
            logger.warning("worker %s answers again", self.name)
            self.is_alive = True
        try:
            self._route(decode_worker(data))
        except ProtocolError as exc:
            logger.error("dropping a reply from %s: %s", self.name, exc)

    def _route(self, msg: object) -> None:
        if type(msg) is TokenDelta:  # NOTE: the common case first
            if (stream := self._streams.get(msg.request_id)) is not None:
                self._deliver(stream, msg)
        elif isinstance(msg, LoadReport):
            self.last_load = msg
            waiter = self._load_waiters.popleft() if self._load_waiters else None
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)
        elif isinstance(msg, TokenDelta | Finished | ErrorReply) and msg.request_id is not None:
            stream = self._streams.get(msg.request_id)
            if stream is not None:  # NOTE: None = a request we stopped waiting for
                self._deliver(stream, msg)
        elif isinstance(msg, Welcome | ErrorReply) and not self._handshake_done(msg):
            logger.error("worker %s: unexpected %r", self.name, msg)

    def _handshake_done(self, msg: Welcome | ErrorReply) -> bool:
        """Resolve ``connect()``'s wait with ``msg``; False when nothing waits for it."""
        waiter = self._welcome
        if waiter is None or waiter.done():
            return False
        if isinstance(msg, Welcome):
            waiter.set_result(msg)
        elif msg.code == "version_mismatch":
            waiter.set_exception(HandshakeError(f"{self.endpoint}: {msg.message}"))
        else:
            return False
        return True

    def _deliver(self, stream: _Stream, msg: TokenDelta | Finished | ErrorReply) -> None:
        if stream.overflowed:
            return
        if isinstance(msg, TokenDelta):
            stream.started = True
            if stream.queue.qsize() >= self.max_pending_deltas:
                stream.overflowed = True  # NOTE: generate()'s finally sends the Abort
                msg = StreamOverflow(f"{msg.request_id}: over {self.max_pending_deltas} unread")
        stream.queue.put_nowait(msg)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            silent_s = time.monotonic() - self._last_seen
            if self.is_alive and silent_s > self.dead_after_s:
                self._mark_dead(silent_s)
            self._load_waiters.append(None)
            self._send(GetLoad())

    def _mark_dead(self, silent_s: float) -> None:
        logger.error("worker %s silent for %.1f s: marked dead", self.name, silent_s)
        self.is_alive = False
        self._fail_all(lambda s: WorkerDead(self.name, started=s.started))

    def _fail_all(self, error: Callable[[_Stream], DispatchError]) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(error(stream))
        self._streams.clear()  # NOTE: late replies to these requests are dropped
        for waiter in self._load_waiters:
            if waiter is not None and not waiter.done():
                waiter.set_exception(WorkerDead(self.name, started=False))
        self._load_waiters.clear()

    async def _next(
        self, stream: _Stream, rid: str, first_s: float | None, idle_s: float | None
    ) -> TokenDelta | Finished | ErrorReply | DispatchError:
        if stream.started:
            timeout_s, what = idle_s or self.idle_timeout_s, "next"
        else:
            timeout_s, what = first_s or self.first_token_timeout_s, "first"
        if not stream.queue.empty():  # NOTE: no timer when the item is already here
            return stream.queue.get_nowait()
        try:
            async with asyncio.timeout(timeout_s):  # NOTE: wait_for would start a Task per item
                return await stream.queue.get()
        except TimeoutError:
            return DispatchTimeout(f"{rid}: no {what} token from {self.name} in {timeout_s} s")

    def _check_can_send(self, rid: str) -> None:
        if self._sock is None:
            raise DispatchError(f"client of {self.endpoint} is not connected")
        if not self.is_alive:
            raise WorkerDead(self.name, started=False)
        if rid in self._streams:
            raise DispatchError(f"request {rid!r} is already in flight on {self.name}")

    def _send(self, msg: ClientMsg) -> bool:
        """Queue ``msg``; False when the socket's queue is full (the worker is away too long).

        NOTE: a DEALER queues while its peer is away, so this never blocks: safe in the finally
        block of a cancelled generator. A send may consume the FD's edge for a reply that arrived
        meanwhile, so it schedules a drain when one is waiting.
        """
        sock = self._sock
        assert sock is not None and self._loop is not None
        try:
            sock.send(encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("send queue to %s is full: dropped %s", self.name, type(msg).__name__)
            return False
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._loop.call_soon(self._drain)
        return True


class Dispatcher:
    """Routes requests over several connected ``WorkerClient``s (least loaded, session sticky).

    Args:
        max_retries: how many other workers a request may move to after a worker died (or was
            overloaded) before it streamed anything.
        max_sessions: the bound of the session -> worker map (least recently used go first).
    """

    def __init__(
        self, clients: Iterable[WorkerClient], *, max_retries: int = 2, max_sessions: int = 100_000
    ) -> None:
        self.clients = list(clients)
        assert self.clients, "a Dispatcher needs at least one WorkerClient"
        assert max_retries >= 0 and max_sessions > 0
        self.max_retries = max_retries
        self.max_sessions = max_sessions
        self.stats = StreamStats()
        self._sessions: OrderedDict[str, WorkerClient] = OrderedDict()

    def pick(
        self, session_id: str | None = None, exclude: Iterable[WorkerClient] = ()
    ) -> WorkerClient:
        """The session's worker if it is alive, else the live worker with the fewest in flight.

        Raises:
            NoWorkerAvailable: every worker is dead or excluded.
        """
        excluded = set(map(id, exclude))
        if (sticky := self._sticky(session_id, excluded)) is not None:
            return sticky
        live = [c for c in self.clients if c.is_alive and id(c) not in excluded]
        if not live:
            raise NoWorkerAvailable(f"no live worker among {len(self.clients)}")
        client = min(live, key=lambda c: c.num_in_flight)
        if session_id is not None:
            self._remember(session_id, client)
        return client

    async def generate(self, request: Generate, **timeouts: float) -> AsyncIterator[StreamItem]:
        """``WorkerClient.generate`` on ``pick(request.session_id)``, moved to another worker
        when the first one dies or is overloaded before streaming a token.

        Raises:
            WorkerDead: with ``started=True``, or when every retry's worker died too.
            NoWorkerAvailable, WorkerError, DispatchTimeout, ...: as ``WorkerClient.generate``.
        """
        tried: list[WorkerClient] = []
        stats = self.stats
        # NOTE: token timings mean something only when the worker sends every step's tokens
        timed = request.stream_interval_s == 0
        last_s = time.perf_counter()  # NOTE: the dispatch time, then the last delta's
        for attempt in itertools.count():
            client = self.pick(request.session_id, exclude=tried)
            tried.append(client)
            started = False
            try:
                async with contextlib.aclosing(client.generate(request, **timeouts)) as stream:
                    async for item in stream:
                        now_s = time.perf_counter()
                        if type(item) is TokenDelta:
                            if timed:
                                (stats.itl if started else stats.ttft).observe(now_s - last_s)
                            last_s = now_s
                        else:
                            stats.finished(item)
                        started = True
                        yield item
                return
            except (WorkerDead, WorkerError) as exc:
                if started or attempt >= self.max_retries or not _is_retryable(exc):
                    raise
                logger.warning("retrying %s elsewhere: %s", request.request_id, exc)

    def _sticky(self, session_id: str | None, excluded: set[int]) -> WorkerClient | None:
        if session_id is None or (client := self._sessions.get(session_id)) is None:
            return None
        if not client.is_alive or id(client) in excluded:
            return None
        self._sessions.move_to_end(session_id)
        return client

    def _remember(self, session_id: str, client: WorkerClient) -> None:
        self._sessions[session_id] = client
        self._sessions.move_to_end(session_id)
        if len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)


def _is_retryable(exc: DispatchError) -> bool:
    if isinstance(exc, WorkerDead):
        return not exc.started
    return isinstance(exc, WorkerError) and exc.code == "overloaded"
