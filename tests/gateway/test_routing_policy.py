"""AgentgateRouter: window-safe credit, predicted TTFT, sticky until saturated, optimistic
entries for bursts, cold spreading."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest

from engine.cost import COST_PRESETS, H200_COST
from engine.worker.events import (
    BlockStored,
    KVEvent,
    KVEventBatch,
    SwaCheckpointDropped,
    SwaCheckpointStored,
)
from gateway.routing.index import KVIndex
from gateway.routing.policy import AgentgateRouter
from gateway.routing.types import REASONS, RouteRequest, WorkerInfo

PAGE = 16
WINDOW = 64  # k = 4 pages
WORKERS = ("w0", "w1", "w2", "w3")


def _chain(start: int, num_pages: int) -> list[int]:
    return list(range(start, start + num_pages))


def _make_router(**options: float) -> AgentgateRouter:
    router = AgentgateRouter(KVIndex(PAGE), **options)
    for w in WORKERS:
        router.add_worker(WorkerInfo(w, PAGE, H200_COST, max_batched_tokens=8192,
                                     sliding_window=WINDOW))
    return router


def _request(rid: str, hashes: Sequence[int], *, key: str | None = None,
             extra_tokens: int = 1, sticky: str | None = None) -> RouteRequest:
    return RouteRequest(request_id=rid, num_tokens=len(hashes) * PAGE + extra_tokens,
                        page_hashes=tuple(hashes), affinity_key=key, sticky_worker=sticky)


def _feed(router: AgentgateRouter, worker_id: str, *events: KVEvent) -> None:
    index = router.index
    seq = index.next_seq(worker_id)
    assert index.apply(worker_id, seq, KVEventBatch(ts=0.0, events=list(events))) is None


def _stored(hashes: Sequence[int], parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent,
                       token_ids=[0] * (PAGE * len(hashes)), block_size=PAGE)


def _send(router: AgentgateRouter, req: RouteRequest, now_s: float = 0.0,
          candidates: Sequence[str] = WORKERS) -> str:
    decision = router.route(req, candidates, now_s=now_s)
    assert decision.reason in REASONS
    router.dispatched(req, decision.worker_id, now_s)
    return decision.worker_id


def test_window_safe_credit_beats_the_raw_match() -> None:
    """w0 holds the whole chain but its windows are gone; w1 holds half of it with a live
    checkpoint. Only w1's hit is real: the router goes there and credits what w1 can use."""
    router = _make_router()
    chain = _chain(1000, 400)
    _feed(router, "w0", _stored(chain),
          SwaCheckpointStored(block_hashes=[chain[-1]], window=WINDOW),
          SwaCheckpointDropped(block_hashes=[chain[-1]]))
    _feed(router, "w1", _stored(chain[:200]),
          SwaCheckpointStored(block_hashes=[chain[199]], window=WINDOW))
    match = router.index.match(chain)
    assert match["w0"].full_pages == 400 and match["w0"].usable_pages == 0
    decision = router.route(_request("r", chain), WORKERS)
    assert (decision.worker_id, decision.reason) == ("w1", "prefix")
    assert decision.cached_tokens == 200 * PAGE


def test_the_last_prompt_token_is_never_credited() -> None:
    router = _make_router()
    chain = _chain(1, 100)  # NOTE: worth more than the tie band (one h200 step overhead)
    _feed(router, "w2", _stored(chain), SwaCheckpointStored(block_hashes=[chain[-1]],
                                                            window=WINDOW))
    req = RouteRequest(request_id="r", num_tokens=100 * PAGE, page_hashes=tuple(chain))
    decision = router.route(req, WORKERS)
    assert decision.worker_id == "w2" and decision.cached_tokens == 100 * PAGE - 1


def test_sticky_stays_within_the_margin_then_moves_for_load() -> None:
    router = _make_router(optimistic_ttl_s=0)
    first = _send(router, _request("t1", _chain(1, 1250), key="s"))  # 20k tokens
    router.finished("t1", 1.0)
    # other work queued on the session's worker: 8k tokens (0.4 s) is within the margin
    router.dispatched(_request("x1", _chain(10**6, 500)), first, 1.0)
    decision = router.route(_request("t2", _chain(1, 1250), key="s"), WORKERS)
    assert (decision.worker_id, decision.reason) == (first, "affinity")
    # 40k more tokens (2 s): past both margins (0.5 s and 1.5x)
    router.dispatched(_request("x2", _chain(2 * 10**6, 2500)), first, 1.0)
    decision = router.route(_request("t2", _chain(1, 1250), key="s"), WORKERS)
    assert decision.reason == "moved_for_load" and decision.worker_id != first


