"""The ``SessionStore`` protocol: sessions keyed by (tenant, id), written by compare-and-set on
``Session.version``. Implementations: ``MemorySessionStore`` (bounded, one process) and
``RedisSessionStore`` (shared by gateway replicas, survives restarts)."""

from __future__ import annotations

from typing import Protocol

import msgspec

from sessions.model import Session

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Session)


class SessionStore(Protocol):
    """Every method is keyed by (tenant, id): one tenant never sees another's sessions. Expired
    (idle past the store's TTL) or evicted sessions are gone, exactly as if deleted."""

    async def create(self, session: Session) -> Session:
        """Store a new session; returns it with ``version == 1``.

        Raises:
            VersionConflict: a session with this (tenant, id) exists.
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
        """
        ...

    async def delete(self, tenant: str, session_id: str) -> bool:
        """Remove it; False when there was nothing to remove."""
        ...

    async def close(self) -> None: ...


def encode_session(session: Session) -> bytes:
    return _ENCODER.encode(session)


def decode_session(data: bytes) -> Session:
    return _DECODER.decode(data)
