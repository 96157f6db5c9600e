"""SGLang ``cache_aware``: its approximate tree and its known failure on a shared system prompt."""

from __future__ import annotations

from engine.worker.events import AllBlocksCleared
from gateway.routing import SGLangCacheAwareRouter
from gateway.routing.baselines_sglang import ApproxTree
from tests.gateway.routing_helpers import (
    PAGE,
    add_workers,
    chain,
    feed,
    make_index,
    make_request,
    send,
    stored,
)

WORKERS = ("w0", "w1", "w2", "w3")
SYSTEM = chain(1_000, 8)  # a system prompt every session shares


def _session_turn(i: int) -> list[int]:
    return SYSTEM + chain(10_000 + 10 * i, 2)  # 8 shared pages + 2 of its own: rate 0.78


def _router(**options: object) -> SGLangCacheAwareRouter:
    router = SGLangCacheAwareRouter(page_size=PAGE, **options)  # type: ignore[arg-type]
    add_workers(router, *WORKERS)
    return router


def test_shared_system_prompt_piles_on_one_worker_until_imbalance() -> None:
    router = _router()
    picks = [send(router, make_request(f"r{i}", _session_turn(i)), WORKERS) for i in range(68)]
    # the first takes the least loaded (w0), every next one matches the system prompt there
    assert picks[:65] == ["w0"] * 65
    # 65 - 0 > 64 and 65 > 1.5 x 0: imbalanced -> least loaded, one each
    assert picks[65:68] == ["w1", "w2", "w3"]
    # w1..w3 now hold 1 each: 65 - 1 > 64 is false, so the pile-up resumes on w0
    assert send(router, make_request("again", _session_turn(99)), WORKERS) == "w0"


def test_pile_up_resumes_once_requests_finish() -> None:
    router = _router()
    for i in range(66):
        send(router, make_request(f"r{i}", _session_turn(i)), WORKERS)
    for i in range(10):
        router.finished(f"r{i}", 1.0)
    # balanced again (55 vs 1): the tree's tenant for the prompt is still w0
    decision = router.route(make_request("x", _session_turn(500)), WORKERS)
    assert (decision.worker_id, decision.reason) == ("w0", "prefix")
    assert decision.cached_tokens == len(SYSTEM) * PAGE


def test_low_match_rate_goes_to_least_loaded_and_is_still_inserted() -> None:
    router = _router()
    send(router, make_request("a", SYSTEM), WORKERS)  # w0
    short = SYSTEM[:2] + chain(50_000, 8)  # 2 of 10 pages match: 8/41 tokens <= 0.3
    decision = router.route(make_request("b", short), WORKERS)
    assert decision.worker_id == "w1" and decision.cached_tokens == 0
    router.dispatched(make_request("b", short), "w1", 0.0)
    # inserted for w1: the same prompt now matches there
    assert router.route(make_request("c", short), WORKERS).worker_id == "w1"


def test_smallest_tree_miss_policy_of_v1() -> None:
    router = _router(miss_policy="smallest-tree")
    send(router, make_request("a", chain(1, 10)), WORKERS)  # empty tree: w0 (first smallest)
    send(router, make_request("b", chain(100, 3)), WORKERS)  # w1: smallest tree, load or not
    router.finished("a", 0.0)
    # w0 idle now but its tree is the biggest; w2 and w3 hold nothing
    assert router.route(make_request("c", chain(200, 3)), WORKERS).worker_id == "w2"


def test_tree_is_bounded_only_by_its_size_lru_on_a_timer() -> None:
    router = _router(max_tree_size_tokens=3 * PAGE, eviction_interval_s=60.0)
    old, new = chain(1, 5), chain(100, 5)
    send(router, make_request("a", old), WORKERS, now_s=0.0)  # w0
    send(router, make_request("b", new), WORKERS, now_s=1.0)  # w1 (least loaded)
    router.finished("a", 30.0)
    tree = router.tree
    assert tree is not None and tree.size_tokens == {"w0": 20, "w1": 20}
    router.finished("b", 61.0)  # the 60 s timer: each tenant cut to 3 pages, from the leaves
    assert tree.size_tokens["w0"] == 3 * PAGE and tree.size_tokens["w1"] == 3 * PAGE
    assert tree.prefix_match(old) == (3, "w0") and tree.prefix_match(new) == (3, "w1")


def test_tree_evicts_the_least_recently_used_branch_first() -> None:
    tree = ApproxTree(PAGE)
    trunk = chain(1, 2)
    tree.insert(trunk + [10, 11], "w0")
    tree.insert(trunk + [20, 21], "w0")
    tree.prefix_match(trunk + [10, 11])  # the first branch used again
    assert tree.evict("w0", 4 * PAGE) == 2 * PAGE
    assert tree.prefix_match(trunk + [20, 21])[0] == 2
    assert tree.prefix_match(trunk + [10, 11]) == (4, "w0")
    assert tree.evict("w0", 0) == 4 * PAGE and tree.num_nodes == 0


def test_tree_keeps_other_tenants_when_one_is_evicted_or_removed() -> None:
    tree = ApproxTree(PAGE)
    tree.insert(chain(1, 4), "a")
    tree.insert(chain(1, 2), "b")
    tree.evict("a", PAGE)
    assert tree.prefix_match(chain(1, 4)) == (2, "b")
    tree.remove_tenant("b")
    assert tree.prefix_match(chain(1, 4)) == (1, "a") and tree.num_nodes == 1


def test_removed_worker_leaves_the_tree() -> None:
    router = _router()
    send(router, make_request("a", SYSTEM), WORKERS)
    router.remove_worker("w0")
    decision = router.route(make_request("b", SYSTEM), ("w1", "w2", "w3"))
    assert decision.reason == "cold" and decision.worker_id == "w1"


def test_tree_never_sees_engine_evictions() -> None:
    index = make_index(*WORKERS)
    router = SGLangCacheAwareRouter(index)
    add_workers(router, *WORKERS)
    feed(index, "w0", stored(SYSTEM))
    assert send(router, make_request("a", SYSTEM), WORKERS) == "w0"
    router.finished("a", 1.0)
    feed(index, "w0", AllBlocksCleared())  # the engine dropped it all; the router can't know
    assert index.match(SYSTEM) == {}
    decision = router.route(make_request("b", SYSTEM), WORKERS)
    assert (decision.worker_id, decision.cached_tokens) == ("w0", len(SYSTEM) * PAGE)