def test_sticky_worker_from_the_session_store_wins_over_the_routers_memory() -> None:
    router = _make_router()
    _send(router, _request("t1", _chain(1, 10), key="s"))
    decision = router.route(_request("t2", _chain(1, 12), key="s", sticky="w3"), WORKERS)
    assert (decision.worker_id, decision.reason) == ("w3", "affinity")


def _fan_out(router: AgentgateRouter) -> Counter[str]:
    """A parent turn with a 20k-token prompt, then 8 sub-agents that extend it by 100 tokens
    each, all before any KV event."""
    parent = _chain(1, 1250)
    owner = _send(router, _request("parent", parent), now_s=0.0)
    assert owner == "w0"
    placed = Counter[str]()
    for i in range(8):
        child = parent + _chain(10**6 * (i + 1), 6)
        placed[_send(router, _request(f"c{i}", child, extra_tokens=4), now_s=0.1)] += 1
    return placed


def test_a_burst_of_siblings_lands_on_the_prefix_owner_thanks_to_optimistic_entries() -> None:
    assert _fan_out(_make_router()) == {"w0": 8}


def test_without_optimistic_entries_the_burst_spreads_by_load() -> None:
    placed = _fan_out(_make_router(optimistic_ttl_s=0))
    assert len(placed) == 4 and placed["w0"] <= 2, placed


def test_identical_siblings_land_together() -> None:
    router = _make_router()
    prompt = _chain(5, 600)
    placed = {_send(router, _request(f"n{i}", prompt)) for i in range(8)}
    assert placed == {"w0"}


def test_optimistic_entries_expire() -> None:
    router = _make_router(optimistic_ttl_s=5.0)
    parent = _chain(1, 1250)
    assert _send(router, _request("parent", parent), now_s=0.0) == "w0"
    router.finished("parent", 1.0)
    child = _request("late", parent + [77], extra_tokens=4)
    early = router.route(child, WORKERS, now_s=4.0)
    assert (early.worker_id, early.cached_tokens) == ("w0", 1250 * PAGE)
    late = router.route(child, WORKERS, now_s=5.5)
    assert late.cached_tokens == 0 and late.reason == "cold"
    assert router.index.num_predicted_pages == 0


def test_confirmed_events_replace_optimistic_entries() -> None:
    router = _make_router()
    chain = _chain(1, 100)
    _send(router, _request("r", chain))
    assert router.index.num_predicted_pages == 100
    _feed(router, "w0", _stored(chain[:60]))
    assert router.index.num_predicted_pages == 40
    decision = router.route(_request("r2", chain + [5]), WORKERS, now_s=1.0)
    assert decision.worker_id == "w0" and decision.cached_tokens == 100 * PAGE


def test_a_sibling_that_leaves_the_chain_gets_no_window_from_a_prediction() -> None:
    """Predicted pages carry full KV only; a window is predicted only at the request's end."""
    router = _make_router()
    chain = _chain(1, 100)
    _send(router, _request("r", chain))
    match = router.index.match(chain[:50] + [999_999], now_s=0.5)["w0"]
    assert (match.full_pages, match.usable_pages) == (50, 0)


def test_cold_requests_spread() -> None:
    router = _make_router()
    placed = Counter(_send(router, _request(f"r{i}", _chain(10_000 * (i + 1), 50)))
                     for i in range(8))
    assert placed == {w: 2 for w in WORKERS}


def test_equal_idle_workers_take_turns_even_after_requests_finish() -> None:
    router = _make_router()
    placed = []
    for i in range(8):
        rid = f"r{i}"
        placed.append(_send(router, _request(rid, _chain(10_000 * (i + 1), 5))))
        router.finished(rid, 0.0)
    assert Counter(placed) == {w: 2 for w in WORKERS}


