"""Admission: which routed requests a worker gets now, and which wait in the gateway.

A pure state machine (no asyncio, no clock reads: callers pass ``now_s``), driven live by
``gateway.admission_gate.AdmissionGate`` and in virtual time by ``agentgate replay``::

    ok = admission.offer(ticket, now_s)          # True: send now; False: queued (QueueFull: 429)
    admission.started(request_id, now_s)         # first token: its prefill is done -> [admitted]
    admission.done(request_id, now_s)            # ended (idempotent; also drops a queued one)
    admission.cancel(request_id)                 # a queued request's client left

**Buckets.** A request's bucket is its UNCACHED prompt length (``prompt - cached``): with the
default bounds ``(2048, 16384, 65536)`` the buckets are < 2k, 2k-16k, 16k-64k and >= 64k tokens.

**Capacity.** A worker's capacity ``C`` is the uncached tokens it prefills in
``prefill_window_s`` by its announced ``CostModel`` (at least one step's ``max_batched_tokens``;
unbounded for a zero-cost model). What is counted against it: the uncached tokens of requests
admitted and not yet at their first token. Bucket ``b`` reserves ``r_b = share_b * C``. A ticket of
``u`` uncached tokens in bucket ``b`` is admitted when one of these holds::

    | rule   | condition                                            | why                         |
    |--------|------------------------------------------------------|-----------------------------|
    | own    | used_b + u <= r_b                                    | a bucket's reserve is its   |
    |        |                                                      | own                         |
    | borrow | used_b + u <= C - sum(k != b) held_k, where held_k = | work-conserving: idle       |
    |        |   max(used_k, r_k) if k < b or k has a queue,        | capacity is lent, but never |
    |        |   else used_k                                        | a shorter bucket's reserve  |
    | alone  | used_b == 0 (nothing of b in flight on that worker)  | nothing is too big to run   |

So a 1k-token agent turn never waits behind a 100k-token prefill: the long one cannot take the
short bucket's reserve, and the short one may use any capacity left idle. A bucket whose queue is
not empty always has a request in flight (the alone rule), so each queue keeps draining.

**Order inside a (worker, bucket) queue.** First the tenant with the smallest virtual time
(weighted fair queueing: a tenant's virtual time grows by ``u / weight`` per admission and starts at
the system's virtual time when it becomes active), then that tenant's ticket with the smallest key
``arrival_s - credit_s``, where ``credit_s = cache_credit_s * cached_fraction + size_credit_s *
(1 - u / bucket_span)``: cache hits first, then fewer uncached tokens, and since every waiting
ticket ages at the same rate, a ticket is overtaken only by tickets that arrived less than
``cache_credit_s + size_credit_s`` after it (bounded starvation). The queue head blocks the
bucket (no skipping ahead of it), so the bound holds.

**Priority** (``Generate.priority``; the engine runs larger first)::

    priority = (num_buckets - 1 - bucket) * 1000 + round(999 * cached_fraction)

shorter buckets above longer ones, and inside a bucket the larger cached fraction first.

**Bounded queue.** Past ``max_queued`` queued tickets in all, or ``max_queued_per_tenant`` of one
tenant, ``offer`` raises ``QueueFull(retry_after_s)``: the queued uncached tokens ahead divided by
the drain rate (admitted uncached tokens per second, an EWMA measured while a queue existed;
before any measurement, the workers' modelled capacity per ``prefill_window_s``), clamped to
``[min_retry_after_s, max_retry_after_s]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.cost import CostModel
from gateway.routing.admission_queue import BucketQueue, Entry

PRIORITY_PER_BUCKET = 1000
MAX_IDLE_TENANTS = 1024  # NOTE: virtual times kept before idle tenants are forgotten


class QueueFull(Exception):
    """The admission queue (all, or the tenant's share) is full: answer 429 with
    ``Retry-After: ceil(retry_after_s)``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Admission settings (see the module docstring).

    Attributes:
        bucket_bounds_tokens: ascending upper bounds (exclusive) of the uncached-length buckets;
            one more bucket holds everything longer.
        bucket_shares: each bucket's reserved share of a worker's capacity (one per bucket; sum
            at most 1). Shorter buckets hold many small requests, the longest one at most a few.
        prefill_window_s: a worker's capacity is the uncached tokens it prefills in this long.
        cache_credit_s, size_credit_s: head start (seconds of waiting) of a fully cached
            request, and of the smallest one in its bucket; their sum bounds overtaking.
        tenant_weights: weighted fair shares; unnamed tenants weigh ``default_tenant_weight``.
        max_queued, max_queued_per_tenant: queue bounds (``QueueFull`` past them).
        drain_alpha, drain_sample_s: the drain-rate EWMA and its sampling interval.
        min_retry_after_s, max_retry_after_s: the clamp of ``QueueFull.retry_after_s``.
    """

    bucket_bounds_tokens: tuple[int, ...] = (2048, 16384, 65536)
    bucket_shares: tuple[float, ...] = (0.3, 0.3, 0.2, 0.2)
    prefill_window_s: float = 2.0
    cache_credit_s: float = 4.0
    size_credit_s: float = 1.0
    tenant_weights: tuple[tuple[str, float], ...] = ()
    default_tenant_weight: float = 1.0
    max_queued: int = 4096
    max_queued_per_tenant: int = 1024
    drain_alpha: float = 0.3
    drain_sample_s: float = 1.0
    min_retry_after_s: float = 1.0
    max_retry_after_s: float = 60.0

    def __post_init__(self) -> None:
        bounds = self.bucket_bounds_tokens
        assert all(b > 0 for b in bounds), f"{bounds=}: positive"
        assert list(bounds) == sorted(set(bounds)), f"{bounds=}: strictly ascending"
        assert len(self.bucket_shares) == len(bounds) + 1, (
            f"{self.bucket_shares=}: one share per bucket ({len(bounds) + 1})")
        assert all(s >= 0 for s in self.bucket_shares), f"{self.bucket_shares=}"
        assert sum(self.bucket_shares) <= 1 + 1e-9, f"{self.bucket_shares=}: sum <= 1"
        assert self.prefill_window_s > 0, f"{self.prefill_window_s=}"
        assert self.cache_credit_s >= 0 and self.size_credit_s >= 0
        assert all(w > 0 for _, w in self.tenant_weights) and self.default_tenant_weight > 0
        assert self.max_queued >= 0 and self.max_queued_per_tenant >= 0
        assert 0 < self.drain_alpha <= 1 and self.drain_sample_s > 0
        assert 0 < self.min_retry_after_s <= self.max_retry_after_s

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_bounds_tokens) + 1

    @property
    def max_credit_s(self) -> float:
        """How much later than a ticket another one may arrive and still be admitted first."""
        return self.cache_credit_s + self.size_credit_s

    def bucket_of(self, uncached_tokens: int) -> int:
        for b, bound in enumerate(self.bucket_bounds_tokens):
            if uncached_tokens < bound:
                return b
        return len(self.bucket_bounds_tokens)

    def weight_of(self, tenant: str) -> float:
        for name, weight in self.tenant_weights:
            if name == tenant:
                return weight
        return self.default_tenant_weight


@dataclass(slots=True)
class Ticket:
    """A routed request asking to be sent to ``worker_id``.

    ``bucket`` and ``priority`` (the int for ``Generate.priority``) are set by ``offer``.
    """

    request_id: str
    worker_id: str
    tenant: str
    num_tokens: int
    cached_tokens: int
    arrival_s: float
    bucket: int = -1
    priority: int = 0

    @property
    def uncached_tokens(self) -> int:
        # NOTE: the last prompt token is always computed, so at least 1
        return max(1, self.num_tokens - max(0, self.cached_tokens))

    @property
    def cached_fraction(self) -> float:
        if self.num_tokens <= 0:
            return 0.0
        return min(1.0, max(0, self.cached_tokens) / self.num_tokens)


@dataclass(slots=True)
class _Worker:
    capacity_tokens: float
    used: list[int]  # NOTE: per bucket: uncached tokens admitted, before their first token
    in_flight: list[int]  # NOTE: per bucket: tickets admitted, before their first token
    queues: list[BucketQueue] = field(default_factory=list)  # NOTE: per bucket


class Admission:
    """The admission state machine (see the module docstring). Not thread-safe."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self._workers: dict[str, _Worker] = {}
        self._entries: dict[str, Entry] = {}  # NOTE: queued or admitted (before first token)
        self._queued_of: dict[str, int] = {}  # NOTE: tenant -> queued tickets
        self._queued_tokens_of: dict[str, int] = {}
        self._num_queued = 0
        self._queued_tokens = 0
        self._vtime: dict[str, float] = {}  # NOTE: tenant -> virtual time (fair queueing)
        self._system_vtime = 0.0
        self._seq = 0
        self._drain_rate: float | None = None  # NOTE: tokens/s, EWMA
        self._drain_since_s: float | None = None
        self._drain_tokens = 0

    # -- workers -----------------------------------------------------------------------------

    def add_worker(self, worker_id: str, cost: CostModel, max_batched_tokens: int) -> None:
        """Register (or re-register, keeping its queue) a worker with its announced cost."""
        capacity = capacity_tokens(cost, max_batched_tokens, self.config.prefill_window_s)
        if (w := self._workers.get(worker_id)) is not None:
            w.capacity_tokens = capacity
            return
        self._workers[worker_id] = self._new_worker(capacity)

    def remove_worker(self, worker_id: str) -> list[Ticket]:
        """Forget a worker: its admitted tickets are dropped (their ``done`` is then a no-op) and
        its queued ones are returned, oldest first, to be routed again."""
        w = self._workers.pop(worker_id, None)
        if w is None:
            return []
        queued = [e for q in w.queues for e in q.entries()]
        for e in queued:
            self._unqueue_counts(e)
        for rid in [r for r, e in self._entries.items() if e.ticket.worker_id == worker_id]:
            del self._entries[rid]
        queued.sort(key=lambda e: e.seq)
        return [e.ticket for e in queued]

    def capacity_of(self, worker_id: str) -> float:
        return self._workers[worker_id].capacity_tokens

    # -- requests ----------------------------------------------------------------------------

    def offer(self, ticket: Ticket, now_s: float) -> bool:
        """Ask to send ``ticket`` to its worker now.

        Returns:
            True: admitted, send it. False: queued; a later ``started``/``done``/``remove_worker``
            returns it (or ``cancel`` drops it).

        Raises:
            QueueFull: the queue (all, or the tenant's) is at its bound; nothing was queued.
            ValueError: the request id is already queued or admitted.
        """
        if ticket.request_id in self._entries:
            raise ValueError(f"request {ticket.request_id!r} is already offered")
        cfg = self.config
        tokens = ticket.uncached_tokens
        ticket.bucket = cfg.bucket_of(tokens)
        ticket.priority = priority_of(ticket.bucket, ticket.cached_fraction, cfg.num_buckets)
        w = self._worker(ticket.worker_id)
        entry = Entry(ticket, ticket.arrival_s - self._credit_s(ticket, tokens), self._seq, tokens)
        self._seq += 1
        q = w.queues[ticket.bucket]
        # NOTE: into a waiting queue it goes only when it becomes the head (a better key than
        # the head that is waiting) and fits; never past a head that would not fit
        q.push(entry)
        if q.head(self._vtime_of) is entry and self._fits(w, ticket.bucket, tokens):
            q.pop(entry)
            self._admit(w, entry, now_s)
            return True
        try:
            self._check_bounds(ticket.tenant, tokens)
        except QueueFull:
            q.drop(entry)
            raise
        self._count_queued(entry)
        return False

    def started(self, request_id: str, now_s: float) -> list[Ticket]:
        """Its first token came (prefill done): free its capacity. Returns the tickets admitted
        now, to send. Idempotent; unknown ids return []."""
        return self._release(request_id, now_s)

    def done(self, request_id: str, now_s: float) -> list[Ticket]:
        """It ended (finished, failed or aborted); a queued one is dropped. Returns the tickets
        admitted now. Idempotent."""
        e = self._entries.get(request_id)
        if e is not None and not e.admitted:
            self.cancel(request_id)
            return self.admit_ready(e.ticket.worker_id, now_s)
        return self._release(request_id, now_s)

    def cancel(self, request_id: str) -> bool:
        """Drop a queued ticket (its client left). False when it is not queued.

        NOTE: this frees no capacity but may unblock a queue (the dropped ticket was its head,
        or held its bucket's reserve): call ``admit_ready`` for the worker to send what fits now.
        Without it, those go at the bucket's next release (a non-empty queue always has one in
        flight)."""
        e = self._entries.get(request_id)
        if e is None or e.admitted:
            return False
        del self._entries[request_id]
        w = self._workers.get(e.ticket.worker_id)
        if w is not None:
            w.queues[e.ticket.bucket].drop(e)
        self._unqueue_counts(e)
        return True

    def admit_ready(self, worker_id: str, now_s: float) -> list[Ticket]:
        """Admit what fits now on ``worker_id`` (after a ``cancel``); the tickets to send."""
        w = self._workers.get(worker_id)
        return [] if w is None else self._pump(w, now_s)

    def is_queued(self, request_id: str) -> bool:
        e = self._entries.get(request_id)
        return e is not None and not e.admitted

    @property
    def num_queued(self) -> int:
        return self._num_queued

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    @property
    def drain_rate_tokens_s(self) -> float:
        """Admitted uncached tokens per second (measured EWMA, else the modelled capacity)."""
        if self._drain_rate is not None and self._drain_rate > 0:
            return self._drain_rate
        window = self.config.prefill_window_s
        modelled = sum(w.capacity_tokens for w in self._workers.values()) / window
        return modelled if math.isfinite(modelled) and modelled > 0 else 0.0

    def used_tokens(self, worker_id: str) -> list[int]:
        """Per bucket: uncached tokens admitted on the worker, before their first token."""
        return list(self._workers[worker_id].used)

    def num_in_flight(self, worker_id: str) -> list[int]:
        """Per bucket: tickets admitted on the worker, before their first token."""
        return list(self._workers[worker_id].in_flight)

    def queued(self, worker_id: str, bucket: int) -> list[Ticket]:
        """The worker's queue of that bucket, in no particular order."""
        return [e.ticket for e in self._workers[worker_id].queues[bucket].entries()]

    # -- internals ---------------------------------------------------------------------------

    def _new_worker(self, capacity: float) -> _Worker:
        n = self.config.num_buckets
        return _Worker(capacity, [0] * n, [0] * n, [BucketQueue() for _ in range(n)])

    def _worker(self, worker_id: str) -> _Worker:
        # NOTE: a worker nobody announced (no Welcome yet) has no known cost: no limit
        if (w := self._workers.get(worker_id)) is None:
            w = self._workers[worker_id] = self._new_worker(math.inf)
        return w

    def _credit_s(self, ticket: Ticket, tokens: int) -> float:
        cfg = self.config
        b = ticket.bucket
        low = 0 if b == 0 else cfg.bucket_bounds_tokens[b - 1]
        high = cfg.bucket_bounds_tokens[b] if b < len(cfg.bucket_bounds_tokens) else 2 * low
        smallness = 1.0 - min(1.0, max(0, tokens - low) / max(1, high - low))
        return cfg.cache_credit_s * ticket.cached_fraction + cfg.size_credit_s * smallness

    def _fits(self, w: _Worker, b: int, tokens: int) -> bool:
        used = w.used[b]
        if w.in_flight[b] == 0:
            return True  # NOTE: alone: nothing is too big to ever run
        cap = w.capacity_tokens
        if not math.isfinite(cap):
            return True
        reserve = self.config.bucket_shares
        if used + tokens <= reserve[b] * cap:
            return True  # NOTE: own reserve
        held = 0.0
        for k, used_k in enumerate(w.used):
            if k == b:
                continue
            protected = k < b or bool(w.queues[k])
            held += max(used_k, reserve[k] * cap) if protected else used_k
        return used + tokens <= cap - held  # NOTE: borrow idle capacity

    def _admit(self, w: _Worker, e: Entry, now_s: float) -> None:
        t = e.ticket
        e.admitted = True
        self._entries[t.request_id] = e
        w.used[t.bucket] += e.tokens
        w.in_flight[t.bucket] += 1
        weight = self.config.weight_of(t.tenant)
        start = max(self._vtime.get(t.tenant, 0.0), self._system_vtime)
        self._system_vtime = start
        self._vtime[t.tenant] = start + e.tokens / weight
        if len(self._vtime) > MAX_IDLE_TENANTS:
            self._forget_idle_tenants()
        self._note_drain(e.tokens, now_s)

    def _forget_idle_tenants(self) -> None:
        # NOTE: a tenant at or behind the system's virtual time starts there anyway
        v = self._system_vtime
        for tenant in [t for t, vt in self._vtime.items() if vt <= v]:
            if tenant not in self._queued_of:
                del self._vtime[tenant]

    def _count_queued(self, e: Entry) -> None:
        t = e.ticket
        self._entries[t.request_id] = e
        self._num_queued += 1
        self._queued_tokens += e.tokens
        self._queued_of[t.tenant] = self._queued_of.get(t.tenant, 0) + 1
        self._queued_tokens_of[t.tenant] = self._queued_tokens_of.get(t.tenant, 0) + e.tokens

    def _unqueue_counts(self, e: Entry) -> None:
        tenant = e.ticket.tenant
        self._entries.pop(e.ticket.request_id, None)
        self._num_queued -= 1
        self._queued_tokens -= e.tokens
        self._queued_of[tenant] -= 1
        self._queued_tokens_of[tenant] -= e.tokens
        if self._queued_of[tenant] == 0:
            del self._queued_of[tenant], self._queued_tokens_of[tenant]

    def _release(self, request_id: str, now_s: float) -> list[Ticket]:
        e = self._entries.pop(request_id, None)
        if e is None:
            return []
        assert e.admitted
        w = self._workers.get(e.ticket.worker_id)
        if w is None:
            return []
        w.used[e.ticket.bucket] -= e.tokens
        w.in_flight[e.ticket.bucket] -= 1
        return self._pump(w, now_s)

    def _pump(self, w: _Worker, now_s: float) -> list[Ticket]:
        """Admit queued tickets while their bucket's head fits, shorter buckets first."""
        admitted: list[Ticket] = []
        for b, q in enumerate(w.queues):
            while q:
                head = q.head(self._vtime_of)
                if not self._fits(w, b, head.tokens):
                    break
                q.pop(head)
                self._unqueue_counts(head)
                self._admit(w, head, now_s)
                admitted.append(head.ticket)
        return admitted

    def _vtime_of(self, tenant: str) -> float:
        """A tenant's virtual start time: its own, or the system's when it has fallen behind."""
        return max(self._vtime.get(tenant, 0.0), self._system_vtime)

    def _check_bounds(self, tenant: str, tokens: int) -> None:
        cfg = self.config
        if self._num_queued >= cfg.max_queued:
            raise QueueFull(
                f"admission queue full ({self._num_queued} queued)",
                self._retry_after_s(self._queued_tokens + tokens, 1.0))
        if self._queued_of.get(tenant, 0) >= cfg.max_queued_per_tenant:
            share = self._tenant_share(tenant)
            raise QueueFull(
                f"tenant {tenant!r} has {self._queued_of[tenant]} requests queued",
                self._retry_after_s(self._queued_tokens_of[tenant] + tokens, share))

    def _tenant_share(self, tenant: str) -> float:
        weights = {t: self.config.weight_of(t) for t in self._queued_of}
        weights[tenant] = self.config.weight_of(tenant)
        return weights[tenant] / sum(weights.values())

    def _retry_after_s(self, tokens_ahead: int, share: float) -> float:
        cfg = self.config
        rate = self.drain_rate_tokens_s * share
        wait_s = tokens_ahead / rate if rate > 0 else cfg.max_retry_after_s
        return min(cfg.max_retry_after_s, max(cfg.min_retry_after_s, wait_s))

    def _note_drain(self, tokens: int, now_s: float) -> None:
        """Sample admitted tokens per second, but only over intervals with a queue: while
        nothing waits, the admission rate is the demand, not what the workers can drain."""
        if self._num_queued == 0 and self._drain_since_s is None:
            return
        if self._drain_since_s is None:
            self._drain_since_s, self._drain_tokens = now_s, tokens
            return
        self._drain_tokens += tokens
        elapsed_s = now_s - self._drain_since_s
        if elapsed_s < self.config.drain_sample_s:
            return
        sample = self._drain_tokens / elapsed_s
        alpha = self.config.drain_alpha
        prev = self._drain_rate
        self._drain_rate = sample if prev is None else alpha * sample + (1 - alpha) * prev
        self._drain_since_s = now_s if self._num_queued else None
        self._drain_tokens = 0


def capacity_tokens(cost: CostModel, max_batched_tokens: int, window_s: float) -> float:
    """Uncached tokens a worker prefills in ``window_s`` (at least one step's budget; unbounded
    for a model whose prefill costs nothing)."""
    if cost.prefill_s_per_token <= 0:
        return math.inf
    return max(float(max_batched_tokens), window_s / cost.prefill_s_per_token)


def priority_of(bucket: int, cached_fraction: float, num_buckets: int) -> int:
    """``Generate.priority`` (larger runs first): shorter buckets first, then higher cached
    fraction."""
    frac = min(1.0, max(0.0, cached_fraction))
    return (num_buckets - 1 - bucket) * PRIORITY_PER_BUCKET + round(999 * frac)
