"""SWA-aware prefix cache: invariants under random use (hypothesis) and the retention policy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from engine.kv.allocator import PageAllocator
from engine.kv.layout import KVLayout, PageKind
from engine.kv.prefix_cache import CacheEvent, Node, PrefixCache

PAGE = 4


def _make_cache(window: int, num_chunks: int, enabled: bool = True, clock=None) -> PrefixCache:
    # one full layer (1 head, dims 2+2) and one SWA layer (2 heads): an SWA page is twice a full
    # page, so a chunk holds 2 full pages or 1 SWA page
    layout = KVLayout(page_size=PAGE, dtype_bytes=1, full_layer_ids=(0,), swa_layer_ids=(1,),
                      full_head_dims=(1, 2, 2), swa_head_dims=(2, 2, 2), window=window)
    alloc = PageAllocator(layout, num_chunks * layout.chunk_bytes)
    events: list[CacheEvent] = []
    kwargs = {"clock": clock} if clock else {}
    cache = PrefixCache(alloc, enabled=enabled, on_event=events.append, **kwargs)
    cache.events = events  # type: ignore[attr-defined]
    return cache


def _hashes(tokens: Sequence[int]) -> list[int]:
    out, prev = [], 0
    for i in range(len(tokens) // PAGE):
        prev = hash((prev, tuple(tokens[i * PAGE : (i + 1) * PAGE]))) & (2**63 - 1)
        out.append(prev)
    return out


@dataclass
class _Running:
    """A request as the engine drives the cache: pinned deepest node + pinned SWA window."""

    hashes: list[int]
    path: list[Node] = field(default_factory=list)
    swa_pinned: list[Node] = field(default_factory=list)


class _Driver:
    """The engine-side protocol: match, pin, compute pages (allocating), slide the window."""

    def __init__(self, cache: PrefixCache, memory: dict[tuple[PageKind, int], int]) -> None:
        self.cache, self.memory = cache, memory

    def start(self, tokens: Sequence[int]) -> _Running:
        req = _Running(_hashes(tokens))
        m = self.cache.match(req.hashes, max_tokens=len(tokens) - 1)
        req.path = list(m.nodes)
        if req.path:
            self.cache.pin(req.path[-1], full=True, swa=False)
            for n in req.path[-self.cache.window_pages :]:
                self.cache.pin(n, full=False, swa=True)
                req.swa_pinned.append(n)
        return req

    def compute(self, req: _Running, num_pages: int) -> int:
        """Compute up to num_pages more pages; returns how many fit in memory."""
        done = 0
        while done < num_pages and len(req.path) < len(req.hashes):
            if not self.cache.evict(1, 1):
                break
            full = self.cache.allocator.allocate(PageKind.FULL, 1)[0]
            swa = self.cache.allocator.allocate(PageKind.SWA, 1)[0]
            h = req.hashes[len(req.path)]
            self.memory[(PageKind.FULL, full)] = self.memory[(PageKind.SWA, swa)] = h
            parent = req.path[-1] if req.path else None
            node = self.cache.insert(parent, h, full, swa)
            if parent is not None:
                self.cache.unpin(parent, full=True, swa=False)
            req.path.append(node)
            req.swa_pinned.append(node)
            while len(req.swa_pinned) > self.cache.window_pages:
                self.cache.unpin(req.swa_pinned.pop(0), full=False, swa=True)
            done += 1
        return done

    def finish(self, req: _Running, checkpoint: bool) -> None:
        if checkpoint and req.path:
            self.cache.mark_checkpoint(req.path[-1])
        for n in req.swa_pinned:
            self.cache.unpin(n, full=False, swa=True)
        if req.path:
            self.cache.unpin(req.path[-1], full=True, swa=False)
        req.swa_pinned, req.path = [], []


def _oracle_match(cache: PrefixCache, hashes: list[int], max_tokens: int) -> tuple[int, int]:
    """Brute force over the live nodes: (raw, usable) tokens."""
    live = {n.page_hash: n.swa_page is not None for n in cache.nodes()}
    k, raw = cache.window_pages, 0
    for h in hashes[: max_tokens // PAGE]:
        if h not in live:
            break
        raw += 1
    usable = 0
    for p in range(1, raw + 1):
        if all(live[hashes[i]] for i in range(max(0, p - k), p)):
            usable = p
    return raw * PAGE, usable * PAGE


# token streams over a tiny alphabet share prefixes often
_tokens = st.lists(st.integers(0, 2), min_size=1, max_size=9).map(
    lambda pages: [t for p in pages for t in [p, 0, 0, 1]] + [7]
)


class PrefixCacheMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.cache: PrefixCache | None = None
        self.memory: dict[tuple[PageKind, int], int] = {}
        self.running: list[_Running] = []
        self.ends: list[Node] = []  # finished requests' end checkpoints (Retain targets)
        self.expired = 0

    @precondition(lambda self: self.cache is None)
    @rule(window=st.sampled_from([1, 4, 6, 8]), chunks=st.integers(4, 24))
    def setup(self, window: int, chunks: int) -> None:
        self.cache = _make_cache(window, chunks, clock=lambda: self.now)
        self.driver = _Driver(self.cache, self.memory)

    @precondition(lambda self: self.cache is not None)
    @rule(target=requests, tokens=_tokens, pages=st.integers(0, 10))
    def start(self, tokens: list[int], pages: int) -> _Running:
        req = self.driver.start(tokens)
        self.driver.compute(req, pages)
        self.running.append(req)
        return req

    @precondition(lambda self: self.cache is not None)
    @rule(req=requests, pages=st.integers(1, 4))
    def compute_more(self, req: _Running, pages: int) -> None:
        if req in self.running:
            self.driver.compute(req, pages)

    @precondition(lambda self: self.cache is not None)
    @rule(req=requests, checkpoint=st.booleans(), ttl=st.none() | st.floats(1, 100))
    def finish(self, req: _Running, checkpoint: bool, ttl: float | None) -> None:
        if req not in self.running:
            return
        if checkpoint and ttl is not None and req.path:
            self.cache.mark_checkpoint(req.path[-1], retain_ttl_s=ttl)
        if checkpoint and req.path:
            self.ends.append(req.path[-1])
        self.driver.finish(req, checkpoint)
        self.running.remove(req)

    @precondition(lambda self: self.cache is not None and self.ends)
    @rule(data=st.data(), ttl=st.sampled_from([0.0, 1.0, 30.0, 500.0]))
    def retain(self, data: st.DataObject, ttl: float) -> None:
        """A Retain (issue 9) on a finished request's end: TTL from now, 0 releases."""
        node = data.draw(st.sampled_from(self.ends))
        window_live = node.alive and all(
            a.swa_page is not None for a in node.ancestors(self.cache.window_pages))
        expected = node.alive and (node.is_ckpt_end if ttl == 0 else window_live)
        assert self.cache.retain(node, ttl) == expected, (node, ttl)
        if expected and ttl > 0:
            assert node.is_ckpt_end and node in self.cache.retentions, node
        if expected:
            assert node.retain_until == (self.now + ttl if ttl else 0.0), node

    @precondition(lambda self: self.cache is not None and self.cache.window < PAGE)
    @rule(req=requests)
    def decode_into_partial_page(self, req: _Running) -> None:
        """The engine's decode once the window (W < page) lies inside the partial page it holds
        apart: the last full page stays pinned for its full KV, its SWA becomes history."""
        if req in self.running:
            for n in req.swa_pinned:
                self.cache.unpin(n, full=False, swa=True)
            req.swa_pinned = []

    @precondition(lambda self: self.cache is not None)
    @rule(req=requests, depth=st.integers(0, 9))
    def mark_periodic(self, req: _Running, depth: int) -> None:
        """A periodic checkpoint (issue 9) on a running request's page: dropped first."""
        if req in self.running and depth < len(req.path):
            self.cache.mark_checkpoint(req.path[depth], periodic=True)

    @precondition(lambda self: self.cache is not None)
    @rule(num_full=st.integers(0, 6), num_swa=st.integers(0, 6))
    def evict(self, num_full: int, num_swa: int) -> None:
        ok = self.cache.evict(num_full, num_swa)
        assert ok == self.cache.allocator.can_allocate(num_full, num_swa)

    @precondition(lambda self: self.cache is not None)
    @rule(dt=st.floats(0, 60))
    def advance_clock(self, dt: float) -> None:
        self.now += dt

    @precondition(lambda self: self.cache is not None)
    @rule(tokens=_tokens)
    def match_agrees_with_oracle(self, tokens: list[int]) -> None:
        hashes = _hashes(tokens)
        expected_raw, expected_usable = _oracle_match(self.cache, hashes, len(tokens) - 1)
        m = self.cache.match(hashes, max_tokens=len(tokens) - 1)
        assert (m.raw_tokens, m.usable_tokens) == (expected_raw, expected_usable), (
            f"match gave raw={m.raw_tokens} usable={m.usable_tokens}, oracle "
            f"raw={expected_raw} usable={expected_usable} (W={self.cache.window})"
        )
        assert [n.page_hash for n in m.nodes] == hashes[: len(m.nodes)]

    @precondition(lambda self: self.cache is not None and not self.running)
    @rule()
    def flush_frees_everything(self) -> None:
        self.cache.flush()
        alloc = self.cache.allocator
        assert self.cache.num_nodes == 0
        assert alloc.used_bytes == 0, f"leak: {alloc.num_used_pages(PageKind.FULL)} full, " \
            f"{alloc.num_used_pages(PageKind.SWA)} SWA pages still used after flush"

    @invariant()
    def pages_hold_what_the_tree_says(self) -> None:
        """No use of a freed page: every live page still holds the content written for it."""
        if self.cache is None:
            return
        for n in self.cache.nodes():
            assert self.memory.get((PageKind.FULL, n.full_page)) == n.page_hash, n
            if n.swa_page is not None:
                assert self.memory.get((PageKind.SWA, n.swa_page)) == n.page_hash, n

    @invariant()
    def no_leak(self) -> None:
        if self.cache is None:
            return
        nodes = self.cache.nodes()
        alloc = self.cache.allocator
        assert alloc.num_used_pages(PageKind.FULL) == len(nodes)
        assert alloc.num_used_pages(PageKind.SWA) == sum(n.swa_page is not None for n in nodes)

    @invariant()
    def pinned_pages_stay(self) -> None:
        for req in self.running:
            for n in req.path:
                assert n.alive, f"a running request's page was freed: {n}"
            for n in req.swa_pinned:
                assert n.swa_page is not None, f"a running request's SWA page was freed: {n}"

    @invariant()
    def retention_bookkeeping(self) -> None:
        """Tracked retentions are live checkpoints; expiries only grow; the retained pages are
        pages the cache really holds."""
        if self.cache is None:
            return
        for n in self.cache.retentions:
            assert n.alive and n.is_ckpt_end, f"tracking a dropped checkpoint: {n}"
        held = self.cache.retained_pages()
        assert 0 <= held <= self.cache.allocator.num_used_pages(PageKind.FULL) + \
            self.cache.allocator.num_used_pages(PageKind.SWA), held
        for n in self.cache.retentions:
            assert n.retain_until > self.now, f"an expired retention still tracked: {n}"
        assert self.cache.retains_expired >= self.expired
        self.expired = self.cache.retains_expired

    @invariant()
    def no_unpinned_tombstone_leaf(self) -> None:
        """A leaf without SWA gives no hit (no window ends at it, nothing below it): keeping it
        only holds full pages that live checkpoints could use."""
        if self.cache is None:
            return
        for n in self.cache.nodes():
            assert not (n.swa_page is None and n.num_children == 0 and n.full_refs == 0
                        and n.swa_refs == 0), f"useless tombstone leaf kept: {n}"

    @invariant()
    def checkpoints_have_live_windows(self) -> None:
        if self.cache is None:
            return
        for n in self.cache.nodes():
            if n.is_ckpt_end:
                window = list(n.ancestors(self.cache.window_pages))
                assert all(a.swa_page is not None for a in window), f"broken checkpoint at {n}"


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase


