"""The Session API: multi-turn agent sessions kept by the gateway.

    POST   /v1/sessions              create (model, system, tools, metadata, prior messages)
    GET    /v1/sessions              the caller's sessions, a page at a time (?limit=, ?after=)
    GET    /v1/sessions/{id}         messages, per-turn usage and cache statistics
    DELETE /v1/sessions/{id}
    POST   /v1/sessions/{id}/turns   append user messages / tool results; the assistant answer
                                     as JSON (``TurnEnd``), or SSE frames with ``stream``
    WS     /v1/sessions/{id}/ws      turns over one socket, with cancel

Sessions belong to the tenant of the bearer key (``gateway.tenancy``): another tenant's id is a
404. The WebSocket protocol (JSON text frames, ``gateway.schemas.sessions``):

    client -> server   {"type": "turn", "id": "t1", "messages": [...], "max_tokens": 64, ...}
                       {"type": "cancel", "id": "c1"}
    server -> client   {"type": "turn_start", "session_id", "turn", "request_id", "id"}
                       {"type": "delta", "content": "..."}                  (zero or more)
                       {"type": "tool_call", "tool_call": {id, type, function}}  (at the end)
                       {"type": "turn_end", "session_id", "turn", "request_id", "message",
                        "finish_reason", "usage", "id"}
                       {"type": "error", "error": {"message", "type", "param", "code"}, "id"}

``id`` is optional; the frames answering a client frame carry its ``id`` (an error frame about a
frame that is not even JSON has none). One turn at a time: a turn frame while one runs is an
error frame (``turn_in_progress``). A bad frame is an error frame and the socket stays open; a
frame over ``max_body_bytes`` is an error frame (``frame_too_large``), then the socket closes
(1009); an unknown session closes it (code 4404) after an error frame. ``cancel`` ends the
running turn with finish_reason "cancelled"; the partial answer is kept in the history
(``gateway.turns``). A streamed REST turn sends the same frames as SSE ``data:`` lines, from
``turn_start`` to ``turn_end`` (or ``error``). When the session store fails as a turn ends, the
stream's last frame is an ``error`` with type and code ``service_unavailable`` (a REST turn
answers 503).
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Controller, Request, Response, WebSocket, delete, get, post, websocket
from litestar.di import NamedDependency
from litestar.exceptions import WebSocketDisconnect
from litestar.params import FromPath

from gateway import sse
from gateway.controllers.openai import Answer, as_response, check_model
from gateway.disconnect import read_body, until_disconnect
from gateway.dispatch import Dispatcher, DispatchError
from gateway.errors import dispatch_error
from gateway.lean_request import HttpRequest
from gateway.lifespan import ModelState, SessionsState
from gateway.schemas import ChunkDelta, ErrorBody, ErrorDetail, RequestError, Usage, error_body
from gateway.schemas.sessions import (
    CancelFrame,
    DeletedSession,
    DeltaFrame,
    ErrorFrame,
    ServerFrame,
    SessionCacheStats,
    SessionList,
    SessionListItem,
    SessionObject,
    ToolCallFrame,
    TurnEnd,
    TurnFrame,
    TurnInfo,
    TurnStart,
    decode_client_frame,
    decode_session_create,
    decode_turn_request,
    frame_id_of,
)
from gateway.tenancy import tenant_of
from gateway.tool_pauses import retention_of, session_key
from gateway.turns import Turn, begin_turn, check_new_session, message_dict
from sessions import (
    MAX_PAGE_SIZE,
    InvalidMessages,
    Session,
    SessionError,
    SessionNotFound,
    SessionSummary,
    SessionTooLarge,
    StoreUnavailable,
    TurnInProgress,
)

logger = logging.getLogger(__name__)

_JSON = msgspec.json.Encoder()
WS_CLOSE_NOT_FOUND = 4404
WS_CLOSE_TOO_BIG = 1009
DEFAULT_PAGE_SIZE = 20

# status, error type per session error; anything else (VersionConflict) is a 409
_SESSION_ERRORS: dict[type[SessionError], tuple[int, str]] = {
    SessionNotFound: (404, "invalid_request_error"),
    InvalidMessages: (400, "invalid_request_error"),
    TurnInProgress: (409, "invalid_request_error"),
    SessionTooLarge: (413, "invalid_request_error"),
    StoreUnavailable: (503, "service_unavailable"),
}


def session_error(_: Request[Any, Any, Any], exc: SessionError) -> Response[ErrorBody]:
    status, body = _session_error_body(exc)
    return Response(body, status_code=status, media_type="application/json")


class SessionsController(Controller):
    path = "/v1/sessions"
    exception_handlers = {SessionError: session_error}

    @post(status_code=200)
    async def create(
        self,
        request: Request[Any, Any, Any],
        model: NamedDependency[ModelState],
        sessions: NamedDependency[SessionsState],
    ) -> SessionObject:
        req = decode_session_create(await read_body(request))
        if req.model is not None:
            check_model(request, req.model)
        messages = [message_dict(m) for m in req.messages]
        await check_new_session(sessions, model, req.system, req.tools, messages)
        session = await sessions.manager.create(
            tenant_of(request), model.name, system=req.system,
            tools=msgspec.to_builtins(req.tools) if req.tools else None, metadata=req.metadata,
            messages=messages,
        )
        return session_object(session)

    @get()
    async def list_sessions(
        self, request: Request[Any, Any, Any], sessions: NamedDependency[SessionsState]
    ) -> SessionList:
        limit, after = _page_params(request)
        page = await sessions.manager.list(tenant_of(request), after, limit)
        data = [_list_item(s) for s in page.data]
        return SessionList(
            data=data, has_more=page.has_more, first_id=data[0].id if data else None,
            last_id=data[-1].id if data else None,
        )

    @get("/{session_id:str}")
    async def read(
        self, request: Request[Any, Any, Any], session_id: FromPath[str],
        sessions: NamedDependency[SessionsState],
    ) -> SessionObject:
        return session_object(await sessions.manager.get(tenant_of(request), session_id))

    @delete("/{session_id:str}", status_code=200)
    async def remove(
        self, request: Request[Any, Any, Any], session_id: FromPath[str],
        sessions: NamedDependency[SessionsState], dispatcher: NamedDependency[Dispatcher],
    ) -> DeletedSession:
        tenant = tenant_of(request)
        await sessions.manager.delete(tenant, session_id)
        # NOTE: no turn will resume it: release its tool-pause retention now
        retention_of(dispatcher).forget(session_key(tenant, session_id))
        return DeletedSession(id=session_id)

    @post("/{session_id:str}/turns", status_code=200)
    async def turn(
        self, request: Request[Any, Any, Any], session_id: FromPath[str]
    ) -> Response[Any]:
        return as_response(await session_turn(request, session_id))


async def session_turn(request: HttpRequest, session_id: str) -> Answer:
    """``POST /v1/sessions/{id}/turns``: the turn's end (JSON) or its SSE events (the lane,
    ``gateway.lane``, calls it too)."""
    state = request.app.state
    req = decode_turn_request(await read_body(request))
    turn = await begin_turn(
        state.sessions, state.model, state.dispatcher, tenant_of(request), session_id, req,
        media=getattr(state, "media", None),
    )
    await _start(turn)
    if req.stream:
        return sse.EventStream(lambda out: _turn_sse(turn, out))
    # NOTE: a non-streamed turn is awaited to its end: only a watch on receive() sees the
    # client leave (then the turn is cancelled, recorded as such, and its lease released)
    return await until_disconnect(request, _run_to_end(turn))


@websocket("/v1/sessions/{session_id:str}/ws")
async def session_ws(
    socket: WebSocket[Any, Any, Any],
    session_id: FromPath[str],
    model: NamedDependency[ModelState],
    dispatcher: NamedDependency[Dispatcher],
    sessions: NamedDependency[SessionsState],
) -> None:
    await socket.accept()
    await _SessionSocket(socket, session_id, model, dispatcher, sessions).serve()


def session_object(session: Session) -> SessionObject:
    """The ``GET /v1/sessions/{id}`` body."""
    turns = [_turn_info(t) for t in session.turns]
    prompt = sum(t.usage.prompt_tokens for t in session.turns)
    cached = sum(t.usage.cached_tokens for t in session.turns)
    completion = sum(t.usage.completion_tokens for t in session.turns)
    cache = SessionCacheStats(
        prompt_tokens=prompt, cached_tokens=cached, hit_rate=cached / prompt if prompt else 0.0,
        reused_prompt_tokens=sum(t.reused_prompt_tokens for t in session.turns),
        stored_prompt_tokens=len(session.prompt_ids),
    )
    return SessionObject(
        id=session.id, model=session.model, system=session.system, tools=session.tools,
        metadata=session.metadata, messages=session.messages, turns=turns,
        usage=Usage.of(prompt, completion, cached), cache=cache,
        running=session.is_running(time.time()), created_at=session.created_at,
        updated_at=session.updated_at,
    )


class _SessionSocket:
    """One WebSocket: a receive loop, and at most one turn task at a time."""

    def __init__(
        self,
        socket: WebSocket[Any, Any, Any],
        session_id: str,
        model: ModelState,
        dispatcher: Dispatcher,
        sessions: SessionsState,
    ) -> None:
        self.socket, self.session_id = socket, session_id
        self.model, self.dispatcher, self.sessions = model, dispatcher, sessions
        self.tenant = tenant_of(socket)
        self._task: asyncio.Task[None] | None = None
        self._is_cancellable = False  # NOTE: false once the turn is recorded: its end is sent
        self._cancel_requested = False

    async def serve(self) -> None:
        try:
            await self.sessions.manager.get(self.tenant, self.session_id)
        except SessionError as exc:
            await self._send(ErrorFrame(error=_error_detail(exc)))
            await self.socket.close(code=WS_CLOSE_NOT_FOUND, reason="session not found")
            return
        max_bytes = self.socket.app.state.cfg.max_body_bytes
        try:
            while True:
                data = await self.socket.receive_data(mode="text")
                if len(data) > max_bytes:
                    await self._refuse_big_frame(len(data), max_bytes)
                    return
                await self._on_frame(data)
        except WebSocketDisconnect:
            pass
        finally:
            if self._task is not None and not self._task.done():
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)

    async def _refuse_big_frame(self, size_bytes: int, max_bytes: int) -> None:
        exc = RequestError(
            f"The frame is {size_bytes} bytes; frames are at most {max_bytes} bytes.",
            code="frame_too_large", status=413,
        )
        await self._send(ErrorFrame(error=_error_detail(exc)))
        await self.socket.close(code=WS_CLOSE_TOO_BIG, reason="frame too large")

    async def _on_frame(self, data: str | bytes) -> None:
        try:
            frame = decode_client_frame(data)
        except RequestError as exc:
            await self._send(ErrorFrame(error=_error_detail(exc), id=frame_id_of(data)))
            return
        running = self._task is not None and not self._task.done()
        if isinstance(frame, CancelFrame):
            if running and self._is_cancellable:
                self._cancel_requested = True
                self._task.cancel()  # type: ignore[union-attr]
            elif not running:
                exc = RequestError("no turn is running", param="type", code="no_turn_running")
                await self._send(ErrorFrame(error=_error_detail(exc), id=frame.id))
            return
        if running:
            busy = _error_detail(TurnInProgress(self.session_id))
            await self._send(ErrorFrame(error=busy, id=frame.id))
            return
        self._task = asyncio.create_task(self._turn(frame))

    async def _turn(self, frame: TurnFrame) -> None:
        self._cancel_requested, self._is_cancellable = False, False
        try:
            turn = await begin_turn(
                self.sessions, self.model, self.dispatcher, self.tenant, self.session_id, frame,
                media=getattr(self.socket.app.state, "media", None),
            )
        except Exception as exc:
            await self._send(ErrorFrame(error=_error_detail(exc), id=frame.id))
            return
        self._is_cancellable = True
        error: Exception | None = None
        try:
            await self._send(TurnStart(
                session_id=self.session_id, turn=turn.index, request_id=turn.request_id,
                id=frame.id,
            ))
            await turn.start()
            async with contextlib.aclosing(turn.deltas()) as deltas:
                async for delta in deltas:
                    if delta.content:
                        await self._send(DeltaFrame(content=delta.content))
        except asyncio.CancelledError:
            if not self._cancel_requested:
                raise  # NOTE: the socket is closing; finally still records the partial turn
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
        except Exception as exc:
            error = exc
        finally:
            self._is_cancellable = False
            end, close_error = await _close(turn)
        await self._send_end(end, error or close_error, frame.id)

    async def _send_end(
        self, end: TurnEnd | None, error: Exception | None, frame_id: str | None
    ) -> None:
        if end is None or error is not None:
            detail = _error_detail(error or RuntimeError("no answer"))
            await self._send(ErrorFrame(error=detail, id=frame_id))
            return
        for call in end.message.tool_calls or []:
            await self._send(ToolCallFrame(tool_call=call))
        await self._send(msgspec.structs.replace(end, id=frame_id))

    async def _send(self, frame: ServerFrame) -> None:
        await self.socket.send_data(_JSON.encode(frame).decode(), mode="text")


async def _start(turn: Turn) -> None:
    try:
        await turn.start()
    except BaseException:
        with contextlib.suppress(SessionError):  # NOTE: the start's error is the one to tell
            await turn.close()
        raise


async def _close(turn: Turn) -> tuple[TurnEnd | None, SessionError | None]:
    """``turn.close()``, its store failure returned (a stream ends with it as an error frame)."""
    try:
        return await turn.close(), None
    except SessionError as exc:
        return None, exc


async def _run_to_end(turn: Turn) -> TurnEnd:
    try:
        async with contextlib.aclosing(turn.deltas()) as deltas:
            async for _ in deltas:
                pass
    finally:
        end = await turn.close()
    assert end is not None, "a turn that did not fail is recorded"
    return end


async def _turn_sse(turn: Turn, out: sse.EventStream) -> AsyncIterator[bytes]:
    """The SSE body; leaving it early (the client went away) records a cancelled turn. ``out``:
    the body this feeds; with a writer (the lane), the deltas are written from the worker's reply
    (``Turn.push_deltas``)."""
    error: DispatchError | SessionError | None = None
    try:
        yield _event(TurnStart(session_id=turn.session.id, turn=turn.index,
                               request_id=turn.request_id))
        if out.writer is not None:  # NOTE: the start is written: push from here on
            turn.push_deltas(out.writer, _delta_event)
        async with contextlib.aclosing(turn.deltas()) as deltas:
            async for delta in deltas:
                if delta.content:
                    yield _event(DeltaFrame(content=delta.content))
    except DispatchError as exc:
        error = exc
    finally:
        end, close_error = await _close(turn)
    error = error or close_error
    if error is not None or end is None:
        yield _event(ErrorFrame(error=_error_detail(error or RuntimeError("no answer"))))
        return
    for call in end.message.tool_calls or []:
        yield _event(ToolCallFrame(tool_call=call))
    yield _event(end)


def _event(frame: ServerFrame) -> bytes:
    return sse.json_event(frame)


def _delta_event(delta: ChunkDelta) -> bytes | None:
    """A delta's SSE event as ``_turn_sse`` writes it (tool calls go out at the end)."""
    return _event(DeltaFrame(content=delta.content)) if delta.content else None


