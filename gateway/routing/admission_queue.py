"""The queue of one (worker, bucket) of ``gateway.routing.admission``: a heap per tenant."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.routing.admission import Ticket


@dataclass(slots=True)
class Entry:
    """A ticket inside admission: queued, or admitted and not yet at its first token."""

    ticket: Ticket
    key: float  # NOTE: arrival_s - credit_s: smaller goes first
    seq: int  # NOTE: tie break: first offered first
    tokens: int
    admitted: bool = False
    dropped: bool = False  # NOTE: cancelled while queued; its heap slot is removed lazily


class BucketQueue:
    """One (worker, bucket) queue: a heap per tenant, by ``(key, seq)``. Cancelled entries
    leave their heap lazily (at its top, or when dropped ones outnumber the live ones)."""

    __slots__ = ("_heaps", "_live", "num_live")

    def __init__(self) -> None:
        self._heaps: dict[str, list[tuple[float, int, Entry]]] = {}
        self._live: dict[str, int] = {}
        self.num_live = 0

    def __bool__(self) -> bool:
        return self.num_live > 0

    def push(self, e: Entry) -> None:
        tenant = e.ticket.tenant
        heapq.heappush(self._heaps.setdefault(tenant, []), (e.key, e.seq, e))
        self._live[tenant] = self._live.get(tenant, 0) + 1
        self.num_live += 1

    def head(self, vtime_of: Callable[[str], float]) -> Entry:
        """The tenant with the smallest virtual time (ties: the smaller key), its top entry."""
        tenant = min(self._heaps, key=lambda t: (vtime_of(t), self._heaps[t][0][:2]))
        return self._heaps[tenant][0][2]

    def pop(self, e: Entry) -> None:
        """Remove ``e``, the top of its tenant's heap."""
        heap = self._heaps[e.ticket.tenant]
        assert heap[0][2] is e
        heapq.heappop(heap)
        self._forget_one(e.ticket.tenant)

    def drop(self, e: Entry) -> None:
        e.dropped = True
        tenant = e.ticket.tenant
        heap = self._heaps[tenant]
        if len(heap) > 2 * self._live[tenant] + 16:
            heap[:] = [item for item in heap if not item[2].dropped]
            heapq.heapify(heap)
        self._forget_one(tenant)

    def entries(self) -> list[Entry]:
        return [item[2] for heap in self._heaps.values() for item in heap if not item[2].dropped]

    def _forget_one(self, tenant: str) -> None:
        self.num_live -= 1
        self._live[tenant] -= 1
        if self._live[tenant] == 0:
            del self._live[tenant], self._heaps[tenant]
            return
        heap = self._heaps[tenant]
        while heap[0][2].dropped:
            heapq.heappop(heap)
