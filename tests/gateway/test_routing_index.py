"""KVIndex: window-safe credit from KV events, sequence gaps, restarts and the memory cap."""

from __future__ import annotations

import gc
import time
import tracemalloc

from engine.hashing import page_hashes
from engine.worker.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    SwaBlocksDropped,
    SwaBlocksStored,
    SwaCheckpointDropped,
    SwaCheckpointStored,
    decode_batch,
    encode_batch,
)
from gateway.routing import KVIndex, MatchResult

PAGE = 4
WINDOW = 8  # k = 2 pages
CHAIN = list(range(100, 107))  # 7 page hashes of one chain


def _batch(*events: KVEvent) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events))


def _stored(hashes: list[int], parent: int | None = None) -> BlockStored:
    """Pages in chain order; ``parent`` is the page before the first one."""
    return BlockStored(block_hashes=hashes, parent_block_hash=parent,
                       token_ids=[0] * (PAGE * len(hashes)), block_size=PAGE)


def _ckpt(*hashes: int) -> SwaCheckpointStored:
    return SwaCheckpointStored(block_hashes=list(hashes), window=WINDOW)


def _index_with(*batches: KVEventBatch, worker: str = "w0", **kwargs: int) -> KVIndex:
    index = KVIndex(PAGE, **kwargs)
    for seq, batch in enumerate(batches):
        assert index.apply(worker, seq, batch) is None
    return index


def test_usable_is_the_engine_rule_over_checkpoint_windows() -> None:
    # the module docstring's table: checkpoints end at pages 2 and 5, k = 2
    index = _index_with(_batch(_stored(CHAIN)), _batch(_ckpt(CHAIN[2], CHAIN[5])))
    assert index.window_pages("w0") == 2
    assert index.match(CHAIN) == {"w0": MatchResult(7, 6)}
    assert index.match(CHAIN[:5]) == {"w0": MatchResult(5, 3)}
    assert index.match(CHAIN[:2]) == {"w0": MatchResult(2, 0)}  # page 0 has no known SWA


def test_adjacent_checkpoint_windows_join() -> None:
    # windows [1, 2] and [3, 4] are contiguous: every page end from 2 to 5 has live SWA before it
    index = _index_with(_batch(_stored(CHAIN), _ckpt(CHAIN[2], CHAIN[4])))
    assert index.match(CHAIN) == {"w0": MatchResult(7, 5)}
    assert index.match(CHAIN[:4]) == {"w0": MatchResult(4, 4)}


def test_checkpoint_at_the_first_page_needs_only_that_page() -> None:
    index = _index_with(_batch(_stored(CHAIN[:3]), _ckpt(CHAIN[0])))
    assert index.match(CHAIN) == {"w0": MatchResult(3, 1)}


def test_checkpoint_window_follows_parents_across_batches() -> None:
    # pages stored by two requests; the checkpoint at page 3 covers pages 2 and 3, beyond the
    # query's end too, as the engine's ckpt_refs do
    index = _index_with(_batch(_stored(CHAIN[:2])), _batch(_stored(CHAIN[2:4], CHAIN[1])),
                        _batch(_ckpt(CHAIN[1], CHAIN[3])))
    assert index.match(CHAIN[:3]) == {"w0": MatchResult(3, 3)}
    index.apply("w0", 3, _batch(SwaCheckpointDropped(block_hashes=[CHAIN[1]])))
    assert index.match(CHAIN[:3]) == {"w0": MatchResult(3, 0)}
    assert index.match(CHAIN) == {"w0": MatchResult(4, 4)}


def test_resync_after_the_first_batch_goes_on_after_it() -> None:
    index = _index_with(_batch(_stored(CHAIN[:1])), worker="w")
    index.resync("w")
    assert index.next_seq("w") == 1 and index.match(CHAIN) == {}


def test_removal_and_dropped_checkpoint_and_clear() -> None:
    index = _index_with(
        _batch(_stored(CHAIN)),
        _batch(_ckpt(CHAIN[2], CHAIN[5])),
        _batch(SwaCheckpointDropped(block_hashes=[CHAIN[5]])),
    )
    assert index.match(CHAIN) == {"w0": MatchResult(7, 3)}
    index.apply("w0", 3, _batch(BlockRemoved(block_hashes=CHAIN[1:])))
    assert index.match(CHAIN) == {"w0": MatchResult(1, 0)}
    index.apply("w0", 4, _batch(AllBlocksCleared()))
    assert index.match(CHAIN) == {}
    assert index.num_pages == 0


