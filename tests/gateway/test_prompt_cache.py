"""gateway.prompt_cache: exact tokens against a full render, reuse across resent turns, tenant
and tools isolation, LRU bounds, and the full-render fallback for a non-prefix-stable template."""

import gc
import json
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.prompt_cache import EncodedPrompt, PromptCache, entry_bytes, message_hashes
from gateway.tokenizer import Tokenizer, write_demo_tokenizer

_SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
_TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
_SYSTEM = {"role": "system", "content": "You are a careful agent. " * 8}
# Renders the message count in the system prompt: rendering messages[:k] is never a prefix of
# rendering messages[:k+1].
_COUNTING_TEMPLATE = (
    "<|im_start|>system\n{{ messages | length }} messages<|im_end|>\n"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("demo")
    write_demo_tokenizer(path)
    return Tokenizer.from_dir(path)


@pytest.fixture(scope="module")
def counting_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("counting")
    write_demo_tokenizer(path)
    (path / "chat_template.jinja").write_text(_COUNTING_TEMPLATE, encoding="utf-8")
    return Tokenizer.from_dir(path)


# --- exactness --------------------------------------------------------------------------------


@_SETTINGS
@given(conversation=st.deferred(lambda: _conversations()), data=st.data())
def test_encode_equals_full_render_for_any_split(
    tok: Tokenizer, conversation: tuple[list[dict[str, Any]], Any], data: st.DataObject
) -> None:
    messages, tools = conversation
    cache = PromptCache(tok)
    splits = data.draw(st.lists(st.integers(0, len(messages)), max_size=3).map(sorted))
    for k in [*splits, len(messages)]:
        _assert_exact(tok, cache.encode(messages[:k], tools), messages[:k], tools)
    assert cache.stats.fallbacks == 0, cache.stats


@_SETTINGS
@given(conversation=st.deferred(lambda: _conversations()), data=st.data())
def test_branches_off_a_cached_prefix_are_exact(
    tok: Tokenizer, conversation: tuple[list[dict[str, Any]], Any], data: st.DataObject
) -> None:
    messages, tools = conversation
    cache = PromptCache(tok)
    cache.encode(messages, tools)
    k = data.draw(st.integers(0, len(messages)))
    branch = [*messages[:k], *data.draw(st.lists(_message(), max_size=3))]
    _assert_exact(tok, cache.encode(branch, tools), branch, tools)


# --- reuse ------------------------------------------------------------------------------------


def test_resent_conversation_reuses_previous_turn(tok: Tokenizer) -> None:
    cache = PromptCache(tok)
    history = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 20}
        for i in range(30)
    ]
    turn1 = [_SYSTEM, *history, {"role": "user", "content": "What is the weather in Paris?"}]
    first = cache.encode(turn1, [_WEATHER_TOOL])
    turn2 = [*turn1, _call("get_weather", city="Paris"), _tool_result("sunny")]
    second = cache.encode(turn2, [_WEATHER_TOOL])
    _assert_exact(tok, second, turn2, [_WEATHER_TOOL])
    full_chars = len(tok.apply_chat_template(turn2, [_WEATHER_TOOL]))
    assert second.reused_tokens == len(first.token_ids) - len(tok.encode("<|im_start|>assistant\n"))
    # the template renders the system block, the last cached message and the new ones, 3 times
    assert second.rendered_chars < full_chars / 2, (second.rendered_chars, full_chars)
    assert (cache.stats.hits, cache.stats.misses, cache.stats.fallbacks) == (1, 1, 0), cache.stats


def test_exact_resend_reuses_everything_but_the_generation_prompt(tok: Tokenizer) -> None:
    cache = PromptCache(tok)
    messages = [_SYSTEM, {"role": "user", "content": "hi"}, _tool_result("x")]
    first = cache.encode(messages)
    again = cache.encode(messages)
    assert again.token_ids == first.token_ids
    assert again.reused_tokens == len(tok.encode_chat(messages, add_generation_prompt=False))
    assert cache.num_entries == 1