# ------------------------------------------------------------------ the retention policy


def _run(cache: PrefixCache, tokens: list[int], checkpoint: bool = True) -> _Running:
    driver = _Driver(cache, {})
    req = driver.start(tokens)
    assert driver.compute(req, len(tokens)) >= 0
    driver.finish(req, checkpoint)
    return req


def _seq(first: int, pages: int) -> list[int]:
    return [first * 100 + i for i in range(pages * PAGE)] + [1]


def test_history_swa_goes_before_checkpoints_and_full_kv() -> None:
    cache = _make_cache(window=4, num_chunks=64)
    _run(cache, _seq(1, 6))  # 6 pages; the checkpoint pins the last one's SWA (k = 1)
    nodes = {n.depth: n for n in cache.nodes()}
    used = cache.allocator.num_used_pages
    assert used(PageKind.SWA) == 6 and used(PageKind.FULL) == 6  # plenty: all history kept
    assert cache.match(_hashes(_seq(1, 6)), max_tokens=3 * PAGE).usable_tokens == 3 * PAGE
    for _ in range(5):
        assert cache._evict_one()
    assert [d for d, n in sorted(nodes.items()) if n.swa_page is not None] == [5]
    assert used(PageKind.FULL) == 6, "full KV must outlive SWA history"
    # a mid-sequence hit is now cut by the window, the checkpoint still hits
    m = cache.match(_hashes(_seq(1, 6)), max_tokens=3 * PAGE)
    assert (m.raw_tokens, m.usable_tokens) == (3 * PAGE, 0)
    full = cache.match(_hashes(_seq(1, 6)), max_tokens=6 * PAGE + 1)
    assert full.usable_tokens == 6 * PAGE
    assert cache.stats.cut_tokens == 3 * PAGE


