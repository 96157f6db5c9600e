"""``KVEventSubscriber``: one worker's PUB stream (topics ``kv`` and ``load``) into a ``KVIndex``.

A thread per worker: it receives batches (what came in ``COALESCE_S`` at a time), applies them
under ``lock`` (share it with whoever calls ``KVIndex.match``), asks the worker's replay socket
for the batches a gap lost, and notes the worker's ``instance_id`` from its load reports (a new
one = a restart). Without a replay endpoint a gap forgets the worker's pages
(``KVIndex.resync``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import zmq

from engine.protocol import LoadReport, decode_worker
from engine.worker.curve import CurveClientKeys
from engine.worker.events import (
    SEQ_BYTES,
    EventDecodeError,
    KVEventBatch,
    decode_batch,
    request_replay,
)
from gateway.routing.index import KVIndex

logger = logging.getLogger(__name__)

# NOTE: engine.worker.publisher.KV_TOPIC / LOAD_TOPIC; that module imports the engine (torch)
_KV = b"kv"
_LOAD = b"load"
COALESCE_S = 0.005


class KVEventSubscriber:
    """Feeds ``index`` from one worker's events. ``start()`` runs it in a daemon thread;
    ``poll(timeout_s)`` handles one message in the caller's thread (tests).

    Args:
        worker_id: the index's name for the worker.
        endpoint: the worker's PUB endpoint (``--events``).
        replay_endpoint: its replay ROUTER (``--replay``); None: gaps resync.
        lock: held while the index is touched.
        replay_timeout_s: how long one replay may take before the gap is resynced.
        catch_up_s: with no message for this long, ask a replay of what may have been lost.
        curve: connect the SUB and replay sockets as CURVE clients (``engine.worker.curve``).
    """

    def __init__(
        self,
        index: KVIndex,
        worker_id: str,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        lock: threading.Lock | None = None,
        replay_timeout_s: float = 2.0,
        catch_up_s: float = 1.0,
        context: zmq.Context[Any] | None = None,
        curve: CurveClientKeys | None = None,
    ) -> None:
        self.index, self.worker_id = index, worker_id
        self.lock = lock or threading.Lock()
        self.last_load: LoadReport | None = None
        self._ctx = context or zmq.Context.instance()
        self._replay_endpoint, self._replay_timeout_s = replay_endpoint, replay_timeout_s
        self._catch_up_s = catch_up_s
        self._last_batch_s = time.monotonic()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._curve = curve
        if curve is not None:
            curve.apply(self._sub)
        for topic in (_KV, _LOAD):
            self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._sub.connect(endpoint)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        with self.lock:
            index.add_worker(worker_id)

    def start(self) -> None:
        """Catch up (a replay from seq 0, what the worker still buffers), then follow the stream."""
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{self.worker_id}",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread, close the socket and forget the worker (it left the index)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._sub.close(linger=0)
        with self.lock:
            self.index.remove_worker(self.worker_id)

    def catch_up(self) -> None:
        """Ask for every batch from the index's next seq on (at start: what the worker buffers).

        NOTE: no gap is known here, so a replay that fails (a busy or dead worker) changes
        nothing; one that starts past the index's next seq still resyncs (those are lost).
        """
        self._last_batch_s = time.monotonic()
        batches = self._replay(self._next_seq())
        if batches is not None:
            with self.lock:
                gap = self.index.apply_replay(self.worker_id, batches)
            if gap is not None:
                self._fill_gap(gap)

    def poll(self, timeout_s: float) -> bool:
        """Handle one message if one arrives within ``timeout_s``; returns whether one did."""
        if not self._sub.poll(int(timeout_s * 1000)):
            return False
        self._handle(self._sub.recv_multipart())
        return True

    def drain(self) -> int:
        """Handle every message already received, without waiting; returns how many."""
        n = 0
        while True:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return n
            self._handle(frames)
            n += 1

    # ---------------------------------------------------------------- internals

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
            logger.warning("worker %s: KV event message of %d frames", self.worker_id, len(frames))
            return
        topic, seq = frames[0], int.from_bytes(frames[1], "big")
        if topic == _LOAD:
            self._on_load(frames[2])
        elif topic == _KV:
            self._on_batch(seq, frames[2])

    def _run(self) -> None:
        try:
            self.catch_up()
            handled_s = 0.0
            while not self._stop.is_set():
                if self._sub.poll(100):
                    # NOTE: at most one wake-up per COALESCE_S: a worker publishes a batch per
                    # step, and each wake-up of this thread is a GIL hand-off with the event
                    # loop; the router predicts its own dispatches, so a few ms of staleness
                    # cost it nothing. A batch that comes later than that is handled at once:
                    # a timed wait per batch would be one more wake-up per step, and on an
                    # idle core a wake-up costs more than the batch (issue 10's profile)
                    if (early_s := COALESCE_S - (time.monotonic() - handled_s)) > 0:
                        self._stop.wait(early_s)
                    self.drain()
                    handled_s = time.monotonic()
                idle_s = time.monotonic() - self._last_batch_s
                if self._replay_endpoint is not None and idle_s > self._catch_up_s:
                    # NOTE: a lost last batch shows no gap until another comes: ask anyway
                    self.catch_up()
        except zmq.ZMQError:
            if not self._stop.is_set():
                logger.exception("worker %s: KV event subscriber stopped", self.worker_id)

    def _on_load(self, payload: bytes) -> None:
        try:
            msg = decode_worker(payload)
        except ValueError:
            logger.warning("worker %s: malformed load report", self.worker_id)
            return
        if isinstance(msg, LoadReport):
            self.last_load = msg
            if msg.instance_id:
                with self.lock:
                    restarted = self.index.note_instance(self.worker_id, msg.instance_id)
                if restarted:
                    self.catch_up()  # NOTE: batches of the new instance seen before this report

    def _on_batch(self, seq: int, payload: bytes) -> None:
        self._last_batch_s = time.monotonic()
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            # NOTE: a batch we can't read is a batch lost: held back, the next one shows a gap
            logger.warning("worker %s: %s", self.worker_id, exc)
            return
        with self.lock:
            gap = self.index.apply(self.worker_id, seq, batch)
        if gap is not None:
            self._fill_gap(gap)

    def _fill_gap(self, start_seq: int) -> None:
        """Replay from ``start_seq``; as long as a gap stays open, retry once, then resync."""
        for _ in range(2):
            batches = self._replay(start_seq)
            if batches is None:
                break
            with self.lock:
                gap = self.index.apply_replay(self.worker_id, batches)
            if gap is None:
                return
            start_seq = gap
        with self.lock:
            self.index.resync(self.worker_id)

    def _replay(self, start_seq: int) -> list[tuple[int, KVEventBatch]] | None:
        if self._replay_endpoint is None:
            return None
        try:
            return request_replay(self._ctx, self._replay_endpoint, start_seq,
                                  self._replay_timeout_s, curve=self._curve)
        except (TimeoutError, EventDecodeError) as exc:
            logger.warning("worker %s: KV event replay failed: %s", self.worker_id, exc)
            return None

    def _next_seq(self) -> int:
        with self.lock:
            return self.index.next_seq(self.worker_id)

