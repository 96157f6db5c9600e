"""An async ZeroMQ client for one engine worker: ``WorkerClient`` (errors: ``dispatch_errors``).

A ``WorkerClient`` owns one DEALER socket. An event-loop reader on the socket's FD drains every
reply and routes it by ``request_id`` to that request's queue, so many streams share the socket.
The socket is a plain (not ``zmq.asyncio``) one, read only in non-blocking calls from the loop:
zmq.asyncio costs a Future and a reader re-registration per message.

Connection life cycle (``start()`` returns at once; ``connect()`` also awaits the first Welcome):

    connecting --Welcome--> alive --(TCP connection lost | silent dead_after_s | new instance)--+
        ^                                                                                        |
        +-- ZeroMQ reconnects (every 0.1 s, backing off to 2 s); each new connection says Hello -+

- A task sends a ``GetLoad`` heartbeat every ``heartbeat_s`` while alive; while not alive it sends
  ``Hello`` again (backing off to ``HELLO_RETRY_MAX_S``) until a ``Welcome`` answers.
- A socket monitor reports the TCP connection's loss at once (a killed worker's kernel closes
  it): the client is no longer alive and every in-flight request fails with
  ``WorkerDead(started)`` at once. NOTE: a DEALER's routing identity is per connection, so the
  replies of requests sent over a lost connection can never come back, even from the same worker.
- Nothing at all for ``dead_after_s`` (a hung or stalled worker) does the same, and also sends
  ``Abort`` for the failed requests, which a stalled worker reads once it runs again.
- ``Welcome.instance_id`` and ``LoadReport.instance_id`` are new per worker process: another one
  on the same endpoint without a connection loss seen in between (a restart the monitor did not
  report) fails the in-flight requests the same way (and aborts them on the new process).

Every ``generate()`` ends in exactly one way: it yields ``Finished`` last, or raises a
``DispatchError``. Leaving the stream early (``aclose()``, cancellation, a timeout, a slow
consumer) sends ``Abort``, so a client that went away stops costing the worker anything. This
module imports only ``engine.protocol`` and ``engine.worker.curve`` from the engine: the gateway
never loads torch.
"""

import asyncio
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

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
    Replies,
    Retain,
    TokenDelta,
    Welcome,
    decode_worker,
    encode,
)
from engine.worker.curve import CurveClientKeys
from gateway.connection_monitor import ConnectionMonitor
from gateway.dispatch_errors import (
    DispatchError,
    DispatchTimeout,
    HandshakeError,
    WorkerDead,
    WorkerError,
)
from gateway.request_stream import Push, RequestStream

_NOBLOCK, _POLLIN = int(zmq.NOBLOCK), int(zmq.POLLIN)
logger = logging.getLogger(__name__)

StreamItem = TokenDelta | Finished
RECONNECT_IVL_MS = 100  # NOTE: ZeroMQ's first reconnect delay, doubled on each failure ...
RECONNECT_IVL_MAX_MS = 2000  # ... up to this
HELLO_RETRY_MAX_S = 5.0
CLOSE_LINGER_MS = 1000
_client_ids = itertools.count()


