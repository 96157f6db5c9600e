"""The Session API against a real sim worker (``--cost zero``) and the demo tokenizer: REST round
trip with per-turn usage and cached tokens, SSE, tool-call round trip with tool-result
validation, WebSocket turns and cancel, tenant isolation, 404 / 400 / 409 errors, and the Redis
store behind the same API."""

import json
import re
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from gateway.serve import WorkerProcess
from sessions import StoreUnavailable
from tests.gateway.dispatch_live import app_client

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
KEY_A = {"Authorization": "Bearer key-a"}
KEY_B = {"Authorization": "Bearer key-b"}


@pytest.fixture(scope="module")
def worker(sim_worker: WorkerProcess) -> WorkerProcess:
    return sim_worker


@pytest.fixture(scope="module")
def model_dir(tokenizer_dir: Path) -> Path:
    return tokenizer_dir


@pytest.fixture(scope="module")
def client(store_client: TestClient[Litestar]) -> TestClient[Litestar]:
    return store_client


def _create(client: TestClient[Litestar], headers: dict[str, str] = KEY_A, **body: Any) -> str:
    resp = client.post("/v1/sessions", json={"system": "Be brief."} | body, headers=headers)
    assert resp.status_code == 200, resp.text
    return resp.json()["id"]


def _turn(client: TestClient[Litestar], sid: str, messages: list[dict[str, Any]],
          headers: dict[str, str] = KEY_A, **body: Any) -> Any:
    payload = {"messages": messages, "max_tokens": 6, "seed": 1} | body
    return client.post(f"/v1/sessions/{sid}/turns", json=payload, headers=headers)


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _assert_error(resp: Any, status: int, param: str | None, code: str | None = None) -> None:
    assert resp.status_code == status, (resp.status_code, resp.text)
    error = resp.json()["error"]
    assert error["param"] == param and error["message"] and error["type"], error
    assert code is None or error["code"] == code, error


def _ws_until_end(ws: Any) -> list[dict[str, Any]]:
    frames = []
    while not frames or frames[-1]["type"] not in ("turn_end", "error"):
        frames.append(json.loads(ws.receive_text()))
    return frames


