"""``MemorySessionStore``: sessions in this process, bounded twice: at most ``max_sessions``
(least recently used evicted first) and none idle longer than ``idle_ttl_s``. Not shared between
gateway replicas and lost on restart: use ``RedisSessionStore`` for either."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec

from sessions.errors import SessionNotFound, VersionConflict
from sessions.model import Session

_Key = tuple[str, str]


class MemorySessionStore:
    """Event-loop only (no locks): every method finishes without awaiting, so a
    compare-and-set cannot interleave with another write."""

    def __init__(
        self,
        max_sessions: int = 10_000,
        idle_ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert max_sessions > 0 and idle_ttl_s > 0, f"{max_sessions=}, {idle_ttl_s=}: must be > 0"
        self.max_sessions = max_sessions
        self.idle_ttl_s = idle_ttl_s
        self._clock = clock
        # NOTE: ordered by last use, oldest first, so both eviction and expiry pop from the front
        self._entries: OrderedDict[_Key, tuple[Session, float]] = OrderedDict()
        self.num_evicted = 0
        self.num_expired = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    async def create(self, session: Session) -> Session:
        self._expire()
        key = (session.tenant, session.id)
        if key in self._entries:
            raise VersionConflict(session.id, 0, self._entries[key][0].version)
        stored = msgspec.structs.replace(session, version=1)
        self._entries[key] = (stored, self._clock())
        while len(self._entries) > self.max_sessions:
            self._entries.popitem(last=False)
            self.num_evicted += 1
        return stored

    async def get(self, tenant: str, session_id: str) -> Session | None:
        self._expire()
        entry = self._entries.get((tenant, session_id))
        if entry is None:
            return None
        self._touch((tenant, session_id), entry[0])
        return entry[0]

    async def put(self, session: Session) -> Session:
        self._expire()
        key = (session.tenant, session.id)
        entry = self._entries.get(key)
        if entry is None:
            raise SessionNotFound(session.id)
        if entry[0].version != session.version:
            raise VersionConflict(session.id, session.version, entry[0].version)
        stored = msgspec.structs.replace(session, version=session.version + 1)
        self._touch(key, stored)
        return stored

    async def delete(self, tenant: str, session_id: str) -> bool:
        self._expire()
        return self._entries.pop((tenant, session_id), None) is not None

    async def close(self) -> None:
        self._entries.clear()

    def _touch(self, key: _Key, session: Session) -> None:
        self._entries[key] = (session, self._clock())
        self._entries.move_to_end(key)

    def _expire(self) -> None:
        deadline = self._clock() - self.idle_ttl_s
        while self._entries:
            key, (_, last_used) = next(iter(self._entries.items()))
            if last_used > deadline:
                return
            del self._entries[key]
            self.num_expired += 1
