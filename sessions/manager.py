"""``SessionManager``: the session operations the API needs, on any ``SessionStore``. It owns
the rules (tool-call matching, one turn at a time, what a finished turn appends); the gateway
owns rendering and generation.

A turn's life, each step one compare-and-set:

    begin_turn:  check the appended messages, claim the session (``running`` = a lease)
    finish_turn: append the client's messages + the assistant message + a TurnRecord, store
                 the new prompt ids, release the lease
    abort_turn:  release the lease, append nothing (the turn failed before it could answer)

A second ``begin_turn`` while a lease is live raises ``TurnInProgress`` (409); a lease outlives
its gateway only until ``turn_lease_s`` (then another turn may take the session over, and the
late ``finish_turn`` is dropped).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from sessions.errors import SessionNotFound, TurnInProgress, VersionConflict
from sessions.model import Message, Session, TurnLease, TurnRecord, new_session
from sessions.store import SessionStore
from sessions.tools import HISTORY_ROLES, check_appended

DEFAULT_TURN_LEASE_S = 600.0
_MAX_CAS_ATTEMPTS = 5


@dataclass(slots=True)
class SessionStats:
    """Counters since start (this process's operations; ``/metrics`` exports them)."""

    created: int = 0
    deleted: int = 0
    turns_started: int = 0
    turns_in_progress: int = 0  # begin_turn refused: another turn holds the session (409)
    turns_aborted: int = 0  # released without recording (the worker failed)
    turns_dropped: int = 0  # finished, but the session was deleted or taken over meanwhile
    turns_finished: Counter[str] = field(default_factory=Counter)  # by finish_reason


class SessionManager:
    def __init__(
        self,
        store: SessionStore,
        *,
        turn_lease_s: float = DEFAULT_TURN_LEASE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        assert turn_lease_s > 0, f"{turn_lease_s=}: must be > 0"
        self.store = store
        self.turn_lease_s = turn_lease_s
        self.stats = SessionStats()
        self._clock = clock

    async def create(
        self,
        tenant: str,
        model: str,
        *,
        system: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        metadata: dict[str, str] | None = None,
        messages: Sequence[Message] = (),
    ) -> Session:
        """A new session; ``messages`` is prior history (user, assistant, tool), checked.

        Raises:
            InvalidMessages: the history breaks the tool-call rules (``messages[i]...``).
        """
        check_appended([], messages, roles=HISTORY_ROLES, require_answered=False)
        session = new_session(
            tenant, model, system=system, tools=tools, metadata=metadata,
            messages=list(messages), now=self._clock(),
        )
        created = await self.store.create(session)
        self.stats.created += 1
        return created

    async def get(self, tenant: str, session_id: str) -> Session:
        session = await self.store.get(tenant, session_id)
        if session is None:
            raise SessionNotFound(session_id)
        return session

    async def delete(self, tenant: str, session_id: str) -> None:
        if not await self.store.delete(tenant, session_id):
            raise SessionNotFound(session_id)
        self.stats.deleted += 1

    async def begin_turn(
        self, tenant: str, session_id: str, new: Sequence[Message], request_id: str
    ) -> Session:
        """Claim the session for one turn appending ``new`` (user / tool messages).

        Returns:
            the session as stored, ``running`` set to this turn's lease.
        Raises:
            SessionNotFound, InvalidMessages (``messages[i]...``), TurnInProgress.
        """
        session = await self.get(tenant, session_id)
        now = self._clock()
        if session.is_running(now):
            self.stats.turns_in_progress += 1
            raise TurnInProgress(session_id)
        check_appended(session.messages, new)
        lease = TurnLease(request_id=request_id, expires_at=now + self.turn_lease_s)
        try:
            claimed = await self.store.put(msgspec.structs.replace(session, running=lease))
        except VersionConflict:
            self.stats.turns_in_progress += 1
            raise TurnInProgress(session_id) from None
        self.stats.turns_started += 1
        return claimed

    async def finish_turn(
        self,
        session: Session,
        new: Sequence[Message],
        assistant: Message,
        record: TurnRecord,
        prefix_ids: list[int],
        num_prefix_messages: int,
    ) -> Session | None:
        """Record the turn that ``begin_turn`` returned ``session`` for, and release it.

        ``record.index`` and ``record.first_message`` are filled in here. ``prefix_ids`` (the
        render of the first ``num_prefix_messages`` rendered messages) become the stored prompt
        ids. Returns None (nothing recorded) when the session was deleted meanwhile or its lease
        was taken over.
        """
        assert session.running is not None, "finish_turn needs the session begin_turn returned"

        def update(current: Session) -> Session:
            record_ = msgspec.structs.replace(
                record, index=len(current.turns), first_message=len(current.messages)
            )
            return msgspec.structs.replace(
                current, messages=[*current.messages, *new, assistant],
                turns=[*current.turns, record_], prompt_ids=prefix_ids,
                prompt_num_messages=num_prefix_messages, running=None,
                updated_at=self._clock(),
            )

        recorded = await self._update_leased(session, update)
        if recorded is None:
            self.stats.turns_dropped += 1
        else:
            self.stats.turns_finished[record.finish_reason] += 1
        return recorded

    async def abort_turn(self, session: Session) -> None:
        """Release the lease of a turn that records nothing (it failed before answering)."""
        self.stats.turns_aborted += 1
        await self._update_leased(session, lambda s: msgspec.structs.replace(s, running=None))

    async def _update_leased(
        self, session: Session, update: Callable[[Session], Session]
    ) -> Session | None:
        assert session.running is not None
        request_id = session.running.request_id
        for _ in range(_MAX_CAS_ATTEMPTS):
            current = await self.store.get(session.tenant, session.id)
            if current is None or current.running is None:
                return None
            if current.running.request_id != request_id:
                return None
            try:
                return await self.store.put(update(current))
            except SessionNotFound:
                return None
            except VersionConflict:
                continue
        return None
