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

A matched stop string ends the worker request at once (``pieces`` aborts it): the answer's
tokens, ``usage.completion_tokens`` and logprobs end with the token that completed the match, and
the finish reason is "stop". Without stop strings a worker's delta is decoded in one go; with
them, token by token, to find that token.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec

from engine.protocol import Finished, Generate, MediaSpan, SamplingSpec, TokenDelta
from gateway.dispatch import Dispatcher, StreamItem
from gateway.lifespan import ModelState
from gateway.logprobs import TokenTexts, chat_logprobs
from gateway.metrics import StreamStats
from gateway.request_stream import Push
from gateway.routing.chain import routable_hashes
from gateway.routing.types import RouteRequest
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
from gateway.tenancy import ANONYMOUS
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
# NOTE: the worker keeps generating until the gateway sees the stop string and aborts; 20
# messages a second cost little and waste at most 50 ms of decoding
STOP_CHECK_INTERVAL_S = 0.05
OFF_LOOP_HASH_TOKENS = 16_384  # NOTE: a keyless prompt longer than this is hashed on a thread


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
    """A worker request whose first item has arrived; iterate ``items()`` once.

    ``num_prompt_tokens`` and ``stats`` are for an answer that ends before the worker's
    ``Finished`` (a stop string matched): its usage, and the dispatcher's token counters.
    """

    request_id: str
    first: StreamItem
    stream: AsyncIterator[StreamItem]
    num_prompt_tokens: int = 0
    stats: StreamStats | None = None
    push_to: Callable[[Push], bool] | None = None  # NOTE: ``Dispatcher.push_to`` of this request
    image_tokens: int = 0  # NOTE: the prompt's media placeholder tokens, for the usage

    def with_stream(self, stream: AsyncIterator[StreamItem],
                    push_to: Callable[[Push], bool] | None = None) -> Started:
        """The same request read through ``stream`` (which wraps ``self.stream``). It can be
        pushed to only through ``push_to`` (None: not at all): ``stream`` may want to see
        every delta, pushed ones too."""
        return Started(self.request_id, self.first, stream, self.num_prompt_tokens, self.stats,
                       push_to, self.image_tokens)

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
    stop_strings: Sequence[str] = (),
    media: Sequence[MediaSpan] = (),
) -> Generate:
    """The worker request (the caller has checked the context with ``check_context``).
    ``stream=False`` (the client wants the whole answer) lets the worker hold tokens back for
    ``WHOLE_ANSWER_INTERVAL_S``: one message per short answer instead of one per token; with
    ``stop_strings``, only for ``STOP_CHECK_INTERVAL_S``, so that a matched stop string aborts the
    request soon after the worker wrote it."""
    interval_s = 0.0 if stream else (
        STOP_CHECK_INTERVAL_S if any(stop_strings) else WHOLE_ANSWER_INTERVAL_S)
    return Generate(
        request_id=request_id, input_ids=input_ids, sampling=sampling, session_id=session_id,
        cache_salt=cache_salt, retain_ttl_s=retain_ttl_s, stream_interval_s=interval_s,
        media=list(media),
    )


