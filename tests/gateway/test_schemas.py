"""gateway.schemas: realistic OpenAI client bodies decode, each bad input raises RequestError
naming its parameter, to_sampling_spec maps sampling fields, responses encode with OpenAI names.

The `openai` package is not installed here, so the request bodies are hand-written in the shapes
openai-python 1.x sends (NOT_GIVEN fields omitted, assistant messages echoed with `refusal`)."""

import json
from typing import Any

import msgspec
import pytest

from engine.protocol import SamplingSpec
from gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    ChunkDelta,
    Completion,
    CompletionChoice,
    FunctionCall,
    FunctionCallDelta,
    Model,
    ModelList,
    NamedToolChoice,
    RequestError,
    ResponseFormatJsonSchema,
    ResponseMessage,
    TextPart,
    ToolCall,
    ToolCallDelta,
    ToolMessage,
    Usage,
    decode_chat_request,
    decode_completion_request,
    to_sampling_spec,
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
            "additionalProperties": False,
        },
        "strict": True,
    },
}
_TOOL_ROUND_TRIP = [
    {"role": "system", "content": "You are a helpful agent."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    # What `completion.choices[0].message.model_dump()` gives back to the client.
    {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "audio": None,
        "function_call": None,
        "annotations": [],
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]


def _chat(**fields: Any) -> bytes:
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(body).encode()


def _completion(**fields: Any) -> bytes:
    return json.dumps({"model": "demo", "prompt": "Once upon", **fields}).encode()


def _assert_request_error(
    body: bytes, param: str | None, decode: Any = decode_chat_request
) -> None:
    with pytest.raises(RequestError) as info:
        decode(body)
    err = info.value
    assert (err.param, err.status) == (param, 400), f"{err.param=} {err.status=}: {err.message}"
    assert err.message and err.code


# --- decoding ----------------------------------------------------------------------------------


def test_tool_round_trip_request_decodes() -> None:
    req = decode_chat_request(
        _chat(
            messages=_TOOL_ROUND_TRIP,
            tools=[_WEATHER_TOOL],
            tool_choice="required",
            stream=True,
            stream_options={"include_usage": True},
            max_completion_tokens=64,
            temperature=0.2,
            seed=7,
            user="u-1",
            metadata={"team": "a"},
            parallel_tool_calls=False,
        )
    )
    assert [type(m).__name__ for m in req.messages] == [
        "SystemMessage",
        "UserMessage",
        "AssistantMessage",
        "ToolMessage",
    ]
    assistant, tool = req.messages[2], req.messages[3]
    assert isinstance(assistant, AssistantMessage) and assistant.content is None
    assert assistant.tool_calls == [
        ToolCall(
            id="call_1",
            function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}'),
        )
    ]
    assert isinstance(tool, ToolMessage) and tool.tool_call_id == "call_1"
    assert req.messages[1].content == [TextPart(text="Weather in Paris?")]
    assert req.tools is not None and req.tools[0].function.parameters["required"] == ["city"]
    assert req.include_usage and req.tool_choice == "required"


def test_named_tool_choice_and_json_schema_decode() -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    req = decode_chat_request(
        _chat(
            tools=[_WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema, "strict": True},
            },
            stop="\n\n",
            logprobs=True,
            top_logprobs=3,
        )
    )
    assert isinstance(req.tool_choice, NamedToolChoice)
    assert req.tool_choice.function.name == "get_weather"
    assert isinstance(req.response_format, ResponseFormatJsonSchema)
    assert req.response_format.json_schema.schema == schema
    assert req.stop_strings == ["\n\n"]


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant"])
def test_every_role_decodes(role: str) -> None:
    req = decode_chat_request(_chat(messages=[{"role": role, "content": "x"}]))
    assert req.messages[0].content == "x"


def test_completion_request_decodes_text_and_token_ids() -> None:
    text = decode_completion_request(_completion(max_tokens=5, logprobs=2, stop=["."]))
    ids = decode_completion_request(_completion(prompt=[1, 2, 3], echo=False))
    assert (text.prompt, text.logprobs, text.stop_strings) == ("Once upon", 2, ["."])
    assert ids.prompt == [1, 2, 3]


