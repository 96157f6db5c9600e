"""``MemorySessionStore``: sessions in this process, bounded three ways: at most
``max_sessions`` and at most ``max_bytes`` in all (least recently used evicted first), none over
``max_session_bytes`` (refused, ``SessionTooLarge``), and none idle longer than ``idle_ttl_s``.
Sizes are the msgpack encoding's, the same bytes the Redis store would keep. Affinity keys
(``get_affinity``/``set_affinity``: a key's worker) are bounded by ``max_sessions`` and
``idle_ttl_s`` too. Not shared between
gateway replicas and lost on restart: use ``RedisSessionStore`` for either."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import msgspec

from sessions.errors import SessionNotFound, SessionTooLarge, VersionConflict
from sessions.model import Session, SessionPage
from sessions.store import DEFAULT_MAX_SESSION_BYTES, MAX_PAGE_SIZE, encode_session

DEFAULT_MAX_BYTES = 1024 * 1024 * 1024

_Key = tuple[str, str]


class _Entry(NamedTuple):
    session: Session
    last_used: float
    size_bytes: int


class MemorySessionStore:
    """Event-loop only (no locks): every method finishes without awaiting, so a
    compare-and-set cannot interleave with another write."""

    def __init__(
        self,
        max_sessions: int = 10_000,
        idle_ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_session_bytes: int = DEFAULT_MAX_SESSION_BYTES,
    ) -> None:
        assert max_sessions > 0 and idle_ttl_s > 0, f"{max_sessions=}, {idle_ttl_s=}: must be > 0"
        assert 0 < max_session_bytes <= max_bytes, f"{max_session_bytes=}, {max_bytes=}"
        self.max_sessions = max_sessions
        self.idle_ttl_s = idle_ttl_s
        self.max_bytes = max_bytes
        self.max_session_bytes = max_session_bytes
        self._clock = clock
        # NOTE: ordered by last use, oldest first, so both eviction and expiry pop from the front
        self._entries: OrderedDict[_Key, _Entry] = OrderedDict()
        self.num_bytes = 0
        self.num_evicted = 0
        self.num_expired = 0
        # NOTE: affinity key -> (worker id, last use); LRU first, bounded by max_sessions
        self._affinity: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    async def create(self, session: Session) -> Session:
        self._expire()
        key = (session.tenant, session.id)
        if key in self._entries:
            raise VersionConflict(session.id, 0, self._entries[key].session.version)
        stored = msgspec.structs.replace(session, version=1)
        self._store(key, stored, self._size_of(stored))
        return stored

    async def get(self, tenant: str, session_id: str) -> Session | None:
        self._expire()
        entry = self._entries.get((tenant, session_id))
        if entry is None:
            return None
        self._store((tenant, session_id), entry.session, entry.size_bytes)
        return entry.session

    async def put(self, session: Session) -> Session:
        self._expire()
        key = (session.tenant, session.id)
        entry = self._entries.get(key)
        if entry is None:
            raise SessionNotFound(session.id)
        if entry.session.version != session.version:
            raise VersionConflict(session.id, session.version, entry.session.version)
        stored = msgspec.structs.replace(session, version=session.version + 1)
        self._store(key, stored, self._size_of(stored))
        return stored

    async def delete(self, tenant: str, session_id: str) -> bool:
        self._expire()
        return self._drop((tenant, session_id))

    async def list(self, tenant: str, after: str | None, limit: int) -> SessionPage:
        self._expire()
        assert 0 < limit <= MAX_PAGE_SIZE, f"{limit=}"
        ids = sorted(i for t, i in self._entries if t == tenant and (after is None or i > after))
        page = [self._entries[(tenant, i)].session.summary() for i in ids[:limit]]
        return SessionPage(data=page, has_more=len(ids) > limit)

    async def ping(self) -> None:
        return None

    async def get_affinity(self, key: str) -> str | None:
        self._expire_affinity()
        entry = self._affinity.get(key)
        if entry is None:
            return None
        self._affinity[key] = (entry[0], self._clock())
        self._affinity.move_to_end(key)
        return entry[0]

    async def set_affinity(self, key: str, worker_id: str) -> None:
        self._expire_affinity()
        self._affinity[key] = (worker_id, self._clock())
        self._affinity.move_to_end(key)
        while len(self._affinity) > self.max_sessions:
            self._affinity.popitem(last=False)

    @property
    def num_affinity_keys(self) -> int:
        return len(self._affinity)

    async def close(self) -> None:
        self._entries.clear()
        self._affinity.clear()
        self.num_bytes = 0

    def _size_of(self, session: Session) -> int:
        size = len(encode_session(session))
        if size > self.max_session_bytes:
            raise SessionTooLarge(session.id, size, self.max_session_bytes)
        return size

    def _store(self, key: _Key, session: Session, size_bytes: int) -> None:
        """Insert or replace ``key`` as the most recently used; evict the least recently used
        others beyond the bounds."""
        self._drop(key)
        self._entries[key] = _Entry(session, self._clock(), size_bytes)
        self.num_bytes += size_bytes
        while len(self._entries) > self.max_sessions or self.num_bytes > self.max_bytes:
            oldest = next(iter(self._entries))
            if oldest == key:
                break  # NOTE: cannot happen (max_session_bytes <= max_bytes), kept as a guard
            self._drop(oldest)
            self.num_evicted += 1

    def _drop(self, key: _Key) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.num_bytes -= entry.size_bytes
        return True

    def _expire_affinity(self) -> None:
        deadline = self._clock() - self.idle_ttl_s
        while self._affinity:
            key, (_, last_used) = next(iter(self._affinity.items()))
            if last_used > deadline:
                return
            del self._affinity[key]

    def _expire(self) -> None:
        deadline = self._clock() - self.idle_ttl_s
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.last_used > deadline:
                return
            self._drop(key)
            self.num_expired += 1
