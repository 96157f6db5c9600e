"""The real ``openai`` Python package against a live ``agentgate serve`` subprocess (native
backend, the demo model): what agent frameworks see. Streaming and non-streaming answers must
agree token for token (greedy), errors must come back as the SDK's typed exceptions with the
offending parameter, and a repeated conversation must report cached prompt tokens."""

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.gateway.live import LiveGateway

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]


@pytest.fixture(scope="module")
def gateway(native_gateway: LiveGateway) -> LiveGateway:
    return native_gateway


@pytest.fixture(scope="module")
def client(gateway: LiveGateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.api_url, api_key="sk-test", max_retries=0,
                       timeout=60) as c:
        yield c


def test_models(client: openai.OpenAI) -> None:
    [model] = client.models.list().data
    assert model.id == "demo" and model.object == "model"


def test_chat_and_stream_agree(client: openai.OpenAI) -> None:
    kwargs = dict(model="demo", messages=MESSAGES, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason in ("length", "stop", "tool_calls"), choice
    assert whole.usage is not None and whole.usage.completion_tokens <= 12

    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (choice.message.content or "")
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    reasons = [r for r in reasons if r]
    assert reasons == [choice.finish_reason]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_repeated_conversation_reports_cached_tokens(client: openai.OpenAI) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "Red."},
                {"role": "user", "content": "Two more, please, and explain each one briefly."}]
    first = client.chat.completions.create(model="demo", messages=messages, max_tokens=2)
    second = client.chat.completions.create(model="demo", messages=messages, max_tokens=2)
    assert first.usage is not None and second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens >= second.usage.prompt_tokens // 2, second.usage


def test_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=4,
                                         logprobs=True, top_logprobs=2, temperature=0)
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == out.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5), entry


def test_completions_and_stream(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=8,
                                      temperature=0)
    streamed = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=8,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": 9}, "temperature"),
        ({"messages": [{"role": "user", "content": "x" * 40_000}]}, "messages"),
        ({"n": 2}, "n"),
    ],
)
def test_bad_request_is_typed_with_param(client: openai.OpenAI, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**({"model": "demo", "messages": MESSAGES} | kwargs))
    assert info.value.status_code == 400
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == param, body


def test_tenants_never_share_cache_hits(gateway: LiveGateway) -> None:
    """Two API keys, the same long conversation: the second tenant gets no cached tokens from
    the first one's (it would reveal what the other tenant sent); its own repeat does."""
    messages = [{"role": "user", "content": "A secret only tenant A knows: " + "lorem " * 60}]
    usage = {}
    for key in ("sk-tenant-a", "sk-tenant-b", "sk-tenant-b"):
        with openai.OpenAI(base_url=gateway.api_url, api_key=key, max_retries=0) as c:
            out = c.chat.completions.create(model="demo", messages=messages, max_tokens=1)
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        usage.setdefault(key, []).append(out.usage.prompt_tokens_details.cached_tokens)
    assert usage["sk-tenant-b"][0] == 0, usage
    assert usage["sk-tenant-b"][1] > 0, usage


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 16}},
        "required": ["zone"]}},
}


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_tool_call_round_trip(client: openai.OpenAI, choice: Any) -> None:
    """tool_choice required / named: the (random) demo model's call validates against the tool's
    schema; the tool result goes back; a final answer with tool_choice none is plain text.
    One call (parallel_tool_calls false): a random model may add calls for as long as its draws
    say, and the bounded schemas make one call end well within max_tokens."""
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    tools = [WEATHER, CLOCK]
    out = client.chat.completions.create(model="demo", messages=messages, tools=tools,
                                         tool_choice=choice, max_tokens=200, seed=1,
                                         parallel_tool_calls=False)
    assert out.choices[0].finish_reason == "tool_calls", out
    calls = out.choices[0].message.tool_calls or []
    assert calls, out
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in calls:
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
    messages.append(out.choices[0].message.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"} for c in calls]
    final = client.chat.completions.create(model="demo", messages=messages, tools=tools,
                                           tool_choice="none", max_tokens=8)
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.usage is not None and final.usage.prompt_tokens > out.usage.prompt_tokens  # type: ignore[union-attr]


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    out = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=200, seed=3,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": schema}},
    )
    assert out.choices[0].finish_reason == "stop", out
    jsonschema.validate(json.loads(out.choices[0].message.content or ""), schema)


def test_client_disconnect_aborts_the_worker_request(gateway: LiveGateway) -> None:
    """Closing a streamed response mid-way aborts the request on the worker: the gateway's
    in-flight gauge and the worker's running count go back to 0 long before 4,000 tokens."""
    import re
    import time

    import httpx

    def busy() -> float:
        text = httpx.get(f"{gateway.base_url}/metrics", timeout=10).text
        pattern = r"^agentgate_worker_(?:in_flight|running)_requests\{[^}]*\} (\S+)$"
        return sum(float(v) for v in re.findall(pattern, text, re.M))

    # NOTE: the random demo model may sample EOS early; a schema needing 3,000 characters cannot
    # end before them (EOS is masked until the grammar completes)
    long_text = {"type": "object", "required": ["s"],
                 "properties": {"s": {"type": "string", "minLength": 3000}}}
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": 4000, "stream": True,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "long", "schema": long_text}}}
    with httpx.stream("POST", f"{gateway.api_url}/chat/completions", json=body,
                      timeout=30) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()  # NOTE: kept: closing this iterator closes the response
        assert next(line for line in lines if line.startswith("data: "))
        assert busy() >= 1
    deadline = time.monotonic() + 10
    while (load := busy()) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert load == 0, "the worker still runs the request after the client went away"
