"""KV events: the vLLM/SGLang wire layout, and publish/subscribe/replay over real ZeroMQ sockets."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import pytest
import zmq

from engine.worker.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    EventPublisher,
    EventSubscriber,
    KVEvent,
    KVEventBatch,
    SwaCheckpointDropped,
    SwaCheckpointStored,
    decode_batch,
    encode_batch,
)

LOCALHOST = "tcp://127.0.0.1:0"
_CONNECT_TIMEOUT_S = 5.0


def _make_events() -> list[KVEvent]:
    """One event of every type, standard ones first."""
    return [
        BlockStored(
            block_hashes=[11, -12],
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4],
            block_size=2,
            cache_salt="tenant-a",
        ),
        BlockRemoved(block_hashes=[11]),
        AllBlocksCleared(),
        SwaCheckpointStored(block_hashes=[-12], window=128),
        SwaCheckpointDropped(block_hashes=[-12]),
    ]


@pytest.fixture
def publisher() -> Iterator[EventPublisher]:
    with EventPublisher(LOCALHOST, replay_endpoint=LOCALHOST, topic="kv") as pub:
        yield pub


@pytest.fixture
def subscriber(publisher: EventPublisher) -> Iterator[EventSubscriber]:
    sub = EventSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint, topic="kv")
    with sub:
        _wait_connected(publisher, sub)
        yield sub


def _wait_connected(pub: EventPublisher, sub: EventSubscriber) -> None:
    """Publish probes until one arrives (a SUB joins late), then drain the rest."""
    deadline = time.monotonic() + _CONNECT_TIMEOUT_S
    while sub.recv(timeout_s=0.02) is None:
        assert time.monotonic() < deadline, "subscriber never connected"
        pub.publish([AllBlocksCleared()])
    while sub.recv(timeout_s=0.05) is not None:
        pass


def _recv_all(sub: EventSubscriber, count: int) -> list[tuple[int, KVEventBatch]]:
    received = []
    for _ in range(count):
        item = sub.recv(timeout_s=2.0)
        assert item is not None, f"got {len(received)} of {count} batches"
        received.append(item)
    return received


@contextmanager
def _serving_replay(pub: EventPublisher) -> Iterator[None]:
    """Stand-in for the worker loop: answer replay requests until the block ends."""
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            pub.poll_replay()
            time.sleep(0.001)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def _assert_seqs(items: list[tuple[int, KVEventBatch]], expected: list[int]) -> None:
    seqs = [seq for seq, _ in items]
    assert seqs == expected, f"seqs {seqs}, expected {expected}"


# --- wire format ------------------------------------------------------------------------------


def test_batch_wire_layout_is_vllm_s() -> None:
    batch = KVEventBatch(ts=12.5, events=_make_events()[:3], data_parallel_rank=0)
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert raw == [
        12.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [11, -12],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "cache_salt": "tenant-a",
            },
            {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]


def test_swa_extension_wire_layout() -> None:
    batch = KVEventBatch(ts=1.0, events=_make_events()[3:], data_parallel_rank=None)
    raw = msgspec.msgpack.decode(encode_batch(batch))
    # NOTE: the rank stays on the wire even when None: Dynamo decodes the batch as a 3-tuple.
    assert raw == [
        1.0,
        [
            {"type": "SwaCheckpointStored", "block_hashes": [-12], "window": 128, "medium": "GPU"},
            {"type": "SwaCheckpointDropped", "block_hashes": [-12], "medium": "GPU"},
        ],
        None,
    ]


def test_batch_round_trips() -> None:
    batch = KVEventBatch(ts=3.25, events=_make_events(), data_parallel_rank=2)
    assert decode_batch(encode_batch(batch)) == batch


class _VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's event classes as of 2025-2026 (required keys have no defaults)."""


