"""L2: a host-memory page store below the device prefix cache (DESIGN.md "Tiers", issue 12).

Pages demoted from L1 (the device ``PrefixCache``) are copied here instead of being dropped, and
copied back when a later request's prefix reaches them. Only what a future hit needs comes down:
full pages of deleted leaves and the SWA pages of demoted checkpoints, never the SWA history.

    arena     a ``KVPool`` on the CPU (pinned when the device pool is on CUDA): the same chunk
              layout as the device, so a host page is shaped like ``KVPool.view(kind)[c, s]``
    slots     a ``PageAllocator`` over that arena: its own free lists, its own byte budget
    index     page_hash -> HostEntry(full_slot, swa_slot, parent_hash, token_ids), in LRU order

An entry holds the full page, the SWA page, or both, of one cached page (keyed by its chained
hash, which includes the tenant's ``cache_salt``). When the budget is full the least recently
used entries go first; entries that a load in progress uses are protected.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.kv.allocator import PageAllocator
from engine.kv.layout import KVLayout, PageKind
from engine.kv.pool import KVPool


@dataclass(slots=True)
class HostEntry:
    """One page in host memory: its full and/or SWA KV (a slot each, None when absent)."""

    page_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...] | None
    full_slot: int | None = None
    swa_slot: int | None = None
    from_storage: bool = False  # its full KV came from L3 and has not been loaded yet

    def slot(self, kind: PageKind) -> int | None:
        return self.full_slot if kind == PageKind.FULL else self.swa_slot


@dataclass
class HostStats:
    demoted_pages: int = 0  # pages copied device -> host
    loaded_pages: int = 0  # pages copied host -> device
    evicted_pages: int = 0  # pages dropped from host memory (LRU)
    dropped_pages: int = 0  # demotions refused: no room even after eviction
    hit_tokens: int = 0  # prompt tokens that L2 added to requests' usable prefix


class HostPagePool:
    """Host page slots of both kinds from ``budget_bytes``, indexed by page hash (LRU).

    Args:
        layout: the device's page geometry (pages are copied as they are).
        budget_bytes: the L2 byte budget (chunks of ``layout.chunk_bytes``).
        dtype: the device pool's dtype; None keeps the bookkeeping only, no memory (the sim
            backend, whose device pages have no tensors either).
        pin_memory: page-locked host memory (only when the device is CUDA).
    """

    def __init__(
        self,
        layout: KVLayout,
        budget_bytes: int,
        dtype: torch.dtype | None,
        pin_memory: bool = False,
    ) -> None:
        self.layout = layout
        self.allocator = PageAllocator(layout, budget_bytes)
        self.pool = None if dtype is None else KVPool(
            layout, self.allocator.num_chunks, dtype, "cpu", pin_memory=pin_memory
        )
        self._index: OrderedDict[int, HostEntry] = OrderedDict()  # LRU first
        self._protected: set[int] = set()
        self._held: set[int] = set()  # entries whose pages a step has yet to copy out
        self.stats = HostStats()
        # called with an entry the LRU evicts, before its slots are freed (L3 write-back)
        self.on_evict: Callable[[HostEntry], None] | None = None
        # called with each entry that leaves (evicted, discarded, cleared), after on_evict
        self.on_remove: Callable[[HostEntry], None] | None = None

    # ---------------------------------------------------------------- queries

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, page_hash: int) -> bool:
        return page_hash in self._index

    def get(self, page_hash: int) -> HostEntry | None:
        return self._index.get(page_hash)

    def entries(self) -> list[HostEntry]:
        return list(self._index.values())

    @property
    def num_pages(self) -> int:
        return sum(self.allocator.num_used_pages(k) for k in PageKind)

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    @property
    def total_bytes(self) -> int:
        return self.allocator.total_bytes

    def page(self, kind: PageKind, slot: int) -> torch.Tensor | None:
        return None if self.pool is None else self.pool.page(kind, slot)

    # ---------------------------------------------------------------- mutations

    def put(
        self,
        page_hash: int,
        parent_hash: int | None,
        token_ids: tuple[int, ...] | None,
        pages: Sequence[tuple[PageKind, torch.Tensor | None]],
    ) -> HostEntry | None:
        """Copy ``pages`` (device page tensors) in under ``page_hash``; a kind the entry already
        holds is kept as it is (the same hash names the same KV). Evicts LRU entries for room.

        Returns the entry (most recently used now), or None when there is no room for it.
        """
        entry = self._index.get(page_hash)
        if entry is not None and entry.token_ids != token_ids:
            self._remove(entry)  # NOTE: another page under this hash (a collision): replace it
            entry = None
        new = [(k, t) for k, t in pages if entry is None or entry.slot(k) is None]
        if not new:
            if entry is not None:
                self._index.move_to_end(page_hash)
            return entry
        num_full = sum(k == PageKind.FULL for k, _ in new)
        if not self._make_room(num_full, len(new) - num_full, keep=page_hash):
            self.stats.dropped_pages += len(new)
            return None
        if entry is None:
            entry = self._index[page_hash] = HostEntry(page_hash, parent_hash, token_ids)
        for kind, tensor in new:
            [slot] = self.allocator.allocate(kind, 1)
            dst = self.page(kind, slot)
            if dst is not None and tensor is not None:
                dst.copy_(tensor)
            if kind == PageKind.FULL:
                entry.full_slot = slot
            else:
                entry.swa_slot = slot
        self.stats.demoted_pages += len(new)
        self._index.move_to_end(page_hash)
        return entry

    def copy_out(self, entry: HostEntry, kind: PageKind, dst: torch.Tensor | None) -> None:
        """Copy the entry's page of ``kind`` into ``dst`` (a device page); marks it used."""
        slot = entry.slot(kind)
        assert slot is not None, f"host entry {entry.page_hash} holds no {kind.name} page"
        src = self.page(kind, slot)
        if src is not None and dst is not None:
            # NOTE: asynchronous from pinned memory is safe: the forward that reads dst runs
            # after it on the same stream, and host pages are only rewritten by blocking copies
            dst.copy_(src, non_blocking=src.is_pinned())
        self._index.move_to_end(entry.page_hash)
        self.stats.loaded_pages += 1

    def protect(self, page_hashes: Iterable[int]) -> None:
        """Keep these entries from eviction until ``unprotect`` (a load in progress)."""
        self._protected.update(page_hashes)

    def unprotect(self) -> None:
        self._protected.clear()

    def hold(self, page_hash: int) -> None:
        """Keep this entry (its slots unchanged) until ``release_held``: a deferred copy out of
        it (layer-wise loading) runs in the step's forward, after more admissions may demote."""
        self._held.add(page_hash)

    def release_held(self) -> None:
        self._held.clear()

    def discard(self, page_hash: int) -> bool:
        """Drop one entry (a hibernated session's page); False when it is not here."""
        entry = self._index.get(page_hash)
        if entry is None:
            return False
        self._remove(entry)
        return True

    def clear(self) -> int:
        """Drop every entry; returns how many."""
        n = len(self._index)
        for entry in list(self._index.values()):
            self._remove(entry)
        return n

    # ---------------------------------------------------------------- internals

    def _make_room(self, num_full: int, num_swa: int, keep: int) -> bool:
        while not self.allocator.can_allocate(num_full, num_swa):
            victim = next(
                (e for h, e in self._index.items()
                 if h != keep and h not in self._protected and h not in self._held),
                None,
            )  # NOTE: the least recently used one that no load in progress needs
            if victim is None:
                return False
            if self.on_evict is not None:
                self.on_evict(victim)
            self.stats.evicted_pages += self._remove(victim)
        return True

    def _remove(self, entry: HostEntry) -> int:
        del self._index[entry.page_hash]
        if self.on_remove is not None:
            self.on_remove(entry)
        freed = 0
        for kind in PageKind:
            slot = entry.slot(kind)
            if slot is not None:
                self.allocator.free(kind, [slot])
                freed += 1
        return freed
