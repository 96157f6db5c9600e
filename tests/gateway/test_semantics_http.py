"""HTTP semantics of issue 8 (items 13 and 19) against a live gateway over real sim workers:
``x-request-id`` on every response (echoed when sane, else generated; errors, streams and
WebSocket handshakes too), optional CORS, one ``context_length_exceeded`` code for the worker's
context check (param ``messages`` / ``prompt``), and ``Retry-After`` on a 503 when no worker is up.
(The 429 + Retry-After of busy workers: tests/gateway/test_dispatch_routing.py.)"""

import asyncio
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from gateway.app import GatewayConfig
from gateway.request_id import LOG_FILTER, request_id_middleware
from gateway.serve import WorkerProcess
from gateway.tokenizer import write_demo_tokenizer
from tests.gateway.conftest import DEMO_VOCAB_SIZE
from tests.gateway.dispatch_live import free_endpoint, serve_app
from tests.gateway.live import LiveGateway, live_gateway, start_sim_worker

ORIGIN = "http://app.example.test"
GENERATED = re.compile(r"[0-9a-f]{32}")
SIM_CONTEXT = 8192  # NOTE: the sim worker's demo geometry (engine.models.checkpoint)
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    w = start_sim_worker("http-sim", cost="zero")
    try:
        yield w
    finally:
        w.stop()


@pytest.fixture(scope="module")
def big_context_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer dir whose config claims 8x the sim worker's context: the gateway's own check
    lets a long request through and the worker refuses it (``context_too_long``)."""
    out = tmp_path_factory.mktemp("big-context") / "demo"  # NOTE: served as "demo"
    write_demo_tokenizer(out)
    config = {"max_position_embeddings": 8 * SIM_CONTEXT, "vocab_size": DEMO_VOCAB_SIZE}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def gateway(big_context_dir: Path, worker: WorkerProcess) -> Iterator[LiveGateway]:
    args = ("--workers", "0", "--worker", worker.listen, "--cors-origin", ORIGIN)
    with live_gateway(big_context_dir, *args) as live:
        yield live


@pytest.fixture(scope="module")
def http(gateway: LiveGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.base_url, timeout=60) as client:
        yield client


# ------------------------------------------------------------------ x-request-id


@pytest.mark.parametrize(("method", "path", "body", "status"), [
    ("GET", "/health", None, 200),
    ("POST", "/v1/chat/completions", CHAT, 200),
    ("POST", "/v1/chat/completions", {"model": "demo"}, 400),
    ("GET", "/no/such/route", None, 404),
    ("POST", "/v1/chat/completions", CHAT | {"max_tokens": 2 * SIM_CONTEXT}, 400),
])
def test_every_response_carries_a_request_id(
    http: httpx.Client, method: str, path: str, body: Any, status: int
) -> None:
    resp = http.request(method, path, json=body)
    assert resp.status_code == status, resp.text
    assert GENERATED.fullmatch(resp.headers.get("x-request-id", "")), resp.headers
    echoed = http.request(method, path, json=body, headers={"X-Request-Id": "abc-123.Z_~"})
    assert echoed.status_code == status and echoed.headers["x-request-id"] == "abc-123.Z_~"


@pytest.mark.parametrize("bad", ["a" * 129, "has space", "tab\there", ""])
def test_an_insane_request_id_is_replaced(http: httpx.Client, bad: str) -> None:
    resp = http.get("/health", headers={"x-request-id": bad})
    assert GENERATED.fullmatch(resp.headers["x-request-id"]), resp.headers


def test_a_stream_and_a_websocket_carry_the_request_id(
    http: httpx.Client, gateway: LiveGateway
) -> None:
    body = CHAT | {"stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body,
                     headers={"x-request-id": "stream-1"}) as resp:
        assert resp.status_code == 200
        assert resp.headers["x-request-id"] == "stream-1"
        assert any(ln == "data: [DONE]" for ln in resp.iter_lines())
    sid = http.post("/v1/sessions", json={}).json()["id"]
    ws_url = gateway.base_url.replace("http", "ws") + f"/v1/sessions/{sid}/ws"
    with connect(ws_url, additional_headers={"x-request-id": "ws-1"}) as ws:
        assert ws.response is not None and ws.response.headers["x-request-id"] == "ws-1"


def test_log_lines_written_during_a_request_name_its_id() -> None:
    """The filter the app puts on the root handlers, around a tiny ASGI app that logs."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    handler = Keep()
    handler.addFilter(LOG_FILTER)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        logging.getLogger("semantics-test").warning("handling %s", "it")

    log = logging.getLogger("semantics-test")
    log.addHandler(handler)
    try:
        scope = {"type": "http", "headers": [(b"x-request-id", b"req-%s-7")]}
        asyncio.run(request_id_middleware(app)(scope, None, None))  # type: ignore[arg-type]
        log.warning("outside")
    finally:
        log.removeHandler(handler)
    assert records == ["handling it [request_id=req-%s-7]", "outside"], records


# ------------------------------------------------------------------ CORS


def test_cors_for_the_configured_origin(http: httpx.Client) -> None:
    preflight = http.options("/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code in (200, 204), preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN, preflight.headers
    resp = http.post("/v1/chat/completions", json=CHAT, headers={"Origin": ORIGIN})
    assert resp.headers["access-control-allow-origin"] == ORIGIN, resp.headers
    assert "x-request-id" in resp.headers["access-control-expose-headers"].lower()
    other = http.get("/health", headers={"Origin": "http://evil.example.test"})
    assert "access-control-allow-origin" not in other.headers, other.headers


def test_no_cors_headers_without_origins(tokenizer_dir: Path, worker: WorkerProcess) -> None:
    cfg = GatewayConfig(model_dir=tokenizer_dir, workers=(worker.listen,), model_name="demo")
    with serve_app(cfg) as served:
        resp = served.http.get("/health", headers={"Origin": ORIGIN})
        assert resp.status_code == 200
        assert "access-control-allow-origin" not in resp.headers, resp.headers


# ------------------------------------------------------------------ error codes


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", CHAT | {"max_tokens": 2 * SIM_CONTEXT}, "messages"),
    ("/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 2 * SIM_CONTEXT},
     "prompt"),
])
def test_the_workers_context_check_is_context_length_exceeded(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    resp = http.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "context_length_exceeded", error
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_no_live_worker_is_503_with_retry_after(tokenizer_dir: Path) -> None:
    cfg = GatewayConfig(model_dir=tokenizer_dir, workers=(free_endpoint(),), model_name="demo")
    with serve_app(cfg) as served:
        resp = served.http.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 503, resp.text
    assert int(resp.headers["retry-after"]) >= 1, resp.headers
    assert resp.json()["error"]["type"] == "service_unavailable", resp.text
