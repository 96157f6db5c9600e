"""Restarts under a live ``agentgate serve --redis`` (real processes, real ``redis-server``):
Redis restarted with persistence keeps every session and the gateway goes on using it; Redis
restarted without persistence loses them (404) but nothing crashes and new sessions work; a
SIGKILLed gateway replaced by a new one finds every session intact, history and all."""

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.serve import WorkerProcess
from tests.gateway.live import LiveGateway, live_gateway, start_sim_worker
from tests.sessions.redis_server import RedisServer, redis_server

AUTH = {"Authorization": "Bearer sk-restart-faults"}
SESSIONS = 5
RECOVER_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    worker = start_sim_worker("restarts", "zero")
    try:
        yield worker
    finally:
        worker.stop(signal.SIGKILL)


def _gateway(model_dir: Path, worker: WorkerProcess, redis: RedisServer) -> Any:
    return live_gateway(model_dir, "--workers", "0", "--worker", worker.listen,
                        "--redis", redis.url)


def _http(gateway: LiveGateway) -> httpx.Client:
    return httpx.Client(base_url=gateway.base_url, headers=AUTH, timeout=60)


def _sessions_with_turns(http: httpx.Client, turns: int) -> dict[str, dict[str, Any]]:
    """``SESSIONS`` sessions of ``turns`` turns each (REST, then SSE): id -> its GET body."""
    out = {}
    for i in range(SESSIONS):
        sid = http.post("/v1/sessions", json={"system": f"Session {i}."}).json()["id"]
        for t in range(turns):
            body = {"messages": [{"role": "user", "content": f"turn {t} of {i}"}],
                    "max_tokens": 6, "stream": t % 2 == 1}
            resp = http.post(f"/v1/sessions/{sid}/turns", json=body)
            assert resp.status_code == 200, resp.text
        out[sid] = http.get(f"/v1/sessions/{sid}").json()
        assert len(out[sid]["turns"]) == turns, out[sid]
    return out


def _until_status(http: httpx.Client, method: str, url: str, want: int, **kw: Any) -> Any:
    """Retry until ``want`` (a gateway reconnecting to Redis answers 503 meanwhile)."""
    deadline = time.monotonic() + RECOVER_WITHIN_S
    while True:
        resp = http.request(method, url, **kw)
        if resp.status_code == want or time.monotonic() > deadline:
            return resp
        time.sleep(0.2)


def _same_history(before: dict[str, Any], after: dict[str, Any]) -> None:
    for field in ("id", "system", "messages", "turns", "usage"):
        assert after[field] == before[field], (field, before[field], after[field])


def test_a_persistent_redis_restart_keeps_every_session(
    sim_model_dir: Path, worker: WorkerProcess, tmp_path: Path
) -> None:
    with redis_server(tmp_path, persistent=True) as redis, \
            _gateway(sim_model_dir, worker, redis) as gateway, _http(gateway) as http:
        before = _sessions_with_turns(http, 2)
        redis.kill()  # NOTE: SIGKILL: only what the append-only file holds comes back
        assert http.get(f"/v1/sessions/{next(iter(before))}").status_code == 503
        redis.start()
        for sid, session in before.items():
            resp = _until_status(http, "GET", f"/v1/sessions/{sid}", 200)
            assert resp.status_code == 200, resp.text
            _same_history(session, resp.json())
            turn = http.post(f"/v1/sessions/{sid}/turns", json={
                "messages": [{"role": "user", "content": "and after?"}], "max_tokens": 4})
            assert turn.status_code == 200, turn.text
        assert gateway.proc.poll() is None


def test_a_redis_restart_without_persistence_loses_sessions_and_nothing_else(
    sim_model_dir: Path, worker: WorkerProcess, tmp_path: Path
) -> None:
    with redis_server(tmp_path) as redis, _gateway(sim_model_dir, worker, redis) as gateway, \
            _http(gateway) as http:
        before = _sessions_with_turns(http, 1)
        redis.kill()
        redis.start()
        for sid in before:
            resp = _until_status(http, "GET", f"/v1/sessions/{sid}", 404)
            assert resp.status_code == 404, resp.text
        fresh = _until_status(http, "POST", "/v1/sessions", 200, json={})
        assert fresh.status_code == 200, fresh.text
        turn = http.post(f"/v1/sessions/{fresh.json()['id']}/turns", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert turn.status_code == 200, turn.text
        assert http.get("/ready").status_code == 200 and gateway.proc.poll() is None


def test_a_killed_gateway_is_replaced_with_every_session_intact(
    sim_model_dir: Path, worker: WorkerProcess, tmp_path: Path
) -> None:
    with redis_server(tmp_path) as redis:
        with _gateway(sim_model_dir, worker, redis) as first, _http(first) as http:
            before = _sessions_with_turns(http, 3)
            first.proc.send_signal(signal.SIGKILL)
            first.proc.wait(timeout=30)
        with _gateway(sim_model_dir, worker, redis) as second, _http(second) as http:
            for sid, session in before.items():
                resp = http.get(f"/v1/sessions/{sid}")
                assert resp.status_code == 200, resp.text
                _same_history(session, resp.json())
                turn = http.post(f"/v1/sessions/{sid}/turns", json={
                    "messages": [{"role": "user", "content": "still there?"}],
                    "max_tokens": 4}).json()
                # NOTE: the new turn's prompt holds the whole history the first gateway wrote
                assert turn["usage"]["prompt_tokens"] > session["turns"][-1]["usage"][
                    "prompt_tokens"], (turn, session["turns"][-1])