def test_rest_round_trip_with_usage_and_cached_tokens(client: TestClient[Litestar]) -> None:
    sid = _create(client, metadata={"agent": "test"})
    first = _turn(client, sid, _user("A long opening message. " * 20))
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["turn"] == 0 and body["finish_reason"] == "length", body
    assert body["message"]["role"] == "assistant" and body["usage"]["completion_tokens"] == 6
    second = _turn(client, sid, _user("And a follow-up."))
    assert second.status_code == 200 and second.json()["turn"] == 1, second.text

    session = client.get(f"/v1/sessions/{sid}", headers=KEY_A).json()
    assert session["metadata"] == {"agent": "test"} and session["system"] == "Be brief."
    assert [m["role"] for m in session["messages"]] == ["user", "assistant"] * 2, session
    assert session["messages"][1]["content"] == body["message"]["content"]
    t0, t1 = session["turns"]
    assert t0["messages"] == [0, 2] and t1["messages"] == [2, 4], session["turns"]
    assert t1["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, t1
    assert t1["reused_prompt_tokens"] > 0, "the second turn reuses the stored prompt ids"
    assert session["cache"]["cached_tokens"] == t1["usage"]["prompt_tokens_details"][
        "cached_tokens"] + t0["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert session["usage"]["completion_tokens"] == 12 and not session["running"], session

    deleted = client.delete(f"/v1/sessions/{sid}", headers=KEY_A)
    assert deleted.status_code == 200 and deleted.json()["deleted"], deleted.text
    _assert_error(client.get(f"/v1/sessions/{sid}", headers=KEY_A), 404, "session_id",
                  "session_not_found")
    _assert_error(_turn(client, sid, _user("hi")), 404, "session_id")
    _assert_error(client.delete(f"/v1/sessions/{sid}", headers=KEY_A), 404, "session_id")


def test_sse_turn_frames_match_the_recorded_answer(client: TestClient[Litestar]) -> None:
    sid = _create(client)
    resp = _turn(client, sid, _user("Stream please."), stream=True, max_tokens=20)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    frames = [json.loads(line.removeprefix("data: ")) for line in resp.text.split("\n")
              if line.startswith("data: ")]
    assert frames[0]["type"] == "turn_start" and frames[-1]["type"] == "turn_end", frames
    streamed = "".join(f["content"] for f in frames if f["type"] == "delta")
    assert streamed == (frames[-1]["message"]["content"] or ""), frames
    session = client.get(f"/v1/sessions/{sid}", headers=KEY_A).json()
    assert session["messages"][-1]["content"] == streamed
    assert session["turns"][0]["usage"]["completion_tokens"] == 20


def test_tool_results_must_answer_pending_calls(client: TestClient[Litestar]) -> None:
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [CALL]}]
    sid = _create(client, tools=TOOLS, messages=history)
    wrong = [{"role": "tool", "tool_call_id": "call_nope", "content": "sunny"}]
    _assert_error(_turn(client, sid, wrong), 400, "messages[0].tool_call_id")
    _assert_error(_turn(client, sid, _user("never mind")), 400, "messages[0]")
    resp = _turn(client, sid, [{"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert resp.status_code == 200, resp.text
    session = client.get(f"/v1/sessions/{sid}", headers=KEY_A).json()
    assert [m["role"] for m in session["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert session["turns"][0]["messages"] == [2, 4], session["turns"]
    again = [{"role": "tool", "tool_call_id": "call_1", "content": "again"}]
    _assert_error(_turn(client, sid, again), 400, "messages[0].tool_call_id")


def test_bad_inputs_are_4xx_naming_the_param(client: TestClient[Litestar]) -> None:
    _assert_error(client.post("/v1/sessions", json={"modle": "x"}), 400, "modle")
    _assert_error(client.post("/v1/sessions", json={"tools": [TOOLS[0], TOOLS[0]]}), 400,
                  "tools[1].function.name")
    _assert_error(client.post("/v1/sessions", json={"metadata": {"k": 1}}), 400, "metadata")
    _assert_error(client.post("/v1/sessions", json={"messages": [{"role": "system",
                                                                  "content": "x"}]}),
                  400, "messages[0].role")
    _assert_error(client.post("/v1/sessions", content=b"{nope"), 400, None)
    sid = _create(client)
    _assert_error(_turn(client, sid, []), 400, "messages")
    _assert_error(_turn(client, sid, _user("x"), temperature=9), 400, "temperature")
    _assert_error(_turn(client, sid, _user("x"), max_token=3), 400, "max_token")
    _assert_error(_turn(client, sid, [{"role": "assistant", "content": "x"}]), 400,
                  "messages[0].role")
    _assert_error(_turn(client, sid, _user("x" * 40_000)), 400, "messages")


def test_tenants_never_see_each_other(client: TestClient[Litestar]) -> None:
    sid = _create(client, headers=KEY_A)
    for method in ("get", "delete"):
        _assert_error(getattr(client, method)(f"/v1/sessions/{sid}", headers=KEY_B), 404,
                      "session_id")
    _assert_error(client.get(f"/v1/sessions/{sid}"), 404, "session_id")  # anonymous
    _assert_error(_turn(client, sid, _user("hi"), headers=KEY_B), 404, "session_id")
    assert client.get(f"/v1/sessions/{sid}", headers=KEY_A).status_code == 200


def test_websocket_turns_cancel_and_errors(client: TestClient[Litestar]) -> None:
    sid = _create(client)
    with client.websocket_connect(f"/v1/sessions/{sid}/ws", headers=KEY_A) as ws:
        ws.send_text(json.dumps({"type": "turn", "messages": _user("Hi"), "max_tokens": 5}))
        frames = _ws_until_end(ws)
        assert frames[0]["type"] == "turn_start" and frames[-1]["type"] == "turn_end", frames
        assert frames[-1]["finish_reason"] == "length" and frames[-1]["turn"] == 0

        ws.send_text("{not json")
        assert json.loads(ws.receive_text())["type"] == "error"
        ws.send_text(json.dumps({"type": "dance"}))
        assert json.loads(ws.receive_text())["error"]["param"] == "type"
        ws.send_text(json.dumps({"type": "cancel"}))
        assert json.loads(ws.receive_text())["error"]["code"] == "no_turn_running"

        ws.send_text(json.dumps({"type": "turn", "messages": _user("Long one"),
                                 "max_tokens": 8000}))
        assert json.loads(ws.receive_text())["type"] == "turn_start"
        ws.send_text(json.dumps({"type": "turn", "messages": _user("Too soon")}))
        ws.send_text(json.dumps({"type": "cancel"}))
        frames = _ws_until_end(ws)
        busy = [f for f in frames if f["type"] == "error"]
        assert busy == [] or busy[0]["error"]["code"] == "turn_in_progress", frames
        if frames[-1]["type"] == "error":  # NOTE: the 409 frame came first; the end follows
            frames = _ws_until_end(ws)
        end = frames[-1]
        assert end["type"] == "turn_end" and end["finish_reason"] == "cancelled", frames
        assert end["usage"]["completion_tokens"] < 8000, end
    session = client.get(f"/v1/sessions/{sid}", headers=KEY_A).json()
    assert [t["finish_reason"] for t in session["turns"]] == ["length", "cancelled"]
    assert session["messages"][-1]["role"] == "assistant" and not session["running"]
    assert session["messages"][-1]["content"] == end["message"]["content"]


def test_websocket_unknown_session_closes_with_an_error(client: TestClient[Litestar]) -> None:
    with client.websocket_connect("/v1/sessions/sess_nope/ws", headers=KEY_A) as ws:
        frame = json.loads(ws.receive_text())
        assert frame["type"] == "error" and frame["error"]["code"] == "session_not_found", frame


def test_concurrent_turn_is_409(client: TestClient[Litestar]) -> None:
    sid = _create(client)
    with client.websocket_connect(f"/v1/sessions/{sid}/ws", headers=KEY_A) as ws:
        ws.send_text(json.dumps({"type": "turn", "messages": _user("Long"), "max_tokens": 8000}))
        assert json.loads(ws.receive_text())["type"] == "turn_start"
        _assert_error(_turn(client, sid, _user("Me too")), 409, None, "turn_in_progress")
        ws.send_text(json.dumps({"type": "cancel"}))
        assert _ws_until_end(ws)[-1]["finish_reason"] == "cancelled"
    assert _turn(client, sid, _user("Now")).status_code == 200


def test_memory_store_is_bounded(worker: WorkerProcess, model_dir: Path) -> None:
    with app_client(worker, model_dir, max_sessions=2) as client:
        ids = [_create(client) for _ in range(3)]
        _assert_error(client.get(f"/v1/sessions/{ids[0]}", headers=KEY_A), 404, "session_id")
        assert client.get(f"/v1/sessions/{ids[2]}", headers=KEY_A).status_code == 200


def test_unreachable_redis_stops_startup(worker: WorkerProcess, model_dir: Path) -> None:
    with pytest.raises(BaseException) as info:  # noqa: SIM117 - anyio wraps it in a group
        with app_client(worker, model_dir, redis_url="redis://127.0.0.1:1/0"):
            pass
    errors = _leaves(info.value)
    assert any(isinstance(e, StoreUnavailable) and "cannot reach Redis" in str(e)
               for e in errors), errors


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def test_session_metrics_count_sessions_and_turn_outcomes(client: TestClient[Litestar]) -> None:
    def scrape() -> dict[str, float]:
        text = client.get("/metrics").text
        pattern = r"^(agentgate_sessions?_\w+(?:\{[^}]*\})?) (\S+)$"
        return {k: float(v) for k, v in re.findall(pattern, text, re.M)}

    before = scrape()
    sid = _create(client)
    assert _turn(client, sid, _user("hello")).status_code == 200
    assert client.delete(f"/v1/sessions/{sid}", headers=KEY_A).status_code == 200
    after = scrape()

    def grew(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("agentgate_sessions_created_total") == 1, after
    assert grew("agentgate_sessions_deleted_total") == 1, after
    assert grew('agentgate_session_turns_total{outcome="length"}') == 1, after


def test_tool_schema_integers_beyond_64_bits_are_400(client: TestClient[Litestar]) -> None:
    """Found by hand after the fuzzer's hint: the Redis store (msgpack) could not hold such a
    schema, which was a 500 there."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": 2**70}}}]
    _assert_error(client.post("/v1/sessions", json={"tools": tools}, headers=KEY_A), 400,
                  "tools[0].function.parameters")
