"""``RedisSessionStore``: sessions in a Redis server, shared by every gateway replica and kept
across restarts. One hash per session, ``{prefix}{tenant}:{id}`` -> ``{v: version, d: msgpack
Session}``, with a key TTL (the idle TTL) refreshed on every read and write, so abandoned
sessions go away by themselves. Compare-and-set is a Lua script (atomic on the server); it needs
nothing beyond a plain Redis (>= 2.6; also fine on a Redis Cluster: one key per script). The hash
also holds ``m``, the msgpack ``SessionSummary`` that ``list`` reads, so a page never decodes
whole sessions.

A tenant's sessions are listed from an index, a sorted set ``{prefix}@index:{tenant}`` of ids
(all scored 0, so ``ZRANGEBYLEX`` pages them by id), kept beside the sessions: added on every
write, removed on delete, its TTL refreshed on every write; ids whose session expired are
dropped when a listing meets them. A session is at most ``max_session_bytes`` encoded
(``SessionTooLarge``). Affinity keys (a session's or a routing key's worker, shared by the
gateway replicas) are plain strings ``{prefix}@affinity:{key}`` with the same idle TTL.

Every Redis failure surfaces as ``StoreUnavailable``.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
from redis import asyncio as aioredis
from redis.exceptions import RedisError

from sessions.errors import SessionNotFound, SessionTooLarge, StoreUnavailable, VersionConflict
from sessions.model import Session, SessionPage, SessionSummary
from sessions.store import (
    DEFAULT_MAX_SESSION_BYTES,
    MAX_PAGE_SIZE,
    decode_session,
    encode_session,
)

DEFAULT_PREFIX = "agentgate:session:"
CONNECT_TIMEOUT_S = 5.0
PING_TIMEOUT_S = 2.0
_MAX_LIST_ROUNDS = 8  # NOTE: each round drops the expired ids it met; bounds a listing's work
_SUMMARY_ENCODER = msgspec.msgpack.Encoder()
_SUMMARY_DECODER = msgspec.msgpack.Decoder(SessionSummary)

# KEYS[1] = key; ARGV = version, data, ttl_ms, summary. 1 = created, 0 = exists.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'v', ARGV[1], 'd', ARGV[2], 'm', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
# KEYS[1] = key; ARGV = expected version, new version, data, ttl_ms, summary.
# Returns 1 = written, -1 = missing, or the stored version (a string) on a mismatch.
_PUT = """
local v = redis.call('HGET', KEYS[1], 'v')
if not v then return -1 end
if v ~= ARGV[1] then return v end
redis.call('HSET', KEYS[1], 'v', ARGV[2], 'd', ARGV[3], 'm', ARGV[5])
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
        self,
        client: aioredis.Redis,
        idle_ttl_s: float = 3600.0,
        prefix: str = DEFAULT_PREFIX,
        *,
        max_session_bytes: int = DEFAULT_MAX_SESSION_BYTES,
    ) -> None:
        assert idle_ttl_s > 0 and max_session_bytes > 0, f"{idle_ttl_s=}, {max_session_bytes=}"
        self.client = client
        self.idle_ttl_s = idle_ttl_s
        self.prefix = prefix
        self.max_session_bytes = max_session_bytes
        self._ttl_ms = max(1, round(idle_ttl_s * 1000))
        self._create = client.register_script(_CREATE)
        self._put = client.register_script(_PUT)
        self._get = client.register_script(_GET)

    async def create(self, session: Session) -> Session:
        stored = msgspec.structs.replace(session, version=1)
        data = self._encode(stored)
        async with _unavailable_on_error():
            ok = await self._create(
                keys=[self.key(session.tenant, session.id)],
                args=[1, data, self._ttl_ms, _SUMMARY_ENCODER.encode(stored.summary())],
            )
            if not ok:
                raise VersionConflict(session.id, 0, None)
            # NOTE: not in the script: the index is another key (another Cluster slot)
            index = self.index_key(session.tenant)
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.zadd(index, {session.id: 0})
                pipe.pexpire(index, self._ttl_ms)
                await pipe.execute()
        return stored

    async def get(self, tenant: str, session_id: str) -> Session | None:
        async with _unavailable_on_error():
            data = await self._get(keys=[self.key(tenant, session_id)], args=[self._ttl_ms])
        return None if data is None else decode_session(data)

    async def put(self, session: Session) -> Session:
        stored = msgspec.structs.replace(session, version=session.version + 1)
        data = self._encode(stored)
        summary = _SUMMARY_ENCODER.encode(stored.summary())
        async with _unavailable_on_error(), self.client.pipeline(transaction=False) as pipe:
            await self._put(
                keys=[self.key(session.tenant, session.id)],
                args=[session.version, stored.version, data, self._ttl_ms, summary], client=pipe,
            )
            # NOTE: re-added on every write: an index entry lost between create's two steps
            # comes back (an id whose session is gone is dropped by the next listing)
            pipe.zadd(self.index_key(session.tenant), {session.id: 0})
            pipe.pexpire(self.index_key(session.tenant), self._ttl_ms)
            result, _, _ = await pipe.execute()
        if result == -1:
            raise SessionNotFound(session.id)
        if result != 1:
            raise VersionConflict(session.id, session.version, int(result))
        return stored

    async def delete(self, tenant: str, session_id: str) -> bool:
        async with _unavailable_on_error(), self.client.pipeline(transaction=False) as pipe:
            pipe.delete(self.key(tenant, session_id))
            pipe.zrem(self.index_key(tenant), session_id)
            deleted, _ = await pipe.execute()
        return bool(deleted)

    async def list(self, tenant: str, after: str | None, limit: int) -> SessionPage:
        assert 0 < limit <= MAX_PAGE_SIZE, f"{limit=}"
        found: list[SessionSummary] = []
        start = "-" if after is None else f"({after}"
        async with _unavailable_on_error():
            for _ in range(_MAX_LIST_ROUNDS):
                ids = await self.client.zrangebylex(
                    self.index_key(tenant), start, "+", start=0, num=limit + 1 - len(found)
                )
                summaries = await self._summaries(tenant, ids)
                found.extend(s for s in summaries if s is not None)
                if len(found) > limit or len(ids) < limit + 1 - len(found) or not ids:
                    break
                start = f"({ids[-1].decode()}"
        return SessionPage(data=found[:limit], has_more=len(found) > limit)

    async def ping(self) -> None:
        async with _unavailable_on_error():
            await asyncio.wait_for(self.client.ping(), PING_TIMEOUT_S)

    async def get_affinity(self, key: str) -> str | None:
        async with _unavailable_on_error(), self.client.pipeline(transaction=False) as pipe:
            pipe.get(self.affinity_key(key))
            pipe.pexpire(self.affinity_key(key), self._ttl_ms)
            value, _ = await pipe.execute()
        return None if value is None else value.decode()

    async def set_affinity(self, key: str, worker_id: str) -> None:
        async with _unavailable_on_error():
            await self.client.set(self.affinity_key(key), worker_id, px=self._ttl_ms)

    async def close(self) -> None:
        await self.client.aclose()

    def key(self, tenant: str, session_id: str) -> str:
        # NOTE: tenant ids never contain ':' (gateway/tenancy.py), so keys cannot collide
        return f"{self.prefix}{tenant}:{session_id}"

    def affinity_key(self, key: str) -> str:
        # NOTE: '@' is in no tenant id, so no session key is an affinity key
        return f"{self.prefix}@affinity:{key}"

    def index_key(self, tenant: str) -> str:
        # NOTE: '@' is in no tenant id, so no session key is an index key
        return f"{self.prefix}@index:{tenant}"

    def _encode(self, session: Session) -> bytes:
        data = encode_session(session)
        if len(data) > self.max_session_bytes:
            raise SessionTooLarge(session.id, len(data), self.max_session_bytes)
        return data

    async def _summaries(self, tenant: str, ids: list[bytes]) -> list[SessionSummary | None]:
        """The summaries of ``ids``; the ids whose session is gone leave the index."""
        if not ids:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.hget(self.key(tenant, i.decode()), "m")
            raw = await pipe.execute()
        gone = [i for i, m in zip(ids, raw, strict=True) if m is None]
        if gone:
            await self.client.zrem(self.index_key(tenant), *gone)
        return [None if m is None else _SUMMARY_DECODER.decode(m) for m in raw]


async def connect_redis(
    url: str,
    idle_ttl_s: float = 3600.0,
    timeout_s: float = CONNECT_TIMEOUT_S,
    *,
    max_session_bytes: int = DEFAULT_MAX_SESSION_BYTES,
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
    return RedisSessionStore(client, idle_ttl_s, max_session_bytes=max_session_bytes)


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
    except (RedisError, OSError, TimeoutError) as exc:
        raise StoreUnavailable(f"session store (Redis) failed: {exc!r}") from None
