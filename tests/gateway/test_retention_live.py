"""Tool-pause retention through the real gateway app and a real sim worker (ZeroMQ): a turn that
ends in tool calls sends Retain (the worker's LoadReport shows retained pages), a plain answer
does not, the next turn releases it once dispatched and counts its cache hit, deleting the
session releases it; the same for stateless chat completions (JSON and SSE)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from gateway.routing.retention import ToolPauseRetention
from gateway.serve import ServeError, WorkerProcess, spawn_worker
from gateway.tool_pauses import retention_of
from tests.gateway.dispatch_live import app_client
from tests.gateway.live import WORKER_START_TIMEOUT_S

LOOKUP = {"type": "function", "function": {
    "name": "lookup",
    "description": "Look a word up.",
    "parameters": {"type": "object",
                   "properties": {"word": {"type": "string", "maxLength": 6}},
                   "required": ["word"], "additionalProperties": False},
}}
AUTH = {"Authorization": "Bearer sk-retention-tests"}
POLL_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def retention_worker(sim_model_dir: Path) -> Iterator[WorkerProcess]:
    """A sim worker of its own (its retained pages are only these tests'), with the tokenizer
    that tool-call grammars need."""
    try:
        worker = spawn_worker(model_dir=sim_model_dir, backend="sim", worker_id="retention",
                              extra_args=("--cost", "zero"), timeout_s=WORKER_START_TIMEOUT_S)
    except ServeError as exc:
        pytest.fail(str(exc))
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture
def client(retention_worker: WorkerProcess, sim_model_dir: Path) -> Iterator[TestClient[Litestar]]:
    with app_client(retention_worker, sim_model_dir, heartbeat_s=0.2, dead_after_s=5.0) as c:
        yield c


def _retention(client: TestClient[Litestar]) -> ToolPauseRetention:
    return retention_of(client.app.state.dispatcher)


def _retained_pages(client: TestClient[Litestar]) -> int:
    load = client.app.state.dispatcher.clients[0].last_load
    return -1 if load is None else load.retained_pages


def _wait_for(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + POLL_TIMEOUT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _turn(client: TestClient[Litestar], sid: str, **body: Any) -> dict[str, Any]:
    resp = client.post(f"/v1/sessions/{sid}/turns", json=body, headers=AUTH)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _tool_turn(client: TestClient[Litestar], sid: str) -> dict[str, Any]:
    first = _turn(client, sid, messages=[{"role": "user", "content": "Define quokka."}],
                  tool_choice="required", parallel_tool_calls=False, max_tokens=120, seed=3)
    assert first["finish_reason"] == "tool_calls", first
    return first


def _session(client: TestClient[Litestar]) -> str:
    created = client.post("/v1/sessions", json={"system": "Be brief.", "tools": [LOOKUP]},
                          headers=AUTH)
    assert created.status_code in (200, 201), created.text
    return created.json()["id"]


def test_tool_turn_retains_and_next_turn_releases(client: TestClient[Litestar]) -> None:
    retention = _retention(client)
    sid = _session(client)
    first = _tool_turn(client, sid)
    assert retention.num_retains == 1 and retention.num_paused == 1
    _wait_for("retained pages on the worker", lambda: _retained_pages(client) > 0)
    metrics = client.get("/metrics").text
    assert "agentgate_retention_retains_total 1.0" in metrics
    assert "agentgate_retention_worker_retained_pages{worker=" in metrics

    [call] = first["message"]["tool_calls"]
    result = {"role": "tool", "tool_call_id": call["id"], "content": "a small wallaby"}
    second = _turn(client, sid, messages=[result], tool_choice="none", max_tokens=4)
    assert second["finish_reason"] in ("stop", "length"), second
    # NOTE: the plain answer retains nothing; the pause it ended was released and counted
    assert retention.num_retains == 1 and retention.num_paused == 0
    assert retention.num_releases == 1 and retention.num_resumed == 1
    assert retention.resumed_cached_tokens > 0, "the turn after the pause missed the cache"
    assert retention.resumed_cached_tokens == second["usage"]["prompt_tokens_details"][
        "cached_tokens"]
    _wait_for("the release on the worker", lambda: _retained_pages(client) == 0)


def test_plain_answer_does_not_retain(client: TestClient[Litestar]) -> None:
    retention = _retention(client)
    sid = _session(client)
    answer = _turn(client, sid, messages=[{"role": "user", "content": "Hi"}],
                   tool_choice="none", max_tokens=4)
    assert answer["finish_reason"] in ("stop", "length")
    assert retention.num_retains == 0 and retention.num_paused == 0
    time.sleep(0.5)  # NOTE: a few heartbeats: nothing retained shows up late either
    assert _retained_pages(client) == 0


def test_session_delete_releases(client: TestClient[Litestar]) -> None:
    retention = _retention(client)
    sid = _session(client)
    _tool_turn(client, sid)
    _wait_for("retained pages on the worker", lambda: _retained_pages(client) > 0)
    assert client.delete(f"/v1/sessions/{sid}", headers=AUTH).status_code == 200
    assert retention.num_paused == 0 and retention.num_releases == 1
    _wait_for("the release on the worker", lambda: _retained_pages(client) == 0)


def _chat(client: TestClient[Litestar], messages: list[dict[str, Any]], **body: Any) -> Any:
    resp = client.post("/v1/chat/completions", headers=AUTH, json={
        "model": "demo", "messages": messages, "tools": [LOOKUP], "max_tokens": 120,
        "seed": 3, **body})
    assert resp.status_code == 200, resp.text
    return resp


def _sse_calls(text: str) -> tuple[list[dict[str, Any]], str | None]:
    calls: dict[int, dict[str, Any]] = {}
    reason = None
    for line in text.splitlines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[len("data: "):])
        for choice in chunk["choices"]:
            reason = choice.get("finish_reason") or reason
            for call in choice["delta"].get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"id": "", "type": "function",
                                                         "function": {"name": "",
                                                                      "arguments": ""}})
                entry["id"] = call.get("id") or entry["id"]
                fn = call.get("function") or {}
                entry["function"]["name"] += fn.get("name") or ""
                entry["function"]["arguments"] += fn.get("arguments") or ""
    return [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("stream", [False, True])
def test_stateless_tool_answer_retained_until_continued(
    client: TestClient[Litestar], stream: bool
) -> None:
    retention = _retention(client)
    user = [{"role": "user", "content": f"Define quokka ({stream})."}]
    resp = _chat(client, user, tool_choice="required", parallel_tool_calls=False, stream=stream)
    if stream:
        calls, reason = _sse_calls(resp.text)
    else:
        choice = resp.json()["choices"][0]
        calls, reason = choice["message"]["tool_calls"], choice["finish_reason"]
    assert reason == "tool_calls" and len(calls) == 1, resp.text
    assert retention.num_retains == 1 and retention.num_paused == 1
    _wait_for("retained pages on the worker", lambda: _retained_pages(client) > 0)

    history = [*user, {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "tool_call_id": calls[0]["id"], "content": "a small wallaby"}]
    follow = _chat(client, history, tool_choice="none", max_tokens=4).json()
    assert follow["choices"][0]["finish_reason"] in ("stop", "length"), follow
    assert retention.num_paused == 0 and retention.num_releases == 1
    assert retention.num_resumed == 1 and retention.num_retains == 1
    _wait_for("the release on the worker", lambda: _retained_pages(client) == 0)


def test_stateless_plain_answer_does_not_retain(client: TestClient[Litestar]) -> None:
    retention = _retention(client)
    _chat(client, [{"role": "user", "content": "Hello"}], tool_choice="none", max_tokens=4)
    assert retention.num_retains == 0 and retention.num_paused == 0


def test_retain_ttl_zero_turns_it_off(retention_worker: WorkerProcess, sim_model_dir: Path) -> None:
    with app_client(retention_worker, sim_model_dir, retain_ttl_s=0.0) as off:
        retention = _retention(off)
        sid = _session(off)
        _tool_turn(off, sid)
        resp = _chat(off, [{"role": "user", "content": "Define quokka."}],
                     tool_choice="required", parallel_tool_calls=False)
        assert resp.json()["choices"][0]["finish_reason"] == "tool_calls"
        assert retention.num_retains == 0 and retention.num_paused == 0
