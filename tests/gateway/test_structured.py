"""Structured output through the gateway (``gateway.structured``) against real workers on the demo
model: forced tool calls (``tool_choice`` "required" or named) and JSON ``response_format`` come
back valid, from the native backend (the real sampler) and the sim backend (which draws among the
grammar's allowed tokens too); a schema that cannot be enforced is a 400 naming its parameter."""

import json
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from gateway.app import GatewayConfig, create_app
from gateway.schemas import decode_chat_request, to_sampling_spec
from gateway.serve import spawn_worker
from gateway.structured import (
    COMPILE_CACHE,
    COMPILE_CACHE_MAX_BYTES,
    closed_objects,
    structured_spec,
    tool_call_grammar,
)

URL = "/v1/chat/completions"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 5},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: arguments are {}
]
PARAMS = {"get_weather": WEATHER, "ping": {"type": "object", "properties": {},
                                          "additionalProperties": False}}


@pytest.fixture(scope="module")
def model_dir(demo_model_dir: Path) -> Path:
    return demo_model_dir


@pytest.fixture(scope="module", params=["native", "sim"])
def client(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[TestClient[Litestar]]:
    extra = ["--cost", "zero"] if request.param == "sim" else ["--device", "cpu"]
    worker = spawn_worker(model_dir=model_dir, backend=request.param,
                          worker_id=f"structured-{request.param}", extra_args=extra, timeout_s=120)
    try:
        cfg = GatewayConfig(model_dir=model_dir, workers=(worker.listen,), model_name="demo")
        with TestClient(create_app(cfg), raise_server_exceptions=False) as test_client:
            yield test_client
    finally:
        worker.stop()


def _chat(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "demo",
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "max_tokens": 200,
        "temperature": 1.0,
    }
    return body | overrides


def _post(client: TestClient[Litestar], body: dict[str, Any]) -> dict[str, Any]:
    resp = client.post(URL, json=body)
    assert resp.status_code == 200, resp.text
    [choice] = resp.json()["choices"]
    return choice


def _assert_valid_call(call: dict[str, Any], names: set[str]) -> None:
    fn = call["function"]
    assert fn["name"] in names, call
    arguments = json.loads(fn["arguments"])
    schema = PARAMS[fn["name"]]
    assert isinstance(arguments, dict), call
    assert arguments.keys() == set(schema.get("required", ())), call
    if fn["name"] == "get_weather":
        assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 5, call
        assert type(arguments["days"]) is int and 1 <= arguments["days"] <= 7, call
        assert arguments["unit"] in ("c", "f"), call


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_tool_choice_required_yields_one_valid_call(
    client: TestClient[Litestar], seed: int
) -> None:
    choice = _post(client, _chat(tools=TOOLS, tool_choice="required", seed=seed,
                                 parallel_tool_calls=False))
    assert choice["finish_reason"] == "tool_calls", choice
    message = choice["message"]
    assert not message.get("content"), message
    [call] = message["tool_calls"]
    _assert_valid_call(call, {"get_weather", "ping"})


def test_tool_choice_required_parallel_calls_are_all_valid(client: TestClient[Litestar]) -> None:
    for seed in (4, 5):
        choice = _post(client, _chat(tools=TOOLS, tool_choice="required", seed=seed))
        calls = choice["message"]["tool_calls"]
        # NOTE: a random model may keep calling until max_tokens cuts the last call short
        assert calls, choice
        for call in calls:
            _assert_valid_call(call, {"get_weather", "ping"})


@pytest.mark.parametrize("seed", [1, 2])
def test_named_tool_choice_calls_that_tool(client: TestClient[Litestar], seed: int) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = _post(client, _chat(tools=TOOLS, tool_choice=named, seed=seed,
                                 parallel_tool_calls=False))
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    _assert_valid_call(call, {"get_weather"})


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_response_format_json_schema_yields_valid_json(
    client: TestClient[Litestar], seed: int
) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    choice = _post(client, _chat(response_format=fmt, seed=seed))
    assert choice["finish_reason"] == "stop", choice
    value = json.loads(choice["message"]["content"])
    _assert_valid_call({"function": {"name": "get_weather", "arguments": json.dumps(value)}},
                       {"get_weather"})


def test_response_format_json_object_yields_an_object(client: TestClient[Litestar]) -> None:
    fmt = {"type": "json_object"}
    choice = _post(client, _chat(response_format=fmt, seed=9, temperature=0.0))
    # NOTE: any object: a random model may write one longer than max_tokens
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict), choice
    else:
        assert choice["message"]["content"].startswith("{"), choice


@pytest.mark.parametrize(("overrides", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "if": {}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "wat"}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    # found by tests/gateway/test_fuzz.py: an int beyond 64 bits was a 500
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"": -(2**63) - 1}}}}, "response_format.json_schema.schema"),
    ({"tools": [TOOLS[1], {"type": "function", "function": {
        "name": "bad", "parameters": {"type": "object", "properties": {"x": {"type": "wat"}}}}}],
      "tool_choice": "required"}, "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}],
      "tool_choice": {"type": "function", "function": {"name": "s"}}},
     "tools[0].function.parameters"),
])
def test_schema_that_cannot_be_enforced_is_400_naming_the_param(
    client: TestClient[Litestar], overrides: dict[str, Any], param: str
) -> None:
    resp = client.post(URL, json=_chat(**overrides))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_auto_and_none_are_unconstrained() -> None:
    for choice in ("auto", "none"):
        req = decode_chat_request(json.dumps(_chat(tools=TOOLS, tool_choice=choice)).encode())
        assert to_sampling_spec(req, default_max_tokens=8).structured is None


