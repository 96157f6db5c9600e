"""The one-budget page allocator (issue 3, "KV memory"; DESIGN.md SWA invariant 2).

The allocator runs against a model that only knows which page ids are held: chunk usage, free
pages and whether a request fits are all derived from that set, not from the allocator's books.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine.kv import KVLayout, OutOfPages, PageAllocator, PageKind
from engine.model_config import ModelConfig
from engine.models.checkpoint import mimo_config
from engine.utils import cdiv

FULL, SWA = PageKind.FULL, PageKind.SWA

# name -> (full layers, full (kv_heads, head_dim, v_head_dim), swa layers, swa dims)
GEOMETRIES = {
    "full-3-slots": (1, (1, 8, 8), 3, (1, 8, 8)),  # chunk = SWA page = 3 full pages
    "full-slack": (2, (1, 8, 8), 3, (1, 8, 8)),  # full page 2/3 of a chunk: 1 slot + slack
    "swa-8-slots": (2, (2, 16, 8), 1, (1, 8, 4)),  # chunk = full page = 8 SWA pages
    "no-swa": (2, (1, 8, 8), 0, (1, 8, 8)),  # SWA pages have 0 bytes: never allocatable
}


# -- allocator units -------------------------------------------------------------------------


def test_model_without_swa_layers_never_gets_swa_pages() -> None:
    cfg = ModelConfig.from_dict(mimo_config(layers="FF", num_key_value_heads=2, head_dim=16))
    layout = KVLayout.from_model(cfg, page_size=4, dtype_bytes=4)
    assert layout.page_bytes(SWA) == 0 and layout.slots_per_chunk(SWA) == 0
    assert layout.page_bytes(FULL) == layout.chunk_bytes == 4 * 2 * 2 * (16 + 16) * 4
    alloc = PageAllocator(layout, budget_bytes=3 * layout.chunk_bytes)
    assert alloc.num_free_pages(SWA) == 0 and alloc.can_allocate(0, 0)
    assert not alloc.can_allocate(0, 1)
    with pytest.raises(OutOfPages):
        alloc.allocate(SWA, 1)
    assert alloc.allocate(FULL, 3) == [0, 1, 2]


def test_allocation_fills_open_chunks_lowest_first() -> None:
    alloc = _make_allocator("full-3-slots", num_chunks=4)  # full: 3 slots, SWA: 1 slot
    assert alloc.allocate(FULL, 2) == [0, 1]  # chunk 0, slots 0-1
    assert alloc.allocate(SWA, 1) == [1]  # chunk 1
    assert alloc.allocate(FULL, 2) == [2, 6]  # chunk 0 slot 2, then chunk 2 slot 0
    alloc.free(FULL, [0])
    assert alloc.allocate(FULL, 1) == [0]
    assert [alloc.locate(FULL, p) for p in (0, 2, 6)] == [(0, 0), (0, 2), (2, 0)]
    _assert_counts(alloc, used_chunks=3, used=(4, 1))


def test_chunk_returns_to_shared_list_and_changes_kind() -> None:
    alloc = _make_allocator("full-3-slots", num_chunks=2)
    full = alloc.allocate(FULL, 6)
    assert not alloc.can_allocate(0, 1), "both chunks hold full pages"
    alloc.free(FULL, full[:2])
    assert not alloc.can_allocate(0, 1), "chunk 0 still holds one full page"
    alloc.free(FULL, full[2:3])
    assert alloc.allocate(SWA, 1) == [0], "freed chunk 0 should now hold an SWA page"
    _assert_counts(alloc, used_chunks=2, used=(3, 1))


@pytest.mark.parametrize(
    ("bad", "why"), [([0, 0], "more than once"), ([5], "not in use"), ([99], "outside")]
)
def test_bad_free_raises_and_changes_nothing(bad: list[int], why: str) -> None:
    alloc = _make_allocator("full-3-slots", num_chunks=4)
    held = alloc.allocate(FULL, 2)  # [0, 1]
    with pytest.raises(ValueError, match=why):
        alloc.free(FULL, [held[1], *bad])
    _assert_counts(alloc, used_chunks=1, used=(2, 0))


def test_double_free_raises() -> None:
    alloc = _make_allocator("swa-8-slots", num_chunks=2)
    pages = alloc.allocate(SWA, 3)
    alloc.free(SWA, pages[:1])
    with pytest.raises(ValueError, match=f"SWA page {pages[0]} is not in use"):
        alloc.free(SWA, pages[:1])
    with pytest.raises(ValueError, match="not in use"):
        alloc.free(FULL, [0])  # page 0 exists only as an SWA page
    _assert_counts(alloc, used_chunks=1, used=(0, 2))


def test_budget_smaller_than_one_chunk_is_rejected() -> None:
    layout = _make_layout("full-3-slots")
    with pytest.raises(ValueError, match="holds no chunk"):
        PageAllocator(layout, budget_bytes=layout.chunk_bytes - 1)


# -- allocator state machine -----------------------------------------------------------------


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free of both kinds against the set of held page ids."""

    @initialize(name=st.sampled_from(sorted(GEOMETRIES)), num_chunks=st.integers(1, 6))
    def setup(self, name: str, num_chunks: int) -> None:
        self.alloc = _make_allocator(name, num_chunks)
        self.slots = {k: self.alloc.layout.slots_per_chunk(k) for k in PageKind}
        self.held: dict[PageKind, set[int]] = {FULL: set(), SWA: set()}
        self.freed: dict[PageKind, set[int]] = {FULL: set(), SWA: set()}

    @rule(kind=st.sampled_from(PageKind), n=st.integers(0, 10))
    def allocate(self, kind: PageKind, n: int) -> None:
        counts = (n, 0) if kind == FULL else (0, n)
        fits, chunks_before = self._oracle_fits(*counts), self._used_chunks()
        assert self.alloc.can_allocate(*counts) == fits, f"can_allocate{counts} != {fits}"
        if not fits:
            with pytest.raises(OutOfPages):
                self.alloc.allocate(kind, n)
            return
        fresh = self._oracle_fresh_chunks(kind, n)
        self._take(kind, self.alloc.allocate(kind, n), n)
        grown = len(self._used_chunks()) - len(chunks_before)
        assert grown == fresh, f"{n} {kind.name} pages opened {grown} chunks, needed {fresh}"

    @rule(num_full=st.integers(0, 8), num_swa=st.integers(0, 8))
    def allocate_both(self, num_full: int, num_swa: int) -> None:
        fits = self.alloc.can_allocate(num_full, num_swa)
        assert fits == self._oracle_fits(num_full, num_swa)
        try:
            full = self.alloc.allocate(FULL, num_full)
        except OutOfPages:
            assert not fits, f"can_allocate({num_full}, {num_swa}) but full allocation failed"
            return
        self._take(FULL, full, num_full)
        try:
            self._take(SWA, self.alloc.allocate(SWA, num_swa), num_swa)
        except OutOfPages:
            assert not fits, f"can_allocate({num_full}, {num_swa}) but SWA allocation failed"
        else:
            assert fits, f"not can_allocate({num_full}, {num_swa}) but both allocations worked"

    @precondition(lambda self: self.held[FULL] or self.held[SWA])
    @rule(data=st.data())
    def free_some(self, data: st.DataObject) -> None:
        kind = data.draw(st.sampled_from([k for k in PageKind if self.held[k]]))
        pages = data.draw(st.lists(st.sampled_from(sorted(self.held[kind])), unique=True))
        self.alloc.free(kind, data.draw(st.permutations(pages)))
        self.held[kind] -= set(pages)
        self.freed[kind] |= set(pages)

    @precondition(lambda self: self.held[FULL] or self.held[SWA])
    @rule(data=st.data(), num_full=st.integers(0, 12), num_swa=st.integers(0, 12))
    def free_pages_one_at_a_time(self, data: st.DataObject, num_full: int, num_swa: int) -> None:
        """``free_page`` page by page; ``frees_needed`` is 0 exactly when the pages fit, and
        each page freed lowers it by at most 1 (the lower bound ``PrefixCache.evict`` uses)."""
        kind = data.draw(st.sampled_from([k for k in PageKind if self.held[k]]))
        pages = data.draw(st.lists(st.sampled_from(sorted(self.held[kind])), unique=True))
        for page in pages:
            before = self.alloc.frees_needed(num_full, num_swa)
            fits = self._oracle_fits(num_full, num_swa)
            assert (before == 0) == fits, f"frees_needed={before}, fits={fits}"
            self.alloc.free_page(kind, page)
            self.held[kind].discard(page)
            self.freed[kind].add(page)
            after = self.alloc.frees_needed(num_full, num_swa)
            assert before - 1 <= after <= before, f"one free moved frees_needed {before} -> {after}"
        assert (self.alloc.frees_needed(num_full, num_swa) == 0) == self._oracle_fits(
            num_full, num_swa)

    @rule(kind=st.sampled_from(PageKind), data=st.data())
    def bad_free_page_changes_nothing(self, kind: PageKind, data: st.DataObject) -> None:
        limit = self.alloc.num_chunks * self.slots[kind]
        bad = data.draw(st.sampled_from([p for p in range(-1, limit + 2)
                                         if p not in self.held[kind]]))
        before = self._snapshot()
        with pytest.raises(ValueError):
            self.alloc.free_page(kind, bad)
        assert self._snapshot() == before, "a rejected free_page changed the allocator"

    @rule(kind=st.sampled_from(PageKind), data=st.data())
    def bad_free_changes_nothing(self, kind: PageKind, data: st.DataObject) -> None:
        limit = self.alloc.num_chunks * self.slots[kind]
        not_held = [p for p in range(limit + 2) if p not in self.held[kind]]
        bad = data.draw(st.sampled_from(not_held))
        good = data.draw(st.lists(st.sampled_from(sorted(self.held[kind]) or [bad]), max_size=3))
        before = self._snapshot()
        with pytest.raises(ValueError):
            self.alloc.free(kind, [*dict.fromkeys(good), bad])
        assert self._snapshot() == before, "a rejected free changed the allocator"

    @rule()
    def free_everything(self) -> None:
        for kind in PageKind:
            self.alloc.free(kind, sorted(self.held[kind]))
            self.freed[kind] |= self.held[kind]
            self.held[kind] = set()
        assert self.alloc.used_bytes == 0 and self.alloc.used_page_bytes == 0
        assert self.alloc.num_free_chunks == self.alloc.num_chunks
        for kind in PageKind:
            want = self.alloc.num_chunks * self.slots[kind]
            assert self.alloc.num_free_pages(kind) == want, f"{kind.name} free pages after reset"

    @invariant()
    def books_agree_with_held_pages(self) -> None:
        alloc, chunks = self.alloc, self._used_chunks()
        assert alloc.used_bytes <= alloc.total_bytes
        assert alloc.used_bytes == len(chunks) * alloc.chunk_bytes, (
            f"used_bytes={alloc.used_bytes}, held pages span chunks {sorted(chunks)}"
        )
        page_bytes = sum(len(self.held[k]) * alloc.layout.page_bytes(k) for k in PageKind)
        assert alloc.used_page_bytes == page_bytes <= alloc.used_bytes
        for kind in PageKind:
            assert alloc.num_used_pages(kind) == len(self.held[kind])
            want = self._oracle_open_slots(kind) + self._oracle_free_chunks() * self.slots[kind]
            got = alloc.num_free_pages(kind)
            assert got == want, f"num_free_pages({kind.name}) = {got}, held pages say {want}"

    def teardown(self) -> None:
        if hasattr(self, "alloc"):
            self.free_everything()

    # -- the model ---------------------------------------------------------------------------

    def _take(self, kind: PageKind, pages: list[int], n: int) -> None:
        limit = self.alloc.num_chunks * self.slots[kind]
        assert len(pages) == len(set(pages)) == n, f"asked {n} {kind.name} pages, got {pages}"
        assert all(0 <= p < limit for p in pages), f"{pages} outside [0, {limit})"
        twice = set(pages) & self.held[kind]
        assert not twice, f"{kind.name} pages {sorted(twice)} handed out twice"
        self.held[kind] |= set(pages)

    def _chunks_of(self, kind: PageKind) -> set[int]:
        return {p // self.slots[kind] for p in self.held[kind]}

    def _used_chunks(self) -> set[int]:
        full, swa = self._chunks_of(FULL), self._chunks_of(SWA)
        assert not full & swa, f"chunks {sorted(full & swa)} hold pages of both kinds"
        return full | swa

    def _oracle_free_chunks(self) -> int:
        return self.alloc.num_chunks - len(self._used_chunks())

    def _oracle_open_slots(self, kind: PageKind) -> int:
        return len(self._chunks_of(kind)) * self.slots[kind] - len(self.held[kind])

    def _oracle_fresh_chunks(self, kind: PageKind, n: int) -> int:
        missing = max(0, n - self._oracle_open_slots(kind))
        if missing and not self.slots[kind]:
            return self.alloc.num_chunks + 1  # never fits
        return cdiv(missing, self.slots[kind]) if missing else 0

    def _oracle_fits(self, num_full: int, num_swa: int) -> bool:
        fresh = self._oracle_fresh_chunks(FULL, num_full) + self._oracle_fresh_chunks(SWA, num_swa)
        return fresh <= self._oracle_free_chunks()

    def _snapshot(self) -> tuple[object, ...]:
        a = self.alloc
        per_kind = [(a.num_used_pages(k), a.num_free_pages(k)) for k in PageKind]
        return (a.used_bytes, a.used_page_bytes, *per_kind)


AllocatorMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocatorMachine = AllocatorMachine.TestCase


# -- builders and helpers --------------------------------------------------------------------


def _make_layout(name: str) -> KVLayout:
    full_layers, full_dims, swa_layers, swa_dims = GEOMETRIES[name]
    return KVLayout(
        page_size=4,
        dtype_bytes=2,
        full_layer_ids=tuple(range(full_layers)),
        swa_layer_ids=tuple(range(full_layers, full_layers + swa_layers)),
        full_head_dims=full_dims,
        swa_head_dims=swa_dims,
        window=8,
    )


def _make_allocator(name: str, num_chunks: int) -> PageAllocator:
    layout = _make_layout(name)
    # a budget that is not a multiple of the chunk size: the remainder is never handed out
    alloc = PageAllocator(layout, budget_bytes=num_chunks * layout.chunk_bytes + 7)
    assert alloc.num_chunks == num_chunks and alloc.total_bytes == num_chunks * layout.chunk_bytes
    return alloc


def _assert_counts(alloc: PageAllocator, used_chunks: int, used: tuple[int, int]) -> None:
    got = (
        alloc.used_bytes // alloc.chunk_bytes,
        (alloc.num_used_pages(FULL), alloc.num_used_pages(SWA)),
    )
    assert got == (used_chunks, used), (
        f"(chunks, (full, swa) pages) = {got}, want {(used_chunks, used)}"
    )