class WorkerClient:
    """An asyncio client for one worker (see the module docstring).

    Args:
        endpoint: the worker's ROUTER endpoint (``--listen``).
        connect_timeout_s: how long ``connect()`` waits for the first Welcome.
        first_token_timeout_s, idle_timeout_s: defaults for ``generate()``.
        max_pending_deltas: the bound of each request's queue of unread deltas.
        curve: connect as a CURVE client (a worker with ``--curve-keys``); the KV event
            subscriber of this worker uses the same keys. None: no authentication. NOTE: a
            worker that refuses the keys never answers (no Welcome): it stays "connecting".

    Attributes:
        is_alive: a Welcome came on the current connection, and nothing was lost since.
        instance_id: the worker process last heard from (None before the first Welcome).
        epoch: +1 each time the in-flight requests are lost (connection lost, silence, restart).
        num_reconnects: times the worker was alive again after being lost.
        num_new_instances: times another ``instance_id`` answered on the endpoint.
        alive_listeners: called (no arguments) each time the client turns alive.
        lost_listeners: called (no arguments) each time an alive client is lost (connection
            lost, silent, another instance answered) or closed.
        load_listeners: called with each ``LoadReport`` of an alive worker (heartbeats).
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
        curve: CurveClientKeys | None = None,
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
        self.curve = curve
        self.welcome: Welcome | None = None
        self.last_load: LoadReport | None = None
        self.is_alive = False
        self.instance_id: str | None = None
        self.epoch = 0
        self.num_reconnects = 0
        self.num_new_instances = 0
        self.alive_listeners: list[Callable[[], None]] = []  # NOTE: called on turning alive
        self.lost_listeners: list[Callable[[], None]] = []  # NOTE: called on losing it
        self.load_listeners: list[Callable[[LoadReport], None]] = []
        self._sock: zmq.Socket[bytes] | None = None
        self._monitor: ConnectionMonitor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._welcome_waiters: list[asyncio.Future[Welcome]] = []
        self._streams: dict[str, RequestStream] = {}
        # NOTE: the worker answers GetLoads in order; None marks a heartbeat's report.
        self._load_waiters: deque[asyncio.Future[LoadReport] | None] = deque()
        self._tasks: list[asyncio.Task[None]] = []
        self._last_seen = 0.0
        self._is_connected = False  # NOTE: the TCP connection, as the monitor reports it
        self._was_alive = False
        self._expect_new_instance = False  # NOTE: a loss was seen: a new instance is no news
        self._hello_at = 0.0
        self._hello_retry_s = heartbeat_s

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def name(self) -> str:
        return self.welcome.worker_id if self.welcome else self.endpoint

    def start(self) -> None:
        """Open the socket and keep connecting in the background; returns at once.

        ``is_alive`` turns True when the worker's Welcome comes, now or whenever it comes up.
        """
        assert self._sock is None, "start() twice"
        loop = self._loop = asyncio.get_running_loop()
        sock = self._sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        if self.curve is not None:
            self.curve.apply(sock)
        self._monitor = ConnectionMonitor(sock, loop, self._on_connected, self._on_disconnected)
        self._monitor.start()
        sock.connect(self.endpoint)
        loop.add_reader(sock.getsockopt(zmq.FD), self._drain)
        self._tasks = [loop.create_task(self._supervise())]

    async def connect(self) -> Welcome:
        """``start()``, then wait for the worker's Welcome.

        Raises:
            HandshakeError: no Welcome within ``connect_timeout_s``, or a version mismatch
                (the client is closed then).
        """
        self.start()
        try:
            return await asyncio.wait_for(self.wait_welcome(), self.connect_timeout_s)
        except TimeoutError:
            self.close()
            msg = f"no Welcome from {self.endpoint} in {self.connect_timeout_s} s"
            raise HandshakeError(msg) from None
        except HandshakeError:
            self.close()
            raise

    async def wait_welcome(self) -> Welcome:
        """The next Welcome (at once when alive). Raises ``HandshakeError`` on a version
        mismatch."""
        if self.is_alive and self.welcome is not None:
            return self.welcome
        assert self._loop is not None, "wait_welcome() before start()"
        waiter: asyncio.Future[Welcome] = self._loop.create_future()
        self._welcome_waiters.append(waiter)
        try:
            return await waiter
        finally:
            if waiter in self._welcome_waiters:
                self._welcome_waiters.remove(waiter)

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
            WorkerDead: the worker was lost (or was not alive).
            DispatchTimeout, StreamOverflow: the request was aborted.
            DispatchError: not started, closed, or ``request_id`` already in flight here.
        """
        rid = request.request_id
        self._check_can_send(rid)
        stream = self._streams[rid] = RequestStream(rid)
        ended = False
        try:
            if not self._send(request):
                raise WorkerDead(self.name, started=False)
            while True:
                item = await stream.next(
                    first_token_timeout_s or self.first_token_timeout_s,
                    idle_timeout_s or self.idle_timeout_s, self.name)
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
            stream.close()
            if self._streams.get(rid) is stream:  # NOTE: _fail_all may have removed it
                del self._streams[rid]
            if not ended and self.is_alive and self._sock is not None:
                self._send(Abort(request_id=rid))

    def push_to(self, request_id: str, push: Push | None) -> bool:
        """Hand ``request_id``'s deltas to ``push`` while its reader waits for them (None: stop);
        see ``RequestStream``. False when it is not in flight here."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        stream.push = push
        return True

    async def abort(self, request_id: str) -> None:
        """Ask the worker to stop ``request_id``; its stream ends with ``Finished("abort")``."""
        if self._sock is not None:
            self._send(Abort(request_id=request_id))

    def retain(self, request_id: str, ttl_s: float) -> bool:
        """Ask the worker to keep finished ``request_id``'s end checkpoint ``ttl_s`` more seconds
        (0 releases it); fire and forget. False when it could not be sent."""
        return self.is_alive and self._send(Retain(request_id=request_id, ttl_s=ttl_s))

    async def load(self, timeout_s: float = 5.0) -> LoadReport:
        """A fresh ``LoadReport`` (answering a GetLoad sent now).

        Raises:
            DispatchTimeout: no report within ``timeout_s``.
            WorkerDead: the worker is not alive.
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
        """Stop the tasks, fail what is in flight (and abort it on the worker), close the socket.
        Safe to call twice."""
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        failed = self._fail_all(lambda _: DispatchError(f"client of {self.name} closed"))
        was_alive, self.is_alive = self.is_alive, False
        if was_alive:
            for rid in failed:
                self._send(Abort(request_id=rid))
            self._notify(self.lost_listeners)
        self._reject_welcome_waiters(HandshakeError(f"client of {self.endpoint} closed"))
        if self._sock is None:
            return
        if self._monitor is not None:
            self._monitor.close()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.getsockopt(zmq.FD))
        # NOTE: the linger lets the Aborts go out; close() itself never blocks
        self._sock.close(linger=CLOSE_LINGER_MS if failed else 0)
        self._sock = self._monitor = None

    # ------------------------------------------------------------------ private: receive

    def _drain(self) -> None:
        """Read every queued reply (the loop calls this when the socket's FD is readable).

        NOTE: the FD is edge-triggered: reading ``EVENTS`` re-arms it, so read until POLLIN is off.
        """
        sock = self._sock
        # NOTE: recv until EAGAIN, then one EVENTS read (re-arms the FD); the flags as ints: an
        # EVENTS read and a Flag-enum test per message cost more than the message's decode
        while sock is not None:
            try:
                data = sock.recv(_NOBLOCK)
            except zmq.Again:
                if not int(sock.getsockopt(zmq.EVENTS)) & _POLLIN:
                    return
                continue
            self._on_message(data)
            sock = self._sock  # NOTE: routing may have closed it

    def _on_message(self, data: bytes) -> None:
        self._last_seen = time.monotonic()
        try:
            msg = decode_worker(data)
        except ProtocolError as exc:
            logger.error("dropping a reply from %s: %s", self.name, exc)
            return
        self._route(msg)

    def _route(self, msg: object) -> None:
        if type(msg) is Replies:  # NOTE: the common cases first: a step's replies, one delta
            for item in msg.items:
                self._route(item)
        elif type(msg) is TokenDelta:
            if (stream := self._streams.get(msg.request_id)) is not None:
                stream.deliver(msg, self.max_pending_deltas)
        elif isinstance(msg, LoadReport):
            self._on_load(msg)
        elif isinstance(msg, TokenDelta | Finished | ErrorReply) and msg.request_id is not None:
            stream = self._streams.get(msg.request_id)
            if stream is not None:  # NOTE: None = a request we stopped waiting for
                stream.deliver(msg, self.max_pending_deltas)
        elif isinstance(msg, Welcome):
            self._on_welcome(msg)
        elif isinstance(msg, ErrorReply) and msg.code == "version_mismatch":
            logger.error("worker at %s: %s", self.endpoint, msg.message)
            self._reject_welcome_waiters(HandshakeError(f"{self.endpoint}: {msg.message}"))
        else:
            logger.error("worker %s: unexpected %r", self.name, msg)

    def _on_welcome(self, msg: Welcome) -> None:
        self._check_instance(msg.instance_id, is_welcome=True)
        self.welcome = msg
        if not self.is_alive:
            if self._was_alive:
                self.num_reconnects += 1
                logger.warning("worker %s at %s is back", msg.worker_id, self.endpoint)
            self.is_alive = self._was_alive = True
            self._hello_retry_s = self.heartbeat_s
            self._notify(self.alive_listeners)
        for waiter in self._welcome_waiters:
            if not waiter.done():
                waiter.set_result(msg)

    def _on_load(self, msg: LoadReport) -> None:
        self._check_instance(msg.instance_id, is_welcome=False)
        if self.is_alive:  # NOTE: no load gauges for a worker that is not alive
            self.last_load = msg
            self._notify(self.load_listeners, msg)
        waiter = self._load_waiters.popleft() if self._load_waiters else None
        if waiter is not None and not waiter.done():
            waiter.set_result(msg)

    def _check_instance(self, instance_id: str, *, is_welcome: bool) -> None:
        """Note the worker process that answered; a new one unannounced fails the requests."""
        if instance_id == self.instance_id:
            if is_welcome:  # NOTE: the same process answered over the new connection
                self._expect_new_instance = False
            return
        previous, self.instance_id = self.instance_id, instance_id
        if previous is None:
            return
        self.num_new_instances += 1
        logger.warning("worker at %s restarted (instance %s, was %s)", self.endpoint,
                       instance_id, previous)
        if self._expect_new_instance:
            self._expect_new_instance = False
            return
        # NOTE: no connection loss seen: the requests in flight may have gone to either process
        failed = self._lose("restarted unnoticed")
        for rid in failed:
            self._send(Abort(request_id=rid))
        self._say_hello()

    # ------------------------------------------------------------------ private: connection

    def _on_connected(self) -> None:
        self._is_connected = True
        self._say_hello()

    def _on_disconnected(self) -> None:
        self._is_connected = False
        self._expect_new_instance = True
        if self.is_alive or self._streams:
            self._lose("lost its connection")

    async def _supervise(self) -> None:
        """Heartbeats while alive (and the silence check); Hellos while not."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            now = time.monotonic()
            if self.is_alive and now - self._last_seen > self.dead_after_s:
                failed = self._lose(f"silent for {now - self._last_seen:.1f} s")
                for rid in failed:  # NOTE: a stalled worker reads these when it runs again
                    self._send(Abort(request_id=rid))
            if self.is_alive:
                self._load_waiters.append(None)
                self._send(GetLoad())
            elif self._is_connected and now - self._hello_at >= self._hello_retry_s:
                self._say_hello()
                self._hello_retry_s = min(2 * self._hello_retry_s, HELLO_RETRY_MAX_S)

    def _say_hello(self) -> None:
        self._hello_at = time.monotonic()
        self._send(Hello(version=PROTOCOL_VERSION, client_id=self.client_id))

    def _lose(self, why: str) -> list[str]:
        """Not alive until the next Welcome; every in-flight request fails with
        ``WorkerDead``. Returns their request ids."""
        logger.error("worker %s %s: %d requests in flight fail", self.name, why,
                     len(self._streams))
        was_alive, self.is_alive = self.is_alive, False
        self.last_load = None
        self.epoch += 1
        self._hello_retry_s = self.heartbeat_s
        failed = self._fail_all(lambda s: WorkerDead(self.name, started=s.started))
        if was_alive:
            self._notify(self.lost_listeners)
        return failed

    def _notify(self, listeners: list[Callable[..., None]], *args: object) -> None:
        for listener in listeners:
            try:
                listener(*args)
            except Exception:  # NOTE: a listener's bug must not break the connection's state
                logger.exception("worker %s: a listener failed", self.name)

    def _fail_all(self, error: Callable[[RequestStream], DispatchError]) -> list[str]:
        failed = list(self._streams)
        for stream in self._streams.values():
            stream.fail(error(stream))
        self._streams.clear()  # NOTE: late replies to these requests are dropped
        for waiter in self._load_waiters:
            if waiter is not None and not waiter.done():
                waiter.set_exception(WorkerDead(self.name, started=False))
        self._load_waiters.clear()
        return failed

    def _reject_welcome_waiters(self, exc: DispatchError) -> None:
        for waiter in self._welcome_waiters:
            if not waiter.done():
                waiter.set_exception(exc)

    # ------------------------------------------------------------------ private: send

    def _check_can_send(self, rid: str) -> None:
        if self._sock is None:
            raise DispatchError(f"client of {self.endpoint} is not connected")
        if not self.is_alive:
            raise WorkerDead(self.name, started=False)
        if rid in self._streams:
            raise DispatchError(f"request {rid!r} is already in flight on {self.name}")

    def _send(self, msg: ClientMsg) -> bool:
        """Queue ``msg``; False when the socket's queue is full (the worker is away too long)
        or the client is closed.

        NOTE: a DEALER queues while its peer is away, so this never blocks: safe in the finally
        block of a cancelled generator. A send may consume the FD's edge for a reply that arrived
        meanwhile, so it schedules a drain when one is waiting.
        """
        sock = self._sock
        if sock is None or self._loop is None:
            return False
        try:
            sock.send(encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("send queue to %s is full: dropped %s", self.name, type(msg).__name__)
            return False
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._loop.call_soon(self._drain)
        return True
