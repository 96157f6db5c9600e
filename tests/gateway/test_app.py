"""The gateway app (``create_app``) against a real sim worker subprocess (``--cost zero``) and the
demo tokenizer: health, models, chat completions (JSON and SSE), cached tokens, and a 4xx OpenAI
error JSON naming the parameter for each bad input."""

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from gateway.app import GatewayConfig, create_app
from gateway.cli import main as cli_main
from gateway.serve import WorkerProcess
from gateway.tokenizer import write_demo_tokenizer
from tests.gateway.live import live_gateway

MAX_BODY_BYTES = 64 * 1024
URL = "/v1/chat/completions"


@pytest.fixture(scope="module")
def client(sim_worker: WorkerProcess, tokenizer_dir: Path) -> Iterator[TestClient[Litestar]]:
    cfg = GatewayConfig(model_dir=tokenizer_dir, workers=(sim_worker.listen,), model_name="demo",
                        max_body_bytes=MAX_BODY_BYTES)
    with TestClient(create_app(cfg), raise_server_exceptions=False) as test_client:
        yield test_client


def _chat(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "demo",
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Hello there, how are you?"}],
        "max_tokens": 12,
        "seed": 7,
    }
    return body | overrides


def _sse_events(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.split("\n") if line.startswith("data: ")]


def _assert_error(resp: Any, status: int, param: str | None) -> None:
    assert resp.status_code == status, (resp.status_code, resp.text)
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert error["message"] and error["type"], error


def test_health_ready_models(client: TestClient[Litestar]) -> None:
    assert client.get("/health").status_code == 200
    ready = client.get("/ready")
    assert ready.status_code == 200 and ready.json()["workers_alive"] == 1, ready.text
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["demo"], models


def test_ready_is_503_without_live_worker(tokenizer_dir: Path) -> None:
    cfg = GatewayConfig(model_dir=tokenizer_dir, workers=("tcp://127.0.0.1:9",))
    app = create_app(cfg)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        for client_ in app.state.dispatcher.clients:
            client_.connect_timeout_s = 0.2
        assert test_client.get("/health").status_code == 200
        _assert_error(test_client.get("/ready"), 503, None)
        _assert_error(test_client.post(URL, json=_chat()), 503, None)


def test_chat_completion_round_trip(client: TestClient[Litestar]) -> None:
    resp = client.post(URL, json=_chat())
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion" and body["model"] == "demo", body
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 12 and usage["prompt_tokens"] > 10, usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12, usage
    assert "cached_tokens" in usage["prompt_tokens_details"], usage


def test_repeated_conversation_reports_cached_tokens(client: TestClient[Litestar]) -> None:
    messages = [{"role": "user", "content": "A long shared history. " * 20}]
    first = client.post(URL, json=_chat(messages=messages)).json()["usage"]
    second = client.post(URL, json=_chat(messages=messages)).json()["usage"]
    assert second["prompt_tokens"] == first["prompt_tokens"], (first, second)
    assert second["prompt_tokens_details"]["cached_tokens"] > 0, second


def test_stream_chunks_end_in_done_with_usage(client: TestClient[Litestar]) -> None:
    resp = client.post(URL, json=_chat(max_tokens=40, stream=True,
                                       stream_options={"include_usage": True}))
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(resp.text)
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant", chunks[0]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length", chunks[-2]
    assert chunks[-1]["choices"] == [], chunks[-1]
    assert chunks[-1]["usage"]["completion_tokens"] == 40, chunks[-1]
    assert len({c["id"] for c in chunks}) == 1, chunks


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "demo", "messages": [', None),
        (json.dumps(_chat(bogus=1)).encode(), "bogus"),
        (json.dumps(_chat(temperature=9)).encode(), "temperature"),
        (json.dumps(_chat(messages=[{"role": "user", "content": "x" * 9000}])).encode(),
         "messages"),
    ],
    ids=["malformed-json", "unknown-field", "bad-temperature", "prompt-too-long"],
)
def test_bad_input_is_400_naming_param(
    client: TestClient[Litestar], body: bytes, param: str | None
) -> None:
    resp = client.post(URL, content=body, headers={"content-type": "application/json"})
    _assert_error(resp, 400, param)


def test_prompt_plus_max_tokens_over_context_is_400(client: TestClient[Litestar]) -> None:
    messages = [{"role": "user", "content": "y" * 8000}]
    resp = client.post(URL, json=_chat(messages=messages, max_tokens=1000))
    _assert_error(resp, 400, "max_tokens")
    assert resp.json()["error"]["code"] == "context_length_exceeded", resp.text


