"""Page ids of both kinds from one byte budget (DESIGN.md, SWA invariant 2: no static split).

The budget is cut into equal chunks, each big enough for one page of the larger kind. A chunk is
free or holds pages of a single kind; it goes back to the shared free list when its last page is
freed, so memory flows between full and SWA pages as the workload needs:

    chunk     0            1            2            3
              [F0 F1 F2 ]  [S1      ]   [ free    ]  [F9 -- F11]    (full: 3 slots, SWA: 1 slot)
    page id = chunk * slots_per_chunk(kind) + slot   (meaningful per kind)

No torch here: the sim backend allocates pages without tensors. ``KVPool`` maps ids to memory.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from engine.kv.layout import KVLayout, PageKind
from engine.utils import cdiv

_KINDS = (PageKind.FULL, PageKind.SWA)


class OutOfPages(Exception):
    """The budget has no room for the pages asked for (check ``can_allocate`` first)."""


class PageAllocator:
    """Hands out page ids of both kinds from ``budget_bytes // layout.chunk_bytes`` chunks.

    Allocation is deterministic: partially used chunks of the kind first (lowest chunk, lowest
    slot), then the lowest free chunks. Not thread-safe: one scheduler owns it.
    """

    def __init__(self, layout: KVLayout, budget_bytes: int) -> None:
        self.layout = layout
        self.chunk_bytes = layout.chunk_bytes
        self.num_chunks = budget_bytes // self.chunk_bytes
        if self.num_chunks < 1:
            raise ValueError(
                f"budget_bytes={budget_bytes} holds no chunk of {self.chunk_bytes} bytes"
            )
        self._slots = {k: layout.slots_per_chunk(k) for k in _KINDS}
        self._free_chunks = list(range(self.num_chunks))  # a heap
        self._chunk_kind: list[PageKind | None] = [None] * self.num_chunks
        self._chunk_free_slots: list[set[int]] = [set() for _ in range(self.num_chunks)]
        # chunks of a kind with at least one free slot (a lazily cleaned heap plus the truth)
        self._open: dict[PageKind, set[int]] = {k: set() for k in _KINDS}
        self._open_heap: dict[PageKind, list[int]] = {k: [] for k in _KINDS}
        self._in_heap: dict[PageKind, set[int]] = {k: set() for k in _KINDS}
        self._num_open_slots = {k: 0 for k in _KINDS}
        self._num_used = {k: 0 for k in _KINDS}

    # -- queries ----------------------------------------------------------------------------

    def slots_per_chunk(self, kind: PageKind) -> int:
        return self._slots[kind]

    def num_free_pages(self, kind: PageKind) -> int:
        """Pages of this kind that one ``allocate`` could hand out right now."""
        return self._num_open_slots[kind] + len(self._free_chunks) * self._slots[kind]

    def num_used_pages(self, kind: PageKind) -> int:
        return self._num_used[kind]

    @property
    def num_free_chunks(self) -> int:
        return len(self._free_chunks)

    @property
    def total_bytes(self) -> int:
        return self.num_chunks * self.chunk_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the chunks in use (pages plus slab slack)."""
        return (self.num_chunks - len(self._free_chunks)) * self.chunk_bytes

    @property
    def used_page_bytes(self) -> int:
        """Bytes of the pages in use, without slab slack."""
        return sum(self._num_used[k] * self.layout.page_bytes(k) for k in _KINDS)

    def locate(self, kind: PageKind, page_id: int) -> tuple[int, int]:
        """(chunk, slot) of a page id of this kind."""
        slots = self._slots[kind]
        if not 0 <= page_id < self.num_chunks * slots:
            raise ValueError(
                f"{kind.name} page {page_id} is outside [0, {self.num_chunks * slots})"
            )
        return divmod(page_id, slots)

    def can_allocate(self, num_full: int, num_swa: int) -> bool:
        """Whether ``num_full`` full and ``num_swa`` SWA pages fit together (no side effects)."""
        return self.frees_needed(num_full, num_swa) == 0

    def frees_needed(self, num_full: int, num_swa: int) -> int:
        """A lower bound on the pages to free (one at a time, of any kind) before
        ``can_allocate(num_full, num_swa)`` holds; 0 when it holds now (no side effects).

        NOTE: the chunks missing: a freed page either opens one slot (one fewer chunk needed at
        most) or closes its chunk (one more free chunk, at most one more needed), so each page
        freed lowers this by at most 1 (1 stands in for "never": a kind without slots).
        """
        fresh_chunks = 0
        for kind, n in ((PageKind.FULL, num_full), (PageKind.SWA, num_swa)):
            assert n >= 0, f"asked for {n} {kind.name} pages"
            missing = n - self._num_open_slots[kind]
            if missing > 0:
                if self._slots[kind] == 0:
                    return 1
                fresh_chunks += cdiv(missing, self._slots[kind])
        return max(0, fresh_chunks - len(self._free_chunks))

    # -- mutations --------------------------------------------------------------------------

    def allocate(self, kind: PageKind, n: int) -> list[int]:
        """``n`` page ids of this kind.

        Raises:
            OutOfPages: they do not fit; nothing is allocated.
        """
        counts = (n, 0) if kind == PageKind.FULL else (0, n)
        if not self.can_allocate(*counts):
            raise OutOfPages(
                f"{n} {kind.name} pages asked, {self.num_free_pages(kind)} free "
                f"({len(self._free_chunks)}/{self.num_chunks} chunks free)"
            )
        slots = self._slots[kind]
        out: list[int] = []
        while len(out) < n and (chunk := self._lowest_open(kind)) is not None:
            free = self._chunk_free_slots[chunk]
            taken = sorted(free)[: n - len(out)]
            free.difference_update(taken)
            out.extend(chunk * slots + s for s in taken)
            self._num_open_slots[kind] -= len(taken)
            if not free:
                self._open[kind].discard(chunk)
        # NOTE: then the lowest free chunks, lowest slots first; a chunk taken whole (most of
        # them, and every SWA chunk of one slot) is never marked open
        free_chunks, chunk_kind, heappop = self._free_chunks, self._chunk_kind, heapq.heappop
        whole, rest = divmod(n - len(out), slots) if n > len(out) else (0, 0)
        chunks = [heappop(free_chunks) for _ in range(whole)]
        for chunk in chunks:
            chunk_kind[chunk] = kind
        if slots == 1:
            out += chunks  # NOTE: page id = chunk (a one-slot kind: most SWA layouts)
        else:
            for chunk in chunks:
                out.extend(range(chunk * slots, chunk * slots + slots))
        if rest:
            chunk = heappop(free_chunks)
            chunk_kind[chunk] = kind
            out.extend(range(chunk * slots, chunk * slots + rest))
            self._chunk_free_slots[chunk] = set(range(rest, slots))
            self._num_open_slots[kind] += slots - rest
            self._mark_open(kind, chunk)
        self._num_used[kind] += n
        return out

    def free(self, kind: PageKind, page_ids: Iterable[int]) -> None:
        """Return pages; a chunk whose pages are all free goes back to the shared list.

        Raises:
            ValueError: an id is not in use as a page of this kind (double free, unknown id, or
                repeated in ``page_ids``); nothing is freed.
        """
        located = self._check_in_use(kind, list(page_ids))
        self._num_used[kind] -= len(located)
        for chunk, slot in located:
            self._release(kind, chunk, slot)

    def free_page(self, kind: PageKind, page_id: int) -> None:
        """``free(kind, [page_id])`` without the lists (the cache frees pages one at a time).

        Raises:
            ValueError: the page is not in use as a page of this kind; nothing is freed.
        """
        chunk, slot = self.locate(kind, page_id)
        self._check_page_in_use(kind, page_id, chunk, slot)
        self._num_used[kind] -= 1
        self._release(kind, chunk, slot)

    # -- private ----------------------------------------------------------------------------

    def _check_in_use(self, kind: PageKind, page_ids: list[int]) -> list[tuple[int, int]]:
        located = [self.locate(kind, p) for p in page_ids]
        if len(page_ids) > 1 and len(set(page_ids)) != len(page_ids):
            dup = sorted({p for p in page_ids if page_ids.count(p) > 1})
            raise ValueError(f"{kind.name} pages {dup} appear more than once in one free")
        for page_id, (chunk, slot) in zip(page_ids, located):
            self._check_page_in_use(kind, page_id, chunk, slot)
        return located

    def _check_page_in_use(self, kind: PageKind, page_id: int, chunk: int, slot: int) -> None:
        if self._chunk_kind[chunk] != kind or slot in self._chunk_free_slots[chunk]:
            raise ValueError(f"{kind.name} page {page_id} is not in use (double free?)")

    def _release(self, kind: PageKind, chunk: int, slot: int) -> None:
        """Give one checked page back: its slot opens, or its chunk closes when it was the
        chunk's last page in use."""
        free = self._chunk_free_slots[chunk]
        free.add(slot)
        self._num_open_slots[kind] += 1
        if len(free) == self._slots[kind]:
            self._close_chunk(kind, chunk)
        elif chunk not in self._open[kind]:
            self._mark_open(kind, chunk)

    def _lowest_open(self, kind: PageKind) -> int | None:
        heap, live = self._open_heap[kind], self._open[kind]
        while heap and heap[0] not in live:
            self._in_heap[kind].discard(heapq.heappop(heap))
        return heap[0] if heap else None

    def _mark_open(self, kind: PageKind, chunk: int) -> None:
        self._open[kind].add(chunk)
        if chunk not in self._in_heap[kind]:
            self._in_heap[kind].add(chunk)
            heapq.heappush(self._open_heap[kind], chunk)

    def _close_chunk(self, kind: PageKind, chunk: int) -> None:
        self._open[kind].discard(chunk)  # its heap entry goes stale, dropped lazily
        self._chunk_kind[chunk] = None
        self._chunk_free_slots[chunk] = set()
        self._num_open_slots[kind] -= self._slots[kind]
        heapq.heappush(self._free_chunks, chunk)
