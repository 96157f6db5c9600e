"""Tool-call tracking: which tool calls of the last assistant message still wait for a result,
and the rules messages appended to a session must follow (OpenAI's):

- a turn appends only ``user`` and ``tool`` messages; history given at creation may also hold
  ``assistant`` messages (``system`` is the session's own field);
- a ``tool`` message answers a pending call: its ``tool_call_id`` is one of the last assistant
  message's ``tool_calls`` ids not answered yet;
- every pending call is answered before the next ``user`` or ``assistant`` message, and before
  the turn's generation (so a turn that follows tool calls starts with their results).

Violations raise ``InvalidMessages`` naming the parameter (``messages[1].tool_call_id``).
"""

from __future__ import annotations

from collections.abc import Sequence

from sessions.errors import InvalidMessages
from sessions.model import Message

TURN_ROLES = ("user", "tool")
HISTORY_ROLES = ("user", "assistant", "tool")


def pending_tool_calls(messages: Sequence[Message]) -> list[str]:
    """Ids of the last assistant message's tool calls that no later tool message answered."""
    answered: set[str] = set()
    for message in reversed(messages):
        if message.get("role") == "tool":
            answered.add(message.get("tool_call_id", ""))
        elif message.get("role") == "assistant":
            return [i for i in _call_ids(message) if i not in answered]
        else:
            return []
    return []


def check_appended(
    history: Sequence[Message],
    new: Sequence[Message],
    *,
    roles: Sequence[str] = TURN_ROLES,
    param: str = "messages",
    require_answered: bool = True,
) -> None:
    """Check that ``new`` may follow ``history`` (the rules above).

    Args:
        roles: roles ``new`` may contain.
        require_answered: the conversation after ``new`` has no pending tool calls (true for a
            turn, which generates next; false for history given at creation).

    Raises:
        InvalidMessages: naming ``{param}[i]...`` of the first offending message.
    """
    pending = pending_tool_calls(history)
    for i, message in enumerate(new):
        role = message.get("role")
        where = f"{param}[{i}]"
        if role not in roles:
            raise InvalidMessages(
                f"{where}: role {role!r} cannot be appended here (allowed: {', '.join(roles)})",
                param=f"{where}.role",
            )
        if role == "tool":
            pending = _answer(pending, message.get("tool_call_id", ""), where)
            continue
        if pending:
            raise _unanswered(pending, where)
        if role == "assistant":
            pending = _call_ids(message)
    if pending and require_answered:
        raise _unanswered(pending, param)


def _answer(pending: list[str], call_id: str, where: str) -> list[str]:
    if call_id not in pending:
        known = ", ".join(pending) if pending else "none"
        raise InvalidMessages(
            f"{where}.tool_call_id {call_id!r} does not match a pending tool call of the last "
            f"assistant message (pending: {known})",
            param=f"{where}.tool_call_id",
        )
    return [i for i in pending if i != call_id]


def _unanswered(pending: list[str], param: str) -> InvalidMessages:
    return InvalidMessages(
        f"an assistant message with tool_calls must be followed by tool messages answering "
        f"each tool_call_id; unanswered: {', '.join(pending)}",
        param=param,
    )


def _call_ids(message: Message) -> list[str]:
    return [call.get("id", "") for call in message.get("tool_calls") or []]
