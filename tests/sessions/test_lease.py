"""Turn leases against a real Redis the test controls: a renewed lease keeps its turn past the
lease time, a stale owner cannot clobber the turn that took over, and a finish during a Redis
freeze or a short outage is retried until Redis answers (bounded: past the retry window it is
``StoreUnavailable``)."""

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sessions import SessionManager, StoreUnavailable, TurnInProgress, TurnRecord, TurnUsage
from sessions.redis import connect_redis
from tests.sessions.redis_server import RedisServer, redis_server

USER = {"role": "user", "content": "hi"}
ANSWER = {"role": "assistant", "content": "yo"}
FREEZE_S = 8.0
SOCKET_TIMEOUT_S = 2.0  # NOTE: a frozen Redis fails each command after this


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path) as server:
        yield server


def _record() -> TurnRecord:
    return TurnRecord(index=0, request_id="r", first_message=0, num_messages=1,
                      finish_reason="stop", usage=TurnUsage(prompt_tokens=5, completion_tokens=1))


async def _manager(redis: RedisServer, **kw: float) -> SessionManager:
    store = await connect_redis(redis.url, timeout_s=SOCKET_TIMEOUT_S)
    return SessionManager(store, **kw)


def test_a_renewed_lease_outlives_the_lease_time(redis: RedisServer) -> None:
    async def body() -> None:
        manager = await _manager(redis, turn_lease_s=1.0)
        session = await manager.create("t", "demo")
        leased = await manager.begin_turn("t", session.id, [USER], "r1")
        for _ in range(4):  # NOTE: 2 s in all, twice the lease
            await asyncio.sleep(0.5)
            assert await manager.renew_turn(leased)
        with pytest.raises(TurnInProgress):
            await manager.begin_turn("t", session.id, [USER], "r2")
        await asyncio.sleep(1.2)  # NOTE: no renewal: it expires, the next turn takes over
        taken = await manager.begin_turn("t", session.id, [USER], "r3")
        assert manager.stats.turns_taken_over == 1
        assert not await manager.renew_turn(leased), "a stale owner cannot renew"
        assert await manager.finish_turn(leased, [USER], ANSWER, _record(), [], 0) is None
        done = await manager.finish_turn(taken, [USER], ANSWER, _record(), [], 0)
        assert done is not None and [t.request_id for t in done.turns] == ["r"], done
        assert done.running is None
        await manager.store.close()

    asyncio.run(body())


def test_a_finish_during_a_redis_freeze_is_recorded_when_it_thaws(redis: RedisServer) -> None:
    async def body() -> None:
        manager = await _manager(redis)
        session = await manager.create("t", "demo")
        leased = await manager.begin_turn("t", session.id, [USER], "r1")
        redis.freeze()
        thaw = threading.Timer(FREEZE_S, redis.thaw)
        thaw.start()
        try:
            t0 = time.monotonic()
            done = await manager.finish_turn(leased, [USER], ANSWER, _record(), [1], 1)
            waited_s = time.monotonic() - t0
        finally:
            thaw.join()
        assert done is not None and done.messages == [USER, ANSWER], done
        assert waited_s >= FREEZE_S - 1, f"recorded after {waited_s:.1f} s, inside the freeze?"
        again = await manager.begin_turn("t", session.id, [USER], "r2")
        assert again.running is not None and again.running.request_id == "r2"
        await manager.store.close()

    asyncio.run(body())


def test_a_finish_survives_a_short_outage_and_gives_up_after_the_retry_window(
    redis: RedisServer,
) -> None:
    async def body() -> None:
        manager = await _manager(redis, write_retry_s=4.0)
        session = await manager.create("t", "demo")
        leased = await manager.begin_turn("t", session.id, [USER], "r1")
        redis.freeze()
        restart = threading.Timer(3.0, redis.thaw)  # NOTE: a 3 s outage
        restart.start()
        try:
            done = await manager.finish_turn(leased, [USER], ANSWER, _record(), [], 0)
        finally:
            restart.join()
        assert done is not None and done.running is None, done

        leased = await manager.begin_turn("t", session.id, [USER], "r2")
        redis.kill()
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await manager.finish_turn(leased, [USER], ANSWER, _record(), [], 0)
        assert 3.5 < time.monotonic() - t0 < 30, "retried for the window, then gave up"
        assert manager.stats.turns_unrecorded == 1
        await manager.store.close()

    asyncio.run(body())