def test_window_unknown_credits_nothing_and_no_swa_credits_everything() -> None:
    index = _index_with(_batch(_stored(CHAIN)))
    assert index.match(CHAIN) == {"w0": MatchResult(7, 0)}
    index.add_worker("w0", window_pages=0)
    assert index.match(CHAIN) == {"w0": MatchResult(7, 7)}


def test_workers_and_salts_are_separate() -> None:
    tokens = list(range(3 * PAGE))
    salted = page_hashes(tokens, PAGE, cache_salt="tenant-a")
    plain = page_hashes(tokens, PAGE, cache_salt=None)
    index = KVIndex(PAGE)
    index.apply("a", 0, _batch(_stored(salted), _ckpt(salted[-1])))
    index.apply("b", 0, _batch(_stored(plain[:2])))
    assert index.match(salted) == {"a": MatchResult(3, 3)}
    assert index.match(plain) == {"b": MatchResult(2, 0)}
    index.remove_worker("a")
    assert index.match(salted) == {} and index.num_pages == 2


def test_gap_asks_replay_and_replay_fills_it() -> None:
    index = KVIndex(PAGE)
    batches = [_batch(_stored([h])) for h in CHAIN]
    assert index.apply("w", 0, batches[0]) is None
    assert index.apply("w", 3, batches[3]) == 1  # seqs 1, 2 lost
    assert index.apply("w", 4, batches[4]) == 1  # still waiting
    assert index.match(CHAIN)["w"].full_pages == 1
    # the worker published up to seq 6 meanwhile: the replay has it, then the live stream too
    assert index.apply_replay("w", [(s, batches[s]) for s in range(0, 7)]) is None
    assert index.match(CHAIN)["w"].full_pages == 7
    assert index.apply("w", 5, batches[5]) is None  # a late duplicate is no restart
    assert index.apply("w", 6, batches[6]) is None
    assert index.stats.restarts == 0 and index.stats.gaps == 2


def test_replay_that_starts_too_late_resyncs() -> None:
    index = KVIndex(PAGE)
    index.apply("w", 0, _batch(_stored(CHAIN[:3])))
    assert index.apply("w", 5, _batch(_stored([999]))) == 1
    # the worker's buffer only reaches back to seq 4: the pages of seq 0 are forgotten
    assert index.apply_replay("w", [(4, _batch(_stored(CHAIN[3:5], CHAIN[2])))]) is None
    assert index.stats.resyncs == 1
    assert index.match(CHAIN) == {}  # under-reports: page 0..2 unknown now
    assert index.match(CHAIN[3:]) == {"w": MatchResult(2, 0)}
    assert index.next_seq("w") == 6


def test_resync_without_replay() -> None:
    index = KVIndex(PAGE)
    index.apply("w", 0, _batch(_stored(CHAIN[:3])))
    assert index.apply("w", 2, _batch(_stored([999]))) == 1
    index.resync("w")
    assert index.match(CHAIN) == {} and index.match([999]) == {"w": MatchResult(1, 0)}
    assert index.next_seq("w") == 3


def test_seq_going_back_is_a_restart() -> None:
    index = _index_with(*(_batch(_stored([h])) for h in CHAIN[:4]))
    assert index.apply("w0", 0, _batch(_stored([555]))) is None
    assert index.stats.restarts == 1
    assert index.match(CHAIN) == {} and index.match([555]) == {"w0": MatchResult(1, 0)}


def test_new_instance_is_a_restart() -> None:
    index = _index_with(_batch(_stored(CHAIN)))
    assert not index.note_instance("w0", "a")
    assert not index.note_instance("w0", "a")
    assert index.note_instance("w0", "b")
    assert index.match(CHAIN) == {} and index.next_seq("w0") == 0


def test_cap_evicts_least_recently_used() -> None:
    index = KVIndex(PAGE, max_pages=4)
    index.apply("a", 0, _batch(_stored(CHAIN[:3])))
    index.match(CHAIN[:1])  # page 0 is recently used now
    index.apply("a", 1, _batch(_stored(CHAIN[3:5], CHAIN[2])))
    assert index.num_pages == 4 and index.stats.evicted_pages == 1
    # page 1 went, page 0 stayed; the engine's cache is prefix-closed, so holding page 4 means
    # holding pages 0-4: the binary search's answer jumps the index's hole, and is still true
    # or stops at it (the previous match end, page 1, is tried first): an under-report either
    # way, never more than the engine holds
    assert index.match(CHAIN[:2]) == {"a": MatchResult(1, 0)}
    assert index.match(CHAIN) == {"a": MatchResult(1, 0)}
    fresh = KVIndex(PAGE, max_pages=4)
    fresh.apply("a", 0, _batch(_stored(CHAIN[:1]), _stored(CHAIN[2:5], CHAIN[1])))
    assert fresh.match(CHAIN) == {"a": MatchResult(5, 0)}


