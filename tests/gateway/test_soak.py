"""A bounded soak, marked ``slow``: not in the default run (``./scripts/test
tests/gateway/test_soak.py -m slow -s`` runs it). ``agentgate serve --backend sim --workers 2``
under agent-shaped load for ``AGENTGATE_SOAK_S`` seconds (default 600): clients open sessions,
run REST and SSE turns, delete them, and send stateless chats, without pause. It reports the
gateway's and each worker's RSS over the run, and checks that none grew by more than
``MAX_GROWTH`` after the first quarter (the warm-up: caches filling), that no request failed,
and that once every session is closed (and retention has expired) each worker's KV pool is back
to its baseline: nothing running, nothing retained, and after a ``Flush`` of the prefix cache
the same bytes in use as before the load."""

import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.protocol import PROTOCOL_VERSION, Flush, GetLoad, Hello, LoadReport, Welcome
from tests.engine.worker_harness import Client
from tests.gateway.live import LiveGateway, live_gateway

SOAK_S = float(os.environ.get("AGENTGATE_SOAK_S", "600"))
# NOTE: past the suite's 600 s per-test timeout: the load, then the drain and the checks
pytestmark = [pytest.mark.slow, pytest.mark.timeout(SOAK_S + 300)]
CLIENTS, SAMPLE_S, MAX_GROWTH, RETAIN_TTL_S = 8, 15.0, 1.25, 2.0
AUTH = {"Authorization": "Bearer sk-soak"}


@pytest.fixture(scope="module")
def gateway(sim_model_dir: Path) -> Iterator[LiveGateway]:
    with live_gateway(sim_model_dir, "--workers", "2", "--retain-ttl", str(RETAIN_TTL_S),
                      "--served-model-name", "demo") as gateway:
        yield gateway


def test_a_soak_leaks_nothing(gateway: LiveGateway) -> None:
    workers = _worker_endpoints(gateway)
    baseline = {w: _flushed(w) for w in workers}
    failures: list[str] = []
    done = threading.Event()
    counts = [0] * CLIENTS
    threads = [threading.Thread(target=_client, args=(gateway, i, done, failures, counts))
               for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    samples = []
    start = time.monotonic()
    try:
        while time.monotonic() - start < SOAK_S and not failures:
            samples.append((time.monotonic() - start, _rss_mb(gateway.proc.pid)))
            print(f"soak {samples[-1][0]:4.0f} s: RSS MB {samples[-1][1]}", flush=True)
            time.sleep(min(SAMPLE_S, max(0.0, SOAK_S - (time.monotonic() - start))))
        samples.append((time.monotonic() - start, _rss_mb(gateway.proc.pid)))
    finally:
        done.set()
        for thread in threads:
            thread.join(60)
    _report(samples, sum(counts))
    assert not failures, failures[:5]
    warm = next(rss for t, rss in samples if t >= SOAK_S / 4)
    for pid, mb in samples[-1][1].items():
        assert mb <= warm[pid] * MAX_GROWTH, (pid, warm[pid], mb)
    time.sleep(RETAIN_TTL_S + 2.0)
    for endpoint, before in baseline.items():
        load = _load(endpoint, GetLoad())
        assert (load.num_running, load.num_waiting, load.retained_pages) == (0, 0, 0), load
        after = _flushed(endpoint)
        assert after.used_bytes == before.used_bytes, (endpoint, before, after)
        assert (after.free_full_pages, after.free_swa_pages) == (
            before.free_full_pages, before.free_swa_pages), (before, after)


def _client(gateway: LiveGateway, i: int, done: threading.Event, failures: list[str],
            counts: list[int]) -> None:
    with httpx.Client(base_url=gateway.base_url, headers=AUTH, timeout=60) as http:
        n = 0
        while not done.is_set():
            n += 1
            try:
                sid = http.post("/v1/sessions", json={"system": f"Agent {i}."}).json()["id"]
                for turn in range(4):
                    body = {"messages": [{"role": "user", "content": f"step {turn} of {n}"}],
                            "max_tokens": 16, "stream": turn % 2 == 1}
                    resp = http.post(f"/v1/sessions/{sid}/turns", json=body)
                    if resp.status_code != 200 or "error" in resp.text[-300:]:
                        failures.append(f"turn: {resp.status_code} {resp.text[-300:]}")
                chat = http.post("/v1/chat/completions", json={
                    "model": "demo", "max_tokens": 8,
                    "messages": [{"role": "user", "content": f"client {i} request {n}"}]})
                if chat.status_code != 200:
                    failures.append(f"chat: {chat.status_code} {chat.text[:300]}")
                if http.delete(f"/v1/sessions/{sid}").status_code not in (200, 204):
                    failures.append(f"delete {sid}")
                counts[i] += 6
            except httpx.HTTPError as exc:
                failures.append(f"{type(exc).__name__}: {exc}")


def _worker_endpoints(gateway: LiveGateway) -> list[str]:
    text = httpx.get(f"{gateway.base_url}/metrics", timeout=10).text
    endpoints = sorted(set(re.findall(r'agentgate_worker_up\{worker="([^"]+)"\} 1', text)))
    assert len(endpoints) == 2, text[:500]
    return endpoints


def _load(endpoint: str, msg: Any) -> LoadReport:
    client = Client(endpoint)
    try:
        client.send(Hello(version=PROTOCOL_VERSION, client_id="soak-probe"))
        assert isinstance(client.recv(10), Welcome)
        client.send(msg)
        while not isinstance(reply := client.recv(10), LoadReport):
            pass
        return reply
    finally:
        client.sock.close()


def _flushed(endpoint: str) -> LoadReport:
    return _load(endpoint, Flush())


def _rss_mb(pid: int) -> dict[int, float]:
    """RSS of ``pid`` and its children (the spawned workers), MB by pid."""
    out = {}
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for p in [pid, *map(int, children)]:
        status = Path(f"/proc/{p}/status").read_text()
        out[p] = int(re.search(r"VmRSS:\s+(\d+)", status)[1]) / 1024  # type: ignore[index]
    return out


def _report(samples: list[tuple[float, dict[int, float]]], requests: int) -> None:
    pids = list(samples[0][1])
    print(f"\nsoak: {samples[-1][0]:.0f} s, {requests} requests; RSS MB (gateway first)")
    print("   t s | " + " | ".join(f"{p:>8}" for p in pids))
    for t, rss in samples:
        print(f"{t:6.0f} | " + " | ".join(f"{rss.get(p, 0):8.1f}" for p in pids))
