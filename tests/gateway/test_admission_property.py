"""Admission under random operations (hypothesis state machine): no ticket lost or duplicated,
reserves and capacity respected except the documented alone case, every queue keeps draining,
overtaking bounded by the aging credit, and done/started idempotent. Plus a fairness property
between weighted tenants."""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.cost import CostModel
from gateway.routing.admission import Admission, AdmissionConfig, QueueFull, Ticket

COST = CostModel(step_overhead_s=0.0, prefill_s_per_token=1e-4, decode_s_per_token=0.0,
                 attn_s_per_qk=0.0)  # NOTE: 10,000 tokens per 1 s window
WORKERS = ("w0", "w1")
TENANTS = ("a", "b", "c")
CFG = AdmissionConfig(bucket_bounds_tokens=(2048, 16384), bucket_shares=(0.4, 0.3, 0.3),
                      prefill_window_s=1.0, tenant_weights=(("a", 2.0),), max_queued=12,
                      max_queued_per_tenant=6)


class AdmissionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.adm = Admission(CFG)
        self.now_s = 0.0
        self.next_id = 0
        self.queued: dict[str, Ticket] = {}
        self.admitted: dict[str, Ticket] = {}  # NOTE: before their first token
        self.decoding: set[str] = set()
        self.gone: set[str] = set()  # NOTE: ended, cancelled, or handed back by remove_worker
        self.admit_order: list[Ticket] = []
        self.alive = set(WORKERS)
        for w in WORKERS:
            self.adm.add_worker(w, COST, 512)

    def _take(self, tickets: list[Ticket]) -> None:
        for t in tickets:
            assert t.request_id in self.queued, f"{t.request_id} admitted but was not queued"
            del self.queued[t.request_id]
            self.admitted[t.request_id] = t
            self.admit_order.append(t)

    @rule(worker=st.sampled_from(WORKERS), tenant=st.sampled_from(TENANTS),
          num_tokens=st.sampled_from([10, 1500, 2500, 6000, 12_000, 30_000]),
          cached_pct=st.sampled_from([0, 50, 95]))
    def offer(self, worker: str, tenant: str, num_tokens: int, cached_pct: int) -> None:
        if worker not in self.alive:
            return
        rid = f"r{self.next_id}"
        self.next_id += 1
        t = Ticket(rid, worker, tenant, num_tokens, num_tokens * cached_pct // 100, self.now_s)
        try:
            ok = self.adm.offer(t, self.now_s)
        except QueueFull as exc:
            assert CFG.min_retry_after_s <= exc.retry_after_s <= CFG.max_retry_after_s
            n_tenant = sum(q.tenant == tenant for q in self.queued.values())
            assert len(self.queued) >= CFG.max_queued or n_tenant >= CFG.max_queued_per_tenant
            self.gone.add(rid)
            return
        if ok:
            self.admitted[rid] = t
            self.admit_order.append(t)
        else:
            self.queued[rid] = t

    @precondition(lambda self: self.admitted)
    @rule(data=st.data())
    def started(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.admitted)))
        del self.admitted[rid]
        self.decoding.add(rid)
        self._take(self.adm.started(rid, self.now_s))
        assert self.adm.started(rid, self.now_s) == []  # NOTE: idempotent

    @precondition(lambda self: self.admitted or self.decoding or self.queued)
    @rule(data=st.data())
    def done(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted({*self.admitted, *self.decoding, *self.queued})))
        for group in (self.admitted, self.queued):
            group.pop(rid, None)
        self.decoding.discard(rid)
        self.gone.add(rid)
        self._take(self.adm.done(rid, self.now_s))
        assert self.adm.done(rid, self.now_s) == []

    @precondition(lambda self: self.queued)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.queued)))
        worker = self.queued[rid].worker_id
        assert self.adm.cancel(rid)
        assert not self.adm.cancel(rid)
        del self.queued[rid]
        self.gone.add(rid)
        self._take(self.adm.admit_ready(worker, self.now_s))

    @rule(dt=st.sampled_from([0.1, 1.0, 7.0]))
    def tick(self, dt: float) -> None:
        self.now_s += dt

    @rule(worker=st.sampled_from(WORKERS))
    def remove_and_readd(self, worker: str) -> None:
        back = self.adm.remove_worker(worker)
        expected = sorted(r for r, t in self.queued.items() if t.worker_id == worker)
        assert sorted(t.request_id for t in back) == expected
        for group in (self.queued, self.admitted):
            for rid in [r for r, t in group.items() if t.worker_id == worker]:
                del group[rid]
                self.gone.add(rid)
        self.adm.add_worker(worker, COST, 512)

    @invariant()
    def counts_match(self) -> None:
        assert self.adm.num_queued == len(self.queued)
        assert all(self.adm.is_queued(r) for r in self.queued)
        assert not any(self.adm.is_queued(r) for r in self.admitted)

    @invariant()
    def capacity_respected(self) -> None:
        for w in WORKERS:
            cap = self.adm.capacity_of(w)
            mine = [t for t in self.admitted.values() if t.worker_id == w]
            used = self.adm.used_tokens(w)
            for b in range(CFG.num_buckets):
                tickets = [t for t in mine if t.bucket == b]
                assert used[b] == sum(t.uncached_tokens for t in tickets), (w, b, used)
                # NOTE: beyond the capacity only when one ticket runs alone in its bucket
                assert used[b] <= cap or len(tickets) == 1, (w, b, used, cap)
            # NOTE: borrowed capacity is bounded: tickets admitted by borrowing fit the capacity,
            # those in their own reserves fit the reserves (sum <= capacity), plus one alone
            # ticket per bucket at most
            alone = sum(max((t.uncached_tokens for t in mine if t.bucket == b), default=0)
                        for b in range(CFG.num_buckets))
            assert sum(used) <= 2 * cap + alone, (w, used, cap)

    @invariant()
    def every_queue_drains(self) -> None:
        # NOTE: a queued bucket has a ticket in flight (its release pumps the queue), and some
        # queued ticket does not fit its bucket's own reserve (else the head would have gone)
        for w in WORKERS:
            cap = self.adm.capacity_of(w)
            used, in_flight = self.adm.used_tokens(w), self.adm.num_in_flight(w)
            for b in range(CFG.num_buckets):
                queued = self.adm.queued(w, b)
                if not queued:
                    continue
                assert in_flight[b] > 0, (w, b)
                biggest = max(t.uncached_tokens for t in queued)
                assert used[b] + biggest > CFG.bucket_shares[b] * cap, (w, b, used, biggest)

    @invariant()
    def overtaking_bounded(self) -> None:
        # NOTE: no queued ticket is older than the credit bound relative to one of the same
        # worker, bucket and tenant admitted before it
        bound = CFG.max_credit_s
        for t in self.queued.values():
            for a in self.admit_order:
                if (a.worker_id, a.bucket, a.tenant) == (t.worker_id, t.bucket, t.tenant):
                    assert a.arrival_s <= t.arrival_s + bound + 1e-9, (a, t)


AdmissionMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=50,
                                              deadline=None)
TestAdmissionMachine = AdmissionMachine.TestCase


@settings(max_examples=60, deadline=None)
@given(weights=st.tuples(st.integers(1, 4), st.integers(1, 4)),
       sizes=st.lists(st.integers(2048, 9000), min_size=80, max_size=80))
def test_weighted_fairness_bound(weights: tuple[int, int], sizes: list[int]) -> None:
    """Two always-backlogged tenants on one busy bucket: the service each gets, divided by its
    weight, differs by at most a couple of the largest tickets."""
    cfg = AdmissionConfig(prefill_window_s=1.0, bucket_shares=(0.25, 0.25, 0.25, 0.25),
                          tenant_weights=(("x", float(weights[0])), ("y", float(weights[1]))))
    adm = Admission(cfg)
    adm.add_worker("w", COST, 512)
    served = {"x": 0, "y": 0}
    in_flight: list[Ticket] = []
    for i, size in enumerate(sizes):
        for tenant in ("x", "y"):
            t = Ticket(f"{tenant}{i}", "w", tenant, size, 0, 0.0)
            if adm.offer(t, 0.0):
                in_flight.append(t)
    for step in range(60):
        t = in_flight.pop(0)
        served[t.tenant] += t.uncached_tokens
        in_flight.extend(adm.started(t.request_id, float(step)))
        assert in_flight, "a backlogged queue stopped"
    lag = abs(served["x"] / weights[0] - served["y"] / weights[1])
    assert lag <= 3 * max(sizes), (served, weights)


@settings(max_examples=60, deadline=None)
@given(tickets=st.lists(st.tuples(st.sampled_from(WORKERS), st.sampled_from(TENANTS),
                                  st.integers(1, 80_000), st.integers(0, 100)),
                        min_size=1, max_size=40))
def test_everything_queued_is_admitted_once_capacity_frees(
    tickets: list[tuple[str, str, int, int]]
) -> None:
    """No new arrivals: each round starts every admitted ticket (their prefill done); each
    round admits at least one queued ticket while any waits, so all go within len rounds."""
    adm = Admission(dataclasses.replace(CFG, max_queued=100, max_queued_per_tenant=100))
    for w in WORKERS:
        adm.add_worker(w, COST, 512)
    admitted: list[str] = []
    for i, (worker, tenant, n, pct) in enumerate(tickets):
        if adm.offer(Ticket(f"r{i}", worker, tenant, n, n * pct // 100, 0.0), 0.0):
            admitted.append(f"r{i}")
    seen = set(admitted)
    rounds = 0
    while admitted:
        rounds += 1
        assert rounds <= len(tickets), f"{adm.num_queued} still queued after {rounds} rounds"
        now, admitted = list(admitted), []
        for rid in now:
            for t in adm.started(rid, float(rounds)):
                assert t.request_id not in seen, f"{t.request_id} admitted twice"
                seen.add(t.request_id)
                admitted.append(t.request_id)
    assert adm.num_queued == 0 and len(seen) == len(tickets)
