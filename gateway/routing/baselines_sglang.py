"""SGLang router's ``cache_aware`` policy (SGLang Model Gateway, CLI defaults) and its approximate
radix tree, over page hashes instead of characters.

The real tree (``sgl-model-gateway`` ``tree.rs`` / ``token_tree.rs``) is one multi-tenant radix
tree per model: each node knows which workers ("tenants") the router *believes* hold it and when
each last used it. The router inserts every request it routes, for the worker it chose, and
never learns about engine evictions: the only bound is a size-based LRU per tenant, run on a
timer. That is its blind spot, kept here on purpose (with page hashes there is no SWA either).

Page granularity is what its event mode and token tree use; chained page hashes name a prefix,
so the tree is a dict ``hash -> node`` whose parent link is the previous page's hash::

    request pages   h0 -> h1 -> h2 -> h3
    tree            h0 {a, b}
                     '- h1 {a, b}
                         |- h2 {a}          <- a's leaf: LRU eviction starts here
                         '- h2' {b}
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.routing.baselines import BaselineRouter
from gateway.routing.index import KVIndex
from gateway.routing.types import Decision, RouteRequest, WorkerInfo

CACHE_THRESHOLD = 0.3  # NOTE: SMG CLI defaults (router_args.py); the library's are 0.5/32/1.1
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5
EVICTION_INTERVAL_S = 60.0
MAX_TREE_SIZE_TOKENS = 2**26  # per tenant
MISS_POLICIES = ("min-load", "smallest-tree")  # current SMG; v1 (2024)


@dataclass(slots=True)
class _Node:
    parent: int | None
    owners: dict[str, int] = field(default_factory=dict)  # tenant -> last access tick
    child_owners: dict[str, int] = field(default_factory=dict)  # tenant -> its children here


class ApproxTree:
    """The approximate multi-tenant radix tree, one node per page (``page_size`` tokens).

    A tenant's nodes are prefix-closed (insert adds whole paths, eviction removes leaves), so any
    owner of the deepest matched node holds the whole matched prefix.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.size_tokens: dict[str, int] = {}  # per tenant
        self._nodes: dict[int, _Node] = {}
        self._tick = 0

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def prefix_match(self, page_hashes: Sequence[int]) -> tuple[int, str | None]:
        """The longest prefix of ``page_hashes`` in the tree (pages) and a tenant holding it
        (the longest-standing owner; SGLang takes whichever its map yields first). The tenant's
        path counts as used."""
        depth = 0
        for h in page_hashes:
            if h not in self._nodes:
                break
            depth += 1
        if depth == 0:
            return 0, None
        tenant = next(iter(self._nodes[page_hashes[depth - 1]].owners))
        self._tick += 1
        for h in page_hashes[:depth]:
            self._nodes[h].owners[tenant] = self._tick
        return depth, tenant

    def insert(self, page_hashes: Sequence[int], tenant: str) -> None:
        """``tenant`` now holds this prefix (the router's optimistic assumption)."""
        self._tick += 1
        self.size_tokens.setdefault(tenant, 0)
        parent: int | None = None
        for h in page_hashes:
            node = self._nodes.get(h)
            if node is None:
                node = self._nodes[h] = _Node(parent)
            if tenant not in node.owners:
                self.size_tokens[tenant] += self.page_size
                if parent is not None:
                    up = self._nodes[parent].child_owners
                    up[tenant] = up.get(tenant, 0) + 1
            node.owners[tenant] = self._tick
            parent = h

    def evict(self, tenant: str, max_size_tokens: int) -> int:
        """Drop ``tenant``'s least recently used leaves until it holds at most
        ``max_size_tokens``. Returns the tokens dropped."""
        before = self.size_tokens.get(tenant, 0)
        if before <= max_size_tokens:
            return 0
        leaves = [(n.owners[tenant], h) for h, n in self._nodes.items()
                  if tenant in n.owners and not n.child_owners.get(tenant)]
        heapq.heapify(leaves)
        while leaves and self.size_tokens[tenant] > max_size_tokens:
            _, h = heapq.heappop(leaves)
            parent = self._drop(h, tenant)
            if parent is not None and not parent[1].child_owners.get(tenant):
                heapq.heappush(leaves, (parent[1].owners[tenant], parent[0]))
        return before - self.size_tokens[tenant]

    def remove_tenant(self, tenant: str) -> None:
        for h in [h for h, n in self._nodes.items() if tenant in n.owners]:
            node = self._nodes[h]
            del node.owners[tenant]
            node.child_owners.pop(tenant, None)
            if not node.owners:
                del self._nodes[h]
        for node in self._nodes.values():
            node.child_owners.pop(tenant, None)
        self.size_tokens.pop(tenant, None)

    def _drop(self, h: int, tenant: str) -> tuple[int, _Node] | None:
        """Remove ``tenant`` from leaf ``h``; returns its parent when the tenant still owns it."""
        node = self._nodes[h]
        del node.owners[tenant]
        self.size_tokens[tenant] -= self.page_size
        if not node.owners:
            del self._nodes[h]
        if node.parent is None or (parent := self._nodes.get(node.parent)) is None:
            return None
        parent.child_owners[tenant] -= 1
        return (node.parent, parent) if tenant in parent.owners else None