def test_retained_checkpoint_survives_pressure_until_its_ttl() -> None:
    now = [0.0]
    cache = _make_cache(window=4, num_chunks=64, clock=lambda: now[0])
    old, kept = _run(cache, _seq(1, 2)), _run(cache, _seq(2, 2), checkpoint=False)
    cache.mark_checkpoint(cache.lookup(kept.hashes[-1]), retain_ttl_s=30)
    del old
    while cache._evict_one():
        pass
    assert {n.depth for n in cache.nodes()} == {0, 1}, "only the retained branch stays"
    assert cache.match(kept.hashes, max_tokens=2 * PAGE + 1).usable_tokens == 2 * PAGE
    now[0] = 31.0
    assert cache._evict_one() and cache.match(kept.hashes, 2 * PAGE + 1).usable_tokens < 2 * PAGE


def test_cache_off_keeps_nothing() -> None:
    cache = _make_cache(window=4, num_chunks=16, enabled=False)
    req = _run(cache, _seq(1, 4))
    assert cache.allocator.used_bytes == 0
    assert cache.match(req.hashes, max_tokens=100).raw_tokens == 0
    assert cache.events == []


def test_events_announce_pages_and_checkpoints() -> None:
    cache = _make_cache(window=8, num_chunks=64)
    req = _run(cache, _seq(1, 3))
    kinds = [e.kind for e in cache.events]
    assert kinds == ["stored", "stored", "stored", "ckpt_stored"]
    assert cache.events[1].parent_hash == req.hashes[0]
    assert cache.events[-1].page_hash == req.hashes[-1]
    cache.flush()
    kinds = [e.kind for e in cache.events[4:]]
    assert "ckpt_dropped" in kinds and kinds.count("removed") == 3 and kinds[-1] == "cleared"


