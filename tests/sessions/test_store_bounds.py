"""Store bounds in bytes and listing, on both stores: a session over the per-session byte bound
is refused (``SessionTooLarge``) and nothing is stored; the memory store evicts the least
recently used sessions to stay under its total bytes; ``list`` pages a tenant's sessions by id and
never shows another tenant's; the Redis index forgets expired sessions."""

import asyncio
import time
import uuid

import msgspec
import pytest

from sessions import MemorySessionStore, SessionTooLarge, new_session
from sessions.redis import connect_redis
from tests.sessions.conftest import MakeStore

BIG = "x" * 40_000


def test_a_session_over_the_byte_bound_is_refused(make_store: MakeStore) -> None:
    async def body() -> None:
        store = await make_store()
        store.max_session_bytes = 10_000  # type: ignore[attr-defined]
        big = new_session("t", "m", messages=[{"role": "user", "content": BIG}])
        with pytest.raises(SessionTooLarge) as info:
            await store.create(big)
        assert info.value.param == "messages" and "10000" in info.value.message
        assert await store.get("t", big.id) is None
        small = await store.create(new_session("t", "m"))
        grown = msgspec.structs.replace(small, messages=[{"role": "user", "content": BIG}])
        with pytest.raises(SessionTooLarge):
            await store.put(grown)
        assert (await store.get("t", small.id)).messages == []  # type: ignore[union-attr]
        await store.close()

    asyncio.run(body())


def test_memory_store_evicts_least_recently_used_by_bytes() -> None:
    async def body() -> None:
        store = MemorySessionStore(max_bytes=100_000, max_session_bytes=50_000)
        ids = []
        for _ in range(3):
            s = new_session("t", "m", messages=[{"role": "user", "content": BIG}])
            ids.append((await store.create(s)).id)
        assert store.num_bytes <= 100_000 and store.num_evicted == 1, store.num_bytes
        assert await store.get("t", ids[0]) is None, "the oldest went first"
        assert await store.get("t", ids[2]) is not None
        await store.delete("t", ids[2])
        await store.delete("t", ids[1])
        assert store.num_bytes == 0 and len(store) == 0

    asyncio.run(body())


def test_list_pages_by_id_within_one_tenant(make_store: MakeStore) -> None:
    async def body() -> None:
        store = await make_store()
        mine = sorted([(await store.create(new_session("t-a", "m", metadata={"i": str(i)}))).id
                       for i in range(5)])
        theirs = (await store.create(new_session("t-b", "m"))).id
        first = await store.list("t-a", None, 2)
        assert [s.id for s in first.data] == mine[:2] and first.has_more, first
        second = await store.list("t-a", first.data[-1].id, 2)
        third = await store.list("t-a", second.data[-1].id, 2)
        assert [s.id for s in second.data + third.data] == mine[2:] and not third.has_more
        everything = await store.list("t-a", None, 100)
        assert theirs not in [s.id for s in everything.data] and len(everything.data) == 5
        assert [s.id for s in (await store.list("t-b", None, 100)).data] == [theirs]
        await store.delete("t-a", mine[0])
        assert [s.id for s in (await store.list("t-a", None, 100)).data] == mine[1:]
        await store.ping()
        await store.close()

    asyncio.run(body())


def test_redis_index_forgets_expired_sessions(redis_url: str) -> None:
    async def body() -> None:
        store = await connect_redis(redis_url, idle_ttl_s=0.5)
        store.prefix = f"test:{uuid.uuid4().hex}:"
        await store.create(new_session("t", "m"))
        time.sleep(1.0)
        kept = await store.create(new_session("t", "m"))  # NOTE: refreshes the index's TTL
        page = await store.list("t", None, 10)
        assert [s.id for s in page.data] == [kept.id], page
        assert await store.client.zcard(store.index_key("t")) == 1
        await store.close()

    asyncio.run(body())
