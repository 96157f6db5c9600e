"""Admission through the real gateway app and a real sim worker: a request that must queue past
the bound is a 429 with the drain-rate Retry-After; a queued request goes once capacity frees;
a queued request whose client leaves is dropped at once.

The worker's capacity is made tiny (a cost model of 1 s per token) and its buckets are occupied
by tickets the test offers itself, so what queues is decided by admission, not by timing."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from litestar import Litestar
from litestar.testing import TestClient

from engine.cost import CostModel
from gateway.admission_gate import AdmissionGate
from gateway.app import GatewayConfig
from gateway.routing.admission import Admission, AdmissionConfig, Ticket
from gateway.serve import WorkerProcess
from tests.gateway.dispatch_live import app_client, serve_app

SLOW = CostModel(step_overhead_s=0.0, prefill_s_per_token=1.0, decode_s_per_token=0.0,
                 attn_s_per_qk=0.0)  # NOTE: capacity 1 token: every bucket admits one alone
POLL_TIMEOUT_S = 20.0
BODY = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def _wait_for(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + POLL_TIMEOUT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _tiny_gate(app: Litestar, **cfg: object) -> tuple[AdmissionGate, str]:
    """The app's gate, with a fresh ``Admission(cfg)`` whose only worker holds one token, and
    the short bucket taken by a ticket "busy" of the test's own."""
    dispatcher = app.state.dispatcher
    gate: AdmissionGate = dispatcher.gate
    assert gate is not None, "admission is on by default"
    wid = dispatcher.link.worker_id(dispatcher.clients[0])
    assert wid is not None
    gate.admission = Admission(AdmissionConfig(prefill_window_s=1.0, **cfg))  # type: ignore[arg-type]
    gate.add_worker(wid, SLOW, 1)
    assert gate.admission.offer(Ticket("busy", wid, "", 1500, 0, time.monotonic()), 0.0)
    return gate, wid


@pytest.fixture
def client(sim_worker: WorkerProcess, tokenizer_dir: Path) -> Iterator[TestClient[Litestar]]:
    with app_client(sim_worker, tokenizer_dir) as c:
        yield c


def test_queue_full_is_429_with_retry_after(client: TestClient[Litestar]) -> None:
    gate, wid = _tiny_gate(client.app, max_queued=1, max_retry_after_s=30.0)
    assert not gate.admission.offer(Ticket("ahead", wid, "", 1000, 0, 0.0), 0.0)
    resp = client.post("/v1/chat/completions", json=BODY)
    assert resp.status_code == 429, resp.text
    assert resp.json()["error"]["type"] == "rate_limit_error"
    # NOTE: 1,000+ tokens ahead at a modelled drain of 1 token/s: the cap
    assert resp.headers["Retry-After"] == "30"
    assert gate.num_rejected == 1 and gate.admission.num_queued == 1


def test_queued_request_goes_when_capacity_frees(client: TestClient[Litestar]) -> None:
    gate, _ = _tiny_gate(client.app)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.post, "/v1/chat/completions", json=BODY)
        _wait_for("the request to queue", lambda: gate.admission.num_queued == 1)
        assert not pending.done()
        client.blocking_portal.call(gate.done, "busy")  # NOTE: on the app's event loop
        resp = pending.result(timeout=POLL_TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    assert gate.num_queued_total == 1 and gate.admission.num_queued == 0


def test_client_leaving_drops_its_queued_request(
    sim_worker: WorkerProcess, tokenizer_dir: Path
) -> None:
    cfg = GatewayConfig(model_dir=tokenizer_dir, workers=(sim_worker.listen,), model_name="demo")
    with serve_app(cfg) as served:
        gate, _ = _tiny_gate(served.app)
        with pytest.raises(httpx.ReadTimeout):
            served.http.post("/v1/chat/completions", json=BODY, timeout=1.0)
        _wait_for("the queued ticket to be dropped", lambda: gate.num_cancelled == 1)
        assert gate.admission.num_queued == 0 and gate.num_waiting == 0
