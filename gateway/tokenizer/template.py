"""Chat templates: compile Hub-style Jinja2 templates in a sandbox and render them as HF does.

The environment mirrors `transformers.utils.chat_template_utils` (trim_blocks, lstrip_blocks,
loopcontrols, a `tojson` that does not HTML-escape, `raise_exception`, `strftime_now`, a no-op
`{% generation %}` tag), so a model's own template renders the same text here as in transformers.
"""

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, Any]
# Names a message's reasoning may arrive under; templates read the first (as in transformers).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile `source`. Raises jinja2.TemplateSyntaxError if it does not parse."""
    env = _ChatEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


_DICT_ATTRIBUTES = frozenset(dir(dict))


class _ChatEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with a fast path for what chat templates read most: ``message.role``,
    ``message.content``, ... on the plain dicts ``render_chat`` passes, and ``loop.first``,
    ``loop.previtem``, ... . Both return what the sandbox's ``getattr`` returns: for a ``dict`` and
    a name that is no attribute of ``dict``, ``getattr`` fails and the sandbox falls back to the
    item (safe: an item is data, never an attribute); a ``LoopContext``'s public attributes are
    data or its own safe methods, which the sandbox allows. Every other access (underscore names,
    dict methods, other types) takes the sandbox's checks.
    """

    def getattr(self, obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if kind is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        if kind is jinja2.runtime.LoopContext and not attribute.startswith("_"):
            try:
                return getattr(obj, attribute)
            except AttributeError:
                pass
        return super().getattr(obj, attribute)


def render_chat(
    template: jinja2.Template,
    messages: Sequence[Message],
    *,
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
    variables: Mapping[str, Any],
) -> str:
    """Render `messages` as transformers' `apply_chat_template(..., tokenize=False)` does.

    `variables` are extra template globals (the special tokens, `enable_thinking`, ...).
    Raises jinja2.TemplateError when the template calls `raise_exception`.
    """
    return template.render(
        **variables,
        messages=[normalize_message(m) for m in messages],
        tools=None if tools is None else [dict(t) for t in tools],
        documents=None,
        add_generation_prompt=add_generation_prompt,
    )


def normalize_message(message: Message) -> dict[str, Any]:
    """Drop keys whose value is None (OpenAI clients send `content: null`) and copy reasoning sent
    as `thinking` or `reasoning` to `reasoning_content`, as transformers does."""
    if not isinstance(message, Mapping):
        raise TypeError(f"a chat message must be a mapping, got {type(message).__name__}")
    out = {key: value for key, value in message.items() if value is not None}
    reasoning = next((out[key] for key in _REASONING_FIELDS if key in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; when only rendering, it outputs its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())
