"""Session API hardening (issue 8) through the app and a real sim worker, on both stores:
``GET /v1/sessions`` pages the caller's sessions only; a bad tool schema or a history that can
never fit the context is refused at creation, before anything is stored; an oversized turn is a
400 at once; ``/ready`` includes the session store; WebSocket answers carry the id of the frame
they answer, and an oversized frame is refused with a clear close; a cancelled turn with no
content stores ``content: null``; tenant ids are keyed by the deployment's secret, which shows up
in no store key, value or log line."""

import json
import logging
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import redis as redis_sync
from litestar import Litestar
from litestar.testing import TestClient
from litestar.testing.websocket_test_session import WebSocketTestSession

from gateway.serve import WorkerProcess
from gateway.tenancy import tenant_id
from tests.gateway.dispatch_live import app_client
from tests.gateway.live import start_sim_worker
from tests.sessions.redis_server import redis_server

KEY_A = {"Authorization": "Bearer key-a"}
KEY_B = {"Authorization": "Bearer key-b"}
HUGE = "word " * (3 * 1024 * 1024)  # 15 MiB: can never fit an 8k context
SECRET = b"a-deployment-secret-0123456789"


@pytest.fixture(scope="module")
def client(store_client: TestClient[Litestar]) -> TestClient[Litestar]:
    return store_client


def _create(client: TestClient[Litestar], headers: dict[str, str] = KEY_A, **body: Any) -> Any:
    return client.post("/v1/sessions", json=body, headers=headers)


def _assert_error(resp: Any, status: int, param: str | None, code: str | None = None) -> None:
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    error = resp.json()["error"]
    assert error["param"] == param and error["message"] and error["type"], error
    assert code is None or error["code"] == code, error


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def test_list_sessions_pages_the_callers_sessions_only(client: TestClient[Litestar]) -> None:
    key_c = {"Authorization": "Bearer key-c-lists"}
    mine = sorted(_create(client, key_c, metadata={"i": str(i)}).json()["id"] for i in range(3))
    theirs = _create(client, KEY_B).json()["id"]
    first = client.get("/v1/sessions", params={"limit": 2}, headers=key_c).json()
    assert first["object"] == "list" and first["has_more"], first
    assert [s["id"] for s in first["data"]] == mine[:2] and first["last_id"] == mine[1]
    assert first["data"][0]["object"] == "session" and "messages" not in first["data"][0]
    rest = client.get("/v1/sessions", params={"after": first["last_id"]}, headers=key_c).json()
    assert [s["id"] for s in rest["data"]] == mine[2:] and not rest["has_more"], rest
    everyone_else = [client.get("/v1/sessions", headers=h).json()["data"] for h in (KEY_B, {})]
    assert all(s["id"] not in mine for page in everyone_else for s in page), everyone_else
    assert theirs in [s["id"] for s in everyone_else[0]]
    for bad in ("0", "101", "ten"):
        _assert_error(client.get("/v1/sessions", params={"limit": bad}), 400, "limit")


def test_a_bad_tool_schema_is_refused_at_creation(client: TestClient[Litestar]) -> None:
    good = {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}}
    bad = {"type": "function", "function": {"name": "bad", "parameters": {
        "type": "object", "properties": {"x": {"type": "no-such-type"}}}}}
    key = {"Authorization": "Bearer key-tools"}
    _assert_error(_create(client, key, tools=[good, bad]), 400, "tools[1].function.parameters")
    assert client.get("/v1/sessions", headers=key).json()["data"] == [], "nothing stored"
    assert _create(client, key, tools=[good]).status_code == 200


def test_a_session_for_another_model_is_404(client: TestClient[Litestar]) -> None:
    _assert_error(_create(client, model="gpt-4o"), 404, "model", "model_not_found")
    assert _create(client, model="demo").status_code == 200


def test_a_history_that_cannot_fit_is_refused_before_storing(client: TestClient[Litestar]) -> None:
    key = {"Authorization": "Bearer key-huge"}
    _assert_error(_create(client, key, messages=_user(HUGE)), 400, "messages",
                  "context_length_exceeded")
    # NOTE: under the cheap bound, but more tokens than the context: refused after tokenizing
    over = " ".join(f"w{i}" for i in range(9000))
    _assert_error(_create(client, key, messages=_user(over)), 400, "messages",
                  "context_length_exceeded")
    assert client.get("/v1/sessions", headers=key).json()["data"] == [], "nothing stored"

    sid = _create(client, key).json()["id"]
    resp = client.post(f"/v1/sessions/{sid}/turns", json={"messages": _user(HUGE)}, headers=key)
    _assert_error(resp, 400, "messages", "context_length_exceeded")
    session = client.get(f"/v1/sessions/{sid}", headers=key).json()
    assert session["messages"] == [] and not session["running"], session


