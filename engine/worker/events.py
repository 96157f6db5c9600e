"""KV cache events in vLLM's / SGLang's ZeroMQ wire format, plus an SWA checkpoint extension.

Wire format (what a KV-aware router such as Dynamo or SGLang's gateway subscribes to)::

    PUB multipart:   [topic, seq (u64, 8 bytes big-endian), payload]
    payload:         msgpack array [ts: float, events: [event, ...], data_parallel_rank: int | nil]
    event:           msgpack map {"type": <class name>, <field>: <value>, ...}

Replay (a ROUTER socket, as vLLM's and SGLang's ``ZmqEventPublisher``): a REQ or DEALER client
sends ``[b"", start_seq (8 bytes big-endian)]``; the publisher answers every buffered batch with
``seq >= start_seq`` as ``[b"", seq, payload]`` and ends with ``[b"", -1 (8 bytes, signed), b""]``.

Both publisher sockets may be CURVE servers and the subscriber's sockets CURVE clients
(``curve=``, ``engine.worker.curve``): a client the publisher's ZAP handler refuses gets nothing.

Block hashes are the signed int64 chained page hashes of ``engine.hashing`` (one per page).

The SWA extension adds event types that say where SWA KV is cached, so that a router credits
only window-safe hits (DESIGN.md "The SWA invariants" 4, 5):

- ``SwaCheckpointStored`` / ``SwaCheckpointDropped``: a window-safe resume point (a checkpoint:
  SWA KV for the W tokens before the end of a listed block) exists / is lost while the block's
  full KV stays. A publisher that can say no more than this still lets a router credit its hits.
- ``SwaBlocksStored`` / ``SwaBlocksDropped``: the SWA KV of each listed (stored) block is cached /
  was freed while its full KV stays. The native engine sends these for every page ("history" SWA
  included, which it keeps while memory is plentiful), so a router can credit a hit at any page
  end whose window is live, exactly as the engine's own match does.

A ``BlockRemoved`` or ``AllBlocksCleared`` implies the loss of the SWA KV and the checkpoints at
those blocks.

Compatibility notes, checked against vLLM's ``vllm/distributed/kv_events.py``, SGLang's
``disaggregation/kv_events.py`` and Dynamo's Rust decoder (``kv_router`` ``RawKvEvent``):

- Events are tagged maps as in current vLLM. SGLang's own Python structs are ``array_like`` (a
  tagged array ``["BlockStored", hashes, parent, ...]``), so SGLang's typed decoder cannot read
  ours; Dynamo and vLLM accept maps.
- Every field is always encoded (no ``omit_defaults``): vLLM declares ``lora_id``, ``medium`` and
  ``lora_name`` without defaults, so its decoder rejects a ``BlockStored`` lacking those keys, and
  ``omit_defaults`` would also drop ``medium="GPU"``. ``cache_salt`` (an extension Dynamo reads)
  is therefore sent as nil when absent; vLLM ignores it.
- The batch always has three elements: Dynamo decodes it as a 3-tuple.
- vLLM's typed decoder and Dynamo reject a whole batch that holds an unknown event type, so
  ``EventPublisher`` never mixes the SWA extension into a batch with standard events: it splits
  each ``publish`` into runs of one kind, each with its own seq. Foreign consumers then fail on
  (and skip) only the extension batches; the order of all events is kept.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from engine.worker.curve import CurveClientKeys, CurveServerKeys

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # the device prefix cache (L1)
MEDIUM_CPU = "CPU"  # L2 host memory of one worker (vLLM's offloading connector says "CPU" too)
MEDIUM_GCACHE = "GCACHE"  # L3, the store shared by every worker of a deployment (issue 12)
END_SEQ = -1
SEQ_BYTES = 8  # NOTE: a message's seq frame: 8-byte big-endian


class BlockStored(msgspec.Struct, tag=True, tag_field="type", frozen=True, kw_only=True, gc=False):
    """Full pages entered the cache, in chain order.

    Attributes:
        block_hashes: one hash per page; each page's parent is the one before it.
        parent_block_hash: hash of the page before the first one; None at the root.
        token_ids: the tokens of all listed pages, concatenated (``block_size`` per page).
        block_size: tokens per page.
        lora_id, lora_name: always None (no LoRA); on the wire because vLLM requires the keys.
        medium: where the pages live (``"GPU"`` for device memory).
        cache_salt: the tenant namespace the hashes were seeded with, None when unsalted.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    cache_salt: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, tag_field="type", frozen=True, kw_only=True, gc=False):
    """Pages left ``medium`` (their full KV is gone there, and so are their checkpoints)."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU


class AllBlocksCleared(
    msgspec.Struct, tag=True, tag_field="type", frozen=True, kw_only=True, gc=False
):
    """Every page and checkpoint of this publisher is gone (cache flush, restart)."""


class SwaCheckpointStored(
    msgspec.Struct, tag=True, tag_field="type", frozen=True, kw_only=True, gc=False
):
    """SWA extension: a window-safe resume point now exists right after each listed page.

    The SWA KV of the ``window`` tokens before the end of each listed (already stored) page is
    cached, so a request whose prefix ends there can skip recomputing it.
    """

    block_hashes: list[int]
    window: int
    medium: str | None = MEDIUM_GPU


class SwaCheckpointDropped(
    msgspec.Struct, tag=True, tag_field="type", frozen=True, kw_only=True, gc=False
):
    """SWA extension: the checkpoint ending at each listed page is gone; its full KV stays."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU


