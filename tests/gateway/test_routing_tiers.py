"""Tier credit in the router: KV events with medium "CPU" (a worker's L2) and "GCACHE" (the L3
store every worker shares) extend a worker's match by the window rule across tiers, and the
policy credits those pages below device hits (gateway.routing.tiers, matching.extend_match).

Events take the engine's path: ``CacheEvent``s through ``KVEventBuffer``, encoded and decoded as
the subscriber gets them.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from engine.kv.layout import usable_pages
from engine.kv.prefix_cache import CacheEvent
from engine.worker.events import KVEventBatch, decode_batch, encode_batch
from engine.worker.publisher import KVEventBuffer
from gateway.routing import AgentgateRouter, KVIndex, MatchResult, RouteRequest, WorkerInfo

PAGE = 4
K = 2  # window pages
WINDOW = K * PAGE
CHAIN = list(range(1000, 1200))  # 200 pages: even a quarter credit saves more than a step
GPU, CPU, GCACHE = "GPU", "CPU", "GCACHE"


class _Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _make_index(*workers: str, window_pages: int = K, **kwargs) -> KVIndex:
    index = KVIndex(PAGE, **kwargs)
    for w in workers:
        index.add_worker(w, window_pages=window_pages)
    return index


def _publish(index: KVIndex, worker: str, events: list[CacheEvent], window: int = WINDOW) -> None:
    """One step's events of ``worker``, merged, encoded and applied as the subscriber does."""
    buf = KVEventBuffer(PAGE, window)
    for event in events:
        buf.add(event)
    payload = encode_batch(KVEventBatch(ts=0.0, events=buf.drain()))
    assert index.apply(worker, index.next_seq(worker), decode_batch(payload)) is None


def _stored(hashes: list[int], medium: str = GPU, swa: bool = True,
            parent: int | None = None) -> list[CacheEvent]:
    """Pages in chain order (``parent``: the page before the first), with their SWA or not."""
    out = []
    for h in hashes:
        out.append(CacheEvent("stored", h, parent, (0,) * PAGE, swa=swa, medium=medium))
        parent = h
    return out


def _events(kind: str, hashes: list[int], medium: str) -> list[CacheEvent]:
    return [CacheEvent(kind, h, medium=medium) for h in hashes]


def _assert_match(index: KVIndex, hashes: list[int], expected: dict[str, MatchResult]) -> None:
    got = index.match(hashes)
    assert got == expected, f"match: got {got}, expected {expected}"


def _make_router(index: KVIndex, *workers: str) -> AgentgateRouter:
    router = AgentgateRouter(index, optimistic_ttl_s=0.0, prefix_affinity=0.0)
    for rank, w in enumerate(workers):
        router.add_worker(WorkerInfo(worker_id=w, page_size=PAGE, sliding_window=WINDOW,
                                     rank=rank))
    return router


def _request(rid: str, hashes: list[int]) -> RouteRequest:
    return RouteRequest(request_id=rid, num_tokens=len(hashes) * PAGE + 1,
                        page_hashes=tuple(hashes))


# ------------------------------------------------------------------------------- credit order


def test_host_hits_beat_no_hits() -> None:
    index = _make_index()
    router = _make_router(index, "b", "a")  # NOTE: b first: the tie-break would pick it
    _publish(index, "a", _stored(CHAIN, CPU))
    _assert_match(index, CHAIN, {"a": MatchResult(200, 200, 200, 0)})
    decision = router.route(_request("r", CHAIN), ["b", "a"])
    assert (decision.worker_id, decision.reason) == ("a", "prefix"), decision
    assert decision.cached_tokens == 200 * PAGE // 2, decision  # host_credit 0.5


def test_device_hits_beat_host_hits() -> None:
    for order in (["gpu", "cpu"], ["cpu", "gpu"]):
        index = _make_index()
        router = _make_router(index, *order)
        _publish(index, "gpu", _stored(CHAIN, GPU))
        _publish(index, "cpu", _stored(CHAIN, CPU))
        decision = router.route(_request("r", CHAIN), order)
        assert decision.worker_id == "gpu", (order, decision)


