"""``make_router``: every name builds its router; bad names and missing indexes are clear
errors."""

from __future__ import annotations

import importlib.util

import pytest

from gateway.routing import ROUTER_NAMES, KVIndex, make_router
from gateway.routing.registry import NEEDS_INDEX
from gateway.routing.types import RouteRequest, WorkerInfo

HAS_AGENTGATE = importlib.util.find_spec("gateway.routing.policy") is not None
BUILT = [n for n in ROUTER_NAMES if n != "agentgate" or HAS_AGENTGATE]


def test_router_names_are_the_agreed_ones() -> None:
    assert ROUTER_NAMES == ("agentgate", "round-robin", "least-loaded", "session-hash",
                            "sglang-cache-aware", "dynamo", "llm-d", "lmetric")


@pytest.mark.parametrize("name", BUILT)
def test_each_name_builds_its_router(name: str) -> None:
    router = make_router(name, KVIndex(16))
    assert router.name == name


@pytest.mark.parametrize("name", [n for n in ROUTER_NAMES if n not in NEEDS_INDEX])
def test_routers_without_index_accept_none(name: str) -> None:
    assert make_router(name, None).name == name


@pytest.mark.parametrize("name", sorted(NEEDS_INDEX))
def test_routers_reading_the_index_refuse_none(name: str) -> None:
    with pytest.raises(ValueError, match="KV index"):
        make_router(name, None)


def test_unknown_name_lists_the_names() -> None:
    with pytest.raises(ValueError, match="unknown router 'random'") as err:
        make_router("random", None)
    assert all(n in str(err.value) for n in ROUTER_NAMES)


def test_options_reach_the_router() -> None:
    router = make_router("sglang-cache-aware", KVIndex(16), cache_threshold=0.5)
    assert router.cache_threshold == 0.5
    with pytest.raises(TypeError):
        make_router("dynamo", KVIndex(16), no_such_option=1)


# NOTE: dynamo and llm-d break ties at random (as the real ones do); session-hash hashes
@pytest.mark.parametrize("name", ["agentgate", "round-robin", "least-loaded", "lmetric",
                                  "sglang-cache-aware"])
def test_ties_follow_the_rank_not_the_order_workers_arrived(name: str) -> None:
    """The gateway ranks workers in their configured order; Welcomes arrive in any order. An
    idle pick goes to rank 0, also after it left and came back."""
    router = make_router(name, KVIndex(16))
    for worker_id, rank in (("c", 2), ("b", 1), ("a", 0)):
        router.add_worker(WorkerInfo(worker_id, 16, rank=rank))
    assert router.route(RouteRequest("r0", 100), ["c", "b", "a"]).worker_id == "a"
    fresh = make_router(name, KVIndex(16))
    for worker_id, rank in (("a", 0), ("c", 2), ("b", 1)):
        fresh.add_worker(WorkerInfo(worker_id, 16, rank=rank))
    fresh.remove_worker("a")
    fresh.add_worker(WorkerInfo("a", 16, rank=0))
    assert fresh.route(RouteRequest("r1", 100), ["c", "b", "a"]).worker_id == "a"