def _page_params(request: Request[Any, Any, Any]) -> tuple[int, str | None]:
    """``limit`` (1..100, default 20) and ``after`` (a session id) of a list request."""
    raw = request.query_params.get("limit")
    try:
        limit = DEFAULT_PAGE_SIZE if raw is None else int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise RequestError(
            f"limit must be an integer from 1 to {MAX_PAGE_SIZE}, got {raw!r}", param="limit"
        )
    return limit, request.query_params.get("after") or None


def _list_item(summary: SessionSummary) -> SessionListItem:
    return SessionListItem(
        id=summary.id, model=summary.model, metadata=summary.metadata,
        num_messages=summary.num_messages, num_turns=summary.num_turns,
        running=summary.running is not None and summary.running.expires_at > time.time(),
        created_at=summary.created_at,
        updated_at=summary.updated_at,
    )


def _turn_info(record: Any) -> TurnInfo:
    usage = record.usage
    end = record.first_message + record.num_messages + 1
    return TurnInfo(
        index=record.index, request_id=record.request_id, finish_reason=record.finish_reason,
        usage=Usage.of(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens),
        messages=(record.first_message, end), reused_prompt_tokens=record.reused_prompt_tokens,
        started_at=record.started_at, first_token_s=record.first_token_s,
        duration_s=record.duration_s,
    )


def _session_error_body(exc: SessionError) -> tuple[int, ErrorBody]:
    status, type_ = _SESSION_ERRORS.get(type(exc), (409, "invalid_request_error"))
    return status, error_body(exc.message, type=type_, param=exc.param, code=exc.code)


def _error_detail(exc: BaseException) -> ErrorDetail:
    """The OpenAI error object of any error, as the HTTP handlers would answer it."""
    if isinstance(exc, RequestError):
        return exc.to_body().error
    if isinstance(exc, SessionError):
        return _session_error_body(exc)[1].error
    if isinstance(exc, DispatchError):
        return dispatch_error(None, exc).content.error  # type: ignore[arg-type,union-attr]
    logger.error("session turn failed", exc_info=exc)
    return error_body("internal server error", type="server_error").error
