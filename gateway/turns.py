"""A session turn, the same for every transport (REST JSON, SSE, WebSocket):

    turn = await begin_turn(...)            # 404 / 400 / 409 before anything is generated
    try:
        await turn.start()                  # the worker's first item (DispatchError -> status)
        async with aclosing(turn.deltas()) as deltas:
            async for delta in deltas: ...  # content and tool-call ChunkDeltas
    finally:
        end = await turn.close()            # record the turn, release the session

What ``close`` records is what the client saw. A turn cut short (a cancel frame, the client went
away) is kept, with finish_reason "cancelled", the content streamed so far (``content: null``
when there was none) and its token counts; tool calls are dropped from a cancelled answer (their
arguments may be cut), so no tool result is ever owed for them. A turn whose worker failed
records nothing: the session stays as it was and the client can send the same turn again.

While a turn runs, a background task renews its lease on the session (``SessionManager``: a short
lease, so a crashed gateway's turn blocks the session only briefly). ``close`` stops it, then
records (the manager retries an unavailable store for a while); ``close`` raises
``StoreUnavailable`` when the store stayed away, and every transport answers that with a 503
error (an ``error`` frame once streaming has begun).

Inputs are bounded cheaply before any rendering: text that cannot fit the context even at the
tokenizer's longest token is a 400 ``context_length_exceeded`` at once, and large inputs are
rendered and tokenized on a thread, so the event loop keeps serving everyone else.
"""

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import jinja2
import msgspec

from engine.protocol import Generate, TokenDelta
from gateway.dispatch import Dispatcher
from gateway.generation import (
    ChatEnd,
    OutputOptions,
    Started,
    build_generate,
    chat_deltas,
    check_context,
    new_request_id,
    start,
    tool_parser,
)
from gateway.lifespan import ModelState, SessionsState
from gateway.media import MediaPipeline
from gateway.request_stream import Push
from gateway.routing.retention import Pause
from gateway.schemas import (
    ChunkDelta,
    FunctionCall,
    RequestError,
    ResponseMessage,
    Tool,
    ToolCall,
    Usage,
)
from gateway.schemas.sessions import TurnEnd, TurnParams, turn_sampling_spec
from gateway.sse import BodyWriter
from gateway.stream_push import delta_push, pushable
from gateway.structured import StructuredError, tool_call_grammar
from gateway.tenancy import cache_salt
from gateway.tokenizer import StreamDecoder
from gateway.tool_parser import ToolCallStreamParser
from gateway.tool_pauses import TOOL_CALLS, call_names, retention_of, session_key
from sessions import (
    Message,
    Session,
    SessionTooLarge,
    StoreUnavailable,
    TurnPrompt,
    TurnRecord,
    TurnUsage,
)

logger = logging.getLogger(__name__)

CANCELLED = "cancelled"
RENDER_ON_THREAD_CHARS = 32 * 1024  # NOTE: below this a render takes ~ms: a thread costs more
MAX_LEASE_RENEWAL_S = 3600.0  # NOTE: a Turn leaked unclosed cannot hold its session forever


async def begin_turn(
    ctx: SessionsState,
    model: ModelState,
    dispatcher: Dispatcher,
    tenant: str,
    session_id: str,
    req: TurnParams,
    media: MediaPipeline | None = None,
) -> "Turn":
    """Claim the session and build the worker request (nothing is sent yet).

    Raises:
        SessionNotFound, InvalidMessages, TurnInProgress: from the session rules.
        RequestError: the prompt does not render or does not fit the context.
    """
    t0, started_at = time.perf_counter(), time.time()
    new = [message_dict(m) for m in req.messages]
    check_fits(ctx, model, new)
    request_id = new_request_id("turn")
    session = await ctx.manager.begin_turn(tenant, session_id, new, request_id)
    lease = _LeaseKeeper(ctx, session)
    try:
        history = session.rendered_messages()
        # NOTE: the session's images (its history's, already checked, and the new messages')
        # are keyed and sent to the encoder (cached ones answer at once) while it renders
        images = None if media is None else await media.start(
            [*history, *new], cache_salt(tenant), count_from=len(history))
        try:
            prompt = await _render(ctx, session, new)
            if images is not None:
                ids, spans = images.expand(prompt.token_ids)
                prompt = prompt._replace(token_ids=ids)
                await images.encoded()
        except BaseException:
            if images is not None:
                images.cancel()
            raise
        left = check_context(model, len(prompt.token_ids), "messages")
        spec = turn_sampling_spec(
            req, tools=session.tools, default_max_tokens=left,
            stop_token_ids=model.tokenizer.eos_token_ids,
        )
        generate = build_generate(
            prompt.token_ids, spec, request_id=request_id, session_id=session.id,
            cache_salt=cache_salt(tenant), media=() if images is None else spans,
        )
    except BaseException:
        await lease.stop()
        with contextlib.suppress(StoreUnavailable):  # NOTE: the lease expires by itself
            await ctx.manager.abort_turn(session)
        raise
    parse_tools = bool(session.tools) and req.tool_choice != "none"
    opts = OutputOptions(req.stop_strings, parse_tools=parse_tools)
    turn = Turn(ctx, model, dispatcher, session, new, prompt, generate, opts, t0, started_at)
    turn.lease = lease
    turn.tenant = tenant
    # NOTE: the previous turn's retained resume point is released once this one is dispatched
    turn.pause = retention_of(dispatcher).resumed(session_key(tenant, session.id), time.monotonic())
    return turn


