"""Session API bodies (``/v1/sessions``) and WebSocket frames (``/v1/sessions/{id}/ws``) as
msgspec Structs, with decoders whose errors name the parameter (``RequestError``).

Messages and tools are the chat-completions Structs; requests reject unknown fields (a
misspelled ``max_tokens`` would otherwise be ignored). The WebSocket and SSE share one frame
union, ``ServerFrame``, tagged by ``type``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from engine.protocol import SamplingSpec
from gateway.schemas.decode import (
    RequestError,
    _validation_error,
    check_tools,
    to_sampling_spec,
)
from gateway.schemas.requests import (
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    Message,
    ResponseFormat,
    Tool,
    ToolCall,
    ToolChoice,
    stop_strings,
)
from gateway.schemas.responses import ErrorDetail, ResponseMessage, Usage

MAX_METADATA_KEYS = 16
_Metadata = Annotated[
    dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]],
    Meta(max_length=MAX_METADATA_KEYS),
]
_Stop = str | Annotated[list[str], Meta(max_length=MAX_STOP_STRINGS)] | None
_MaxTokens = Annotated[int, Meta(ge=1)] | None
_Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
_FrameId = Annotated[str, Meta(max_length=256)] | None

# --- requests --------------------------------------------------------------------------------


class SessionCreateRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/sessions``. ``model`` is optional (one model is served; its name is
    recorded). ``messages``: prior history to start from (user, assistant, tool messages)."""

    model: str | None = None
    system: str | None = None
    tools: list[Tool] | None = None
    metadata: _Metadata | None = None
    messages: list[Message] = []


class TurnParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a turn appends (user messages and/or tool results) and how to sample its answer."""

    messages: list[Message]
    max_tokens: _MaxTokens = None
    max_completion_tokens: _MaxTokens = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    seed: _Int64 | None = None
    stop: _Stop = None
    tool_choice: ToolChoice | None = None  # against the session's tools
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    @property
    def stop_strings(self) -> list[str]:
        return stop_strings(self.stop)


class TurnRequest(TurnParams, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/sessions/{id}/turns``; ``stream`` answers with SSE ``ServerFrame``s."""

    stream: bool = False


class TurnFrame(TurnParams, tag="turn", tag_field="type", frozen=True, kw_only=True):
    """Client -> server: run a turn. ``id`` (optional) comes back in the frames that answer
    it (``turn_start``, ``turn_end``, ``error``)."""

    id: _FrameId = None


class CancelFrame(
    msgspec.Struct, tag="cancel", tag_field="type", frozen=True, kw_only=True,
    forbid_unknown_fields=True,
):
    """Client -> server: end the running turn now (finish_reason "cancelled")."""

    id: _FrameId = None


class _FrameIdOnly(msgspec.Struct, frozen=True):
    """A client frame's id alone (unknown fields ignored)."""

    id: str | None = None


ClientFrame = TurnFrame | CancelFrame

# --- responses -------------------------------------------------------------------------------


class TurnInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One turn in ``GET /v1/sessions/{id}``: ``messages`` = [first, end) indexes into the
    session's ``messages`` (the client's messages, then the assistant answer at end - 1)."""

    index: int
    request_id: str
    finish_reason: str
    usage: Usage
    messages: tuple[int, int]
    reused_prompt_tokens: int
    started_at: float
    first_token_s: float | None
    duration_s: float


class SessionCacheStats(msgspec.Struct, frozen=True, kw_only=True):
    """``cached_tokens`` / ``prompt_tokens``: the workers' prefix-cache hits over all turns;
    ``reused_prompt_tokens``: prompt tokens the gateway did not tokenize again."""

    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    reused_prompt_tokens: int
    stored_prompt_tokens: int


class SessionObject(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    model: str
    system: str | None
    tools: list[dict[str, Any]] | None
    metadata: dict[str, str]
    messages: list[dict[str, Any]]
    turns: list[TurnInfo]
    usage: Usage
    cache: SessionCacheStats
    running: bool
    created_at: float
    updated_at: float
    object: Literal["session"] = "session"


class SessionListItem(msgspec.Struct, frozen=True, kw_only=True):
    """One session in ``GET /v1/sessions`` (no messages)."""

    id: str
    model: str
    metadata: dict[str, str]
    num_messages: int
    num_turns: int
    running: bool
    created_at: float
    updated_at: float
    object: Literal["session"] = "session"


class SessionList(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /v1/sessions``: a page of the caller's sessions, ordered by id; the next page is
    ``?after=<last_id>`` while ``has_more``."""

    data: list[SessionListItem]
    has_more: bool
    first_id: str | None
    last_id: str | None
    object: Literal["list"] = "list"