def test_flush_under_a_running_request_announces_each_removal_not_a_clear() -> None:
    """Pages a running request pins stay through a flush: an ``AllBlocksCleared`` would make a
    router's index forget pages the worker still holds, so only the removals are announced."""
    cache = _make_cache(window=8, num_chunks=64)
    _run(cache, _seq(1, 3))  # finished: cached and unpinned
    driver = _Driver(cache, {})
    tokens = _seq(2, 3)
    running = driver.start(tokens)
    assert driver.compute(running, len(tokens)) >= 0  # computed, still running: pinned
    first = len(cache.events)
    cache.flush()
    kinds = [e.kind for e in cache.events[first:]]
    assert "cleared" not in kinds and kinds.count("removed") == 3, kinds
    announced = {e.page_hash for e in cache.events if e.kind == "stored"}
    announced -= {e.page_hash for e in cache.events if e.kind == "removed"}
    assert announced == {n.page_hash for n in cache.nodes()} != set()


@pytest.mark.parametrize("window", [1, 4, 5, 8])
def test_window_safe_boundary(window: int) -> None:
    """Usable needs live SWA for exactly the ceil(W / page) pages before the resume point."""
    cache = _make_cache(window=window, num_chunks=64)
    req = _run(cache, _seq(3, 5), checkpoint=False)
    k = cache.window_pages
    nodes = sorted(cache.nodes(), key=lambda n: n.depth)
    victim = nodes[2]  # tombstone page 2: resume points 3 .. 2 + k lose their window
    cache.allocator.free(PageKind.SWA, [victim.swa_page])
    victim.swa_page = None
    for end in range(1, 6):
        m = cache.match(req.hashes, max_tokens=end * PAGE)
        window_hits_page_2 = 3 <= end <= 2 + k  # resume point `end` needs pages end-k .. end-1
        if window_hits_page_2:
            assert m.usable_tokens < end * PAGE, f"end={end}, k={k}: usable {m.usable_tokens}"
            assert m.raw_tokens == end * PAGE
        else:
            assert m.usable_tokens == end * PAGE, f"end={end}, k={k}: usable {m.usable_tokens}"


