"""The ``SessionStore`` protocol: sessions keyed by (tenant, id), written by compare-and-set on
``Session.version``. Implementations: ``MemorySessionStore`` (bounded, one process) and
``RedisSessionStore`` (shared by gateway replicas, survives restarts)."""

from __future__ import annotations

from typing import Protocol

import msgspec

from sessions.model import Session, SessionPage

DEFAULT_MAX_SESSION_BYTES = 32 * 1024 * 1024
MAX_PAGE_SIZE = 100

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Session)


class SessionStore(Protocol):
    """Every method is keyed by (tenant, id): one tenant never sees another's sessions. Expired
    (idle past the store's TTL) or evicted sessions are gone, exactly as if deleted."""

    async def create(self, session: Session) -> Session:
        """Store a new session; returns it with ``version == 1``.

        Raises:
            VersionConflict: a session with this (tenant, id) exists.
            SessionTooLarge: it encodes to more than the store's per-session byte bound.
        """
        ...

    async def get(self, tenant: str, session_id: str) -> Session | None:
        """The session, or None; a hit counts as use (refreshes the idle TTL)."""
        ...

    async def put(self, session: Session) -> Session:
        """Replace the stored session if its version still equals ``session.version``; returns
        what was stored (``version + 1``).

        Raises:
            SessionNotFound: it no longer exists (deleted, expired, evicted).
            VersionConflict: someone else wrote it since it was read.
            SessionTooLarge: it encodes to more than the store's per-session byte bound.
        """
        ...

    async def delete(self, tenant: str, session_id: str) -> bool:
        """Remove it; False when there was nothing to remove."""
        ...

    async def list(self, tenant: str, after: str | None, limit: int) -> SessionPage:
        """Up to ``limit`` (<= ``MAX_PAGE_SIZE``) of the tenant's sessions with ids above
        ``after`` (None: from the first), ordered by id. A read, not a use: no TTL refresh."""
        ...

    async def ping(self) -> None:
        """Raises ``StoreUnavailable`` when the store cannot be reached."""
        ...

    async def get_affinity(self, key: str) -> str | None:
        """The worker an affinity key (a session, a routing header; tenant-prefixed by the
        caller) was last sent to, or None; a hit refreshes its idle TTL. Optional: the gateway
        routes without it when a store lacks it.

        Raises:
            StoreUnavailable: the store cannot be reached.
        """
        ...

    async def set_affinity(self, key: str, worker_id: str) -> None:
        """Record ``key``'s worker (bounded like the sessions: the store's idle TTL, and the
        memory store's LRU bound). Raises ``StoreUnavailable``."""
        ...

    async def close(self) -> None: ...


def encode_session(session: Session) -> bytes:
    return _ENCODER.encode(session)


def decode_session(data: bytes) -> Session:
    return _DECODER.decode(data)
