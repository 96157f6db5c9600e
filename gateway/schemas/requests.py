"""OpenAI-compatible HTTP bodies as msgspec Structs, their decoders, and the one mapping from
OpenAI sampling fields to the worker's ``SamplingSpec``.

Unknown fields:

| struct                          | unknown fields | why                                       |
|---------------------------------|----------------|-------------------------------------------|
| ChatCompletionRequest,          | rejected       | a misspelled `max_tokens` would otherwise |
| CompletionRequest, Tool,        |                | be silently ignored; the OpenAI fields we |
| FunctionDef, tool_choice,       |                | accept and ignore (`user`, `metadata`,    |
| response_format, stream_options |                | `store`, ...) are declared fields         |
| messages, tool calls, parts     | ignored        | clients echo response messages back       |
|                                 |                | verbatim, with `refusal`, `annotations`   |

A required field missing from a message (a tool message without ``tool_call_id``) is still an
error. Range checks the type system cannot express live in ``_check_*``; every failure is a
``RequestError`` naming the parameter path (``messages[0].role``). Pure msgspec: no litestar, no
torch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS
from gateway.schemas.limits import DEFAULT_LIMITS, MAX_INT64

MAX_STOP_STRINGS = DEFAULT_LIMITS.max_stop_strings
MAX_STOP_CHARS = DEFAULT_LIMITS.max_stop_chars
_Int64 = Annotated[int, Meta(ge=-(2**63), le=MAX_INT64)]
_TokenId = Annotated[int, Meta(ge=0, lt=2**31)]  # NOTE: bounded: ids travel as msgpack ints
FinishReason = Literal["stop", "length", "tool_calls", "content_filter"]

# --- request parts ---------------------------------------------------------------------------


class TextPart(msgspec.Struct, tag="text", tag_field="type", frozen=True, kw_only=True):
    text: str


class ImageUrl(msgspec.Struct, frozen=True, kw_only=True):
    """``url``: a ``data:`` URI, or http(s) when the gateway fetches URLs
    (``--allow-media-urls``). ``detail`` is accepted; every image gets the tower's one tile."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(msgspec.Struct, tag="image_url", tag_field="type", frozen=True, kw_only=True):
    image_url: ImageUrl


class VideoUrl(msgspec.Struct, frozen=True, kw_only=True):
    """A short clip (MP4, WebM, ...): a ``data:`` URI or an allowed URL; frames are sampled."""

    url: str


class VideoUrlPart(msgspec.Struct, tag="video_url", tag_field="type", frozen=True, kw_only=True):
    video_url: VideoUrl


class VideoFramesPart(msgspec.Struct, tag="video", tag_field="type", frozen=True, kw_only=True):
    """A video as its frames (vLLM's and Qwen's spelling): image URLs, in order."""

    video: list[str]


# NOTE: a tagged union, so that an unknown part (input_audio) fails at `content[0].type` with
# the unsupported value rather than as a missing field of some other part
ContentPart = TextPart | ImageUrlPart | VideoUrlPart | VideoFramesPart
MediaPart = ImageUrlPart | VideoUrlPart | VideoFramesPart
Content = str | list[ContentPart]