async def check_new_session(
    ctx: SessionsState,
    model: ModelState,
    system: str | None,
    tools: list[Tool] | None,
    messages: list[Message],
) -> None:
    """What a session must pass before it is stored: every tool's parameters compile as a
    constraint (as a forced call would need), and its history fits the context with room to
    answer. Large histories and schemas are checked on a thread.

    Raises:
        RequestError: ``tools[i].function.parameters``; 400 ``context_length_exceeded`` naming
            ``messages``.
    """
    if tools:
        await asyncio.to_thread(_check_tool_schemas, tools)
    if not messages:
        return
    head = [] if system is None else [{"role": "system", "content": system}]
    history = [*head, *messages]
    check_fits(ctx, model, history)
    tool_dicts = msgspec.to_builtins(tools) if tools else None
    encode = functools.partial(model.tokenizer.encode_chat, history, tool_dicts)
    try:
        if sum(message_chars(m) for m in history) < RENDER_ON_THREAD_CHARS:
            ids = encode()
        else:
            ids = await asyncio.to_thread(encode)
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        raise RequestError(f"messages could not be rendered: {exc}", param="messages") from None
    check_context(model, len(ids), "messages")


def check_fits(ctx: SessionsState, model: ModelState, messages: Sequence[Message]) -> None:
    """Cheap bound, before any rendering: ``messages`` whose text alone needs more tokens than
    the context holds (at the tokenizer's longest token) can never fit.

    Raises:
        RequestError: 400 ``context_length_exceeded`` naming ``messages``.
    """
    chars = sum(message_chars(m) for m in messages)
    min_tokens = chars // ctx.max_token_chars
    if min_tokens >= model.max_context:
        raise RequestError(
            f"The messages hold {chars} characters, at least {min_tokens} tokens; this model's "
            f"context is {model.max_context} tokens.", param="messages",
            code="context_length_exceeded",
        )


def message_chars(message: Message) -> int:
    """The characters of a message's text (content, text parts, tool-call arguments)."""
    content = message.get("content")
    if isinstance(content, str):
        chars = len(content)
    elif isinstance(content, list):
        chars = sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    else:
        chars = 0
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        chars += len(function.get("arguments") or "") + len(function.get("name") or "")
    return chars