class SGLangCacheAwareRouter(BaselineRouter):
    """SGLang router ``cache_aware`` (see the module docstring for the tree).

    Per request: if the candidates' in-flight counts are imbalanced (max - min >
    ``balance_abs_threshold`` AND max > ``balance_rel_threshold`` x min), the least loaded
    (ties: fewest routed, then the order added). Otherwise the tree's longest-prefix tenant when
    matched tokens / prompt tokens > ``cache_threshold``, else the least loaded (``miss_policy``
    "smallest-tree": the tenant with the smallest tree, as v1 did). Either way the request is
    inserted for the chosen worker. Every ``eviction_interval_s`` of the callers' clock, tenants
    above ``max_tree_size_tokens`` lose LRU leaves.

    Known failure, kept: sessions sharing a long system prompt all match the first tenant that
    got it and pile there until the imbalance thresholds trip.
    """

    name = "sglang-cache-aware"

    def __init__(self, index: KVIndex | None = None, *, page_size: int | None = None,
                 cache_threshold: float = CACHE_THRESHOLD,
                 balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = BALANCE_REL_THRESHOLD,
                 eviction_interval_s: float = EVICTION_INTERVAL_S,
                 max_tree_size_tokens: int = MAX_TREE_SIZE_TOKENS,
                 miss_policy: str = "min-load") -> None:
        super().__init__()
        if miss_policy not in MISS_POLICIES:
            raise ValueError(f"miss_policy={miss_policy!r}: one of {MISS_POLICIES}")
        page_size = page_size or (index.page_size if index is not None else None)
        self.tree: ApproxTree | None = None if page_size is None else ApproxTree(page_size)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.eviction_interval_s = eviction_interval_s
        self.max_tree_size_tokens = max_tree_size_tokens
        self.miss_policy = miss_policy
        self._processed: dict[str, int] = {}
        self._last_evict_s: float | None = None
        self._last: tuple[str, str, int] | None = None  # request, worker, believed cached

    def add_worker(self, info: WorkerInfo) -> None:
        super().add_worker(info)
        if self.tree is None:
            self.tree = ApproxTree(info.page_size)

    def remove_worker(self, worker_id: str) -> None:
        super().remove_worker(worker_id)
        self._processed.pop(worker_id, None)
        if self.tree is not None:
            self.tree.remove_tenant(worker_id)

    def route(self, req: RouteRequest, candidates: Sequence[str]) -> Decision:
        order = self._ordered(candidates)
        tree = self.tree if self.tree is not None else self._default_tree()
        cached, reason = 0, "load"
        if self.is_imbalanced(order):
            pick = self._least_loaded(order)
        else:
            depth, tenant = tree.prefix_match(req.page_hashes)
            cached = min(depth * tree.page_size, req.num_tokens)
            if tenant in order and cached > self.cache_threshold * max(req.num_tokens, 1):
                pick, reason = tenant, "prefix"
            else:
                pick, cached = self._on_miss(order, tree), 0
                reason = "load" if depth else "cold"
        tree.insert(req.page_hashes, pick)
        self._processed[pick] = self._processed.get(pick, 0) + 1
        self._last = (req.request_id, pick, cached)
        return Decision(pick, cached_tokens=cached, reason=reason)

    def is_imbalanced(self, workers: Sequence[str]) -> bool:
        loads = [self.load.num_in_flight(w) for w in workers]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def dispatched(self, req: RouteRequest, worker_id: str, now_s: float) -> None:
        super().dispatched(req, worker_id, now_s)
        self._tick(now_s)

    def first_token(self, request_id: str, now_s: float) -> None:
        super().first_token(request_id, now_s)
        self._tick(now_s)

    def finished(self, request_id: str, now_s: float) -> None:
        super().finished(request_id, now_s)
        self._tick(now_s)

    # ---------------------------------------------------------------- helpers

    def _cached_tokens(self, req: RouteRequest, worker_id: str) -> int:
        last = self._last
        return last[2] if last is not None and last[:2] == (req.request_id, worker_id) else 0

    def _least_loaded(self, order: list[str]) -> str:
        return min(order, key=lambda w: (self.load.num_in_flight(w), self._processed.get(w, 0)))

    def _on_miss(self, order: list[str], tree: ApproxTree) -> str:
        if self.miss_policy == "smallest-tree":
            return min(order, key=lambda w: tree.size_tokens.get(w, 0))
        return self._least_loaded(order)

    def _default_tree(self) -> ApproxTree:
        # NOTE: no index and no announced worker: one token per page is the tree's only safe unit
        self.tree = ApproxTree(1)
        return self.tree

    def _tick(self, now_s: float) -> None:
        """The eviction timer, on the callers' clock (a router never reads one)."""
        if self._last_evict_s is None:
            self._last_evict_s = now_s
        if now_s - self._last_evict_s < self.eviction_interval_s or self.tree is None:
            return
        self._last_evict_s = now_s
        for tenant in list(self.tree.size_tokens):
            self.tree.evict(tenant, self.max_tree_size_tokens)
