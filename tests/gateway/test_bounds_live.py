"""Issue 8 items 2, 3, 5 and 19 (context errors) against a live ``agentgate serve`` over a
zero-cost sim worker: a huge body never stalls other requests, cheap bounds (message and tool
counts, characters against the context, schema depth, stop strings, integer ranges) answer a
fast 400 naming the field, never a 500."""

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.serve import WorkerProcess
from tests.gateway.live import LiveGateway, live_gateway

CHAT = "/v1/chat/completions"
HEALTH_LATENCY_S = 1.5  # NOTE: the issue asks for ~1 s; it was 20-45 s before
FAST_S = 5.0  # a refusal that needs no tokenizing; it was 17 s (400k messages) before
HUGE_BODY_BYTES = 15 * 1024 * 1024


@pytest.fixture(scope="module")
def gateway(sim_worker: WorkerProcess, tokenizer_dir: Path) -> Iterator[LiveGateway]:
    with live_gateway(tokenizer_dir, "--worker", sim_worker.listen, "--workers", "0") as live:
        yield live


def _post(gateway: LiveGateway, path: str, body: Any, timeout_s: float = 120) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(gateway.base_url + path, data=data,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _chat(**overrides: Any) -> dict[str, Any]:
    return {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4} | overrides


def _assert_400(status: int, body: Any, param: str, code: str | None = None) -> None:
    assert status == 400, (status, body)
    assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body


def _health_latencies(gateway: LiveGateway, busy: threading.Thread) -> list[float]:
    """GET /health latencies while ``busy`` runs (at most 60 probes)."""
    latencies: list[float] = []
    while busy.is_alive() and len(latencies) < 60:
        t0 = time.monotonic()
        with urllib.request.urlopen(gateway.base_url + "/health", timeout=60) as resp:
            assert resp.status == 200
        latencies.append(time.monotonic() - t0)
        time.sleep(0.1)
    return latencies


def test_health_answers_while_a_huge_body_is_processed(gateway: LiveGateway) -> None:
    text = "ab " * (HUGE_BODY_BYTES // 3 - 100)
    data = json.dumps(_chat(messages=[{"role": "user", "content": text}])).encode()
    answers: list[tuple[int, Any]] = []
    busy = threading.Thread(target=lambda: answers.append(_post(gateway, CHAT, data)))
    t0 = time.monotonic()
    busy.start()
    time.sleep(0.2)  # NOTE: the body is on its way (or already read) when the probes start
    latencies = _health_latencies(gateway, busy)
    busy.join(timeout=120)
    assert answers, "the huge request never answered"
    _assert_400(*answers[0], "messages", "context_length_exceeded")
    assert max(latencies, default=0.0) < HEALTH_LATENCY_S, (latencies, time.monotonic() - t0)


def test_many_messages_are_a_fast_400(gateway: LiveGateway) -> None:
    body = _chat(messages=[{"role": "user", "content": ""}] * 400_000)
    t0 = time.monotonic()
    _assert_400(*_post(gateway, CHAT, body), "messages")
    assert time.monotonic() - t0 < FAST_S


def test_many_tools_are_a_fast_400(gateway: LiveGateway) -> None:
    params = {"type": "object", "properties": {"a": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": params}}
             for i in range(10_000)]
    t0 = time.monotonic()
    _assert_400(*_post(gateway, CHAT, _chat(tools=tools)), "tools")
    assert time.monotonic() - t0 < FAST_S


def _nested_schema(depth: int) -> str:
    return ('{"type":"object","properties":{"a":' * depth + '{"type":"object"}'
            + "}}" * depth)


_HEAD = '{"model":"demo","max_tokens":4,"messages":[{"role":"user","content":"hi"}],'


@pytest.mark.parametrize("depth", [40, 600, 1200])
@pytest.mark.parametrize(
    ("template", "param"),
    [
        ('"tools":[{"type":"function","function":{"name":"f","parameters":%s}}]}',
         "tools[0].function.parameters"),
        ('"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":%s}}}',
         "response_format.json_schema.schema"),
    ],
    ids=["tools", "response_format"],
)
def test_deep_schemas_are_a_400_naming_the_field(
    gateway: LiveGateway, template: str, param: str, depth: int
) -> None:
    body = (_HEAD + template % _nested_schema(depth)).encode()
    _assert_400(*_post(gateway, CHAT, body), param)


def test_deep_json_anywhere_is_a_400(gateway: LiveGateway) -> None:
    nested = "[" * 5000 + "]" * 5000
    body = ('{"model":"demo","max_tokens":4,"messages":[{"role":"user","content":"hi","x":'
            + nested + "}]}").encode()
    _assert_400(*_post(gateway, CHAT, body), "messages[0].x")


@pytest.mark.parametrize(
    ("path", "field", "extra"),
    [
        (CHAT, "max_tokens", {}),
        (CHAT, "max_completion_tokens", {}),
        (CHAT, "n", {}),
        (CHAT, "seed", {}),
        (CHAT, "top_logprobs", {"logprobs": True}),
        ("/v1/completions", "max_tokens", {}),
        ("/v1/completions", "logprobs", {}),
        ("/v1/completions", "seed", {}),
    ],
)
def test_integers_beyond_64_bits_are_a_400(
    gateway: LiveGateway, path: str, field: str, extra: dict[str, Any]
) -> None:
    body = _chat() if path == CHAT else {"model": "demo", "prompt": "hi", "max_tokens": 4}
    for value in (2**64, 2**63, -(2**64)):
        status, answer = _post(gateway, path, body | extra | {field: value})
        _assert_400(status, answer, field)


@pytest.mark.parametrize(
    ("stop", "param"),
    [
        ("", "stop"),
        (["a", ""], "stop[1]"),
        ("x" * 1025, "stop"),
        (["a", "y" * 5000], "stop[1]"),
        ([str(i) for i in range(17)], "stop"),
    ],
    ids=["empty", "empty-in-list", "long", "long-in-list", "too-many"],
)
def test_bad_stop_strings_are_a_400(gateway: LiveGateway, stop: Any, param: str) -> None:
    _assert_400(*_post(gateway, CHAT, _chat(stop=stop)), param)
    completion = {"model": "demo", "prompt": "hi", "max_tokens": 4, "stop": stop}
    _assert_400(*_post(gateway, "/v1/completions", completion), param)


def test_sixteen_stop_strings_of_1024_chars_are_fine(gateway: LiveGateway) -> None:
    stop = [f"{i:02d}" + "z" * 1022 for i in range(16)]
    status, body = _post(gateway, CHAT, _chat(stop=stop))
    assert status == 200, body


def test_context_errors_name_the_api_field(gateway: LiveGateway) -> None:
    long = [{"role": "user", "content": "y " * 9000}]
    _assert_400(*_post(gateway, CHAT, _chat(messages=long)), "messages",
                "context_length_exceeded")
    _assert_400(*_post(gateway, CHAT, _chat(max_tokens=9000)), "max_tokens",
                "context_length_exceeded")
    _assert_400(*_post(gateway, CHAT, _chat(max_tokens=None, max_completion_tokens=9000)),
                "max_completion_tokens", "context_length_exceeded")
    completion = {"model": "demo", "prompt": "y " * 9000, "max_tokens": 4}
    _assert_400(*_post(gateway, "/v1/completions", completion), "prompt",
                "context_length_exceeded")
    _assert_400(*_post(gateway, "/v1/completions", completion | {"prompt": "hi",
                                                                  "max_tokens": 9000}),
                "max_tokens", "context_length_exceeded")
    status, body = _post(gateway, CHAT, _chat(max_tokens=100))
    assert status == 200, body
