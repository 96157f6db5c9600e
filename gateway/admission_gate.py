"""``AdmissionGate``: the asyncio side of ``gateway.routing.admission.Admission``.

    await gate.admit(ticket)    # returns once admitted (ticket.priority is then set)
    ...                         # send it; on its first token:
    gate.started(request_id)    # its prefill is done: capacity frees, queued tickets go
    gate.done(request_id)       # on every end (finished, failed, aborted, refused); idempotent

A queued ticket waits on a future of its own; a release resolves the futures of the tickets it
admits. Cancelling the awaiting task (the client went away) removes the ticket at once, and a
ticket admitted in the same instant its task was cancelled is released again, so no capacity
leaks. ``QueueFull`` propagates from ``admit`` (the caller answers 429 with its Retry-After).
When a worker leaves, its queued tickets are let through (``remove_worker``): their sends then
fail on the dead worker and the dispatcher's retry moves them elsewhere.

Clocks: ``time.monotonic`` unless a clock is given (tests). Everything runs on one event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from engine.cost import CostModel
from gateway.metrics import LATENCY_BUCKETS_S, Histogram
from gateway.routing.admission import Admission, QueueFull, Ticket

__all__ = ["AdmissionGate", "QueueFull", "Ticket"]


class AdmissionGate:
    """Waits routed requests through an ``Admission`` (see the module docstring).

    Attributes:
        admission: the state machine (its config, queue sizes, drain rate).
        wait_s: seconds each admitted ticket waited (0 for those admitted at once).
        num_admitted, num_queued_total, num_rejected, num_cancelled: counters for /metrics.
    """

    def __init__(self, admission: Admission | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.admission = admission or Admission()
        self._clock = clock
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self.wait_s = Histogram(LATENCY_BUCKETS_S)
        self.num_admitted = 0
        self.num_queued_total = 0
        self.num_rejected = 0
        self.num_cancelled = 0

    def add_worker(self, worker_id: str, cost: CostModel, max_batched_tokens: int) -> None:
        self.admission.add_worker(worker_id, cost, max_batched_tokens)

    def remove_worker(self, worker_id: str) -> list[Ticket]:
        """Forget a worker; its queued tickets' ``admit`` calls return (their sends fail over)."""
        tickets = self.admission.remove_worker(worker_id)
        for t in tickets:
            fut = self._waiters.pop(t.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        return tickets

    async def admit(self, ticket: Ticket) -> None:
        """Return once ``ticket`` is admitted.

        Raises:
            QueueFull: the queue is full (nothing was queued).
            asyncio.CancelledError: the awaiting task was cancelled; the ticket is gone.
        """
        rid = ticket.request_id
        start_s = self._clock()
        try:
            if self.admission.offer(ticket, start_s):
                self._admitted(0.0)
                return
        except QueueFull:
            self.num_rejected += 1
            raise
        self.num_queued_total += 1
        fut = self._waiters[rid] = asyncio.get_running_loop().create_future()
        try:
            await fut
        except asyncio.CancelledError:
            self._waiters.pop(rid, None)
            self.num_cancelled += 1
            now_s = self._clock()
            if self.admission.cancel(rid):
                # NOTE: it may have blocked its queue's head: what fits now goes now
                self._wake(self.admission.admit_ready(ticket.worker_id, now_s))
            else:
                # NOTE: admitted in the same instant: nobody will send it, so release it
                self._wake(self.admission.done(rid, now_s))
            raise
        self._admitted(self._clock() - start_s)

    def started(self, request_id: str) -> None:
        """Its first token came; idempotent."""
        self._wake(self.admission.started(request_id, self._clock()))

    def done(self, request_id: str) -> None:
        """It ended; idempotent. A still-waiting ``admit`` of it is cancelled."""
        fut = self._waiters.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.cancel()
        self._wake(self.admission.done(request_id, self._clock()))

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    def collect(self) -> Iterator[Metric]:
        """The admission metrics (``agentgate_admission_*``), for ``GatewayMetrics``."""
        p = "agentgate_admission_"
        adm = self.admission
        yield GaugeMetricFamily(p + "queued_requests", "Requests waiting for admission",
                                value=adm.num_queued)
        yield GaugeMetricFamily(p + "queued_tokens", "Uncached prompt tokens waiting for "
                                "admission", value=adm.queued_tokens)
        yield GaugeMetricFamily(p + "drain_rate_tokens_per_second", "Admitted uncached tokens "
                                "per second (EWMA while a queue existed)",
                                value=adm.drain_rate_tokens_s)
        for name, text, value in (
            ("admitted", "Requests admitted", self.num_admitted),
            ("queued", "Requests that had to wait for admission", self.num_queued_total),
            ("rejected", "Requests refused with 429 (queue full)", self.num_rejected),
            ("cancelled", "Queued requests whose client left", self.num_cancelled),
        ):
            yield CounterMetricFamily(p + name, text, value=value)
        wait = HistogramMetricFamily(p + "wait_seconds", "Time from offer to admission")
        wait.add_metric([], self.wait_s.buckets(), self.wait_s.sum)
        yield wait

    def _admitted(self, waited_s: float) -> None:
        self.num_admitted += 1
        self.wait_s.observe(waited_s)

    def _wake(self, tickets: list[Ticket]) -> None:
        """Resolve the admitted tickets' futures; one whose waiter is gone is released again
        (which may admit others: a worklist, not recursion)."""
        pending = list(tickets)
        while pending:
            t = pending.pop()
            fut = self._waiters.pop(t.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
                continue
            pending.extend(self.admission.done(t.request_id, self._clock()))

