"""Agent sessions: the session model, session stores (memory, Redis), tool-call tracking,
incremental prompts and the turn rules (``SessionManager``). Imports only ``engine.protocol``
below it; never litestar or the gateway. ``sessions.redis`` (the Redis store) is imported on
demand, so the memory store does not need the redis package loaded."""

from sessions.errors import (
    InvalidMessages,
    SessionError,
    SessionNotFound,
    SessionTooLarge,
    StoreUnavailable,
    TurnInProgress,
    VersionConflict,
)
from sessions.manager import SessionManager
from sessions.memory import MemorySessionStore
from sessions.model import (
    Message,
    Session,
    SessionPage,
    SessionSummary,
    TurnLease,
    TurnRecord,
    TurnUsage,
    new_session,
)
from sessions.prompt import SessionPrompter, TurnPrompt
from sessions.store import DEFAULT_MAX_SESSION_BYTES, MAX_PAGE_SIZE, SessionStore
from sessions.tools import check_appended, pending_tool_calls

__all__ = [
    "DEFAULT_MAX_SESSION_BYTES",
    "MAX_PAGE_SIZE",
    "InvalidMessages",
    "MemorySessionStore",
    "Message",
    "Session",
    "SessionError",
    "SessionManager",
    "SessionNotFound",
    "SessionPage",
    "SessionPrompter",
    "SessionStore",
    "SessionSummary",
    "SessionTooLarge",
    "StoreUnavailable",
    "TurnInProgress",
    "TurnLease",
    "TurnPrompt",
    "TurnRecord",
    "TurnUsage",
    "VersionConflict",
    "check_appended",
    "create_session_store",
    "new_session",
    "pending_tool_calls",
]


async def create_session_store(
    redis_url: str | None,
    *,
    max_sessions: int = 10_000,
    idle_ttl_s: float = 3600.0,
    max_session_bytes: int = DEFAULT_MAX_SESSION_BYTES,
    max_bytes: int | None = None,
) -> SessionStore:
    """The Redis store at ``redis_url`` (checked with a PING; ``StoreUnavailable`` if not
    reachable), or a ``MemorySessionStore`` when it is None (``max_bytes``: its total bound,
    None for the default)."""
    if redis_url is None:
        total = {} if max_bytes is None else {"max_bytes": max_bytes}
        return MemorySessionStore(
            max_sessions=max_sessions, idle_ttl_s=idle_ttl_s,
            max_session_bytes=max_session_bytes, **total,
        )
    from sessions.redis import connect_redis

    return await connect_redis(
        redis_url, idle_ttl_s=idle_ttl_s, max_session_bytes=max_session_bytes
    )
