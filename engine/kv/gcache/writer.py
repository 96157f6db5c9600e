"""``BackgroundWriter``: puts pages to a ``PageStore`` on a daemon thread, off the step loop.

The step loop copies the pages to host and submits either the (key, value) items or a zero-arg
callable that makes them (the encoding then runs on this thread). The queue holds at most
``max_queue`` submissions; when it is full a submit is dropped and counted, never waited for: a
page not written to L3 is a future miss, a stalled step is a stall for every sequence.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from engine.kv.gcache.store import PageStore

logger = logging.getLogger("engine.kv.gcache")

Items = Sequence[tuple[bytes, bytes]]
Submission = Items | Callable[[], Items]

_POLL_S = 0.05


class BackgroundWriter:
    """Args:
    store: where the items go; not closed by ``close`` (the caller owns it).
    max_queue: submissions waiting at most (each one a batch of items or a callable).
    batch_items: items per ``put_many`` call at most.
    """

    def __init__(self, store: PageStore, max_queue: int, batch_items: int = 64) -> None:
        assert max_queue > 0 and batch_items > 0, f"{max_queue=}, {batch_items=}"
        self.store, self.batch_items = store, batch_items
        self.submitted = self.dropped = self.written = self.failed = 0
        self._queue: queue.Queue[Submission] = queue.Queue(maxsize=max_queue)
        self._pending = 0  # submissions accepted and not yet done
        self._done = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gcache-writer", daemon=True)
        self._thread.start()

    def submit(self, items: Submission) -> bool:
        """Queue ``items`` (or a callable returning them) for writing; never blocks.

        Returns:
            False when the queue is full or the writer closed (the items are dropped).
        """
        if self._stop.is_set():
            self.dropped += 1
            return False
        with self._done:
            self._pending += 1
        try:
            self._queue.put_nowait(items)
        except queue.Full:
            with self._done:
                self._pending -= 1
            self.dropped += 1
            return False
        self.submitted += 1
        return True

    def flush(self, timeout_s: float) -> bool:
        """Wait until every accepted submission is written (or failed). False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._done:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._done.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (for up to ``timeout_s``), then stop the thread."""
        self.flush(timeout_s)
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                submission = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            try:
                self._write(submission)
            finally:
                with self._done:
                    self._pending -= 1
                    self._done.notify_all()

    def _write(self, submission: Submission) -> None:
        try:
            items = submission() if callable(submission) else submission
            for start in range(0, len(items), self.batch_items):
                self.written += self.store.put_many(items[start : start + self.batch_items])
        # NOTE: a failing encoder or store must not kill the thread (the store itself never
        # raises; an encoder might)
        except Exception:  # noqa: BLE001
            self.failed += 1
            logger.exception("gcache writer: a submission failed")
