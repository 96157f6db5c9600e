"""The session: one multi-turn conversation of one tenant, with its per-turn records and the
token ids of its rendered prompt (so a turn tokenizes only what it appends, even after a restart
when the store is Redis).

A ``Session`` is an immutable value (a frozen Struct; never mutate its lists): a change is a new
value made with ``msgspec.structs.replace`` and written back with ``SessionStore.put``, a
compare-and-set on ``version``. Messages are OpenAI chat messages as JSON-like dicts (the gateway
validated them), without the system prompt, which is kept apart in ``system``:

    rendered = [{"role": "system", ...}] + messages        (the system message only if set)
               |<-- prompt_num_messages -->|
               prompt_ids = tokens of render(rendered[:prompt_num_messages], no gen. prompt)

Invariant: every assistant message the gateway generated has one ``TurnRecord``; history given
at creation has none.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

Message = dict[str, Any]


class TurnUsage(msgspec.Struct, frozen=True, kw_only=True):
    """Token counts of one turn. ``cached_tokens``: prompt tokens the worker's prefix cache
    served (not prefilled again)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class TurnRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One generated turn.

    Attributes:
        first_message: index in ``Session.messages`` of the first message the client appended.
        num_messages: messages the client appended (the assistant answer follows them).
        finish_reason: "stop", "length", "tool_calls" or "cancelled".
        reused_prompt_tokens: prompt token ids taken from the session, not tokenized again.
        started_at: wall-clock seconds (unix) when the turn was accepted.
        first_token_s: seconds from acceptance to the first output token; None if none came.
        duration_s: seconds from acceptance to the end.
    """

    index: int
    request_id: str
    first_message: int
    num_messages: int
    finish_reason: str
    usage: TurnUsage
    reused_prompt_tokens: int = 0
    started_at: float = 0.0
    first_token_s: float | None = None
    duration_s: float = 0.0


class TurnLease(msgspec.Struct, frozen=True, kw_only=True):
    """The running turn's claim on a session; past ``expires_at`` (unix s) it is stale (its
    gateway died) and another turn may take the session over."""

    request_id: str
    expires_at: float


class SessionSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What ``GET /v1/sessions`` lists of a session (no messages: a page stays small)."""

    id: str
    model: str
    metadata: dict[str, str] = {}
    num_messages: int = 0
    num_turns: int = 0
    created_at: float = 0.0
    updated_at: float = 0.0
    running: TurnLease | None = None


class SessionPage(msgspec.Struct, frozen=True, kw_only=True):
    """One page of a tenant's sessions, ordered by id; ``has_more``: a next page exists
    (ask for it with ``after`` = the last id here)."""

    data: list[SessionSummary]
    has_more: bool


class Session(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    tenant: str
    model: str
    system: str | None = None
    tools: list[dict[str, Any]] | None = None
    metadata: dict[str, str] = {}
    messages: list[Message] = []
    turns: list[TurnRecord] = []
    prompt_ids: list[int] = []
    prompt_num_messages: int = 0
    created_at: float = 0.0
    updated_at: float = 0.0
    version: int = 0  # set by the store: 1 on create, +1 on every put
    running: TurnLease | None = None

    def rendered_messages(self) -> list[Message]:
        """What the chat template renders: the system message (if any), then ``messages``."""
        head = [] if self.system is None else [{"role": "system", "content": self.system}]
        return [*head, *self.messages]

    def is_running(self, now: float) -> bool:
        return self.running is not None and self.running.expires_at > now

    def summary(self) -> SessionSummary:
        return SessionSummary(
            id=self.id, model=self.model, metadata=self.metadata,
            num_messages=len(self.messages), num_turns=len(self.turns),
            created_at=self.created_at, updated_at=self.updated_at, running=self.running,
        )


def new_session_id() -> str:
    return f"sess_{uuid.uuid4().hex}"


def new_session(
    tenant: str,
    model: str,
    *,
    system: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    metadata: dict[str, str] | None = None,
    messages: list[Message] | None = None,
    session_id: str | None = None,
    now: float | None = None,
) -> Session:
    now = time.time() if now is None else now
    return Session(
        id=session_id or new_session_id(), tenant=tenant, model=model, system=system,
        tools=tools or None, metadata=dict(metadata or {}), messages=list(messages or []),
        created_at=now, updated_at=now,
    )