class SwaBlocksStored(
    msgspec.Struct, tag=True, tag_field="type", frozen=True, kw_only=True, gc=False
):
    """SWA extension: the SWA KV of each listed (already stored) page is cached; ``window`` is
    W, the tokens an SWA query sees (as in ``SwaCheckpointStored``)."""

    block_hashes: list[int]
    window: int
    medium: str | None = MEDIUM_GPU


class SwaBlocksDropped(
    msgspec.Struct, tag=True, tag_field="type", frozen=True, kw_only=True, gc=False
):
    """SWA extension: the SWA KV of each listed page was freed; its full KV stays."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU


KVEvent = (
    BlockStored
    | BlockRemoved
    | AllBlocksCleared
    | SwaCheckpointStored
    | SwaCheckpointDropped
    | SwaBlocksStored
    | SwaBlocksDropped
)
SWA_EXTENSION_EVENTS = (SwaCheckpointStored, SwaCheckpointDropped, SwaBlocksStored,
                        SwaBlocksDropped)


class KVEventBatch(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The events of one engine step: ``[ts, events, data_parallel_rank]`` on the wire."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class EventDecodeError(ValueError):
    """A payload that is not a ``KVEventBatch``."""


_ENCODER = msgspec.msgpack.Encoder()
_BATCH_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_EVENT_DECODER = msgspec.msgpack.Decoder(KVEvent)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a payload; events of a type this module does not know are skipped.

    Raises:
        EventDecodeError: the payload, or an event of a known type, is malformed.
    """
    try:
        return _BATCH_DECODER.decode(payload)
    except msgspec.MsgspecError:
        pass  # NOTE: slow path, to tell unknown event types (skipped) from malformed ones
    try:
        raw = msgspec.msgpack.decode(payload, type=_RawBatch)
    except msgspec.MsgspecError as exc:
        raise EventDecodeError(f"invalid KV event batch: {exc}") from None
    events = [event for event in map(_decode_event, raw.events) if event is not None]
    return KVEventBatch(ts=raw.ts, events=events, data_parallel_rank=raw.data_parallel_rank)