def test_rendered_chars_per_turn_stay_bounded_by_the_new_messages(tok: Tokenizer) -> None:
    cache = PromptCache(tok)
    messages: list[dict[str, Any]] = [_SYSTEM]
    rendered: list[int] = []
    history_chars: list[int] = []
    for turn in range(20):
        messages += [{"role": "user", "content": f"question {turn} " * 10}]
        encoded = cache.encode(messages, [_TIME_TOOL])
        _assert_exact(tok, encoded, messages, [_TIME_TOOL])
        rendered.append(encoded.rendered_chars)
        history_chars.append(len(tok.apply_chat_template(messages, [_TIME_TOOL])))
        messages += [{"role": "assistant", "content": f"answer {turn} " * 10}]
    # every turn after the first renders the system block, the previous message and the new one
    # (three times: anchor, anchor + new, anchor + new + generation prompt), whatever the history
    assert max(rendered[1:]) <= rendered[1] + 3 * 2 * 20, rendered
    assert history_chars[-1] > 5 * history_chars[1], history_chars  # while the history grew 5x
    assert rendered[-1] < history_chars[-1], (rendered, history_chars)
    assert cache.stats.hits == 19 and cache.stats.fallbacks == 0, cache.stats


# --- isolation --------------------------------------------------------------------------------


def test_different_cache_salt_never_reuses(tok: Tokenizer) -> None:
    cache = PromptCache(tok)
    turn1 = [_SYSTEM, {"role": "user", "content": "secret plan"}]
    cache.encode(turn1, cache_salt="tenant-a")
    turn2 = [*turn1, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
    for salt in ("tenant-b", None):
        other = cache.encode(turn2, cache_salt=salt)
        assert other.reused_tokens == 0, salt
        _assert_exact(tok, other, turn2, None)
    assert cache.encode(turn2, cache_salt="tenant-a").reused_tokens > 0


def test_different_tools_never_reuse(tok: Tokenizer) -> None:
    cache = PromptCache(tok)
    turn1 = [_SYSTEM, {"role": "user", "content": "what time is it?"}]
    cache.encode(turn1, [_TIME_TOOL])
    turn2 = [*turn1, _call("get_time"), _tool_result("noon")]
    for tools in (None, [_WEATHER_TOOL], [_WEATHER_TOOL, _TIME_TOOL], []):
        encoded = cache.encode(turn2, tools)
        assert encoded.reused_tokens == 0, tools
        _assert_exact(tok, encoded, turn2, tools)
    assert cache.encode(turn2, [_TIME_TOOL]).reused_tokens > 0


def test_message_hashes_chain_over_the_seed_and_every_message() -> None:
    a, b = {"role": "user", "content": "a"}, {"content": "b", "role": "user"}
    assert message_hashes(1, [a, b])[0] == message_hashes(1, [a])[0]
    assert message_hashes(1, [a, b]) != message_hashes(2, [a, b])
    assert message_hashes(1, [b, a])[1] != message_hashes(1, [a, b])[1]
    assert message_hashes(1, [dict(reversed(b.items()))]) == message_hashes(1, [b])


# --- bounds -----------------------------------------------------------------------------------


def test_lru_bound_on_entries(tok: Tokenizer) -> None:
    cache = PromptCache(tok, max_entries=3)
    conversations = [[{"role": "user", "content": f"conversation {i}"}] for i in range(5)]
    for messages in conversations:
        cache.encode(messages)
        assert cache.num_entries <= 3
    assert cache.stats.evictions == 2
    assert cache.encode(conversations[0]).reused_tokens == 0  # evicted
    assert cache.encode(conversations[4]).reused_tokens > 0  # kept


def test_lru_bound_on_bytes(tok: Tokenizer) -> None:
    max_bytes = entry_bytes(200)
    cache = PromptCache(tok, max_bytes=max_bytes)
    for i in range(10):
        cache.encode([{"role": "user", "content": f"{i} " + "x" * 40}])
        assert cache.num_bytes <= max_bytes, cache.num_bytes
    assert 0 < cache.num_entries < 10
    cache.encode([{"role": "user", "content": "y" * 500}])  # larger than the whole cache
    assert cache.num_bytes <= max_bytes and cache.num_entries > 0


def test_byte_charge_is_an_upper_bound_on_memory_held(tok: Tokenizer) -> None:
    """What the entries really hold (tracemalloc, with the conversations' own objects freed)
    never exceeds what they are charged, so ``max_bytes`` bounds the gateway's memory."""
    cache = PromptCache(tok, max_bytes=entry_bytes(50_000))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(40):
            words = " ".join(f"w{i}x{j}" for j in range(300))  # ids above 256: no small ints
            cache.encode([{"role": "user", "content": words}])
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert cache.num_entries > 1 and cache.num_bytes <= cache.max_bytes, cache.num_bytes
    assert held <= cache.num_bytes, (held, cache.num_bytes)


def test_concurrent_encodes_from_threads_agree_with_a_full_render(tok: Tokenizer) -> None:
    """The gateway encodes large prompts on threads while small ones run on its loop."""
    cache = PromptCache(tok, max_entries=8)
    history = [{"role": "user", "content": "start"}]
    conversations = [
        [*history, {"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": f"u{i}"}]
        for i in range(16)
    ]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda m: cache.encode(m).token_ids, conversations * 4))
    for messages, ids in zip(conversations * 4, results, strict=True):
        assert ids == tok.encode_chat(messages, add_generation_prompt=True)
    assert cache.num_entries <= 8


