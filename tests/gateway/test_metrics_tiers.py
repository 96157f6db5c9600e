"""``/metrics`` for the KV tiers below the device: the routing index's L2 ("CPU") and L3
("GCACHE") views as gauges, and the cached prompt tokens split by the tier that served them.

No worker process: a real ``Dispatcher`` with a router is told its (unconnected) client turned
alive with a ``Welcome``, as ``WorkerClient`` tells it, so the router's ``KVFeed`` and
``KVIndex`` exist; KV events go into that index as its subscriber applies them, and the real
``GatewayMetrics`` renders the text a scrape gets."""

from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.protocol import PROTOCOL_VERSION, Finished, Welcome
from engine.worker.events import (
    MEDIUM_CPU,
    MEDIUM_GCACHE,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from gateway.dispatch import Dispatcher, WorkerClient
from gateway.lifespan import ModelState
from gateway.metrics import GatewayMetrics, HttpStats
from gateway.routing import KVIndex

PAGE = 16
WORKER = "w0"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def gateway(demo_model: ModelState) -> Iterator[tuple[GatewayMetrics, KVIndex]]:
    metrics = _make_metrics(demo_model)
    index = metrics.dispatcher.link.index  # type: ignore[union-attr]
    assert index is not None, "the router's index exists once a worker answered"
    try:
        yield metrics, index
    finally:
        for client in metrics.dispatcher.clients:
            client.close()


def test_index_gauges_count_each_tier_apart(gateway: tuple[GatewayMetrics, KVIndex]) -> None:
    metrics, index = gateway
    _assert_samples(_scrape(metrics), pages=0, host_pages=0, storage_pages=0)
    _feed(index, _stored(range(0, 3)), _stored(range(10, 12), MEDIUM_CPU),
          _stored(range(20, 24), MEDIUM_GCACHE))
    _assert_samples(_scrape(metrics), pages=3, host_pages=2, storage_pages=4)

    _feed(index, BlockRemoved(block_hashes=[10], medium=MEDIUM_CPU),
          _stored(range(20, 26), MEDIUM_GCACHE))  # NOTE: 4 confirmed again, 2 new
    _assert_samples(_scrape(metrics), pages=3, host_pages=1, storage_pages=6)

    _feed(index, AllBlocksCleared())  # NOTE: the worker's device and L2 views; L3 is shared
    _assert_samples(_scrape(metrics), pages=0, host_pages=0, storage_pages=6)


def test_cached_tokens_split_by_tier_sum_to_the_total(
    gateway: tuple[GatewayMetrics, KVIndex],
) -> None:
    metrics, _ = gateway
    stats = metrics.dispatcher.stats
    stats.finished(_finished(cached=64, host=16, storage=32))
    stats.finished(_finished(cached=8))  # NOTE: a worker without lower tiers: all device
    stats.finished(_finished(cached=16, host=16, storage=16))  # NOTE: clamped to the total
    samples = _scrape(metrics)
    tiers = {tier: samples[(_TIERS, (("tier", tier),))] for tier in ("device", "host", "storage")}
    assert tiers == {"device": 24, "host": 16, "storage": 48}, tiers
    total = samples[("agentgate_cached_prompt_tokens_total", ())]
    assert sum(tiers.values()) == total == 88, (tiers, total)


_TIERS = "agentgate_cached_prompt_tokens_by_tier_total"


def _make_metrics(model: ModelState) -> GatewayMetrics:
    client = WorkerClient("tcp://127.0.0.1:9")  # NOTE: never connected
    dispatcher = Dispatcher([client], router="agentgate")
    # NOTE: no events endpoint: the feed subscribes to nothing, the test applies the events
    client.welcome = Welcome(version=PROTOCOL_VERSION, worker_id=WORKER, instance_id="i0",
                             model="demo", page_size=PAGE, sliding_window=None,
                             max_context=4096)
    for listener in client.alive_listeners:
        listener()
    return GatewayMetrics(HttpStats(), dispatcher, model.prompt_cache)


def _feed(index: KVIndex, *events: KVEvent) -> None:
    """One batch on the worker's live stream, as ``KVEventSubscriber`` applies it."""
    seq = index.next_seq(WORKER)
    assert index.apply(WORKER, seq, KVEventBatch(ts=0.0, events=list(events))) is None


def _stored(hashes: range, medium: str = MEDIUM_GPU) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None,
                       token_ids=[0] * (PAGE * len(hashes)), block_size=PAGE, medium=medium)


def _finished(cached: int, host: int = 0, storage: int = 0) -> Finished:
    return Finished(request_id="r", finish_reason="length", prompt_tokens=100,
                    completion_tokens=1, cached_tokens=cached, cached_tokens_host=host,
                    cached_tokens_storage=storage)


def _scrape(metrics: GatewayMetrics) -> Samples:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _assert_samples(samples: Samples, **expected: int) -> None:
    got = {name: samples.get((f"agentgate_routing_index_{name}", ())) for name in expected}
    assert got == expected, f"got {got}, expected {expected}"