def test_decoded_messages_re_encode_for_the_template() -> None:
    req = decode_chat_request(_chat(messages=_TOOL_ROUND_TRIP))
    out = msgspec.to_builtins(req.messages)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool"]
    assert out[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert "refusal" not in out[2]


# --- errors --------------------------------------------------------------------------------------

_TOOLS = [_WEATHER_TOOL]
_BAD_CHAT = [
    (b"{not json", None),
    (b"[]", None),
    (json.dumps({"messages": []}).encode(), "model"),
    (_chat(messages=[]), "messages"),
    (_chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
    (_chat(messages=[{"role": "user"}]), "messages[0].content"),
    (_chat(messages=[{"role": "user", "content": 3}]), "messages[0].content"),
    (
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        "messages[0].content[0].image_url.url",
    ),
    (
        _chat(messages=[{"role": "user", "content": [{"type": "input_audio", "data": "x"}]}]),
        "messages[0].content[0].type",
    ),
    (_chat(messages=[{"role": "tool", "content": "42"}]), "messages[0].tool_call_id"),
    (_chat(tmperature=0.5), "tmperature"),
    (_chat(n=2), "n"),
    (_chat(max_tokens=0), "max_tokens"),
    (_chat(max_completion_tokens=-1), "max_completion_tokens"),
    (_chat(temperature=2.5), "temperature"),
    (_chat(temperature=-0.1), "temperature"),
    (_chat(top_p=0), "top_p"),
    (_chat(top_p=1.5), "top_p"),
    (_chat(stop=[str(i) for i in range(17)]), "stop"),
    (_chat(stop=""), "stop"),
    (_chat(stop=["a", ""]), "stop[1]"),
    (_chat(stop="s" * 1025), "stop"),
    (_chat(max_tokens=2**64), "max_tokens"),
    (_chat(n=2**64), "n"),
    (_chat(logit_bias={"5": 100.5}), "logit_bias"),
    (_chat(logit_bias={"-5": 1}), "logit_bias"),
    (_chat(functions=[{"name": "f"}]), "functions"),
    (_chat(modalities=["audio"]), "modalities"),
    (_chat(messages=[{"role": "user", "content": ""}] * 4097), "messages"),
    (_chat(top_logprobs=2), "top_logprobs"),
    (_chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        "response_format.json_schema.schema",
    ),
    (_chat(response_format={"type": "yaml"}), "response_format.type"),
    (_chat(tool_choice="required"), "tool_choice"),
    (
        _chat(tools=_TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
        "tool_choice.function.name",
    ),
    (_chat(tools=_TOOLS, tool_choice="sometimes"), "tool_choice"),
    (
        _chat(tools=[{"type": "function", "function": {"name": "f", "paramters": {}}}]),
        "tools[0].function.paramters",
    ),
    (_chat(tools=[_WEATHER_TOOL, _WEATHER_TOOL]), "tools[1].function.name"),
    (_chat(stream_options={"include_usage": True}), "stream_options"),
    (_chat(presence_penalty=0.5), "presence_penalty"),
    (_chat(seed="7"), "seed"),
]


@pytest.mark.parametrize(("body", "param"), _BAD_CHAT)
def test_bad_chat_request_names_param(body: bytes, param: str | None) -> None:
    _assert_request_error(body, param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_completion(prompt=""), "prompt"),
        (_completion(prompt=[]), "prompt"),
        (_completion(prompt=[1, -2]), "prompt[1]"),
        (_completion(echo=True), "echo"),
        (_completion(logprobs=True), "logprobs"),
        (_completion(logprobs=21), "logprobs"),
        (_completion(suffix="x"), "suffix"),
        (_completion(n=3), "n"),
    ],
)
def test_bad_completion_request_names_param(body: bytes, param: str) -> None:
    _assert_request_error(body, param, decode_completion_request)


def test_request_error_becomes_openai_error_body() -> None:
    with pytest.raises(RequestError) as info:
        decode_chat_request(_chat(n=4))
    body = json.loads(msgspec.json.encode(info.value.to_body()))
    assert body["error"]["param"] == "n" and body["error"]["type"] == "invalid_request_error"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert RequestError("gone", param=None, status=404).status == 404


# --- sampling ----------------------------------------------------------------------------------


def _spec(body: bytes, **kwargs: Any) -> SamplingSpec:
    decode = decode_completion_request if b'"prompt"' in body else decode_chat_request
    return to_sampling_spec(decode(body), default_max_tokens=kwargs.pop("default", 100), **kwargs)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (_chat(), SamplingSpec(max_new_tokens=100, temperature=1.0, top_p=1.0)),
        (_chat(max_tokens=10), SamplingSpec(max_new_tokens=10)),
        (_chat(max_tokens=10, max_completion_tokens=20), SamplingSpec(max_new_tokens=20)),
        (
            _chat(temperature=0, top_p=0.9, seed=3),
            SamplingSpec(max_new_tokens=100, temperature=0.0, top_p=0.9, seed=3),
        ),
        (_chat(seed=-1), SamplingSpec(max_new_tokens=100, seed=2**63 - 1)),
        (_chat(logprobs=False), SamplingSpec(max_new_tokens=100, logprobs=None)),
        (_chat(logprobs=True), SamplingSpec(max_new_tokens=100, logprobs=0)),
        (_chat(logprobs=True, top_logprobs=5), SamplingSpec(max_new_tokens=100, logprobs=5)),
        (_completion(max_tokens=7, logprobs=3), SamplingSpec(max_new_tokens=7, logprobs=3)),
        (
            _chat(top_k=20, min_p=0.05, repetition_penalty=1.1, logit_bias={"7": -100, "5": 2}),
            SamplingSpec(max_new_tokens=100, top_k=20, min_p=0.05, repetition_penalty=1.1,
                         logit_bias=[(5, 2.0), (7, -100.0)]),
        ),
        (_chat(top_k=-1, min_p=None, repetition_penalty=None), SamplingSpec(max_new_tokens=100)),
        (_chat(top_k=0, logit_bias={}), SamplingSpec(max_new_tokens=100)),
        (
            _completion(max_tokens=3, top_k=4, logit_bias={"9": 1}),
            SamplingSpec(max_new_tokens=3, top_k=4, logit_bias=[(9, 1.0)]),
        ),
    ],
)
def test_to_sampling_spec(body: bytes, expected: SamplingSpec) -> None:
    spec = _spec(body)
    assert spec == expected, f"{spec} != {expected}"
    spec.to_params()  # every mapped spec passes the engine's own validation


