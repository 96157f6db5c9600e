"""The lane: ``POST /v1/chat/completions``, ``POST /v1/completions`` and ``POST
/v1/sessions/{id}/turns``, the hot paths of agents, answered without litestar's per-request
machinery.

A litestar request passes the server's proxy-header middleware, the app's send wrapper and its
before-send hooks, the exception middleware, the router, the request-id and metrics middlewares,
the route handler's signature model and response objects, and for a stream an anyio task group
per response: about half the gateway's CPU on a short chat completion (``loadtest/
bench_gateway.py``, profile in the README). ``GatewayApp`` takes these endpoints off that
path and does, in one function, what that stack does for them:

- the request id: the ``x-request-id`` header of every answer, and ``current_request_id()`` (log
  lines) while the request runs (``gateway.request_id``);
- the body and its limit (``LeanRequest``: 413 over ``max_body_bytes``);
- errors: the same handlers as the app (``gateway.errors.ERROR_HANDLERS``, and the sessions
  controller's ``session_error``), so every error is the same JSON with the same status and
  headers;
- the metrics: the endpoint's responses by status and their duration to the last byte
  (``HttpStats``, as ``MetricsMiddleware``);
- a client that leaves: one watch task per request (``until_disconnect``) for a JSON answer and
  for a stream alike; it cancels the work, whose ``finally`` aborts the worker request (499);
- a stream's SSE events go to the server as they come, with litestar's headers.

The handlers (``gateway.controllers.openai``, ``.sessions``) are the controllers' own: both
paths run the same code. Everything else goes to litestar, and so do these paths when CORS is
configured and the request carries an ``Origin`` (litestar's CORS middleware answers those).
"""

import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import msgspec
from litestar import Litestar
from litestar.types import Receive, Scope, Send

from gateway import sse
from gateway.auth_gate import AuthGate
from gateway.controllers.openai import (
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    Answer,
    chat_completion,
    completion,
)
from gateway.controllers.sessions import session_error, session_turn
from gateway.disconnect import CLIENT_CLOSED_REQUEST, ClientDisconnected, until_disconnect
from gateway.errors import ERROR_HANDLERS
from gateway.lean_request import HttpRequest, LeanRequest
from gateway.request_id import HEADER as REQUEST_ID_HEADER
from gateway.request_id import bound_request_id, request_id_of
from sessions import SessionError

_JSON = msgspec.json.Encoder()
_RID = REQUEST_ID_HEADER.encode()
_JSON_TYPE = (b"content-type", b"application/json")
_SSE_HEADERS = [(k.lower().encode(), v.encode()) for k, v in sse.HEADERS.items()] + [
    (b"content-type", b"text/event-stream; charset=utf-8")]
Handler = Callable[[HttpRequest], Awaitable[Answer]]
# NOTE: a client that leaves before a JSON answer must not leave its request running: the
# OpenAI handlers are watched whole; a session turn watches its run itself (once it holds the
# session's lease, so that a cancel always records the turn and releases the lease)
HANDLERS: dict[str, Handler] = {
    CHAT_COMPLETIONS_PATH: lambda request: until_disconnect(request, chat_completion(request)),
    COMPLETIONS_PATH: lambda request: until_disconnect(request, completion(request)),
}
SESSION_TURNS = re.compile(r"/v1/sessions/([^/]+)/turns")
SESSION_TURNS_TEMPLATE = "/v1/sessions/{session_id}/turns"  # NOTE: litestar's metric label
_SESSION_ERRORS = {SessionError: session_error, **ERROR_HANDLERS}


class GatewayApp(Litestar):
    """The gateway's Litestar app, with the lane in front (see the module docstring), and the
    API-key gate in front of both when keys are configured (``auth_gate``, set by
    ``gateway.app.create_app``)."""

    auth_gate: AuthGate | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.auth_gate is not None:
            await self.auth_gate(scope, receive, send, self._serve)
            return
        await self._serve(scope, receive, send)

    async def _serve(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not (
                self.cors_config is not None and _has_origin(scope)):
            path = scope["path"]
            if (handler := HANDLERS.get(path)) is not None:
                scope["app"] = scope["litestar_app"] = self
                await self._lane(handler, path, ERROR_HANDLERS, scope, receive, send)
                return
            if path.startswith("/v1/sessions/") and (match := SESSION_TURNS.fullmatch(path)):
                scope["app"] = scope["litestar_app"] = self
                session_id = match[1]
                await self._lane(lambda request: session_turn(request, session_id),
                                 SESSION_TURNS_TEMPLATE, _SESSION_ERRORS, scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    async def _lane(self, handler: Handler, endpoint: str, errors: Mapping[type, Any],
                    scope: Scope, receive: Receive, send: Send) -> None:
        start_s = time.perf_counter()
        status = 500  # NOTE: kept when the answer fails midway (as MetricsMiddleware)
        rid = request_id_of(scope)
        request = LeanRequest(self, scope, receive, self.state.cfg.max_body_bytes)
        try:
            with bound_request_id(rid):
                try:
                    answer = await handler(request)
                except Exception as exc:  # noqa: BLE001 - the app's handlers map every error
                    status = await _send_error(send, request, exc, rid, errors)
                    return
                if isinstance(answer, msgspec.Struct):
                    await _send(send, 200, [_JSON_TYPE], _JSON.encode(answer), rid)
                    status = 200
                else:
                    status = await _stream(send, request, answer, rid, scope)
        finally:
            if (metrics := self.state.get("metrics")) is not None:
                metrics.http.observe(endpoint, status, time.perf_counter() - start_s)


async def _send(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes,
                rid: str) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        *headers, (b"content-length", str(len(body)).encode()), (_RID, rid.encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_error(send: Send, request: HttpRequest, exc: Exception, rid: str,
                      errors: Mapping[type, Any]) -> int:
    """Answers ``exc`` as the app's (or the route's) exception handlers do; returns the status."""
    handle = next(errors[cls] for cls in type(exc).__mro__ if cls in errors)
    response = handle(request, exc)  # type: ignore[arg-type]
    status = response.status_code
    if status == CLIENT_CLOSED_REQUEST:
        return status  # NOTE: nobody to answer
    headers = [_JSON_TYPE, *((k.lower().encode(), v.encode()) for k, v in
                             (response.headers or {}).items())]
    await _send(send, status, headers, _JSON.encode(response.content), rid)
    return status


async def _stream(send: Send, request: HttpRequest, events: AsyncIterator[bytes],
                  rid: str, scope: Scope) -> int:
    """Writes the SSE events as they come; returns the status. A client that leaves cancels the
    writing (499, ``until_disconnect``: the only listener while the stream runs), and closing
    ``events`` aborts the worker request."""
    try:
        await until_disconnect(request, _write_events(send, events, rid, scope))
        return 200
    except ClientDisconnected:
        return CLIENT_CLOSED_REQUEST
    finally:
        await events.aclose()  # type: ignore[attr-defined]


async def _write_events(send: Send, events: AsyncIterator[bytes], rid: str,
                        scope: Scope) -> None:
    """The response; an ``sse.EventStream`` also gets the server's ``BodyWriter`` (when it
    offers one: ``gateway.http_server``) to write some events itself."""
    writer = scope.get("extensions", {}).get(sse.BODY_WRITER)
    if writer is not None and isinstance(events, sse.EventStream):
        events.attach(writer)
    await send({"type": "http.response.start", "status": 200,
                "headers": [*_SSE_HEADERS, (_RID, rid.encode())]})
    async for event in events:
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _has_origin(scope: Scope) -> bool:
    return any(name == b"origin" for name, _ in scope["headers"])
