"""Session turns through a live ``agentgate serve --redis`` while the Redis under it fails: a
freeze (SIGSTOP) mid-turn still records the answer once Redis answers again, and the next turn is
accepted at once; a crashed gateway's turn lease expires, so a new gateway takes the session
over within the lease time; Redis killed mid-turn ends the SSE stream and the WebSocket turn with
an error frame (503 semantics) instead of cutting them."""

import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from gateway.serve import WorkerProcess
from tests.gateway.live import LiveGateway, live_gateway, start_sim_worker
from tests.sessions.redis_server import RedisServer, redis_server

FREEZE_S = 8.0
TAKEOVER_WITHIN_S = 60.0  # NOTE: the turn lease (20 s) plus a slow box's margin; was 600 s
AUTH = {"Authorization": "Bearer sk-faults"}
HTTP_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def paced_worker() -> Iterator[WorkerProcess]:
    """A sim worker with the h200 cost model: ~20 ms a token, so a turn of a few hundred tokens
    is surely still running when the test breaks something."""
    worker = start_sim_worker("faults", "h200")
    try:
        yield worker
    finally:
        worker.stop(signal.SIGKILL)


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path) as server:
        yield server


def _gateway(model_dir: Path, worker: WorkerProcess, redis: RedisServer) -> Any:
    return live_gateway(model_dir, "--workers", "0", "--worker", worker.listen,
                        "--redis", redis.url)


def _http(gateway: LiveGateway) -> httpx.Client:
    return httpx.Client(base_url=gateway.base_url, headers=AUTH, timeout=HTTP_TIMEOUT_S)


def _create(http: httpx.Client) -> str:
    resp = http.post("/v1/sessions", json={"system": "Be brief."})
    assert resp.status_code == 200, resp.text
    return resp.json()["id"]


def _body(max_tokens: int, text: str = "Hello!", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens} | extra


def _sse_turn(http: httpx.Client, sid: str, max_tokens: int, on_first_delta: Any) -> list[Any]:
    """The SSE frames of one streamed turn; ``on_first_delta()`` runs once, mid-turn."""
    frames: list[dict[str, Any]] = []
    body = _body(max_tokens, stream=True)
    try:
        with http.stream("POST", f"/v1/sessions/{sid}/turns", json=body) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                frames.append(json.loads(line.removeprefix("data: ")))
                if frames[-1]["type"] == "delta" and sum(f["type"] == "delta"
                                                         for f in frames) == 1:
                    on_first_delta()
    except httpx.HTTPError as exc:
        raise AssertionError(f"the SSE stream broke ({exc!r}) after {frames[-3:]}") from None
    return frames


def test_a_redis_freeze_mid_turn_still_records_the_answer(
    tokenizer_dir: Path, paced_worker: WorkerProcess, redis: RedisServer
) -> None:
    with _gateway(tokenizer_dir, paced_worker, redis) as gateway, _http(gateway) as http:
        sid = _create(http)
        thaw = threading.Timer(FREEZE_S, redis.thaw)

        def freeze() -> None:
            redis.freeze()
            thaw.start()

        try:
            frames = _sse_turn(http, sid, 100, freeze)
        finally:
            thaw.join(timeout=FREEZE_S + 5)
            redis.thaw()
        assert frames and frames[-1]["type"] == "turn_end", frames[-3:]
        session = http.get(f"/v1/sessions/{sid}").json()
        assert not session["running"] and len(session["turns"]) == 1, session
        streamed = "".join(f["content"] for f in frames if f["type"] == "delta")
        assert session["messages"][-1]["content"] == streamed, session["messages"]
        t0 = time.monotonic()
        resp = http.post(f"/v1/sessions/{sid}/turns", json=_body(4))
        assert resp.status_code == 200, (resp.status_code, resp.text)
        assert time.monotonic() - t0 < 10, "the lease was released, not left to expire"


def test_a_new_gateway_takes_over_a_crashed_gateways_turn(
    tokenizer_dir: Path, paced_worker: WorkerProcess, redis: RedisServer
) -> None:
    with _gateway(tokenizer_dir, paced_worker, redis) as first, _http(first) as http:
        sid = _create(http)
        with contextlib.suppress(AssertionError):  # NOTE: the stream breaks: its gateway dies
            _sse_turn(http, sid, 1500, lambda: first.proc.send_signal(signal.SIGKILL))
        first.proc.wait(timeout=30)
    t0 = time.monotonic()
    with _gateway(tokenizer_dir, paced_worker, redis) as second, _http(second) as http:
        statuses = []
        deadline = t0 + TAKEOVER_WITHIN_S
        while time.monotonic() < deadline:
            resp = http.post(f"/v1/sessions/{sid}/turns", json=_body(4))
            statuses.append(resp.status_code)
            if resp.status_code != 409:
                break
            time.sleep(1.0)
        assert statuses[-1] == 200, (statuses, resp.text)
        assert 409 in statuses or time.monotonic() - t0 > 1, statuses
        session = http.get(f"/v1/sessions/{sid}").json()
        assert [t["finish_reason"] for t in session["turns"]] == ["length"], session["turns"]


def test_redis_killed_mid_turn_ends_sse_and_websocket_with_an_error_frame(
    tokenizer_dir: Path, paced_worker: WorkerProcess, redis: RedisServer
) -> None:
    with _gateway(tokenizer_dir, paced_worker, redis) as gateway, _http(gateway) as http:
        sid = _create(http)
        frames = _sse_turn(http, sid, 100, redis.kill)
        _assert_unavailable(frames[-1])

        redis.start()  # NOTE: the same port: the gateway reconnects by itself
        sid = _create(http)
        ws_url = gateway.base_url.replace("http://", "ws://") + f"/v1/sessions/{sid}/ws"
        with connect(ws_url, additional_headers=AUTH, open_timeout=30) as ws:
            ws.send(json.dumps({"type": "turn", "id": "t-1"} | _body(100)))
            frames = []
            for _ in range(1000):
                frames.append(json.loads(ws.recv(timeout=HTTP_TIMEOUT_S)))
                if frames[-1]["type"] == "delta" and len(frames) == 2:
                    redis.kill()
                if frames[-1]["type"] in ("turn_end", "error"):
                    break
        _assert_unavailable(frames[-1])
        assert frames[-1].get("id") == "t-1", frames[-1]


def _assert_unavailable(frame: dict[str, Any]) -> None:
    assert frame["type"] == "error", frame
    assert frame["error"]["type"] == "service_unavailable", frame
    assert frame["error"]["code"] == "service_unavailable", frame
