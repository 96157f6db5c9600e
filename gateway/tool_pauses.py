"""Tool-pause retention for the gateway's two APIs (``gateway.routing.retention`` does the
bookkeeping; this module finds the conversations).

- Sessions (``gateway.turns``): the conversation is the session; a turn that ends in tool calls
  is retained under ``session/<tenant>/<id>``; the session's next turn resumes it; deleting the
  session releases it.
- Stateless OpenAI clients (``controllers/openai.py``): an answer that ends in tool calls is
  retained under ``<tenant salt>/<its first call id>``. A later request continues that answer
  when a ``tool`` message after its last assistant message answers that call id (call ids are
  random per answer, so the match is exact without rehashing the conversation).

In both, the pause (answer finished -> next request arrived) is what the ``PauseLearner`` learns,
and the retention is released once the next request is dispatched and has its first token (its
prefill has found the checkpoint by then), or has failed.

The ``ToolPauseRetention`` lives on the dispatcher (``dispatcher.retention``), whose ``retain``
sends the ``Retain`` to the worker that finished the request.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from gateway.generation import ChatEnd, Started, start
from gateway.routing.retention import Pause, ToolPauseRetention

if TYPE_CHECKING:
    from engine.protocol import Generate
    from gateway.dispatch import Dispatcher

TOOL_CALLS = "tool_calls"


def retention_of(dispatcher: Dispatcher) -> ToolPauseRetention:
    """The dispatcher's ``ToolPauseRetention`` (the app's lifespan makes it with the configured
    default TTL; a dispatcher without one gets the defaults on first use)."""
    retention = getattr(dispatcher, "retention", None)
    if retention is None:
        retention = ToolPauseRetention(send_retain=dispatcher.retain)
        dispatcher.retention = retention  # type: ignore[attr-defined]
    return retention


def session_key(tenant: str, session_id: str) -> str:
    return f"session/{tenant}/{session_id}"


def call_names(tool_calls: Iterable[Any] | None) -> tuple[str, ...]:
    """The function names of response ``ToolCall``s (or their dict form)."""
    names = []
    for call in tool_calls or ():
        function = call.get("function") if isinstance(call, dict) else call.function
        name = function.get("name") if isinstance(function, dict) else function.name
        names.append(name or "")
    return tuple(names)


# ------------------------------------------------------------------------ stateless clients


def answered_calls(messages: Sequence[Any]) -> list[str]:
    """The ``tool_call_id``s that the ``tool`` messages after the last assistant message answer
    (request message Structs or dicts)."""
    ids: list[str] = []
    for message in reversed(messages):
        role = _role(message)
        if role == "assistant":
            break
        if role == "tool" and (call_id := _field(message, "tool_call_id")):
            ids.append(call_id)
    return ids


async def start_stateless(
    dispatcher: Dispatcher,
    generate: Generate,
    affinity_key: str | None,
    messages: Sequence[Any] | None,
    salt: str | None,
    conversation: int | None = None,
) -> Started:
    """``generation.start`` (``conversation``: see ``route_request``); when ``messages`` answer
    the tool calls of a retained answer, the pause is learned and its retention released once
    this request has its first item."""
    retention = retention_of(dispatcher)
    pause = None
    now_s = time.monotonic()
    for call_id in answered_calls(messages or ()):
        if (pause := retention.resumed(_stateless_key(salt, call_id), now_s)) is not None:
            break
    try:
        return await start(dispatcher, generate, affinity_key, conversation)
    finally:
        retention.release(pause)
        if pause is not None:
            retention.resumed_request(generate.request_id)


def answered(dispatcher: Dispatcher, request_id: str, salt: str | None,
             tool_calls: Sequence[Any] | None, finish_reason: Any, usage: Any) -> None:
    """A stateless chat answer ended: retain it when it ended in tool calls; count the hit of
    a request that followed a tool pause."""
    retention = retention_of(dispatcher)
    retention.request_ended(request_id, usage.prompt_tokens,
                            usage.prompt_tokens_details.cached_tokens)
    if finish_reason != TOOL_CALLS or not tool_calls:
        return
    first = tool_calls[0]
    call_id = first.get("id") if isinstance(first, dict) else first.id
    retention.paused(_stateless_key(salt, call_id), request_id, salt or "",
                     call_names(tool_calls), time.monotonic())


async def watch_stream(
    dispatcher: Dispatcher, request_id: str, salt: str | None, events: AsyncIterator[Any],
    calls: dict[int, list[str]] | None = None,
) -> AsyncIterator[Any]:
    """``chat_deltas`` events passed through; the tool calls they stream are noted, and at the
    ``ChatEnd`` the answer is retained as ``answered`` says. ``calls`` (index -> [id, name]):
    shared with whoever notes the calls of deltas that skip this (``note_calls``)."""
    if calls is None:
        calls = {}
    try:
        async for event in events:
            if isinstance(event, ChatEnd):
                ordered = [{"id": c[0], "function": {"name": c[1]}}
                           for _, c in sorted(calls.items())]
                answered(dispatcher, request_id, salt, ordered, event.finish_reason, event.usage)
            else:
                note_calls(calls, event.delta.tool_calls)
            yield event
    finally:
        await events.aclose()  # type: ignore[attr-defined]


# ------------------------------------------------------------------------ helpers


def note_calls(calls: dict[int, list[str]], deltas: Iterable[Any] | None) -> None:
    """Note the ids and names of streamed tool-call deltas in ``calls`` (see ``watch_stream``)."""
    for call in deltas or ():
        entry = calls.setdefault(call.index, ["", ""])
        if call.id:
            entry[0] = call.id
        if call.function is not None and call.function.name:
            entry[1] = call.function.name


def _stateless_key(salt: str | None, call_id: str) -> str:
    return f"{salt or ''}/{call_id}"


def _role(message: Any) -> Any:
    if isinstance(message, dict):
        return message.get("role")
    # NOTE: request messages are msgspec Structs tagged by their role (no role attribute)
    config = getattr(message, "__struct_config__", None)
    return getattr(message, "role", None) or (config.tag if config is not None else None)


def _field(message: Any, name: str) -> Any:
    if isinstance(message, dict):
        return message.get(name)
    return getattr(message, name, None)


__all__ = ["Pause", "answered", "answered_calls", "call_names", "note_calls", "retention_of",
           "session_key", "start_stateless", "watch_stream"]