class Turn:
    """One turn of one session; see the module docstring for the protocol."""

    def __init__(
        self,
        ctx: SessionsState,
        model: ModelState,
        dispatcher: Dispatcher,
        session: Session,
        new: list[Message],
        prompt: TurnPrompt,
        generate: Generate,
        opts: OutputOptions,
        t0: float,
        started_at: float,
    ) -> None:
        self._ctx, self._model, self._dispatcher = ctx, model, dispatcher
        self.session, self.new, self.prompt, self.generate = session, new, prompt, generate
        self._opts = opts
        self._t0, self._started_at = t0, started_at
        self._tally = _Tally(t0)
        self._started: Started | None = None
        self._decoder: StreamDecoder | None = None  # NOTE: with the parser, shared with a push
        self._parser: ToolCallStreamParser | None = None
        self._content: list[str] = []
        self._calls: dict[int, list[str]] = {}  # index -> [id, name, *argument pieces]
        self._end: ChatEnd | None = None
        self._failed = False
        self._closing: asyncio.Task[TurnEnd | None] | None = None
        self._pause_released = False
        self.lease: _LeaseKeeper | None = None  # set by begin_turn; stopped by close
        self.tenant = ""  # set by begin_turn
        self.pause: Pause | None = None  # the tool pause this turn ends (set by begin_turn)

    @property
    def index(self) -> int:
        return len(self.session.turns)

    @property
    def request_id(self) -> str:
        return self.generate.request_id

    async def start(self) -> None:
        """Send the request and wait for its first item; a ``DispatchError`` propagates."""
        try:
            started = await start(self._dispatcher, self.generate)
        except Exception:
            self._failed = True
            raise
        finally:
            self._release_pause()
        self._started = self._tally.wrap(started)
        self._decoder = StreamDecoder(self._model.tokenizer, skip_special_tokens=True)
        self._parser = tool_parser(started, self._opts)

    async def deltas(self) -> AsyncIterator[ChunkDelta]:
        """The answer's deltas (after ``start``); leaving early aborts the worker request."""
        assert self._started is not None, "Turn.deltas() before start()"
        events = chat_deltas(self._started, self._model, self._opts, self._decoder, self._parser)
        try:
            async for event in events:
                if isinstance(event, ChatEnd):
                    self._end = event
                    continue
                self._add(event.delta)
                yield event.delta
        except Exception:
            self._failed = True
            raise
        finally:
            await events.aclose()

    def push_deltas(self, writer: BodyWriter, encode: Callable[[ChunkDelta], bytes | None]
                    ) -> bool:
        """Write this turn's next deltas from the worker's reply (``RequestStream.push``),
        while ``deltas()`` waits for them: each is recorded as ``deltas()`` records it (the same
        decoder and tool-call parser, made by ``start``) and written as ``encode`` makes it
        (None: nothing to write). Call it once what comes before the deltas is written; not
        with stop strings (a match ends the turn) or logprobs. False when the turn cannot be
        pushed to."""
        started, decoder = self._started, self._decoder
        if started is None or started.push_to is None or decoder is None or \
                not pushable(self._opts):
            return False

        def emit(delta: ChunkDelta) -> bytes | None:
            self._add(delta)
            return encode(delta)

        return started.push_to(delta_push(decoder, self._parser, writer, emit))

    async def close(self) -> TurnEnd | None:
        """Record the turn and release the session (idempotent); None if the worker failed.

        Raises:
            StoreUnavailable: the store stayed unavailable through the manager's retries
                (nothing recorded; the lease expires by itself).

        NOTE: the store write runs in its own task, shielded: a request being torn down (the
        client went away, its cancel scope fires at every await) still records the turn."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._record())
            self._ctx.background.add(self._closing)
            self._closing.add_done_callback(self._ctx.background.discard)
        return await asyncio.shield(self._closing)

    async def _record(self) -> TurnEnd | None:
        if self.lease is not None:
            await self.lease.stop()
        self._release_pause()  # NOTE: a turn closed before start() sends nothing
        if self._failed:
            await self._ctx.manager.abort_turn(self.session)
            return None
        message, reason, usage = self._answer()
        record = TurnRecord(
            index=self.index, request_id=self.request_id, first_message=0,
            num_messages=len(self.new), finish_reason=reason,
            usage=TurnUsage(
                prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                cached_tokens=usage.prompt_tokens_details.cached_tokens,
            ),
            reused_prompt_tokens=self.prompt.reused_tokens, started_at=self._started_at,
            first_token_s=self._tally.first_token_s, duration_s=time.perf_counter() - self._t0,
        )
        try:
            await self._ctx.manager.finish_turn(
                self.session, self.new, _assistant_dict(message), record,
                self.prompt.prefix_ids, self.prompt.num_messages,
            )
        except SessionTooLarge:
            await self._ctx.manager.abort_turn(self.session)  # NOTE: release, record nothing
            raise
        self._retain_if_paused(message, reason, usage)
        return TurnEnd(
            session_id=self.session.id, turn=self.index, request_id=self.request_id,
            message=message, finish_reason=reason, usage=usage,
        )

    def _release_pause(self) -> None:
        if self._pause_released:
            return
        self._pause_released = True
        retention_of(self._dispatcher).release(self.pause)

    def _retain_if_paused(self, message: ResponseMessage, reason: str, usage: Usage) -> None:
        """Count this turn's cache hit when it followed a tool pause; when it ended in tool
        calls, retain its resume point on its worker while the tools run."""
        retention = retention_of(self._dispatcher)
        if self.pause is not None and self._started is not None:
            retention.hit_after_pause(usage.prompt_tokens,
                                      usage.prompt_tokens_details.cached_tokens)
        if reason != TOOL_CALLS or not message.tool_calls or not self._ctx.retain_ttl_s:
            return
        retention.paused(session_key(self.tenant, self.session.id), self.request_id, self.tenant,
                         call_names(message.tool_calls), time.monotonic(),
                         default_ttl_s=self._ctx.retain_ttl_s)

    def _answer(self) -> tuple[ResponseMessage, str, Usage]:
        content = "".join(self._content)
        if self._end is None:
            tally = self._tally
            usage = Usage.of(
                len(self.generate.input_ids), tally.completion_tokens, tally.cached_tokens
            )
            return ResponseMessage(content=content or None), CANCELLED, usage
        calls = [
            ToolCall(id=p[0], function=FunctionCall(name=p[1], arguments="".join(p[2:])))
            for _, p in sorted(self._calls.items())
        ]
        message = ResponseMessage(content=content or None, tool_calls=calls or None)
        return message, self._end.finish_reason, self._end.usage

    def _add(self, delta: ChunkDelta) -> None:
        if delta.content:
            self._content.append(delta.content)
        for call in delta.tool_calls or []:
            parts = self._calls.setdefault(call.index, ["", ""])
            if call.id:
                parts[0] = call.id
            if call.function is not None and call.function.name:
                parts[1] = call.function.name
            if call.function is not None and call.function.arguments:
                parts.append(call.function.arguments)


def message_dict(message: Any) -> Message:
    """A request message Struct as the JSON-like dict a session stores (no null fields)."""
    return {k: v for k, v in msgspec.to_builtins(message).items() if v is not None}


class _Tally:
    """Counts what the worker streamed, for a turn that ends before the worker's ``Finished``."""

    def __init__(self, t0: float) -> None:
        self._t0 = t0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.first_token_s: float | None = None

    def wrap(self, started: Started) -> Started:
        self._see(started.first)
        if not isinstance(started.first, TokenDelta):
            return started  # NOTE: already Finished: nothing more to count
        push_to = None if started.push_to is None else \
            functools.partial(self._push_to, started.push_to)
        return started.with_stream(self._counted(started.stream), push_to)

    def _push_to(self, push_to: Callable[[Push], bool], push: Push) -> bool:
        """``push_to(push)`` with what ``push`` takes counted too."""
        def counted(item: TokenDelta) -> bool:
            if not push(item):
                return False
            self._see(item)
            return True

        return push_to(counted)

    async def _counted(self, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
        try:
            async for item in stream:
                self._see(item)
                yield item
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    def _see(self, item: Any) -> None:
        if not isinstance(item, TokenDelta):
            return
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self._t0
            self.cached_tokens = item.cached_tokens
        self.completion_tokens += len(item.token_ids)


class _LeaseKeeper:
    """Renews a running turn's lease every ``manager.renew_every_s`` until ``stop``."""

    def __init__(self, ctx: SessionsState, session: Session) -> None:
        self._manager, self._session = ctx.manager, session
        self._task = asyncio.create_task(self._renew())
        ctx.leases.add(self._task)
        self._task.add_done_callback(ctx.leases.discard)

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _renew(self) -> None:
        deadline = time.monotonic() + MAX_LEASE_RENEWAL_S
        session = self._session
        while time.monotonic() < deadline:
            await asyncio.sleep(self._manager.renew_every_s)
            try:
                if not await self._manager.renew_turn(session):
                    logger.warning("turn %s lost its lease on session %s (taken over or "
                                   "deleted)", session.running.request_id, session.id)  # type: ignore[union-attr]
                    return
            except StoreUnavailable as exc:
                logger.warning("could not renew the lease of session %s: %s", session.id, exc)


async def _render(ctx: SessionsState, session: Session, new: Sequence[Message]) -> TurnPrompt:
    messages = [*session.rendered_messages(), *new]
    uncovered = messages[session.prompt_num_messages:] if session.prompt_ids else messages
    render = functools.partial(
        ctx.prompter.render, messages, session.tools, session.prompt_ids,
        session.prompt_num_messages,
    )
    try:
        if sum(message_chars(m) for m in uncovered) < RENDER_ON_THREAD_CHARS:
            return render()
        # NOTE: the prompter's state is caches of idempotent facts (dict writes, atomic under
        # the GIL), so a render on a thread beside one on the loop is safe
        return await asyncio.to_thread(render)
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        raise RequestError(f"messages could not be rendered: {exc}", param="messages") from None


def _check_tool_schemas(tools: list[Tool]) -> None:
    for i, tool in enumerate(tools):
        try:
            tool_call_grammar([(i, tool)], parallel=False)
        except StructuredError as exc:
            raise RequestError(str(exc), param=exc.param) from None


def _assistant_dict(message: ResponseMessage) -> Message:
    out: Message = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = msgspec.to_builtins(message.tool_calls)
    return out
