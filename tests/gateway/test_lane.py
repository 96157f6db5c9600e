"""The lane (``gateway.lane``) answers ``POST /v1/chat/completions`` and ``/v1/completions`` without
litestar's stack; litestar still answers them when CORS is configured and the request has an
``Origin``. Both paths run the same handlers, so every answer must match byte for byte where it
can (errors, headers) and in shape where ids differ; and the lane keeps what the stack did: the
body limit (also for a chunked body with no length), the metrics, and a client that leaves
mid-body is a 499, not a 500."""

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.app import GatewayConfig
from gateway.serve import WorkerProcess
from tests.gateway.dispatch_live import Served, close_abruptly, serve_app
from tests.gateway.live import start_sim_worker

ORIGIN = "http://app.example.test"
MAX_BODY = 4096
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": "demo", "prompt": "hi", "max_tokens": 4}
BAD = [  # (path, body): each an error the handlers raise at a different step
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/chat/completions", {"model": "demo"}),
    ("/v1/chat/completions", {"model": "demo", "messages": "not a list"}),
    ("/v1/chat/completions", CHAT | {"max_tokens": 10**6}),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": "x" * MAX_BODY}]}),
    ("/v1/completions", {"model": "demo", "prompt": [10**9]}),
    ("/v1/completions", COMPLETION | {"temperature": -1}),
]


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    w = start_sim_worker("lane-sim", cost="zero")
    try:
        yield w
    finally:
        w.stop()


@pytest.fixture(scope="module")
def served(tokenizer_dir: Path, worker: WorkerProcess) -> Iterator[Served]:
    cfg = GatewayConfig(model_dir=tokenizer_dir, workers=(worker.listen,), model_name="demo",
                        cors_origins=(ORIGIN,), max_body_bytes=MAX_BODY)
    with serve_app(cfg) as s:
        yield s


def _both(http: httpx.Client, path: str, body: object) -> tuple[httpx.Response, httpx.Response]:
    """(the lane's answer, litestar's answer) to the same request."""
    return http.post(path, json=body), http.post(path, json=body, headers={"Origin": ORIGIN})


@pytest.mark.parametrize(("path", "body"), BAD)
def test_errors_are_the_same_on_the_lane_and_through_litestar(
    served: Served, path: str, body: object
) -> None:
    lane, stack = _both(served.http, path, body)
    assert 400 <= lane.status_code < 500, lane.text
    assert (lane.status_code, lane.content) == (stack.status_code, stack.content)
    assert lane.headers["content-type"] == stack.headers["content-type"] == "application/json"
    assert "access-control-allow-origin" not in lane.headers
    assert stack.headers["access-control-allow-origin"] == ORIGIN  # NOTE: litestar answered it


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", CHAT),
                                            ("/v1/completions", COMPLETION)])
def test_answers_have_the_same_shape_and_headers(served: Served, path: str, body: dict) -> None:
    lane, stack = _both(served.http, path, body)
    assert lane.status_code == stack.status_code == 200
    a, b = lane.json(), stack.json()
    assert a.keys() == b.keys() and a["object"] == b["object"] and a["model"] == b["model"]
    assert a["choices"][0].keys() == b["choices"][0].keys()
    assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"] == 4
    assert lane.headers["content-type"] == stack.headers["content-type"]
    assert int(lane.headers["content-length"]) == len(lane.content)
    rid = served.http.post(path, json=body, headers={"x-request-id": "lane-1"})
    assert rid.headers["x-request-id"] == "lane-1"


def test_streams_have_the_same_events_and_headers(served: Served) -> None:
    def events(headers: dict[str, str]) -> tuple[httpx.Headers, list[str]]:
        with served.http.stream("POST", "/v1/chat/completions", json=CHAT | {"stream": True},
                                headers=headers) as resp:
            assert resp.status_code == 200
            lines = [ln for ln in resp.iter_lines() if ln]
            return resp.headers, lines

    lane_headers, lane = events({"x-request-id": "s-1"})
    stack_headers, stack = events({"Origin": ORIGIN})
    assert lane[-1] == stack[-1] == "data: [DONE]"
    # NOTE: the same role chunk and finish chunk but for the id and time; the content in between
    # may be cut differently (chunks carry what arrived together)
    first, last = (lambda x: _anonymous(x[0]), lambda x: _anonymous(x[-2]))
    assert (first(lane), last(lane)) == (first(stack), last(stack))
    assert first(lane)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert last(lane)["choices"][0]["finish_reason"] == "length"
    for name in ("content-type", "cache-control", "x-accel-buffering"):
        assert lane_headers[name] == stack_headers[name], name
    assert lane_headers["x-request-id"] == "s-1"


