"""``gateway.sse``: the pre-encoded content chunk is byte for byte the chunk the structs give."""

import hypothesis.strategies as st
import msgspec
from hypothesis import given, settings

from gateway import sse
from gateway.schemas.responses import ChatCompletionChunk, ChunkChoice, ChunkDelta


def _slow(id: str, model: str, created: int, text: str) -> bytes:
    chunk = ChatCompletionChunk(id=id, model=model, created=created,
                                choices=[ChunkChoice(index=0, delta=ChunkDelta(content=text))])
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


@settings(max_examples=300, deadline=None)
@given(id=st.text(max_size=40), model=st.text(max_size=40), created=st.integers(0, 2**40),
       text=st.text(max_size=60))
def test_content_chunk_bytes_equal_the_structs_encoding(
    id: str, model: str, created: int, text: str
) -> None:
    fast = sse.ContentChunks(id, model, created).encode(text)
    if fast is None:  # NOTE: only when a head field is the template's sentinel
        assert "\x00agentgate-content\x00" in (id, model)
        return
    assert fast == _slow(id, model, created, text)
    assert fast.count(b"\n") == 2, "one data line, then the blank line"


def test_a_head_holding_the_sentinel_falls_back() -> None:
    sentinel = "\x00agentgate-content\x00"
    assert sse.ContentChunks(sentinel, "m", 1).encode("x") is None
    inside = sse.ContentChunks(f"chatcmpl-{sentinel}", "m", 1).encode("x")
    assert inside == _slow(f"chatcmpl-{sentinel}", "m", 1, "x"), "inside a longer id: no clash"


def test_events_frame_one_line() -> None:
    assert sse.event(b"[DONE]") == sse.DONE == b"data: [DONE]\n\n"
    assert sse.json_event({"a": "b\nc"}) == b'data: {"a":"b\\nc"}\n\n'
