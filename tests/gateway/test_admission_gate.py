"""AdmissionGate (gateway/admission_gate.py) with real asyncio tasks: waiting, waking in order,
cancellation of the awaiting task, QueueFull, a worker leaving, metrics."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from engine.cost import CostModel
from gateway.admission_gate import AdmissionGate
from gateway.routing.admission import Admission, AdmissionConfig, QueueFull, Ticket

COST = CostModel(step_overhead_s=0.0, prefill_s_per_token=1e-4, decode_s_per_token=0.0,
                 attn_s_per_qk=0.0)  # NOTE: 10,000 tokens per 1 s window


class _Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _make_gate(**overrides: object) -> tuple[AdmissionGate, _Clock]:
    clock = _Clock()
    adm = Admission(AdmissionConfig(prefill_window_s=1.0, **overrides))  # type: ignore[arg-type]
    gate = AdmissionGate(adm, clock=clock)
    gate.add_worker("w", COST, 512)
    return gate, clock


def _ticket(rid: str, num_tokens: int, cached: int = 0, tenant: str = "") -> Ticket:
    return Ticket(rid, "w", tenant, num_tokens, cached, 0.0)


TEST_TIMEOUT_S = 30.0


def _run(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """Run an async test on a fresh event loop, bounded in time."""
    @functools.wraps(test)
    def wrapper() -> None:
        asyncio.run(asyncio.wait_for(test(), TEST_TIMEOUT_S))

    return wrapper


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@_run
async def test_waits_until_a_release_admits_it() -> None:
    gate, clock = _make_gate()
    await gate.admit(_ticket("a", 9000))
    task = asyncio.create_task(gate.admit(_ticket("b", 9000)))
    await _settle()
    assert not task.done() and gate.num_waiting == 1
    clock.now_s = 2.5
    gate.started("a")
    await asyncio.wait_for(task, 5)
    assert gate.num_waiting == 0 and gate.admission.used_tokens("w")[1] == 9000
    assert gate.wait_s.count == 2 and gate.wait_s.sum == pytest.approx(2.5)


@_run
async def test_priority_is_set_for_the_engine() -> None:
    gate, _ = _make_gate()
    t = _ticket("a", 1000, cached=500)
    await gate.admit(t)
    assert t.bucket == 0 and t.priority == 3500


@_run
async def test_cancelling_the_waiter_removes_the_ticket() -> None:
    gate, _ = _make_gate()
    await gate.admit(_ticket("a", 9000))
    task = asyncio.create_task(gate.admit(_ticket("b", 9000)))
    await _settle()
    assert gate.admission.is_queued("b")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not gate.admission.is_queued("b") and gate.admission.num_queued == 0
    assert gate.num_cancelled == 1 and gate.num_waiting == 0


@_run
async def test_cancelled_in_the_instant_of_admission_releases() -> None:
    gate, _ = _make_gate()
    await gate.admit(_ticket("a", 9000))
    b = asyncio.create_task(gate.admit(_ticket("b", 9000)))
    c = asyncio.create_task(gate.admit(_ticket("c", 9000)))
    await _settle()
    gate.started("a")  # NOTE: admits b (its future resolves); b's task has not resumed yet
    b.cancel()
    with pytest.raises(asyncio.CancelledError):
        await b
    # NOTE: b's capacity was handed on to c instead of leaking
    await asyncio.wait_for(c, 5)
    assert gate.admission.used_tokens("w")[1] == 9000


@_run
async def test_queue_full_propagates() -> None:
    gate, _ = _make_gate(max_queued=1)
    await gate.admit(_ticket("a", 9000))
    waiting = asyncio.create_task(gate.admit(_ticket("b", 9000)))
    await _settle()
    with pytest.raises(QueueFull) as exc:
        await gate.admit(_ticket("c", 9000))
    assert exc.value.retry_after_s >= 1.0 and gate.num_rejected == 1
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


@_run
async def test_done_of_a_waiting_ticket_cancels_its_admit() -> None:
    gate, _ = _make_gate()
    await gate.admit(_ticket("a", 9000))
    task = asyncio.create_task(gate.admit(_ticket("b", 9000)))
    await _settle()
    gate.done("b")
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gate.admission.num_queued == 0
    gate.done("b")  # NOTE: idempotent


@_run
async def test_worker_leaving_lets_its_waiters_through() -> None:
    gate, _ = _make_gate()
    await gate.admit(_ticket("a", 9000))
    tasks = [asyncio.create_task(gate.admit(_ticket(f"q{i}", 9000))) for i in range(3)]
    await _settle()
    back = gate.remove_worker("w")
    assert sorted(t.request_id for t in back) == ["q0", "q1", "q2"]
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    for i in range(3):
        gate.done(f"q{i}")  # NOTE: their sends failed over; done stays harmless
    gate.done("a")


@_run
async def test_many_tasks_all_admitted_in_the_end() -> None:
    gate, clock = _make_gate()
    tickets = [_ticket(f"r{i}", [500, 3000, 20_000, 70_000][i % 4], tenant=f"t{i % 3}")
               for i in range(40)]
    tasks = {t.request_id: asyncio.create_task(gate.admit(t)) for t in tickets}
    await _settle()
    for _ in range(200):  # NOTE: bounded: 40 tickets, each started then done
        admitted = [rid for rid, task in tasks.items() if task.done()]
        if not admitted:
            break
        for rid in admitted:
            del tasks[rid]
            clock.now_s += 0.1
            gate.started(rid)
            gate.done(rid)
        await _settle()
    assert not tasks, f"never admitted: {sorted(tasks)}"
    assert gate.admission.num_queued == 0 and gate.num_admitted == 40


@_run
async def test_metrics_render() -> None:
    gate, _ = _make_gate()
    await gate.admit(_ticket("a", 9000))
    registry = CollectorRegistry()
    registry.register(gate)  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    assert "agentgate_admission_admitted_total 1.0" in text
    assert "agentgate_admission_queued_requests 0.0" in text
    assert "agentgate_admission_wait_seconds_count 1.0" in text


@_run
async def test_cancelling_a_blocking_head_lets_the_next_go() -> None:
    gate, _ = _make_gate()
    await gate.admit(_ticket("small_busy", 2500))  # NOTE: bucket 1 (reserve 3,000) in use
    # NOTE: the head (cold, 9,000) blocks; the warm one behind it would fit the reserve
    head = asyncio.create_task(gate.admit(_ticket("head", 9000)))
    await _settle()
    behind = asyncio.create_task(gate.admit(Ticket("behind", "w", "", 5000, 2500, 9.0)))
    await _settle()
    assert gate.admission.num_queued == 2 and not behind.done()
    head.cancel()
    await asyncio.gather(head, return_exceptions=True)
    await asyncio.wait_for(behind, 5)
    assert gate.admission.num_queued == 0
