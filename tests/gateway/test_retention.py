"""PauseLearner and ToolPauseRetention (gateway/routing/retention.py): TTLs from observed tool
pauses, fallbacks, bounds; the retain / resume / release protocol and its metrics."""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from prometheus_client import CollectorRegistry, generate_latest

from engine.protocol import LoadReport
from gateway.routing.retention import (
    DEFAULT_TTL_S,
    MAX_TTL_S,
    PauseLearner,
    ToolPauseRetention,
    quantile_of,
)


def test_default_until_min_samples() -> None:
    learner = PauseLearner(min_samples=4)
    for _ in range(3):
        learner.observe("t", ["bash"], 5.0)
    assert learner.ttl_s("t", ["bash"]) == DEFAULT_TTL_S
    learner.observe("t", ["bash"], 5.0)
    assert learner.ttl_s("t", ["bash"]) == 5.0


def test_p90_of_recent_pauses() -> None:
    learner = PauseLearner(min_samples=10, max_samples=10)
    for pause in range(1, 11):  # NOTE: 1..10 s: p90 (nearest rank) is 9 s
        learner.observe("t", ["read"], float(pause))
    assert learner.ttl_s("t", ["read"]) == 9.0
    for _ in range(10):  # NOTE: the ring keeps the recent ones only
        learner.observe("t", ["read"], 2.0)
    assert learner.ttl_s("t", ["read"]) == 2.0


def test_capped_and_floored() -> None:
    learner = PauseLearner(min_samples=1)
    learner.observe("t", ["slow"], 3600.0)
    learner.observe("t", ["fast"], 0.01)
    assert learner.ttl_s("t", ["slow"]) == MAX_TTL_S
    assert learner.ttl_s("t", ["fast"]) == 1.0


def test_longest_tool_wins() -> None:
    learner = PauseLearner(min_samples=1)
    learner.observe("t", ["fast"], 2.0)
    learner.observe("t", ["slow"], 40.0)
    assert learner.ttl_s("t", ["fast", "slow"]) == 40.0


def test_fallback_to_tenant_then_tool() -> None:
    learner = PauseLearner(min_samples=2)
    learner.observe("a", ["x"], 10.0)
    learner.observe("a", ["y"], 20.0)
    # NOTE: (a, z) unknown: the tenant's pauses over all tools
    assert learner.ttl_s("a", ["z"]) == 20.0
    learner.observe("b", ["x"], 30.0)
    # NOTE: tenant c unknown: tool x's pauses over all tenants
    assert learner.ttl_s("c", ["x"]) == 30.0
    assert learner.ttl_s("c", ["w"]) == DEFAULT_TTL_S


def test_negative_and_nan_ignored() -> None:
    learner = PauseLearner(min_samples=1)
    learner.observe("t", ["x"], -1.0)
    learner.observe("t", ["x"], float("nan"))
    assert learner.num_keys == 0


def test_bounded_keys() -> None:
    learner = PauseLearner(max_keys=10, min_samples=1)
    for i in range(100):
        learner.observe(f"t{i}", [f"tool{i}"], 1.0)
    assert learner.num_keys <= 10
    learner.observe("last", ["x"], 7.0)
    assert learner.ttl_s("last", ["x"]) == 7.0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=200),
       st.floats(0.05, 1.0))
def test_quantile_is_an_observed_value_with_q_below(values: list[float], q: float) -> None:
    v = quantile_of(values, q)
    assert v in values
    assert sum(x <= v for x in values) >= q * len(values)
    assert sum(x < v for x in values) < q * len(values)


def test_lognormal_pauses_learn_near_p90() -> None:
    rng = random.Random(7)
    learner = PauseLearner(min_samples=8, max_samples=512)
    pauses = [rng.lognormvariate(0.7, 1.5) for _ in range(512)]  # NOTE: median ~2 s
    for p in pauses:
        learner.observe("t", ["bash"], p)
    assert learner.ttl_s("t", ["bash"]) == pytest.approx(quantile_of(pauses, 0.9))


class _Sent:
    def __init__(self, ok: bool = True) -> None:
        self.ok = ok
        self.calls: list[tuple[str, float]] = []

    def __call__(self, rid: str, ttl_s: float) -> bool:
        self.calls.append((rid, ttl_s))
        return self.ok


