"""What the gateway hands the router: affinity keys from headers and body fields (in order, per
tenant, bounded), page hashes (salted, routable, incremental per key), and a session store that
fails costing only the affinity."""

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st
from redis import asyncio as aioredis

from engine.hashing import page_hashes
from engine.protocol import Generate, SamplingSpec
from gateway.affinity import SharedAffinity
from gateway.affinity_keys import MAX_KEY_CHARS, affinity_key
from gateway.dispatch import Dispatcher, default_route
from gateway.generation import route_request
from gateway.routing.chain import PrefixHasher
from gateway.routing.types import RouteRequest
from gateway.worker_client import WorkerClient
from sessions.redis import RedisSessionStore
from tests.gateway.live import free_port

PAGE = 16


def test_the_first_hint_present_wins() -> None:
    assert affinity_key({"x-session-id": "s1", "x-smg-routing-key": "r"}, "p", "u") == "hdr:s1"
    assert affinity_key({"x-dynamo-session-id": "d"}, "p", "u") == "hdr:d"
    assert affinity_key({"x-smg-routing-key": "r"}, "p", "u") == "hdr:r"
    assert affinity_key({"x-session-id": "  "}, "p", "u") == "pck:p", "a blank header is none"
    assert affinity_key({}, None, "u") == "user:u"
    assert affinity_key({}, None, None) is None


def test_a_long_key_is_hashed_to_a_bounded_one() -> None:
    long = "x" * 10_000
    key = affinity_key({"x-session-id": long}, None, None)
    assert key is not None and len(key) <= MAX_KEY_CHARS
    assert key == affinity_key({"x-session-id": long}, None, None), "stable"
    assert key != affinity_key({"x-session-id": long + "y"}, None, None)


def test_route_request_keys_by_tenant_and_hashes_the_routable_pages() -> None:
    d = _dispatcher_with_hasher()
    ids = list(range(1, 100))  # NOTE: 99 tokens: 6 routable pages ((99 - 1) // 16)
    a = route_request(d, _generate(ids, salt="t-a"), "hdr:s")
    b = route_request(d, _generate(ids, salt="t-b"), "hdr:s")
    anon = route_request(d, _generate(ids, salt=None), "hdr:s")
    assert (a.affinity_key, b.affinity_key, anon.affinity_key) == (
        "t-a/hdr:s", "t-b/hdr:s", "anonymous/hdr:s")
    assert list(a.page_hashes) == page_hashes(ids, PAGE, "t-a")[:6]
    assert set(a.page_hashes).isdisjoint(b.page_hashes), "tenants' pages never match"
    assert (a.tenant, a.num_tokens, a.max_new_tokens) == ("t-a", 99, 5)


def test_a_session_turn_is_keyed_by_its_session() -> None:
    d = _dispatcher_with_hasher()
    route = route_request(d, _generate([1] * 40, salt="t-a", session_id="sess_1"))
    assert route.affinity_key == "t-a/session:sess_1"
    assert default_route(_generate([1] * 40, session_id="s")).affinity_key == "s"


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 500), min_size=0, max_size=60), min_size=1, max_size=5))
def test_hashes_of_a_growing_history_equal_a_full_rehash(growth: list[list[int]]) -> None:
    d = _dispatcher_with_hasher()
    ids: list[int] = [7] * 20
    for more in growth:
        ids = ids + more
        route = route_request(d, _generate(ids, salt="t"), "hdr:conv")
        expected = page_hashes(ids, PAGE, "t")[: max(0, (len(ids) - 1) // PAGE)]
        assert list(route.page_hashes) == expected


def test_a_store_that_fails_costs_only_the_affinity() -> None:
    async def main() -> None:
        # NOTE: a real client against a port nobody listens on
        client = aioredis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=1)
        affinity = SharedAffinity(RedisSessionStore(client))
        route = RouteRequest(request_id="r", num_tokens=10, affinity_key="t/hdr:s")
        await affinity.load(route)
        assert route.sticky_worker is None
        affinity.decided(route, "w0")
        await affinity.settle(timeout_s=5.0)
        assert affinity.num_failures == 2 and route.sticky_worker == "w0"
        await client.aclose()

    asyncio.run(main())


def _dispatcher_with_hasher() -> Dispatcher:
    d = Dispatcher([WorkerClient("tcp://127.0.0.1:1")], router="least-loaded")
    d._hasher = PrefixHasher(PAGE)  # NOTE: what the first Welcome's page size would make
    return d


def _generate(ids: list[int], salt: str | None = None, session_id: str | None = None
              ) -> Generate:
    return Generate(request_id="g", input_ids=ids, cache_salt=salt, session_id=session_id,
                    sampling=SamplingSpec(max_new_tokens=5))