def test_retention_gives_way_before_a_request_would_fail() -> None:
    """A TTL hint protects against ordinary pressure, not to the point of failing a request."""
    cache = _make_cache(window=4, num_chunks=6, clock=lambda: 0.0)
    kept = _run(cache, _seq(1, 3), checkpoint=False)
    cache.mark_checkpoint(cache.lookup(kept.hashes[-1]), retain_ttl_s=1000)
    other = _run(cache, _seq(2, 1))
    assert cache.lookup(other.hashes[0]) is not None
    assert cache.evict(0, 4), "all 6 chunks are evictable, so 4 SWA pages must be obtainable"
    assert cache.lookup(other.hashes[0]) is None, "unretained pages go first"
    assert cache.allocator.can_allocate(0, 4)


def test_a_finished_request_whose_last_window_was_dropped_leaves_no_dead_pages() -> None:
    """Decode past a page end with W < page: the last full page's SWA is history while the
    request runs, pressure drops it, and the finish can mark no checkpoint there. That page (and
    the tombstones above it) give no hit any more, so they go at once, not by LRU after live
    checkpoints (the replay found ~9 % of a worker's full pages held this way)."""
    cache = _make_cache(window=1, num_chunks=64)  # k = 1
    driver = _Driver(cache, {})
    kept = _run(cache, _seq(1, 2))  # another request's checkpoint: must stay
    req = driver.start(_seq(2, 3))
    driver.compute(req, 3)
    for n in req.swa_pinned:  # the window moved into the partial page
        cache.unpin(n, full=False, swa=True)
    req.swa_pinned = []
    assert cache.drop_history() == 3 + 1  # req's three pages and kept's first one
    assert all(n.swa_page is None for n in req.path)
    used_before, path = cache.allocator.num_used_pages(PageKind.FULL), list(req.path)
    driver.finish(req, checkpoint=True)  # no window at the end: no checkpoint
    assert all(not n.alive for n in path), "dead full pages kept"
    assert cache.allocator.num_used_pages(PageKind.FULL) == used_before - 3
    removed = [e.page_hash for e in cache.events if e.kind == "removed"]
    assert sorted(removed) == sorted(n.page_hash for n in path), "each removal announced"
    m = cache.match(kept.hashes, max_tokens=2 * PAGE + 1)
    assert m.usable_tokens == 2 * PAGE, "the other request's checkpoint is untouched"


def test_without_swa_layers_eviction_takes_one_page_at_a_time() -> None:
    """A model with full attention only has no tombstones: every cached page is a resume point,
    so evicting a leaf must leave its parent (the whole unshared chain went at once before)."""
    layout = KVLayout(page_size=PAGE, dtype_bytes=1, full_layer_ids=(0,), swa_layer_ids=(),
                      full_head_dims=(1, 2, 2), swa_head_dims=(2, 2, 2), window=PAGE)
    cache = PrefixCache(PageAllocator(layout, 64 * layout.chunk_bytes))
    assert not cache.has_swa
    hashes, path = _hashes(_seq(1, 5)), []
    for h in hashes:
        parent = path[-1] if path else None
        path.append(cache.insert(parent, h, cache.allocator.allocate(PageKind.FULL, 1)[0], None))
        if parent is not None:
            cache.unpin(parent, full=True, swa=False)
    cache.unpin(path[-1], full=True, swa=False)
    assert cache.match(hashes, max_tokens=100).usable_tokens == 5 * PAGE
    for left in (4, 3):
        assert cache._evict_one()
        assert cache.num_nodes == left
        assert cache.match(hashes, max_tokens=100).usable_tokens == left * PAGE


