"""The HTTP server ``agentgate serve`` runs the app on: uvicorn with the limits it lacks.

- A request head (request line + headers) must arrive within ``header_timeout_s`` of its first
  byte (or of the connection, for a client that sends nothing), and be at most
  ``MAX_HEAD_BYTES``: slow-header clients get 408, oversized heads 431, and the connection closes.
- A request body may stall at most ``body_timeout_s`` between two pieces (408, closed).
- ``max_connections``: requests on connections beyond it get uvicorn's 503.
- Shutdown (SIGINT or SIGTERM alike): stop accepting, let requests in flight finish for up to
  ``drain_timeout_s``, then call ``on_drain_timeout`` (the gateway fails what is left with a
  clean error) and give those requests ``END_GRACE_S`` to say so before they are cancelled.
- ``on_started`` runs once the port is bound and serving (and the app's lifespan has started);
  ``on_exit`` when the first SIGINT or SIGTERM comes, before the drain (``agentgate serve``
  passes the signal on to its other gateway processes there, so they all drain at once).

The timers live in a subclass of uvicorn's httptools protocol, driven by the parser callbacks.
The same subclass offers each request a ``gateway.sse.BodyWriter`` (ASGI extension
``agentgate.body_writer``): a chunked response's next piece written to the transport now, as the
cycle's own ``send`` would, without a coroutine and a message dict per piece.
"""

import asyncio
import contextlib
import signal
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from gateway.sse import BODY_WRITER

