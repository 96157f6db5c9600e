"""``SessionManager``: the session operations the API needs, on any ``SessionStore``. It owns
the rules (tool-call matching, one turn at a time, what a finished turn appends); the gateway
owns rendering and generation.

A turn's life, each step one compare-and-set:

    begin_turn:  check the appended messages, claim the session (``running`` = a lease)
    renew_turn:  push the lease's expiry ``turn_lease_s`` ahead (every ``renew_every_s`` while
                 the turn runs: the gateway's ``Turn`` does it in a background task)
    finish_turn: append the client's messages + the assistant message + a TurnRecord, store
                 the new prompt ids, release the lease
    abort_turn:  release the lease, append nothing (the turn failed before it could answer)

A second ``begin_turn`` while a lease is live raises ``TurnInProgress`` (409). The lease is
short (``turn_lease_s``, 20 s) and renewed while its turn runs, so a lease whose gateway died
(or lost its store) expires soon; then a new turn takes the session over. Renew, finish and
abort are compare-and-sets on the lease's ``request_id`` (its token): a stale owner never
clobbers a newer turn, its late write is dropped. Finish and abort retry a store that is
unavailable, with backoff, for up to ``write_retry_s`` (a short Redis outage or freeze loses
no answer) before ``StoreUnavailable`` reaches the caller; the lease then expires by itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from sessions.errors import SessionNotFound, StoreUnavailable, TurnInProgress, VersionConflict
from sessions.model import Message, Session, SessionPage, TurnLease, TurnRecord, new_session
from sessions.store import SessionStore
from sessions.tools import HISTORY_ROLES, check_appended

logger = logging.getLogger(__name__)

DEFAULT_TURN_LEASE_S = 20.0
DEFAULT_WRITE_RETRY_S = 12.0
_MAX_CAS_ATTEMPTS = 5
_FIRST_BACKOFF_S = 0.1
_MAX_BACKOFF_S = 2.0


@dataclass(slots=True)
class SessionStats:
    """Counters since start (this process's operations; ``/metrics`` exports them)."""

    created: int = 0
    deleted: int = 0
    turns_started: int = 0
    turns_in_progress: int = 0  # begin_turn refused: another turn holds the session (409)
    turns_aborted: int = 0  # released without recording (the worker failed)
    turns_dropped: int = 0  # finished, but the session was deleted or taken over meanwhile
    turns_taken_over: int = 0  # begin_turn claimed a session whose lease had expired
    turns_unrecorded: int = 0  # the store stayed unavailable past the write retries
    turns_finished: Counter[str] = field(default_factory=Counter)  # by finish_reason


class SessionManager:
    def __init__(
        self,
        store: SessionStore,
        *,
        turn_lease_s: float = DEFAULT_TURN_LEASE_S,
        write_retry_s: float = DEFAULT_WRITE_RETRY_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        assert turn_lease_s > 0 and write_retry_s >= 0, f"{turn_lease_s=}, {write_retry_s=}"
        self.store = store
        self.turn_lease_s = turn_lease_s
        self.write_retry_s = write_retry_s
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

    async def list(self, tenant: str, after: str | None, limit: int) -> SessionPage:
        """A page of the tenant's sessions (``SessionStore.list``)."""
        return await self.store.list(tenant, after, limit)

    @property
    def renew_every_s(self) -> float:
        """How often a running turn renews its lease: three tries before it could expire."""
        return self.turn_lease_s / 3
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
        if session.running is not None:
            logger.warning("turn %s takes over session %s from %s (its lease expired)",
                           request_id, session_id, session.running.request_id)
            self.stats.turns_taken_over += 1
        self.stats.turns_started += 1
        return claimed

    async def renew_turn(self, session: Session) -> bool:
        """Push the lease of the turn ``begin_turn`` returned ``session`` for ``turn_lease_s``
        ahead. False: the lease is lost (the session was deleted, or another turn took it over
        after it expired). One try: ``StoreUnavailable`` propagates (the caller tries again at
        its next tick, while the lease has not expired).
        """
        assert session.running is not None
        lease = TurnLease(
            request_id=session.running.request_id, expires_at=self._clock() + self.turn_lease_s
        )
        renewed = await self._update_leased(
            session, lambda s: msgspec.structs.replace(s, running=lease)
        )
        return renewed is not None

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

        Raises:
            StoreUnavailable: still unavailable after ``write_retry_s`` of retries.
            SessionTooLarge: the session with this turn would exceed the store's byte bound.
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

        try:
            recorded = await self._retrying(lambda: self._update_leased(session, update))
        except StoreUnavailable:
            self.stats.turns_unrecorded += 1
            raise
        if recorded is None:
            self.stats.turns_dropped += 1
        else:
            self.stats.turns_finished[record.finish_reason] += 1
        return recorded

    async def abort_turn(self, session: Session) -> None:
        """Release the lease of a turn that records nothing (it failed before answering).

        Raises:
            StoreUnavailable: still unavailable after ``write_retry_s`` of retries (the lease
                then expires by itself).
        """
        self.stats.turns_aborted += 1
        await self._retrying(lambda: self._update_leased(session, _released))

    async def _retrying(self, write: Callable[[], Awaitable[Session | None]]) -> Session | None:
        """``write()``, tried again while the store is unavailable, with exponential backoff,
        until ``write_retry_s`` has passed."""
        deadline = time.monotonic() + self.write_retry_s
        backoff_s = _FIRST_BACKOFF_S
        while True:
            try:
                return await write()
            except StoreUnavailable as exc:
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    raise
                logger.warning("session store unavailable, retrying a turn's write: %s", exc)
                await asyncio.sleep(min(backoff_s, left_s))
                backoff_s = min(2 * backoff_s, _MAX_BACKOFF_S)

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


def _released(session: Session) -> Session:
    return msgspec.structs.replace(session, running=None)
