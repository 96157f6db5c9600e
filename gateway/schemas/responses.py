"""OpenAI-compatible response bodies (chat completions, chunks, completions, models, errors)."""

from __future__ import annotations

import time
from typing import Literal

import msgspec

from gateway.schemas.requests import FinishReason, ToolCall

# --- responses -------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, frozen=True, kw_only=True):
    """``image_tokens``: the prompt's image and video placeholder tokens (absent without media;
    ``cached_tokens`` counts those that hit like any other)."""

    cached_tokens: int = 0
    image_tokens: int | msgspec.UnsetType = msgspec.UNSET


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
           image_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=cached_tokens, image_tokens=image_tokens or msgspec.UNSET),
        )


class TopLogprob(msgspec.Struct, frozen=True, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    content: list[TokenLogprob] | None = None


class ResponseMessage(msgspec.Struct, frozen=True, kw_only=True):
    content: str | None
    tool_calls: list[ToolCall] | None = None
    role: Literal["assistant"] = "assistant"


class ChatChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    message: ResponseMessage
    finish_reason: FinishReason | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    model: str
    choices: list[ChatChoice]
    usage: Usage
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    object: Literal["chat.completion"] = "chat.completion"


class FunctionCallDelta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One tool call's piece in a chunk; the first piece of call ``index`` carries ``id``,
    ``type`` and ``function.name``, the later ones only ``function.arguments``."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChunkDelta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    delta: ChunkDelta
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct, frozen=True, kw_only=True):
    """One SSE event. ``usage`` is omitted while UNSET; with ``stream_options.include_usage``
    pass None (``null``, as OpenAI) on every chunk but the last, which has ``choices == []``."""

    id: str
    model: str
    created: int
    choices: list[ChunkChoice]
    usage: Usage | None | msgspec.UnsetType = msgspec.UNSET
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class CompletionLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = []


class CompletionChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """A ``text_completion`` body, or one SSE event of a streamed completion (``usage`` UNSET,
    hence omitted, except on the last event)."""

    id: str
    model: str
    created: int
    choices: list[CompletionChoice]
    usage: Usage | None | msgspec.UnsetType = msgspec.UNSET
    object: Literal["text_completion"] = "text_completion"


class Model(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    created: int = 0
    owned_by: str = "agentgate"
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct, frozen=True, kw_only=True):
    data: list[Model]
    object: Literal["list"] = "list"


class ErrorDetail(msgspec.Struct, frozen=True, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    error: ErrorDetail


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> ErrorBody:
    """The OpenAI error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return ErrorBody(error=ErrorDetail(message=message, type=type, param=param, code=code))


