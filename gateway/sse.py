"""Server-sent events as bytes: the framing the OpenAI and Sessions streams use, without a
per-event object, and a litestar ``Stream`` with the SSE headers.

``event(data)`` is ``data: <data>\\n\\n``: every payload here is one line (compact JSON, or
``[DONE]``), so no splitting is needed. ``ContentChunks`` pre-encodes the parts of one stream's
content-only chat chunk that never change, so a token's chunk costs one JSON string encoding and
two concatenations; its bytes equal encoding the whole ``ChatCompletionChunk``
(tests/gateway/test_sse.py).
"""

from collections.abc import AsyncIterator

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

    def encode(self, text: str) -> bytes | None:
        if self._prefix is None:
            return None
        return self._prefix + _JSON.encode(text) + self._suffix  # type: ignore[operator]