class EventPublisher:
    """Publishes KV event batches on a PUB socket, without ever blocking the engine loop.

    Sends are non-blocking: with no subscriber, or one slower than ``hwm`` messages, batches are
    dropped (a subscriber sees the gap in ``seq`` and can ask for a replay). The last
    ``buffer_steps`` batches are kept for replay; call ``poll_replay()`` from the worker loop.

    Args:
        endpoint: where to bind the PUB socket, e.g. ``tcp://127.0.0.1:0`` (port 0 picks a free
            port; read the bound address from ``.endpoint``).
        replay_endpoint: where to bind the replay ROUTER socket; None for no replay.
        topic: the first frame of every message (SUB sockets filter on its prefix).
        data_parallel_rank: written into every batch.
        curve: bind both sockets as CURVE servers (``engine.worker.curve``; the caller runs the
            context's ZAP handler); None: no authentication.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
        context: zmq.Context[Any] | None = None,
        curve: CurveServerKeys | None = None,
    ) -> None:
        ctx = context or zmq.Context.instance()
        self._topic = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self._next_seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._pub, self.endpoint = _bound_socket(ctx, zmq.PUB, endpoint, hwm, curve)
        self._replay: zmq.Socket[bytes] | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            # NOTE: room for one whole replay per client; beyond it ROUTER drops, never blocks.
            try:
                self._replay, self.replay_endpoint = _bound_socket(
                    ctx, zmq.ROUTER, replay_endpoint, buffer_steps + 2, curve
                )
            except zmq.ZMQError:
                self._pub.close(linger=0)
                raise

    @property
    def next_seq(self) -> int:
        """The seq the next published batch will carry (seqs start at 0)."""
        return self._next_seq

    def publish(self, events: Sequence[KVEvent]) -> int | None:
        """Send ``events`` (in order) as one batch, or several when SWA extension events are mixed
        with standard ones (see the module docstring).

        Returns:
            The seq of the last batch sent; None when ``events`` is empty (nothing is sent).
        """
        seq = None
        ts = time.time()
        for _, run in itertools.groupby(events, key=_is_extension):
            batch = KVEventBatch(ts=ts, events=list(run), data_parallel_rank=self._rank)
            seq = self._send(encode_batch(batch))
        return seq

    def poll_replay(self, max_requests: int = 8) -> int:
        """Answer up to ``max_requests`` waiting replay requests; never waits for one.

        Returns:
            The number of requests answered.
        """
        if self._replay is None:
            return 0
        served = 0
        while served < max_requests:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            served += self._answer_replay(frames)
        return served

    def close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _send(self, payload: bytes) -> int:
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        # NOTE: PUB drops rather than blocks at its HWM; the batch stays in the replay buffer.
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart([self._topic, _seq_bytes(seq), payload], zmq.NOBLOCK)
        return seq

    def _answer_replay(self, frames: list[bytes]) -> int:
        assert self._replay is not None
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != SEQ_BYTES:
            logger.warning("ignoring malformed KV event replay request: %d frames", len(frames))
            return 0
        identity, start_seq = frames[0], int.from_bytes(frames[2], "big")
        replies = [(_seq_bytes(seq), payload) for seq, payload in self._buffer if seq >= start_seq]
        replies.append((_seq_bytes(END_SEQ), b""))
        try:
            for seq_bytes, payload in replies:
                self._replay.send_multipart([identity, b"", seq_bytes, payload], zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("KV event replay to a slow client cut short")
        return 1


class EventSubscriber:
    """Receives KV event batches from one ``EventPublisher`` (or a vLLM/SGLang publisher).

    Tracks the last seq seen and counts the batches missed in gaps (``missed``); a seq lower than
    the last one means the publisher restarted, and counting starts over from it.

    Args:
        endpoint: the publisher's PUB endpoint.
        replay_endpoint: the publisher's replay endpoint, for ``replay()``.
        topic: subscribe to topics starting with this prefix ("" for all).
        curve: connect as a CURVE client (a publisher with ``--curve-keys``); None: plain.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        context: zmq.Context[Any] | None = None,
        curve: CurveClientKeys | None = None,
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self._curve = curve
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self._sub)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self.last_seq: int | None = None
        self.missed = 0

    def recv(self, timeout_s: float) -> tuple[int, KVEventBatch] | None:
        """The next ``(seq, batch)``, or None if none arrives within ``timeout_s``.

        Raises:
            EventDecodeError: a message is malformed (its seq still counts as seen).
        """
        if not self._sub.poll(int(timeout_s * 1000)):
            return None
        frames = self._sub.recv_multipart()
        if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
            raise EventDecodeError(f"KV event message has {len(frames)} frames, expected 3")
        seq = int.from_bytes(frames[1], "big")
        if self.last_seq is not None and seq > self.last_seq + 1:
            self.missed += seq - self.last_seq - 1
        self.last_seq = seq
        return seq, decode_batch(frames[2])

    def replay(self, start_seq: int, timeout_s: float = 1.0) -> list[tuple[int, KVEventBatch]]:
        """Ask the publisher for its buffered batches with ``seq >= start_seq``, oldest first.

        Batches older than the publisher's buffer are gone: the first seq returned may be larger
        than ``start_seq``. Batches also delivered by ``recv`` are the caller's to de-duplicate.

        Raises:
            RuntimeError: no ``replay_endpoint`` was given.
            TimeoutError: the publisher did not finish answering within ``timeout_s``.
        """
        if self._replay_endpoint is None:
            raise RuntimeError("EventSubscriber.replay needs a replay_endpoint")
        return request_replay(self._ctx, self._replay_endpoint, start_seq, timeout_s,
                              curve=self._curve)

    def close(self) -> None:
        self._sub.close(linger=0)

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _Tag(msgspec.Struct, gc=False):
    type: str | None = None