class FunctionCall(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class SystemMessage(msgspec.Struct, tag="system", tag_field="role", frozen=True, kw_only=True):
    content: Content
    name: str | None = None


class DeveloperMessage(
    msgspec.Struct, tag="developer", tag_field="role", frozen=True, kw_only=True
):
    content: Content
    name: str | None = None


class UserMessage(msgspec.Struct, tag="user", tag_field="role", frozen=True, kw_only=True):
    content: Content
    name: str | None = None


class AssistantMessage(
    msgspec.Struct, tag="assistant", tag_field="role", frozen=True, kw_only=True, omit_defaults=True
):
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None
    name: str | None = None
    reasoning_content: str | None = None


class ToolMessage(msgspec.Struct, tag="tool", tag_field="role", frozen=True, kw_only=True):
    content: Content
    tool_call_id: str


Message = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage


class FunctionDef(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] = {}  # a JSON schema; OpenAI treats absent as "no arguments"
    strict: bool | None = None


class Tool(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    function: FunctionDef
    type: Literal["function"] = "function"


class NamedFunction(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    function: NamedFunction
    type: Literal["function"] = "function"


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class ResponseFormatText(
    msgspec.Struct, tag="text", tag_field="type", frozen=True, forbid_unknown_fields=True
):
    pass


class ResponseFormatJsonObject(
    msgspec.Struct, tag="json_object", tag_field="type", frozen=True, forbid_unknown_fields=True
):
    pass


class JsonSchemaSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormatJsonSchema(
    msgspec.Struct,
    tag="json_schema",
    tag_field="type",
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
):
    json_schema: JsonSchemaSpec


ResponseFormat = ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``continuous_usage_stats`` (vLLM): every chunk carries the usage so far."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


# NOTE: an empty stop string would match everywhere; a long one is held back from every delta
_StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = _StopString | Annotated[list[_StopString], Meta(max_length=MAX_STOP_STRINGS)] | None
_Stop = Stop
_MaxTokens = Annotated[int, Meta(ge=1, le=MAX_INT64)] | None
_Temperature = Annotated[float, Meta(ge=0, le=2)] | None
_TopP = Annotated[float, Meta(gt=0, le=1)] | None
_Penalty = Annotated[float, Meta(ge=-2, le=2)] | None
# NOTE: vLLM's spelling of "no top-k" is -1 (or 0); both map to None
_TopK = Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None
_MinP = Annotated[float, Meta(ge=0, le=1)] | None
_RepetitionPenalty = Annotated[float, Meta(gt=0)] | None
_LogitBias = Annotated[
    dict[str, Annotated[float, Meta(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
    Meta(max_length=MAX_LOGIT_BIAS_ENTRIES),
] | None
_ShortStr = Annotated[str, Meta(max_length=1024)] | None


class ChatCompletionRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/chat/completions``. Fields clients send that do not change this model's
    output are accepted and ignored: ``metadata``, ``store``, ``service_tier``,
    ``safety_identifier``, ``verbosity``, ``reasoning_effort``, ``prediction``. Honoured:
    ``logit_bias``, ``top_k``, ``min_p``, ``repetition_penalty`` (vLLM); ``prompt_cache_key``
    and ``user`` are worker-affinity hints (``gateway.affinity_keys``). Refused unless null or
    empty (``unsupported_value``): ``functions``, ``function_call`` other than "none"/"auto",
    ``audio``, ``modalities`` other than text. Penalties are accepted only as 0."""

    model: str
    messages: list[Message]
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: _MaxTokens = None
    max_completion_tokens: _MaxTokens = None
    temperature: _Temperature = None
    top_p: _TopP = None
    seed: _Int64 | None = None
    stop: _Stop = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    n: _Int64 | None = None
    presence_penalty: _Penalty = None
    frequency_penalty: _Penalty = None
    parallel_tool_calls: bool | None = None
    logit_bias: _LogitBias = None
    top_k: _TopK = None
    min_p: _MinP = None
    repetition_penalty: _RepetitionPenalty = None
    prompt_cache_key: _ShortStr = None
    user: _ShortStr = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: _ShortStr = None
    safety_identifier: _ShortStr = None
    verbosity: _ShortStr = None
    reasoning_effort: _ShortStr = None
    prediction: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None

    @property
    def stop_strings(self) -> list[str]:
        return stop_strings(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: ``continuous_usage_stats`` with ``include_usage`` (as vLLM)."""
        return self.include_usage and self.stream_options.continuous_usage_stats  # type: ignore[union-attr]


class CompletionRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/completions``: one prompt, as text or token ids; ``echo`` must be false,
    ``suffix`` null and ``best_of`` 1. ``user`` and ``prompt_cache_key`` are routing hints only
    (``gateway.affinity_keys``); ``logit_bias`` and the vLLM extras are honoured as in chat."""

    model: str
    prompt: str | list[_TokenId]
    max_tokens: _MaxTokens = None
    temperature: _Temperature = None
    top_p: _TopP = None
    seed: _Int64 | None = None
    stop: _Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    n: _Int64 | None = None
    best_of: _Int64 | None = None
    suffix: str | None = None
    presence_penalty: _Penalty = None
    frequency_penalty: _Penalty = None
    logit_bias: _LogitBias = None
    top_k: _TopK = None
    min_p: _MinP = None
    repetition_penalty: _RepetitionPenalty = None
    prompt_cache_key: _ShortStr = None
    user: _ShortStr = None

    @property
    def stop_strings(self) -> list[str]:
        return stop_strings(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: ``continuous_usage_stats`` with ``include_usage`` (as vLLM)."""
        return self.include_usage and self.stream_options.continuous_usage_stats  # type: ignore[union-attr]


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """The ``stop`` parameter as a list (OpenAI takes one string or a list)."""
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)
