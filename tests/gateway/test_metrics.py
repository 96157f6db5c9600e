"""``GET /metrics`` against the real app over a real sim worker subprocess: request counters by
endpoint and status (4xx included), TTFT / inter-token histograms, token counters, the prompt
cache's counters and worker health, which drops to 0 once a killed worker is noticed."""

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import GatewayConfig, create_app
from gateway.metrics import Histogram
from gateway.serve import WorkerProcess
from tests.gateway.live import start_sim_worker

URL = "/v1/chat/completions"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    proc = start_sim_worker("metrics-test")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(worker: WorkerProcess, tokenizer_dir: Path) -> Iterator[TestClient[Litestar]]:
    cfg = GatewayConfig(model_dir=tokenizer_dir, workers=(worker.listen,), model_name="demo")
    with TestClient(create_app(cfg), raise_server_exceptions=False) as test_client:
        yield test_client


def test_histogram_buckets_are_cumulative_with_inf_last() -> None:
    hist = Histogram([0.1, 1.0])
    for value in (0.05, 0.1, 0.5, 7.0):
        hist.observe(value)
    assert hist.buckets() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)], hist.buckets()
    assert hist.count == 4 and hist.sum == pytest.approx(7.65), (hist.count, hist.sum)


def test_metrics_count_requests_tokens_and_workers(
    client: TestClient[Litestar], worker: WorkerProcess
) -> None:
    before = _scrape(client)
    messages = [{"role": "user", "content": "Tell me about sliding windows. " * 4}]
    # NOTE: the second one hits the prompt cache and the worker's KV cache; streamed, because
    # only streamed requests have per-token timings (whole answers come in one message)
    for _ in range(2):
        assert client.post(URL, json=_chat(messages, stream=True)).status_code == 200
    assert client.post(URL, json=_chat(messages, max_tokens=-1)).status_code == 400
    assert client.get("/v1/nope").status_code == 404
    after = _scrape(client)

    chat = {"endpoint": URL}
    _assert_grew(before, after, "agentgate_requests_total", chat | {"status": "200"}, 2)
    _assert_grew(before, after, "agentgate_requests_total", chat | {"status": "400"}, 1)
    _assert_grew(before, after, "agentgate_requests_total",
                 {"endpoint": "unmatched", "status": "404"}, 1)
    _assert_grew(before, after, "agentgate_request_duration_seconds_count", chat, 3)
    _assert_grew(before, after, "agentgate_time_to_first_token_seconds_count", {}, 2)
    _assert_grew(before, after, "agentgate_inter_token_latency_seconds_count", {}, 1)
    # NOTE: one gap per token after each request's first, however the tokens were batched on
    # the way (the worker's Replies, the stream's coalescing): exact, not a lower bound
    itl, gen, ttft = (after.get((name, ()), 0.0) - before.get((name, ()), 0.0) for name in (
        "agentgate_inter_token_latency_seconds_count", "agentgate_generated_tokens_total",
        "agentgate_time_to_first_token_seconds_count"))
    assert itl == gen - ttft, (itl, gen, ttft)
    _assert_grew(before, after, "agentgate_generated_tokens_total", {}, 2 * MAX_TOKENS)
    _assert_grew(before, after, "agentgate_prompt_tokens_total", {}, 40)
    _assert_grew(before, after, "agentgate_cached_prompt_tokens_total", {}, 1)
    _assert_grew(before, after, "agentgate_prompt_cache_hits_total", {}, 1)
    _assert_grew(before, after, "agentgate_prompt_cache_reused_tokens_total", {}, 1)
    up = {"worker": worker.listen}
    assert after[("agentgate_worker_up", _key(up))] == 1.0, after
    assert after[("agentgate_worker_in_flight_requests", _key(up))] == 0.0, after


def test_killed_worker_reads_down(tokenizer_dir: Path, victim: WorkerProcess) -> None:
    cfg = GatewayConfig(model_dir=tokenizer_dir, workers=(victim.listen,), heartbeat_s=0.1,
                        dead_after_s=1.0)
    app = create_app(cfg)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        up = ("agentgate_worker_up", _key({"worker": victim.listen}))
        assert _scrape(test_client)[up] == 1.0
        victim.stop(signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while (value := _scrape(test_client)[up]) != 0.0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert value == 0.0, "worker_up still 1 five seconds after SIGKILL"


# ---------------------------------------------------------------------- helpers

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _chat(messages: list[dict[str, str]], **overrides: Any) -> dict[str, Any]:
    return {"model": "demo", "messages": messages, "max_tokens": MAX_TOKENS, **overrides}


def _scrape(client: TestClient[Litestar]) -> Samples:
    resp = client.get("/metrics")
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4"), resp.headers
    return {
        (sample.name, _key(sample.labels)): sample.value
        for family in text_string_to_metric_families(resp.text)
        for sample in family.samples
    }


def _key(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def _assert_grew(
    before: Samples, after: Samples, name: str, labels: dict[str, str], at_least: float
) -> None:
    key = (name, _key(labels))
    delta = after.get(key, 0.0) - before.get(key, 0.0)
    assert delta >= at_least, f"{name}{labels} grew by {delta}, expected >= {at_least}"


