"""Big session inputs against a live ``agentgate serve``: a 15 MiB WebSocket turn frame and a 15
MiB REST turn are refused (400 ``context_length_exceeded``) without stalling the event loop:
``/health`` keeps answering while they are handled."""

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

from gateway.serve import WorkerProcess
from tests.gateway.live import LiveGateway, live_gateway

HUGE = "word " * (3 * 1024 * 1024)  # 15 MiB
HEALTH_TIMEOUT_S = 3.0  # NOTE: generous for a busy 2-core box; the stall was 40 s
AUTH = {"Authorization": "Bearer sk-big"}


@pytest.fixture(scope="module")
def gateway(tokenizer_dir: Path, sim_worker: WorkerProcess) -> Iterator[LiveGateway]:
    with live_gateway(tokenizer_dir, "--workers", "0", "--worker", sim_worker.listen) as live:
        yield live


class _HealthProbe:
    """Polls ``/health`` on a thread; ``failures`` are the probes slower than the timeout."""

    def __init__(self, base_url: str) -> None:
        self._url, self._stop = f"{base_url}/health", threading.Event()
        self.failures: list[str] = []
        self.num_probes = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "_HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=HEALTH_TIMEOUT_S + 5)

    def _run(self) -> None:
        with httpx.Client(timeout=HEALTH_TIMEOUT_S) as http:
            while not self._stop.wait(0.2):
                self.num_probes += 1
                try:
                    http.get(self._url).raise_for_status()
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))


def test_a_15_mib_websocket_frame_does_not_stall_the_gateway(gateway: LiveGateway) -> None:
    with httpx.Client(base_url=gateway.base_url, headers=AUTH, timeout=60) as http:
        sid = http.post("/v1/sessions", json={}).json()["id"]
    url = gateway.base_url.replace("http://", "ws://") + f"/v1/sessions/{sid}/ws"
    with _HealthProbe(gateway.base_url) as probe, connect(
        url, additional_headers=AUTH, open_timeout=30, max_size=None
    ) as ws:
        t0 = time.monotonic()
        ws.send(json.dumps({"type": "turn", "messages": [{"role": "user", "content": HUGE}]}))
        frame = json.loads(ws.recv(timeout=60))
        took_s = time.monotonic() - t0
        time.sleep(0.5)  # NOTE: a few more probes after the answer
    assert not probe.failures and probe.num_probes >= 2, (probe.failures, took_s)
    assert frame["type"] == "error", frame
    assert frame["error"]["code"] == "context_length_exceeded", frame
    assert frame["error"]["param"] == "messages", frame


def test_a_15_mib_rest_turn_is_refused_at_once(gateway: LiveGateway) -> None:
    with httpx.Client(base_url=gateway.base_url, headers=AUTH, timeout=60) as http:
        sid = http.post("/v1/sessions", json={}).json()["id"]
        with _HealthProbe(gateway.base_url) as probe:
            resp = http.post(f"/v1/sessions/{sid}/turns",
                             json={"messages": [{"role": "user", "content": HUGE}]})
            time.sleep(0.5)
        assert resp.status_code == 400, resp.text[:300]
        assert resp.json()["error"]["code"] == "context_length_exceeded", resp.text[:300]
        assert not probe.failures, probe.failures
        session = http.get(f"/v1/sessions/{sid}").json()
        assert not session["running"] and session["messages"] == [], session
