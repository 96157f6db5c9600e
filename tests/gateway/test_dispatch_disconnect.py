"""A client that floods the gateway and goes away leaves nothing running (issue 8, item 13): 50
raw HTTP clients send long requests to the real app over a paced sim worker, wait until all 50
run on the worker, and close their sockets; the worker's ``num_running`` (and the gateway's
in-flight count) return to 0 within a few seconds, for non-streamed and streamed requests."""

import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.app import GatewayConfig
from gateway.serve import WorkerProcess
from tests.gateway.dispatch_live import Served, close_abruptly, serve_app
from tests.gateway.live import start_sim_worker

NUM_CLIENTS = 50
LONG_TOKENS = 4000  # NOTE: ~25 s and more on a paced worker: surely running when they leave
STOP_S = 10.0  # NOTE: the Aborts land within a step or two; generous for a noisy box


@pytest.fixture
def paced() -> Iterator[WorkerProcess]:
    """A worker of each test's own: a failed test's requests must not run on in the next."""
    worker = start_sim_worker("flooded", "cpu")
    try:
        yield worker
    finally:
        worker.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_clients_that_leave_leave_nothing_running(
    paced: WorkerProcess, tokenizer_dir: Path, stream: bool
) -> None:
    cfg = GatewayConfig(model_dir=tokenizer_dir, workers=(paced.listen,), model_name="demo",
                        heartbeat_s=0.2, dead_after_s=10.0)
    with serve_app(cfg) as served:
        client = served.app.state.dispatcher.clients[0]
        socks = [_send_chat(served, stream) for _ in range(NUM_CLIENTS)]
        try:
            _wait(lambda: client.num_in_flight == NUM_CLIENTS and _running(client) == NUM_CLIENTS,
                  lambda: f"{NUM_CLIENTS} requests never ran at once "
                  f"({client.num_in_flight} in flight, {_running(client)} running)", 30.0)
        finally:
            for sock in socks:
                close_abruptly(sock)
        left_at = time.monotonic()
        _wait(lambda: client.num_in_flight == 0 and _running(client) == 0,
              lambda: f"{STOP_S} s after the clients left: {client.num_in_flight} in flight, "
              f"{_running(client)} running on the worker", STOP_S)
        assert time.monotonic() - left_at < STOP_S
        resp = served.http.post("/v1/chat/completions", json=_body(stream=False, max_tokens=3))
        assert resp.status_code == 200, resp.text


def test_a_session_turn_whose_client_leaves_stops_and_frees_the_session(
    paced: WorkerProcess, tokenizer_dir: Path
) -> None:
    """A non-streamed REST turn is awaited to its end by litestar: without the disconnect watch
    it ran on (and held the session's lease) after its client left."""
    cfg = GatewayConfig(model_dir=tokenizer_dir, workers=(paced.listen,), model_name="demo",
                        heartbeat_s=0.2, dead_after_s=10.0)
    with serve_app(cfg) as served:
        client = served.app.state.dispatcher.clients[0]
        session_id = served.http.post("/v1/sessions", json={}).json()["id"]
        turn = {"messages": [{"role": "user", "content": "Count to a thousand."}],
                "max_tokens": LONG_TOKENS}
        sock = _send_raw(served, f"/v1/sessions/{session_id}/turns", turn)
        try:
            _wait(lambda: _running(client) == 1, lambda: "the turn never ran", 30.0)
        finally:
            close_abruptly(sock)
        _wait(lambda: client.num_in_flight == 0 and _running(client) == 0,
              lambda: f"{STOP_S} s after the client left: {client.num_in_flight} in flight, "
              f"{_running(client)} running on the worker", STOP_S)
        short = {**turn, "max_tokens": 3}
        resp = served.http.post(f"/v1/sessions/{session_id}/turns", json=short)
        assert resp.status_code == 200, resp.text
        turns = served.http.get(f"/v1/sessions/{session_id}").json()["turns"]
        assert [t["finish_reason"] for t in turns][0] == "cancelled", turns


def _running(client: object) -> int | None:
    load = client.last_load  # type: ignore[attr-defined]
    return None if load is None else load.num_running


def _send_chat(served: Served, stream: bool) -> socket.socket:
    return _send_raw(served, "/v1/chat/completions", _body(stream, LONG_TOKENS))


def _send_raw(served: Served, path: str, payload: dict[str, object]) -> socket.socket:
    host, port = served.base_url.removeprefix("http://").split(":")
    body = json.dumps(payload).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sock = socket.create_connection((host, int(port)), timeout=10.0)
    sock.sendall(head + body)
    return sock


def _body(stream: bool, max_tokens: int) -> dict[str, object]:
    return {"model": "demo", "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": max_tokens, "stream": stream}


def _wait(check: Callable[[], bool], what: Callable[[], str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what()
        time.sleep(0.05)