class _VllmBlockStored(_VllmEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[object] | None = None
    group_idx: int | None = None


class _VllmBlockRemoved(_VllmEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class _VllmAllBlocksCleared(_VllmEvent, tag="AllBlocksCleared"):
    pass


class _VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_VllmBlockStored | _VllmBlockRemoved | _VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


def test_vllm_s_decoder_reads_our_standard_batches() -> None:
    batch = KVEventBatch(ts=1.0, events=_make_events()[:3], data_parallel_rank=0)
    theirs = msgspec.msgpack.decode(encode_batch(batch), type=_VllmBatch)
    stored = theirs.events[0]
    assert isinstance(stored, _VllmBlockStored)
    assert (stored.block_hashes, stored.medium, stored.lora_id) == ([11, -12], "GPU", None)
    assert [type(e) for e in theirs.events[1:]] == [_VllmBlockRemoved, _VllmAllBlocksCleared]


def test_we_read_vllm_s_batches_and_skip_unknown_event_types() -> None:
    theirs = _VllmBatch(
        ts=2.0,
        events=[
            _VllmBlockStored(
                block_hashes=[5],
                parent_block_hash=4,
                token_ids=[9, 9],
                block_size=2,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
            ),
            _VllmBlockRemoved(block_hashes=[5], medium="GPU"),
        ],
        data_parallel_rank=1,
    )
    payload = msgspec.msgpack.encode(theirs)
    ours = decode_batch(payload)
    assert ours.events == [
        BlockStored(block_hashes=[5], parent_block_hash=4, token_ids=[9, 9], block_size=2),
        BlockRemoved(block_hashes=[5]),
    ]
    future = [2.0, [{"type": "BlockPinned", "block_hashes": [5]}, {"type": "AllBlocksCleared"}]]
    assert decode_batch(msgspec.msgpack.encode(future)).events == [AllBlocksCleared()]


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        msgspec.msgpack.encode({"ts": 1.0, "events": []}),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved"}], 0]),
        msgspec.msgpack.encode([1.0, [["BlockRemoved", [1], "GPU"]], 0]),
    ],
    ids=["garbage", "map-batch", "missing-field", "array-event"],
)
def test_malformed_batches_raise_event_decode_error(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


# --- publish / subscribe ---------------------------------------------------------------------


def test_port_zero_binds_a_free_port(publisher: EventPublisher) -> None:
    for endpoint in (publisher.endpoint, publisher.replay_endpoint):
        assert endpoint is not None and endpoint.startswith("tcp://127.0.0.1:")
        assert int(endpoint.rsplit(":", 1)[1]) > 0, endpoint


def test_every_event_type_round_trips(
    publisher: EventPublisher, subscriber: EventSubscriber
) -> None:
    events = _make_events()
    for event in events:
        publisher.publish([event])
    received = _recv_all(subscriber, len(events))
    assert [batch.events for _, batch in received] == [[event] for event in events]
    assert all(batch.data_parallel_rank == 0 for _, batch in received)


def test_seq_increments_by_one_per_batch(
    publisher: EventPublisher, subscriber: EventSubscriber
) -> None:
    first = publisher.next_seq
    sent = [publisher.publish([BlockRemoved(block_hashes=[i])]) for i in range(5)]
    assert sent == list(range(first, first + 5))
    _assert_seqs(_recv_all(subscriber, 5), sent)
    assert subscriber.missed == 0


def test_extension_events_travel_in_their_own_batches_in_order(
    publisher: EventPublisher, subscriber: EventSubscriber
) -> None:
    stored, removed, _, checkpoint, dropped = _make_events()
    first = publisher.next_seq
    last = publisher.publish([stored, removed, checkpoint, dropped, removed])
    received = _recv_all(subscriber, 3)
    _assert_seqs(received, [first, first + 1, first + 2])
    assert last == first + 2
    assert [batch.events for _, batch in received] == [
        [stored, removed],
        [checkpoint, dropped],
        [removed],
    ]


def test_publishing_nothing_sends_nothing(
    publisher: EventPublisher, subscriber: EventSubscriber
) -> None:
    seq = publisher.next_seq
    assert publisher.publish([]) is None
    assert publisher.next_seq == seq
    assert subscriber.recv(timeout_s=0.05) is None


def test_subscriber_counts_missed_batches_and_follows_a_restart() -> None:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    payload = encode_batch(KVEventBatch(ts=0.0, events=[], data_parallel_rank=0))
    try:
        with EventSubscriber(endpoint) as sub:
            deadline = time.monotonic() + _CONNECT_TIMEOUT_S
            while sub.recv(timeout_s=0.02) is None:  # seq 0 until the SUB has joined
                assert time.monotonic() < deadline, "subscriber never connected"
                pub.send_multipart([b"", (0).to_bytes(8, "big"), payload])
            for seq in (1, 4, 5, 9, 0, 1):
                pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            seqs = []
            while (item := sub.recv(timeout_s=0.5)) is not None:
                seqs.append(item[0])
            # Late probes (seq 0) may trail in first; the gaps 1 -> 4 -> 5 -> 9 miss 2 + 3.
            assert seqs[-6:] == [1, 4, 5, 9, 0, 1] and not any(seqs[:-6]), seqs
            assert sub.missed == 5
            assert sub.last_seq == 1
    finally:
        pub.close(linger=0)


def test_replay_from_a_seq(publisher: EventPublisher, subscriber: EventSubscriber) -> None:
    sent = [publisher.publish([BlockRemoved(block_hashes=[i])]) for i in range(10)]
    live = _recv_all(subscriber, 10)
    with _serving_replay(publisher):
        replayed = subscriber.replay(sent[5], timeout_s=2.0)
    assert replayed == live[5:]


def test_replay_returns_only_what_the_buffer_still_holds() -> None:
    with EventPublisher(LOCALHOST, replay_endpoint=LOCALHOST, buffer_steps=4) as pub:
        for i in range(10):
            pub.publish([BlockRemoved(block_hashes=[i])])
        with (
            EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint) as sub,
            _serving_replay(pub),
        ):
            replayed = sub.replay(0, timeout_s=2.0)
    _assert_seqs(replayed, [6, 7, 8, 9])
    assert [batch.events[0].block_hashes for _, batch in replayed] == [[6], [7], [8], [9]]


