"""``RequestStream``: deltas queued since the last read come out as one, in order, with their
logprobs aligned; ends, errors, timeouts and the unread bound behave as before coalescing."""

import asyncio

import hypothesis.strategies as st
from hypothesis import given, settings

from engine.protocol import Finished, TokenDelta, merge_deltas
from gateway.dispatch_errors import DispatchTimeout, StreamOverflow
from gateway.request_stream import RequestStream

RID = "r"


def _delta(ids: list[int], logprobs: bool = False, cached: int = 0) -> TokenDelta:
    return TokenDelta(request_id=RID, token_ids=ids,
                      logprobs=[-float(t) for t in ids] if logprobs else None,
                      top_logprobs=[[(t, -float(t))] for t in ids] if logprobs else None,
                      cached_tokens=cached)


def _finished(n: int) -> Finished:
    return Finished(request_id=RID, finish_reason="length", prompt_tokens=3,
                    completion_tokens=n, cached_tokens=0)


def _read_all(stream: RequestStream) -> list[object]:
    async def go() -> list[object]:
        out = []
        while True:
            item = await stream.next(1.0, 1.0, "w")
            out.append(item)
            if not isinstance(item, TokenDelta):
                return out
    return asyncio.run(go())


def test_deltas_queued_between_reads_come_out_as_one() -> None:
    s = RequestStream(RID)
    s.deliver(_delta([1], cached=7), 100)
    s.deliver(_delta([2, 3]), 100)
    s.deliver(_delta([4]), 100)
    s.deliver(_finished(4), 100)
    items = _read_all(s)
    assert items[0] == TokenDelta(request_id=RID, token_ids=[1, 2, 3, 4], cached_tokens=7)
    assert isinstance(items[1], Finished) and len(items) == 2, "the end is never merged away"


def test_logprobs_stay_aligned_and_shapes_are_not_mixed() -> None:
    s = RequestStream(RID)
    for ids in ([1], [2, 3]):
        s.deliver(_delta(ids, logprobs=True), 100)
    s.deliver(_delta([4]), 100)  # NOTE: no logprobs: not merged with the ones before
    s.deliver(_finished(4), 100)
    first, second, end = _read_all(s)
    assert first.token_ids == [1, 2, 3]
    assert first.logprobs == [-1.0, -2.0, -3.0]
    assert first.top_logprobs == [[(1, -1.0)], [(2, -2.0)], [(3, -3.0)]]
    assert second.token_ids == [4] and second.logprobs is None
    assert isinstance(end, Finished)


def test_unread_bound_still_overflows_and_stops_delivering() -> None:
    s = RequestStream(RID)
    for i in range(3):
        s.deliver(_delta([i]), 2)
    s.deliver(_finished(3), 2)
    items = _read_all(s)
    assert items[0].token_ids == [0, 1], "what was queued before the bound is still handed out"
    assert isinstance(items[1], StreamOverflow) and len(items) == 2 and s.overflowed


def test_a_read_that_drains_the_queue_frees_the_bound() -> None:
    s = RequestStream(RID)

    async def go() -> None:
        for i in range(10):
            s.deliver(_delta([i]), 2)
            s.deliver(_delta([i]), 2)
            item = await s.next(1.0, 1.0, "w")
            assert item.token_ids == [i, i]
        assert not s.overflowed

    asyncio.run(go())


def test_timeouts_name_first_and_next() -> None:
    s = RequestStream(RID)

    async def go() -> tuple[object, object]:
        first = await s.next(0.01, 5.0, "w0")
        s.deliver(_delta([1]), 10)
        await s.next(5.0, 5.0, "w0")
        return first, await s.next(5.0, 0.01, "w0")

    first, idle = asyncio.run(go())
    assert isinstance(first, DispatchTimeout) and "no first token from w0" in str(first)
    assert isinstance(idle, DispatchTimeout) and "no next token from w0" in str(idle)


def test_a_waiting_reader_wakes_on_delivery() -> None:
    s = RequestStream(RID)

    async def go() -> object:
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, s.deliver, _delta([5]), 10)
        return await s.next(5.0, 5.0, "w")

    assert asyncio.run(go()).token_ids == [5]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 50), min_size=1, max_size=4),
                          st.booleans(), st.integers(0, 3)), min_size=1, max_size=30))
