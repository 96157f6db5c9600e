"""``StopMatcher`` (issue 8, item 3: matching cost independent of history length) against a naive
reference, for any split of the text into feeds; plus the token-level cut of ``pieces``: the
tokens, logprobs and usage of an answer end with the token that completed the stop string, and
the worker stream is closed (the request aborted) before the answer ends."""

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.protocol import Finished, SamplingSpec, TokenDelta
from gateway.dispatch import StreamItem
from gateway.generation import (
    STOP_CHECK_INTERVAL_S,
    WHOLE_ANSWER_INTERVAL_S,
    OutputOptions,
    Started,
    StopMatcher,
    build_generate,
    chat_result,
    pieces,
)
from gateway.lifespan import ModelState
from gateway.metrics import StreamStats

ALPHABET = "ab\n"
_texts = st.text(alphabet=ALPHABET, max_size=40)
_stops = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=5), min_size=1, max_size=4)


def _reference(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """The text before the stop string that completes first (the longest of those completing at
    the same character), and whether one did."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if text[:end].endswith(s)]
        if starts:
            return text[: min(starts)], True
    return text, False


def _undecided_len(text: str, stops: Sequence[str]) -> int:
    """The longest suffix of ``text`` that is a proper prefix of a stop string."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c for c in cuts if 0 < c < len(text))})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)]


@settings(max_examples=400, deadline=None)
@given(text=_texts, stops=_stops, cuts=st.lists(st.integers(0, 40), max_size=10))
def test_matcher_agrees_with_the_reference_for_any_split(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    matcher = StopMatcher(stops)
    out, seen = "", ""
    for chunk in _split(text, cuts):
        out += matcher.feed(chunk)
        seen += chunk
        if matcher.stopped:
            break
        # NOTE: eager: only what could still start a stop string is held back, and no more
        assert out == seen[: len(seen) - _undecided_len(seen, stops)], (seen, out)
        assert len(matcher._held) < max(map(len, stops)), matcher._held
    out += matcher.flush()
    assert (out, matcher.stopped) == _reference(text, stops), (text, stops, out)


def test_earliest_completion_wins_and_ties_go_to_the_longer() -> None:
    matcher = StopMatcher(["abcdef", "cd"])
    assert matcher.feed("abcdefg") + matcher.flush() == "ab"
    matcher = StopMatcher(["d", "bcd"])
    assert matcher.feed("abcde") == "a"


def test_empty_and_duplicate_stop_strings_are_ignored() -> None:
    matcher = StopMatcher(["", "x", "x"])
    assert matcher.stops == ["x"]
    assert matcher.feed("abc") == "abc"
    assert StopMatcher([""]).feed("abc") == "abc"


def test_a_million_character_stop_costs_little_per_feed() -> None:
    """The issue's case: a 1M-character stop string. The old matcher walked a cut point over the
    whole stop length on every feed (2.5 s per feed here: 40 minutes for 1,000 feeds)."""
    matcher = StopMatcher(["ab" * 500_000])
    t0 = time.perf_counter()
    out = "".join(matcher.feed("hello world, a b ") for _ in range(1000))
    elapsed_s = time.perf_counter() - t0
    assert out == "hello world, a b " * 1000 and not matcher.stopped
    # NOTE: generous (under 0.1 s here on a busy CPU)
    assert elapsed_s < 20, f"{elapsed_s:.1f} s"


def test_near_matches_of_a_long_stop_cost_constant_work_per_character() -> None:
    """A 100k-character stop string that almost matches for ever: the held tail stays under the
    stop's length, and each character costs O(1) (amortized), however long the history."""
    stop = "a" * 100_000 + "b"
    matcher = StopMatcher([stop])
    t0 = time.perf_counter()
    emitted = sum(len(matcher.feed("aaaa")) for _ in range(40_000))
    elapsed_s = time.perf_counter() - t0
    assert len(matcher._held) == 100_000 and emitted == 160_000 - 100_000
    assert matcher.feed("b") == "" and matcher.stopped
    # NOTE: generous (about 1 s here on a busy CPU)
    assert elapsed_s < 30, f"{elapsed_s:.1f} s"


# ------------------------------------------------------------------ the token-level cut


class _Worker:
    """A scripted worker stream that records whether it was closed before its end."""

    def __init__(self, chunks: list[list[int]]) -> None:
        self.chunks = chunks
        self.closed_early = False

    async def stream(self) -> AsyncIterator[StreamItem]:
        done = False
        try:
            for chunk in self.chunks:
                lps = [-0.01 * t for t in chunk]
                yield TokenDelta(request_id="r", token_ids=chunk, logprobs=lps, cached_tokens=2)
            done = True
            total = sum(map(len, self.chunks))
            yield Finished(request_id="r", finish_reason="length", prompt_tokens=7,
                           completion_tokens=total)
        finally:
            self.closed_early = not done

    async def started(self, stats: StreamStats | None = None) -> Started:
        stream = self.stream()
        return Started("r", await anext(stream), stream, 7, stats)


@pytest.mark.parametrize("split", [1, 3, 100])
def test_usage_and_logprobs_end_with_the_token_that_completed_the_stop(
    demo_model: ModelState, split: int
) -> None:
    text = "hello STOP and then a lot more text that is never billed"
    ids = demo_model.tokenizer.encode(text)
    worker = _Worker([ids[i : i + split] for i in range(0, len(ids), split)])
    stats = StreamStats()

    async def run() -> tuple[list[object], bool]:
        items = [p async for p in pieces(await worker.started(stats), demo_model, ["STOP"])]
        return items, worker.closed_early

    items, closed_early = asyncio.run(run())
    *texts, finished = items
    assert isinstance(finished, Finished), finished
    through_stop = len(demo_model.tokenizer.encode("hello STOP"))
    assert finished.finish_reason == "stop" and finished.completion_tokens == through_stop
    assert (finished.prompt_tokens, finished.cached_tokens) == (7, 2)
    assert sum(len(p.token_ids) for p in texts) == through_stop  # type: ignore[attr-defined]
    assert sum(len(p.logprobs or []) for p in texts) == through_stop  # type: ignore[attr-defined]
    assert "".join(p.text for p in texts) == "hello "  # type: ignore[attr-defined]
    assert closed_early, "the worker stream was read to its end instead of aborted"
    assert stats.num_finished == 1 and stats.generated_tokens == through_stop


def test_chat_result_bills_only_up_to_the_stop(demo_model: ModelState) -> None:
    ids = demo_model.tokenizer.encode("one two three four five six seven")
    worker = _Worker([ids])

    async def run() -> object:
        return await chat_result(
            await worker.started(), demo_model,
            OutputOptions(["two"], parse_tools=False, logprobs=True),
        )

    result = asyncio.run(run())
    n = len(demo_model.tokenizer.encode("one two"))
    assert result.message.content == "one "  # type: ignore[attr-defined]
    assert result.usage.completion_tokens == n and len(result.logprobs) == n  # type: ignore
    assert result.finish_reason == "stop" and worker.closed_early  # type: ignore[attr-defined]


def test_a_whole_answer_with_stop_strings_is_sent_in_short_intervals() -> None:
    """The worker holds a whole answer's tokens back for up to 1 s; with a stop string that
    would be a second of tokens generated past the stop before the abort."""
    spec = SamplingSpec(max_new_tokens=8)
    plain = build_generate([1], spec, request_id="a", stream=False)
    stopped = build_generate([1], spec, request_id="b", stream=False, stop_strings=["\n"])
    streamed = build_generate([1], spec, request_id="c", stream=True, stop_strings=["\n"])
    assert plain.stream_interval_s == WHOLE_ANSWER_INTERVAL_S
    assert stopped.stream_interval_s == STOP_CHECK_INTERVAL_S <= 0.1
    assert streamed.stream_interval_s == 0.0
