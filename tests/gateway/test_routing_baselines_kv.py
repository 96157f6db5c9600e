"""Dynamo's KV router cost and llm-d's sticky-until-saturated: raw (SWA-blind) credit, load."""

from __future__ import annotations

import pytest

from engine.cost import H200_COST, CostModel
from gateway.routing import DynamoRouter, KVIndex, LlmDRouter, WorkerInfo
from tests.gateway.routing_helpers import (
    PAGE,
    add_workers,
    chain,
    checkpoint,
    feed,
    make_index,
    make_request,
    send,
    stored,
)

PROMPT = chain(100, 10)  # 10 routable pages, 41 tokens
BOTH = ("w0", "w1")


def _swa_lost_index() -> KVIndex:
    """w0 holds 8 pages of PROMPT with no live SWA window (usable 0); w1 holds 4 with one."""
    index = make_index(*BOTH)
    feed(index, "w0", stored(PROMPT[:8]))
    feed(index, "w1", stored(PROMPT[:4]), checkpoint(PROMPT[3]))
    match = index.match(PROMPT)
    assert (match["w0"].full_pages, match["w0"].usable_pages) == (8, 0)
    assert (match["w1"].full_pages, match["w1"].usable_pages) == (4, 4)
    return index


def _dynamo(index: KVIndex, **options: object) -> DynamoRouter:
    router = DynamoRouter(index, **options)  # type: ignore[arg-type]
    add_workers(router, *BOTH)
    return router


def test_dynamo_credits_a_prefix_whose_swa_windows_are_gone() -> None:
    router = _dynamo(_swa_lost_index())
    req = make_request("q", PROMPT)
    matches = router.index.match(PROMPT)
    assert router.cost(req, "w0", matches) == pytest.approx(41 / 4 - 8 + 10)
    assert router.cost(req, "w1", matches) == pytest.approx(41 / 4 - 4 + 10)
    decision = router.route(req, BOTH)
    assert (decision.worker_id, decision.cached_tokens) == ("w0", 8 * PAGE)


def test_agentgate_does_not_credit_what_dynamo_does() -> None:
    policy = pytest.importorskip("gateway.routing.policy")
    index = _swa_lost_index()
    router = policy.AgentgateRouter(index)
    add_workers(router, *BOTH)
    assert router.route(make_request("q", PROMPT), ("w0",)).cached_tokens == 0
    assert _dynamo(index).route(make_request("q", PROMPT), ("w0",)).cached_tokens == 8 * PAGE


def test_dynamo_cost_counts_active_prefill_and_distinct_active_blocks() -> None:
    index = make_index(*BOTH)
    feed(index, "w0", stored(PROMPT[:6]))
    router = _dynamo(index)
    req = make_request("q", PROMPT)
    assert router.route(req, BOTH).worker_id == "w0"  # 10.25 - 6 + 10 < 10.25 + 10
    busy = make_request("busy", chain(500, 5), num_tokens=20)
    router.dispatched(busy, "w0", 0.0)  # 20 uncached tokens, 5 active blocks
    assert router.cost(req, "w0", index.match(PROMPT)) == pytest.approx((20 + 41) / 4 - 6 + 15)
    assert router.route(req, BOTH).worker_id == "w1"  # 24.25 > 20.25
    # after its first token only the blocks count; after it ends, nothing
    router.first_token("busy", 1.0)
    assert router.cost(req, "w0", index.match(PROMPT)) == pytest.approx(41 / 4 - 6 + 15)
    router.finished("busy", 2.0)
    assert router.cost(req, "w0", index.match(PROMPT)) == pytest.approx(41 / 4 - 6 + 10)
    # blocks shared by requests in flight count once; the request's own are not new there
    router.dispatched(make_request("s1", PROMPT[:3], num_tokens=12), "w1", 3.0)
    router.dispatched(make_request("s2", PROMPT[:5], num_tokens=20), "w1", 3.0)
    router.first_token("s1", 3.0)
    router.first_token("s2", 3.0)
    assert router.cost(req, "w1", {}) == pytest.approx(41 / 4 + 5 + 5)