def test_completion_round_trip(client: TestClient[Litestar]) -> None:
    body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 8, "stop": "\x00"}
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["object"] == "text_completion" and isinstance(out["choices"][0]["text"], str)
    assert out["usage"]["prompt_tokens"] == len("Once upon a time"), out["usage"]
    _assert_error(client.post("/v1/completions", json=body | {"prompt": ""}), 400, "prompt")
    _assert_error(client.post("/v1/completions", json=body | {"prompt": [1, 320]}), 400,
                  "prompt[1]")  # NOTE: the demo vocabulary is [0, 320)
    _assert_error(client.post("/v1/completions", json=body | {"prompt": [2**40]}), 400,
                  "prompt[0]")


def test_completion_stream_ends_with_reason_usage_and_done(client: TestClient[Litestar]) -> None:
    """(The sim worker's tokens depend on the request id, so streamed and whole answers differ
    here; ``test_openai_client`` checks that they agree on the native backend.)"""
    body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 10, "seed": 3}
    resp = client.post("/v1/completions",
                       json=body | {"stream": True, "stream_options": {"include_usage": True}})
    events = _sse_events(resp.text)
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks), chunks
    assert len({c["id"] for c in chunks}) == 1 and "usage" not in chunks[0], chunks
    assert chunks[-1]["usage"]["completion_tokens"] == 10, chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]


def test_unknown_route_and_bad_messages_are_4xx_json(client: TestClient[Litestar]) -> None:
    _assert_error(client.get("/v1/nope"), 404, None)
    bad = _chat(messages=[{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}])
    resp = client.post(URL, json=bad)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"].startswith("messages"), resp.text


def test_body_too_large_is_413(client: TestClient[Litestar]) -> None:
    body = _chat(messages=[{"role": "user", "content": "z" * (MAX_BODY_BYTES + 1)}])
    _assert_error(client.post(URL, json=body), 413, "body")


def test_gateway_does_not_import_torch() -> None:
    code = "import sys, gateway.cli, gateway.app, gateway.serve; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.skipif(importlib.util.find_spec("uvicorn") is None, reason="needs uvicorn")
def test_agentgate_serve_answers_http_and_stops_its_workers_on_sigint(tmp_path: Path) -> None:
    """The README's main command, for real: a gateway process over a spawned sim worker."""
    import urllib.request

    from engine.models.checkpoint import DEMO_CONFIG

    model_dir = tmp_path / "model"
    write_demo_tokenizer(model_dir)
    (model_dir / "config.json").write_text(json.dumps(DEMO_CONFIG))
    with live_gateway(model_dir) as gateway:
        body = json.dumps({"model": "model", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 3}).encode()
        req = urllib.request.Request(f"{gateway.api_url}/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            reply = json.loads(r.read())
        assert reply["usage"]["completion_tokens"] == 3
        out = gateway.stop()
    assert gateway.proc.returncode in (0, 130), out
    workers = subprocess.run(["pgrep", "-f", f"engine.worker.*{model_dir}"], capture_output=True,
                             text=True, check=False)
    assert workers.stdout.strip() == "", f"workers left running: {workers.stdout}"


@pytest.mark.skipif(importlib.util.find_spec("uvicorn") is not None, reason="uvicorn installed")
def test_serve_without_asgi_server_says_so(
    tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["serve", "--model", str(tokenizer_dir)]) == 2
    assert "no ASGI server installed" in capsys.readouterr().err


def test_chat_logprobs_line_up_with_tokens(client: TestClient[Litestar]) -> None:
    """The sim worker is a uniform model: every token's logprob is -log(choices), and the top
    alternatives tie with it."""
    resp = client.post(URL, json=_chat(max_tokens=6, logprobs=True, top_logprobs=3))
    assert resp.status_code == 200, resp.text
    out = resp.json()["choices"][0]
    content = out["logprobs"]["content"]
    assert len(content) == resp.json()["usage"]["completion_tokens"] == 6, content
    for entry in content:
        assert entry["logprob"] < 0 and len(entry["top_logprobs"]) == 3, entry
        assert entry["top_logprobs"][0]["token"] == entry["token"], entry
        assert {t["logprob"] for t in entry["top_logprobs"]} == {entry["logprob"]}, entry
        assert isinstance(entry["bytes"], list), entry
    plain = client.post(URL, json=_chat(max_tokens=6)).json()["choices"][0]
    assert plain.get("logprobs") is None, plain
