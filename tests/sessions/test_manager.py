"""``SessionManager`` turn rules on both stores: one turn at a time (a live lease is a
``TurnInProgress``, a stale one is taken over), finish appends the client's messages, the answer
and a record; abort appends nothing; tool results must answer pending calls."""

import asyncio

import pytest

from sessions import (
    InvalidMessages,
    SessionManager,
    TurnInProgress,
    TurnRecord,
    TurnUsage,
    pending_tool_calls,
)
from tests.sessions.conftest import MakeStore

USER = {"role": "user", "content": "hi"}
CALLS = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
    {"id": "b", "type": "function", "function": {"name": "f", "arguments": "{}"}},
]}


class _Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def _record() -> TurnRecord:
    usage = TurnUsage(prompt_tokens=5, completion_tokens=1)
    return TurnRecord(index=0, request_id="r", first_message=0, num_messages=1,
                      finish_reason="stop", usage=usage)


def test_one_turn_at_a_time_and_what_finish_records(make_store: MakeStore) -> None:
    async def body() -> None:
        clock = _Clock()
        manager = SessionManager(await make_store(), turn_lease_s=60, clock=clock)
        session = await manager.create("t", "demo", system="s")
        leased = await manager.begin_turn("t", session.id, [USER], "r1")
        with pytest.raises(TurnInProgress):
            await manager.begin_turn("t", session.id, [USER], "r2")
        answer = {"role": "assistant", "content": "yo"}
        done = await manager.finish_turn(leased, [USER], answer, _record(), [1, 2], 2)
        assert done is not None and done.messages == [USER, answer] and done.running is None
        assert done.turns[0].first_message == 0 and done.prompt_ids == [1, 2]
        leased = await manager.begin_turn("t", session.id, [USER], "r3")
        await manager.abort_turn(leased)
        after = await manager.get("t", session.id)
        assert after.messages == done.messages and after.running is None, after
        stuck = await manager.begin_turn("t", session.id, [USER], "r4")
        clock.now += 61  # NOTE: the lease of r4 went stale (its gateway died)
        taken = await manager.begin_turn("t", session.id, [USER], "r5")
        assert await manager.finish_turn(stuck, [USER], answer, _record(), [], 0) is None
        assert (await manager.finish_turn(taken, [USER], answer, _record(), [], 0)) is not None
        await manager.store.close()

    asyncio.run(body())


def test_tool_results_answer_pending_calls(make_store: MakeStore) -> None:
    async def body() -> None:
        manager = SessionManager(await make_store())
        session = await manager.create("t", "demo", messages=[USER, CALLS])
        assert pending_tool_calls(session.messages) == ["a", "b"]
        tool_a = {"role": "tool", "tool_call_id": "a", "content": "1"}
        for new, param in [
            ([{"role": "tool", "tool_call_id": "z", "content": "1"}], "messages[0].tool_call_id"),
            ([tool_a], "messages"),  # "b" unanswered
            ([tool_a, USER], "messages[1]"),
            ([tool_a, tool_a], "messages[1].tool_call_id"),
        ]:
            with pytest.raises(InvalidMessages) as info:
                await manager.begin_turn("t", session.id, new, "r")
            assert info.value.param == param, (new, info.value)
        tool_b = {"role": "tool", "tool_call_id": "b", "content": "2"}
        assert (await manager.begin_turn("t", session.id, [tool_b, tool_a], "r")).running
        with pytest.raises(InvalidMessages, match="role"):
            await manager.create("t", "demo", messages=[{"role": "system", "content": "x"}])
        await manager.store.close()

    asyncio.run(body())
