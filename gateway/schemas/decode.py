"""Decoding request bodies into Structs with errors that name the parameter, and the one
mapping from OpenAI sampling fields to the worker's ``SamplingSpec``."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import msgspec

from engine.protocol import SamplingSpec
from engine.sampling_params import SEED_LIMIT, StructuredSpec
from gateway.schemas.limits import DEFAULT_LIMITS, RequestLimits
from gateway.schemas.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    Message,
    NamedToolChoice,
    ResponseFormatJsonSchema,
    TextPart,
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


def decode_chat_request(
    body: bytes, limits: RequestLimits = DEFAULT_LIMITS
) -> ChatCompletionRequest:
    """Decode and check a ``/v1/chat/completions`` body, the cheap bounds of ``limits``
    included (``gateway.schemas.limits``).

    Raises:
        RequestError: malformed or too deeply nested JSON, a wrong type or range, an unknown
            field, a bound exceeded, or a semantic error (empty messages, unknown tool in
            ``tool_choice``, ...), naming the parameter.
    """
    req = _decode(_CHAT_DECODER, body)
    _check_common(req)
    _check_chat(req, limits)
    return req


def decode_completion_request(body: bytes) -> CompletionRequest:
    """Decode and check a ``/v1/completions`` body (raises ``RequestError`` as above)."""
    req = _decode(_COMPLETION_DECODER, body)
    _check_common(req)
    if not req.prompt:
        raise RequestError("prompt must not be empty", param="prompt")
    if req.echo:
        raise RequestError("echo=true is not supported", param="echo", code="unsupported_value")
    if req.suffix is not None:
        raise _unsupported("suffix", "suffix is not supported")
    if req.best_of not in (None, 1):
        raise _unsupported("best_of", f"best_of={req.best_of} is not supported (only 1)")
    return req


def prompt_chars(messages: Sequence[Message]) -> int:
    """Characters of the messages' text (content, tool call arguments): a lower bound on what
    the chat template renders, known before rendering."""
    total = 0
    for message in messages:
        content = getattr(message, "content", None)
        if isinstance(content, str):
            total += len(content)
        elif content:
            total += sum(len(part.text) for part in content if isinstance(part, TextPart))
        for call in getattr(message, "tool_calls", None) or ():
            total += len(call.function.arguments) + len(call.function.name)
    return total


def check_max_tokens(
    req: ChatCompletionRequest | CompletionRequest, num_prompt_tokens: int, max_context: int
) -> None:
    """A requested completion length that cannot fit beside the prompt is a 400
    ``context_length_exceeded`` naming the field that asked for it."""
    field, wanted = "max_tokens", req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        field, wanted = "max_completion_tokens", req.max_completion_tokens
    if wanted is not None and num_prompt_tokens + wanted > max_context:
        raise RequestError(
            f"This model's maximum context length is {max_context} tokens. However, you "
            f"requested {num_prompt_tokens + wanted} tokens ({num_prompt_tokens} in the prompt, "
            f"{wanted} for the completion). Please reduce {field} or the prompt.",
            param=field, code="context_length_exceeded",
        )


def check_logit_bias(logit_bias: dict[str, float] | None, vocab_size: int | None) -> None:
    """Token ids of ``logit_bias`` are in the vocabulary (keys are checked at decoding)."""
    if not logit_bias or vocab_size is None:
        return
    for key in logit_bias:
        if int(key) >= vocab_size:
            raise RequestError(
                f"logit_bias token id {key} is outside this model's vocabulary "
                f"[0, {vocab_size})", param="logit_bias",
            )


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
        top_k=req.top_k if req.top_k is not None and req.top_k > 0 else None,
        min_p=req.min_p or 0.0,
        seed=None if req.seed is None else req.seed % SEED_LIMIT,
        stop_token_ids=list(stop_token_ids),
        logprobs=logprobs,
        structured=structured,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=sorted((int(k), v) for k, v in (req.logit_bias or {}).items()),
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
    except RecursionError:
        raise too_deep_error(body) from None


# NOTE: the places free-form JSON may sit, so that a too-deep value names its field rather than
# the 500th level inside it
_FREE_FORM = re.compile(
    r"^(tools\[\d+\]\.function\.parameters|response_format\.json_schema\.schema|"
    r"functions\[\d+\]|messages\[\d+\]\.[^.\[]+|[^.\[]+)"
)
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{},]')
_LOCATE_DEPTH = 256


def too_deep_error(body: bytes | str) -> RequestError:
    """The 400 for JSON msgspec refused to recurse into (~1,000 levels), naming the field
    that holds it (``tools[0].function.parameters``), found by a flat scan of ``body``."""
    data = body.encode() if isinstance(body, str) else body
    path = _deep_path(data, _LOCATE_DEPTH)
    match = _FREE_FORM.match(path or "")
    param = match.group(1) if match else None
    return RequestError(
        f"{param or 'the body'} is nested too deeply (JSON nesting is limited to well under "
        f"1,000 levels; schemas to {DEFAULT_LIMITS.max_schema_depth})", param=param,
    )


def _deep_path(data: bytes, max_depth: int) -> str | None:
    """The path of the first JSON container opened deeper than ``max_depth``."""
    frames: list[list[Any]] = []  # [kind, key or index] per open container
    for token in _JSON_TOKEN.finditer(data):
        text = token.group()
        first = text[:1]
        if first == b'"':
            if frames and frames[-1][0] == b"{" and frames[-1][1] is None:
                frames[-1][1] = _json_key(text)
        elif first in b"{[":
            if len(frames) >= max_depth:
                return "".join(f"[{p}]" if k == b"[" else f".{p}" for k, p in frames).lstrip(".")
            frames.append([first, 0 if first == b"[" else None])
        elif first in b"}]":
            if frames:
                frames.pop()
        elif frames:  # a comma
            frames[-1][1] = frames[-1][1] + 1 if frames[-1][0] == b"[" else None
    return None


def _json_key(text: bytes) -> str:
    try:
        return str(json.loads(text))
    except ValueError:
        return text.decode(errors="replace").strip('"')


def _validation_error(text: str) -> RequestError:
    """msgspec's ``"<detail> - at `$.messages[0].role`"`` -> param ``messages[0].role``."""
    detail, _, where = text.partition(" - at `")
    # NOTE: msgspec writes a dict value's path as `logit_bias[...]`: the field is the dict
    path = where.rstrip("`").removeprefix("$").removeprefix(".").replace("[...]", "")
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


