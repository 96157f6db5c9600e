"""The prefix cache's data types: a page of the radix tree (``Node``), match results, events and
counters (``engine.kv.prefix_cache`` re-exports them)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple


class Node:
    """One cached page. ``swa_page is None`` means its SWA KV was dropped (tombstone)."""

    __slots__ = (
        "page_hash",
        "parent",
        "depth",
        "full_page",
        "swa_page",
        "num_children",
        "token_ids",
        "full_refs",
        "swa_refs",
        "ckpt_refs",
        "is_ckpt_end",
        "is_periodic",
        "retain_until",
        "access",
        "swa_access",
        "alive",
        "mtp",
    )

    def __init__(
        self,
        page_hash: int,
        parent: Node | None,
        full_page: int,
        swa_page: int | None,
        token_ids: tuple[int, ...] | None,
    ) -> None:
        self.page_hash, self.parent = page_hash, parent
        self.depth = 0 if parent is None else parent.depth + 1
        self.full_page, self.swa_page, self.token_ids = full_page, swa_page, token_ids
        self.num_children = 0
        self.full_refs = self.swa_refs = self.ckpt_refs = 0
        self.is_ckpt_end = self.is_periodic = False
        self.retain_until = 0.0
        self.access = self.swa_access = 0
        self.alive = True
        # MTP (engine.spec): the hidden states the MTP layers continue from after this page
        # ([K, hidden]), set when the request that wrote its SWA page had exact MTP KV in it
        self.mtp: object | None = None

    def ancestors(self, n: int) -> Iterator[Node]:
        """This node and up to n - 1 parents, deepest first."""
        node: Node | None = self
        for _ in range(n):
            if node is None:
                return
            yield node
            node = node.parent

    def __repr__(self) -> str:
        return (
            f"Node(depth={self.depth}, full={self.full_page}, swa={self.swa_page}, "
            f"refs={self.full_refs}/{self.swa_refs}, ckpt={self.ckpt_refs})"
        )


class MatchResult(NamedTuple):
    nodes: list[Node]  # the usable path, root side first (len = usable pages)
    usable_tokens: int
    raw_tokens: int  # full KV present for this many tokens
    branch_node: Node | None  # node at the raw match end: an observed branch point

    @property
    def cut_tokens(self) -> int:
        """Tokens with full KV cached that the window made unusable."""
        return self.raw_tokens - self.usable_tokens


class CacheEvent(NamedTuple):
    """One change to the cache, for KV events (``engine.worker.publisher.KVEventBuffer``).

    Kinds: "stored" (a page entered; ``swa``: with its SWA KV), "removed", "swa_stored" (a
    tombstone's SWA KV came back), "swa_dropped" (a page's SWA KV was freed, its full KV stays),
    "ckpt_stored", "ckpt_dropped", "cleared". ``medium``: the tier the change happened in
    ("GPU": the device prefix cache; "CPU": L2 host memory; "GCACHE": the shared L3 store).
    """

    kind: str
    page_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    swa: bool = False
    medium: str = "GPU"


@dataclass
class CacheStats:
    match_calls: int = 0
    matched_tokens: int = 0  # usable
    raw_matched_tokens: int = 0
    cut_tokens: int = 0  # raw - usable, summed: what the window cut off
    evicted_full_pages: int = 0
    evicted_swa_pages: int = 0
    dropped_checkpoints: int = 0