def test_bytes_per_entry() -> None:
    """The memory figure of the notes (printed with -s): what one page entry keeps alive, its
    hash int included, after the decoded batch is gone. Every page has live SWA (what the
    native engine announces while memory is plentiful) and one page in 8 ends a checkpoint."""
    num = 50_000
    hashes = page_hashes(list(range(num * PAGE)), PAGE, cache_salt=None)
    payload = encode_batch(_batch(_stored(hashes), SwaBlocksStored(block_hashes=hashes,
                                                                   window=WINDOW),
                                  _ckpt(*hashes[::8])))
    del hashes
    index = KVIndex(PAGE)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    index.apply("w", 0, decode_batch(payload))
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    per_entry = grown / num
    print(f"KVIndex: {per_entry:.0f} bytes per page entry")
    assert index.num_pages == num
    assert 60 < per_entry < 300, per_entry


def test_per_page_swa_events_credit_any_page_end_with_a_live_window() -> None:
    """The module docstring's picture: a checkpoint at page 2 and SWA announced on pages 4, 5
    (k = 2): usable up to page end 6. Dropping page 4's SWA cuts it to 3; storing it again, or
    a checkpoint there, brings it back; a removed page loses its SWA for good."""
    index = _index_with(_batch(_stored(CHAIN), _ckpt(CHAIN[2])),
                        _batch(SwaBlocksStored(block_hashes=CHAIN[4:6], window=WINDOW)))
    assert index.match(CHAIN) == {"w0": MatchResult(7, 6)}
    index.apply("w0", 2, _batch(SwaBlocksDropped(block_hashes=[CHAIN[4]])))
    assert index.match(CHAIN) == {"w0": MatchResult(7, 3)}
    index.apply("w0", 3, _batch(SwaBlocksStored(block_hashes=[CHAIN[4]], window=WINDOW)))
    assert index.match(CHAIN) == {"w0": MatchResult(7, 6)}
    index.apply("w0", 4, _batch(BlockRemoved(block_hashes=[CHAIN[6], CHAIN[5]]),
                                _stored(CHAIN[5:7], CHAIN[4])))
    assert index.match(CHAIN) == {"w0": MatchResult(7, 3)}, "a re-stored page has no SWA yet"


def test_the_subscriber_drains_every_queued_batch_in_one_wake_up() -> None:
    """``KVEventSubscriber.drain`` (its thread calls it after each wake-up, then pauses
    ``COALESCE_S``): batches published while it slept are all applied, in order, without
    waiting; a wire message it cannot read is skipped, not fatal."""
    import zmq

    from gateway.routing import KVEventSubscriber

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = KVIndex(PAGE)
    sub = KVEventSubscriber(index, "w0", f"tcp://127.0.0.1:{port}", context=ctx)
    try:
        for _ in range(100):  # NOTE: bounded: the slow joiner's subscription takes a moment
            pub.send_multipart([b"load", (0).to_bytes(8, "big"), b"x"])
            if sub.poll(0.05):
                break
        else:
            raise AssertionError("the subscription never came up")
        sub.drain()  # NOTE: the warm-up's other load messages
        pub.send_multipart([b"kv", (0).to_bytes(8, "big"), encode_batch(_batch(
            _stored(CHAIN[:3])))])
        pub.send_multipart([b"kv"])  # NOTE: malformed: skipped
        pub.send_multipart([b"kv", (1).to_bytes(8, "big"), encode_batch(_batch(
            _stored(CHAIN[3:5], CHAIN[2])))])
        time.sleep(0.3)  # NOTE: loopback: all three have arrived by then
        assert sub.drain() == 3
        assert sub.drain() == 0
        assert index.num_pages == 5 and index.next_seq("w0") == 2
        assert index.match(CHAIN)["w0"].full_pages == 5
    finally:
        sub.stop()
        pub.close(linger=0)
