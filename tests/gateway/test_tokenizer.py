"""gateway.tokenizer: demo files, encode/decode, chat template parity with transformers,
prefix stability of the template, streaming detokenization and load errors."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.tokenizer import DEMO_VOCAB_SIZE_MIN, StreamDecoder, Tokenizer, write_demo_tokenizer
from gateway.tokenizer.demo import DEMO_SPECIAL_TOKENS, byte_to_unicode

_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_DEMO_FILES = (
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
_WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
_TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {}}}


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("demo")
    write_demo_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(demo_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir)


@pytest.fixture(scope="module")
def hf_tok(demo_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(demo_dir))


# --- demo files -------------------------------------------------------------------------------


def test_demo_files_are_byte_identical_across_writes(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    write_demo_tokenizer(first)
    write_demo_tokenizer(second)
    write_demo_tokenizer(second)  # overwriting gives the same bytes too
    assert sorted(p.name for p in first.iterdir()) == list(_DEMO_FILES)
    for name in _DEMO_FILES:
        digest_a = hashlib.sha256((first / name).read_bytes()).hexdigest()
        digest_b = hashlib.sha256((second / name).read_bytes()).hexdigest()
        assert digest_a == digest_b, f"{name}: {digest_a} != {digest_b}"
        assert (first / name).read_bytes().endswith(b"}\n"), name


def test_demo_vocab_layout(tok: Tokenizer) -> None:
    assert DEMO_VOCAB_SIZE_MIN == 270
    assert tok.vocab_size == DEMO_VOCAB_SIZE_MIN
    assert tok.model_max_length is not None and tok.model_max_length > 0
    chars = byte_to_unicode()
    assert sorted(chars) == list(range(256)) and len(set(chars.values())) == 256
    for byte, char in chars.items():
        assert tok.token_to_id(char) == byte, f"byte {byte} spelled {char!r}"


def test_specials_map_to_their_ids(tok: Tokenizer) -> None:
    for offset, token in enumerate(DEMO_SPECIAL_TOKENS):
        assert tok.token_to_id(token) == 256 + offset, token
        assert tok.encode(f"a{token}b") == [ord("a"), 256 + offset, ord("b")], token
        assert tok.decode([256 + offset]) == token
    assert tok.eos_token_ids == (258, 256)  # <|im_end|>, <|endoftext|>
    assert tok.pad_token_id == 265
    assert tok.special_ids == frozenset({256, 257, 258, 265, 266, 267, 268, 269})
    ids = tok.encode("<|im_start|>x<tool_call>y</tool_call><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "x<tool_call>y</tool_call>"


# --- encode / decode --------------------------------------------------------------------------


@_SETTINGS
@given(text=st.text())
def test_encode_decode_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    if "<" not in text:  # no special-token strings: one token per UTF-8 byte
        assert ids == list(text.encode("utf-8"))


@_SETTINGS
@given(parts=st.lists(st.text(max_size=8) | st.sampled_from(DEMO_SPECIAL_TOKENS), max_size=8))
def test_encode_matches_transformers(tok: Tokenizer, hf_tok: Any, parts: list[str]) -> None:
    text = "".join(parts)
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=True) == hf_tok.encode(text)


# --- chat template ----------------------------------------------------------------------------

_CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "system-user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi! 你好 👋"},
    ],
    "multi-turn": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "3+3?"}],
        },
    ],
    "tool-call-dict-args": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21C"},
        {"role": "assistant", "content": "Sunny, 21C.", "thinking": "Tool said so."},
    ],
    "tool-calls-string-args-parallel": [
        {"role": "user", "content": "Weather and time?"},
        {
            "role": "assistant",
            "content": "Checking both.",
            "reasoning_content": "Two tools at once.",
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": '{"city":  "Oslo"}'}},
                {"name": "get_time", "arguments": "{}"},
            ],
        },
        {"role": "tool", "content": "snow"},
        {"role": "tool", "content": [{"type": "text", "text": "12:00"}]},
    ],
    "tool-result-then-user": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "content": "09:30"},
        {"role": "user", "content": "thanks"},
    ],
}


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("tools", [None, [_WEATHER_TOOL, _TIME_TOOL]], ids=["no-tools", "tools"])
@pytest.mark.parametrize("name", list(_CONVERSATIONS))
def test_chat_template_matches_transformers(
    tok: Tokenizer,
    hf_tok: Any,
    name: str,
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
) -> None:
    messages = _CONVERSATIONS[name]
    ours = tok.apply_chat_template(messages, tools, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours == theirs
    assert tok.encode_chat(messages, tools, add_generation_prompt) == hf_tok.encode(
        theirs, add_special_tokens=False
    )


def test_chat_template_renders_qwen_layout(tok: Tokenizer) -> None:
    text = tok.apply_chat_template(_CONVERSATIONS["tool-calls-string-args-parallel"], [_TIME_TOOL])
    assert text == (
        "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query. For each function call, return a JSON object with the function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n'
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_time", "parameters": {}}}\n'
        "</tools><|im_end|>\n"
        "<|im_start|>user\nWeather and time?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo tools at once.\n</think>\n\nChecking both.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city":  "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsnow\n</tool_response>\n"
        "<tool_response>\n12:00\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@_SETTINGS
@given(conversation=st.deferred(lambda: _conversations()))
def test_chat_template_is_prefix_stable(
    tok: Tokenizer, conversation: tuple[list[dict[str, Any]], list[dict[str, Any]] | None]
) -> None:
    messages, tools = conversation
    for k in range(len(messages)):
        head = tok.apply_chat_template(messages[:k], tools, add_generation_prompt=False)
        longer = tok.apply_chat_template(messages[: k + 1], tools, add_generation_prompt=False)
        _assert_prefix(head, longer, k)
        _assert_prefix(tok.encode(head), tok.encode(longer), k)
        if messages[k]["role"] == "assistant":  # a prompt + the model's reply = the next render
            prompt = tok.apply_chat_template(messages[:k], tools, add_generation_prompt=True)
            _assert_prefix(prompt, longer, k)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=st.deferred(lambda: _conversations()), add_generation_prompt=st.booleans())
def test_chat_template_matches_transformers_on_random_chats(
    tok: Tokenizer,
    hf_tok: Any,
    conversation: tuple[list[dict[str, Any]], list[dict[str, Any]] | None],
    add_generation_prompt: bool,
) -> None:
    messages, tools = conversation
    if not messages:
        return  # transformers rejects an empty conversation
    ours = tok.apply_chat_template(messages, tools, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours == theirs


def test_template_helpers_behave_like_transformers(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no ' + m.role) }}"
        "{% endif %}{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}"
    )
    tok = _load_with_config(tmp_path, chat_template=template)
    assert tok.apply_chat_template([{"role": "user", "content": "<é>"}]) == (
        '{"role": "user", "content": "<é>"}'
    )
    with pytest.raises(jinja2.TemplateError, match="no bad"):
        tok.apply_chat_template([{"role": "bad", "content": ""}])


# --- streaming detokenization -----------------------------------------------------------------

_WIDE_CHARS = ["é", "ß", "中", "文字", "😀", "👩‍👩‍👧", "𝔘", "\u0301", "한국어"]


@_SETTINGS
@given(
    pieces=st.lists(
        st.sampled_from(_WIDE_CHARS) | st.characters(codec="utf-8", exclude_characters="\ufffd"),
        min_size=1,
        max_size=30,
    )
)
def test_stream_decoder_emits_whole_characters_as_soon_as_complete(
    tok: Tokenizer, pieces: list[str]
) -> None:
    text = "".join(pieces)
    data = text.encode("utf-8")
    decoder = StreamDecoder(tok)
    emitted = ""
    for i, byte in enumerate(data):  # demo ids: one token per byte, id == byte value
        emitted += decoder.feed(byte)
        complete = data[: i + 1].decode("utf-8", errors="ignore")
        assert emitted == complete, f"after byte {i} of {data!r}: {emitted!r} != {complete!r}"
    assert decoder.flush() == ""
    assert emitted == text


def test_stream_decoder_flushes_invalid_bytes_as_replacement(tok: Tokenizer) -> None:
    decoder = StreamDecoder(tok)
    assert [decoder.feed(i) for i in (0xFF, 0x41)] == ["", "\ufffdA"]
    assert [decoder.feed(i) for i in (0xE4, 0xB8)] == ["", ""]  # first 2 bytes of 中
    assert decoder.feed(0x41) == "\ufffdA"  # 中 never completed
    assert decoder.feed(0xF0) == ""
    assert decoder.flush() == "\ufffd"
    assert decoder.feed(0x42) == "B"  # flush starts over


def test_stream_decoder_specials(tok: Tokenizer) -> None:
    ids = tok.encode("hi<tool_call>中<|im_end|>")
    plain, skipping = StreamDecoder(tok), StreamDecoder(tok, skip_special_tokens=True)
    assert "".join(plain.feed(i) for i in ids) + plain.flush() == "hi<tool_call>中<|im_end|>"
    assert "".join(skipping.feed(i) for i in ids) + skipping.flush() == "hi<tool_call>中"


# --- loading ----------------------------------------------------------------------------------


def test_missing_files_raise_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        Tokenizer.from_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    write_demo_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("eos_token", 7),
        ("eos_token", "<|not-a-token|>"),
        ("pad_token", {"content": 3}),
        ("chat_template", {"default": "x"}),
        ("chat_template", "{% if %}"),
        ("model_max_length", -1),
    ],
)
def test_malformed_tokenizer_config_names_the_key(tmp_path: Path, key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=key):
        _load_with_config(tmp_path, **{key: value})


def test_malformed_json_names_the_file(tmp_path: Path) -> None:
    write_demo_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{oops", encoding="utf-8")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path)


def test_chat_template_sources(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert _load_with_config(tmp_path, chat_template=named).apply_chat_template([]) == "D"
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }}", encoding="utf-8")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user"}]) == "1"
    (tmp_path / "chat_template.jinja").unlink()
    tok = _load_with_config(tmp_path, chat_template=None)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_import_pulls_in_no_torch_transformers_or_litestar() -> None:
    code = (
        "import sys, gateway.tokenizer; "
        "print(sorted({'torch', 'transformers', 'litestar'} & set(sys.modules)))"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


# --- helpers ----------------------------------------------------------------------------------


def _load_with_config(model_dir: Path, **overrides: Any) -> Tokenizer:
    write_demo_tokenizer(model_dir)
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**config, **overrides}), encoding="utf-8")
    return Tokenizer.from_dir(model_dir)


def _assert_prefix(head: Any, longer: Any, k: int) -> None:
    assert longer[: len(head)] == head, f"messages[:{k}] is not a prefix:\n{head!r}\n{longer!r}"


_TEXT = st.text(max_size=12)
_CONTENT = (
    _TEXT
    | st.none()
    | st.lists(
        st.builds(lambda text: {"type": "text", "text": text}, _TEXT)
        | st.just({"type": "image_url", "image_url": {"url": "http://x/y.png"}}),
        max_size=3,
    )
)
_ARGUMENTS = st.dictionaries(st.text(max_size=5), st.integers() | _TEXT | st.booleans(), max_size=3)


@st.composite
def _tool_call(draw: st.DrawFn) -> dict[str, Any]:
    arguments = draw(_ARGUMENTS)
    call = {
        "name": draw(st.sampled_from(["get_weather", "get_time", "ünï"])),
        "arguments": json.dumps(arguments) if draw(st.booleans()) else arguments,
    }
    return {"type": "function", "function": call} if draw(st.booleans()) else call


@st.composite
def _message(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(st.sampled_from(["user", "assistant", "tool", "tool", "system"]))
    message: dict[str, Any] = {"role": role, "content": draw(_CONTENT)}
    if role == "assistant":
        if draw(st.booleans()):
            message["tool_calls"] = draw(st.lists(_tool_call(), min_size=1, max_size=2))
        if draw(st.booleans()):
            message["reasoning_content"] = draw(_TEXT)
    return message


@st.composite
def _conversations(
    draw: st.DrawFn,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    messages = draw(st.lists(_message(), max_size=7))
    tools = draw(st.none() | st.lists(st.sampled_from([_WEATHER_TOOL, _TIME_TOOL]), max_size=2))
    return messages, tools


@_SETTINGS
@given(
    ids=st.lists(st.integers(0, 265), min_size=1, max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    skip=st.booleans(),
)
def test_stream_decoder_feed_many_matches_feed(
    tok: Tokenizer, ids: list[int], cuts: list[int], skip: bool
) -> None:
    """Any split of any ids (invalid UTF-8 and specials included) into chunks gives, chunk by
    chunk, what ``feed`` gives token by token."""
    bounds = sorted({0, len(ids), *(c for c in cuts if c < len(ids))})
    one = StreamDecoder(tok, skip_special_tokens=skip)
    many = StreamDecoder(tok, skip_special_tokens=skip)
    for a, b in zip(bounds, bounds[1:], strict=False):
        assert many.feed_many(ids[a:b]) == "".join(one.feed(t) for t in ids[a:b]), (ids, a, b)
    assert many.flush() == one.flush()


_FAST_PATH_TEMPLATE = (
    "{% for m in messages %}{{ loop.index }}{{ loop.first }}{{ loop.last }}"
    "{% if loop.previtem %}<{{ loop.previtem.role }}>{% endif %}{{ loop.cycle('a', 'b') }}"
    "{{ m.role }}:{{ m.content }}|{{ m.name is defined }}|{{ m.get('name', '-') }}"
    "|{{ m.items() | list | length }}|{{ m['role'] }}|{{ m.keys | string | length > 0 }}"
    "{% endfor %}"
)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "u", "name": "n"},
     {"role": "assistant", "content": "a", "items": "shadowed key"}],
])
def test_the_templates_fast_attribute_path_renders_what_the_sandbox_does(
    messages: list[dict[str, str]],
) -> None:
    """``template._ChatEnvironment`` answers ``dict`` and ``loop`` attributes without the
    sandbox's checks: the same text as the plain sandbox, dict methods (``get``, ``items``,
    even shadowed by a key) still resolve as methods, a missing key is undefined."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from gateway.tokenizer.template import compile_chat_template

    plain = ImmutableSandboxedEnvironment().from_string(_FAST_PATH_TEMPLATE)
    fast = compile_chat_template(_FAST_PATH_TEMPLATE)
    assert fast.render(messages=messages) == plain.render(messages=messages)


@pytest.mark.parametrize("expr", ["m.__class__.__mro__", "loop._iterator", "m.__init__",
                                  "m.update({'role': 'x'})", "loop.__class__.__init__",
                                  "m.clear()", "loop._after"])
def test_the_fast_attribute_path_keeps_the_sandbox(expr: str) -> None:
    """Underscore names and mutating dict methods take the sandbox's path: the same refusal
    (``SecurityError``) or the same empty undefined as the plain sandbox, never the object."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from gateway.tokenizer.template import compile_chat_template

    source = "{% for m in messages %}{{ " + expr + " }}{% endfor %}"

    def outcome(template: Any) -> str:
        try:
            return "text:" + template.render(messages=[{"role": "user", "content": "x"}])
        except Exception as exc:  # noqa: BLE001 - the outcome compared is the exception's type
            return f"raised:{type(exc).__name__}"

    fast = outcome(compile_chat_template(source))
    assert fast == outcome(ImmutableSandboxedEnvironment().from_string(source))
    assert fast in ("text:", "raised:SecurityError"), fast
