"""Admission (gateway/routing/admission.py): buckets, reserves, cache-first order with aging,
tenant fairness, the bounded queue and its Retry-After."""

from __future__ import annotations

import math

import pytest

from engine.cost import CostModel
from gateway.routing.admission import (
    Admission,
    AdmissionConfig,
    QueueFull,
    Ticket,
    capacity_tokens,
    priority_of,
)

# NOTE: 1e-4 s per token and a 1 s window: each worker prefills 10,000 tokens per window
COST = CostModel(step_overhead_s=0.0, prefill_s_per_token=1e-4, decode_s_per_token=0.0,
                 attn_s_per_qk=0.0)
CAPACITY = 10_000


def _make(**overrides: object) -> Admission:
    cfg = AdmissionConfig(prefill_window_s=1.0, **overrides)  # type: ignore[arg-type]
    adm = Admission(cfg)
    adm.add_worker("w", COST, max_batched_tokens=512)
    return adm


def _ticket(rid: str, num_tokens: int, cached: int = 0, *, tenant: str = "",
            arrival_s: float = 0.0, worker: str = "w") -> Ticket:
    return Ticket(rid, worker, tenant, num_tokens, cached, arrival_s)


def test_capacity_from_cost_model() -> None:
    assert capacity_tokens(COST, 512, 1.0) == pytest.approx(CAPACITY)
    assert capacity_tokens(COST, 50_000, 1.0) == 50_000  # NOTE: at least one step's budget
    zero = CostModel(0.0, 0.0, 0.0, 0.0)
    assert capacity_tokens(zero, 512, 1.0) == math.inf


def test_buckets_by_uncached_tokens() -> None:
    cfg = AdmissionConfig()
    assert [cfg.bucket_of(n) for n in (1, 2047, 2048, 16383, 16384, 65535, 65536, 10**6)] == [
        0, 0, 1, 1, 2, 2, 3, 3]
    adm = _make()
    t = _ticket("a", 100_000, cached=99_000)  # NOTE: 1,000 uncached: the short bucket
    assert adm.offer(t, 0.0)
    assert t.bucket == 0


def test_priority_encoding_orders_buckets_then_cache() -> None:
    n = 4
    assert priority_of(0, 0.0, n) > priority_of(1, 1.0, n) > priority_of(2, 1.0, n)
    assert priority_of(1, 0.9, n) > priority_of(1, 0.1, n)
    adm = _make()
    short, long_ = _ticket("s", 1000, 500), _ticket("l", 70_000)
    adm.offer(short, 0.0), adm.offer(long_, 0.0)
    assert short.priority == 3 * 1000 + 500 and long_.priority == 0


def test_short_turn_never_waits_behind_long_prefill() -> None:
    adm = _make()
    assert adm.offer(_ticket("huge", 100_000), 0.0)  # NOTE: alone: bigger than any share
    assert adm.offer(_ticket("huge2", 120_000), 0.0) is False  # NOTE: its bucket is busy
    for i in range(3):
        assert adm.offer(_ticket(f"short{i}", 1000), 0.0), f"short{i} waited behind a prefill"


def test_long_bucket_cannot_take_short_reserve() -> None:
    adm = _make()
    # NOTE: 3,000-token tickets (bucket 1, reserve 3,000); idle short bucket keeps its 3,000
    admitted = [adm.offer(_ticket(f"m{i}", 3000), 0.0) for i in range(4)]
    assert admitted == [True, True, False, False], admitted
    used = adm.used_tokens("w")
    assert used[1] == 6000 and used[1] <= CAPACITY - 0.3 * CAPACITY, used
    assert adm.offer(_ticket("s", 1500), 0.0)
    assert adm.offer(_ticket("s2", 1500), 0.0)


def test_short_bucket_borrows_idle_capacity() -> None:
    adm = _make()
    # NOTE: short reserve is 3,000 tokens; 9 x 1,000 fit by borrowing the idle longer reserves
    admitted = [adm.offer(_ticket(f"s{i}", 1000), 0.0) for i in range(11)]
    assert admitted == [True] * 10 + [False], admitted


