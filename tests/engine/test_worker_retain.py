"""``Retain`` over real ZeroMQ (issue 9): a client keeps the end checkpoint of its own finished
request through memory pressure, releases it with ttl 0; unknown ids and other clients' ids are
ignored; expiries and retained pages show in ``LoadReport``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from engine.config import EngineConfig
from engine.protocol import GetLoad, LoadReport, Retain, TokenDelta
from engine.worker.server import Worker
from tests.engine.worker_harness import (
    PAGE,
    Client,
    assert_finished,
    make_prompt,
    worker_thread,
)

# NOTE: 1 MiB of KV holds 153 full pages of the demo geometry (about 2,400 tokens); the pressure
# runs 8 fresh prompts of 400 tokens through it
PROMPT_TOKENS = 4 * PAGE
PRESSURE_PROMPTS, PRESSURE_TOKENS = 8, 400


@pytest.fixture
def worker() -> Iterator[Worker]:
    with worker_thread(EngineConfig(backend="sim", kv_budget_bytes=2**20)) as w:
        yield w


def _finish(client: Client, request_id: str) -> list[int]:
    """Run a request to its end; returns the next turn's prompt (its history + new tokens)."""
    prompt = make_prompt(PROMPT_TOKENS)
    client.generate(request_id, prompt, max_new_tokens=1)
    deltas, last = client.collect(request_id)
    assert_finished(last, "length", 1)
    return prompt + deltas[0].token_ids + make_prompt(8)


def _cached(client: Client, request_id: str, prompt: list[int]) -> int:
    client.generate(request_id, prompt, max_new_tokens=1)
    deltas, last = client.collect(request_id)
    assert_finished(last, "length", 1)
    assert isinstance(deltas[0], TokenDelta)
    return deltas[0].cached_tokens


def _pressure(client: Client) -> None:
    for i in range(PRESSURE_PROMPTS):
        client.generate(f"pressure-{i}", make_prompt(PRESSURE_TOKENS), max_new_tokens=1)
        assert_finished(client.collect(f"pressure-{i}")[1], "length", 1)


def _load(client: Client) -> LoadReport:
    client.send(GetLoad())
    report = client.recv()
    assert isinstance(report, LoadReport), report
    return report


def test_retained_end_survives_pressure_that_evicts_an_unretained_one(
    worker: Worker, connect: Callable[[str], Client]
) -> None:
    client = connect(worker.endpoints[0])
    kept_next, lost_next = _finish(client, "kept"), _finish(client, "lost")
    client.send(Retain(request_id="kept", ttl_s=600.0))
    assert _load(client).retained_pages > 0
    _pressure(client)
    assert _cached(client, "kept-2", kept_next) == PROMPT_TOKENS, "the retained end was lost"
    assert _cached(client, "lost-2", lost_next) < PROMPT_TOKENS, "pressure evicted nothing"


def test_release_with_ttl_0_makes_the_end_evictable_again(
    worker: Worker, connect: Callable[[str], Client]
) -> None:
    client = connect(worker.endpoints[0])
    next_turn = _finish(client, "r")
    client.send(Retain(request_id="r", ttl_s=600.0))
    client.send(Retain(request_id="r", ttl_s=0.0))
    assert _load(client).retained_pages == 0
    _pressure(client)
    assert _cached(client, "r-2", next_turn) < PROMPT_TOKENS


def test_unknown_ids_and_bad_ttls_are_ignored_without_a_reply(
    worker: Worker, connect: Callable[[str], Client]
) -> None:
    client = connect(worker.endpoints[0])
    _finish(client, "r")
    client.send(Retain(request_id="never-sent", ttl_s=600.0))
    for bad in (-1.0, float("nan"), float("inf")):
        client.send(Retain(request_id="r", ttl_s=bad))
    client.assert_silent()
    assert _load(client).retained_pages == 0


def test_another_client_cannot_retain_my_request(
    worker: Worker, connect: Callable[[str], Client]
) -> None:
    mine, other = connect(worker.endpoints[0]), connect(worker.endpoints[0])
    next_turn = _finish(mine, "r")
    other.send(Retain(request_id="r", ttl_s=600.0))
    assert _load(other).retained_pages == 0, "another client's Retain took effect"
    _pressure(mine)
    assert _cached(mine, "r-2", next_turn) < PROMPT_TOKENS


def test_expiry_is_counted_in_the_load_report(
    worker: Worker, connect: Callable[[str], Client]
) -> None:
    client = connect(worker.endpoints[0])
    _finish(client, "r")
    client.send(Retain(request_id="r", ttl_s=0.2))
    assert _load(client).retained_pages > 0
    time.sleep(0.5)  # NOTE: waits past the TTL; nothing here is timed
    report = _load(client)
    assert (report.retained_pages, report.retains_expired) == (0, 1), report