def test_tool_grammar_writes_the_chat_templates_call_format() -> None:
    tool = decode_chat_request(json.dumps(_chat(tools=TOOLS)).encode()).tools or []
    lark = tool_call_grammar([(0, tool[0])], parallel=False)
    assert lark.startswith("start: call\n"), lark
    assert 'call: <tool_call> "\\n" (fn_0) "\\n" </tool_call>' in lark, lark
    assert '"{\\"name\\": \\"get_weather\\", \\"arguments\\": "' in lark, lark


# ------------------------------------------------------------- issue 8, item 18 and item 4

# NOTE: LangChain's tool schemas omit additionalProperties, at every level. Every value is bounded
# so that the random model's call always ends within max_tokens (an unbounded string or array
# may run on for as long as its draws say).
LANGCHAIN_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 5},
        "when": {"type": "object", "properties": {"day": {"type": "integer", "minimum": 1,
                                                          "maximum": 31}}},
        "stops": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 5}}}},
    },
    "required": ["city", "when"],
}
LANGCHAIN_TOOL = {"type": "function", "function": {"name": "trip", "parameters": LANGCHAIN_PARAMS}}


def _assert_keys_within(value: Any, schema: dict[str, Any], where: str = "arguments") -> None:
    if isinstance(value, dict):
        props = schema.get("properties", {})
        assert set(value) <= set(props), f"{where}: keys {sorted(value)} outside {sorted(props)}"
        for key, sub in value.items():
            _assert_keys_within(sub, props[key], f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _assert_keys_within(item, schema.get("items", {}), f"{where}[{i}]")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_named_tool_choice_makes_exactly_one_call(client: TestClient[Litestar], seed: int) -> None:
    """parallel_tool_calls left at its default (true): a named choice is still one call."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = _post(client, _chat(tools=TOOLS, tool_choice=named, seed=seed, max_tokens=400))
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    _assert_valid_call(call, {"get_weather"})


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_forced_arguments_stay_within_a_schema_without_additional_properties(
    client: TestClient[Litestar], seed: int
) -> None:
    named = {"type": "function", "function": {"name": "trip"}}
    choice = _post(client, _chat(tools=[LANGCHAIN_TOOL], tool_choice=named, seed=seed,
                                 max_tokens=400))
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    assert {"city", "when"} <= set(arguments), arguments
    _assert_keys_within(arguments, LANGCHAIN_PARAMS)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_call_cut_by_max_tokens_leaks_no_markup(
    client: TestClient[Litestar], stream: bool
) -> None:
    body = _chat(tools=TOOLS, tool_choice="required", seed=3, max_tokens=8, stream=stream)
    if not stream:
        choice = _post(client, body)
        content, calls, reason = (choice["message"].get("content"),
                                  choice["message"].get("tool_calls"), choice["finish_reason"])
    else:
        with client.stream("POST", URL, json=body) as resp:
            assert resp.status_code == 200, resp.read()
            lines = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
        chunks = [json.loads(ln)["choices"][0] for ln in lines if ln != "[DONE]"]
        content = "".join(c["delta"].get("content") or "" for c in chunks) or None
        calls = [t for c in chunks for t in c["delta"].get("tool_calls") or []] or None
        [reason] = [c["finish_reason"] for c in chunks if c["finish_reason"]]
    assert reason == "length", (reason, content, calls)
    assert content is None or "<tool_call" not in content, content
    assert calls is None, calls  # NOTE: the cut call's arguments are not JSON: dropped


def test_closed_objects_copies_and_closes_every_object_schema() -> None:
    before = json.dumps(LANGCHAIN_PARAMS)
    closed = closed_objects(LANGCHAIN_PARAMS)
    assert json.dumps(LANGCHAIN_PARAMS) == before, "the request's schema was changed"
    assert closed["additionalProperties"] is False
    assert closed["properties"]["when"]["additionalProperties"] is False
    assert closed["properties"]["stops"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["city"]
    kept = closed_objects({"type": "object", "additionalProperties": {"type": "integer"}})
    assert kept["additionalProperties"] == {"type": "integer"}
    union = closed_objects({"anyOf": [{"properties": {"a": {}}}, {"type": "string"}]})
    assert union["anyOf"][0]["additionalProperties"] is False and union["anyOf"][1] == {
        "type": "string"}


def test_compile_cache_stays_within_its_byte_bound() -> None:
    """40 distinct 1 MB schemas (the issue's 40 big schemas grew the gateway to 781 MB)."""
    COMPILE_CACHE.clear()
    tracemalloc.start()
    try:
        base_bytes, _ = tracemalloc.get_traced_memory()
        for i in range(40):
            schema = {"type": "object", "description": f"{i}" + "x" * 1_000_000,
                      "properties": {"a": {"type": "string"}}}
            fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
            req = decode_chat_request(json.dumps(_chat(response_format=fmt)).encode())
            assert structured_spec(req) is not None
            del req
        kept_bytes = tracemalloc.get_traced_memory()[0] - base_bytes
    finally:
        tracemalloc.stop()
    assert COMPILE_CACHE.num_bytes <= COMPILE_CACHE_MAX_BYTES, COMPILE_CACHE.num_bytes
    assert 0 < len(COMPILE_CACHE) < 40, len(COMPILE_CACHE)
    # NOTE: what the process keeps: the cache and a little more, not 40 schemas
    assert kept_bytes < COMPILE_CACHE_MAX_BYTES + 4_000_000, kept_bytes
    COMPILE_CACHE.clear()