def test_queued_bucket_keeps_its_reserve() -> None:
    adm = _make()
    assert adm.offer(_ticket("m0", 9000), 0.0)  # NOTE: alone in bucket 1
    assert adm.offer(_ticket("m1", 3000), 0.0) is False
    # NOTE: bucket 1 now has a queue: the short bucket may not borrow bucket 1's reserve...
    shorts = [adm.offer(_ticket(f"s{i}", 1000), 0.0) for i in range(3)]
    assert shorts == [True, True, True]  # own reserve (3,000)
    assert adm.offer(_ticket("s3", 1000), 0.0) is False
    # ...and when m0 is prefilled, both go (shorter buckets first)
    assert [t.request_id for t in adm.started("m0", 1.0)] == ["s3", "m1"]


def test_cache_hits_first_then_fewer_uncached() -> None:
    adm = _make()
    assert adm.offer(_ticket("busy", 5000), 0.0)  # NOTE: bucket 1 busy: later ones queue
    adm.offer(_ticket("cold", 6000, 0), 0.0)
    adm.offer(_ticket("warm", 12_000, 6000), 0.0)
    adm.offer(_ticket("cold_small", 3000, 0), 0.0)
    order = [t.request_id for t in adm.started("busy", 0.0)]
    assert order[:1] == ["warm"], order
    assert order.index("cold_small") < order.index("cold") if "cold" in order else True


def test_aging_bounds_overtaking() -> None:
    cfg_credit = AdmissionConfig().max_credit_s
    adm = _make()
    assert adm.offer(_ticket("busy", 9000, arrival_s=0.0), 0.0)
    adm.offer(_ticket("old_cold", 9000, arrival_s=0.0), 0.0)
    # NOTE: a fully cached one arriving later than the credit bound no longer goes first
    adm.offer(_ticket("late_warm", 18_000, 9000, arrival_s=cfg_credit + 0.5), cfg_credit + 0.5)
    order = [t.request_id for t in adm.started("busy", 10.0)]
    assert order[0] == "old_cold", order


def test_done_and_started_idempotent_and_cancel() -> None:
    adm = _make()
    assert adm.offer(_ticket("a", 9000), 0.0)
    assert not adm.offer(_ticket("b", 9000), 0.0)
    assert not adm.offer(_ticket("c", 9000), 0.0)
    assert adm.cancel("c") and not adm.cancel("c") and adm.num_queued == 1
    assert [t.request_id for t in adm.started("a", 1.0)] == ["b"]
    assert adm.started("a", 1.0) == [] and adm.done("a", 1.0) == []
    assert adm.done("b", 2.0) == [] and adm.done("b", 2.0) == []
    assert adm.used_tokens("w") == [0, 0, 0, 0] and adm.num_queued == 0
    assert adm.cancel("a") is False


def test_duplicate_offer_rejected() -> None:
    adm = _make()
    adm.offer(_ticket("a", 10), 0.0)
    with pytest.raises(ValueError, match="already offered"):
        adm.offer(_ticket("a", 10), 0.0)


def test_remove_worker_returns_queued_oldest_first() -> None:
    adm = _make()
    adm.offer(_ticket("a", 9000), 0.0)
    adm.offer(_ticket("b", 9000), 0.0)
    adm.offer(_ticket("c", 200_000), 0.0)
    adm.offer(_ticket("d", 200_000), 0.0)
    back = adm.remove_worker("w")
    assert [t.request_id for t in back] == ["b", "d"]
    assert adm.num_queued == 0 and adm.done("a", 1.0) == []


def test_unknown_worker_has_no_limit() -> None:
    adm = Admission()
    assert all(adm.offer(_ticket(f"x{i}", 100_000, worker="new"), 0.0) for i in range(5))


def test_zero_cost_worker_has_no_limit() -> None:
    adm = Admission()
    adm.add_worker("z", CostModel(0.0, 0.0, 0.0, 0.0), 512)
    assert all(adm.offer(_ticket(f"x{i}", 40_000, worker="z"), 0.0) for i in range(5))


