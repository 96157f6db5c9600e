"""The generation pipeline behind every API that produces text: the OpenAI endpoints, session
turns over REST and WebSocket. Transport-agnostic: it yields typed pieces, the controllers turn
them into JSON, SSE events or WebSocket frames.

    worker stream -> StreamDecoder (whole characters) -> StopMatcher (stop strings)
                  -> ToolCallStreamParser (chat only) -> ChunkDelta / ChatEnd

``start`` awaits the worker's first item before anything is answered, so an error the worker
gives before any token (``context_too_long``, ``overloaded``, no worker) still becomes an HTTP
status even for a streamed request. Leaving a stream early (the client went away) aborts the
worker request. NOTE: invariant: for any split into deltas, a streamed answer's content deltas
concatenate to the non-streamed ``content``, with the same tool calls.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec

from engine.protocol import Finished, Generate, SamplingSpec, TokenDelta
from gateway.dispatch import Dispatcher, StreamItem
from gateway.lifespan import ModelState
from gateway.logprobs import TokenTexts, chat_logprobs
from gateway.schemas import (
    ChunkDelta,
    FunctionCall,
    FunctionCallDelta,
    RequestError,
    ResponseMessage,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from gateway.tokenizer import StreamDecoder
from gateway.tool_parser import (
    ContentDelta,
    ToolCallArgumentsDelta,
    ToolCallEvent,
    ToolCallStart,
    ToolCallStreamParser,
    parse_tool_calls,
)

# NOTE: every ZeroMQ message costs the gateway a wake-up (tens of microseconds of CPU, more when
# the loop was idle); a non-streamed answer needs no per-token messages.
WHOLE_ANSWER_INTERVAL_S = 1.0


class OutputOptions(NamedTuple):
    """What to do with the generated text.

    Attributes:
        stop_strings: the text ends before the first of these (not included).
        parse_tools: turn ``<tool_call>`` blocks into tool calls (chat with tools).
        logprobs: report token logprobs (the worker was asked for them).
    """

    stop_strings: Sequence[str] = ()
    parse_tools: bool = True
    logprobs: bool = False


@dataclass(slots=True)
class Started:
    """A worker request whose first item has arrived; iterate ``items()`` once."""

    request_id: str
    first: StreamItem
    stream: AsyncIterator[StreamItem]

    async def items(self) -> AsyncIterator[StreamItem]:
        yield self.first
        if not isinstance(self.first, Finished):
            async for item in self.stream:
                yield item

    async def aclose(self) -> None:
        await self.stream.aclose()  # type: ignore[attr-defined]


class Piece(NamedTuple):
    """New text and the tokens (with their logprobs) that produced it."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


class ChatDelta(NamedTuple):
    delta: ChunkDelta
    logprobs: list[TokenLogprob] | None


class ChatEnd(NamedTuple):
    finish_reason: Any
    usage: Usage
    logprobs: list[TokenLogprob] | None  # of tokens not yet attached to a delta


class ChatResult(NamedTuple):
    message: ResponseMessage
    finish_reason: Any
    usage: Usage
    logprobs: list[TokenLogprob] | None
    token_ids: list[int]


def new_request_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def build_generate(
    input_ids: list[int],
    sampling: SamplingSpec,
    *,
    request_id: str,
    session_id: str | None = None,
    cache_salt: str | None = None,
    retain_ttl_s: float | None = None,
    stream: bool = True,
) -> Generate:
    """The worker request (the caller has checked the context with ``check_context``).
    ``stream=False`` (the client wants the whole answer) lets the worker hold tokens back for
    ``WHOLE_ANSWER_INTERVAL_S``: one message per short answer instead of one per token."""
    return Generate(
        request_id=request_id, input_ids=input_ids, sampling=sampling, session_id=session_id,
        cache_salt=cache_salt, retain_ttl_s=retain_ttl_s,
        stream_interval_s=0.0 if stream else WHOLE_ANSWER_INTERVAL_S,
    )


def check_context(model: ModelState, num_prompt_tokens: int, param: str) -> int:
    """Tokens left for the completion; raises ``RequestError`` when there are none."""
    left = model.max_context - num_prompt_tokens
    if left <= 0:
        raise RequestError(
            f"The prompt is {num_prompt_tokens} tokens; this model's context is "
            f"{model.max_context} tokens.", param=param, code="context_length_exceeded",
        )
    return left


async def start(dispatcher: Dispatcher, generate: Generate) -> Started:
    """Send ``generate`` and wait for its first item; a ``DispatchError`` propagates."""
    stream = dispatcher.generate(generate)
    try:
        first = await anext(stream)
    except BaseException:
        await stream.aclose()  # type: ignore[attr-defined]
        raise
    return Started(generate.request_id, first, stream)


