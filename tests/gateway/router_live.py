"""Helpers of the live routing tests (``test_router_live``, ``test_router_replicas``): sim workers
with a replay socket, the per-worker counters and routing gauges read from a gateway's
``/metrics``, and prompts long enough to span many KV pages."""

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.serve import ANY_PORT, ServeError, WorkerProcess, spawn_worker
from tests.gateway.live import WORKER_START_TIMEOUT_S

AUTH = {"Authorization": "Bearer sk-router-live"}
# NOTE: the tests ask for model "demo". The spawned workers' sim cost is the CPU preset: with the
# zero preset every predicted TTFT is 0, and a cost-based router has no reason to prefer a cache.
SERVE_ARGS = ("--served-model-name", "demo", "--cost", "cpu")
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
         "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo")


def start_replay_worker(worker_id: str, cost: str = "cpu") -> WorkerProcess:
    """A sim worker on free ports with a KV event replay socket (as ``agentgate serve`` spawns
    them)."""
    try:
        return spawn_worker(model_dir=None, backend="sim", worker_id=worker_id,
                            extra_args=("--cost", cost), timeout_s=WORKER_START_TIMEOUT_S,
                            replay=ANY_PORT)
    except ServeError as e:
        pytest.fail(str(e))


@contextlib.contextmanager
def replay_workers(*worker_ids: str, cost: str = "cpu") -> Iterator[list[WorkerProcess]]:
    with contextlib.ExitStack() as stack:
        out = []
        for worker_id in worker_ids:
            worker = start_replay_worker(worker_id, cost)
            stack.callback(worker.stop)
            out.append(worker)
        yield out


def text(seed: int, num_words: int) -> str:
    """``num_words`` words (about one token each) that no other seed repeats in order."""
    return " ".join(WORDS[(seed * 7 + i * (seed % 5 + 1)) % len(WORDS)] + str((seed + i) % 97)
                    for i in range(num_words))


def metrics(http: httpx.Client) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """``/metrics`` as {sample name: {sorted labels: value}}."""
    resp = http.get("/metrics")
    assert resp.status_code == 200, resp.text
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            out.setdefault(sample.name, {})[labels] = sample.value
    return out


def worker_requests(http: httpx.Client) -> dict[str, float]:
    """Requests sent to each worker so far (``agentgate_worker_requests_total``)."""
    samples = metrics(http).get("agentgate_worker_requests_total", {})
    return {dict(labels)["worker"]: value for labels, value in samples.items()}


def landed(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The workers whose request counters moved, and by how much."""
    return {w: n - before.get(w, 0) for w, n in after.items() if n > before.get(w, 0)}


def one_home(http: httpx.Client, send: Callable[[], Any]) -> tuple[str, Any]:
    """Run ``send``; the one worker whose request counter moved, and what ``send`` returned."""
    before = worker_requests(http)
    result = send()
    moved = landed(before, worker_requests(http))
    assert len(moved) == 1, moved
    return next(iter(moved)), result


def session_turn(http: httpx.Client, sid: str, content: str, max_tokens: int) -> None:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    resp = http.post(f"/v1/sessions/{sid}/turns", json=body)
    assert resp.status_code == 200, resp.text


def gauge(http: httpx.Client, name: str, **labels: str) -> float:
    samples = metrics(http).get(name, {})
    return samples.get(tuple(sorted(labels.items())), 0.0)


def chat(http: httpx.Client, messages: list[dict[str, Any]], max_tokens: int = 4,
         **extra: Any) -> dict[str, Any]:
    body = {"model": "demo", "messages": messages, "max_tokens": max_tokens, **extra}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def cached_tokens(answer: dict[str, Any]) -> int:
    return answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
