"""OpenAI output constraints as engine grammars (``StructuredSpec``), checked before dispatch.

    | request                                  | grammar                                        |
    |------------------------------------------|------------------------------------------------|
    | tool_choice "required"                   | one or more tool calls, each naming one of     |
    |                                          | `tools`, arguments matching its parameters     |
    |                                          | (exactly one if `parallel_tool_calls` false)   |
    | tool_choice {"function": {"name": f}}    | exactly one call, to f                         |
    | response_format json_object              | any JSON object                                |
    | response_format json_schema              | JSON matching `json_schema.schema`             |
    | otherwise ("auto", "none", text, absent) | none                                           |

A forced tool call is written exactly as the chat template renders one and ``gateway.tool_parser``
parses it: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, calls separated by
"\\n". ``<tool_call>`` and ``</tool_call>`` are
named as special tokens (``<tool_call>`` in llguidance's Lark), so the model emits the marker
token the template uses; the engine resolves the names against the model's tokenizer. JSON is
written as ``json.dumps`` writes it (``engine.grammar.JSON_FORMAT``).

In a forced call's arguments, an object schema without ``additionalProperties`` allows no other
keys (``"additionalProperties": false`` is added to a copy, recursively; LangChain's schemas omit
it, and a JSON schema's default would let the model invent keys). A ``response_format`` schema is
enforced as written.

Every schema is compiled here (without a tokenizer), so one llguidance rejects is a 400 naming
``response_format.json_schema.schema`` or ``tools[i].function.parameters``, never a worker error.
The outcome is cached by grammar text, least recently used first out, within
``COMPILE_CACHE_MAX_BYTES`` (keys and values counted). llguidance is imported only for requests
with a constraint.
"""

import json
import sys
import threading
from collections import OrderedDict
from collections.abc import Hashable
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
COMPILE_CACHE_MAX_BYTES = 16 * 1024 * 1024
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
        # NOTE: a named choice is one call to that function, whatever parallel_tool_calls says
        parallel = only is None and req.parallel_tool_calls is not False
        lark = tool_call_grammar(picked, parallel=parallel)
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
    try:
        closed = closed_objects(params)
    except RecursionError:
        raise StructuredError("function parameters are nested too deeply", param=param) from None
    schema = {**closed, "type": "object", "x-guidance": params.get("x-guidance", JSON_FORMAT)}
    _check(StructuredSpec(json_schema=_dumps(schema)), param)
    return schema


def closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema without ``additionalProperties`` has
    ``"additionalProperties": false`` (the input is not changed). An object schema is one whose
    ``type`` is or includes "object", or that has ``properties``; subschemas are followed through
    the JSON Schema keywords that hold them."""
    if not isinstance(schema, dict):
        return schema
    out = {key: _closed_child(key, value) for key, value in schema.items()}
    if _is_object_schema(schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas"})
_SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_SCHEMA_ONES = frozenset({"items", "additionalProperties", "not", "if", "then", "else",
                          "contains", "unevaluatedProperties", "propertyNames"})


def _closed_child(key: str, value: Any) -> Any:
    if key in _SCHEMA_MAPS and isinstance(value, dict):
        return {name: closed_objects(sub) for name, sub in value.items()}
    if key in _SCHEMA_LISTS and isinstance(value, list):
        return [closed_objects(sub) for sub in value]
    if key in _SCHEMA_ONES:
        return [closed_objects(sub) for sub in value] if isinstance(value, list) else (
            closed_objects(value))
    return value


def _is_object_schema(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or (
        kind is None and "properties" in schema)


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


class CompileCheckCache:
    """Outcomes of ``check_grammar`` (None, or llguidance's error) by spec, least recently used
    first out, bounded in bytes: the spec's grammar text plus the error, as ``sys.getsizeof``
    counts them. A spec larger than the whole bound is not kept. Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        assert max_bytes > 0, f"{max_bytes=}"
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[Hashable, tuple[str | None, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> tuple[bool, str | None]:
        """(whether ``key`` is cached, its outcome)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False, None
            self._entries.move_to_end(key)
            return True, entry[0]

    def put(self, key: Hashable, outcome: str | None, key_bytes: int) -> None:
        num_bytes = key_bytes + sys.getsizeof(outcome)
        if num_bytes > self.max_bytes:
            return
        with self._lock:
            if (old := self._entries.pop(key, None)) is not None:
                self.num_bytes -= old[1]
            self._entries[key] = (outcome, num_bytes)
            self.num_bytes += num_bytes
            while self.num_bytes > self.max_bytes:
                _, (_, evicted_bytes) = self._entries.popitem(last=False)
                self.num_bytes -= evicted_bytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.num_bytes = 0


# NOTE: one per process, like the lru_cache it replaces: the outcome depends on the spec alone
COMPILE_CACHE = CompileCheckCache(COMPILE_CACHE_MAX_BYTES)


def _compile_error(spec: StructuredSpec) -> str | None:
    """None when llguidance compiles ``spec``; its error otherwise (cached either way)."""
    hit, outcome = COMPILE_CACHE.get(spec)
    if hit:
        return outcome
    try:
        check_grammar(spec)
    except GrammarError as e:
        outcome = str(e)
    key_bytes = sys.getsizeof(spec.json_schema or "") + sys.getsizeof(spec.lark or "")
    COMPILE_CACHE.put(spec, outcome, key_bytes)
    return outcome
