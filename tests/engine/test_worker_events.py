"""What a worker publishes (KV events under ``kv``, load reports under ``load``) and answers to
``GetLoad``/``Flush``, over the paced sim worker subprocess of ``conftest.py``; and how
``KVEventBuffer`` merges the prefix cache's events into batches.

(``test_events.py`` covers the event wire format, publisher and subscriber on their own.)
"""

from __future__ import annotations

from engine.hashing import page_hashes
from engine.kv.prefix_cache import CacheEvent
from engine.protocol import Abort, Flush, GetLoad, LoadReport
from engine.worker.events import (
    MEDIUM_CPU,
    MEDIUM_GCACHE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    SwaBlocksDropped,
    SwaBlocksStored,
    SwaCheckpointDropped,
    SwaCheckpointStored,
    encode_batch,
)
from engine.worker.publisher import KVEventBuffer
from tests.engine.worker_harness import (
    PAGE,
    WINDOW,
    Client,
    Subscription,
    assert_finished,
    make_prompt,
)


def test_load_report_numbers_are_sane(client: Client) -> None:
    client.send(GetLoad())
    report = client.recv()
    assert isinstance(report, LoadReport), report
    assert report.worker_id == "sim-test"
    assert report.free_full_pages > 0 and report.free_swa_pages > 0, report
    assert 0 <= report.used_bytes <= report.total_bytes, report
    assert report.num_running >= 0 and report.num_waiting >= 0, report


def test_request_publishes_chained_block_stored_and_a_checkpoint(
    client: Client, subscription: Subscription
) -> None:
    prompt = make_prompt(3 * PAGE)
    hashes = page_hashes(prompt, PAGE)
    client.generate("ev", prompt, max_new_tokens=4)  # stays inside the partial 4th page
    assert_finished(client.collect("ev")[1], "length", 4)

    def stored() -> list[BlockStored]:
        return [e for e in subscription.kv
                if isinstance(e, BlockStored) and set(e.block_hashes) & set(hashes)]

    def checkpointed() -> bool:
        return any(isinstance(e, SwaCheckpointStored) and hashes[-1] in e.block_hashes
                   for e in subscription.kv)

    def with_swa() -> set[int]:
        return {h for e in subscription.kv if isinstance(e, SwaBlocksStored)
                for h in e.block_hashes}

    subscription.wait_for(lambda: sum(len(e.block_hashes) for e in stored()) >= 3 and
                          checkpointed() and set(hashes) <= with_swa(),
                          "BlockStored + SwaBlocksStored + SwaCheckpointStored")
    events = stored()
    assert [h for e in events for h in e.block_hashes] == hashes, events
    parents = [None, *hashes]
    for e in events:
        assert e.parent_block_hash == parents[hashes.index(e.block_hashes[0])], e
        assert e.block_size == PAGE and len(e.token_ids) == PAGE * len(e.block_hashes), e
    assert [t for e in events for t in e.token_ids] == prompt
    ckpt = next(e for e in subscription.kv
                if isinstance(e, SwaCheckpointStored) and hashes[-1] in e.block_hashes)
    assert ckpt.window == WINDOW, ckpt


def test_flush_publishes_all_blocks_cleared(client: Client, subscription: Subscription) -> None:
    client.generate("fill", make_prompt(2 * PAGE), max_new_tokens=2)
    client.collect("fill")
    client.send(Flush())
    report = client.recv()
    assert isinstance(report, LoadReport), report
    assert (report.cached_pages, report.used_bytes) == (0, 0), report
    subscription.wait_for(lambda: any(isinstance(e, AllBlocksCleared) for e in subscription.kv),
                          "AllBlocksCleared")


def test_load_reports_are_published(client: Client, subscription: Subscription) -> None:
    client.generate("busy", make_prompt(8), max_new_tokens=300)  # ~2 s of sim decode
    subscription.wait_for(lambda: any(r.num_running == 1 for r in subscription.loads),
                          "a load report showing the running request")
    client.send(Abort(request_id="busy"))
    client.collect("busy")
    assert all(r.worker_id == "sim-test" for r in subscription.loads)


def test_kv_event_buffer_merges_runs_that_keep_their_meaning() -> None:
    buf = KVEventBuffer(page_size=2, window=4)
    for ev in [
        CacheEvent("stored", 1, None, (1, 2)), CacheEvent("stored", 2, 1, (3, 4)),
        CacheEvent("stored", 9, 5, (7, 7)),  # another branch: a new BlockStored
        CacheEvent("ckpt_stored", 2), CacheEvent("ckpt_stored", 9),
        CacheEvent("ckpt_dropped", 2), CacheEvent("removed", 2), CacheEvent("removed", 1),
        CacheEvent("cleared"), CacheEvent("cleared"),
    ]:
        buf.add(ev)
    assert buf.drain() == [
        BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                    block_size=2),
        BlockStored(block_hashes=[9], parent_block_hash=5, token_ids=[7, 7], block_size=2),
        SwaCheckpointStored(block_hashes=[2, 9], window=4),
        SwaCheckpointDropped(block_hashes=[2]),
        BlockRemoved(block_hashes=[2, 1]),
        AllBlocksCleared(),
    ]
    assert buf.drain() == []


