"""OpenAI output constraints as engine grammars (``StructuredSpec``), checked before dispatch.

    | request                                  | grammar                                        |
    |------------------------------------------|------------------------------------------------|
    | tool_choice "required"                   | one or more tool calls, each naming one of     |
    |                                          | `tools`, arguments matching its parameters     |
    | tool_choice {"function": {"name": f}}    | the same, f only                               |
    | response_format json_object              | any JSON object                                |
    | response_format json_schema              | JSON matching `json_schema.schema`             |
    | otherwise ("auto", "none", text, absent) | none                                           |

A forced tool call is written exactly as the chat template renders one and ``gateway.tool_parser``
parses it: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, calls separated by
"\\n" (one call when ``parallel_tool_calls`` is false). ``<tool_call>`` and ``</tool_call>`` are
named as special tokens (``<tool_call>`` in llguidance's Lark), so the model emits the marker
token the template uses; the engine resolves the names against the model's tokenizer. JSON is
written as ``json.dumps`` writes it (``engine.grammar.JSON_FORMAT``).

Every schema is compiled here (without a tokenizer), so one llguidance rejects is a 400 naming
``response_format.json_schema.schema`` or ``tools[i].function.parameters``, never a worker error.
llguidance is imported only for requests with a constraint.
"""

import json
from functools import lru_cache
from typing import Any

from engine.grammar import JSON_FORMAT, GrammarError, check_grammar
from engine.sampling_params import StructuredSpec
from gateway.schemas.requests import (
    ChatCompletionRequest,
    NamedToolChoice,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    Tool,
)

ANY_JSON_OBJECT = '{"type": "object"}'
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


class StructuredError(ValueError):
    """A constraint that cannot be enforced; ``param`` is the request field at fault."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


def structured_spec(req: ChatCompletionRequest) -> StructuredSpec | None:
    """The grammar a chat request's output must follow (None: unconstrained), checked.

    A forcing ``tool_choice`` wins over ``response_format``.

    Raises:
        StructuredError: a schema llguidance cannot compile, or tool parameters that are not an
            object schema, naming the parameter.
    """
    choice, tools = req.tool_choice, req.tools or []
    if tools and (choice == "required" or isinstance(choice, NamedToolChoice)):
        only = choice.function.name if isinstance(choice, NamedToolChoice) else None
        picked = [(i, t) for i, t in enumerate(tools) if only in (None, t.function.name)]
        lark = tool_call_grammar(picked, parallel=req.parallel_tool_calls is not False)
        _check(StructuredSpec(lark=lark), "tool_choice")
        return StructuredSpec(lark=lark)
    fmt = req.response_format
    if isinstance(fmt, ResponseFormatJsonObject):
        return StructuredSpec(json_schema=ANY_JSON_OBJECT)
    if isinstance(fmt, ResponseFormatJsonSchema) and fmt.json_schema.schema is not None:
        spec = StructuredSpec(json_schema=_dumps(fmt.json_schema.schema))
        _check(spec, "response_format.json_schema.schema")
        return spec
    return None


def tool_call_grammar(tools: list[tuple[int, Tool]], *, parallel: bool) -> str:
    """llguidance Lark for tool calls to ``tools`` (``(index in the request, tool)`` pairs).

    Raises:
        StructuredError: a tool's parameters are not an object schema or do not compile.
    """
    rules = [f"fn_{i}: {_lark_str(_call_prefix(t.function.name))} "
             f"%json{_dumps(_arguments_schema(i, t))} \"}}\"" for i, t in tools]
    alternatives = " | ".join(f"fn_{i}" for i, _ in tools)
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join([start, f'call: <tool_call> "\\n" ({alternatives}) "\\n" </tool_call>',
                      *rules]) + "\n"


def _arguments_schema(index: int, tool: Tool) -> dict[str, Any]:
    params, param = tool.function.parameters, f"tools[{index}].function.parameters"
    if not params:
        return {**_NO_ARGUMENTS, "x-guidance": JSON_FORMAT}
    if params.get("type", "object") != "object":
        raise StructuredError(
            f"function parameters must be an object schema (type \"object\"), got type "
            f"{params['type']!r}", param=param,
        )
    schema = {**params, "type": "object", "x-guidance": params.get("x-guidance", JSON_FORMAT)}
    _check(StructuredSpec(json_schema=_dumps(schema)), param)
    return schema


def _call_prefix(name: str) -> str:
    # NOTE: the chat template's `'{"name": ' + (name | tojson) + ', "arguments": '`
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '


def _lark_str(text: str) -> str:
    """A Lark string literal (JSON escapes, which llguidance's Lark reads)."""
    return json.dumps(text, ensure_ascii=False)


def _dumps(obj: Any) -> str:
    # NOTE: key order kept: llguidance writes properties in the schema's order
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _check(spec: StructuredSpec, param: str) -> None:
    error = _compile_error(spec)
    if error is not None:
        raise StructuredError(f"{param} cannot be enforced: {error}", param=param)


@lru_cache(maxsize=256)
def _compile_error(spec: StructuredSpec) -> str | None:
    """None when llguidance compiles ``spec``; its error otherwise (cached either way)."""
    try:
        check_grammar(spec)
    except GrammarError as e:
        return str(e)
    return None
