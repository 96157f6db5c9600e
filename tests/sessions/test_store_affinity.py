"""Affinity keys in the session stores (memory and a real Redis): a key's worker is read back by
every client of the store, overwritten by a later decision, expires with the idle TTL, and the
memory store keeps at most ``max_sessions`` of them (least recently used dropped)."""

import asyncio

from sessions import MemorySessionStore
from tests.sessions.conftest import MakeStore


def test_an_affinity_key_is_read_back_and_overwritten(make_store: MakeStore) -> None:
    async def main() -> None:
        store = await make_store()
        try:
            assert await store.get_affinity("t-1/session:s1") is None
            await store.set_affinity("t-1/session:s1", "w0")
            assert await store.get_affinity("t-1/session:s1") == "w0"
            await store.set_affinity("t-1/session:s1", "w1")
            assert await store.get_affinity("t-1/session:s1") == "w1"
            assert await store.get_affinity("t-2/session:s1") is None, "another tenant's key"
        finally:
            await store.close()

    asyncio.run(main())


def test_an_affinity_key_expires_when_idle(make_store: MakeStore) -> None:
    async def main() -> None:
        store = await make_store(idle_ttl_s=0.2)
        try:
            await store.set_affinity("k", "w0")
            await asyncio.sleep(0.6)  # NOTE: only "gone after the TTL": no upper bound on time
            assert await store.get_affinity("k") is None
        finally:
            await store.close()

    asyncio.run(main())


def test_reading_an_affinity_key_keeps_it_alive() -> None:
    async def main() -> None:
        now = [0.0]
        store = MemorySessionStore(max_sessions=10, idle_ttl_s=10.0, clock=lambda: now[0])
        await store.set_affinity("k", "w0")
        for _ in range(5):
            now[0] += 8.0
            assert await store.get_affinity("k") == "w0"
        now[0] += 11.0
        assert await store.get_affinity("k") is None

    asyncio.run(main())


def test_the_memory_store_bounds_its_affinity_keys() -> None:
    async def main() -> None:
        store = MemorySessionStore(max_sessions=3)
        for i in range(3):
            await store.set_affinity(f"k{i}", f"w{i}")
        assert await store.get_affinity("k0") == "w0"  # NOTE: k1 is now the least recent
        await store.set_affinity("k3", "w3")
        assert store.num_affinity_keys == 3
        assert await store.get_affinity("k1") is None
        assert [await store.get_affinity(k) for k in ("k0", "k2", "k3")] == ["w0", "w2", "w3"]

    asyncio.run(main())
