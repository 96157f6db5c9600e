"""``RedisSessionStore`` specifics, on a real redis-server: sessions outlive the store object
(a gateway restart needs no re-tokenization: prompt ids come back), keys carry a TTL, and an
unreachable Redis is a clear ``StoreUnavailable`` (password never shown)."""

import asyncio
import uuid

import msgspec
import pytest

from sessions import StoreUnavailable, create_session_store, new_session
from sessions.redis import connect_redis, redacted


def test_sessions_survive_a_new_store_with_their_prompt_ids(redis_url: str) -> None:
    prefix = f"test:{uuid.uuid4().hex}:"

    async def body() -> None:
        first = await connect_redis(redis_url)
        first.prefix = prefix
        session = new_session("t-a", "demo", session_id="s", messages=[{"role": "user",
                                                                        "content": "hi"}])
        session = msgspec.structs.replace(session, prompt_ids=[5, 6, 7], prompt_num_messages=1)
        await first.create(session)
        await first.close()
        second = await create_session_store(redis_url)
        second.prefix = prefix  # type: ignore[attr-defined]
        got = await second.get("t-a", "s")
        assert got is not None and got.prompt_ids == [5, 6, 7] and got.version == 1, got
        await second.close()

    asyncio.run(body())


def test_keys_have_the_idle_ttl(redis_url: str) -> None:
    async def body() -> None:
        store = await connect_redis(redis_url, idle_ttl_s=120)
        store.prefix = f"test:{uuid.uuid4().hex}:"
        await store.create(new_session("t-a", "demo", session_id="s"))
        ttl_ms = await store.client.pttl(store.key("t-a", "s"))
        assert 110_000 < ttl_ms <= 120_000, ttl_ms
        await store.close()

    asyncio.run(body())


def test_unreachable_redis_is_a_clear_error() -> None:
    with pytest.raises(StoreUnavailable, match=r"cannot reach Redis at redis://:\*\*\*@127"):
        asyncio.run(connect_redis("redis://:secret@127.0.0.1:1/0", timeout_s=2))
    with pytest.raises(StoreUnavailable, match="bad Redis URL"):
        asyncio.run(connect_redis("http://nope"))


def test_redacted_hides_only_the_password() -> None:
    assert redacted("redis://u:pw@h:1/0") == "redis://u:***@h:1/0"
    assert redacted("redis://h:1/0") == "redis://h:1/0"
