"""Push: a stream's deltas written from the worker's reply, past the stream's layers.

``RequestStream.push`` (``gateway.request_stream``) hands a delta to a synchronous function while
the stream's reader waits; ``delta_push`` is that function for the chat-shaped streams (chat
completions, session turns): it does what ``generation.chat_deltas`` does on the queued way,
with the stream's own decoder and tool-call parser, and writes the chunks through the server's
``BodyWriter`` (``gateway.sse``). ``pushable`` says which streams can be pushed at all.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.protocol import TokenDelta
from gateway.generation import OutputOptions, chunk_delta
from gateway.request_stream import Push
from gateway.schemas import ChunkDelta
from gateway.sse import BodyWriter
from gateway.tokenizer import StreamDecoder
from gateway.tool_parser import ContentDelta, ToolCallStreamParser


def pushable(opts: OutputOptions) -> bool:
    """Whether a delta's whole way to its chunks is synchronous and per delta: no stop strings
    to match (a match ends the stream), no logprobs to attach."""
    return not opts.stop_strings and not opts.logprobs


def delta_push(decoder: StreamDecoder, parser: ToolCallStreamParser | None, writer: BodyWriter,
               emit: Callable[[ChunkDelta], bytes | None],
               text_chunk: Callable[[str], bytes] | None = None) -> Push:
    """A ``RequestStream`` push that does, for a delta, what ``chat_deltas`` does on the queued
    way with the stream's own ``decoder`` and ``parser``: detokenize, parse tool calls, and write
    what ``emit`` makes of each chunk delta (None: nothing). ``text_chunk``: the bytes of a text
    when no parser runs (a content-only chunk, without building its delta). Declined while
    ``writer`` is not ready, before decoding, so that the delta then takes the queued way with
    nothing touched."""

    def push(item: TokenDelta) -> bool:
        if not writer.ready():
            return False
        text = decoder.feed_many(item.token_ids)
        if not text:
            return True
        if parser is None and text_chunk is not None:
            writer.write(text_chunk(text))
            return True
        events = parser.feed(text) if parser is not None else [ContentDelta(text)]
        for delta in filter(None, map(chunk_delta, events)):
            if (body := emit(delta)) is not None:
                writer.write(body)
        return True

    return push
