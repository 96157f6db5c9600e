"""Baseline routers without a tree: round-robin, least-loaded, session-hash, LMetric."""

from __future__ import annotations

from gateway.routing import (
    LeastLoadedRouter,
    LMetricRouter,
    RoundRobinRouter,
    RouteRequest,
    SessionHashRouter,
)
from tests.gateway.routing_helpers import (
    add_workers,
    chain,
    checkpoint,
    feed,
    make_index,
    make_request,
    send,
    stored,
)

WORKERS = ("w0", "w1", "w2")


def _req(rid: str, key: str | None = None) -> RouteRequest:
    return make_request(rid, (), key=key, num_tokens=10)


def test_round_robin_cycles_and_skips_non_candidates() -> None:
    router = RoundRobinRouter()
    add_workers(router, *WORKERS)
    picks = [send(router, _req(f"r{i}"), WORKERS) for i in range(6)]
    assert picks == ["w0", "w1", "w2", "w0", "w1", "w2"]
    # w0 excluded: the cycle goes on from the last pick, skipping it
    picks = [send(router, _req(f"s{i}"), ("w1", "w2")) for i in range(3)]
    assert picks == ["w1", "w2", "w1"]


def test_least_loaded_is_the_old_dispatcher_pick() -> None:
    router = LeastLoadedRouter()
    add_workers(router, *WORKERS)
    # no load: sessions spread in round-robin order
    assert [send(router, _req(f"a{i}", key=f"s{i}"), WORKERS) for i in range(3)] == list(WORKERS)
    # a session stays on its worker while it is a candidate, loaded or not
    assert send(router, _req("b0", key="s0"), WORKERS) == "w0"
    assert router.route(_req("b1", key="s0"), WORKERS).reason == "affinity"
    # fewest in flight wins: w0 has 2, w1 and w2 have 1 each; tie -> fewest sessions -> rr
    assert send(router, _req("c0"), WORKERS) == "w1"
    assert send(router, _req("c1"), WORKERS) == "w2"
    # its worker excluded: the session moves, and is remembered there
    decision = router.route(_req("d0", key="s0"), ("w1", "w2"))
    assert decision.worker_id == "w1" and decision.reason == "moved_for_load"
    assert router.route(_req("d1", key="s0"), WORKERS).worker_id == "w1"


def test_least_loaded_ties_on_sessions_before_round_robin() -> None:
    router = LeastLoadedRouter()
    add_workers(router, *WORKERS)
    for i, w in enumerate(WORKERS):
        router.route(_req(f"x{i}", key=f"k{i}"), (w,))  # one session each, nothing in flight
    router.route(_req("y", key="k9"), ("w0",))  # w0 now has two sessions
    picks = [router.route(_req(f"z{i}"), WORKERS).worker_id for i in range(2)]
    assert "w0" not in picks and set(picks) == {"w1", "w2"}


def test_least_loaded_follows_the_session_stores_worker() -> None:
    router = LeastLoadedRouter()
    add_workers(router, *WORKERS)
    req = RouteRequest(request_id="r", num_tokens=5, affinity_key="s", sticky_worker="w2")
    assert router.route(req, WORKERS).worker_id == "w2"


def test_session_hash_is_stable_and_moves_about_one_nth_on_worker_add() -> None:
    router = SessionHashRouter()
    add_workers(router, "w0", "w1", "w2", "w3")
    keys = [f"session-{i}" for i in range(2000)]
    before = {k: router.route(_req(k, key=k), ("w0", "w1", "w2", "w3")).worker_id for k in keys}
    assert before == {k: router.route(_req(k, key=k), ("w0", "w1", "w2", "w3")).worker_id
                      for k in keys}
    assert min(list(before.values()).count(w) for w in ("w0", "w1", "w2", "w3")) > 300
    add_workers(router, "w4")
    all5 = ("w0", "w1", "w2", "w3", "w4")
    after = {k: router.route(_req(k, key=k), all5).worker_id for k in keys}
    moved = [k for k in keys if after[k] != before[k]]
    assert all(after[k] == "w4" for k in moved), "a key moved between old workers"
    assert 0.12 < len(moved) / len(keys) < 0.3, len(moved)


def test_session_hash_non_candidate_moves_only_its_keys() -> None:
    router = SessionHashRouter()
    add_workers(router, *WORKERS)
    keys = [f"k{i}" for i in range(300)]
    before = {k: router.route(_req(k, key=k), WORKERS).worker_id for k in keys}
    after = {k: router.route(_req(k, key=k), ("w0", "w2")).worker_id for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "w1")
    assert all(after[k] in ("w0", "w2") for k in keys)


def test_session_hash_without_key_goes_to_fewest_in_flight() -> None:
    router = SessionHashRouter()
    add_workers(router, *WORKERS)
    assert [send(router, _req(f"r{i}"), WORKERS) for i in range(3)] == list(WORKERS)
    router.finished("r1", 1.0)
    assert router.route(_req("r3"), WORKERS).worker_id == "w1"


def test_lmetric_trades_uncached_tokens_against_batch_size() -> None:
    index = make_index("w0", "w1")
    prefix = chain(100, 10)
    feed(index, "w0", stored(prefix[:8]))  # 8 of 10 pages, no SWA window left: raw credit
    router = LMetricRouter(index)
    add_workers(router, "w0", "w1")
    req = make_request("q", prefix)  # 41 tokens; w0: 9 uncached, w1: 41
    for i in range(3):
        router.dispatched(_req(f"busy{i}"), "w0", 0.0)
    decision = router.route(req, ("w0", "w1"))  # 9 x 4 = 36 < 41 x 1
    assert (decision.worker_id, decision.cached_tokens) == ("w0", 32)
    router.dispatched(_req("busy3"), "w0", 0.0)
    router.dispatched(_req("busy4"), "w0", 0.0)
    assert router.route(req, ("w0", "w1")).worker_id == "w1"  # 9 x 6 = 54 > 41


def test_lmetric_credits_the_raw_match_not_the_window_safe_one() -> None:
    index = make_index("w0", "w1")
    prefix = chain(100, 10)
    feed(index, "w0", stored(prefix[:6]))
    feed(index, "w1", stored(prefix[:4]), checkpoint(prefix[3]))
    assert index.match(prefix)["w0"].usable_pages == 0
    assert index.match(prefix)["w1"].usable_pages == 4
    router = LMetricRouter(index)
    add_workers(router, "w0", "w1")
    assert router.route(make_request("q", prefix), ("w0", "w1")).worker_id == "w0"