def test_extended_prefix_is_evicted_before_other_conversations(tok: Tokenizer) -> None:
    cache = PromptCache(tok, max_entries=2)
    other = [{"role": "user", "content": "other"}]
    turn1 = [{"role": "user", "content": "mine"}]
    cache.encode(turn1)
    cache.encode(other)
    cache.encode([*turn1, {"role": "assistant", "content": "ok"}])  # evicts turn1, not other
    assert cache.encode(other).reused_tokens > 0


# --- fallback ---------------------------------------------------------------------------------


def test_non_prefix_stable_template_falls_back_to_a_full_render(counting_tok: Tokenizer) -> None:
    cache = PromptCache(counting_tok)
    messages = [{"role": "user", "content": "a"}]
    for turn in range(4):
        encoded = cache.encode(messages)
        _assert_exact(counting_tok, encoded, messages, None)
        assert encoded.reused_tokens == 0, turn
        messages = [*messages, {"role": "assistant", "content": f"r{turn}"}, messages[0]]
    assert cache.stats.hits == 0 and cache.stats.fallbacks == 3, cache.stats


def test_empty_conversation_is_rendered_in_full(tok: Tokenizer) -> None:
    cache = PromptCache(tok)
    _assert_exact(tok, cache.encode([], [_TIME_TOOL]), [], [_TIME_TOOL])
    assert cache.num_entries == 0


# --- helpers ----------------------------------------------------------------------------------


def _assert_exact(tok: Tokenizer, encoded: EncodedPrompt, messages: Any, tools: Any) -> None:
    expected = tok.encode_chat(messages, tools, add_generation_prompt=True)
    assert encoded.token_ids == expected, (
        f"cache gave {tok.decode(encoded.token_ids)!r}\nfull render {tok.decode(expected)!r}"
    )
    assert 0 <= encoded.reused_tokens <= len(expected)


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    call = {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _tool_result(content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": "call_1", "content": content}


_TEXT = st.text(max_size=12)
_CONTENT = _TEXT | st.none() | st.lists(st.builds(lambda t: {"type": "text", "text": t}, _TEXT))
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
def _conversations(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    messages = draw(st.lists(_message(), max_size=8))
    tools = draw(st.none() | st.lists(st.sampled_from([_WEATHER_TOOL, _TIME_TOOL]), max_size=2))
    return messages, tools


def test_a_conversation_keeps_its_name_across_turns_and_nobody_shares_it(tok: Tokenizer) -> None:
    """``EncodedPrompt.conversation`` (the router's page hasher extends a chain under it): the
    same for every turn of one chat, another for another first question, another tenant or
    other tools, and there for a full render too."""
    cache = PromptCache(tok)
    turns = [_SYSTEM, {"role": "user", "content": "Plan a trip."},
             {"role": "assistant", "content": "Where to?"}, {"role": "user", "content": "Oslo"}]
    names = {cache.encode(turns[:k]).conversation for k in (2, 4)}
    assert len(names) == 1 and None not in names
    other_question = [_SYSTEM, {"role": "user", "content": "Plan a party."}]
    assert cache.encode(other_question).conversation not in names
    assert cache.encode(turns[:2], cache_salt="t-other").conversation not in names
    assert cache.encode(turns[:2], [_TIME_TOOL]).conversation not in names
    assert cache.encode(turns[:1]).conversation is not None  # NOTE: one message: its own name
    assert PromptCache(tok).encode(turns[:4]).conversation in names  # NOTE: not per process
