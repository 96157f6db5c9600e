"""Server-sent events as bytes: the framing the OpenAI and Sessions streams use, without a
per-event object, and a litestar ``Stream`` with the SSE headers.

``event(data)`` is ``data: <data>\\n\\n``: every payload here is one line (compact JSON, or
``[DONE]``), so no splitting is needed. ``ContentChunks`` pre-encodes the parts of one stream's
content-only chat chunk that never change, so a token's chunk costs one JSON string encoding and
two concatenations; its bytes equal encoding the whole ``ChatCompletionChunk``
(tests/gateway/test_sse.py).

``EventStream`` is a body that may also write some events itself, straight to the connection,
when the server offers a ``BodyWriter`` (``gateway.http_server``'s ASGI extension; the lane
attaches it): a chat stream's tokens then skip the per-event ASGI ``send`` and every
layer above it (``gateway.request_stream``, push).
"""

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import msgspec
from litestar.response import Stream

from gateway.schemas.responses import ChatCompletionChunk, ChunkChoice, ChunkDelta

_JSON = msgspec.json.Encoder()
_SENTINEL = "\x00agentgate-content\x00"
HEADERS = {"Cache-Control": "no-cache", "Connection": "keep-alive", "X-Accel-Buffering": "no"}


def event(data: bytes) -> bytes:
    """One SSE event carrying ``data`` (a single line)."""
    return b"data: " + data + b"\n\n"


def json_event(body: object) -> bytes:
    """One SSE event carrying ``body`` as compact JSON."""
    return event(_JSON.encode(body))


DONE = event(b"[DONE]")


def response(events: AsyncIterator[bytes]) -> Stream:
    """A streamed ``text/event-stream`` response of pre-encoded events."""
    return Stream(events, media_type="text/event-stream", headers=HEADERS)


class ContentChunks:
    """The SSE event of a content-only ``ChatCompletionChunk`` (no role, tool calls, finish
    reason, logprobs or usage) of one stream, from bytes made once.

    ``encode(text)`` is None when the head's own fields hold the sentinel the template is cut
    at (then the caller encodes the struct).
    """

    __slots__ = ("_prefix", "_suffix")

    def __init__(self, id: str, model: str, created: int) -> None:
        choice = ChunkChoice(index=0, delta=ChunkDelta(content=_SENTINEL))
        framed = json_event(ChatCompletionChunk(id=id, model=model, created=created,
                                                choices=[choice]))
        marker = _JSON.encode(_SENTINEL)
        at = framed.find(marker)
        if at < 0 or framed.count(marker) != 1:
            self._prefix = self._suffix = None
            return
        self._prefix, self._suffix = framed[:at], framed[at + len(marker):]

    @property
    def usable(self) -> bool:
        """Whether ``encode`` gives bytes (the head's fields hold no sentinel)."""
        return self._prefix is not None

    def encode(self, text: str) -> bytes | None:
        if self._prefix is None:
            return None
        return self._prefix + _JSON.encode(text) + self._suffix  # type: ignore[operator]


BODY_WRITER = "agentgate.body_writer"  # NOTE: the ASGI extension's key in scope["extensions"]


class BodyWriter(Protocol):
    """Writes response body bytes to the connection now, between the app's own ``send``s."""

    def ready(self) -> bool:
        """Whether a write now is safe: the response started, is not complete, the client is
        there and the transport is not paused (a paused one goes through ``send``)."""

    def write(self, body: bytes) -> None:
        """Write ``body`` as the response's next piece (only after ``ready()``)."""


class EventStream:
    """An SSE body: the async iterator of events that ``make(self)`` returns. The events may
    also go out through ``writer`` when the server offers one (``attach`` before iterating;
    without it the body is a plain async iterator). ``aclose`` closes the events."""

    __slots__ = ("writer", "_events")

    def __init__(self, make: "Callable[[EventStream], AsyncIterator[bytes]]") -> None:
        self.writer: BodyWriter | None = None
        self._events = make(self)

    def attach(self, writer: BodyWriter) -> None:
        self.writer = writer

    def __aiter__(self) -> "EventStream":
        return self

    def __anext__(self) -> "Awaitable[bytes]":
        return self._events.__anext__()

    async def aclose(self) -> None:
        await self._events.aclose()  # type: ignore[attr-defined]
