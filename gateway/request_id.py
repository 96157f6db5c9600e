"""The ``x-request-id`` of every HTTP response and WebSocket handshake: the client's own when it
is sane (1 to 128 visible ASCII characters), else a new one (32 hex digits). Errors and streams
carry it too: it is added where every ASGI message leaves the app (a ``before_send`` hook).

While a request is handled, ``current_request_id()`` gives it, and log lines written by the
gateway's loggers end with ``[request_id=...]`` (``RequestIdLogFilter``, on the root logger's
handlers while the app runs).
"""

import contextlib
import contextvars
import logging
import re
import uuid
from collections.abc import Iterator

from litestar.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
MAX_LEN = 128
_HEADER_BYTES = HEADER.encode()
_SANE = re.compile(rb"[\x21-\x7e]{1,%d}" % MAX_LEN)
_STATE_KEY = "request_id"
_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


def current_request_id() -> str | None:
    """The id of the request being handled in this context (None outside one)."""
    return _current.get()


def request_id_of(scope: Scope) -> str:
    """The request's id, chosen once per connection and kept in its scope's state."""
    state = scope.setdefault("state", {})
    if (rid := state.get(_STATE_KEY)) is None:
        rid = state[_STATE_KEY] = _from_headers(scope) or uuid.uuid4().hex
    return rid


@contextlib.contextmanager
def bound_request_id(rid: str) -> Iterator[None]:
    """``current_request_id()`` is ``rid`` inside (the lane's, ``gateway.lane``)."""
    token = _current.set(rid)
    try:
        yield
    finally:
        _current.reset(token)


def request_id_middleware(app: ASGIApp) -> ASGIApp:
    """Makes the request's id ``current_request_id()`` while the handler (and its stream) run."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await app(scope, receive, send)
            return
        with bound_request_id(request_id_of(scope)):
            await app(scope, receive, send)

    return middleware


async def add_request_id_header(message: Message, scope: Scope) -> None:
    """``before_send`` hook: the header on every response start and WebSocket accept."""
    if message["type"] not in ("http.response.start", "websocket.accept"):
        return
    headers = [(k, v) for k, v in message.get("headers") or () if k.lower() != _HEADER_BYTES]
    headers.append((_HEADER_BYTES, request_id_of(scope).encode()))
    message["headers"] = headers  # type: ignore[typeddict-unknown-key]


class RequestIdLogFilter(logging.Filter):
    """Appends `` [request_id=...]`` to records logged while a request is handled."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = _current.get()
        if rid is not None and not getattr(record, "request_id", None):
            record.request_id = rid
            # NOTE: the id is the client's: no %-format of it unless it is escaped
            safe = rid.replace("%", "%%") if record.args else rid
            record.msg = f"{record.msg} [request_id={safe}]"
        return True


LOG_FILTER = RequestIdLogFilter()


def install_log_filter() -> None:
    """Put ``LOG_FILTER`` on the root logger's handlers (app startup)."""
    for handler in logging.getLogger().handlers:
        if LOG_FILTER not in handler.filters:
            handler.addFilter(LOG_FILTER)


def remove_log_filter() -> None:
    for handler in logging.getLogger().handlers:
        handler.removeFilter(LOG_FILTER)


def _from_headers(scope: Scope) -> str | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == _HEADER_BYTES:
            return value.decode("ascii") if _SANE.fullmatch(value) else None
    return None
