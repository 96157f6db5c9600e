"""gateway.tool_parser: round trips through the chat template, stream/whole-text equivalence over
random splits, held-back partial markers, malformed and unterminated blocks."""

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.tokenizer.demo import demo_chat_template
from gateway.tokenizer.template import compile_chat_template, render_chat
from gateway.tool_parser import (
    ContentDelta,
    ParsedOutput,
    ToolCall,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallError,
    ToolCallEvent,
    ToolCallStart,
    ToolCallStreamParser,
    parse_tool_calls,
    tool_call_id,
)

_SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_TEMPLATE = compile_chat_template(demo_chat_template())
_SEED = "seed"
_MARKERS = ("<tool_call>", "</tool_call>")


def _no_marker(text: str) -> bool:
    return not any(marker in text for marker in _MARKERS)


_PIECE = st.text(st.characters(codec="utf-8"), max_size=3) | st.sampled_from(
    ["<", "<tool_", "call>", "\n", " ", "é", "🙂"]
)
_TEXT = st.lists(_PIECE, max_size=5).map("".join).filter(_no_marker)
_JSON_SCALAR = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT
)
_JSON = st.recursive(
    _JSON_SCALAR,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=8,
)
_ARGUMENTS = st.dictionaries(_TEXT, _JSON, max_size=4)
_NAME = st.text(min_size=1, max_size=16).filter(_no_marker)
# (name, arguments, sent to the template as a compact JSON string rather than a dict)
_CALL = st.tuples(_NAME, _ARGUMENTS, st.booleans())


@_SETTINGS
@given(content=_TEXT, calls=st.lists(_CALL, max_size=3))
def test_round_trip_through_template(content: str, calls: list[tuple[str, Any, bool]]) -> None:
    text = _render_assistant(content, calls)
    parsed = parse_tool_calls(text, id_seed=_SEED)
    assert parsed == ParsedOutput(content.strip(), _expected_calls(calls), []), text


@_SETTINGS
@given(content=_TEXT, calls=st.lists(_CALL, max_size=3), data=st.data())
def test_stream_matches_whole_text_at_any_split(
    content: str, calls: list[tuple[str, Any, bool]], data: st.DataObject
) -> None:
    text = _render_assistant(content, calls)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    _assert_stream_matches(text, _split(text, cuts))


@_SETTINGS
@given(pieces=st.lists(_TEXT | st.sampled_from([*_MARKERS, "{", "}", '"name"']), max_size=12))
def test_stream_matches_whole_text_on_arbitrary_text(pieces: list[str]) -> None:
    text = "".join(pieces)
    _assert_stream_matches(text, list(text))


def test_ids_are_pinned_by_seed_and_index() -> None:
    assert tool_call_id("a", 0) == tool_call_id("a", 0)
    assert len({tool_call_id("a", 0), tool_call_id("a", 1), tool_call_id("b", 0)}) == 3
    call_id = tool_call_id("a", 0)
    assert call_id.startswith("call_") and len(call_id) == 5 + 24, call_id
    int(call_id.removeprefix("call_"), 16)


def test_partial_marker_is_held_back() -> None:
    parser = ToolCallStreamParser(id_seed=_SEED)
    assert parser.feed("Hello <tool_") == [ContentDelta("Hello")]
    events = parser.feed('call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert events == [
        ToolCallStart(0, tool_call_id(_SEED, 0), "f"),
        ToolCallArgumentsDelta(0, '{"x": 1}'),
        ToolCallEnd(0),
    ]
    assert parser.feed(" <tool") == []
    # NOTE: the space before <tool_call> was held back; it is content again once text follows.
    assert parser.feed("box>") == [ContentDelta("  <toolbox>")]
    assert parser.finish() == []