MAX_HEAD_BYTES = 64 * 1024
END_GRACE_S = 3.0


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Attributes:
    header_timeout_s: the whole request head must arrive within this (408 after).
    body_timeout_s: a request body may stall this long between two pieces (408 after).
    max_connections: connections served at once; requests on more get 503.
    drain_timeout_s: on shutdown, requests in flight may finish for this long.
    keep_alive_timeout_s: an idle keep-alive connection is closed after this long.
    """

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 2048
    drain_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        assert self.header_timeout_s > 0 and self.body_timeout_s > 0, f"{self}: timeouts > 0"
        assert self.max_connections >= 1, f"{self.max_connections=}: >= 1"
        assert self.drain_timeout_s >= 0, f"{self.drain_timeout_s=}: >= 0"
        assert self.keep_alive_timeout_s > 0, f"{self.keep_alive_timeout_s=}: > 0"


class GatewayServer(uvicorn.Server):
    """A ``uvicorn.Server`` with the callbacks above; SIGINT and SIGTERM both shut it down
    gracefully and are not re-raised afterwards (uvicorn re-raises them, and a re-raised SIGTERM
    kills the process before ``agentgate serve`` can stop its workers)."""

    def __init__(self, config: uvicorn.Config, limits: HttpLimits,
                 on_started: Callable[[], None] = lambda: None,
                 on_drain_timeout: Callable[[], None] = lambda: None,
                 on_exit: Callable[[], None] = lambda: None) -> None:
        super().__init__(config)
        self.limits = limits
        self._on_started = on_started
        self._on_drain_timeout = on_drain_timeout
        self._on_exit = on_exit
        self.exit_signal: int | None = None

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            self._on_started()

    async def shutdown(self, sockets: Any = None) -> None:
        timer = asyncio.get_running_loop().call_later(
            self.limits.drain_timeout_s, self._on_drain_timeout)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.exit_signal is None:
            self._on_exit()
        self.exit_signal = sig
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        originals = {sig: signal.signal(sig, self.handle_exit)
                     for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


WS_FRAME_SLACK_BYTES = 64 * 1024


def make_server(app: Any, *, host: str, limits: HttpLimits, **callbacks: Callable[[], None]
                ) -> GatewayServer:
    """A ``GatewayServer`` for ``app`` (serve it with ``server.run(sockets=[bound_socket])``)."""
    config = uvicorn.Config(
        app, host=host, http=_guarded_protocol(limits), log_config=None, log_level="warning",
        # NOTE: no access log (one logging call per request on the hot path; /metrics counts
        # requests by endpoint and status instead)
        access_log=False,
        # NOTE: uvicorn counts the connection asking too, so N + 1 lets N be served
        limit_concurrency=limits.max_connections + 1,
        timeout_graceful_shutdown=limits.drain_timeout_s + END_GRACE_S,
        timeout_keep_alive=limits.keep_alive_timeout_s,
        # NOTE: a little above the app's own bound, so that the session WebSocket handler (not
        # uvicorn's bare close 1009) answers an oversize frame with a frame_too_large error
        ws_max_size=app.state.cfg.max_body_bytes + WS_FRAME_SLACK_BYTES,
    )
    return GatewayServer(config, limits, **callbacks)


def _guarded_protocol(limits: HttpLimits) -> type[HttpToolsProtocol]:
    class Protocol(GuardedHttpProtocol):
        header_timeout_s = limits.header_timeout_s
        body_timeout_s = limits.body_timeout_s

    return Protocol


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a head timer, a body idle timer and a head size bound.

    NOTE: states: "head" (from the connection or a request's first byte to its last header),
    "body" (until the message is complete), None (a request is being answered, or keep-alive
    idle, which uvicorn times out itself). One timer at most.
    """

    header_timeout_s = 10.0
    body_timeout_s = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._begin_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._state != "body":
            self._head_bytes += len(data)
        super().data_received(data)
        if self._state == "head" and self._head_bytes > MAX_HEAD_BYTES:
            self._refuse(431, "Request Header Fields Too Large")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._state != "head":
            self._begin_head()

    def on_headers_complete(self) -> None:
        self._cancel_timer()
        self._head_bytes = 0
        self._state = "body"
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:
            self.scope.setdefault("extensions", {})[BODY_WRITER] = _ChunkWriter(cycle)
        if self.parser is not None and self.parser.should_upgrade():
            self._state = None  # NOTE: a WebSocket; its protocol takes the transport over
        else:
            self._arm(self.body_timeout_s, self._body_timed_out)

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        if self._state == "body":
            self._arm(self.body_timeout_s, self._body_timed_out)

    def on_message_complete(self) -> None:
        self._cancel_timer()
        self._state = None
        super().on_message_complete()

    def _begin_head(self) -> None:
        self._state: str | None = "head"
        self._head_bytes = 0
        self._arm(self.header_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._timer = None
        self._refuse(408, "Request Timeout")

    def _body_timed_out(self) -> None:
        self._timer = None
        cycle = self.cycle
        if self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue):
            # NOTE: the app is not reading yet: the stall is ours, not the client's
            self._arm(self.body_timeout_s, self._body_timed_out)
            return
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # NOTE: the app sees http.disconnect; its sends are dropped
            cycle.message_event.set()
            if cycle.response_started:
                self.transport.close()
                return
        self._refuse(408, "Request Timeout")

    def _refuse(self, status: int, reason: str) -> None:
        self._cancel_timer()
        self._state = None
        if not self.transport.is_closing():
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                % (status, reason.encode(), len(reason), reason.encode()))
            self.transport.close()

    def _arm(self, delay_s: float, callback: Callable[[], None]) -> None:
        self._cancel_timer()
        self._timer = self.loop.call_later(delay_s, callback)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _ChunkWriter:
    """``gateway.sse.BodyWriter`` over a uvicorn httptools request cycle: one chunked-encoding
    piece a write, only while the cycle's ``send`` would write at once (see ``ready``)."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle

    def ready(self) -> bool:
        cycle = self._cycle
        return bool(cycle.response_started and cycle.chunked_encoding) and not (
            cycle.response_complete or cycle.disconnected or cycle.flow.write_paused
            or cycle.transport.is_closing())

    def write(self, body: bytes) -> None:
        self._cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
