"""An SGLang-style hybrid-SWA prefix cache, as a baseline for trace replays (not our design).

Modelled on SGLang's SWA radix cache (see ../shared/reference/sglang-swa-kv.md, section 2):
two static pools (SWA pool = ``swa_full_tokens_ratio`` x the full pool's tokens, 0.8 by default),
every inserted page keeps live SWA until the SWA pool's LRU tombstones it, full-pool pressure
deletes LRU leaves (and then tombstone parents that became leaves), window-safe matching, and the
window-aware LRU refresh (only the W tokens before a match end are refreshed for SWA). Running
requests keep SWA for their window; the rest of what they inserted is evictable at once.
Page granularity, prefill-only, one request at a time.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass


@dataclass(eq=False, slots=True)
class _Node:
    h: int
    parent: _Node | None
    children: int = 0
    swa: bool = True
    access: int = 0
    swa_access: int = 0
    alive: bool = True
    locked: bool = False


class SGLangStyleCache:
    def __init__(self, full_pages: int, swa_pages: int, window_pages: int) -> None:
        self.full_cap, self.swa_cap, self.k = full_pages, swa_pages, window_pages
        self.full_used = self.swa_used = 0
        self.nodes: dict[int, _Node] = {}
        self._tick = itertools.count(1)
        self._seq = itertools.count()
        self._leaves: list[tuple[int, int, _Node, int]] = []
        self._swa: list[tuple[int, int, _Node, int]] = []

    def process(self, hashes: list[int], prompt_len: int) -> int:
        """Serve one prefill-only request; returns the cached (reused) tokens."""
        path, usable = self._match(hashes[: (prompt_len - 1) // 16])
        tick = next(self._tick)
        for n in path:
            n.access = tick
        for n in path[max(0, usable - self.k) : usable]:
            n.swa_access = tick
            self._push_swa(n)
        locked = path[max(0, usable - self.k) : usable]
        for n in locked:
            n.locked = True
        parent = path[usable - 1] if usable else None
        for h in hashes[usable:]:
            parent = self._insert(parent, h, locked)
        for n in locked:
            n.locked = False
            self._push_swa(n)
            if n.children == 0:
                self._push_leaf(n)
        return usable * 16

    def _match(self, hashes: list[int]) -> tuple[list[_Node], int]:
        path: list[_Node] = []
        run = usable = 0
        for i, h in enumerate(hashes):
            n = self.nodes.get(h)
            if n is None:
                break
            path.append(n)
            run = run + 1 if n.swa else 0
            if run >= min(self.k, i + 1):
                usable = i + 1
        return path, usable

    def _insert(self, parent: _Node | None, h: int, locked: list[_Node]) -> _Node:
        tick = next(self._tick)
        node = self.nodes.get(h)
        if node is None:
            self._make_room(full=1, swa=1)
            node = _Node(h, parent)
            self.nodes[h] = node
            self.full_used += 1
            self.swa_used += 1
            if parent is not None:
                parent.children += 1
        elif not node.swa:  # the request recomputed it: revive the tombstone
            self._make_room(full=0, swa=1)
            node.swa = True
            self.swa_used += 1
        node.access = node.swa_access = tick
        node.locked = True  # the running request's window
        locked.append(node)
        while len(locked) > self.k:
            old = locked.pop(0)
            old.locked = False
            self._push_swa(old)
        return node

    def _make_room(self, full: int, swa: int) -> None:
        while self.full_used + full > self.full_cap:
            if not self._evict_leaf():
                raise MemoryError("full pool exhausted by locked pages")
        while self.swa_used + swa > self.swa_cap:
            if not self._tombstone():
                raise MemoryError("SWA pool exhausted by locked pages")

    def _evict_leaf(self) -> bool:
        while self._leaves:
            access, _, n, _gen = heapq.heappop(self._leaves)
            if n.alive and not n.locked and n.children == 0 and access == n.access:
                self._delete(n)
                return True
        return False

    def _tombstone(self) -> bool:
        while self._swa:
            access, _, n, _gen = heapq.heappop(self._swa)
            if n.alive and n.swa and not n.locked and access == n.swa_access:
                n.swa = False
                self.swa_used -= 1
                if n.children == 0:
                    self._delete(n)
                return True
        return False

    def _delete(self, n: _Node | None) -> None:
        while n is not None and n.alive and n.children == 0 and not n.locked:
            n.alive = False
            self.full_used -= 1
            if n.swa:
                self.swa_used -= 1
            del self.nodes[n.h]
            parent = n.parent
            if parent is None:
                return
            parent.children -= 1
            if parent.children or parent.swa:
                if not parent.children:
                    self._push_leaf(parent)
                return
            n = parent  # a tombstone leaf: useless

    def _push_leaf(self, n: _Node) -> None:
        heapq.heappush(self._leaves, (n.access, next(self._seq), n, 0))

    def _push_swa(self, n: _Node) -> None:
        heapq.heappush(self._swa, (n.swa_access, next(self._seq), n, 0))