def test_partial_marker_at_the_end_is_content() -> None:
    parser = ToolCallStreamParser(id_seed=_SEED)
    assert parser.feed("a <tool_ca") == [ContentDelta("a")]
    assert parser.finish() == [ContentDelta(" <tool_ca")]


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ('{"name": "f", "arguments": {', "malformed JSON"),
        ('["f"]', "expected a JSON object"),
        ('{"arguments": {}}', "'name'"),
        ('{"name": 3}', "'name'"),
        ('{"name": "f", "arguments": "{oops"}', "not valid JSON"),
        ('{"name": "f", "arguments": {"x": NaN}}', "malformed JSON"),
    ],
)
def test_malformed_block_stays_in_content(body: str, error: str) -> None:
    good = '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    text = f"Hi\n<tool_call>\n{body}\n</tool_call>\n{good}"
    parsed = parse_tool_calls(text, id_seed=_SEED)
    assert parsed.content == f"Hi\n<tool_call>\n{body}\n</tool_call>", parsed
    assert parsed.tool_calls == [ToolCall(id=tool_call_id(_SEED, 0), name="g", arguments="{}")]
    assert len(parsed.errors) == 1 and error in parsed.errors[0], parsed.errors
    _assert_stream_matches(text, list(text))


def test_arguments_string_passes_through_and_missing_arguments_are_empty() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\":[1, 2]}"}</tool_call>'
    text += '<tool_call>{"name": "g"}</tool_call>'
    parsed = parse_tool_calls(text, id_seed=_SEED)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("f", '{"a":[1, 2]}'),
        ("g", "{}"),
    ]


def test_unterminated_block_is_dropped_with_an_error() -> None:
    """A call cut off (max_tokens) leaks no markup into content (issue 8, item 18)."""
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": '
    parsed = parse_tool_calls(text, id_seed=_SEED)
    assert parsed.content == "Sure." and parsed.tool_calls == [], parsed
    assert len(parsed.errors) == 1 and "unterminated" in parsed.errors[0], parsed.errors
    _assert_stream_matches(text, list(text))


def _render_assistant(content: str, calls: list[tuple[str, Any, bool]]) -> str:
    tool_calls = [
        {"type": "function", "function": {"name": name, "arguments": _sent(args, as_string)}}
        for name, args, as_string in calls
    ]
    message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
    rendered = render_chat(
        _TEMPLATE, [message], tools=None, add_generation_prompt=False, variables={}
    )
    prefix, suffix = "<|im_start|>assistant\n", "<|im_end|>\n"
    assert rendered.startswith(prefix) and rendered.endswith(suffix), rendered
    return rendered[len(prefix) : -len(suffix)]


def _sent(args: Any, as_string: bool) -> Any:
    return json.dumps(args, separators=(",", ":")) if as_string else args


def _expected_calls(calls: list[tuple[str, Any, bool]]) -> list[ToolCall]:
    # NOTE: the template inlines string arguments raw, so the model writes an object either way
    # and the parser re-serializes it with the template's `tojson` defaults.
    return [
        ToolCall(
            id=tool_call_id(_SEED, i), name=name, arguments=json.dumps(args, ensure_ascii=False)
        )
        for i, (name, args, _) in enumerate(calls)
    ]


def _split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _assert_stream_matches(text: str, deltas: list[str]) -> None:
    parser = ToolCallStreamParser(id_seed=_SEED)
    events = [event for delta in deltas for event in parser.feed(delta)] + parser.finish()
    streamed = _collect(events)
    expected = parse_tool_calls(text, id_seed=_SEED)
    assert streamed == expected, f"text={text!r} deltas={deltas!r} events={events!r}"


def _collect(events: list[ToolCallEvent]) -> ParsedOutput:
    """Rebuild a ParsedOutput as an OpenAI client would, checking start/arguments/end order."""
    content: list[str] = []
    calls: list[ToolCall] = []
    errors: list[str] = []
    open_call: list[Any] | None = None
    for event in events:
        match event:
            case ContentDelta(text):
                assert open_call is None and text, events
                content.append(text)
            case ToolCallStart(index, call_id, name):
                assert open_call is None and index == len(calls), events
                open_call = [call_id, name, ""]
            case ToolCallArgumentsDelta(index, text):
                assert open_call is not None and index == len(calls), events
                open_call[2] += text
            case ToolCallEnd(index):
                assert open_call is not None and index == len(calls), events
                calls.append(ToolCall(id=open_call[0], name=open_call[1], arguments=open_call[2]))
                open_call = None
            case ToolCallError(message):
                errors.append(message)
    assert open_call is None, events
    return ParsedOutput("".join(content), calls, errors)