def test_websocket_answers_carry_the_frame_id(
    sim_worker: WorkerProcess, tokenizer_dir: Path
) -> None:
    with app_client(sim_worker, tokenizer_dir, max_body_bytes=64 * 1024) as client:
        sid = _create(client).json()["id"]
        with client.websocket_connect(f"/v1/sessions/{sid}/ws", headers=KEY_A) as ws:
            ws.send_text(json.dumps({"type": "cancel", "id": "c-1"}))
            error = _recv_error(ws)
            assert error["id"] == "c-1" and error["error"]["code"] == "no_turn_running", error
            ws.send_text(json.dumps({"type": "turn", "id": "bad-1", "messages": []}))
            assert _recv_error(ws)["id"] == "bad-1"
            ws.send_text(json.dumps({"type": "turn", "id": 7, "messages": _user("x")}))
            assert "id" not in _recv_error(ws), "an unreadable id is not echoed"
            ws.send_text(json.dumps({"type": "turn", "id": "t-1", "max_tokens": 4,
                                     "messages": _user("hi")}))
            frames = [_recv(ws)]
            while frames[-1]["type"] not in ("turn_end", "error"):
                frames.append(_recv(ws))
            assert frames[0]["type"] == "turn_start" and frames[0]["id"] == "t-1", frames
            assert frames[-1]["type"] == "turn_end" and frames[-1]["id"] == "t-1", frames
            ws.send_text(json.dumps({"type": "turn", "messages": _user("y" * 70_000)}))
            error = _recv_error(ws)
            assert error["error"]["code"] == "frame_too_large", error
            assert "65536" in error["error"]["message"], error
            with pytest.raises(Exception) as closed:
                ws.receive_text()
            assert getattr(closed.value, "code", None) == 1009, closed.value


def test_a_cancelled_turn_without_content_stores_null(tokenizer_dir: Path) -> None:
    worker = start_sim_worker("cancel-null", "h200")  # NOTE: ~20 ms a step: cancel comes first
    try:
        with app_client(worker, tokenizer_dir) as client:
            sid = _create(client).json()["id"]
            with client.websocket_connect(f"/v1/sessions/{sid}/ws", headers=KEY_A) as ws:
                ws.send_text(json.dumps({"type": "turn", "max_tokens": 500,
                                         "messages": _user("hi " * 2000)}))
                assert _recv(ws)["type"] == "turn_start"
                ws.send_text(json.dumps({"type": "cancel"}))
                end = _recv(ws)
                while end["type"] == "delta":
                    end = _recv(ws)
            assert end["type"] == "turn_end" and end["finish_reason"] == "cancelled", end
            stored = client.get(f"/v1/sessions/{sid}", headers=KEY_A).json()["messages"][-1]
            assert stored["content"] == end["message"]["content"], (stored, end)
            assert stored["content"] != "", "no content is null, not an empty string"
    finally:
        worker.stop(signal.SIGKILL)


def test_ready_includes_the_session_store(
    sim_worker: WorkerProcess, tokenizer_dir: Path, tmp_path: Path
) -> None:
    with app_client(sim_worker, tokenizer_dir) as client:
        ready = client.get("/ready")
        assert ready.status_code == 200 and ready.json()["sessions"] == "ok", ready.text
    with redis_server(tmp_path) as server, app_client(
        sim_worker, tokenizer_dir, redis_url=server.url
    ) as client:
        assert client.get("/ready").json()["sessions"] == "ok"
        server.kill()
        _assert_error(client.get("/ready"), 503, "sessions", "service_unavailable")
        assert "sessions" in client.get("/ready").json()["error"]["message"]
        server.start()
        assert client.get("/ready").status_code == 200


def test_tenant_ids_are_keyed_by_the_deployment_secret(
    sim_worker: WorkerProcess, tokenizer_dir: Path, redis_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    one, two = tenant_id("sk-weak", SECRET), tenant_id("sk-weak", b"another secret")
    assert one != two != tenant_id("sk-weak") and one == tenant_id("sk-weak", SECRET)
    assert all(re.fullmatch(r"t-[0-9a-f]{24}", t) for t in (one, two)), (one, two)
    assert tenant_id("k", b"s" * 200) != tenant_id("k", b"s" * 199), "long secrets count whole"
    headers = {"Authorization": "Bearer sk-weak"}
    caplog.set_level(logging.DEBUG)
    with app_client(sim_worker, tokenizer_dir, redis_url=redis_url, tenant_secret=SECRET) as client:
        sid = _create(client, headers).json()["id"]
        turn = client.post(f"/v1/sessions/{sid}/turns", headers=headers,
                           json={"messages": _user("hi"), "max_tokens": 2})
        assert turn.status_code == 200, turn.text
    with app_client(sim_worker, tokenizer_dir, redis_url=redis_url,
                 tenant_secret=b"another secret") as client:
        _assert_error(client.get(f"/v1/sessions/{sid}", headers=headers), 404, "session_id")
    db = redis_sync.Redis.from_url(redis_url)
    try:
        keys = [k for k in db.scan_iter(match=f"*{sid}*")]
        assert keys and all(one.encode() in k for k in keys), keys
        for key in db.scan_iter(count=1000):
            assert SECRET not in key, key
            if db.type(key) == b"hash":
                assert all(SECRET not in v for v in db.hgetall(key).values()), key
    finally:
        db.close()
    assert SECRET.decode() not in caplog.text


def _recv(ws: WebSocketTestSession) -> dict[str, Any]:
    return json.loads(ws.receive_text())


def _recv_error(ws: WebSocketTestSession) -> dict[str, Any]:
    frame = _recv(ws)
    assert frame["type"] == "error" and frame["error"]["message"], frame
    return frame



def test_a_turn_that_would_overflow_the_session_bound_is_413_and_releases_it(
    client: TestClient[Litestar],
) -> None:
    store = client.app.state.sessions.manager.store
    sid = _create(client).json()["id"]
    bound = store.max_session_bytes
    store.max_session_bytes = 1500  # NOTE: a fresh session is a few hundred bytes
    try:
        resp = client.post(f"/v1/sessions/{sid}/turns", headers=KEY_A,
                           json={"messages": _user("z" * 2000), "max_tokens": 2})
        _assert_error(resp, 413, "messages", "session_too_large")
        session = client.get(f"/v1/sessions/{sid}", headers=KEY_A).json()
        assert session["messages"] == [] and not session["running"], session
    finally:
        store.max_session_bytes = bound
