"""KVManager: one request's page table against the shared allocator and the prefix cache.

Lifecycle of a request's pages:

    admit    match the prefix cache, then the tier below it (L2) when there is one, loading the
             pages a longer usable prefix needs; pin the usable path (full: deepest node, SWA:
             the window)
    reserve  before a forward: allocate private pages for positions [num_computed, +n)
    commit   after it: every page the step completed goes into the tree (deduplicated), the pin
             moves to the new deepest node, and SWA pages that slid out of the window are unpinned
             (the cache keeps them as history while memory is plentiful, or frees them)
    release  finish / abort / preempt: optionally checkpoint the end, unpin everything, free the
             private partial page

NOTE (O(W) running requests): after every commit a request pins SWA only for the pages holding
positions [seq_len - W, seq_len); during a step it also holds the step's new pages, so at most
ceil((W + chunk) / page) + 1 SWA pages per SWA layer at any time.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from engine.hashing import page_hash, page_hashes, salt_seed, u32_ids
from engine.kv.allocator import PageAllocator
from engine.kv.host_pool import HostEntry
from engine.kv.layout import PageKind, num_pages, swa_first_needed_page, usable_pages
from engine.kv.paged import SeqPages
from engine.kv.prefix_cache import MatchResult, Node, PrefixCache
from engine.kv.tier import LowerTier
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.kv.gcache.tier import GCacheTier

_Pin = tuple[Node, bool, bool]  # (node, full, swa): a pin held while pages load


class KVManager:
    """Args:
    checkpoint_interval_tokens: also checkpoint every this many tokens along each newly computed
        prompt (periodic checkpoints, in the same LRU as resume points); 0 disables. A multiple
        of the page size.
    max_finished_ends: how many finished requests' end checkpoints ``retain`` can still find
        (the oldest are forgotten first).
    lower: the tier below the prefix cache (L2 host memory); None: L1 only. The cache must be
        the one that demotes into it (``PrefixCache.lower``).
    """

    def __init__(
        self, allocator: PageAllocator, cache: PrefixCache, checkpoint_interval_tokens: int = 0,
        max_finished_ends: int = 4096, lower: LowerTier | None = None,
        storage: GCacheTier | None = None,
    ) -> None:
        self.allocator, self.cache = allocator, cache
        self.lower = lower if cache.enabled else None
        self.storage = storage if cache.enabled else None
        self.checkpoint_interval_tokens = checkpoint_interval_tokens
        self.max_finished_ends = max_finished_ends
        # NOTE: request id -> the resume checkpoint marked at its finish (``retain``) and the
        # time it finished (``hibernate``); bounded, oldest first
        self._ends: OrderedDict[str, tuple[Node, float]] = OrderedDict()
        layout = allocator.layout
        self.page_size, self.window = layout.page_size, layout.window
        self.has_swa = layout.page_bytes(PageKind.SWA) > 0

    # ------------------------------------------------------------------ admission

    def admit(self, seq: Sequence) -> int:
        """Match the prefix cache for a request with nothing computed; returns cached tokens."""
        assert seq.num_computed == 0 and not seq.path and not seq.pending_full
        num_tokens, token_ids = seq.num_tokens, seq.token_ids
        if len(seq.page_hashes) < num_tokens // self.page_size:
            # NOTE: a caller may precompute the hashes (in-process only, e.g. a trace replay);
            # hashes from the wire are never trusted, they would cross tenant salts
            seq.page_hashes = page_hashes(u32_ids(token_ids), self.page_size, seq.cache_salt)
        # at least the last token is recomputed: its logits are needed
        m = self.cache.match(
            seq.page_hashes, num_tokens - 1, token_ids if self.cache.keep_tokens else None
        )
        seq.path = list(m.nodes)
        seq.branch_node = m.branch_node if m.raw_tokens > 0 else None
        held: list[_Pin] = []
        if self.lower is not None:
            loaded = self._load_from_lower(seq, m, held)
            if loaded is not None:
                seq.path = loaded
                if seq.branch_node is not None and len(loaded) > seq.branch_node.depth:
                    seq.branch_node = None  # NOTE: the lower tier had what L1 lacked there
        usable_tokens = len(seq.path) * self.page_size
        if seq.path:
            self.cache.pin(seq.path[-1], full=True, swa=False)
            first = swa_first_needed_page(usable_tokens, self.window, 0, self.page_size)
            for node in seq.path[first:] if self.has_swa else ():
                self.cache.pin(node, full=False, swa=True)
                seq.swa_pinned.append(node)
        for node, full, swa in held:  # NOTE: after the pins above, so nothing loaded is freed
            self.cache.unpin(node, full=full, swa=swa)
        seq.num_computed = usable_tokens
        if seq.num_preemptions == 0:
            # NOTE: num_cached is what the cache saved this request (cached_tokens to clients,
            # hit rates in benchmarks). A resume after preemption mostly hits the request's own
            # pages, prompt and output, which it computed itself: keep the first admission's.
            seq.num_cached = usable_tokens
            seq.num_cached_host = usable_tokens - m.usable_tokens - seq.num_cached_storage
        return usable_tokens

    # ------------------------------------------------------------------ one step

    def pages_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New pages (of each kind) a step of ``num_new_tokens`` needs."""
        have = len(seq.path) + len(seq.pending_full)
        return max(0, num_pages(seq.num_computed + num_new_tokens, self.page_size) - have)

    def can_reserve(self, seq: Sequence, num_new_tokens: int, evict: bool = True) -> bool:
        n = self.pages_needed(seq, num_new_tokens)
        if n == 0:
            return True  # NOTE: most decode steps (nothing to allocate, nothing to evict)
        n_swa = n if self.has_swa else 0
        if evict:
            return self.cache.evict(n, n_swa)
        return self.allocator.can_allocate(n, n_swa)

    def reserve(self, seq: Sequence, num_new_tokens: int) -> None:
        """Allocate the pages for positions [num_computed, num_computed + n); check first."""
        n = self.pages_needed(seq, num_new_tokens)
        if n:
            seq.pending_full += self.allocator.allocate(PageKind.FULL, n)
            if self.has_swa:
                seq.pending_swa += self.allocator.allocate(PageKind.SWA, n)

    def seq_pages(self, seq: Sequence, query_len: int) -> SeqPages:
        swa = [n.swa_page for n in seq.path] + list(seq.pending_swa)
        return SeqPages(
            full_pages=[n.full_page for n in seq.path] + list(seq.pending_full),
            swa_pages=swa if self.has_swa else [],
            num_cached=seq.num_computed,
            query_len=query_len,
        )

    def commit(self, seq: Sequence, num_new_tokens: int) -> None:
        """Record that the step computed ``num_new_tokens``; cache the pages it completed."""
        seq.num_computed += num_new_tokens
        p = self.page_size
        if (len(seq.path) + 1) * p <= seq.num_computed:
            self._insert_pages(seq, seq.num_computed // p)
        pinned = seq.swa_pinned
        if pinned and pinned[0].depth < (
                first := swa_first_needed_page(seq.num_computed, self.window, 0, p)):
            out = 0
            for node in pinned:
                if node.depth >= first:
                    break
                out += 1
            self.cache.unpin_swa([pinned.popleft() for _ in range(out)])
        if seq.branch_node is not None and len(seq.path) > seq.branch_node.depth:
            # an observed branch point: the request recomputed the window it lacked
            self.cache.mark_checkpoint(seq.path[seq.branch_node.depth])
            seq.branch_node = None
        before = seq.num_computed - num_new_tokens
        for pos in seq.checkpoint_positions:
            pages = pos // p  # the hint's page-aligned floor, reached by this step?
            if before < pages * p <= seq.num_computed and pages >= 1:
                self.cache.mark_checkpoint(seq.path[pages - 1])
        if before >= len(seq.prompt_ids):
            return  # NOTE: periodic checkpoints fall on newly computed prompt tokens only
        for pos in periodic_checkpoints(
            before, seq.num_computed, len(seq.prompt_ids), self.checkpoint_interval_tokens
        ):
            self.cache.mark_checkpoint(seq.path[pos // p - 1], periodic=True)

    # ------------------------------------------------------------------ release

    def release(self, seq: Sequence, checkpoint: bool = False) -> None:
        """Give back everything the request holds; with ``checkpoint``, keep its end resumable
        (and write its path through to L3 when there is one)."""
        if checkpoint and seq.path and self.cache.mark_checkpoint(seq.path[-1], seq.retain_ttl_s):
            self._remember_end(seq.request_id, seq.path[-1], self.cache.clock())
            if self.storage is not None:
                self.storage.write_path(seq.path, self.cache.window_pages)
        for node in seq.swa_pinned:
            self.cache.unpin(node, full=False, swa=True)
        if seq.path:
            self.cache.unpin(seq.path[-1], full=True, swa=False)
        self.allocator.free(PageKind.FULL, seq.pending_full)
        if seq.pending_swa:
            self.allocator.free(PageKind.SWA, seq.pending_swa)
        seq.path, seq.pending_full, seq.pending_swa = [], [], []
        seq.swa_pinned.clear()
        seq.branch_node = None
        seq.num_computed = 0

    def num_swa_pages_held(self, seq: Sequence) -> int:
        return len(seq.swa_pinned) + len(seq.pending_swa)

    def retain(self, request_id: str, ttl_s: float) -> bool:
        """Protect a finished request's end checkpoint for ``ttl_s`` seconds from now (0 releases
        it); False when the request is unknown (never finished here, or forgotten) or its end
        page or window is gone. See ``PrefixCache.retain``."""
        end = self._ends.get(request_id)
        if end is None:
            return False
        if not self.cache.retain(end[0], ttl_s):
            del self._ends[request_id]  # NOTE: gone for good (a demoted, released end too)
            return False
        return True

    # ------------------------------------------------------------------ internals

    def _load_from_lower(
        self, seq: Sequence, m: MatchResult, held: list[_Pin]
    ) -> list[Node] | None:
        """Extend the L1 match ``m`` with the tier below (window rule across tiers, see
        ``engine.kv.tier``); load what the longer usable prefix needs into L1 pages.

        Returns the new usable path (loaded nodes inserted or revived in the tree), or None
        when the tier adds nothing usable or L1 has no room for it. Appends to ``held`` the
        pins taken meanwhile (the caller pins the final path, then drops these).

            pages      0 ....... lo ....... keep ....... usable         (k = window pages)
            L1 raw     raw[0 .. keep) kept (full)       | raw match may go on past usable
            loaded     SWA of tombstones in [lo, keep)  | full of [keep, usable), SWA of
                                                        | [max(lo, keep), usable)
        """
        assert self.lower is not None
        p, k, lower = self.page_size, self.cache.window_pages, self.lower
        tokens = seq.token_ids if self.cache.keep_tokens else None
        hashes = seq.page_hashes[: (seq.num_tokens - 1) // p]
        raw = list(m.branch_node.ancestors(m.branch_node.depth + 1))[::-1] if m.branch_node else []
        below = lower.lookup(hashes, len(raw), tokens, p)
        for i, entry in enumerate(below):
            if self.cache.lookup(entry.page_hash) is not None:  # in L1 under other tokens
                below = below[:i]
                break
        revivable = self._revivable_swa(raw, tokens)
        full = [True] * len(raw) + [e.full_slot is not None for e in below]
        swa = [n.swa_page is not None or i in revivable for i, n in enumerate(raw)]
        swa += [e.swa_slot is not None for e in below]
        usable = usable_pages(full, swa, k)
        if usable <= len(m.nodes):
            return None
        keep, lo = min(usable, len(raw)), max(0, usable - k) if self.has_swa else usable
        revive = [i for i in range(lo, keep) if raw[i].swa_page is None]
        assert all(i in revivable for i in revive), f"window rule broken: {revive} {revivable}"
        fetched = below[: usable - keep]
        num_swa = len(revive) + sum(i >= lo for i in range(keep, usable))
        lower.protect([e.page_hash for e in fetched] + [revivable[i].page_hash for i in revive])
        try:
            self._hold_for_load(seq, m, raw[:keep], lo, held)
            if not self.cache.evict(len(fetched), num_swa):
                return None
            full_ids = self.allocator.allocate(PageKind.FULL, len(fetched))
            swa_ids = self.allocator.allocate(PageKind.SWA, num_swa) if num_swa else []
        finally:
            lower.unprotect()
        for i in revive:
            lower.load(revivable[i], PageKind.SWA, swa_ids[-1])
            self.cache.restore_swa(raw[i], swa_ids.pop())
            held.append((raw[i], False, True))
        path = raw[:keep]
        for i, entry in enumerate(fetched, start=keep):
            lower.load(entry, PageKind.FULL, full_ids[i - keep])
            swa_page = swa_ids.pop() if i >= lo and self.has_swa else None
            if swa_page is not None:
                lower.load(entry, PageKind.SWA, swa_page)
            page_tokens = None if tokens is None else tuple(tokens[i * p : (i + 1) * p])
            node = self.cache.insert(
                path[-1] if path else None, entry.page_hash, full_ids[i - keep], swa_page,
                page_tokens,
            )
            held.append((node, True, swa_page is not None))
            path.append(node)
        lower.stats.hit_tokens += (usable - len(m.nodes)) * p
        from_storage = [e for e in fetched if e.from_storage]
        for entry in from_storage:
            entry.from_storage = False  # NOTE: a later hit on it is an L2 hit
        if self.storage is not None:
            self.storage.stats.hit_tokens += len(from_storage) * p
        if seq.num_preemptions == 0:
            seq.num_cached_storage = len(from_storage) * p
        return path

    def _revivable_swa(self, raw: list[Node], tokens: list[int] | None) -> dict[int, HostEntry]:
        """Tombstones on the L1 path whose SWA the tier below holds, by page index."""
        out: dict[int, HostEntry] = {}
        if not self.has_swa or self.lower is None:
            return out
        p = self.page_size
        for i, node in enumerate(raw):
            if node.swa_page is None:
                parent = node.parent.page_hash if node.parent is not None else None
                page = None if tokens is None else tokens[i * p : (i + 1) * p]
                entry = self.lower.find(node.page_hash, parent, page)
                if entry is not None and entry.swa_slot is not None:
                    out[i] = entry
        return out

    def _hold_for_load(
        self, seq: Sequence, m: MatchResult, kept: list[Node], lo: int, held: list[_Pin]
    ) -> None:
        """Pin what eviction must leave alone while the pages load: the kept L1 path (full), the
        live SWA of the new window, and the L1 match's own window (the fallback)."""
        if kept:
            self.cache.pin(kept[-1], full=True, swa=False)
            held.append((kept[-1], True, False))
        first = swa_first_needed_page(m.usable_tokens, self.window, 0, self.page_size)
        window = {id(n): n for n in [*kept[lo:], *(m.nodes[first:] if self.has_swa else [])]}
        for node in window.values():
            if node.swa_page is not None:
                self.cache.pin(node, full=False, swa=True)
                held.append((node, False, True))

    def hibernate(self, idle_s: float, now: float) -> int:
        """Write the sessions that finished ``idle_s`` or more ago (and are not retained) to L3
        and drop them from L1 and L2 once the store confirms every page; returns how many were
        dropped. Never waits: an unconfirmed session is written now and checked on a later call.

        What is dropped is the chain ending at the session's end checkpoint, bottom up, as far
        as no request or other checkpoint holds it and nothing touched it after the session
        ended (a shared prefix that other sessions use stays).
        """
        storage = self.storage
        if storage is None:
            return 0
        k, dropped = self.cache.window_pages, 0
        for request_id, (node, ended) in list(self._ends.items()):
            if now - ended < idle_s:
                break  # NOTE: oldest first: the rest finished later
            if not node.alive or not node.is_ckpt_end:
                del self._ends[request_id]  # gone already (evicted, demoted)
                continue
            if node.retain_until > self.cache.clock():
                continue  # NOTE: the gateway expects a resume here (a tool call)
            path = list(node.ancestors(node.depth + 1))[::-1]
            if not storage.has_path(path, k):
                storage.write_path(path, k)
                continue
            del self._ends[request_id]
            for dropped_hash in self.cache.drop_branch(node):
                storage.host.host.discard(dropped_hash)
            storage.stats.hibernated += 1
            dropped += 1
        return dropped

    def _remember_end(self, request_id: str, node: Node, now: float) -> None:
        self._ends[request_id] = (node, now)
        self._ends.move_to_end(request_id)
        while len(self._ends) > self.max_finished_ends:
            self._ends.popitem(last=False)

    def _insert_pages(self, seq: Sequence, end: int) -> None:
        """Put pages [len(path), end) into the tree (one ``insert_chain``), the full pin moving
        to the last, each keeping its SWA pin (the window slides in ``commit``).

            page index   0 ...... start ........... end ...... (pending)
            owner        the tree  | these pages: pending_full[:k], pending_swa[:k] -> tree
        """
        start, p, n = len(seq.path), self.page_size, len(seq.prompt_ids)
        k = end - start
        tokens: list[tuple[int, ...] | None]
        if not self.cache.keep_tokens:
            tokens = [None] * k
        elif end * p <= n:  # NOTE: prompt pages (a prefill chunk), sliced in one go
            prompt = seq.prompt_ids
            tokens = [prompt[lo : lo + p] for lo in range(start * p, end * p, p)]
        else:
            tokens = [tuple(seq.token(j) for j in range(i * p, (i + 1) * p))
                      for i in range(start, end)]
        hashes = seq.page_hashes
        assert len(hashes) >= start, "the path's pages have their hashes (admit, commit)"
        for i in range(len(hashes), end):
            prev = hashes[-1] if hashes else None
            page = tokens[i - start] or tuple(seq.token(j) for j in range(i * p, (i + 1) * p))
            hashes.append(page_hash(prev, page, salt_seed(seq.cache_salt)))
        parent = seq.path[-1] if seq.path else None
        full = seq.pending_full[:k]
        del seq.pending_full[:k]
        if self.has_swa:
            swa: list[int | None] = list(seq.pending_swa[:k])
            del seq.pending_swa[:k]
        else:
            swa = [None] * k
        nodes = self.cache.insert_chain(parent, hashes[start:end], full, swa, tokens)
        for i, node, swa_page in zip(range(start, end), nodes, swa):
            mtp = seq.mtp_pages.pop(i, None) if seq.mtp_pages else None
            if swa_page is not None and node.swa_page == swa_page:
                node.mtp = mtp  # NOTE: the SWA page (and its MTP KV) is this request's
            elif swa_page is not None and node.mtp is None:
                seq.mtp_taint = (i + 1) * p  # NOTE: another request's SWA page, MTP KV unknown
        seq.path += nodes
        if self.has_swa:
            seq.swa_pinned.extend(nodes)

def periodic_checkpoints(
    before: int, num_computed: int, prompt_len: int, interval_tokens: int
) -> range:
    """Periodic checkpoint positions a step computing [before, num_computed) reached.

    Multiples of ``interval_tokens`` in (before, min(num_computed, prompt_len)]; none when the
    interval is 0. Only newly computed prompt tokens get them: a cached prefix already has its own.

        positions   0 ...... I ...... 2I ...... 3I ..... prompt_len
        step        [before ........... num_computed)
        marked               I         2I                (when I, 2I in (before, end])
    """
    if interval_tokens <= 0:
        return range(0)
    end = min(num_computed, prompt_len)
    first = (before // interval_tokens + 1) * interval_tokens
    return range(first, end + 1, interval_tokens)