def test_any_interleaving_of_deliveries_and_reads_keeps_every_token_in_order(
    plan: list[tuple[list[int], bool, int]],
) -> None:
    """Deliveries (with or without logprobs) and reads in any order: the tokens read, and each
    token's logprob, are exactly the ones delivered, in order; shapes never mix in one item."""
    s = RequestStream(RID)
    sent: list[tuple[int, float | None]] = []
    got: list[tuple[int, float | None]] = []

    async def go() -> None:
        for ids, with_lp, reads in plan:
            d = _delta(ids, logprobs=with_lp)
            s.deliver(d, 10_000)
            sent.extend((t, -float(t) if with_lp else None) for t in ids)
            for _ in range(reads):
                if not s._items:
                    break
                item = await s.next(1.0, 1.0, "w")
                lps = item.logprobs if item.logprobs is not None else [None] * len(item.token_ids)
                assert len(lps) == len(item.token_ids)
                got.extend(zip(item.token_ids, lps, strict=True))
        s.deliver(_finished(len(sent)), 10_000)
        while not isinstance(item := await s.next(1.0, 1.0, "w"), Finished):
            lps = item.logprobs if item.logprobs is not None else [None] * len(item.token_ids)
            got.extend(zip(item.token_ids, lps, strict=True))

    asyncio.run(go())
    assert got == sent


def test_merge_sums_cached_tokens_of_the_first_delta_only_once() -> None:
    merged = merge_deltas([_delta([1], cached=16), _delta([2]), _delta([3])])
    assert merged.token_ids == [1, 2, 3] and merged.cached_tokens == 16


# ------------------------------------------------------------------ push


def test_push_takes_deltas_while_the_reader_waits_and_the_end_still_queues() -> None:
    s = RequestStream(RID)
    pushed: list[list[int]] = []
    s.push = lambda d: pushed.append(d.token_ids) is None

    async def go() -> object:
        reader = asyncio.ensure_future(s.next(1.0, 1.0, "w"))
        await asyncio.sleep(0)  # NOTE: the reader is parked now
        for i in range(3):
            s.deliver(_delta([i]), 100)
        assert not reader.done(), "a pushed delta does not wake the reader"
        s.deliver(_finished(3), 100)
        return await reader

    end = asyncio.run(go())
    assert pushed == [[0], [1], [2]] and isinstance(end, Finished) and s.started


def test_a_declined_push_queues_the_delta_and_nothing_overtakes_it() -> None:
    s = RequestStream(RID)
    ready = [False]
    pushed: list[list[int]] = []

    def push(d: TokenDelta) -> bool:
        if ready[0]:
            pushed.append(d.token_ids)
        return ready[0]

    s.push = push

    async def go() -> list[object]:
        reader = asyncio.ensure_future(s.next(1.0, 1.0, "w"))
        await asyncio.sleep(0)
        s.deliver(_delta([1]), 100)  # NOTE: declined: queued, wakes the reader
        ready[0] = True
        s.deliver(_delta([2]), 100)  # NOTE: queued too: [1] is not read yet
        first = await reader
        rest = asyncio.ensure_future(s.next(1.0, 1.0, "w"))
        await asyncio.sleep(0)
        s.deliver(_delta([3]), 100)  # NOTE: queue empty, reader parked: pushed
        s.deliver(_finished(3), 100)
        return [first, await rest]

    first, end = asyncio.run(go())
    assert first.token_ids == [1, 2] and pushed == [[3]] and isinstance(end, Finished)


def test_pushed_deltas_keep_the_idle_timer_from_firing() -> None:
    s = RequestStream(RID)
    s.push = lambda d: True
    s.deliver(_delta([0]), 100)  # NOTE: the first delta arrives before anybody reads

    async def go() -> tuple[object, float]:
        assert (await s.next(1.0, 0.2, "w")).token_ids == [0]
        loop = asyncio.get_running_loop()
        start = loop.time()
        reader = asyncio.ensure_future(s.next(1.0, 0.2, "w"))
        for i in range(8):  # NOTE: 0.4 s of pushes, twice the idle timeout
            await asyncio.sleep(0.05)
            s.deliver(_delta([i]), 100)
        assert not reader.done(), "pushes kept coming: no idle timeout"
        return await reader, loop.time() - start  # NOTE: then the timeout, 0.2 s after

    item, waited = asyncio.run(go())
    assert isinstance(item, DispatchTimeout) and "no next token" in str(item)
    assert waited >= 0.55, waited


def test_a_push_that_raises_is_dropped_and_the_delta_is_queued() -> None:
    s = RequestStream(RID)

    def push(d: TokenDelta) -> bool:
        raise ValueError("a consumer's bug")

    s.push = push

    async def go() -> object:
        reader = asyncio.ensure_future(s.next(1.0, 1.0, "w"))
        await asyncio.sleep(0)
        s.deliver(_delta([5]), 100)  # NOTE: must not raise into the worker's reader
        return await reader

    assert asyncio.run(go()).token_ids == [5] and s.push is None
