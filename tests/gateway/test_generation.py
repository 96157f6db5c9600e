"""The transport-agnostic generation pipeline (``gateway/generation.py``) on scripted worker
streams: streamed and whole answers agree for any split into deltas, stop strings cut across
deltas, logprobs line up with tokens, and leaving a stream early closes (aborts) the worker's."""

import asyncio
import json
from collections.abc import AsyncIterator, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.protocol import Finished, TokenDelta
from gateway.dispatch import StreamItem
from gateway.generation import (
    ChatDelta,
    ChatEnd,
    OutputOptions,
    Started,
    chat_deltas,
    chat_result,
)
from gateway.lifespan import ModelState

TEXT = 'héllo 世界 wor<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


def _started(ids: list[int], splits: Sequence[int], logprobs: bool = False) -> Started:
    """A worker stream giving ``ids`` in chunks cut at ``splits``, then ``Finished``."""
    cuts = sorted({0, len(ids), *(s for s in splits if 0 < s < len(ids))})
    chunks = [ids[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]

    def delta(chunk: list[int]) -> TokenDelta:
        lps = [-0.5 - 0.01 * t for t in chunk] if logprobs else None
        return TokenDelta(request_id="r", token_ids=chunk, logprobs=lps)

    async def rest() -> AsyncIterator[StreamItem]:
        for chunk in chunks[1:]:
            yield delta(chunk)
        yield Finished(request_id="r", finish_reason="stop", prompt_tokens=3,
                       completion_tokens=len(ids))

    return Started("r", delta(chunks[0]), rest())


async def _stream(started: Started, model: ModelState, opts: OutputOptions) -> list[object]:
    return [e async for e in chat_deltas(started, model, opts)]


@settings(max_examples=40, deadline=None)
@given(splits=st.lists(st.integers(0, 120), max_size=12), stop=st.sampled_from([(), ("wor",)]))
def test_stream_concatenates_to_whole(
    demo_model: ModelState, splits: list[int], stop: tuple
) -> None:
    ids = demo_model.tokenizer.encode(TEXT)
    opts = OutputOptions(stop, parse_tools=True, logprobs=True)
    whole = asyncio.run(chat_result(_started(ids, splits, True), demo_model, opts))
    events = asyncio.run(_stream(_started(ids, splits, True), demo_model, opts))
    deltas = [e.delta for e in events if isinstance(e, ChatDelta)]
    content = "".join(d.content or "" for d in deltas)
    calls = [c for d in deltas for c in d.tool_calls or []]
    assert content == (whole.message.content or "")
    streamed_lps = [lp for e in events for lp in (e.logprobs or [])]
    assert [lp.logprob for lp in streamed_lps] == [lp.logprob for lp in whole.logprobs or []]
    [end] = [e for e in events if isinstance(e, ChatEnd)]
    assert end.finish_reason == whole.finish_reason
    if stop:
        assert whole.message.tool_calls is None and content == "héllo 世界"
        return
    assert len(whole.logprobs or []) == len(ids)
    [call] = whole.message.tool_calls or []
    assert calls[0].id == call.id and calls[0].function.name == call.function.name == "f"
    assert "".join(c.function.arguments for c in calls) == call.function.arguments
    assert json.loads(call.function.arguments) == {"a": 1}
    assert whole.finish_reason == "tool_calls"


def test_logprob_bytes_join_a_split_character(demo_model: ModelState) -> None:
    ids = demo_model.tokenizer.encode("世")
    assert len(ids) > 1  # byte-level: one token per byte here
    whole = asyncio.run(chat_result(
        _started(ids, [], True), demo_model, OutputOptions(logprobs=True)
    ))
    raw = b"".join(bytes(lp.bytes or []) for lp in whole.logprobs or [])
    assert raw.decode() == "世"


def test_leaving_the_stream_early_closes_the_worker_stream(demo_model: ModelState) -> None:
    closed: list[bool] = []

    async def endless() -> AsyncIterator[StreamItem]:
        try:
            while True:
                yield TokenDelta(request_id="r", token_ids=[104])
        finally:
            closed.append(True)

    async def read_two_and_leave() -> None:
        stream = endless()
        started = Started("r", await anext(stream), stream)
        events = chat_deltas(started, demo_model, OutputOptions())
        await anext(events)
        await anext(events)
        await events.aclose()

    asyncio.run(read_two_and_leave())
    assert closed == [True], closed