_KNOWN_TAGS = frozenset(cls.__name__ for cls in KVEvent.__args__)


def _decode_event(raw: msgspec.Raw) -> KVEvent | None:
    try:
        tag = msgspec.msgpack.decode(raw, type=_Tag).type
        if tag not in _KNOWN_TAGS:
            return None
        return _EVENT_DECODER.decode(raw)
    except msgspec.MsgspecError as exc:
        raise EventDecodeError(f"invalid KV event: {exc}") from None


def request_replay(
    context: zmq.Context[Any], endpoint: str, start_seq: int, timeout_s: float,
    *, curve: CurveClientKeys | None = None,
) -> list[tuple[int, KVEventBatch]]:
    """The batches with ``seq >= start_seq`` that the publisher at ``endpoint`` (its replay
    socket) still buffers, oldest first; see ``EventSubscriber.replay``. ``curve``: connect as
    a CURVE client (a publisher that refuses us never answers: a ``TimeoutError``).

    Raises:
        TimeoutError: the publisher did not finish answering within ``timeout_s``.
        EventDecodeError: a replayed message is malformed.
    """
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        if curve is not None:
            curve.apply(dealer)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", _seq_bytes(start_seq)])
        return _collect_replay(dealer, time.monotonic() + timeout_s)
    finally:
        dealer.close(linger=0)


def _collect_replay(dealer: zmq.Socket[bytes], deadline: float) -> list[tuple[int, KVEventBatch]]:
    batches = []
    while (left_s := deadline - time.monotonic()) > 0:
        if not dealer.poll(max(1, int(left_s * 1000))):
            break
        frames = dealer.recv_multipart()
        if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
            raise EventDecodeError(f"KV event replay message has {len(frames)} frames, expected 3")
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq == END_SEQ:
            return batches
        batches.append((seq, decode_batch(frames[2])))
    raise TimeoutError(f"KV event replay incomplete after {len(batches)} batches")


def _is_extension(event: KVEvent) -> bool:
    return isinstance(event, SWA_EXTENSION_EVENTS)


def _seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def _bound_socket(
    ctx: zmq.Context[Any], kind: int, endpoint: str, send_hwm: int,
    curve: CurveServerKeys | None = None,
) -> tuple[zmq.Socket[bytes], str]:
    """A socket bound to ``endpoint`` (a CURVE server with ``curve``), and the address it bound
    (port 0 -> the port picked)."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        endpoint = endpoint[:-2] + ":*"
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, send_hwm)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if curve is not None:
            curve.apply(sock)
        sock.bind(endpoint)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
