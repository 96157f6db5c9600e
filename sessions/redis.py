"""``RedisSessionStore``: sessions in a Redis server, shared by every gateway replica and kept
across restarts. One hash per session, ``{prefix}{tenant}:{id}`` -> ``{v: version, d: msgpack
Session}``, with a key TTL (the idle TTL) refreshed on every read and write, so abandoned
sessions go away by themselves. Compare-and-set is a Lua script (atomic on the server); it needs
nothing beyond a plain Redis (>= 2.6; also fine on a Redis Cluster: one key per script).

Every Redis failure surfaces as ``StoreUnavailable``.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
from redis import asyncio as aioredis
from redis.exceptions import RedisError

from sessions.errors import SessionNotFound, StoreUnavailable, VersionConflict
from sessions.model import Session
from sessions.store import decode_session, encode_session

DEFAULT_PREFIX = "agentgate:session:"
CONNECT_TIMEOUT_S = 5.0

# KEYS[1] = key; ARGV = version, data, ttl_ms. 1 = created, 0 = exists.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'v', ARGV[1], 'd', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
# KEYS[1] = key; ARGV = expected version, new version, data, ttl_ms.
# Returns 1 = written, -1 = missing, or the stored version (a string) on a mismatch.
_PUT = """
local v = redis.call('HGET', KEYS[1], 'v')
if not v then return -1 end
if v ~= ARGV[1] then return v end
redis.call('HSET', KEYS[1], 'v', ARGV[2], 'd', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
"""
# KEYS[1] = key; ARGV = ttl_ms. The data, its TTL refreshed; nil when missing.
_GET = """
local d = redis.call('HGET', KEYS[1], 'd')
if d then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return d
"""


class RedisSessionStore:
    """Args:
    client: a ``redis.asyncio.Redis`` with ``decode_responses=False``; closed by ``close``.
    idle_ttl_s: a session unused this long expires (the key's TTL).
    """

    def __init__(
        self, client: aioredis.Redis, idle_ttl_s: float = 3600.0, prefix: str = DEFAULT_PREFIX
    ) -> None:
        assert idle_ttl_s > 0, f"{idle_ttl_s=}: must be > 0"
        self.client = client
        self.idle_ttl_s = idle_ttl_s
        self.prefix = prefix
        self._ttl_ms = max(1, round(idle_ttl_s * 1000))
        self._create = client.register_script(_CREATE)
        self._put = client.register_script(_PUT)
        self._get = client.register_script(_GET)

    async def create(self, session: Session) -> Session:
        stored = msgspec.structs.replace(session, version=1)
        async with _unavailable_on_error():
            ok = await self._create(
                keys=[self.key(session.tenant, session.id)],
                args=[1, encode_session(stored), self._ttl_ms],
            )
        if not ok:
            raise VersionConflict(session.id, 0, None)
        return stored

    async def get(self, tenant: str, session_id: str) -> Session | None:
        async with _unavailable_on_error():
            data = await self._get(keys=[self.key(tenant, session_id)], args=[self._ttl_ms])
        return None if data is None else decode_session(data)

    async def put(self, session: Session) -> Session:
        stored = msgspec.structs.replace(session, version=session.version + 1)
        async with _unavailable_on_error():
            result = await self._put(
                keys=[self.key(session.tenant, session.id)],
                args=[session.version, stored.version, encode_session(stored), self._ttl_ms],
            )
        if result == -1:
            raise SessionNotFound(session.id)
        if result != 1:
            raise VersionConflict(session.id, session.version, int(result))
        return stored

    async def delete(self, tenant: str, session_id: str) -> bool:
        async with _unavailable_on_error():
            return bool(await self.client.delete(self.key(tenant, session_id)))

    async def close(self) -> None:
        await self.client.aclose()

    def key(self, tenant: str, session_id: str) -> str:
        # NOTE: tenant ids never contain ':' (gateway/tenancy.py), so keys cannot collide
        return f"{self.prefix}{tenant}:{session_id}"


async def connect_redis(
    url: str, idle_ttl_s: float = 3600.0, timeout_s: float = CONNECT_TIMEOUT_S
) -> RedisSessionStore:
    """A store on the Redis at ``url`` (``redis://[:password@]host:port/db``), checked with a
    PING.

    Raises:
        StoreUnavailable: a malformed URL, or no Redis answering there within ``timeout_s``.
    """
    try:
        client = aioredis.Redis.from_url(
            url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s
        )
    except ValueError as exc:
        raise StoreUnavailable(f"bad Redis URL {redacted(url)!r}: {exc}") from None
    try:
        await client.ping()
    except (RedisError, OSError) as exc:
        await client.aclose()
        raise StoreUnavailable(f"cannot reach Redis at {redacted(url)}: {exc}") from None
    return RedisSessionStore(client, idle_ttl_s)


def redacted(url: str) -> str:
    """``url`` without its password (safe to log)."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urllib.parse.urlunsplit(parts._replace(netloc=user + netloc))


@asynccontextmanager
async def _unavailable_on_error() -> AsyncIterator[None]:
    try:
        yield
    except (RedisError, OSError) as exc:
        raise StoreUnavailable(f"session store (Redis) failed: {exc}") from None
