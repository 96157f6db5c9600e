"""Workers that go away and come back on the same address (issue 8, items 8-10), with real sim
worker subprocesses killed (SIGKILL) and started again on their port, and the real app on a real
HTTP server:

- a started stream of a killed worker ends with an error at once, not after the idle timeout,
  even when a new worker process is up on the address before the old one was declared dead;
- a non-streamed request that had sent nothing is retried on the new incarnation and succeeds;
- a gateway started while its worker is down starts at once, answers 503, and uses the worker
  as soon as it comes up;
- ``/metrics``: ``worker_up`` is 0 and the load gauges are gone while a worker is away; the
  reconnect and restart counters count its return.
"""

import asyncio
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.protocol import Finished, TokenDelta
from gateway.app import GatewayConfig
from gateway.dispatch import WorkerClient, WorkerDead
from gateway.serve import WorkerProcess
from tests.gateway.dispatch_live import (
    SwapProxy,
    free_endpoint,
    serve_app,
    sim_request,
    start_worker_on,
)
from tests.gateway.live import free_port, spawn_serve

URL = "/v1/chat/completions"
LONG_TOKENS = 4000  # NOTE: ~25 s on a paced (--cost cpu) worker: surely running when killed
NOTICE_S = 5.0  # NOTE: how soon after the kill the gateway must act (a restart takes ~3 s more)
TEST_TIMEOUT_S = 60.0


@pytest.fixture
def endpoint() -> Iterator[str]:
    yield free_endpoint()


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    """Every worker a test starts; all killed at the end."""
    started: list[WorkerProcess] = []
    try:
        yield started
    finally:
        for worker in started:
            worker.stop(signal.SIGKILL)


def test_restart_fails_a_started_stream_at_once(
    endpoint: str, workers: list[WorkerProcess]
) -> None:
    """``dead_after_s`` far longer than the restart: only noticing the lost connection (or the
    new ``instance_id``) can end the stream before its idle timeout."""
    workers.append(start_worker_on(endpoint, "incarnation", "cpu"))

    async def main() -> None:
        client = WorkerClient(endpoint, heartbeat_s=0.5, dead_after_s=30.0,
                              first_token_timeout_s=40.0, idle_timeout_s=40.0)
        await client.connect()
        try:
            assert client.welcome is not None
            first_instance = client.welcome.instance_id
            stream = client.generate(sim_request(LONG_TOKENS))
            assert isinstance(await anext(stream), TokenDelta)
            workers[-1].stop(signal.SIGKILL)
            killed_at = time.monotonic()
            restart = asyncio.ensure_future(
                asyncio.to_thread(start_worker_on, endpoint, "incarnation", "cpu"))
            with pytest.raises(WorkerDead) as info:
                async for _ in stream:
                    pass
            waited_s = time.monotonic() - killed_at
            workers.append(await restart)
            assert info.value.started, info.value
            assert waited_s < NOTICE_S, f"the stream ended {waited_s:.1f} s after the kill"
            await _wait_until(lambda: client.is_alive, "the client never reconnected")
            assert client.welcome.instance_id != first_instance, client.welcome
            assert client.num_new_instances == 1 and client.num_reconnects == 1, (
                client.num_new_instances, client.num_reconnects)
            finals = [i async for i in client.generate(sim_request(5)) if isinstance(i, Finished)]
            assert [f.completion_tokens for f in finals] == [5], finals
        finally:
            client.close()

    asyncio.run(asyncio.wait_for(main(), TEST_TIMEOUT_S))


def test_a_new_instance_behind_an_unbroken_connection_fails_the_old_requests(
    endpoint: str, workers: list[WorkerProcess]
) -> None:
    """A restart the socket monitor cannot see (a proxy keeps the TCP connection): the new
    ``instance_id`` in the next heartbeat's LoadReport alone fails the old process's requests,
    and a Hello makes the client alive again on the new process."""
    workers.append(start_worker_on(endpoint, "incarnation", "cpu"))

    async def main() -> None:
        proxy = SwapProxy(int(endpoint.rsplit(":", 1)[1]))
        await proxy.start()
        client = WorkerClient(proxy.endpoint, heartbeat_s=0.5, dead_after_s=30.0,
                              first_token_timeout_s=40.0, idle_timeout_s=40.0)
        try:
            await client.connect()
            first_instance, epoch = client.instance_id, client.epoch
            stream = client.generate(sim_request(LONG_TOKENS))
            assert isinstance(await anext(stream), TokenDelta)
            await _kill_and_restart(workers, endpoint, "cpu")
            await proxy.swap()
            swapped_at = time.monotonic()
            with pytest.raises(WorkerDead) as info:
                async for _ in stream:
                    pass
            waited_s = time.monotonic() - swapped_at
            assert info.value.started, info.value
            assert waited_s < NOTICE_S, f"the stream ended {waited_s:.1f} s after the swap"
            await _wait_until(lambda: client.is_alive, "the client never said Hello again")
            assert client.instance_id != first_instance and client.epoch == epoch + 1, (
                client.instance_id, client.epoch)
            assert client.num_new_instances == 1, client.num_new_instances
            finals = [i async for i in client.generate(sim_request(5)) if isinstance(i, Finished)]
            assert [f.completion_tokens for f in finals] == [5], finals
        finally:
            client.close()
            proxy.close()

    asyncio.run(asyncio.wait_for(main(), TEST_TIMEOUT_S))