def test_queue_full_total_and_per_tenant_with_retry_after() -> None:
    adm = _make(max_queued=3, max_queued_per_tenant=2)
    assert adm.offer(_ticket("busy", 9000, tenant="a"), 0.0)
    assert not adm.offer(_ticket("a1", 9000, tenant="a"), 0.0)
    assert not adm.offer(_ticket("a2", 9000, tenant="a"), 0.0)
    with pytest.raises(QueueFull) as per_tenant:
        adm.offer(_ticket("a3", 9000, tenant="a"), 0.0)
    assert not adm.offer(_ticket("b1", 9000, tenant="b"), 0.0)
    with pytest.raises(QueueFull) as total:
        adm.offer(_ticket("c1", 9000, tenant="c"), 0.0)
    cfg = adm.config
    for exc in (per_tenant.value, total.value):
        assert cfg.min_retry_after_s <= exc.retry_after_s <= cfg.max_retry_after_s
    # NOTE: the modelled drain is 10,000 tokens/s; 3 x 9,000 queued + 9,000 -> 3.6 s
    assert total.value.retry_after_s == pytest.approx(3.6)
    assert adm.num_queued == 3 and not adm.is_queued("a3") and not adm.is_queued("c1")


def test_retry_after_follows_measured_drain() -> None:
    adm = _make(max_queued=2, drain_sample_s=1.0, drain_alpha=1.0)
    assert adm.offer(_ticket("r0", 9000), 0.0)
    adm.offer(_ticket("r1", 9000), 0.0)
    adm.offer(_ticket("r2", 9000), 0.0)
    # NOTE: the queue drains at 9,000 tokens per 10 s (slower than modelled)
    now = 0.0
    for i in range(3):
        now += 10.0
        back = adm.started(f"r{i}", now)
        adm.offer(_ticket(f"r{i + 3}", 9000), now)
        assert len(back) == 1
    assert adm.drain_rate_tokens_s == pytest.approx(900, rel=0.01)
    with pytest.raises(QueueFull) as exc:
        adm.offer(_ticket("late", 9000), now)
    assert exc.value.retry_after_s == pytest.approx(30.0, rel=0.01)


def test_retry_after_capped() -> None:
    adm = _make(max_queued=1, max_retry_after_s=5.0)
    assert adm.offer(_ticket("a", 10**7), 0.0)
    assert not adm.offer(_ticket("b", 10**7), 0.0)
    with pytest.raises(QueueFull) as exc:
        adm.offer(_ticket("c", 10**7), 0.0)
    assert exc.value.retry_after_s == 5.0


def test_weighted_tenants_share_a_busy_bucket() -> None:
    adm = _make(tenant_weights=(("gold", 3.0),))
    assert adm.offer(_ticket("busy", 9000, tenant="x"), 0.0)
    for i in range(40):
        adm.offer(_ticket(f"g{i}", 9000, tenant="gold"), 0.0)
        adm.offer(_ticket(f"s{i}", 9000, tenant="silver"), 0.0)
    served: list[str] = []
    head = "busy"
    for step in range(40):
        back = adm.started(head, float(step))
        assert len(back) == 1
        head = back[0].request_id
        served.append(head[0])
    gold, silver = served.count("g"), served.count("s")
    assert 2.5 <= gold / silver <= 3.5, served


def test_offer_goes_ahead_only_as_head_that_fits() -> None:
    adm = _make()
    assert adm.offer(_ticket("busy", 2500), 0.0)  # NOTE: bucket 1, reserve 3,000
    assert not adm.offer(_ticket("cold_big", 9000, arrival_s=0.0), 0.0)  # NOTE: head, too big
    # NOTE: a fully cached arrival has the better key and fits: it goes at once
    assert adm.offer(_ticket("warm", 20_000, 17_500, arrival_s=0.5), 0.5)
    # NOTE: a later cold one of the same size has a worse key than the head: it waits
    assert not adm.offer(_ticket("cold_small", 2500, arrival_s=9.0), 9.0)
    assert adm.num_queued == 2