class DeletedSession(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    deleted: bool = True
    object: Literal["session.deleted"] = "session.deleted"


class TurnStart(
    msgspec.Struct, tag="turn_start", tag_field="type", frozen=True, kw_only=True,
    omit_defaults=True,
):
    session_id: str
    turn: int
    request_id: str
    id: str | None = None  # the WebSocket turn frame's id


class DeltaFrame(msgspec.Struct, tag="delta", tag_field="type", frozen=True, kw_only=True):
    content: str


class ToolCallFrame(msgspec.Struct, tag="tool_call", tag_field="type", frozen=True, kw_only=True):
    tool_call: ToolCall


class TurnEnd(
    msgspec.Struct, tag="turn_end", tag_field="type", frozen=True, kw_only=True,
    omit_defaults=True,
):
    """The end of a turn; also the JSON body of a non-streamed ``POST .../turns``.
    ``finish_reason``: "stop", "length", "tool_calls" or "cancelled"."""

    session_id: str
    turn: int
    request_id: str
    message: ResponseMessage
    finish_reason: str
    usage: Usage
    id: str | None = None  # the WebSocket turn frame's id


class ErrorFrame(
    msgspec.Struct, tag="error", tag_field="type", frozen=True, kw_only=True, omit_defaults=True
):
    """``id``: the WebSocket frame this error answers, when it had one."""

    error: ErrorDetail
    id: str | None = None


ServerFrame = TurnStart | DeltaFrame | ToolCallFrame | TurnEnd | ErrorFrame

# --- decoding --------------------------------------------------------------------------------

_CREATE_DECODER = msgspec.json.Decoder(SessionCreateRequest)
_TURN_DECODER = msgspec.json.Decoder(TurnRequest)
_FRAME_DECODER = msgspec.json.Decoder(ClientFrame)
_FRAME_ID_DECODER = msgspec.json.Decoder(_FrameIdOnly)


def decode_session_create(body: bytes) -> SessionCreateRequest:
    """Raises ``RequestError`` naming the parameter (``tools[0].function.name``, ...)."""
    req: SessionCreateRequest = _decode(_CREATE_DECODER, body)
    check_tools(req.tools or [], None)
    return req


def decode_turn_request(body: bytes) -> TurnRequest:
    req: TurnRequest = _decode(_TURN_DECODER, body)
    _check_turn(req)
    return req


def decode_client_frame(data: str | bytes) -> ClientFrame:
    """One WebSocket text frame; an unknown ``type`` names the parameter ``type``."""
    frame: ClientFrame = _decode(_FRAME_DECODER, data)
    if isinstance(frame, TurnFrame):
        _check_turn(frame)
    return frame


def frame_id_of(data: str | bytes) -> str | None:
    """The ``id`` of a frame that failed to decode, when it has a readable string one."""
    try:
        return _FRAME_ID_DECODER.decode(data).id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def turn_sampling_spec(
    req: TurnParams,
    *,
    tools: list[dict[str, Any]] | None,
    default_max_tokens: int,
    stop_token_ids: tuple[int, ...] | list[int],
) -> SamplingSpec:
    """The worker's sampling spec, through the one OpenAI -> engine mapping; ``tools`` are the
    session's (a named ``tool_choice`` must be one of them).

    Raises:
        RequestError: ``tool_choice`` without tools or naming an unknown one; a schema that
            cannot be enforced.
    """
    chat = ChatCompletionRequest(
        model="", messages=[], max_tokens=req.max_tokens,
        max_completion_tokens=req.max_completion_tokens, temperature=req.temperature,
        top_p=req.top_p, seed=req.seed,
        tools=msgspec.convert(tools, list[Tool]) if tools else None,
        tool_choice=req.tool_choice, parallel_tool_calls=req.parallel_tool_calls,
        response_format=req.response_format,
    )
    check_tools(chat.tools or [], chat.tool_choice)
    return to_sampling_spec(
        chat, default_max_tokens=default_max_tokens, stop_token_ids=stop_token_ids
    )


def _check_turn(req: TurnParams) -> None:
    if not req.messages:
        raise RequestError("messages must contain at least one message", param="messages")


def _decode(decoder: msgspec.json.Decoder[Any], data: str | bytes) -> Any:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        error = _validation_error(str(exc))
        if error.param is not None:  # NOTE: msgspec writes a dict value's path as `metadata[...]`
            error.param = error.param.replace("[...]", "")
        raise error from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"We could not parse the JSON: {exc}", code="invalid_json") from None