def test_hits_without_pressure_keep_the_eviction_heaps_bounded() -> None:
    """Every hit re-keys its pages in the lazy eviction heaps (old entries go stale); with no
    memory pressure nothing pops them, so a heap is compacted once it doubles past the cached
    pages: 2,000 hits on one checkpointed prefix leave each heap within that bound, and the
    checkpoint is still demotable (its entry survived the compactions)."""
    from engine.kv.prefix_cache import HEAP_SLACK

    cache = _make_cache(window=8, num_chunks=64)
    driver = _Driver(cache, {})
    tokens = list(range(6 * PAGE))
    first = driver.start(tokens)
    driver.compute(first, 6)
    driver.finish(first, checkpoint=True)
    for _ in range(2000):
        req = driver.start(tokens)
        assert len(req.path) == 5  # NOTE: the last token is always recomputed
        driver.finish(req, checkpoint=False)
    bound = 2 * len(cache._index) + HEAP_SLACK  # noqa: SLF001
    for heap in (cache._swa_heap, cache._leaf_heap, cache._ckpt_heap):  # noqa: SLF001
        assert len(heap) <= bound, (len(heap), bound)
    assert cache.evict(64, 32), "everything unpinned must be evictable"
    assert cache.stats.dropped_checkpoints >= 1


# -- insert_chain: one call for a run of pages, the same as page by page ---------------------


@settings(max_examples=200, deadline=None)
@given(
    window=st.sampled_from([1, 4, 8]),
    enabled=st.booleans(),
    cached=_tokens,
    tokens=_tokens,
    start=st.integers(0, 9),
    drop_history=st.booleans(),
)
def test_insert_chain_equals_page_by_page(window: int, enabled: bool, cached: list[int],
                                          tokens: list[int], start: int,
                                          drop_history: bool) -> None:
    """``insert_chain`` leaves the same tree, pins, LRU heaps, allocator and events as
    ``insert`` + ``unpin(previous, full)`` page by page, over hits (deduplicated pages),
    revived tombstones and a pinned parent; the eviction that follows goes the same way."""
    caches = [_make_cache(window, 64, enabled=enabled) for _ in range(2)]
    for cache in caches:
        _cache_chain(cache, _hashes(cached), drop_history)
    hashes, cached_hashes = _hashes(tokens), _hashes(cached)
    shared = next((i for i, (a, b) in enumerate(zip(hashes, cached_hashes)) if a != b),
                  min(len(hashes), len(cached_hashes)))
    start = min(start, shared)  # NOTE: the chain goes on from a cached page (or the root)
    by_page, chained = caches
    nodes = []
    for cache in caches:
        parent = _pinned_parent(cache, hashes[:start])
        n = len(hashes) - start
        full = cache.allocator.allocate(PageKind.FULL, n)
        swa = cache.allocator.allocate(PageKind.SWA, n)
        pages = [tuple(tokens[i * PAGE : (i + 1) * PAGE]) for i in range(start, len(hashes))]
        if cache is chained:
            nodes.append(cache.insert_chain(parent, hashes[start:], full, swa, pages))
            continue
        out, prev = [], parent
        for h, f, s, t in zip(hashes[start:], full, swa, pages):
            node = cache.insert(prev, h, f, s, t)
            if prev is not None:
                cache.unpin(prev, full=True, swa=False)
            out.append(node)
            prev = node
        nodes.append(out)
    _assert_same_caches(by_page, chained, nodes[0], nodes[1])
    for cache, path in zip(caches, nodes):
        for node in path:
            cache.unpin(node, full=node is path[-1], swa=True)
        cache.evict(64, 64)
    _assert_same_caches(by_page, chained, [], [])


def _cache_chain(cache: PrefixCache, hashes: list[int], drop_history: bool) -> None:
    """Compute and release a request's pages (its end a checkpoint), then maybe tombstone the
    history SWA."""
    driver = _Driver(cache, {})
    req = _Running(hashes)
    driver.compute(req, len(hashes))
    driver.finish(req, checkpoint=True)
    if drop_history:
        cache.drop_history()


def _pinned_parent(cache: PrefixCache, prefix: list[int]) -> Node | None:
    """The cached node at the end of ``prefix``, pinned (full) as a request's deepest page."""
    if not prefix:
        return None
    node = cache.lookup(prefix[-1]) if cache.enabled else None
    if node is None:  # NOTE: the cache off keeps nothing: a fresh chain stands in for it
        for h in prefix:
            page = cache.allocator.allocate(PageKind.FULL, 1)[0]
            parent, node = node, cache.insert(node, h, page, None)
            if parent is not None:
                cache.unpin(parent, full=True, swa=False)
        return node
    assert [n.page_hash for n in node.ancestors(node.depth + 1)][::-1] == prefix
    cache.pin(node, full=True, swa=False)
    return node


