"""SWA-aware prefix cache: a radix tree of pages, keyed by chained page hashes.

Every cached page keeps its full-attention KV. Its SWA KV may be dropped ("tombstone") while the
full KV stays: SWA is only needed for the W tokens before a point where a later request resumes.

Window-safe match (DESIGN.md invariant 4): a cached prefix is usable up to the deepest page end
p where full KV covers [0, p) and live SWA covers [p - W, p):

    pages     0    1    2    3    4    5    6        (page = 4 tokens, W = 8 -> k = 2 pages)
    full      x    x    x    x    x    x    x        raw match = 7 pages
    SWA       x    -    -    x    x    -    x
    usable?   y    n    n    n    y    n    n        usable = 5 pages (20 tokens), cut = 8

Retention (DESIGN.md invariant 3) is adaptive. SWA pages are "history" unless they belong to a
checkpoint (the k = ceil(W / page) pages before a marked resume point: a prompt end, an output end,
an observed branch point, or a periodic point every ``checkpoint_interval_tokens`` along a new
prompt). Eviction frees, in order: history SWA (LRU), then the least recently used of
{checkpoint demotion, leaf deletion}, where periodic and resume-point checkpoints share one LRU;
retained checkpoints (TTL hints) go last. So while memory is plentiful every page keeps its SWA and
hits land anywhere; under pressure the cache degrades to the checkpoints hits actually used lately.
NOTE: one LRU for both kinds, because dropping periodic ones strictly first missed issue 9's
synthetic-trace targets at every interval (``loadtest/bench_engine.py hit-rate``): a periodic
point that keeps being hit is worth more than a resume point nobody came back to.

Events (``on_event``): every page stored or removed, every checkpoint marked or dropped, and
every change to which pages hold SWA KV ("stored" says whether the page came with its SWA;
"swa_stored" when a tombstone is revived, "swa_dropped" when history SWA is freed), so that a
router's index can apply the window-safe rule above exactly, history SWA included.

Tiers (issue 12): with a ``lower`` tier (L2 host memory), eviction moves down what a future hit
needs instead of dropping it: a deleted leaf's full page, and a demoted checkpoint's k SWA pages
(under those pages' hashes). History SWA is never moved down. ``KVManager.admit`` loads pages
back (``insert``, ``restore_swa``), so they come with the usual events.

Ownership: once a page is in the tree, the tree owns it. Running requests pin what they use:
``full_refs`` on their deepest node (ancestors are pinned by having children) and ``swa_refs`` on
the nodes inside their window. Only unpinned pages are ever freed.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.kv.allocator import PageAllocator
from engine.kv.layout import PageKind, usable_pages
from engine.kv.node import CacheEvent, CacheStats, MatchResult, Node
from engine.kv.retention import Retentions
from engine.utils import cdiv

if TYPE_CHECKING:
    from engine.kv.tier import LowerTier  # NOTE: for types only (tier.py needs torch, this not)

HEAP_SLACK = 16  # NOTE: a heap is compacted past 2 x the cached pages + this many entries


class _LazyHeap(list):  # type: ignore[type-arg]
    """``(key, seq, node)`` entries in key order (``heapq``), deleted lazily: an entry is live
    while ``key(node)`` still equals its key and ``valid(node)`` holds; a re-keyed or no longer
    eligible node leaves a stale entry behind, skipped when it reaches the top."""

    def __init__(self, key: Callable[[Node], int], valid: Callable[[Node], bool]) -> None:
        super().__init__()
        self.key, self.valid = key, valid

    def is_live(self, entry: tuple[int, int, Node]) -> bool:
        return entry[0] == self.key(entry[2]) and self.valid(entry[2])

__all__ = ["CacheEvent", "CacheStats", "MatchResult", "Node", "PrefixCache"]


@dataclass
class PrefixCache:
    """See the module docstring.

    Args:
        allocator: where the pages come from and go back to (its layout gives the page size and
            W, the previous tokens an SWA query sees).
        enabled: False keeps nothing once released (and never matches): the "cache off" mode.
        keep_tokens: store each page's token ids; off saves memory for 10^7-page replays.
        on_event: called with each ``CacheEvent`` (KV events for routers).
        clock: seconds, for retention TTLs.
        lower: the tier below (L2) that evicted pages a future hit needs are copied into.
    """

    allocator: PageAllocator
    enabled: bool = True
    keep_tokens: bool = True  # store each page's token ids (collision check, BlockStored events)
    on_event: Callable[[CacheEvent], None] | None = None
    clock: Callable[[], float] = time.monotonic
    stats: CacheStats = field(default_factory=CacheStats)
    lower: LowerTier | None = None

    def __post_init__(self) -> None:
        self._demote = self.lower is not None and self.enabled
        self._index: dict[int, Node] = {}
        self._tick = itertools.count(1)
        self._seq = itertools.count()
        # history SWA by swa_access, deletable leaves by access, checkpoint ends by swa_access
        self._swa_heap = _LazyHeap(lambda n: n.swa_access, self._is_history)
        self._leaf_heap = _LazyHeap(lambda n: n.access, self._is_deletable)
        self._ckpt_heap = _LazyHeap(lambda n: n.swa_access, self._is_ckpt)
        self.retentions = Retentions()  # metrics only: eviction reads ``Node.retain_until``
        layout = self.allocator.layout
        self.page_size, self.window = layout.page_size, layout.window
        self.has_swa = layout.page_bytes(PageKind.SWA) > 0

    # ---------------------------------------------------------------- queries

    @property
    def window_pages(self) -> int:
        """k = ceil(W / page): the pages of SWA a resume point needs."""
        return cdiv(self.window, self.page_size) if self.has_swa else 0

    @property
    def num_nodes(self) -> int:
        return len(self._index)

    def nodes(self) -> list[Node]:
        return list(self._index.values())

    def lookup(self, page_hash: int) -> Node | None:
        return self._index.get(page_hash)

    def match(
        self, page_hashes: Sequence[int], max_tokens: int, token_ids: Sequence[int] | None = None
    ) -> MatchResult:
        """Longest window-safe cached prefix of at most ``max_tokens`` tokens (no locks taken).

        ``token_ids``, when given, are checked against the cached pages' tokens (a hash collision
        then counts as a miss).
        """
        k, p = self.window_pages, self.page_size
        path: list[Node] = []
        for i, h in enumerate(page_hashes[: max_tokens // p]):
            node = self._index.get(h)
            if node is None or (
                token_ids is not None
                and node.token_ids is not None
                and tuple(token_ids[i * p : (i + 1) * p]) != node.token_ids
            ):
                break
            path.append(node)
        swa = (n.swa_page is not None or not self.has_swa for n in path)
        usable = usable_pages(itertools.repeat(True), swa, k)
        self._touch(path, usable)
        raw_tokens, usable_tokens = len(path) * p, usable * p
        st = self.stats
        st.match_calls += 1
        st.matched_tokens += usable_tokens
        st.raw_matched_tokens += raw_tokens
        st.cut_tokens += raw_tokens - usable_tokens
        return MatchResult(path[:usable], usable_tokens, raw_tokens, path[-1] if path else None)

    # ---------------------------------------------------------------- mutations

    def insert(
        self,
        parent: Node | None,
        page_hash: int,
        full_page: int,
        swa_page: int | None,
        token_ids: tuple[int, ...] | None = None,
    ) -> Node:
        """Add one page under ``parent`` and pin it for the caller (``full_refs`` and, with an SWA
        page, ``swa_refs``); returns the node now in the tree.

        The tree takes ownership of the given pages. If the page is already cached, the given
        duplicates are freed, except that a given SWA page revives a tombstone.
        """
        return self._insert(parent, page_hash, full_page, swa_page, token_ids)

    def insert_chain(
        self,
        parent: Node | None,
        page_hashes: Sequence[int],
        full_pages: Sequence[int],
        swa_pages: Sequence[int | None],
        token_ids: Sequence[tuple[int, ...] | None],
    ) -> list[Node]:
        """Add a chain of pages, each under the one before (the first under ``parent``), moving
        the caller's full pin down it; returns the nodes now in the tree, in chain order.

        The same as, page by page, ``insert`` and then ``unpin(previous, full=True, swa=False)``
        (``parent`` included when it is not None: the caller must hold a full pin on it), events
        included: the last node keeps a full pin, each node given an SWA page an SWA pin. One
        call for a step's run of completed pages (a prefill chunk) instead of two a page.
        """
        nodes: list[Node] = []
        prev, insert, enabled, swa_heap = parent, self._insert, self.enabled, self._swa_heap
        index, ticks = self._index, self._tick
        for h, full, swa, tokens in zip(page_hashes, full_pages, swa_pages, token_ids,
                                        strict=True):
            if not enabled or h in index:
                node = insert(prev, h, full, swa, tokens)  # a duplicate: the general path
            else:
                # NOTE: _insert's new-page path specialized (the per-page hot path of a
                # prefill): a new node is pinned (full, and SWA when it has a page) and ends no
                # checkpoint, so it goes into no heap
                node = self._new_node(prev, h, full, swa, tokens)
                node.full_refs = 1
                node.swa_refs = 1 if swa is not None else 0
                node.access = node.swa_access = next(ticks)
            if prev is not None and not enabled:
                self.unpin(prev, full=True, swa=False)  # NOTE: the cache off frees as it unpins
            elif prev is not None:
                # NOTE: unpin(prev, full=True) inlined: prev has a child now, so it is neither a
                # deletable leaf nor a tombstone leaf; only its SWA may become history
                assert prev.full_refs > 0, f"unbalanced full unpin: {prev}"
                prev.full_refs -= 1
                if prev.swa_page is not None and prev.swa_refs == 0 and prev.ckpt_refs == 0:
                    self._push(swa_heap, prev.swa_access, prev)
            nodes.append(node)
            prev = node
        return nodes

    def _insert(
        self,
        parent: Node | None,
        page_hash: int,
        full_page: int,
        swa_page: int | None,
        token_ids: tuple[int, ...] | None,
    ) -> Node:
        """``insert``'s body (and ``insert_chain``'s, page by page); NOTE: the per-page hot path,
        with ``_emit``, ``_set_swa_access`` and ``_offer`` inlined."""
        node = self._index.get(page_hash) if self.enabled else None
        if node is not None:
            assert node.parent is parent, f"page hash {page_hash} cached under another parent"
            self.allocator.free_page(PageKind.FULL, full_page)
            if swa_page is not None and node.swa_page is None:
                node.swa_page = swa_page
                self._emit("swa_stored", node)
            elif swa_page is not None:
                self.allocator.free_page(PageKind.SWA, swa_page)
        else:
            node = self._new_node(parent, page_hash, full_page, swa_page, token_ids)
        node.full_refs += 1
        if swa_page is not None:
            node.swa_refs += 1
        tick = node.access = node.swa_access = next(self._tick)
        if node.is_ckpt_end:  # _set_swa_access(node, tick)
            self._push(self._ckpt_heap, tick, node)
        # _offer(node): pinned (full), so never a deletable leaf; its SWA may be history
        if node.swa_page is not None and node.swa_refs == 0 and node.ckpt_refs == 0:
            self._push(self._swa_heap, tick, node)
        return node

    def _new_node(self, parent: Node | None, page_hash: int, full_page: int,
                  swa_page: int | None, token_ids: tuple[int, ...] | None) -> Node:
        """A page not in the tree yet, under ``parent``: indexed and announced when the cache
        is on; no pins or LRU entries yet (the caller's)."""
        tokens = token_ids if self.keep_tokens else None
        node = Node(page_hash, parent, full_page, swa_page, tokens)
        if parent is not None:
            parent.num_children += 1
        if self.enabled:
            self._index[page_hash] = node
            if self.on_event is not None:  # _emit("stored", node), per inserted page
                parent_hash = parent.page_hash if parent is not None else None
                swa = self.has_swa and swa_page is not None
                self.on_event(CacheEvent("stored", page_hash, parent_hash, tokens, swa))
        return node

    def restore_swa(self, node: Node, swa_page: int) -> None:
        """Give a tombstone its SWA KV back (loaded from a lower tier) and pin it for the caller
        (``swa_refs``). The tree takes ownership of ``swa_page``."""
        assert node.alive and node.swa_page is None, f"restoring SWA of {node}"
        node.swa_page = swa_page
        node.swa_refs += 1
        self._set_swa_access(node, next(self._tick))
        self._emit("swa_stored", node)

    def pin(self, node: Node, *, full: bool, swa: bool) -> None:
        assert node.alive, f"pinning a freed page: {node}"
        if full:
            node.full_refs += 1
        if swa:
            assert node.swa_page is not None, f"pinning the SWA of a tombstone: {node}"
            node.swa_refs += 1

    def unpin(self, node: Node, *, full: bool, swa: bool) -> None:
        """Drop a pin; what is no longer pinned becomes evictable (or is freed when disabled)."""
        if full:
            assert node.full_refs > 0, f"unbalanced full unpin: {node}"
            node.full_refs -= 1
        if swa:
            assert node.swa_refs > 0, f"unbalanced SWA unpin: {node}"
            node.swa_refs -= 1
        if not self.enabled:
            self._drop_unpinned(node)
            return
        if node.swa_refs:
            return  # NOTE: SWA still pinned: neither history nor a leaf to delete (_offer's tests)
        self._offer_unpinned(node)

    def unpin_swa(self, nodes: Iterable[Node]) -> None:
        """``unpin(node, full=False, swa=True)`` for each node, in order (a request's window
        sliding past them in ``KVManager.commit``).

        NOTE: the per-page hot path of a prefill, ``unpin`` and ``_offer`` inlined for a page
        that keeps its SWA; other cases take ``unpin``'s own path.
        """
        if not self.enabled:
            for node in nodes:
                self.unpin(node, full=False, swa=True)
            return
        push, swa_heap, leaf_heap = self._push, self._swa_heap, self._leaf_heap
        for node in nodes:
            assert node.swa_refs > 0, f"unbalanced SWA unpin: {node}"
            node.swa_refs -= 1
            if node.swa_refs:
                continue
            if node.swa_page is None or not node.alive:
                self._offer_unpinned(node)
                continue
            if node.ckpt_refs == 0:  # _offer: history SWA
                push(swa_heap, node.swa_access, node)
            if node.num_children == 0 and node.full_refs == 0:  # _offer: a deletable leaf
                push(leaf_heap, node.access, node)

    def mark_checkpoint(
        self, node: Node, retain_ttl_s: float | None = None, *, periodic: bool = False
    ) -> bool:
        """Make ``node``'s end a resume point: keep SWA for the k pages ending at it.

        ``retain_ttl_s`` protects it from eviction for that long (sessions paused in a tool call).
        ``periodic`` labels a speculative point (every N tokens along a prompt); both kinds share
        one LRU, the label (``Node.is_periodic``) only says how it came; marking it again without
        ``periodic`` relabels it a resume point.
        Returns False (and marks nothing) when the window before it is not all live.

        NOTE (invariant): every checkpoint's k pages keep live SWA until it is dropped.
        """
        if not self.enabled or not node.alive or not self._window_live(node):
            return False
        if retain_ttl_s is not None:
            node.retain_until = max(node.retain_until, self.clock() + retain_ttl_s)
            self.retentions.track(node)
        if node.is_ckpt_end:
            node.is_periodic = node.is_periodic and periodic
            return True
        node.is_ckpt_end, node.is_periodic = True, periodic
        for n in node.ancestors(self.window_pages):
            n.ckpt_refs += 1
        self._set_swa_access(node, next(self._tick))
        self._emit("ckpt_stored", node)
        return True

    def retain(self, node: Node, ttl_s: float) -> bool:
        """Protect the checkpoint ending at ``node`` for ``ttl_s`` seconds from now (replacing an
        earlier TTL); ``ttl_s <= 0`` releases it (evictable by LRU again).

        A node whose checkpoint was demoted is marked again when its window is still live.
        Returns False (and changes nothing) when the node or its window is gone.
        """
        if not node.alive:
            return False
        if ttl_s <= 0:
            node.retain_until = 0.0
            self.retentions.release(node)
            return node.is_ckpt_end
        if not node.is_ckpt_end and not self.mark_checkpoint(node):
            return False
        node.retain_until = self.clock() + ttl_s
        self.retentions.track(node)
        return True

    def retained_pages(self) -> int:
        """Pages that live retentions protect from eviction (an estimate, see ``Retentions``);
        counts the retentions that expired unused since the last call first."""
        return self.retentions.pages(self.clock(), self.window_pages)

    @property
    def retains_expired(self) -> int:
        """Retained checkpoints whose TTL ran out before any request reached them (so far)."""
        return self.retentions.num_expired

    def evict(self, num_full: int, num_swa: int) -> bool:
        """Free cached pages until the allocator can hand out this many pages of each kind.

        Returns whether it can now. Never touches a pinned page.
        """
        frees_needed = self.allocator.frees_needed
        while (needed := frees_needed(num_full, num_swa)) > 0:
            # NOTE: _evict_one's first choice, ``needed`` pages at a time: ``can_allocate``
            # cannot hold before that many were freed, so checking in between changes nothing
            if self._drop_history(needed):
                continue
            # NOTE: TTL retention protects against ordinary pressure, never to the point of
            # failing a request: when nothing else is left, retained pages go too.
            if not self._evict_one() and not self._evict_one(ignore_retention=True):
                return False
        return True

    def drop_history(self) -> int:
        """Tombstone every unpinned non-checkpoint SWA page (what pressure takes first).

        Returns the number of SWA pages freed. Full KV and checkpoints stay.
        """
        freed = 0
        while node := self._pop(self._swa_heap):
            self._drop_swa(node)
            freed += 1
        return freed

    def flush(self, demote: bool = False) -> int:
        """Free every unpinned cached page; returns the number of nodes removed.

        ``demote``: move what a future hit needs to the lower tier first, as eviction does
        (otherwise a flush forgets it, as a cold-cache benchmark wants).
        """
        before = len(self._index)
        self._demote = demote and self.lower is not None and self.enabled
        try:
            while self._evict_one(ignore_retention=True):
                pass
        finally:
            self._demote = self.lower is not None and self.enabled
        # NOTE: each removal was announced; "cleared" only when nothing is left, as pages pinned
        # by running requests stay, and a router's index must not forget them
        if self.enabled and not self._index:
            self._emit("cleared", None)
        return before - len(self._index)

    def drop_branch(self, end: Node) -> list[int]:
        """Delete the chain ending at ``end`` (a session hibernated to L3), bottom up, while a
        node is unpinned, childless, in no other checkpoint's window and untouched since
        ``end`` was; nothing is demoted. Returns the hashes of the deleted pages."""
        chain = list(end.ancestors(end.depth + 1))
        limit = end.access
        demote, self._demote = self._demote, False
        try:
            self._drop_checkpoint(end)
            node: Node | None = end
            while (node is not None and self._is_deletable(node) and node.ckpt_refs == 0
                   and not node.is_ckpt_end and node.access <= limit):
                parent = node.parent
                self._delete_leaf(node)  # NOTE: may delete tombstone parents too
                node = parent
        finally:
            self._demote = demote
        return [n.page_hash for n in chain if not n.alive]

    # ---------------------------------------------------------------- eviction internals

    def _evict_one(self, ignore_retention: bool = False) -> bool:
        node = self._pop(self._swa_heap)
        if node is not None:
            self._drop_swa(node)
            return True
        now = self.clock()
        retained: list[tuple[_LazyHeap, tuple[int, int, Node]]] = []
        try:
            while True:
                leaf = self._peek(self._leaf_heap)
                ckpt = self._peek(self._ckpt_heap)
                if leaf is None and ckpt is None:
                    return False
                use_leaf = ckpt is None or (leaf is not None and leaf[0] <= ckpt[0])
                heap = self._leaf_heap if use_leaf else self._ckpt_heap
                entry = heapq.heappop(heap)
                victim = entry[2]
                if victim.retain_until > now and not ignore_retention:
                    retained.append((heap, entry))  # TTL hint: skip it for now
                    continue
                if use_leaf:
                    self._delete_leaf(victim)
                else:
                    self._drop_checkpoint(victim)
                return True
        finally:
            for heap, entry in retained:
                heapq.heappush(heap, entry)

    def _drop_swa(self, node: Node) -> None:
        """Tombstone a history page (no checkpoint needs it, nobody pins it)."""
        assert node.swa_page is not None and node.swa_refs == 0 and node.ckpt_refs == 0, node
        self.allocator.free_page(PageKind.SWA, node.swa_page)
        node.swa_page = None
        self.stats.evicted_swa_pages += 1
        if self._is_tombstone_leaf(node):
            self._delete_leaf(node)  # NOTE: announced as removed, which implies the SWA too
        else:
            self._emit("swa_dropped", node)

    def _drop_history(self, num_pages: int) -> int:
        """Tombstone history SWA pages, least recently used first, until ``num_pages`` pages
        were freed (deleting a tombstone leaf frees more than one) or none is left; returns the
        pages freed. The same as ``_pop(self._swa_heap)`` then ``_drop_swa`` page by page,
        without a ``_peek`` per page (the per-evicted-page hot path)."""
        heap, alloc, drop_swa = self._swa_heap, self.allocator, self._drop_swa
        used_before = alloc.num_used_pages(PageKind.FULL) + alloc.num_used_pages(PageKind.SWA)
        freed = 0
        while freed < num_pages and heap:
            entry = heapq.heappop(heap)
            if not heap.is_live(entry):
                continue  # stale entry (``_is_history`` no longer holds, or re-keyed)
            node = entry[2]
            if self.has_swa and node.num_children == 0 and node.full_refs == 0:
                drop_swa(node)  # NOTE: deletes a tombstone leaf (and maybe its parents)
                freed = used_before - alloc.num_used_pages(PageKind.FULL) - alloc.num_used_pages(
                    PageKind.SWA)
                continue
            drop_swa(node)
            freed += 1
        return freed

    def _drop_checkpoint(self, end: Node) -> None:
        if not end.is_ckpt_end:
            return
        if end in self.retentions:
            self.retentions.end(end, self.clock())
        end.is_ckpt_end = end.is_periodic = False
        end.retain_until = 0.0
        if self._demote and self.lower is not None:
            # NOTE: the window's SWA is what a resume at ``end`` needs; it goes down now, as
            # these pages become history that pressure frees without another look
            for n in end.ancestors(self.window_pages):
                if n.swa_page is not None:
                    self.lower.store(n, (PageKind.SWA,))
        for n in end.ancestors(self.window_pages):
            n.ckpt_refs -= 1
            self._offer(n)
        self.stats.dropped_checkpoints += 1
        if end.alive:
            self._emit("ckpt_dropped", end)

    def _delete_leaf(self, node: Node) -> None:
        """Delete an unpinned leaf, then parents that became useless (tombstone leaves)."""
        while node is not None:
            assert node.num_children == 0 and node.full_refs == 0 and node.swa_refs == 0, node
            self._drop_checkpoint(node)  # a leaf's only covering checkpoint ends at itself
            assert node.ckpt_refs == 0, node
            if node.swa_page is not None:
                self.allocator.free_page(PageKind.SWA, node.swa_page)
                self.stats.evicted_swa_pages += 1
            if self._demote and self.lower is not None and self._index.get(node.page_hash) is node:
                self.lower.store(node, (PageKind.FULL,))  # its SWA went with its checkpoint
            self.allocator.free_page(PageKind.FULL, node.full_page)
            self.stats.evicted_full_pages += 1
            node.alive = False
            if self._index.get(node.page_hash) is node:
                del self._index[node.page_hash]
                self._emit("removed", node)
            parent = node.parent
            if parent is None:
                return
            parent.num_children -= 1
            if parent.num_children or parent.full_refs or parent.swa_refs:
                return
            if self.enabled and not self._is_tombstone_leaf(parent):
                self._offer(parent)  # a leaf again: evictable by LRU
                return
            node = parent  # a tombstone leaf (or cache off): useless, delete it too

    def _drop_unpinned(self, node: Node) -> None:
        """Cache off: free what nobody pins any more, right away."""
        if node.swa_page is not None and node.swa_refs == 0:
            self.allocator.free_page(PageKind.SWA, node.swa_page)
            node.swa_page = None
        if node.alive and node.num_children == 0 and node.full_refs == 0 and node.swa_refs == 0:
            self._delete_leaf(node)

    # ---------------------------------------------------------------- classification / LRU

    def _is_history(self, n: Node) -> bool:
        return n.alive and n.swa_page is not None and n.swa_refs == 0 and n.ckpt_refs == 0

    def _is_deletable(self, n: Node) -> bool:
        return n.alive and n.num_children == 0 and n.full_refs == 0 and n.swa_refs == 0

    def _is_tombstone_leaf(self, n: Node) -> bool:
        """An unpinned leaf of an SWA model whose SWA is gone: no hit can use it (no window ends
        at or below it), so it is deleted rather than kept for LRU."""
        return self.has_swa and n.swa_page is None and self._is_deletable(n)

    def _is_ckpt(self, n: Node) -> bool:
        # NOTE: demotable even while a running request pins some of its window: demotion only
        # drops the checkpoint refs, pinned pages stay until unpinned (then they are history).
        # Skipping pinned ones here would pop them off the heap for good (nothing re-offers them).
        return n.alive and n.is_ckpt_end

    def _window_live(self, end: Node) -> bool:
        return all(a.swa_page is not None for a in end.ancestors(self.window_pages))

    def _offer(self, n: Node) -> None:
        if self._is_history(n):
            self._push(self._swa_heap, n.swa_access, n)
        if self._is_deletable(n):
            self._push(self._leaf_heap, n.access, n)

    def _offer_unpinned(self, node: Node) -> None:
        """``unpin``'s end, for an enabled cache and a node whose SWA nobody pins any more."""
        if self._is_tombstone_leaf(node):
            # NOTE: it happens when a request's last full page lost its SWA while the request ran
            # (W < page: the window sat in the partial page); left to LRU, such pages outlived
            # live checkpoints
            self._delete_leaf(node)
            return
        self._offer(node)

    def _touch(self, path: list[Node], usable: int) -> None:
        if not path:
            return
        tick = next(self._tick)
        for n in path:
            n.access = tick
        self._offer(path[-1])
        if usable:
            end = path[usable - 1]
            for n in end.ancestors(self.window_pages):
                self._set_swa_access(n, tick)
                self._offer(n)

    def _set_swa_access(self, n: Node, tick: int) -> None:
        """NOTE: a checkpoint end's heap entry is keyed by its ``swa_access``: every change of
        it re-keys the entry (an old one is skipped as stale), or the checkpoint could never be
        demoted again and its window's SWA pages would stay for good."""
        n.swa_access = tick
        if n.is_ckpt_end:
            self._push(self._ckpt_heap, tick, n)

    def _push(self, heap: _LazyHeap, key: int, n: Node) -> None:
        heapq.heappush(heap, (key, next(self._seq), n))
        if len(heap) > 2 * len(self._index) + HEAP_SLACK:
            self._compact(heap)

    @staticmethod
    def _compact(heap: _LazyHeap) -> None:
        """Drop stale entries, one entry per node at most: without eviction pressure nothing
        pops them, and every hit pushes some. NOTE: a heap is rebuilt only after it doubled past
        the cached pages, so O(1) a push."""
        seen: set[int] = set()
        kept = []
        for entry in heap:
            if heap.is_live(entry) and id(entry[2]) not in seen:
                seen.add(id(entry[2]))
                kept.append(entry)
        heapq.heapify(kept)
        heap[:] = kept

    @staticmethod
    def _peek(heap: _LazyHeap) -> tuple[int, int, Node] | None:
        while heap:
            if heap.is_live(heap[0]):
                return heap[0]
            heapq.heappop(heap)  # stale entry
        return None

    def _pop(self, heap: _LazyHeap) -> Node | None:
        entry = self._peek(heap)
        if entry is None:
            return None
        heapq.heappop(heap)
        return entry[2]

    def _emit(self, kind: str, node: Node | None) -> None:
        if self.on_event is None:
            return
        if node is None:
            self.on_event(CacheEvent(kind))
            return
        parent = node.parent.page_hash if node.parent is not None else None
        if kind == "stored":
            swa = self.has_swa and node.swa_page is not None
            self.on_event(CacheEvent(kind, node.page_hash, parent, node.token_ids, swa))
            return
        self.on_event(CacheEvent(kind, node.page_hash, parent))