def test_json_request_is_retried_on_the_restarted_worker(
    endpoint: str, workers: list[WorkerProcess], tokenizer_dir: Path
) -> None:
    """One worker only: the retry can only go to its new incarnation. Killed before the worker
    sent anything (a JSON answer is held back up to 1 s), the request is retried and answers 200
    soon after the new process is up (before: 60 s then a 504)."""
    workers.append(start_worker_on(endpoint, "incarnation", "cpu"))
    cfg = _config(tokenizer_dir, endpoint, 0.5, 10.0)
    with serve_app(cfg) as served:
        replies: list[httpx.Response] = []
        thread = threading.Thread(
            target=lambda: replies.append(served.http.post(URL, json=_chat(max_tokens=200))))
        thread.start()
        dispatcher = served.app.state.dispatcher
        dispatcher.retry_wait_s = 60.0  # NOTE: a slow box may take longer than 10 s to restart
        client = dispatcher.clients[0]
        _wait_sync(lambda: client.num_in_flight == 1, "the request never reached the worker")
        killed_at = asyncio.run(_kill_and_restart(workers, endpoint, "cpu"))
        restarted_in_s = time.monotonic() - killed_at
        thread.join(restarted_in_s + 20.0)
        assert not thread.is_alive(), "no answer 20 s after the worker was back"
        [resp] = replies
        assert resp.status_code == 200, (resp.status_code, resp.text)
        assert resp.json()["usage"]["completion_tokens"] == 200, resp.text
        assert client.num_new_instances == 1, client.num_new_instances


def test_sse_stream_of_a_restarted_worker_goes_on_on_its_new_incarnation(
    endpoint: str, workers: list[WorkerProcess], tokenizer_dir: Path
) -> None:
    """One worker only, restarted on its address mid-stream: the stream migrates to the new
    process and ends whole, with the tokens of an uninterrupted run (seeded)."""
    workers.append(start_worker_on(endpoint, "incarnation", "cpu"))
    body = _chat(stream=True, seed=4, max_tokens=300)
    with serve_app(_config(tokenizer_dir, endpoint, 0.5, 10.0)) as served:
        served.app.state.dispatcher.retry_wait_s = 60.0  # NOTE: a slow box restarts slowly
        with served.http.stream("POST", URL, json=body) as resp:
            events, lines = _until_first_token(resp)
            restarter = threading.Thread(
                target=lambda: asyncio.run(_kill_and_restart(workers, endpoint, "cpu")))
            restarter.start()
            events += list(lines)
        restarter.join(60.0)
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
        text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                       for e in events[:-1] if json.loads(e)["choices"])
        whole = served.http.post(URL, json=body | {"stream": False}).json()
        assert text == whole["choices"][0]["message"]["content"]
        assert served.app.state.dispatcher.num_migrations == 1


def test_sse_stream_of_a_restarted_worker_ends_with_an_error_without_migration(
    endpoint: str, workers: list[WorkerProcess], tokenizer_dir: Path
) -> None:
    workers.append(start_worker_on(endpoint, "incarnation", "cpu"))
    cfg = _config(tokenizer_dir, endpoint, 0.5, 10.0, migration_limit=0)
    with serve_app(cfg) as served:
        with served.http.stream("POST", URL, json=_chat(stream=True)) as resp:
            events, lines = _until_first_token(resp)
            restarter = threading.Thread(
                target=lambda: asyncio.run(_kill_and_restart(workers, endpoint, "cpu")))
            killed_at = time.monotonic()
            restarter.start()
            events += list(lines)
            waited_s = time.monotonic() - killed_at
        restarter.join(60.0)
    assert waited_s < NOTICE_S, f"the stream ended {waited_s:.1f} s after the kill"
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "not answering" in error["message"], error


def test_gateway_starts_without_its_worker_and_uses_it_once_up(
    endpoint: str, workers: list[WorkerProcess], tokenizer_dir: Path
) -> None:
    cfg = _config(tokenizer_dir, endpoint, 0.5, 10.0)
    with serve_app(cfg) as served:
        assert served.started_in_s < 5.0, f"the gateway took {served.started_in_s:.1f} s"
        assert served.http.get("/ready").status_code == 503
        resp = served.http.post(URL, json=_chat(max_tokens=4))
        assert resp.status_code == 503, (resp.status_code, resp.text)
        workers.append(start_worker_on(endpoint, "late"))
        up_at = time.monotonic()
        resp = _post_until_ok(served.http, _chat(max_tokens=4), timeout_s=15.0)
        assert resp.json()["usage"]["completion_tokens"] == 4, resp.text
        ready = served.http.get("/ready")
        assert ready.status_code == 200 and ready.json()["workers_alive"] == 1, ready.text
        assert time.monotonic() - up_at < 15.0


