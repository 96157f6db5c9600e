"""Tiers below the device prefix cache: the ``LowerTier`` interface, L2 host memory behind it,
and the window rule across tiers (DESIGN.md invariant 4 and "Tiers", issue 12).

The prefix cache (L1) calls ``store`` when it evicts something a future hit needs (a deleted
leaf's full page, a demoted checkpoint's SWA pages); ``KVManager.admit`` calls ``lookup`` /
``find`` after the L1 match and ``load`` for the pages the usable prefix needs. An L3 tier
(GCache) can chain below L2 behind the same interface.

Window rule across tiers (``engine.kv.layout.usable_pages``): the combined prefix is usable up
to the deepest page end p where full KV (L1 or L2) covers [0, p) and SWA (L1 live, or L2) covers
[p - W, p):

    pages        0    1    2    3    4    5       (k = ceil(W / page) = 2)
    full (L1)    x    x    x    -    -    -       raw L1 match = 3 pages
    full (L2)                   x    x    x
    SWA  (L1)    x    -    -
    SWA  (L2)         x              x    -
    usable?      y    y    n    n    n    n       usable = 2 pages: page 5 has no SWA anywhere,
                                                  pages 2 and 3 neither
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from engine.kv.host_pool import HostEntry, HostPagePool, HostStats
from engine.kv.layerwise import PageCopy
from engine.kv.layout import PageKind
from engine.kv.node import CacheEvent, Node

if TYPE_CHECKING:
    import torch

    from engine.kv.pool import KVPool


MEDIUM = "CPU"  # engine.worker.events.MEDIUM_CPU


class LowerTier(Protocol):
    """A page store below L1, keyed by chained page hash.

    Not thread-safe: the scheduler's thread owns it (as it owns the prefix cache).
    """

    stats: HostStats

    def store(self, node: Node, kinds: Sequence[PageKind]) -> None:
        """Copy these pages of an L1 node down (called right before L1 frees them)."""

    def lookup(
        self, page_hashes: Sequence[int], start: int, token_ids: Sequence[int] | None,
        page_size: int,
    ) -> list[HostEntry]:
        """Entries chained from page ``start`` on (each one's parent is the page before it),
        stopping at the first page missing here or whose tokens differ from ``token_ids``."""
        ...

    def find(
        self, page_hash: int, parent_hash: int | None, token_ids: Sequence[int] | None
    ) -> HostEntry | None:
        """One entry, checked against its parent hash and (when given) its token ids."""
        ...

    def load(self, entry: HostEntry, kind: PageKind, page_id: int) -> None:
        """Copy the entry's page of ``kind`` into the L1 page ``page_id``."""

    def protect(self, page_hashes: Iterable[int]) -> None:
        """Keep these entries while a load that planned on them runs (``unprotect`` ends it)."""

    def unprotect(self) -> None: ...


class HostTier:
    """L2: ``LowerTier`` over a ``HostPagePool``, copying to and from the device ``KVPool``
    (None for the sim backend: the bookkeeping only). ``on_event`` gets KV events with medium
    "CPU" for what enters and leaves host memory."""

    def __init__(
        self, host: HostPagePool, device_pool: KVPool | None,
        on_event: Callable[[CacheEvent], None] | None = None,
    ) -> None:
        self.host, self.device_pool = host, device_pool
        self.stats = host.stats
        self.on_event = on_event
        # NOTE: layer-wise loading: ``load`` records the copies here (the host entries held)
        # for the step's forward to make (``take_loads``), instead of copying at once
        self.defer_loads = False
        self._loads: list[PageCopy] = []
        if on_event is not None:
            host.on_remove = lambda e: on_event(CacheEvent("removed", e.page_hash, medium=MEDIUM))

    def store(self, node: Node, kinds: Sequence[PageKind]) -> None:
        pages = []
        for kind in kinds:
            page_id = node.full_page if kind == PageKind.FULL else node.swa_page
            assert page_id is not None, f"storing the missing {kind.name} page of {node}"
            pages.append((kind, self._device_page(kind, page_id)))
        parent = node.parent.page_hash if node.parent is not None else None
        self.put(node.page_hash, parent, node.token_ids, pages)

    def put(
        self, page_hash: int, parent_hash: int | None, token_ids: tuple[int, ...] | None,
        pages: Sequence[tuple[PageKind, torch.Tensor | None]],
    ) -> HostEntry | None:
        """``HostPagePool.put``, announced: "stored" when the full page came in, "swa_stored"
        when only the SWA page did."""
        before = self.host.get(page_hash)
        had = (None, None) if before is None else (before.full_slot, before.swa_slot)
        entry = self.host.put(page_hash, parent_hash, token_ids, pages)
        if entry is None or self.on_event is None:
            return entry
        if entry.full_slot is not None and (before is not entry or had[0] is None):
            self.on_event(CacheEvent("stored", page_hash, parent_hash, token_ids,
                                     swa=entry.swa_slot is not None, medium=MEDIUM))
        elif entry.swa_slot is not None and had[1] is None:
            self.on_event(CacheEvent("swa_stored", page_hash, medium=MEDIUM))
        return entry

    def lookup(
        self, page_hashes: Sequence[int], start: int, token_ids: Sequence[int] | None,
        page_size: int,
    ) -> list[HostEntry]:
        out: list[HostEntry] = []
        parent = page_hashes[start - 1] if start > 0 else None
        for i in range(start, len(page_hashes)):
            tokens = None if token_ids is None else token_ids[i * page_size : (i + 1) * page_size]
            entry = self.find(page_hashes[i], parent, tokens)
            if entry is None:
                break
            out.append(entry)
            parent = entry.page_hash
        return out

    def find(
        self, page_hash: int, parent_hash: int | None, token_ids: Sequence[int] | None
    ) -> HostEntry | None:
        entry = self.host.get(page_hash)
        if entry is None or entry.parent_hash != parent_hash:
            return None
        # NOTE: a stale page (a hash collision) is a miss, as in L1 when it keeps tokens
        check = token_ids is not None and entry.token_ids is not None
        if check and tuple(token_ids) != entry.token_ids:  # type: ignore[arg-type]
            return None
        return entry

    def load(self, entry: HostEntry, kind: PageKind, page_id: int) -> None:
        if not self.defer_loads or self.device_pool is None:
            self.host.copy_out(entry, kind, self._device_page(kind, page_id))
            return
        slot = entry.slot(kind)
        assert slot is not None, f"host entry {entry.page_hash} holds no {kind.name} page"
        src = self.host.page(kind, slot)
        assert src is not None
        self.host.hold(entry.page_hash)
        self.host.copy_out(entry, kind, None)  # NOTE: the bookkeeping (LRU, counters) only
        self._loads.append(PageCopy(kind, src, page_id))

    def take_loads(self) -> list[PageCopy]:
        """The copies deferred since the last call; ``loads_done`` once they are made."""
        loads, self._loads = self._loads, []
        return loads

    def loads_done(self) -> None:
        """The step's forward made the deferred copies: their host entries may go."""
        self.host.release_held()

    def protect(self, page_hashes: Iterable[int]) -> None:
        self.host.protect(page_hashes)

    def unprotect(self) -> None:
        self.host.unprotect()

    def _device_page(self, kind: PageKind, page_id: int) -> torch.Tensor | None:
        return None if self.device_pool is None else self.device_pool.page(kind, page_id)

