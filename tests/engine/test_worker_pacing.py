"""A paced sim worker (``--cost`` other than zero) waits for a held step's release in the poll,
never in a loop of zero-timeout polls."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from engine.config import EngineConfig
from engine.worker.server import Worker, WorkerConfig, _HeldStep
from tests.engine.worker_harness import ANY_PORT

HELD_S = 0.005


@pytest.fixture
def paced() -> Iterator[Worker]:
    cfg = WorkerConfig(listen=ANY_PORT, events=ANY_PORT, worker_id="paced", cost="h200")
    worker = Worker(cfg, EngineConfig(backend="sim"))
    try:
        yield worker
    finally:
        worker.close()


def test_held_step_is_awaited_in_few_polls(paced: Worker) -> None:
    """Every loop until the release polls with the held step's remaining time, rounded up: a
    truncated timeout turns its last millisecond into a busy loop of polls with timeout 0."""
    paced._held = _HeldStep([], time.monotonic() + HELD_S)
    polls = 0
    while paced._held is not None:
        paced._router.poll(paced._poll_timeout_ms())
        paced._advance()
        polls += 1
        assert polls <= 4, f"{polls} polls to wait {HELD_S * 1e3:g} ms: spinning"


def test_poll_timeout_covers_a_sub_millisecond_wait(paced: Worker) -> None:
    paced._held = _HeldStep([], time.monotonic() + 0.0005)
    timeout_ms = paced._poll_timeout_ms()
    assert timeout_ms == 1, f"poll timeout {timeout_ms} ms for a 0.5 ms wait (0 spins)"