def route_request(
    dispatcher: Dispatcher, generate: Generate, affinity_key: str | None = None,
    conversation: int | None = None,
) -> RouteRequest:
    """What the router needs to place ``generate``: its routable page hashes (salted by its
    ``cache_salt``, computed incrementally per affinity key) and its affinity key.

    The affinity key is ``affinity_key`` (the OpenAI path's hint: a session header,
    ``prompt_cache_key`` or ``user``; see ``gateway.affinity_keys``), else the request's session
    id (a Sessions API turn), prefixed by the tenant so that tenants never share one. Without
    one, ``conversation`` (the prompt cache's name of a stateless chat) keys the incremental
    hashing only: a client that resends its history without any hint is hashed O(new pages)
    a turn too, and routed by its pages alone.
    """
    tenant = generate.cache_salt or ANONYMOUS
    if affinity_key is None and generate.session_id is not None:
        affinity_key = f"session:{generate.session_id}"
    key = None if affinity_key is None else f"{tenant}/{affinity_key}"
    hash_key = key if key is not None or conversation is None else \
        f"{tenant}/conversation:{conversation:x}"
    num_tokens = len(generate.input_ids)
    hasher = dispatcher.hasher
    hashes: Sequence[int] = ()
    if hasher is not None:
        hashes = routable_hashes(
            hasher.hashes(generate.input_ids, generate.cache_salt, hash_key), num_tokens,
            hasher.page_size)
    return RouteRequest(
        request_id=generate.request_id, num_tokens=num_tokens, page_hashes=hashes,
        affinity_key=key, tenant=generate.cache_salt or "",
        max_new_tokens=generate.sampling.max_new_tokens,
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


async def start(
    dispatcher: Dispatcher, generate: Generate, affinity_key: str | None = None,
    conversation: int | None = None,
) -> Started:
    """Send ``generate`` (routed by ``route_request``) and wait for its first item; a
    ``DispatchError`` propagates."""
    if affinity_key is None and generate.session_id is None and conversation is None and (
            len(generate.input_ids) > OFF_LOOP_HASH_TOKENS):
        # NOTE: nothing to hash incrementally by: a whole long prompt (~16 ms per 100k tokens)
        # is hashed on a thread, not on the loop every other request waits on
        route = await asyncio.to_thread(route_request, dispatcher, generate)
    else:
        route = route_request(dispatcher, generate, affinity_key, conversation)
    stream = dispatcher.generate(generate, route)
    try:
        first = await anext(stream)
    except BaseException:
        await stream.aclose()  # type: ignore[attr-defined]
        raise
    return Started(generate.request_id, first, stream, len(generate.input_ids), dispatcher.stats,
                   functools.partial(dispatcher.push_to, generate.request_id),
                   sum(span.length for span in generate.media))


async def pieces(
    started: Started, model: ModelState, stop_strings: Sequence[str],
    decoder: StreamDecoder | None = None,
) -> AsyncIterator[Piece | Finished]:
    """Text pieces (stop strings applied), then a ``Finished`` (its ``finish_reason`` is "stop"
    when a stop string cut the text). Closes the stream on exit.

    A stop string matched in a worker's delta ends the worker request there (``Abort``) and the
    ``Finished`` is made here: ``completion_tokens`` counts the tokens up to and including the
    one that completed the match, and the last piece holds only those tokens.

    ``decoder``: the stream's detokenizer when the caller decodes some deltas itself (pushed
    ones: ``_chat_sse``), so that both see one text.
    """
    if decoder is None:
        decoder = StreamDecoder(model.tokenizer, skip_special_tokens=True)
    stop = StopMatcher(stop_strings)
    num_tokens = 0
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
            if not stop.stops:
                yield _piece(item, decoder.feed_many(item.token_ids))
                continue
            piece = _cut_at_stop(item, decoder, stop)
            num_tokens += len(piece.token_ids)
            if stop.stopped:
                await started.aclose()  # NOTE: sends Abort before anything else is awaited
                yield piece
                yield _stopped(started, num_tokens)
                return
            yield piece
    finally:
        await started.aclose()


def tool_parser(started: Started, opts: OutputOptions) -> ToolCallStreamParser | None:
    """The stream's tool-call parser (None when ``opts`` parses no tools)."""
    return ToolCallStreamParser(id_seed=started.request_id) if opts.parse_tools else None


async def chat_deltas(
    started: Started, model: ModelState, opts: OutputOptions,
    decoder: StreamDecoder | None = None, parser: ToolCallStreamParser | None = None,
) -> AsyncIterator[ChatDelta | ChatEnd]:
    """The streamed form of a chat answer: ``ChatDelta``s, then one ``ChatEnd``.

    ``decoder`` (as ``pieces``) and ``parser`` (``tool_parser``): the stream's own when the
    caller handles some deltas itself (pushed ones: ``_chat_sse``); made here when None."""
    texts = TokenTexts(model.tokenizer)
    if parser is None:
        parser = tool_parser(started, opts)
    pending: list[TokenLogprob] = []
    async with aclosing(pieces(started, model, opts.stop_strings, decoder)) as stream:
        async for piece in stream:
            if isinstance(piece, Finished):
                events = parser.finish() if parser is not None else []
                for delta in filter(None, map(chunk_delta, events)):
                    yield ChatDelta(delta, _take(pending, opts.logprobs))
                has_calls = parser is not None and parser.num_calls > 0
                reason = finish_reason(piece, has_calls)
                yield ChatEnd(reason, usage_of(piece, started.image_tokens),
                              _take(pending, opts.logprobs))
                return
            if opts.logprobs and piece.logprobs is not None:
                pending += chat_logprobs(
                    texts, piece.token_ids, piece.logprobs, piece.top_logprobs)
            events = parser.feed(piece.text) if parser is not None else [ContentDelta(piece.text)]
            for delta in filter(None, map(chunk_delta, events)):
                yield ChatDelta(delta, _take(pending, opts.logprobs))


async def chat_result(started: Started, model: ModelState, opts: OutputOptions) -> ChatResult:
    """The whole answer: the same text, calls and logprobs as ``chat_deltas`` joined up."""
    text: list[str] = []
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    texts = TokenTexts(model.tokenizer)
    async with aclosing(pieces(started, model, opts.stop_strings)) as stream:
        async for piece in stream:
            if isinstance(piece, Finished):
                finished = piece
                break
            text.append(piece.text)
            token_ids += piece.token_ids
            if opts.logprobs and piece.logprobs is not None:
                logprobs += chat_logprobs(
                    texts, piece.token_ids, piece.logprobs, piece.top_logprobs)
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
        message, reason, usage_of(finished, started.image_tokens),
        logprobs if opts.logprobs else None, token_ids,
    )


