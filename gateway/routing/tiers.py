"""The KV index's view of the tiers below a worker's device prefix cache (DESIGN.md "Tiers"):
L2 host memory, one per worker (KV events with medium "CPU"), and L3 GCache, one store shared by
every worker of the deployment (medium "GCACHE").

    medium   scope        learnt from                          forgotten on
    CPU      its worker   BlockStored / SwaBlocksStored,       BlockRemoved (CPU), the worker's
                          SwaBlocksDropped, BlockRemoved        AllBlocksCleared, restart, resync,
                                                               the host cap (least recently stored)
    GCACHE   all workers  BlockStored / SwaBlocksStored from   the TTL (the store evicts silently,
                          any worker                           no removal is ever sent), the cap
                                                               (least recently confirmed); never
                                                               by one worker's clear or restart

A page hash names its whole (salted) prefix, so an entry needs no parent link: the matcher
(``gateway.routing.matching.match_tiers``) walks the query's chain. Hashes are salted per tenant
(``cache_salt``), so the shared L3 set keeps tenants apart by construction.

Full KV and SWA KV are separate facts in both views (an L2 entry may hold only the SWA of a page
whose full KV stays on the device: a demoted checkpoint).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

FULL = 1  # NOTE: host entry bits: the page's full KV / its SWA KV is in host memory
SWA = 2

DEFAULT_STORAGE_TTL_S = 3600.0  # NOTE: a typical GCache (Redis) TTL; beyond it, do not bet on it
DEFAULT_MAX_STORAGE_PAGES = 1_000_000  # about 100 bytes an entry


class HostView:
    """One worker's L2 pages: page hash -> ``FULL | SWA`` bits, least recently stored first."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def store(self, page_hashes: Iterable[int], bit: int) -> int:
        """Mark ``bit`` on these pages; returns how many entries are new."""
        entries, added = self.entries, 0
        for h in page_hashes:
            old = entries.get(h)
            if old is None:
                added += 1
                entries[h] = bit
            else:
                entries[h] = old | bit
                entries.move_to_end(h)
        return added

    def drop_swa(self, page_hashes: Iterable[int]) -> int:
        """The SWA of these pages left host memory; returns the entries that went with it."""
        entries, removed = self.entries, 0
        for h in page_hashes:
            old = entries.get(h)
            if old is None:
                continue
            if old & FULL:
                entries[h] = FULL
            else:
                del entries[h]
                removed += 1
        return removed

    def remove(self, page_hashes: Iterable[int]) -> int:
        entries = self.entries
        return sum(entries.pop(h, None) is not None for h in page_hashes)

    def pop_oldest(self) -> None:
        self.entries.popitem(last=False)

    def clear(self) -> None:
        self.entries.clear()


class StorageView:
    """The shared L3 pages: page hash -> when it was last confirmed (``full`` and ``swa`` apart),
    oldest first in each. Bounded by ``max_pages`` entries (both maps together) and aged by
    ``ttl_s`` on the caller's clock (``expire``)."""

    __slots__ = ("full", "swa", "max_pages", "ttl_s", "num_evicted", "num_expired")

    def __init__(self, max_pages: int = DEFAULT_MAX_STORAGE_PAGES,
                 ttl_s: float = DEFAULT_STORAGE_TTL_S) -> None:
        assert max_pages > 0 and ttl_s > 0, (max_pages, ttl_s)
        self.full: OrderedDict[int, float] = OrderedDict()
        self.swa: OrderedDict[int, float] = OrderedDict()
        self.max_pages, self.ttl_s = max_pages, ttl_s
        self.num_evicted = self.num_expired = 0

    def __len__(self) -> int:
        return len(self.full) + len(self.swa)

    def store(self, page_hashes: Iterable[int], bit: int, now_s: float) -> None:
        """Confirmed at ``now_s``: refreshed (moved to the young end) or added; the cap applies."""
        entries = self.full if bit == FULL else self.swa
        for h in page_hashes:
            entries[h] = now_s
            entries.move_to_end(h)
        while len(self.full) + len(self.swa) > self.max_pages:
            self._pop_oldest()
            self.num_evicted += 1

    def expire(self, now_s: float) -> None:
        """Forget what was last confirmed ``ttl_s`` or more before ``now_s``."""
        limit = now_s - self.ttl_s
        for entries in (self.full, self.swa):
            # NOTE: oldest first (store refreshes to the end), so stop at the first young one
            while entries and next(iter(entries.values())) <= limit:
                entries.popitem(last=False)
                self.num_expired += 1

    def clear(self) -> None:
        self.full.clear()
        self.swa.clear()

    def _pop_oldest(self) -> None:
        full, swa = self.full, self.swa
        if not swa or (full and next(iter(full.values())) <= next(iter(swa.values()))):
            full.popitem(last=False)
        else:
            swa.popitem(last=False)
