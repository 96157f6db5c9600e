"""Tool calls in model output, parsed into OpenAI-style calls. The model writes (Qwen/MiMo style,
as `tokenizer/chat_template.jinja` renders them)
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

`parse_tool_calls` parses a whole completion; `ToolCallStreamParser` does the same on text deltas.
NOTE: invariant: for any split of a text into deltas, the stream parser's content deltas concatenate
to the `content` of `parse_tool_calls`, and it yields the same calls (same ids for the same seed)
and the same errors.

A final block without `</tool_call>` (the output was cut: `max_tokens`, a stop string, or an end
token inside the block) is dropped, markup and all: its arguments are cut JSON, so it is no call,
and the markup is no content either. Its error is reported (`ToolCallError`, `errors`).

NOTE: the stream parser buffers each tool-call block until `</tool_call>` and then emits
ToolCallStart, one ToolCallArgumentsDelta with the whole arguments JSON, and ToolCallEnd. A block
is only known to be a valid call once it is closed; emitting a start earlier would mean taking
back a call whose JSON turns out to be malformed, which OpenAI's delta format cannot express.
"""

import hashlib
import json
import secrets
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """One parsed call; `arguments` is a JSON text, as in OpenAI's `function.arguments`."""

    id: str
    name: str
    arguments: str


class ParsedOutput(NamedTuple):
    content: str
    tool_calls: list[ToolCall]
    errors: list[str]


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgumentsDelta:
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    index: int


@dataclass(frozen=True, slots=True)
class ToolCallError:
    """A block that is not a valid call; its text has been (or is being) emitted as content."""

    message: str


ToolCallEvent = ContentDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd | ToolCallError


def tool_call_id(seed: str, index: int) -> str:
    """`call_<24 hex>`, a pure function of (seed, index), so that tests can pin ids."""
    return "call_" + hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()[:24]


def new_id_seed() -> str:
    return secrets.token_hex(12)


def parse_tool_calls(text: str, *, id_seed: str | None = None) -> ParsedOutput:
    """Split `text` into content and tool calls. Never raises.

    Args:
        id_seed: ids are `tool_call_id(id_seed, i)` for the i-th valid call; None: a random seed.
    Returns:
        content: the text outside valid blocks, with surrounding whitespace stripped. A block whose
            JSON is malformed stays in content verbatim; a final block without `</tool_call>` is
            dropped (see the module docstring).
        errors: one message per such block.
    """
    seed = new_id_seed() if id_seed is None else id_seed
    parts: list[str] = []
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = 0
    while (start := text.find(TOOL_CALL_START, pos)) >= 0:
        parts.append(text[pos:start])
        body_at = start + len(TOOL_CALL_START)
        end = text.find(TOOL_CALL_END, body_at)
        if end < 0:  # NOTE: cut off: dropped, neither a call nor content
            errors.append(_UNTERMINATED)
            pos = len(text)
            break
        result = _parse_block(text[body_at:end], seed, len(calls))
        if isinstance(result, ToolCall):
            calls.append(result)
        else:
            parts.append(text[start : end + len(TOOL_CALL_END)])
            errors.append(result)
        pos = end + len(TOOL_CALL_END)
    parts.append(text[pos:])
    return ParsedOutput("".join(parts).strip(), calls, errors)


@dataclass(slots=True)
class ToolCallStreamParser:
    """Incremental `parse_tool_calls`: `feed` text deltas, then `finish` once.

    Content is held back while it could still be the start of `<tool_call>`, and trailing
    whitespace is held until more content follows (so the result is stripped like
    `parse_tool_calls`' content). See the module docstring for how calls are emitted.
    """

    id_seed: str = field(default_factory=new_id_seed)
    num_calls: int = field(default=0, init=False)
    _buf: str = field(default="", init=False)
    _in_block: bool = field(default=False, init=False)
    # NOTE: in a block, `</tool_call>` does not start before _buf[_scanned:].
    _scanned: int = field(default=0, init=False)
    _pending_ws: str = field(default="", init=False)  # trailing whitespace, held back
    _has_content: bool = field(default=False, init=False)

    def feed(self, delta: str) -> list[ToolCallEvent]:
        events: list[ToolCallEvent] = []
        self._buf += delta
        while self._step(events):
            pass
        return events

    def finish(self) -> list[ToolCallEvent]:
        """Flush what is held back; an unterminated block is dropped, with a ToolCallError."""
        events: list[ToolCallEvent] = []
        if self._in_block:
            events.append(ToolCallError(_UNTERMINATED))
        else:
            self._emit_content(events, self._buf)
        self._buf, self._in_block, self._pending_ws = "", False, ""
        return events

    def _step(self, events: list[ToolCallEvent]) -> bool:
        """Consume what can be decided from `_buf`; True when it should be called again."""
        if not self._in_block:
            start = self._buf.find(TOOL_CALL_START)
            if start < 0:
                keep = _marker_prefix_len(self._buf, TOOL_CALL_START)
                self._emit_content(events, self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                return False
            self._emit_content(events, self._buf[:start])
            self._buf = self._buf[start + len(TOOL_CALL_START) :]
            self._in_block, self._scanned = True, 0
            return True
        end = self._buf.find(TOOL_CALL_END, self._scanned)
        if end < 0:
            self._scanned = max(0, len(self._buf) - len(TOOL_CALL_END) + 1)
            return False
        self._close_block(events, self._buf[:end])
        self._buf = self._buf[end + len(TOOL_CALL_END) :]
        self._in_block = False
        return True

    def _close_block(self, events: list[ToolCallEvent], body: str) -> None:
        result = _parse_block(body, self.id_seed, self.num_calls)
        if not isinstance(result, ToolCall):
            self._emit_content(events, TOOL_CALL_START + body + TOOL_CALL_END)
            events.append(ToolCallError(result))
            return
        index = self.num_calls
        self.num_calls += 1
        events.append(ToolCallStart(index, result.id, result.name))
        events.append(ToolCallArgumentsDelta(index, result.arguments))
        events.append(ToolCallEnd(index))

    def _emit_content(self, events: list[ToolCallEvent], text: str) -> None:
        text = self._pending_ws + text
        if not self._has_content:
            text = text.lstrip()
        kept = text.rstrip()
        self._pending_ws = text[len(kept) :]
        if kept:
            events.append(ContentDelta(kept))
            self._has_content = True


_UNTERMINATED = f"unterminated {TOOL_CALL_START} block at the end of the output"


def _parse_block(body: str, seed: str, index: int) -> ToolCall | str:
    """The call in one block's body, or an error message."""
    try:
        obj = json.loads(body, parse_constant=_reject_constant)
    except ValueError as e:
        return f"tool call {index}: malformed JSON: {e}"
    if not isinstance(obj, dict):
        return f"tool call {index}: expected a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"tool call {index}: missing or non-string 'name'"
    arguments = _arguments_text(obj.get("arguments", {}))
    if arguments is None:
        return f"tool call {index}: 'arguments' is a string that is not valid JSON"
    return ToolCall(id=tool_call_id(seed, index), name=name, arguments=arguments)


def _arguments_text(arguments: Any) -> str | None:
    # NOTE: json.dumps with the template's `tojson` defaults (ensure_ascii=False, ", " and ": "), so
    # arguments rendered by the template parse back to the same text.
    if not isinstance(arguments, str):
        return json.dumps(arguments, ensure_ascii=False)
    try:
        json.loads(arguments, parse_constant=_reject_constant)
    except ValueError:
        return None
    return arguments


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