def _node_state(n: Node) -> tuple[object, ...]:
    return (n.page_hash, n.depth, n.full_page, n.swa_page, n.num_children, n.token_ids,
            n.full_refs, n.swa_refs, n.ckpt_refs, n.is_ckpt_end, n.access, n.swa_access, n.alive)


def _assert_same_caches(a: PrefixCache, b: PrefixCache, nodes_a: list[Node],
                        nodes_b: list[Node]) -> None:
    assert [_node_state(n) for n in nodes_a] == [_node_state(n) for n in nodes_b]
    assert a.events == b.events, "events differ"  # type: ignore[attr-defined]
    state_a = sorted(_node_state(n) for n in a.nodes())
    assert state_a == sorted(_node_state(n) for n in b.nodes()), "trees differ"
    for kind in PageKind:
        assert a.allocator.num_free_pages(kind) == b.allocator.num_free_pages(kind), kind
    for heap in ("_swa_heap", "_leaf_heap", "_ckpt_heap"):
        assert _live_entries(a, heap) == _live_entries(b, heap), f"{heap}: live entries differ"


def _live_entries(cache: PrefixCache, name: str) -> list[tuple[int, int]]:
    heap = getattr(cache, name)
    return sorted({(e[0], e[2].page_hash) for e in heap if heap.is_live(e)})


# -- unpin_swa and evict: batched, the same as one page at a time ------------------------------


@settings(max_examples=200, deadline=None)
@given(
    window=st.sampled_from([1, 4, 8]),
    enabled=st.booleans(),
    cached=st.lists(_tokens, max_size=4),
    tokens=_tokens,
    slide=st.integers(0, 9),
    num_full=st.integers(0, 24),
    num_swa=st.integers(0, 24),
)
def test_unpin_swa_and_evict_equal_one_page_at_a_time(
    window: int, enabled: bool, cached: list[list[int]], tokens: list[int], slide: int,
    num_full: int, num_swa: int,
) -> None:
    """``unpin_swa`` (a request's window sliding past its pages) leaves the same cache as
    ``unpin(node, swa=True)`` node by node; ``evict``, which drops history SWA many pages at
    a time, frees the same pages, in the same order (events), as ``_evict_one`` until the
    allocator can hand the pages out, cascades into tombstone leaves included."""
    caches = [_make_cache(window, 24, enabled=enabled) for _ in range(2)]
    one_by_one, batched = caches
    paths = []
    for cache in caches:
        for other in cached:
            _cache_chain(cache, _hashes(other), drop_history=False)
        hashes = _hashes(tokens)
        n = len(hashes)
        while not cache.allocator.can_allocate(n, n):
            n -= 1
        full = cache.allocator.allocate(PageKind.FULL, n)
        swa = cache.allocator.allocate(PageKind.SWA, n)
        pages = [tuple(tokens[i * PAGE : (i + 1) * PAGE]) for i in range(n)]
        nodes = cache.insert_chain(None, hashes[:n], full, swa, pages)
        out = nodes[: min(slide, len(nodes))]
        if cache is batched:
            cache.unpin_swa(out)
        else:
            for node in out:
                cache.unpin(node, full=False, swa=True)
        paths.append(nodes)
    _assert_same_caches(one_by_one, batched, paths[0], paths[1])
    assert batched.evict(num_full, num_swa) == _evict_one_at_a_time(one_by_one, num_full,
                                                                     num_swa)
    _assert_same_caches(one_by_one, batched, paths[0], paths[1])
    for cache, path in zip(caches, paths):
        if path:
            cache.unpin_swa(path[min(slide, len(path)):])
            cache.unpin(path[-1], full=True, swa=False)
    assert batched.evict(64, 64) == _evict_one_at_a_time(one_by_one, 64, 64)
    _assert_same_caches(one_by_one, batched, [], [])


def _evict_one_at_a_time(cache: PrefixCache, num_full: int, num_swa: int) -> bool:
    """``PrefixCache.evict`` as its definition says: one page (or checkpoint) at a time."""
    while not cache.allocator.can_allocate(num_full, num_swa):
        if not cache._evict_one() and not cache._evict_one(ignore_retention=True):
            return False
    return True
