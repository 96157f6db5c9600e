"""Every registered router under random traffic (hypothesis): it always picks a candidate, and
once everything has ended, its router-side load is back to zero."""

from __future__ import annotations

import importlib.util

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from gateway.routing import ROUTER_NAMES, DynamoRouter, LoadTracker, make_router
from tests.gateway.routing_helpers import (
    add_workers,
    chain,
    checkpoint,
    feed,
    make_index,
    make_request,
    stored,
)

WORKERS = ("w0", "w1", "w2")
HAS_AGENTGATE = importlib.util.find_spec("gateway.routing.policy") is not None
NAMES = [n for n in ROUTER_NAMES if n != "agentgate" or HAS_AGENTGATE]
PREFIXES = [chain(1_000 * (i + 1), 12) for i in range(3)]

_request = st.tuples(st.integers(0, 2), st.integers(0, 12), st.integers(0, 5),
                     st.sampled_from([None, "s0", "s1", "s2"]))
_step = st.one_of(
    st.tuples(st.just("route"), _request, st.sets(st.sampled_from(WORKERS), min_size=1)),
    st.tuples(st.just("first_token"), st.integers(0, 50)),
    st.tuples(st.just("finished"), st.integers(0, 50)),
    st.tuples(st.just("stored"), st.sampled_from(WORKERS), st.integers(0, 2), st.integers(1, 12)),
    st.tuples(st.just("restart"), st.sampled_from(WORKERS)),
)


def _assert_idle(name: str, load: LoadTracker) -> None:
    counts = {w: (load.num_in_flight(w), load.prefill_tokens(w), load.num_decoding(w))
              for w in WORKERS}
    assert all(c == (0, 0, 0) for c in counts.values()), (name, counts)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(_step, max_size=60))
def test_router_picks_a_candidate_and_load_returns_to_zero(steps: list, name: str) -> None:
    index = make_index(*WORKERS)
    router = make_router(name, index)
    add_workers(router, *WORKERS)
    in_flight: list[str] = []
    for now_s, step in enumerate(steps):
        kind = step[0]
        if kind == "route":
            (prefix, num_pages, extra, key), candidates = step[1], sorted(step[2])
            req = make_request(f"r{now_s}", PREFIXES[prefix][:num_pages], key=key,
                               num_tokens=num_pages * 4 + 1 + extra)
            decision = router.route(req, candidates)
            assert decision.worker_id in candidates, (name, decision, candidates)
            router.dispatched(req, decision.worker_id, float(now_s))
            in_flight.append(req.request_id)
        elif kind in ("first_token", "finished") and in_flight:
            rid = in_flight[step[1] % len(in_flight)]
            getattr(router, kind)(rid, float(now_s))
            if kind == "finished":
                in_flight.remove(rid)
        elif kind == "stored":
            pages = PREFIXES[step[2]][: step[3]]
            feed(index, step[1], stored(pages), checkpoint(pages[-1]))
        elif kind == "restart":
            router.remove_worker(step[1])
            index.remove_worker(step[1])
            index.add_worker(step[1], window_pages=2)
            add_workers(router, step[1])
    for rid in in_flight:
        router.finished(rid, float(len(steps)))
    load = getattr(router, "load", None)
    if isinstance(load, LoadTracker):
        _assert_idle(name, load)
    if isinstance(router, DynamoRouter):
        assert all(router.active_blocks(w) == 0 for w in WORKERS)
