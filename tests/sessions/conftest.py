"""``make_store``: the same behavioural tests run against every ``SessionStore`` (memory and a
real Redis). Stores bind to an event loop, so the fixture is a factory called inside it."""

import uuid
from collections.abc import Awaitable, Callable

import pytest

from sessions import MemorySessionStore, SessionStore
from sessions.redis import connect_redis

MakeStore = Callable[..., Awaitable[SessionStore]]


@pytest.fixture(params=["memory", "redis"])
def make_store(request: pytest.FixtureRequest) -> MakeStore:
    if request.param == "memory":

        async def make_memory(idle_ttl_s: float = 3600.0) -> SessionStore:
            return MemorySessionStore(max_sessions=1000, idle_ttl_s=idle_ttl_s)

        return make_memory
    url = request.getfixturevalue("redis_url")

    async def make_redis(idle_ttl_s: float = 3600.0) -> SessionStore:
        store = await connect_redis(url, idle_ttl_s=idle_ttl_s)
        store.prefix = f"test:{uuid.uuid4().hex}:"  # NOTE: each test its own key space
        return store

    return make_redis