def test_remove_worker_forgets_everything_of_it() -> None:
    router = _make_router()
    chain = _chain(1, 100)
    w = _send(router, _request("r", chain, key="s"))
    assert router.sticky_worker("s") == w and router.load.num_in_flight(w) == 1
    router.remove_worker(w)
    assert router.sticky_worker("s") is None and router.load.num_in_flight(w) == 0
    assert router.index.num_predicted_pages == 0 and w not in router.index.match(chain, 0.1)
    others = [x for x in WORKERS if x != w]
    decision = router.route(_request("r2", chain, key="s"), others)
    assert decision.worker_id in others
    router.finished("r", 1.0)  # NOTE: the caller may still report the old request's end


def test_bad_options_are_named() -> None:
    with pytest.raises(ValueError, match="margin_ratio"):
        AgentgateRouter(KVIndex(PAGE), margin_ratio=0.5)
    with pytest.raises(ValueError, match="candidates"):
        _make_router().route(_request("r", [1]), [])


def test_history_credit_bets_on_the_raw_match_only_when_asked() -> None:
    """w0 holds the whole chain without a live window; w1 holds a quarter of it with one.
    Window-safe credit (the default) goes to w1; ``history_credit=1`` credits w0's raw match."""
    chain = _chain(1000, 400)
    routers = {hc: _make_router(history_credit=hc) for hc in (0.0, 1.0)}
    for router in routers.values():
        _feed(router, "w0", _stored(chain))
        _feed(router, "w1", _stored(chain[:100]),
              SwaCheckpointStored(block_hashes=[chain[99]], window=WINDOW))
    safe = routers[0.0].route(_request("r", chain), WORKERS)
    bet = routers[1.0].route(_request("r", chain), WORKERS)
    assert (safe.worker_id, safe.cached_tokens) == ("w1", 100 * PAGE)
    assert (bet.worker_id, bet.cached_tokens) == ("w0", 400 * PAGE)


def test_prefix_affinity_keeps_a_keyless_request_on_its_prefix_owner_within_the_margin() -> None:
    chain = _chain(1, 1250)  # 20k tokens, all cached on w0 with a live window
    picks = {}
    for pa in (0.0, 0.5):
        router = _make_router(work_weight=0.0, prefix_affinity=pa, optimistic_ttl_s=0)
        _feed(router, "w0", _stored(chain),
              SwaCheckpointStored(block_hashes=[chain[-1]], window=WINDOW))
        router.dispatched(_request("busy", _chain(10**7, 1625)), "w0", 0.0)  # 26k tokens queued
        picks[pa] = router.route(_request("r", chain, extra_tokens=8), WORKERS)
    assert picks[0.0].worker_id != "w0" and picks[0.0].reason == "load"
    assert (picks[0.5].worker_id, picks[0.5].reason) == ("w0", "prefix")


@pytest.mark.parametrize("cost", ["h200", "cpu"])
@pytest.mark.parametrize("work_weight", [1.0, 12.0, 50.0])
def test_new_sessions_sharing_a_short_system_prompt_spread_one_at_a_time(
    cost: str, work_weight: float
) -> None:
    """A shared system prompt whose cached page saves less than a step's overhead must not pull
    every new session onto its owner: near-equal predictions tie, and ties spread (the dispatch
    test's 20 sessions sharing "Be brief." all landed on one worker; again with work_weight 12
    and the cpu cost, until the band counted the work term too)."""
    router = AgentgateRouter(KVIndex(PAGE), work_weight=work_weight)
    for w in WORKERS:
        router.add_worker(WorkerInfo(w, PAGE, COST_PRESETS[cost], max_batched_tokens=8192,
                                     sliding_window=WINDOW))
    system = [1]  # one page, with a live window on w0
    _feed(router, "w0", _stored(system), SwaCheckpointStored(block_hashes=[1], window=WINDOW))
    placed = []
    for i in range(8):
        rid = f"s{i}"
        req = _request(rid, system + _chain(10_000 * (i + 1), 1), key=f"session-{i}")
        placed.append(_send(router, req))
        router.first_token(rid, 0.0)
        router.finished(rid, 0.0)
    assert Counter(placed) == {w: 2 for w in WORKERS}, placed


def test_a_shared_prefix_worth_more_than_the_tie_band_still_wins() -> None:
    router = _make_router()
    system = _chain(1, 200)  # 3,200 tokens with a live window on w0: ~0.16 s of h200 prefill
    _feed(router, "w0", _stored(system),
          SwaCheckpointStored(block_hashes=[system[-1]], window=WINDOW))
    req = _request("r", system + _chain(10_000, 2), key="new-session")
    assert router.route(req, WORKERS).worker_id == "w0"