def test_credit_order_device_host_storage_none() -> None:
    """At equal (no) load: device < host < storage-only < cold in predicted TTFT."""
    index = _make_index()
    router = _make_router(index, "gpu", "cpu", "other")
    _publish(index, "gpu", _stored(CHAIN, GPU))
    _publish(index, "cpu", _stored(CHAIN, CPU))
    cold = router.route(_request("cold", CHAIN), ["other"])
    assert (cold.cached_tokens, cold.reason) == (0, "cold"), cold
    _publish(index, "gpu", _stored(CHAIN, GCACHE))  # NOTE: now "other" can fetch it from L3
    ttft = {w: router.route(_request(w, CHAIN), [w]).predicted_ttft_s
            for w in ("gpu", "cpu", "other")}
    assert ttft["gpu"] < ttft["cpu"] < ttft["other"] < cold.predicted_ttft_s, (ttft, cold)
    assert router.route(_request("all", CHAIN), ["other", "cpu", "gpu"]).worker_id == "gpu"
    assert router.route(_request("low", CHAIN), ["other", "cpu"]).worker_id == "cpu"
    storage = router.route(_request("s", CHAIN), ["other"])
    assert (storage.cached_tokens, storage.reason) == (200 * PAGE // 4, "prefix"), storage


def test_gpu_only_events_give_the_device_credit_unchanged() -> None:
    index = _make_index()
    router = _make_router(index, "a", "b")
    _publish(index, "a", _stored(CHAIN, GPU))
    _assert_match(index, CHAIN, {"a": MatchResult(200, 200)})
    assert index.match(CHAIN)["a"] == (200, 200, 0, 0)
    decision = router.route(_request("r", CHAIN), ["b", "a"])
    assert (decision.worker_id, decision.cached_tokens) == ("a", 200 * PAGE), decision


# ------------------------------------------------------------------------------- shared L3


def test_a_storage_page_published_by_one_worker_credits_every_worker() -> None:
    index = _make_index("a", "b")
    _publish(index, "a", _stored(CHAIN[:5], GCACHE))
    same = MatchResult(5, 5, 0, 5)
    _assert_match(index, CHAIN[:5], {"a": same, "b": same})
    # NOTE: b's own device pages stay device hits; L3 carries it on from there
    _publish(index, "b", _stored(CHAIN[:2], GPU))
    _assert_match(index, CHAIN[:5], {"a": same, "b": MatchResult(5, 5, 0, 3)})


def test_salted_chains_stay_apart_in_the_shared_set() -> None:
    """Tenants are kept apart by their salted hashes: another tenant's chain of the same tokens
    has other hashes and gets nothing from the first one's L3 pages."""
    from engine.hashing import page_hashes

    tokens = list(range(5 * PAGE))
    mine, theirs = page_hashes(tokens, PAGE, cache_salt="t1"), page_hashes(tokens, PAGE,
                                                                           cache_salt="t2")
    index = _make_index("a", "b")
    _publish(index, "a", _stored(mine, GCACHE))
    assert index.match(mine)["b"] == MatchResult(5, 5, 0, 5)
    assert index.match(theirs) == {}


def test_storage_cap_drops_the_least_recently_confirmed() -> None:
    clock = _Clock()
    index = _make_index("a", "b", max_storage_pages=6, clock=clock)
    _publish(index, "a", _stored(CHAIN[:4], GCACHE))  # NOTE: 4 full + 4 SWA entries
    assert index.num_storage_pages == 6 and index.storage.num_evicted == 2
    # pages 0 and 1 (full) went first: nothing reaches page 0 any more
    _assert_match(index, CHAIN[:4], {})
    _publish(index, "b", _stored(CHAIN[:2], GCACHE))  # NOTE: confirmed again: young
    assert index.num_storage_pages == 6
    assert index.match(CHAIN[:2])["a"] == MatchResult(2, 2, 0, 2)


def test_storage_entries_age_out_by_the_ttl_unless_confirmed_again() -> None:
    clock = _Clock()
    index = _make_index("a", "b", storage_ttl_s=10.0, clock=clock)
    _publish(index, "a", _stored(CHAIN[:3], GCACHE))
    clock.now_s = 5.0
    _publish(index, "b", _stored(CHAIN[3:5], GCACHE, parent=CHAIN[2]))
    assert index.match(CHAIN[:5])["b"] == MatchResult(5, 5, 0, 5)
    clock.now_s = 10.0  # NOTE: pages 0-2 are 10 s old: gone; 3-4 stay but page 0 is missing
    assert index.match(CHAIN[:5]) == {}
    assert index.num_storage_pages == 4 and index.storage.num_expired == 6
    _publish(index, "a", _stored(CHAIN[:3], GCACHE))  # NOTE: a lookup found them again
    assert index.match(CHAIN[:5])["b"] == MatchResult(5, 5, 0, 5)
    clock.now_s = 15.0
    assert index.match(CHAIN[:5])["b"] == MatchResult(3, 3, 0, 3)
    clock.now_s = 20.0
    assert index.match(CHAIN[:5]) == {} and index.num_storage_pages == 0


# ------------------------------------------------------------------------------- window rule


def test_window_rule_across_tiers() -> None:
    """Device full KV with its window's SWA only in L2 is usable (an L2 load of the SWA); a
    page whose SWA is nowhere ends no usable prefix."""
    index = _make_index("a")
    _publish(index, "a", _stored(CHAIN[:6], GPU) + _events("swa_dropped", CHAIN[4:6], GPU))
    _assert_match(index, CHAIN[:6], {"a": MatchResult(6, 4)})
    _publish(index, "a", _events("swa_stored", CHAIN[4:6], CPU))  # NOTE: demoted, not lost
    _assert_match(index, CHAIN[:6], {"a": MatchResult(6, 6, 2, 0)})
    _publish(index, "a", _stored(CHAIN[6:8], CPU, swa=False, parent=CHAIN[5]))
    _assert_match(index, CHAIN[:8], {"a": MatchResult(8, 6, 2, 0)})
    _publish(index, "a", _events("swa_stored", [CHAIN[7]], GCACHE))
    _assert_match(index, CHAIN[:8], {"a": MatchResult(8, 6, 2, 0)})  # page 6: no SWA anywhere
    _publish(index, "a", _events("swa_stored", [CHAIN[6]], CPU))
    # pages 6, 7 in the window: 6 full+SWA in L2, 7 full in L2 and SWA only in L3
    _assert_match(index, CHAIN[:8], {"a": MatchResult(8, 8, 1, 1)})


def test_the_extend_match_docstring_table() -> None:
    index = _make_index("a")
    _publish(index, "a", _stored(CHAIN[:2], GPU) + _stored([CHAIN[2]], GPU, swa=False,
                                                           parent=CHAIN[1]))
    _publish(index, "a", _stored(CHAIN[3:5], CPU, swa=False, parent=CHAIN[2])
             + _events("swa_stored", [CHAIN[2], CHAIN[4]], CPU)
             + _stored([CHAIN[5]], GCACHE, parent=CHAIN[4]))
    _assert_match(index, CHAIN[:6], {"a": MatchResult(6, 6, 2, 1)})


def test_no_swa_layers_credit_every_reachable_page() -> None:
    index = _make_index("a", window_pages=0)
    _publish(index, "a", _stored(CHAIN[:3], GPU, swa=False)
             + _stored(CHAIN[3:5], CPU, swa=False, parent=CHAIN[2]))
    _assert_match(index, CHAIN[:5], {"a": MatchResult(5, 5, 2, 0)})


# ------------------------------------------------------------------------------- removals, clears


def test_host_removal_drops_only_the_host_copy() -> None:
    index = _make_index("a")
    _publish(index, "a", _stored(CHAIN[:4], GPU) + _stored(CHAIN[:6], CPU))
    _assert_match(index, CHAIN[:6], {"a": MatchResult(6, 6, 2, 0)})
    _publish(index, "a", _events("removed", CHAIN[:6], CPU))
    _assert_match(index, CHAIN[:6], {"a": MatchResult(4, 4)})
    assert index.num_host_pages == 0 and index.num_pages == 4
    _publish(index, "a", _stored(CHAIN[:6], CPU) + _events("removed", CHAIN[:4], GPU))
    _assert_match(index, CHAIN[:6], {"a": MatchResult(6, 6, 6, 0)})


def test_all_blocks_cleared_keeps_the_shared_storage() -> None:
    index = _make_index("a", "b")
    _publish(index, "a", _stored(CHAIN[:2], GPU) + _stored(CHAIN[2:4], CPU, parent=CHAIN[1])
             + _stored(CHAIN[:3], GCACHE))
    _assert_match(index, CHAIN[:4], {"a": MatchResult(4, 4, 2, 0), "b": MatchResult(3, 3, 0, 3)})
    _publish(index, "a", [CacheEvent("cleared")])
    assert index.num_pages == 0 and index.num_host_pages == 0 and index.num_storage_pages == 6
    _assert_match(index, CHAIN[:4], {"a": MatchResult(3, 3, 0, 3), "b": MatchResult(3, 3, 0, 3)})


def test_restart_forgets_the_host_view() -> None:
    index = _make_index("a")
    _publish(index, "a", _stored(CHAIN[:3], CPU))
    assert index.note_instance("a", "one") is False
    assert index.note_instance("a", "two") is True
    assert index.num_host_pages == 0 and index.match(CHAIN[:3]) == {}


def test_host_cap_drops_the_biggest_workers_oldest() -> None:
    index = _make_index("a", "b", max_host_pages=5)
    _publish(index, "a", _stored(CHAIN[:4], CPU, swa=False))
    _publish(index, "b", _stored(CHAIN[:2], CPU, swa=False))
    assert index.num_host_pages == 5 and index.stats.evicted_host_pages == 1
    _assert_match(index, CHAIN[:4], {"b": MatchResult(2, 0)})  # a lost page 0: nothing


# ------------------------------------------------------------------------------- property

_TIERS = st.sampled_from(["", "c", "g", "cg"])  # per page and part: in L2 (c), L3 (g), both


@settings(max_examples=300, deadline=None)
@given(
    k=st.integers(0, 3),
    num_pages=st.integers(1, 12),
    device_full=st.integers(0, 12),
    data=st.data(),
)
def test_tiered_match_is_the_engine_rule_by_brute_force(
    k: int, num_pages: int, device_full: int, data: st.DataObject
) -> None:
    """Random tiers per page (device full KV a prefix, as the engine's cache is): the index's
    usable prefix is ``engine.kv.layout.usable_pages`` over "any tier", and each usable page is
    credited to the dearest part it needs, cheapest copy first."""
    hashes = CHAIN[:num_pages]
    g = min(device_full, num_pages)
    has_swa = st.booleans() if k else st.just(False)  # NOTE: SWA events would announce a k
    dev_swa = [data.draw(has_swa) for _ in range(g)] + [False] * (num_pages - g)
    full_low = [data.draw(_TIERS) for _ in range(num_pages)]
    swa_low = [data.draw(_TIERS if k else st.just("")) for _ in range(num_pages)]
    index = _make_index("a", "b", window_pages=k)
    window = max(1, k * PAGE)
    events = [CacheEvent("stored", h, hashes[i - 1] if i else None, (0,) * PAGE,
                         swa=dev_swa[i]) for i, h in enumerate(hashes[:g])]
    for tier, medium in (("c", CPU), ("g", GCACHE)):
        for i, h in enumerate(hashes):
            if tier in full_low[i]:
                events.append(CacheEvent("stored", h, hashes[i - 1] if i else None,
                                         (0,) * PAGE, medium=medium))
            if tier in swa_low[i]:
                events.append(CacheEvent("swa_stored", h, medium=medium))
    _publish(index, "a", events, window)

    full_any = [i < g or bool(full_low[i]) for i in range(num_pages)]
    swa_any = [dev_swa[i] or bool(swa_low[i]) for i in range(num_pages)]
    raw = next((i for i, f in enumerate(full_any) if not f), num_pages)
    usable = usable_pages(full_any, swa_any, k)
    lo = max(0, usable - k)
    tiers = []
    for i in range(usable):
        tier = 0 if i < g else (1 if "c" in full_low[i] else 2)
        if k and i >= lo and not dev_swa[i]:
            tier = max(tier, 1 if "c" in swa_low[i] else 2)
        tiers.append(tier)
    expected = MatchResult(raw, usable, tiers.count(1), tiers.count(2))
    got = index.match(hashes).get("a", MatchResult(0, 0))
    assert got == expected, (got, expected, g, dev_swa, full_low, swa_low)
    # b shares only L3: the same rule over L3 alone
    full_g = ["g" in t for t in full_low]
    swa_g = ["g" in t for t in swa_low]
    raw_b = next((i for i, f in enumerate(full_g) if not f), num_pages)
    usable_b = usable_pages(full_g, swa_g, k)
    got_b = index.match(hashes).get("b", MatchResult(0, 0))
    assert got_b == MatchResult(raw_b, usable_b, 0, usable_b), (got_b, full_low, swa_low)