def test_pause_resume_release_learns_the_pause() -> None:
    sent = _Sent()
    tracker = ToolPauseRetention(PauseLearner(min_samples=1), sent)
    assert tracker.paused("s1", "turn-1", "t", ["bash"], now_s=100.0) == DEFAULT_TTL_S
    assert sent.calls == [("turn-1", DEFAULT_TTL_S)] and tracker.is_paused("s1")
    pause = tracker.resumed("s1", now_s=104.0)
    assert pause is not None and not tracker.is_paused("s1")
    tracker.release(pause)
    assert sent.calls[-1] == ("turn-1", 0.0)
    assert tracker.learner.ttl_s("t", ["bash"]) == 4.0
    assert tracker.resumed("s1", 105.0) is None  # NOTE: once


def test_forget_releases_and_repause_supersedes() -> None:
    sent = _Sent()
    tracker = ToolPauseRetention(send_retain=sent)
    tracker.paused("s", "r1", "t", ["x"], 0.0)
    tracker.paused("s", "r2", "t", ["x"], 1.0)
    assert ("r1", 0.0) in sent.calls
    tracker.forget("s")
    assert sent.calls[-1] == ("r2", 0.0) and tracker.num_paused == 0
    tracker.forget("s")  # NOTE: idempotent
    assert len(sent.calls) == 4


def test_unsent_retain_is_not_tracked() -> None:
    tracker = ToolPauseRetention(send_retain=_Sent(ok=False))
    assert tracker.paused("s", "r", "t", ["x"], 0.0) is None
    assert tracker.num_paused == 0 and tracker.num_retains == 0


def test_bounded_paused_set_releases_oldest() -> None:
    sent = _Sent()
    tracker = ToolPauseRetention(send_retain=sent, max_paused=3)
    for i in range(5):
        tracker.paused(f"s{i}", f"r{i}", "t", ["x"], float(i))
    assert tracker.num_paused == 3
    assert ("r0", 0.0) in sent.calls and ("r1", 0.0) in sent.calls


def test_metrics() -> None:
    tracker = ToolPauseRetention(send_retain=_Sent())
    tracker.paused("s", "r", "t", ["x"], 0.0)
    tracker.hit_after_pause(1000, 990)
    load = LoadReport(worker_id="w0", num_running=0, num_waiting=0, free_full_pages=0,
                      free_swa_pages=0, used_bytes=0, total_bytes=1, cached_pages=0,
                      retained_pages=12, retains_expired=3)

    class _Collector:
        def collect(self):  # type: ignore[no-untyped-def]
            return tracker.collect([("w0", load), ("w1", None)], now_s=1.0)

    registry = CollectorRegistry()
    registry.register(_Collector())  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    assert 'agentgate_retention_worker_retained_pages{worker="w0"} 12.0' in text
    assert 'agentgate_retention_worker_expired_total{worker="w0"} 3.0' in text
    assert "agentgate_retention_resumed_cached_tokens_total 990.0" in text
    assert "agentgate_retention_paused_conversations 1.0" in text


def test_paused_gauge_counts_only_unexpired_retentions() -> None:
    """A pause whose TTL ran out is no longer retained on the worker: the gauge leaves it out,
    while the tracker keeps it to learn from a late resume (how long the pause really was)."""
    tracker = ToolPauseRetention(send_retain=_Sent())
    ttl_s = tracker.paused("s", "r", "t", ["x"], 100.0)
    assert ttl_s is not None and ttl_s > 0

    def gauge(now_s: float) -> float:
        [family] = [m for m in tracker.collect(now_s=now_s)
                    if m.name == "agentgate_retention_paused_conversations"]
        return family.samples[0].value

    assert gauge(100.0 + ttl_s - 1.0) == 1.0
    assert gauge(100.0 + ttl_s + 1.0) == 0.0
    pause = tracker.resumed("s", 100.0 + 2 * ttl_s)
    assert pause is not None and pause.request_id == "r"


def test_answered_calls_after_the_last_assistant_message() -> None:
    from gateway.schemas.requests import AssistantMessage, ToolMessage, UserMessage
    from gateway.tool_pauses import answered_calls

    dicts = [{"role": "user", "content": "q"},
             {"role": "assistant", "tool_calls": [{"id": "call_old"}]},
             {"role": "tool", "tool_call_id": "call_old", "content": "r"},
             {"role": "assistant", "tool_calls": [{"id": "call_a"}, {"id": "call_b"}]},
             {"role": "tool", "tool_call_id": "call_a", "content": "x"},
             {"role": "tool", "tool_call_id": "call_b", "content": "y"}]
    assert sorted(answered_calls(dicts)) == ["call_a", "call_b"]
    assert answered_calls([*dicts, {"role": "assistant", "content": "done"}]) == []
    structs = [UserMessage(content="q"), AssistantMessage(content="thinking"),
               ToolMessage(tool_call_id="call_s", content="r")]
    assert answered_calls(structs) == ["call_s"]
