"""Bookkeeping of retained checkpoints (TTL hints on resume points), for metrics.

Eviction itself only reads ``Node.retain_until`` (``PrefixCache._evict_one`` skips a retained
checkpoint until nothing else is left). This tracks which checkpoints are retained so that the
engine can report ``retained_pages`` and ``retains_expired`` without scanning the whole tree.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv.node import Node


class Retentions:
    """Retained checkpoint ends, each with its ``Node.access`` when retained: a later request that
    reaches the node (a match through it) moves ``access``, so an unchanged one at expiry means
    the retention was never used.

    ``num_expired`` counts retentions whose TTL ran out unused; a release (TTL 0) or an eviction
    that had to take a retained checkpoint is not an expiry.
    """

    def __init__(self) -> None:
        self._seen: dict[Node, int] = {}
        self.num_expired = 0

    def __contains__(self, node: Node) -> bool:
        return node in self._seen

    def __len__(self) -> int:
        return len(self._seen)

    def __iter__(self) -> Iterator[Node]:
        return iter(list(self._seen))

    def track(self, node: Node) -> None:
        """``node.retain_until`` was just set in the future: (re)start tracking it."""
        self._seen[node] = node.access

    def release(self, node: Node) -> None:
        self._seen.pop(node, None)

    def end(self, node: Node, now: float) -> None:
        """Stop tracking ``node`` (its checkpoint is dropped or its TTL is over)."""
        seen = self._seen.pop(node)
        if 0.0 < node.retain_until <= now and node.access == seen:
            self.num_expired += 1

    def sweep(self, now: float) -> None:
        """End every tracked retention that expired or whose checkpoint is gone."""
        for node in [n for n in self._seen if not (n.retain_until > now and n.is_ckpt_end)]:
            self.end(node, now)

    def pages(self, now: float, window_pages: int) -> int:
        """Pages live retentions protect (after a ``sweep``); an estimate: plain LRU might have
        kept some of them anyway.

        Per retained checkpoint: its window's SWA pages that no running request pins (shared
        windows counted once), plus the full pages only its own tail keeps (``tail_pages``).
        """
        self.sweep(now)
        swa: set[Node] = set()
        full = 0
        for node in self._seen:
            swa.update(a for a in node.ancestors(window_pages) if a.swa_refs == 0)
            full += tail_pages(node)
        return len(swa) + full


def tail_pages(end: Node) -> int:
    """Full pages that only the checkpoint at ``end`` keeps: the unbranched, unpinned chain that
    ends at ``end`` (a leaf), up to but not including a branch point, a page pinned by a running
    request, or another checkpoint's end. 0 when ``end`` has children or is pinned."""
    count, node = 0, end
    while node is not None and node.num_children <= (0 if node is end else 1):
        if node.full_refs or (node is not end and node.is_ckpt_end):
            break
        count += 1
        node = node.parent
    return count