def _unsupported(param: str, message: str) -> RequestError:
    return RequestError(message, param=param, code="unsupported_value")


def _check_common(req: ChatCompletionRequest | CompletionRequest) -> None:
    for key in req.logit_bias or {}:
        if not key.isdigit() or int(key) >= 2**31:
            raise RequestError(
                f"logit_bias keys are token ids (decimal strings), got {key!r}", param="logit_bias"
            )
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


def check_json(
    value: Any, param: str, limits: RequestLimits = DEFAULT_LIMITS, max_nodes: int | None = None
) -> int:
    """Free-form JSON (a tool's or a response format's schema) is at most
    ``limits.max_schema_depth`` containers deep, has at most ``max_nodes`` values (default
    ``limits.max_schema_nodes``), and holds only integers that fit in 64 bits: session stores
    and the worker protocol encode it as msgpack, and the grammar compiler as JSON numbers of
    that range. Iterative: a deep value costs no Python recursion.

    Returns:
        the number of JSON values in ``value``.

    Raises:
        RequestError: naming ``param``.
    """
    budget = limits.max_schema_nodes if max_nodes is None else max_nodes
    stack: list[tuple[Any, int]] = [(value, 1)]
    num_nodes = 0
    while stack:
        item, depth = stack.pop()
        num_nodes += 1
        if num_nodes > budget:
            raise RequestError(
                f"{param} is too large (schemas hold at most {limits.max_schema_nodes} JSON "
                f"values in all)", param=param,
            )
        if isinstance(item, dict | list):
            if depth > limits.max_schema_depth:
                raise RequestError(
                    f"{param} is nested more than {limits.max_schema_depth} levels deep",
                    param=param,
                )
            values = item.values() if isinstance(item, dict) else item
            stack.extend((v, depth + 1) for v in values)
        elif isinstance(item, int) and not -(2**63) <= item < 2**64:
            raise RequestError(f"{param} holds the integer {item}, outside 64 bits", param=param)
    return num_nodes


def check_json_ints(value: Any, param: str) -> None:
    """``check_json`` under the default limits (kept for its callers)."""
    check_json(value, param)


def _check_chat(req: ChatCompletionRequest, limits: RequestLimits) -> None:
    if not req.messages:
        raise RequestError("messages must contain at least one message", param="messages")
    if len(req.messages) > limits.max_messages:
        raise RequestError(
            f"messages holds {len(req.messages)} messages; at most {limits.max_messages} are "
            f"allowed", param="messages",
        )
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("top_logprobs requires logprobs=true", param="top_logprobs")
    _check_legacy_and_audio(req)
    fmt = req.response_format
    if isinstance(fmt, ResponseFormatJsonSchema) and fmt.json_schema.schema is None:
        raise RequestError(
            "response_format json_schema needs a schema",
            param="response_format.json_schema.schema",
            code="missing_required_parameter",
        )
    left = limits.max_schema_nodes - check_tools(req.tools or [], req.tool_choice, limits)
    if isinstance(fmt, ResponseFormatJsonSchema):
        check_json(fmt.json_schema.schema, "response_format.json_schema.schema", limits, left)
    _structured(req)  # NOTE: a schema that cannot be enforced is a 400 before any prompt work


def _check_legacy_and_audio(req: ChatCompletionRequest) -> None:
    """Null, empty or default values are fine; anything else would change the output."""
    if req.functions:
        raise _unsupported("functions", "functions is not supported: use tools")
    if req.function_call not in (None, "none", "auto"):
        raise _unsupported("function_call", "function_call is not supported: use tool_choice")
    if req.audio is not None:
        raise _unsupported("audio", "audio output is not supported")
    if any(m != "text" for m in req.modalities or ()):
        raise _unsupported("modalities", "only the text modality is supported")


def check_tools(
    tools: list[Tool], choice: ToolChoice | None, limits: RequestLimits = DEFAULT_LIMITS
) -> int:
    """At most ``limits.max_tools`` tools, with unique names, bounded schemas holding only
    64-bit integers (``check_json``), and a named ``tool_choice`` is one of them.

    Returns:
        the number of JSON values in all the tools' schemas.

    Raises:
        RequestError: naming the parameter.
    """
    if len(tools) > limits.max_tools:
        raise RequestError(
            f"tools holds {len(tools)} tools; at most {limits.max_tools} are allowed",
            param="tools",
        )
    names: set[str] = set()
    num_nodes = 0
    for i, tool in enumerate(tools):
        if tool.function.name in names:
            raise RequestError(
                f"duplicate tool name {tool.function.name!r}", param=f"tools[{i}].function.name"
            )
        names.add(tool.function.name)
        num_nodes += check_json(tool.function.parameters, f"tools[{i}].function.parameters",
                                limits, limits.max_schema_nodes - num_nodes)
    if choice is None or choice in ("auto", "none"):
        return num_nodes
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
    return num_nodes