def test_a_chunked_body_over_the_limit_is_413(served: Served) -> None:
    """No Content-Length to refuse early: the lane counts the bytes as they come."""
    piece = b'{"model": "demo", "messages": [{"role": "user", "content": "' + b"x" * 1500
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
            b"\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(4))
    status, body = _raw(served, head + chunks + b"0\r\n\r\n")
    assert status == 413, body
    assert b'"param":"body"' in body


@pytest.mark.parametrize(("path", "origin"), [
    ("/v1/chat/completions", b""),
    ("/v1/chat/completions", b"Origin: " + ORIGIN.encode() + b"\r\n"),
    ("/v1/sessions", b""),  # NOTE: not on the lane: litestar reads its body
], ids=["lane", "litestar", "session-create"])
def test_a_client_that_leaves_mid_body_is_a_499_in_the_metrics(
    served: Served, path: str, origin: bytes
) -> None:
    def count(status: str) -> float:
        for line in served.http.get("/metrics").text.splitlines():
            if line.startswith("agentgate_requests_total{") and \
                    f'endpoint="{path}"' in line and f'status="{status}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before, errors = count("499"), count("500")
    sock = socket.create_connection(("127.0.0.1", int(served.base_url.rsplit(":", 1)[1])))
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n" % path.encode()
                 + origin + b"Content-Type: application/json\r\n\r\n{\"model\": ")
    close_abruptly(sock)
    for _ in range(100):  # NOTE: bounded: 5 s
        if count("499") == before + 1 or count("500") > errors:
            break
        time.sleep(0.05)
    assert (count("499"), count("500")) == (before + 1, errors)
    assert served.http.post("/v1/chat/completions", json=CHAT).status_code == 200


def _anonymous(event: str) -> dict:
    body = json.loads(event.removeprefix("data: "))
    return body | {"id": None, "created": None}


def _raw(served: Served, request: bytes) -> tuple[int, bytes]:
    port = int(served.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n")
                          if ln.lower().startswith(b"content-length")))
        while len(body) < length:
            body += sock.recv(65536)
        return int(head[9:12]), body


def test_a_stateless_chat_without_hints_is_hashed_incrementally(served: Served) -> None:
    """No session header, ``prompt_cache_key`` or ``user``: the prompt cache's name of the chat
    keys the router's page hasher, so each later turn hashes only its new pages."""
    hasher = served.app.state.dispatcher.hasher
    messages = [{"role": "system", "content": "You are terse. " * 40},
                {"role": "user", "content": "A unique first question for this test. " * 4}]
    full0, incremental0 = hasher.num_full, hasher.num_incremental
    for turn in range(3):
        resp = served.http.post("/v1/chat/completions", json={
            "model": "demo", "messages": messages, "max_tokens": 4})
        assert resp.status_code == 200, resp.text
        messages += [resp.json()["choices"][0]["message"],
                     {"role": "user", "content": f"And turn {turn}, please. " * 8}]
    assert (hasher.num_full - full0, hasher.num_incremental - incremental0) == (1, 2)


def test_session_turns_answer_the_same_on_the_lane_and_through_litestar(served: Served) -> None:
    """A turn (JSON and SSE), its errors (unknown session 404, a bad body 400, a turn while one
    runs 409 is in test_sessions), and the metric's endpoint label are the same on both paths."""
    http = served.http
    sid = http.post("/v1/sessions", json={}).json()["id"]
    url = f"/v1/sessions/{sid}/turns"
    turn = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    lane, stack = _both(http, url, turn)
    assert lane.status_code == stack.status_code == 200, (lane.text, stack.text)
    assert (lane.json()["turn"], stack.json()["turn"]) == (0, 1)
    assert lane.json().keys() == stack.json().keys()
    for bad_url, body in [("/v1/sessions/sess_nope/turns", turn), (url, {"messages": 3})]:
        lane, stack = _both(http, bad_url, body)
        assert 400 <= lane.status_code < 500, lane.text
        assert (lane.status_code, lane.content) == (stack.status_code, stack.content)
    with http.stream("POST", url, json=turn | {"stream": True}) as resp:
        events = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert json.loads(events[0].removeprefix("data: "))["type"] == "turn_start"
    assert json.loads(events[-1].removeprefix("data: "))["type"] == "turn_end"
    labels = {line.split('endpoint="')[1].split('"')[0]
              for line in http.get("/metrics").text.splitlines()
              if line.startswith("agentgate_requests_total{") and "/turns" in line}
    assert labels == {"/v1/sessions/{session_id}/turns"}, labels
