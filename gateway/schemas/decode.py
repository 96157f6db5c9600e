"""Decoding request bodies into Structs with errors that name the parameter, and the one
mapping from OpenAI sampling fields to the worker's ``SamplingSpec``."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.protocol import SamplingSpec
from engine.sampling_params import SEED_LIMIT, StructuredSpec
from gateway.schemas.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    ResponseFormatJsonSchema,
    Tool,
    ToolChoice,
)
from gateway.schemas.responses import ErrorBody, error_body
from gateway.structured import StructuredError, structured_spec


class RequestError(ValueError):
    """A request the client must fix; mapped once to an OpenAI error body in ``gateway/errors``.

    Attributes:
        param: the offending parameter path (``messages[2].tool_call_id``), None for the body.
        code: a short machine-readable reason (``invalid_value``, ``unknown_parameter``, ...).
        status: the HTTP status, 400 unless the caller says otherwise (404, 413).
    """

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = "invalid_value",
        status: int = 400,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status

    def to_body(self) -> ErrorBody:
        return error_body(self.message, param=self.param, code=self.code)


# --- decoding and mapping --------------------------------------------------------------------

_CHAT_DECODER = msgspec.json.Decoder(ChatCompletionRequest)
_COMPLETION_DECODER = msgspec.json.Decoder(CompletionRequest)


def decode_chat_request(body: bytes) -> ChatCompletionRequest:
    """Decode and check a ``/v1/chat/completions`` body.

    Raises:
        RequestError: malformed JSON, a wrong type or range, an unknown field, or a semantic
            error (empty messages, unknown tool in ``tool_choice``, ...), naming the parameter.
    """
    req = _decode(_CHAT_DECODER, body)
    _check_common(req)
    _check_chat(req)
    return req


def decode_completion_request(body: bytes) -> CompletionRequest:
    """Decode and check a ``/v1/completions`` body (raises ``RequestError`` as above)."""
    req = _decode(_COMPLETION_DECODER, body)
    _check_common(req)
    if not req.prompt:
        raise RequestError("prompt must not be empty", param="prompt")
    if req.echo:
        raise RequestError("echo=true is not supported", param="echo", code="unsupported_value")
    return req


def to_sampling_spec(
    req: ChatCompletionRequest | CompletionRequest,
    *,
    default_max_tokens: int,
    stop_token_ids: tuple[int, ...] | list[int] = (),
) -> SamplingSpec:
    """The worker's sampling spec for a decoded request; the only OpenAI -> engine mapping.

    ``max_completion_tokens`` wins over ``max_tokens``; absent, ``default_max_tokens`` (the
    caller caps it by the context left). A seed outside [0, 2**63) wraps into it (OpenAI takes
    any int64). Chat ``logprobs``: false/absent -> None, true -> ``top_logprobs`` or 0.
    Stop strings are not here: the gateway matches them on the detokenized text. A forcing
    ``tool_choice`` or a JSON ``response_format`` becomes ``structured`` (``gateway.structured``).

    Raises:
        RequestError: a schema that cannot be enforced, naming its parameter.
    """
    max_tokens, structured = req.max_tokens, None
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens or max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        structured = _structured(req)
    else:
        logprobs = req.logprobs
    return SamplingSpec(
        max_new_tokens=max_tokens or default_max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=None if req.seed is None else req.seed % SEED_LIMIT,
        stop_token_ids=list(stop_token_ids),
        logprobs=logprobs,
        structured=structured,
    )


def _structured(req: ChatCompletionRequest) -> StructuredSpec | None:
    try:
        return structured_spec(req)
    except StructuredError as e:
        raise RequestError(str(e), param=e.param) from None


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise _validation_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise RequestError(
            f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
        ) from None


def _validation_error(text: str) -> RequestError:
    """msgspec's ``"<detail> - at `$.messages[0].role`"`` -> param ``messages[0].role``."""
    detail, _, where = text.partition(" - at `")
    path = where.rstrip("`").removeprefix("$").removeprefix(".")
    field = detail.rsplit("`", 2)[1] if detail.count("`") >= 2 else ""
    if detail.startswith("Object missing required field"):
        param = f"{path}.{field}" if path else field
        return RequestError(
            f"Missing required parameter: '{param}'.",
            param=param,
            code="missing_required_parameter",
        )
    if detail.startswith("Object contains unknown field"):
        param = f"{path}.{field}" if path else field
        return RequestError(
            f"Unrecognized request argument supplied: '{param}'.",
            param=param,
            code="unknown_parameter",
        )
    code = (
        "invalid_type"
        if detail.startswith("Expected `") and ", got `" in detail
        else ("invalid_value")
    )
    if not path:
        return RequestError(f"Invalid request body: {detail}", code=code)
    return RequestError(f"Invalid value for '{path}': {detail}", param=path, code=code)


def _check_common(req: ChatCompletionRequest | CompletionRequest) -> None:
    if req.n is not None and req.n != 1:
        raise RequestError(
            f"n={req.n} is not supported: only one choice per request (n=1)",
            param="n",
            code="unsupported_value",
        )
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise RequestError(
                f"{name} is not supported (only 0)", param=name, code="unsupported_value"
            )
    if req.stream_options is not None and not req.stream:
        raise RequestError(
            "stream_options is only allowed when stream is true", param="stream_options"
        )


def check_json_ints(value: Any, param: str) -> None:
    """Free-form JSON (a tool's or a response format's schema) may hold only integers that fit
    in 64 bits: session stores and the worker protocol encode it as msgpack, and the grammar
    compiler as JSON numbers of that range.

    Raises:
        RequestError: naming ``param``.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, int) and not -(2**63) <= item < 2**64:
            raise RequestError(f"{param} holds the integer {item}, outside 64 bits", param=param)


def _check_chat(req: ChatCompletionRequest) -> None:
    if not req.messages:
        raise RequestError("messages must contain at least one message", param="messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("top_logprobs requires logprobs=true", param="top_logprobs")
    fmt = req.response_format
    if isinstance(fmt, ResponseFormatJsonSchema) and fmt.json_schema.schema is None:
        raise RequestError(
            "response_format json_schema needs a schema",
            param="response_format.json_schema.schema",
            code="missing_required_parameter",
        )
    check_tools(req.tools or [], req.tool_choice)
    _structured(req)  # NOTE: a schema that cannot be enforced is a 400 before any prompt work


def check_tools(tools: list[Tool], choice: ToolChoice | None) -> None:
    """Tool names are unique, their schemas hold only 64-bit integers, and a named
    ``tool_choice`` is one of them (raises RequestError)."""
    names: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.function.name in names:
            raise RequestError(
                f"duplicate tool name {tool.function.name!r}", param=f"tools[{i}].function.name"
            )
        names.add(tool.function.name)
        check_json_ints(tool.function.parameters, f"tools[{i}].function.parameters")
    if choice is None or choice in ("auto", "none"):
        return
    if not tools:
        raise RequestError(
            "tool_choice is only allowed when tools are specified", param="tool_choice"
        )
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise RequestError(
            f"tool_choice names function {choice.function.name!r}, which is not in tools "
            f"({', '.join(sorted(names))})",
            param="tool_choice.function.name",
        )