def test_serve_attached_to_a_worker_that_is_down_uses_it_once_up(
    endpoint: str, workers: list[WorkerProcess], tokenizer_dir: Path, tmp_path: Path
) -> None:
    """``agentgate serve --worker ENDPOINT`` with nothing on ENDPOINT: it serves at once
    (``/health`` 200, ``/ready`` and requests 503), and the worker started later is used."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = spawn_serve(tokenizer_dir, port, "--worker", endpoint,
                           "--served-model-name", "demo", backend=None, stdout=log)
    try:
        with httpx.Client(base_url=base_url, timeout=30.0) as http:
            _wait_sync(lambda: proc.poll() is None and _answers(http, "/health"),
                       f"serve never answered: {log_path.read_text()}", timeout_s=60.0)
            assert http.get("/ready").status_code == 503
            assert http.post(URL, json=_chat(max_tokens=4)).status_code == 503
            workers.append(start_worker_on(endpoint, "late"))
            resp = _post_until_ok(http, _chat(max_tokens=4), timeout_s=15.0)
            assert resp.json()["usage"]["completion_tokens"] == 4, resp.text
            assert http.get("/ready").status_code == 200
    finally:
        proc.kill()
        proc.wait(30)


def test_metrics_follow_a_worker_that_goes_and_comes_back(
    endpoint: str, workers: list[WorkerProcess], tokenizer_dir: Path
) -> None:
    workers.append(start_worker_on(endpoint, "metrics"))
    cfg = _config(tokenizer_dir, endpoint, 0.2, 1.0)
    with serve_app(cfg) as served:
        assert served.http.post(URL, json=_chat(max_tokens=4)).status_code == 200
        _wait_sync(lambda: _worker_samples(served.http, endpoint).get("worker_running_requests")
                   is not None, "no load gauge for a live worker")
        before = _worker_samples(served.http, endpoint)
        assert before["worker_up"] == 1.0, before
        workers.pop().stop(signal.SIGKILL)
        _wait_sync(lambda: _worker_samples(served.http, endpoint)["worker_up"] == 0.0,
                   "worker_up stayed 1 after the kill")
        away = _worker_samples(served.http, endpoint)
        assert "worker_running_requests" not in away and "worker_waiting_requests" not in away, (
            "stale load gauges of a dead worker", away)
        assert served.http.get("/ready").status_code == 503
        workers.append(start_worker_on(endpoint, "metrics"))
        _wait_sync(lambda: _worker_samples(served.http, endpoint)["worker_up"] == 1.0,
                   "worker_up never came back", timeout_s=15.0)
        _wait_sync(lambda: "worker_running_requests" in _worker_samples(served.http, endpoint),
                   "the load gauges never came back")
        back = _worker_samples(served.http, endpoint)
        assert back["worker_reconnects_total"] == before["worker_reconnects_total"] + 1, back
        assert back["worker_new_instances_total"] == before["worker_new_instances_total"] + 1, back


# ---------------------------------------------------------------------- helpers


def _config(model_dir: Path, endpoint: str, heartbeat_s: float, dead_after_s: float,
            migration_limit: int = 2) -> GatewayConfig:
    return GatewayConfig(model_dir=model_dir, workers=(endpoint,), model_name="demo",
                         heartbeat_s=heartbeat_s, dead_after_s=dead_after_s,
                         migration_limit=migration_limit)


async def _kill_and_restart(workers: list[WorkerProcess], endpoint: str, cost: str) -> float:
    """SIGKILL the last worker, start a new one on its address; the kill's monotonic time."""
    workers[-1].stop(signal.SIGKILL)
    killed_at = time.monotonic()
    workers.append(await asyncio.to_thread(start_worker_on, endpoint, "incarnation", cost))
    return killed_at


async def _wait_until(check: Any, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def _wait_sync(check: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _answers(http: httpx.Client, path: str) -> bool:
    try:
        return http.get(path).status_code == 200
    except httpx.TransportError:
        return False


def _post_until_ok(http: httpx.Client, body: dict[str, Any], timeout_s: float) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        resp = http.post(URL, json=body)
        if resp.status_code == 200 or time.monotonic() > deadline:
            assert resp.status_code == 200, (resp.status_code, resp.text)
            return resp
        assert resp.status_code == 503, (resp.status_code, resp.text)
        time.sleep(0.2)


def _worker_samples(http: httpx.Client, endpoint: str) -> dict[str, float]:
    """``agentgate_worker_*`` samples of ``endpoint`` by name (prefix stripped)."""
    text = http.get("/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("agentgate_worker_") and sample.labels == {
                "worker": endpoint
            }:
                out[sample.name.removeprefix("agentgate_")] = sample.value
    return out


def _chat(**overrides: Any) -> dict[str, Any]:
    body = {"model": "demo", "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": LONG_TOKENS}
    return body | overrides


def _until_first_token(resp: httpx.Response) -> tuple[list[str], Iterator[str]]:
    """An SSE response's data events up to the first generated token, and the rest to come."""
    assert resp.status_code == 200, resp.read()
    lines = (line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: "))
    events: list[str] = []
    while not any('"content"' in e and '"role"' not in e for e in events):
        events.append(next(lines))
    return events, lines