def finish_reason(item: Finished, has_calls: bool = False) -> Any:
    """The OpenAI finish reason of a worker's ``Finished``: "length" when ``max_tokens`` (or the
    context) cut the answer, even after complete calls (a cut call was dropped); else
    "tool_calls" when calls were made; else "stop"."""
    if item.finish_reason == "length":
        return "length"
    return "tool_calls" if has_calls else "stop"


def usage_of(item: Finished, image_tokens: int = 0) -> Usage:
    return Usage.of(item.prompt_tokens, item.completion_tokens, item.cached_tokens, image_tokens)


class StopMatcher:
    """Cuts text at the first stop string to complete; holds back what could start one.

    The cut is where the stop string that completes earliest begins (of two completing at the
    same character, the longer), the same for any split of the text into ``feed`` calls. Text
    that cannot be the start of a stop string is passed on at once.

    NOTE: cost: a KMP automaton per stop string, so each fed character costs amortized O(1) per
    stop string, and memory is the held-back tail (under ``max(map(len, stops))`` characters):
    both independent of how much text came before. Building it is linear in the stops' length.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]  # NOTE: "" never matches (a 400)
        self.stopped = False
        self._failure = [_failure(s) for s in self.stops]
        self._states = [0] * len(self.stops)  # longest prefix of stop i ending the text so far
        self._held = ""

    def feed(self, text: str) -> str:
        """The part of ``text`` (and of the held-back tail) that is final; "" once stopped."""
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        buf = self._held + text
        cut: tuple[int, int] | None = None  # (match end in text, -length of the stop)
        for i, stop in enumerate(self.stops):
            state, end = _scan(stop, self._failure[i], self._states[i], text)
            self._states[i] = state
            if end >= 0 and (cut is None or (end, -len(stop)) < cut):
                cut = (end, -len(stop))
        if cut is not None:
            end, minus_len = cut
            self.stopped, self._held = True, ""
            return buf[: len(buf) - len(text) + end + minus_len]
        keep = max(self._states)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """What is held back, at the end of the text ("" once stopped)."""
        held, self._held = self._held, ""
        self._states = [0] * len(self.stops)
        return "" if self.stopped else held


def _failure(stop: str) -> list[int]:
    """KMP: ``out[i]`` is the length of the longest proper prefix of ``stop[:i + 1]`` that is
    also its suffix."""
    out = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = out[k - 1]
        if stop[i] == stop[k]:
            k += 1
        out[i] = k
    return out


def _scan(stop: str, failure: list[int], state: int, text: str) -> tuple[int, int]:
    """Run ``stop``'s automaton from ``state`` over ``text``: (the state after, the end index in
    ``text`` of the first match or -1). The state is how much of ``stop`` ends the text."""
    i, n, m, first = 0, len(text), len(stop), stop[0]
    while i < n:
        if state == 0:  # NOTE: fast path: nothing can start before the next first character
            i = text.find(first, i)
            if i < 0:
                return 0, -1
        char = text[i]
        while state and stop[state] != char:
            state = failure[state - 1]
        if stop[state] == char:
            state += 1
        i += 1
        if state == m:
            return state, i
    return state, -1


def _with_reason(item: Finished, reason: str) -> Finished:
    return msgspec.structs.replace(item, finish_reason=reason)


def _piece(item: TokenDelta, text: str, num_tokens: int | None = None) -> Piece:
    """The piece of ``item``'s first ``num_tokens`` tokens (all when None)."""
    if num_tokens is None or num_tokens == len(item.token_ids):
        return Piece(text, item.token_ids, item.logprobs, item.top_logprobs)
    cut = slice(0, num_tokens)
    return Piece(
        text, item.token_ids[cut], None if item.logprobs is None else item.logprobs[cut],
        None if item.top_logprobs is None else item.top_logprobs[cut],
    )


def _cut_at_stop(item: TokenDelta, decoder: StreamDecoder, stop: StopMatcher) -> Piece:
    """``item``'s piece, up to and including the token that completes a stop string."""
    texts = []
    for n, token_id in enumerate(item.token_ids, 1):
        texts.append(stop.feed(decoder.feed(token_id)))
        if stop.stopped:
            return _piece(item, "".join(texts), n)
    return _piece(item, "".join(texts))


def _stopped(started: Started, num_tokens: int) -> Finished:
    """The ``Finished`` of a request ended by a stop string (the worker's never comes)."""
    first = started.first
    cached = first.cached_tokens if isinstance(first, TokenDelta) else 0
    finished = Finished(
        request_id=started.request_id, finish_reason="stop",
        prompt_tokens=started.num_prompt_tokens, completion_tokens=num_tokens,
        cached_tokens=cached,
    )
    if started.stats is not None:
        started.stats.finished(finished)
    return finished


def _take(pending: list[TokenLogprob], wanted: bool) -> list[TokenLogprob] | None:
    if not wanted:
        return None
    taken = pending[:]
    pending.clear()
    return taken


def chunk_delta(event: ToolCallEvent) -> ChunkDelta | None:
    """A parser event as the chunk delta it streams (None: nothing to send)."""
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