def test_dynamo_predicted_ttl_keeps_a_sibling_with_its_unconfirmed_prefix() -> None:
    def sibling_worker(seed: int, ttl_s: float | None, now_s: float) -> tuple[str, str]:
        router = _dynamo(make_index(*BOTH), predicted_ttl_s=ttl_s, seed=seed)
        first = send(router, make_request("a", PROMPT), BOTH, now_s=0.0)
        router.first_token("a", now_s)  # prefill done; its KV events have not come yet
        return first, router.route(make_request("b", PROMPT), BOTH).worker_id

    with_ttl = [sibling_worker(seed, 5.0, 1.0) for seed in range(8)]
    assert all(first == second for first, second in with_ttl)
    without = [sibling_worker(seed, None, 1.0) for seed in range(8)]
    assert any(first != second for first, second in without)  # a tie, broken at random
    expired = [sibling_worker(seed, 5.0, 6.0) for seed in range(8)]
    assert any(first != second for first, second in expired)


def _llmd(index: KVIndex, **options: object) -> LlmDRouter:
    router = LlmDRouter(index, exploration_probability=0.0, **options)  # type: ignore[arg-type]
    # 1,000 prefill tok/s at full steps: tau = 5 s x 1,000 = 5,000 uncached tokens in flight
    add_workers(router, *BOTH, cost=CostModel(0.0, 1e-3, 0.0, 0.0), max_batched_tokens=512)
    return router


def test_llmd_stays_sticky_until_saturated_then_breaks() -> None:
    index = make_index(*BOTH)
    feed(index, "w0", stored(PROMPT[:9]))  # hit 0.9 >= 0.8, raw: no SWA window known
    assert index.match(PROMPT)["w0"].usable_pages == 0
    router = _llmd(index)
    assert router.saturation_tokens("w0") == pytest.approx(5000)
    router.dispatched(make_request("busy", (), num_tokens=4000), "w0", 0.0)
    decision = router.route(make_request("q", PROMPT), BOTH)
    # w1's score (-41) beats w0's (-4004.1), but only w0 is a candidate while under tau
    assert (decision.worker_id, decision.reason) == ("w0", "prefix")
    assert decision.cached_tokens == 9 * PAGE
    router.dispatched(make_request("busy2", (), num_tokens=1001), "w0", 0.0)
    decision = router.route(make_request("q", PROMPT), BOTH)
    assert (decision.worker_id, decision.reason) == ("w1", "moved_for_load")
    router.first_token("busy2", 1.0)  # its prefill is done: under tau again
    assert router.route(make_request("q", PROMPT), BOTH).worker_id == "w0"


def test_llmd_below_the_affinity_threshold_goes_by_token_load() -> None:
    index = make_index(*BOTH)
    feed(index, "w0", stored(PROMPT[:7]))  # hit 0.7: no sticky candidate
    router = _llmd(index)
    assert router.route(make_request("q", PROMPT), BOTH).worker_id == "w0"  # -12.3 > -41
    router.dispatched(make_request("busy", (), num_tokens=100), "w0", 0.0)
    assert router.route(make_request("q", PROMPT), BOTH).worker_id == "w1"  # -112.3 < -41


def test_llmd_exploration_skips_the_gate() -> None:
    index = make_index(*BOTH)
    feed(index, "w0", stored(PROMPT[:9]))
    router = LlmDRouter(index, exploration_probability=1.0)
    add_workers(router, *BOTH)
    router.dispatched(make_request("busy", (), num_tokens=4000), "w0", 0.0)
    assert router.route(make_request("q", PROMPT), BOTH).worker_id == "w1"


def test_llmd_tau_from_the_h200_cost_model() -> None:
    router = LlmDRouter(make_index("w"))
    router.add_worker(WorkerInfo("w", page_size=PAGE, cost=H200_COST, max_batched_tokens=8192))
    # 8192 / (0.02 + 8192 x 5e-5) = 19,070 tok/s, x 5 s
    assert router.saturation_tokens("w") == pytest.approx(8192 / 0.4296 * 5)
    assert round(router.saturation_tokens("w")) == 95345