def test_replay_speaks_vllm_s_frame_protocol(publisher: EventPublisher) -> None:
    payloads = {}
    for i in range(3):
        seq = publisher.publish([BlockRemoved(block_hashes=[i])])
        payloads[seq] = publisher._buffer[-1][1]
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        assert publisher.replay_endpoint is not None
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        with _serving_replay(publisher):
            frames = [dealer.recv_multipart() for _ in range(3) if dealer.poll(2000)]
    finally:
        dealer.close(linger=0)
    assert frames == [
        [b"", (1).to_bytes(8, "big"), payloads[1]],
        [b"", (2).to_bytes(8, "big"), payloads[2]],
        [b"", END_SEQ.to_bytes(8, "big", signed=True), b""],
    ]


def test_malformed_replay_request_is_ignored(publisher: EventPublisher) -> None:
    publisher.publish([AllBlocksCleared()])
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        assert publisher.replay_endpoint is not None
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart([b"", b"short"])
        deadline = time.monotonic() + _CONNECT_TIMEOUT_S
        while publisher._replay is not None and not publisher._replay.poll(10):
            assert time.monotonic() < deadline, "replay request never arrived"
        assert publisher.poll_replay() == 0
        assert not dealer.poll(100), "a malformed request must get no answer"
    finally:
        dealer.close(linger=0)


def test_replay_without_an_answer_times_out(
    publisher: EventPublisher, subscriber: EventSubscriber
) -> None:
    with pytest.raises(TimeoutError):
        subscriber.replay(0, timeout_s=0.1)  # nobody calls poll_replay


def test_replay_needs_an_endpoint(publisher: EventPublisher) -> None:
    with EventSubscriber(publisher.endpoint) as sub, pytest.raises(RuntimeError):
        sub.replay(0)
    with EventPublisher(LOCALHOST) as no_replay:
        assert no_replay.poll_replay() == 0


def _assert_publishes_fast(pub: EventPublisher, count: int, limit_s: float) -> None:
    event = BlockStored(
        block_hashes=[1], parent_block_hash=None, token_ids=list(range(16)), block_size=16
    )
    start = time.perf_counter()
    for _ in range(count):
        pub.publish([event])
    elapsed_s = time.perf_counter() - start
    assert elapsed_s < limit_s, f"{count} publishes took {elapsed_s:.2f} s"
    assert pub.next_seq == count


def test_publish_never_blocks_without_a_subscriber() -> None:
    with EventPublisher(LOCALHOST) as pub:
        _assert_publishes_fast(pub, 10_000, limit_s=5.0)


def test_publish_never_blocks_on_a_stalled_subscriber() -> None:
    with EventPublisher(LOCALHOST, hwm=10) as pub:
        stalled = zmq.Context.instance().socket(zmq.SUB)
        stalled.setsockopt(zmq.RCVHWM, 1)
        stalled.setsockopt(zmq.LINGER, 0)
        stalled.setsockopt(zmq.SUBSCRIBE, b"")
        stalled.connect(pub.endpoint)
        try:
            time.sleep(0.1)  # let it join, then never read
            _assert_publishes_fast(pub, 10_000, limit_s=5.0)
        finally:
            stalled.close(linger=0)
