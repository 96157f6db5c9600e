"""KV index: which worker holds which pages, rebuilt from the workers' KV events
(engine.worker.events).

Per worker the index keeps the page hashes whose full KV is cached, and which of them end a live
SWA checkpoint. ``match`` answers, per worker, the raw full-KV match of a hash chain and the
window-safe part of it, by the engine's own rule (``engine.kv.prefix_cache.PrefixCache.match``):
page end ``p`` is usable when full KV covers pages ``[0, p)`` and the last ``min(k, p)`` pages
before it have live SWA, ``k = ceil(W / page)``.

The events say where SWA is live in two ways: per page (``SwaBlocksStored`` /
``SwaBlocksDropped``, which the native engine sends for every page, "history" SWA included), and
through checkpoints: a live checkpoint ending at page ``j`` guarantees live SWA on pages
``[j - k + 1, j]`` (the engine's invariant, DESIGN.md "The SWA invariants" 3, 5), which is all a
publisher without per-page events tells. The index applies the engine's rule to the union of
that knowledge, so it never credits a hit the engine would not give:

    pages        0    1    2    3    4    5    6        (k = 2)
    full         x    x    x    x    x    x    x        full_pages = 7
    checkpoint             ^                           (ends at page 2)
    SWA blocks                       x    x
    known SWA         x    x         x    x
    usable?      n    n    y    n    n    y    n        usable_pages = 6

With per-page events the index and the engine's cache agree exactly, up to the events in flight
and the cap (tests/gateway/test_routing_index_property.py).

Sequence numbers: each worker's ``kv`` stream counts batches from 0. A gap asks for a replay
(``apply`` returns the seq to replay from); ``apply_replay`` fills it. When the publisher's replay
buffer no longer reaches back to the gap (or there is no replay socket: ``resync``), the index
forgets the worker's pages and rebuilds from the first batch it can still get. Workers offer no
full-state dump, so pages stored before that point and still cached stay unknown until they are
stored again or the router's own bookkeeping learns them: the index under-reports, never over.

A seq at or below the last one seen on the live stream means the publisher restarted (the PUB
stream only goes forward); the worker's pages are forgotten. A restart whose first seen seq is
higher than the last one is told apart only by the worker's ``instance_id`` (``note_instance``,
from ``LoadReport``/``Welcome``).

A batch lost at the end of a burst shows as a gap only when a later batch (or a periodic
catch-up replay, ``KVEventSubscriber``) arrives; until then the index may be behind the worker.

Optimistic entries (``predict``): the router adds, for a request it has just sent, short-lived
entries for the request's pages on that worker (a side index per worker), so siblings routed
before any ``BlockStored`` arrives see the prefix where it is being computed. ``match(hashes,
now_s)`` takes the max of confirmed and unexpired predicted credit; without ``now_s`` it is the
confirmed credit alone. A ``BlockStored`` for a predicted page replaces its entry; entries expire
at their ``until_s``; at most ``max_predicted_pages`` live over all workers (the oldest go first).
Window safety of predictions: a predicted checkpoint stands for a point whose window the
worker's engine will have live within the TTL (the end of the request's routable prompt, which
the running request's own window covers and where the engine keeps a checkpoint; an observed
branch point, which the engine marks once the request recomputes past it). Predicted pages carry
a window of their own only on a worker that announces SWA per page (``SwaBlocksStored``): its
engine stores every computed page with its SWA and frees that history only under pressure, so a
sibling that leaves the chain anywhere is credited up to its branch point, as the events will
confirm. Elsewhere a sibling that leaves the chain off a predicted checkpoint gets full-KV credit
only.

Matching (``gateway.routing.matching``) is O(log pages) per worker for the full-KV part: a
binary search over the chain (a page hash names its whole prefix and the engine's cache is
prefix-closed, so "page i is cached" is monotone in i), trying the worker's previous match end
and the previous worker's first. Then a backward scan from the match end to the deepest
window-safe point (one lookup when a live checkpoint ends there; O(pages) only for a long match
without any live window on it). A page the index lost (the cap) inside a chain it still holds
deeper pages of can make the search stop early or jump the hole; both are under-reports, as the
engine does hold the prefix of any page it holds.

Tiers below the device (``gateway.routing.tiers``): events with medium "CPU" build each worker's
L2 view (bounded by ``max_host_pages`` over all workers, least recently stored of the biggest
worker first); events with medium "GCACHE" from any worker build ONE shared L3 view, credited on
every worker, bounded by ``max_storage_pages`` and aged by ``storage_ttl_s`` on ``clock`` (L3
never reports removals). While either holds anything, ``match`` extends each worker's device
match through them by the window rule across tiers and reports, in ``MatchResult.host_pages`` /
``storage_pages``, how many usable pages would be loaded from each (``matching.match_tiers``).
``AllBlocksCleared`` clears the worker's device and L2 views, never the shared L3 one.

Memory: at most ``max_pages`` page entries over all workers (about 170 bytes each with CPython
3.11: the hash, its parent link and the LRU order; test_routing_index.py measures it); beyond it
the least recently stored entry (a match touches its end page) of the biggest worker is dropped
(an under-report again). Not thread-safe: callers serialize ``apply*`` and ``match``
(``KVEventSubscriber.lock``).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat

from engine.utils import cdiv
from engine.worker.events import (
    MEDIUM_CPU,
    MEDIUM_GCACHE,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    SwaBlocksDropped,
    SwaBlocksStored,
    SwaCheckpointDropped,
    SwaCheckpointStored,
)
from gateway.routing.matching import MatchResult, full_pages, match_all, match_tiers
from gateway.routing.tiers import (
    DEFAULT_MAX_STORAGE_PAGES,
    DEFAULT_STORAGE_TTL_S,
    FULL,
    SWA,
    HostView,
    StorageView,
)

DEFAULT_MAX_PAGES = 1_000_000  # ~250 MB; 16M tokens at 16 tokens a page
DEFAULT_MAX_PREDICTED_PAGES = 200_000  # optimistic entries over all workers
DEFAULT_MAX_HOST_PAGES = 1_000_000  # L2 entries over all workers, ~100 bytes each
MAX_PENDING_BATCHES = 10_000  # live batches held while a replay fills the gap before them


@dataclass(slots=True)
class IndexStats:
    gaps: int = 0  # replays asked for
    resyncs: int = 0  # times a worker's pages were forgotten for a gap no replay covered
    restarts: int = 0  # times a worker's pages were forgotten for a restart
    evicted_pages: int = 0  # dropped by the max_pages cap
    evicted_host_pages: int = 0  # dropped by the max_host_pages cap


@dataclass(slots=True)
class _Worker:
    # NOTE: page hash -> parent hash; order = least recently stored/matched first
    pages: OrderedDict[int, int | None] = field(default_factory=OrderedDict)
    ckpts: dict[int, tuple[int, ...]] = field(default_factory=dict)  # live end -> its window
    cover: dict[int, int] = field(default_factory=dict)  # page -> live windows holding it
    swa: set[int] = field(default_factory=set)  # pages announced with live SWA (SwaBlocks*)
    per_page_swa: bool = False  # NOTE: the publisher sends SwaBlocks* (kept across a clear)
    window_pages: int | None = None  # k; None until an SWA event (or add_worker) says
    next_seq: int = 0  # the seq of the next batch to apply
    live_last: int | None = None  # the last seq seen on the live stream
    pending: dict[int, KVEventBatch] = field(default_factory=dict)
    instance_id: str | None = None
    # NOTE: optimistic entries: page hash -> until_s; checkpoint end -> (depth in pages, until_s)
    pred: dict[int, float] = field(default_factory=dict)
    pred_ckpts: dict[int, tuple[int, float]] = field(default_factory=dict)
    last_end: int = 0  # NOTE: the previous match's end (pages) and hash there: a search hint
    last_end_hash: int = 0
    host: HostView = field(default_factory=HostView)  # NOTE: its L2 (medium "CPU")

    def clear(self) -> None:
        """Forget the device and L2 views (the shared L3 one is not the worker's)."""
        self.pages.clear()
        self.ckpts.clear()
        self.cover.clear()
        self.swa.clear()
        self.host.clear()

    def add_ckpt(self, end: int, k: int) -> None:
        """A checkpoint ends at ``end``: its window is ``end`` and up to k - 1 known parents."""
        if end in self.ckpts or end not in self.pages:
            return  # NOTE: a page the cap dropped stays unknown (an under-report)
        window, h = [], end
        while h is not None and h in self.pages and len(window) < k:
            window.append(h)
            h = self.pages[h]
        self.ckpts[end] = tuple(window)
        for h in window:
            self.cover[h] = self.cover.get(h, 0) + 1

    def drop_ckpt(self, end: int) -> None:
        for h in self.ckpts.pop(end, ()):
            n = self.cover.get(h, 0) - 1
            if n > 0:
                self.cover[h] = n
            else:
                self.cover.pop(h, None)

    def remove(self, h: int) -> bool:
        if h not in self.pages:
            return False
        self.drop_ckpt(h)
        del self.pages[h]
        self.cover.pop(h, None)
        self.swa.discard(h)
        return True


class KVIndex:
    """See the module docstring.

    Args:
        page_size: tokens per page, as the workers hash them (turns ``window`` into pages).
        max_pages: cap on page entries over all workers.
        max_predicted_pages: cap on optimistic entries (``predict``) over all workers, about
            100 bytes each.
        max_host_pages: cap on L2 ("CPU") entries over all workers.
        max_storage_pages: cap on the shared L3 ("GCACHE") entries.
        storage_ttl_s: an L3 entry not confirmed again for this long is forgotten.
        clock: seconds, for the L3 ages (``time.monotonic``; a replay passes its own).
    """

    def __init__(
        self,
        page_size: int,
        max_pages: int = DEFAULT_MAX_PAGES,
        max_predicted_pages: int = DEFAULT_MAX_PREDICTED_PAGES,
        *,
        max_host_pages: int = DEFAULT_MAX_HOST_PAGES,
        max_storage_pages: int = DEFAULT_MAX_STORAGE_PAGES,
        storage_ttl_s: float = DEFAULT_STORAGE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert page_size > 0 and max_pages > 0, (page_size, max_pages)
        assert max_host_pages > 0, max_host_pages
        self.page_size, self.max_pages = page_size, max_pages
        self.max_predicted_pages = max_predicted_pages
        self.max_host_pages = max_host_pages
        self.clock = clock
        self.stats = IndexStats()
        self.storage = StorageView(max_storage_pages, storage_ttl_s)
        self._workers: dict[str, _Worker] = {}
        self._num_pages = 0
        self._num_host = 0  # NOTE: L2 entries over all workers
        # NOTE: (until_s, worker, its _Worker, page hashes, checkpoint ends) in insertion order
        self._pred_queue: deque[tuple[float, str, _Worker, list[int], list[int]]] = deque()
        self._num_pred = 0  # live page entries
        self._num_queued = 0  # hashes listed in _pred_queue (>= live entries)

    # ---------------------------------------------------------------- queries

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_host_pages(self) -> int:
        """L2 ("CPU") entries over all workers."""
        return self._num_host

    @property
    def num_storage_pages(self) -> int:
        """Shared L3 ("GCACHE") entries, full and SWA, as of the last event or match."""
        return len(self.storage)

    def workers(self) -> list[str]:
        return list(self._workers)

    def window_pages(self, worker_id: str) -> int | None:
        w = self._workers.get(worker_id)
        return None if w is None else w.window_pages

    def next_seq(self, worker_id: str) -> int:
        """The seq of the next batch the index needs from ``worker_id`` (0 for a new one)."""
        w = self._workers.get(worker_id)
        return 0 if w is None else w.next_seq

    @property
    def num_predicted_pages(self) -> int:
        return self._num_pred

    def match(
        self, page_hashes: Sequence[int], now_s: float | None = None
    ) -> dict[str, MatchResult]:
        """Per worker with at least one page of ``page_hashes`` cached: its ``MatchResult``.

        A worker whose window is not known yet (no checkpoint event, no ``window_pages`` given)
        gets ``usable_pages = 0`` from confirmed pages. With ``now_s``, optimistic entries live
        at ``now_s`` count too (see the module docstring). The deepest matched page counts as
        recently used for the cap. While an L2 or the shared L3 view holds anything, the match
        goes on through them (the module docstring).
        """
        if now_s is not None:
            self.expire(now_s)
        if not page_hashes:
            return {}
        store = self.storage
        if store:
            store.expire(self.clock())
        if not self._num_host and not store:
            return match_all(self._workers, page_hashes, now_s)
        return match_tiers(self._workers, store, page_hashes, now_s)

    def confirmed_pages(self, worker_id: str, page_hashes: Sequence[int], hint: int = 0) -> int:
        """The raw match of ``page_hashes`` on ``worker_id`` from events alone (no
        predictions, no LRU touch); ``hint``: a likely answer, checked first."""
        w = self._workers.get(worker_id)
        if w is None or not page_hashes:
            return 0
        return full_pages(w.pages, None, None, page_hashes, hint)

    # ---------------------------------------------------------------- predictions

    def predict(
        self,
        worker_id: str,
        page_hashes: Sequence[int],
        until_s: float,
        *,
        from_page: int = 0,
        checkpoint_pages: Iterable[int] = (),
    ) -> None:
        """Optimistic entries on ``worker_id`` until ``until_s``: pages
        ``page_hashes[from_page:]`` (the ones before are confirmed already) and live checkpoints
        ending after page ``d - 1`` for each ``d`` in ``checkpoint_pages`` (1 <= d <= len)."""
        w = self._workers.get(worker_id)
        if w is None:
            return
        pages, pred = w.pages, w.pred
        added = [h for h in page_hashes[from_page:] if h not in pages]
        # NOTE: the latest prediction of a page wins (with one TTL and a forward clock, that is
        # the longest-lived); a renewed page is listed again, the older queue item skips it
        before = len(pred)
        pred.update(zip(added, repeat(until_s)))  # NOTE: no dict in between (dict.fromkeys)
        num_new = len(pred) - before
        ends = []
        for d in checkpoint_pages:
            if 1 <= d <= len(page_hashes):
                h = page_hashes[d - 1]
                w.pred_ckpts[h] = (d, until_s)
                ends.append(h)
        self._num_pred += num_new
        self._pred_queue.append((until_s, worker_id, w, added, ends))
        self._num_queued += len(added) + len(ends)
        # NOTE: the queue lists every entry at least once, so bounding it bounds them all
        while self._num_queued > self.max_predicted_pages and self._pred_queue:
            self._drop_prediction(self._pred_queue.popleft(), force=True)

    def expire(self, now_s: float) -> None:
        """Drop optimistic entries whose ``until_s`` is at or before ``now_s``."""
        q = self._pred_queue
        # NOTE: entries are queued in insertion order; with one TTL that is until_s order. A
        # longer-lived entry queued before a shorter one only delays the latter's cleanup (match
        # checks until_s itself), never its expiry.
        while q and q[0][0] <= now_s:
            self._drop_prediction(q.popleft(), force=False)

    def forget_predictions(self, worker_id: str) -> None:
        w = self._workers.get(worker_id)
        if w is not None:
            self._num_pred -= len(w.pred)
            w.pred.clear()
            w.pred_ckpts.clear()

    # ---------------------------------------------------------------- membership

    def add_worker(
        self, worker_id: str, *, window_pages: int | None = None, per_page_swa: bool = False
    ) -> None:
        """Start tracking ``worker_id`` (``apply`` does it too). ``window_pages`` is k; 0 for
        a model without SWA layers (every full page is usable); None: learn it from events.
        ``per_page_swa``: its events announce SWA per page (``Welcome.swa_page_events``; the
        first ``SwaBlocksStored`` says so too), so predicted pages have their SWA."""
        w = self._workers.setdefault(worker_id, _Worker())
        if window_pages is not None:
            w.window_pages = window_pages
        w.per_page_swa = w.per_page_swa or per_page_swa

    def remove_worker(self, worker_id: str) -> None:
        """The worker left: forget it."""
        self.forget_predictions(worker_id)
        w = self._workers.pop(worker_id, None)
        if w is not None:
            self._num_pages -= len(w.pages)
            self._num_host -= len(w.host)

    def note_instance(self, worker_id: str, instance_id: str) -> bool:
        """Record the worker's process instance; a new one means a restart (pages forgotten,
        the next batch expected is seq 0). Returns whether it was a restart."""
        w = self._workers.setdefault(worker_id, _Worker())
        if w.instance_id is None or w.instance_id == instance_id:
            w.instance_id = instance_id
            return False
        w.instance_id = instance_id
        self._restart(w)
        return True

    # ---------------------------------------------------------------- events

    def apply(self, worker_id: str, seq: int, batch: KVEventBatch) -> int | None:
        """Apply one batch from the live stream.

        Returns:
            None, or the seq to ask a replay from (a gap before ``seq``; the batch is held until
            ``apply_replay`` or ``resync``).
        """
        w = self._workers.setdefault(worker_id, _Worker())
        if w.live_last is not None and seq <= w.live_last:
            self._restart(w)
        w.live_last = seq
        if seq < w.next_seq:
            return None  # NOTE: already applied from a replay
        if seq > w.next_seq:
            self._hold(w, seq, batch)
            self.stats.gaps += 1
            return w.next_seq
        self._apply_batch(w, batch)
        w.next_seq += 1
        return self._drain(w)

    def apply_replay(
        self, worker_id: str, batches: Iterable[tuple[int, KVEventBatch]]
    ) -> int | None:
        """Apply a replay's ``(seq, batch)``s (any order; ones already applied are skipped).

        When the replay starts after the seq the index needs, the gap can't be filled: the
        worker's pages are forgotten and it rebuilds from the first batch there is.

        Returns:
            None, or the seq to ask a replay from for a gap that is still open.
        """
        w = self._workers.setdefault(worker_id, _Worker())
        for seq, batch in batches:
            if seq >= w.next_seq:
                w.pending.setdefault(seq, batch)
        if w.pending and w.next_seq not in w.pending:
            self._forget(w, min(w.pending))
            self.stats.resyncs += 1
        return self._drain(w)

    def resync(self, worker_id: str) -> None:
        """No replay is possible: forget the worker's pages, go on from the held batches."""
        w = self._workers.setdefault(worker_id, _Worker())
        last = -1 if w.live_last is None else w.live_last
        next_seq = min(w.pending) if w.pending else max(w.next_seq, last + 1)
        self._forget(w, next_seq)
        self.stats.resyncs += 1
        self._drain(w)

    # ---------------------------------------------------------------- internals

    def _apply_batch(self, w: _Worker, batch: KVEventBatch) -> None:
        for event in batch.events:
            self._apply_event(w, event)
        self._enforce_cap()

    def _apply_event(self, w: _Worker, event: KVEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            self._num_pages -= len(w.pages)
            self._num_host -= len(w.host)
            w.clear()  # NOTE: its device and L2 views; the shared L3 stays
            return
        medium = getattr(event, "medium", MEDIUM_GPU)
        if medium == MEDIUM_CPU:
            self._apply_host_event(w, event)
            return
        if medium == MEDIUM_GCACHE:
            self._apply_storage_event(w, event)
            return
        if medium not in (MEDIUM_GPU, None):
            return  # NOTE: a medium this index does not know (another connector's): no credit
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            for h in event.block_hashes:
                if h in w.pages:
                    w.pages.move_to_end(h)
                else:
                    w.pages[h] = parent
                    self._num_pages += 1
                    if w.pred and w.pred.pop(h, None) is not None:
                        self._num_pred -= 1  # NOTE: confirmed: the event replaces the guess
                parent = h
        elif isinstance(event, BlockRemoved):
            self._num_pages -= sum(map(w.remove, event.block_hashes))
        elif isinstance(event, SwaCheckpointStored):
            k = w.window_pages = cdiv(event.window or 0, self.page_size)
            for h in event.block_hashes:
                w.add_ckpt(h, k)
        elif isinstance(event, SwaCheckpointDropped):
            for h in event.block_hashes:
                w.drop_ckpt(h)
        elif isinstance(event, SwaBlocksStored):
            w.window_pages = cdiv(event.window or 0, self.page_size)
            w.per_page_swa = True
            pages = w.pages  # NOTE: a page the cap dropped stays unknown (an under-report)
            w.swa.update(h for h in event.block_hashes if h in pages)
        elif isinstance(event, SwaBlocksDropped):
            w.swa.difference_update(event.block_hashes)

    def _apply_host_event(self, w: _Worker, event: KVEvent) -> None:
        """L2 ("CPU"): what enters and leaves the worker's host memory. Checkpoint events are
        not sent for L2 (its SWA comes per page) and are ignored."""
        host = w.host
        if isinstance(event, BlockStored):
            self._num_host += host.store(event.block_hashes, FULL)
        elif isinstance(event, SwaBlocksStored):
            w.window_pages = cdiv(event.window or 0, self.page_size)
            self._num_host += host.store(event.block_hashes, SWA)
        elif isinstance(event, SwaBlocksDropped):
            self._num_host -= host.drop_swa(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self._num_host -= host.remove(event.block_hashes)

    def _apply_storage_event(self, w: _Worker, event: KVEvent) -> None:
        """L3 ("GCACHE"): confirmations only; the store's TTL and LRU evict silently (and any
        removal a publisher might send is ignored: another worker may have written it again)."""
        if isinstance(event, BlockStored):
            self.storage.store(event.block_hashes, FULL, self.clock())
        elif isinstance(event, SwaBlocksStored):
            w.window_pages = cdiv(event.window or 0, self.page_size)
            self.storage.store(event.block_hashes, SWA, self.clock())

    def _drain(self, w: _Worker) -> int | None:
        while (batch := w.pending.pop(w.next_seq, None)) is not None:
            self._apply_batch(w, batch)
            w.next_seq += 1
        for seq in [s for s in w.pending if s < w.next_seq]:
            del w.pending[seq]
        return w.next_seq if w.pending else None

    def _hold(self, w: _Worker, seq: int, batch: KVEventBatch) -> None:
        w.pending[seq] = batch
        if len(w.pending) > MAX_PENDING_BATCHES:
            # NOTE: the replay never came; give up on the gap rather than grow without bound
            self._forget(w, min(w.pending))
            self.stats.resyncs += 1

    def _drop_prediction(
        self, item: tuple[float, str, _Worker, list[int], list[int]], *, force: bool
    ) -> None:
        until_s, _, w, added, ends = item
        self._num_queued -= len(added) + len(ends)
        for h in added:
            u = w.pred.get(h)
            # NOTE: an entry renewed by a later prediction stays (unless the cap forces it out)
            if u is not None and (force or u <= until_s):
                del w.pred[h]
                self._num_pred -= 1
        for h in ends:
            c = w.pred_ckpts.get(h)
            if c is not None and (force or c[1] <= until_s):
                del w.pred_ckpts[h]

    def _restart(self, w: _Worker) -> None:
        self._num_pred -= len(w.pred)
        w.pred.clear()
        w.pred_ckpts.clear()
        w.pending.clear()  # NOTE: the old instance's batches
        self._forget(w, 0)
        w.live_last = None
        self.stats.restarts += 1

    def _forget(self, w: _Worker, next_seq: int) -> None:
        self._num_pages -= len(w.pages)
        self._num_host -= len(w.host)
        w.clear()
        w.pending = {s: b for s, b in w.pending.items() if s >= next_seq}
        w.next_seq = next_seq

    def _enforce_cap(self) -> None:
        while self._num_pages > self.max_pages:
            # NOTE: O(workers) per eviction; the oldest entry of the biggest worker goes
            biggest = max(self._workers.values(), key=lambda w: len(w.pages))
            biggest.remove(next(iter(biggest.pages)))
            self._num_pages -= 1
            self.stats.evicted_pages += 1
        while self._num_host > self.max_host_pages:
            biggest = max(self._workers.values(), key=lambda w: len(w.host))
            biggest.host.pop_oldest()
            self._num_host -= 1
            self.stats.evicted_host_pages += 1