async def pieces(
    started: Started, model: ModelState, stop_strings: Sequence[str]
) -> AsyncIterator[Piece | Finished]:
    """Text pieces (stop strings applied), then the worker's ``Finished`` (its
    ``finish_reason`` is "stop" when a stop string cut the text). Closes the stream on exit."""
    decoder = StreamDecoder(model.tokenizer, skip_special_tokens=True)
    stop = StopMatcher(stop_strings)
    try:
        async for item in started.items():
            if isinstance(item, Finished):
                tail = stop.feed(decoder.flush()) + stop.flush()
                if tail:
                    yield Piece(tail, [], None, None)
                if stop.stopped and item.finish_reason == "length":
                    item = _with_reason(item, "stop")
                yield item
                return
            yield _piece(item, stop.feed(decoder.feed_many(item.token_ids)))
    finally:
        await started.aclose()


async def chat_deltas(
    started: Started, model: ModelState, opts: OutputOptions
) -> AsyncIterator[ChatDelta | ChatEnd]:
    """The streamed form of a chat answer: ``ChatDelta``s, then one ``ChatEnd``."""
    texts = TokenTexts(model.tokenizer)
    parser = ToolCallStreamParser(id_seed=started.request_id) if opts.parse_tools else None
    pending: list[TokenLogprob] = []
    async for piece in pieces(started, model, opts.stop_strings):
        if isinstance(piece, Finished):
            events = parser.finish() if parser is not None else []
            for delta in filter(None, map(_delta, events)):
                yield ChatDelta(delta, _take(pending, opts.logprobs))
            has_calls = parser is not None and parser.num_calls > 0
            reason = finish_reason(piece, has_calls)
            yield ChatEnd(reason, usage_of(piece), _take(pending, opts.logprobs))
            return
        if opts.logprobs and piece.logprobs is not None:
            pending += chat_logprobs(texts, piece.token_ids, piece.logprobs, piece.top_logprobs)
        events = parser.feed(piece.text) if parser is not None else [ContentDelta(piece.text)]
        for delta in filter(None, map(_delta, events)):
            yield ChatDelta(delta, _take(pending, opts.logprobs))


async def chat_result(started: Started, model: ModelState, opts: OutputOptions) -> ChatResult:
    """The whole answer: the same text, calls and logprobs as ``chat_deltas`` joined up."""
    text: list[str] = []
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    texts = TokenTexts(model.tokenizer)
    async for piece in pieces(started, model, opts.stop_strings):
        if isinstance(piece, Finished):
            finished = piece
            break
        text.append(piece.text)
        token_ids += piece.token_ids
        if opts.logprobs and piece.logprobs is not None:
            logprobs += chat_logprobs(texts, piece.token_ids, piece.logprobs, piece.top_logprobs)
    parsed = (
        parse_tool_calls("".join(text), id_seed=started.request_id)
        if opts.parse_tools else None
    )
    content = parsed.content if parsed is not None else "".join(text)
    calls = [
        ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in (parsed.tool_calls if parsed is not None else [])
    ]
    message = ResponseMessage(content=content or None, tool_calls=calls or None)
    reason = finish_reason(finished, bool(calls))
    return ChatResult(
        message, reason, usage_of(finished), logprobs if opts.logprobs else None, token_ids
    )


def finish_reason(item: Finished, has_calls: bool = False) -> Any:
    """The OpenAI finish reason of a worker's ``Finished`` ("tool_calls" when calls were made)."""
    if has_calls:
        return "tool_calls"
    return "length" if item.finish_reason == "length" else "stop"


def usage_of(item: Finished) -> Usage:
    return Usage.of(item.prompt_tokens, item.completion_tokens, item.cached_tokens)


class StopMatcher:
    """Cuts text at the first stop string; holds back what could be the start of one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.stopped = False
        self._held = ""

    def feed(self, text: str) -> str:
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        text = self._held + text
        cuts = [i for s in self.stops if (i := text.find(s)) >= 0]
        if cuts:
            self.stopped, self._held = True, ""
            return text[: min(cuts)]
        keep = max(len(s) - 1 for s in self.stops)
        emit = len(text) - keep
        while emit < len(text) and not any(s.startswith(text[max(emit, 0):]) for s in self.stops):
            emit += 1
        emit = max(emit, 0)
        self._held = text[emit:]
        return text[:emit]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held


def _with_reason(item: Finished, reason: str) -> Finished:
    return msgspec.structs.replace(item, finish_reason=reason)


def _piece(item: TokenDelta, text: str) -> Piece:
    return Piece(text, item.token_ids, item.logprobs, item.top_logprobs)


def _take(pending: list[TokenLogprob], wanted: bool) -> list[TokenLogprob] | None:
    if not wanted:
        return None
    taken = pending[:]
    pending.clear()
    return taken


def _delta(event: ToolCallEvent) -> ChunkDelta | None:
    if isinstance(event, ContentDelta):
        return ChunkDelta(content=event.text) if event.text else None
    if isinstance(event, ToolCallStart):
        fn = FunctionCallDelta(name=event.name, arguments="")
        call = ToolCallDelta(index=event.index, id=event.id, type="function", function=fn)
        return ChunkDelta(tool_calls=[call])
    if isinstance(event, ToolCallArgumentsDelta):
        fn = FunctionCallDelta(arguments=event.text)
        return ChunkDelta(tool_calls=[ToolCallDelta(index=event.index, function=fn)])
    return None  # ToolCallEnd, ToolCallError: nothing to send