def test_to_sampling_spec_passes_stop_token_ids() -> None:
    assert _spec(_chat(), stop_token_ids=(2, 7)).stop_token_ids == [2, 7]


# --- responses ---------------------------------------------------------------------------------


def _encoded(obj: msgspec.Struct) -> dict[str, Any]:
    return json.loads(msgspec.json.encode(obj))


def test_chat_completion_encodes_openai_fields() -> None:
    call = ToolCall(id="call_1", function=FunctionCall(name="get_weather", arguments="{}"))
    body = _encoded(
        ChatCompletion(
            id="chatcmpl-1",
            model="demo",
            created=1,
            choices=[
                ChatChoice(
                    index=0,
                    message=ResponseMessage(content=None, tool_calls=[call]),
                    finish_reason="tool_calls",
                )
            ],
            usage=Usage.of(prompt_tokens=10, completion_tokens=4, cached_tokens=8),
        )
    )
    assert body["object"] == "chat.completion"
    assert body["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 4,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert message["tool_calls"][0]["type"] == "function"


def test_chunk_omits_absent_delta_fields() -> None:
    delta = ChunkDelta(
        tool_calls=[
            ToolCallDelta(index=0, function=FunctionCallDelta(arguments='{"ci')),
        ]
    )
    chunk = _encoded(
        ChatCompletionChunk(
            id="c", model="demo", created=1, choices=[ChunkChoice(index=0, delta=delta)]
        )
    )
    assert chunk["object"] == "chat.completion.chunk" and "usage" not in chunk
    assert chunk["choices"][0]["delta"] == {
        "tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]
    }
    assert chunk["choices"][0]["finish_reason"] is None
    last = _encoded(
        ChatCompletionChunk(id="c", model="demo", created=1, choices=[], usage=Usage.of(3, 2))
    )
    assert last["usage"]["total_tokens"] == 5 and last["choices"] == []


def test_completion_and_models_encode() -> None:
    completion = _encoded(
        Completion(
            id="cmpl-1",
            model="demo",
            created=1,
            choices=[CompletionChoice(index=0, text=" a time", finish_reason="length")],
            usage=Usage.of(2, 2),
        )
    )
    assert completion["object"] == "text_completion"
    assert completion["choices"][0]["text"] == " a time"
    models = _encoded(ModelList(data=[Model(id="demo")]))
    assert models == {
        "object": "list",
        "data": [{"id": "demo", "created": 0, "owned_by": "agentgate", "object": "model"}],
    }


def test_chat_request_round_trips_through_encode() -> None:
    req = decode_chat_request(_chat(messages=_TOOL_ROUND_TRIP, tools=[_WEATHER_TOOL]))
    again = msgspec.json.decode(msgspec.json.encode(req), type=ChatCompletionRequest)
    assert again == req


def test_chunk_usage_null_when_set_to_none() -> None:
    chunk = ChatCompletionChunk(id="c", model="demo", created=1, choices=[], usage=None)
    assert _encoded(chunk)["usage"] is None