def test_pages_stored_with_their_swa_are_followed_by_swa_blocks_stored() -> None:
    """A stored chain keeps one BlockStored; the pages that came with SWA KV follow in one
    SwaBlocksStored; a revived tombstone and freed history SWA are their own events."""
    buf = KVEventBuffer(page_size=2, window=4)
    for ev in [
        CacheEvent("stored", 1, None, (1, 2), swa=True), CacheEvent("stored", 2, 1, (3, 4)),
        CacheEvent("stored", 3, 2, (5, 6), swa=True),
        CacheEvent("swa_dropped", 1), CacheEvent("swa_dropped", 3), CacheEvent("swa_stored", 1),
    ]:
        buf.add(ev)
    assert buf.drain() == [
        BlockStored(block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=[1, 2, 3, 4, 5, 6],
                    block_size=2),
        SwaBlocksStored(block_hashes=[1, 3], window=4),
        SwaBlocksDropped(block_hashes=[1, 3]),
        SwaBlocksStored(block_hashes=[1], window=4),
    ]


def test_consecutive_stored_chains_share_one_swa_blocks_stored() -> None:
    """A decode step in which several requests each complete a page: one BlockStored per chain,
    then one SwaBlocksStored for all their SWA pages (so the publisher sends two batches, not
    two per request); any other event first flushes the SWA news of the chains before it."""
    buf = KVEventBuffer(page_size=2, window=4)
    for ev in [
        CacheEvent("stored", 1, 10, (1, 2), swa=True), CacheEvent("stored", 2, 20, (3, 4)),
        CacheEvent("stored", 3, 30, (5, 6), swa=True), CacheEvent("stored", 4, 3, (7, 8), swa=True),
        CacheEvent("swa_dropped", 40),
        CacheEvent("stored", 5, 50, (9, 9), swa=True), CacheEvent("removed", 5),
    ]:
        buf.add(ev)
    assert buf.drain() == [
        BlockStored(block_hashes=[1], parent_block_hash=10, token_ids=[1, 2], block_size=2),
        BlockStored(block_hashes=[2], parent_block_hash=20, token_ids=[3, 4], block_size=2),
        BlockStored(block_hashes=[3, 4], parent_block_hash=30, token_ids=[5, 6, 7, 8],
                    block_size=2),
        SwaBlocksStored(block_hashes=[1, 3, 4], window=4),
        SwaBlocksDropped(block_hashes=[40]),
        BlockStored(block_hashes=[5], parent_block_hash=50, token_ids=[9, 9], block_size=2),
        SwaBlocksStored(block_hashes=[5], window=4),
        BlockRemoved(block_hashes=[5]),
    ]


def test_kv_event_buffer_carries_the_medium_and_merges_only_within_one() -> None:
    """L2 ("CPU") and L3 ("GCACHE") events keep their medium; a run never spans two media
    (a page in host memory is not one on the device), even where the pages chain."""
    buf = KVEventBuffer(page_size=2, window=4)
    for ev in [
        CacheEvent("stored", 1, None, (1, 2), swa=True),
        CacheEvent("stored", 2, 1, (3, 4), medium=MEDIUM_CPU),  # chains, but another medium
        CacheEvent("stored", 3, 2, (5, 6), swa=True, medium=MEDIUM_CPU),
        CacheEvent("swa_stored", 2, medium=MEDIUM_CPU),
        CacheEvent("swa_stored", 2, medium=MEDIUM_GCACHE),
        CacheEvent("removed", 3, medium=MEDIUM_CPU), CacheEvent("removed", 1),
    ]:
        buf.add(ev)
    assert buf.drain() == [
        BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=2),
        SwaBlocksStored(block_hashes=[1], window=4),
        BlockStored(block_hashes=[2, 3], parent_block_hash=1, token_ids=[3, 4, 5, 6],
                    block_size=2, medium=MEDIUM_CPU),
        SwaBlocksStored(block_hashes=[3], window=4, medium=MEDIUM_CPU),
        SwaBlocksStored(block_hashes=[2], window=4, medium=MEDIUM_CPU),
        SwaBlocksStored(block_hashes=[2], window=4, medium=MEDIUM_GCACHE),
        BlockRemoved(block_hashes=[3], medium=MEDIUM_CPU),
        BlockRemoved(block_hashes=[1]),
    ]


def test_kv_event_buffer_gpu_events_are_byte_identical_to_the_default_medium() -> None:
    """Device events encode exactly as before the medium was carried (medium "GPU", the
    structs' default), so foreign consumers see no change."""
    buf = KVEventBuffer(page_size=2, window=4)
    for ev in [
        CacheEvent("stored", 1, None, (1, 2), swa=True), CacheEvent("ckpt_stored", 1),
        CacheEvent("swa_dropped", 1), CacheEvent("ckpt_dropped", 1), CacheEvent("removed", 1),
    ]:
        buf.add(ev)
    expected = [
        BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=2),
        SwaBlocksStored(block_hashes=[1], window=4),
        SwaCheckpointStored(block_hashes=[1], window=4),
        SwaBlocksDropped(block_hashes=[1]),
        SwaCheckpointDropped(block_hashes=[1]),
        BlockRemoved(block_hashes=[1]),
    ]
    got = encode_batch(KVEventBatch(ts=1.0, events=buf.drain()))
    assert got == encode_batch(KVEventBatch(ts=1.0, events=expected))
