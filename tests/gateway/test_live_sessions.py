"""Sessions against a live ``agentgate serve`` (native worker, demo model), over real HTTP and a
real WebSocket: an agent loop (a forced tool call whose arguments validate, the tool result, a
final answer), per-turn usage with cached tokens, a streamed WebSocket turn that joins up to
the stored answer, cancel, and delete."""

import json
from typing import Any

import httpx
import jsonschema
from websockets.sync.client import connect

from tests.gateway.live import LiveGateway

LOOKUP = {"type": "function", "function": {
    "name": "lookup",
    "description": "Look a word up in the dictionary.",
    "parameters": {"type": "object",
                   "properties": {"word": {"type": "string", "maxLength": 10}},
                   "required": ["word"], "additionalProperties": False},
}}
AUTH = {"Authorization": "Bearer sk-live-sessions"}


def _turn(http: httpx.Client, sid: str, **body: Any) -> dict[str, Any]:
    resp = http.post(f"/v1/sessions/{sid}/turns", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_rest_agent_loop(native_gateway: LiveGateway) -> None:
    with httpx.Client(base_url=native_gateway.base_url, headers=AUTH, timeout=60) as http:
        created = http.post("/v1/sessions", json={"system": "You look words up.",
                                                  "tools": [LOOKUP], "metadata": {"k": "v"}})
        assert created.status_code in (200, 201), created.text
        sid = created.json()["id"]

        first = _turn(http, sid, messages=[{"role": "user", "content": "What is a quokka?"}],
                      tool_choice="required", parallel_tool_calls=False, max_tokens=200, seed=5)
        assert first["finish_reason"] == "tool_calls", first
        [call] = first["message"]["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        jsonschema.validate(args, LOOKUP["function"]["parameters"])

        result = {"role": "tool", "tool_call_id": call["id"], "content": "a small wallaby"}
        second = _turn(http, sid, messages=[result], tool_choice="none", max_tokens=6)
        assert second["finish_reason"] in ("stop", "length"), second
        assert not second["message"].get("tool_calls"), second

        state = http.get(f"/v1/sessions/{sid}").json()
        assert [m["role"] for m in state["messages"]] == ["user", "assistant", "tool", "assistant"]
        turns = state["turns"]
        assert len(turns) == 2, turns
        # the second turn resends nothing: its prompt starts with the first turn's, cached
        cached = turns[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= turns[0]["usage"]["prompt_tokens"] // 2, turns

        assert http.delete(f"/v1/sessions/{sid}").status_code in (200, 204)
        gone = http.get(f"/v1/sessions/{sid}")
        assert gone.status_code == 404 and gone.json()["error"]["message"], gone.text


def test_websocket_turn_and_cancel(native_gateway: LiveGateway) -> None:
    with httpx.Client(base_url=native_gateway.base_url, headers=AUTH, timeout=60) as http:
        sid = http.post("/v1/sessions", json={"system": "Be brief."}).json()["id"]
        ws_url = native_gateway.base_url.replace("http://", "ws://") + f"/v1/sessions/{sid}/ws"
        with connect(ws_url, additional_headers=AUTH, open_timeout=30) as ws:
            ws.send(json.dumps({"type": "turn", "max_tokens": 8, "seed": 1,
                                "messages": [{"role": "user", "content": "Hello!"}]}))
            frames = _frames_until_end(ws)
            assert frames[0]["type"] == "turn_start", frames
            end = frames[-1]
            assert end["type"] == "turn_end" and end["usage"]["completion_tokens"] == 8, end
            streamed = "".join(f["content"] for f in frames if f["type"] == "delta")
            assert streamed == (end["message"]["content"] or ""), (streamed, end)

            ws.send(json.dumps({"type": "turn", "max_tokens": 2000,
                                "messages": [{"role": "user", "content": "Tell me more."}]}))
            assert json.loads(ws.recv(timeout=60))["type"] == "turn_start"
            ws.send(json.dumps({"type": "cancel"}))
            cancelled = _frames_until_end(ws)[-1]
            assert cancelled["type"] == "turn_end", cancelled
            assert cancelled["finish_reason"] == "cancelled", cancelled
            assert cancelled["usage"]["completion_tokens"] < 2000, cancelled

            ws.send("not json")
            error = json.loads(ws.recv(timeout=30))
            assert error["type"] == "error" and error["error"]["message"], error
        turns = http.get(f"/v1/sessions/{sid}").json()["turns"]
        assert [t["finish_reason"] for t in turns] == ["length", "cancelled"], turns


def _frames_until_end(ws: Any, limit: int = 10_000) -> list[dict[str, Any]]:
    frames = []
    for _ in range(limit):
        frame = json.loads(ws.recv(timeout=60))
        frames.append(frame)
        if frame["type"] in ("turn_end", "error"):
            return frames
    raise AssertionError(f"no turn_end in {limit} frames")
