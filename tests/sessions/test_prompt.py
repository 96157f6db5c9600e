"""Incremental prompts equal full renders: for random conversations (system or not, tools or
not, user / assistant / tool-call / tool-result messages, awkward text) cut into random turns,
``SessionPrompter.render`` with the stored prefix ids gives exactly
``tokenizer.encode_chat(all messages, tools, add_generation_prompt=True)``, and does so
incrementally (no full-render fallback) on the demo template."""

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.tokenizer import Tokenizer, write_demo_tokenizer
from sessions import SessionPrompter

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": {"type": "object"}}}]
_piece = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=6) | (
    st.sampled_from([" ", "\n", "<|im_end|>", "<tool_call>", "</tool_response>", "  x", "🙂"])
)
_text = st.lists(_piece, max_size=4).map("".join)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out: Path = tmp_path_factory.mktemp("tok")
    write_demo_tokenizer(out)
    return Tokenizer.from_dir(out)


@st.composite
def _conversation(draw: st.DrawFn) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(_text)})
    for i in range(draw(st.integers(1, 6))):
        messages.append({"role": "user", "content": draw(_text)})
        calls = draw(st.integers(0, 2))
        assistant: dict[str, Any] = {"role": "assistant", "content": draw(_text)}
        if draw(st.booleans()):
            assistant["reasoning_content"] = draw(_text)
        if calls:
            assistant["tool_calls"] = [
                {"id": f"c{i}{j}", "type": "function",
                 "function": {"name": "get_weather", "arguments": draw(st.sampled_from(
                     ['{"city": "Paris"}', "{}", '{"q": "a\\nb"}']))}}
                for j in range(calls)
            ]
        messages.append(assistant)
        messages += [{"role": "tool", "tool_call_id": f"c{i}{j}", "content": draw(_text)}
                     for j in range(calls)]
    return messages


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=_conversation(), with_tools=st.booleans(), data=st.data())
def test_incremental_equals_full_render(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], with_tools: bool, data: st.DataObject
) -> None:
    tools = TOOLS if with_tools else None
    prompter = SessionPrompter.for_tokenizer(tokenizer, verify_first=0)  # NOTE: no self-check
    cuts = sorted(data.draw(st.sets(st.integers(1, len(messages)), max_size=6)) | {len(messages)})
    prefix_ids: list[int] = []
    covered = 0
    for end in cuts:
        prompt = prompter.render(messages[:end], tools, prefix_ids, covered)
        expected = tokenizer.encode_chat(messages[:end], tools, add_generation_prompt=True)
        assert prompt.token_ids == expected, (end, messages[:end])
        assert prompt.is_incremental, ("fell back to a full render", end, messages[:end])
        assert prompt.reused_tokens == len(prefix_ids)
        assert prompt.prefix_ids == tokenizer.encode_chat(
            messages[:end], tools, add_generation_prompt=False
        )
        prefix_ids, covered = prompt.prefix_ids, prompt.num_messages


def test_wrong_stored_ids_are_caught_by_the_first_check(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "again"}]
    prompter = SessionPrompter.for_tokenizer(tokenizer)
    first = prompter.render(messages[:1], None)
    bogus = [*first.prefix_ids[:-1], 0]  # NOTE: not what messages[:1] renders to
    prompt = prompter.render(messages, None, bogus, 1)
    assert prompt.token_ids == tokenizer.encode_chat(messages, None)
    assert not prompt.is_incremental and prompter.num_full == 1


def test_out_of_range_coverage_renders_in_full(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    prompt = SessionPrompter.for_tokenizer(tokenizer).render(messages, None, [1, 2], 5)
    assert prompt.token_ids == tokenizer.encode_chat(messages, None) and prompt.reused_tokens == 0
