"""L3 "GCache" below L2: pages written to a shared ``PageStore`` and fetched back into L2
(DESIGN.md "Tiers", issue 12).

    writes   write-through: a finished request's path (full pages it lacks in L3, and the SWA
             window ending at its checkpoint), gathered on the step loop in one copy per layer
             kind (on CUDA queued to pinned host memory, never waited for there), encoded and put
             on the writer thread; write-back: what L2 evicts and L3 lacks. A full queue drops
             the write and counts it.
    reads    a prefetch when a request is queued (``start_fetch``): the fetcher thread gets the
             pages its prompt lacks in L1 and L2 (full pages while they chain, then the SWA of
             the last ``swa_scan_pages`` of them) and decodes them; the request waits in the
             queue (not the step loop) until they land in L2 (``land``) or ``wait_s`` passes.
             Admission then loads them from L2 like any L2 hit, by the window rule.

What is in L3 is known only from this worker's confirmed writes and reads (``known``, an LRU of
page keys): writes skip what is known, and each confirmation is announced as a KV event with
medium "GCACHE" (a router credits it on every worker sharing the store). Other workers' writes,
TTL expiry and the store's own eviction are learnt by looking.

Threads: the step loop (scheduler thread) owns everything but ``_fetch_loop`` and the writer's
jobs, which touch only their own job objects, the store and two deques.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.kv.gcache.format import KIND_NAMES, decode_page, encode_page, page_key, page_shape
from engine.kv.gcache.store import PageStore
from engine.kv.gcache.writer import BackgroundWriter
from engine.kv.host_pool import HostEntry
from engine.kv.layout import KVLayout, PageKind
from engine.kv.node import CacheEvent, Node
from engine.kv.prefix_cache import PrefixCache
from engine.kv.tier import HostTier

logger = logging.getLogger("engine.kv.gcache")

MEDIUM = "GCACHE"  # engine.worker.events.MEDIUM_GCACHE
_SIM_SHAPE = (0,)  # the sim backend's pages: no bytes, the bookkeeping only
_SIM_DTYPE = torch.float16

PageRef = tuple[int, int | None, tuple[int, ...] | None]  # (hash, parent hash, token ids)


@dataclass
class GCacheStats:
    written_pages: int = 0  # confirmed in the store after a write (present already included)
    write_failed_pages: int = 0  # the store failed the write (an outage): retried later
    write_dropped: int = 0  # write jobs refused: the writer's queue was full
    fetches: int = 0  # prefetches started
    fetch_dropped: int = 0  # prefetches refused: the fetch queue was full
    fetched_pages: int = 0  # pages (full or SWA) landed in L2 from the store
    wait_timeouts: int = 0  # requests admitted before their prefetch finished
    hit_tokens: int = 0  # prompt tokens whose full KV came from the store
    hibernated: int = 0  # sessions written out and dropped from this worker


@dataclass(eq=False)
class Fetch:
    """One queued request's lookup; the fetcher thread fills ``pages`` and then sets ``done``."""

    refs: list[PageRef]  # from the first page L1 and L2 lack, in chain order
    swa_scan_pages: int
    deadline: float
    pages: list[tuple[PageRef, torch.Tensor | None, torch.Tensor | None]] = field(
        default_factory=list)  # (page, full KV or None, SWA KV or None), in chain order
    done: bool = False
    cancelled: bool = False


class GCacheTier:
    """Args:
    store: the L3 backend (``open_store``); closed by ``close``.
    fingerprint: ``model_fingerprint`` of the served model (the key namespace).
    host: L2, where fetched pages land and whose evictions are written back.
    layout: the page geometry.
    device_pool: the device ``KVPool`` (None for the sim: values carry no bytes).
    wait_s: how long a queued request waits for its prefetch at most.
    max_queue: write jobs (and fetches) waiting at most; more are dropped and counted.
    swa_scan_pages: how far back from the deepest fetched page to look for SWA KV (a window
        end); write-through stores windows at request ends, which a next turn extends.
    max_known: page keys remembered as present in the store (LRU).
    on_event: KV events (medium "GCACHE") for the confirmed pages.
    """

    def __init__(
        self, store: PageStore, fingerprint: str, host: HostTier, layout: KVLayout,
        device_pool: object | None, *, wait_s: float = 0.5, max_queue: int = 256,
        swa_scan_pages: int = 64, max_known: int = 1 << 18,
        on_event: Callable[[CacheEvent], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store, self.fingerprint, self.host, self.layout = store, fingerprint, host, layout
        self.device_pool = device_pool
        self.wait_s, self.swa_scan_pages, self.max_known = wait_s, swa_scan_pages, max_known
        self.on_event, self.clock = on_event, clock
        self.stats = GCacheStats()
        self.has_swa = layout.page_bytes(PageKind.SWA) > 0
        pool = getattr(device_pool, "arena", None)
        self._dtype = _SIM_DTYPE if pool is None else pool.dtype
        self._shapes = {k: _SIM_SHAPE if pool is None else page_shape(layout, k) for k in PageKind}
        self._known: OrderedDict[tuple[int, PageKind], None] = OrderedDict()
        self._inflight: set[tuple[int, PageKind]] = set()
        # NOTE: appended by the writer's thread, drained by the step loop (deque ops are atomic)
        self._results: deque[tuple[list[tuple[PageRef, PageKind]], bool]] = deque()
        self.writer = BackgroundWriter(store, max_queue)
        self._fetches: queue.Queue[Fetch | None] = queue.Queue(maxsize=max_queue)
        self._fetcher = threading.Thread(target=self._fetch_loop, name="gcache-fetch",
                                         daemon=True)
        self._fetcher.start()
        host.host.on_evict = self._write_back
        # NOTE: threads still encoding (torch) while the interpreter finalizes can abort the
        # process; closing at exit also writes what is queued
        atexit.register(_close_at_exit, weakref.ref(self))
        self._closed = False

    # ---------------------------------------------------------------- writes

    def write_path(self, path: Sequence[Node], window_pages: int) -> bool:
        """Write-through: the full pages of ``path`` (root first) the store lacks, and the SWA
        of its last ``window_pages`` pages. Returns False when the write was dropped (queue
        full); True when it was queued or nothing was missing."""
        self.poll()
        todo: list[tuple[PageRef, PageKind, torch.Tensor | None]] = []
        ids: dict[PageKind, list[tuple[int, int]]] = {kind: [] for kind in PageKind}
        first_swa = len(path) - window_pages if self.has_swa else len(path)
        for i, node in enumerate(path):
            parent = node.parent.page_hash if node.parent is not None else None
            ref = (node.page_hash, parent, node.token_ids)
            kinds = [(PageKind.FULL, node.full_page)]
            if i >= first_swa and node.swa_page is not None:
                kinds.append((PageKind.SWA, node.swa_page))
            for kind, page_id in kinds:
                if self._wanted(node.page_hash, kind):
                    if page_id is not None:
                        ids[kind].append((len(todo), page_id))
                    todo.append((ref, kind, None))
        ready = None
        if self.device_pool is not None:
            for kind, pairs in ids.items():
                if pairs:
                    batch, ready = self._snapshot_device(kind, [page for _, page in pairs])
                    for j, (at, _) in enumerate(pairs):
                        todo[at] = (todo[at][0], kind, batch[j])
        return self._submit(todo, ready)

    def has_path(self, path: Sequence[Node], window_pages: int) -> bool:
        """Whether every page ``write_path`` would write is confirmed in the store."""
        self.poll()
        first_swa = len(path) - window_pages if self.has_swa else len(path)
        return all(
            (n.page_hash, PageKind.FULL) in self._known
            and (i < first_swa or n.swa_page is None or (n.page_hash, PageKind.SWA) in self._known)
            for i, n in enumerate(path)
        )

    def _write_back(self, entry: HostEntry) -> None:
        """L2 evicts ``entry`` (its slots are still valid): write what the store lacks."""
        ref = (entry.page_hash, entry.parent_hash, entry.token_ids)
        todo = []
        for kind in PageKind:
            slot = entry.slot(kind)
            if slot is not None and self._wanted(entry.page_hash, kind):
                src = self.host.host.page(kind, slot)
                todo.append((ref, kind, None if src is None else src.clone()))
        self._submit(todo)

    def _wanted(self, page_hash: int, kind: PageKind) -> bool:
        key = (page_hash, kind)
        if key in self._known:
            self._known.move_to_end(key)
            return False
        return key not in self._inflight

    def _snapshot_device(
        self, kind: PageKind, page_ids: list[int]
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """These device pages, copied now (they may be freed and reused before the writer
        encodes them) in one gather: [len(page_ids), *page shape] on the host. On CUDA the copy
        to host is queued (pinned memory) and the event says when it is done; the step loop
        never waits for it (the writer does)."""
        per = self.layout.slots_per_chunk(kind)
        view = self.device_pool.view(kind)  # type: ignore[attr-defined]
        idx = torch.tensor(page_ids, dtype=torch.long, device=view.device)
        batch = view[idx // per, idx % per]  # NOTE: advanced indexing: a fresh tensor
        if batch.device.type != "cuda":
            return batch, None
        host = torch.empty(batch.shape, dtype=batch.dtype, pin_memory=True)
        host.copy_(batch, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    def _submit(self, todo: list[tuple[PageRef, PageKind, torch.Tensor | None]],
                ready: torch.cuda.Event | None = None) -> bool:
        """Queue ``todo`` for the writer (after ``ready``, the host copies' event, if any)."""
        if not todo:
            return True
        keys = [(ref[0], kind) for ref, kind, _ in todo]
        if not self.writer.submit(lambda: self._write_job(todo, ready)):
            self.stats.write_dropped += 1
            return False
        self._inflight.update(keys)
        return True

    def _write_job(self, todo: list[tuple[PageRef, PageKind, torch.Tensor | None]],
                   ready: torch.cuda.Event | None = None) -> list:
        """On the writer's thread: encode and put; report which pages the store confirmed."""
        if ready is not None:
            ready.synchronize()
        items = [(self._key(ref[0], kind), self._encode(t)) for ref, kind, t in todo]
        st = self.store.stats
        before = st.errors, st.skipped_too_large
        self.store.put_many(items)
        ok = (st.errors, st.skipped_too_large) == before
        self._results.append(([(ref, kind) for ref, kind, _ in todo], ok))
        return []  # NOTE: written here already (the writer's own put would write them again)

    def _encode(self, t: torch.Tensor | None) -> bytes:
        return encode_page(t if t is not None else torch.empty(_SIM_SHAPE, dtype=_SIM_DTYPE))

    # ---------------------------------------------------------------- reads

    def missing(
        self, page_hashes: Sequence[int], token_ids: Sequence[int] | None, num_tokens: int,
        cache: PrefixCache,
    ) -> list[PageRef]:
        """The pages of a prompt of ``num_tokens`` (its chained hashes; its tokens, or None)
        from the first one whose full KV neither L1 (``cache``) nor L2 holds, as many as L2 can
        take at once (a fetch lands no more); the last token's page is never needed."""
        p = self.layout.page_size
        n = (num_tokens - 1) // p
        host, i = self.host.host, 0
        while i < n and (cache.lookup(page_hashes[i]) is not None
                         or ((e := host.get(page_hashes[i])) is not None
                             and e.full_slot is not None)):
            i += 1
        per_page = self.layout.page_bytes(PageKind.FULL) + self.layout.page_bytes(PageKind.SWA)
        end = min(n, i + host.total_bytes // max(1, per_page))
        return [(page_hashes[j], page_hashes[j - 1] if j else None,
                 None if token_ids is None else tuple(token_ids[j * p : (j + 1) * p]))
                for j in range(i, end)]

    def start_fetch(self, refs: list[PageRef]) -> Fetch | None:
        """Look up ``refs`` (the pages a queued prompt lacks locally, in chain order) in the
        store on the fetcher thread; None when there is nothing to look up or no room."""
        self.poll()
        if not refs:
            return None
        job = Fetch(refs, self.swa_scan_pages if self.has_swa else 0,
                    self.clock() + self.wait_s)
        try:
            self._fetches.put_nowait(job)
        except queue.Full:
            self.stats.fetch_dropped += 1
            return None
        self.stats.fetches += 1
        return job

    def ready(self, job: Fetch) -> bool:
        """Whether the request may be admitted: its fetch landed (now, in L2) or timed out."""
        if job.done:
            self.land(job)
            return True
        if self.clock() >= job.deadline:
            job.cancelled = True
            self.stats.wait_timeouts += 1
            return True
        return False

    def land(self, job: Fetch) -> None:
        """Put a finished fetch's pages into L2 (protected from each other's eviction)."""
        self.poll()
        pool = self.host.host
        pool.protect(ref[0] for ref, _, _ in job.pages)
        try:
            for ref, full, swa in job.pages:
                pages = self._present(full, swa)
                entry = self.host.put(ref[0], ref[1], ref[2], pages)
                if entry is None:
                    break  # NOTE: L2 is full of protected pages: the rest would not chain
                if full is not None or (swa is not None and entry.full_slot is not None):
                    entry.from_storage = True
                self.stats.fetched_pages += len(pages)
                for kind, _ in pages:
                    self._remember((ref[0], kind))
        finally:
            pool.unprotect()
        job.pages = []

    def _present(
        self, full: torch.Tensor | None, swa: torch.Tensor | None
    ) -> list[tuple[PageKind, torch.Tensor | None]]:
        """The kinds a fetch found for a page (a tensor each, or None on the sim)."""
        found = []
        for kind, t in ((PageKind.FULL, full), (PageKind.SWA, swa)):
            if t is not None:
                found.append((kind, None if self.device_pool is None else t))
        return found

    def _fetch_loop(self) -> None:
        while (job := self._fetches.get()) is not None:
            try:
                if not job.cancelled:
                    self._fetch(job)
            except Exception:  # noqa: BLE001 (a bug here must not stop every later fetch)
                logger.exception("gcache fetch failed")
            finally:
                job.done = True

    def _fetch(self, job: Fetch) -> None:
        """Full pages while they chain, then the SWA of the last ``swa_scan_pages`` of them."""
        full = self._get(job.refs, PageKind.FULL)
        n = next((i for i, t in enumerate(full) if t is None), len(full))
        lo = max(0, n - job.swa_scan_pages)
        swa = self._get(job.refs[lo:n], PageKind.SWA) if job.swa_scan_pages and n else []
        swa = [None] * lo + swa
        job.pages = [(job.refs[i], full[i], swa[i]) for i in range(n)]

    def _get(self, refs: Sequence[PageRef], kind: PageKind) -> list[torch.Tensor | None]:
        values = self.store.get_many([self._key(ref[0], kind) for ref in refs])
        out = []
        for value in values:
            t = None if value is None else decode_page(value, self._shapes[kind], self._dtype)
            if value is not None and t is None:
                self.store.stats.count_corrupt()
            out.append(t)
        return out

    # ---------------------------------------------------------------- bookkeeping

    def poll(self) -> None:
        """Take in the writer's confirmations (step loop): known pages, KV events."""
        while self._results:
            pages, ok = self._results.popleft()
            for ref, kind in pages:
                self._inflight.discard((ref[0], kind))
                if ok:
                    self._remember((ref[0], kind))
                    self._announce(ref, kind)
            if ok:
                self.stats.written_pages += len(pages)
            else:
                self.stats.write_failed_pages += len(pages)

    def _remember(self, key: tuple[int, PageKind]) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        while len(self._known) > self.max_known:
            self._known.popitem(last=False)

    def _announce(self, ref: PageRef, kind: PageKind) -> None:
        if self.on_event is None:
            return
        h, parent, tokens = ref
        if kind == PageKind.FULL:
            self.on_event(CacheEvent("stored", h, parent, tokens, medium=MEDIUM))
        else:
            self.on_event(CacheEvent("swa_stored", h, medium=MEDIUM))

    def _key(self, page_hash: int, kind: PageKind) -> bytes:
        return page_key(self.fingerprint, KIND_NAMES[kind], page_hash)

    def flush_writes(self, timeout_s: float) -> bool:
        """Wait for the queued writes (tests, shutdown); then take in their confirmations."""
        ok = self.writer.flush(timeout_s)
        self.poll()
        return ok

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (up to ``timeout_s``), stop both threads, close the store."""
        if self._closed:
            return
        self._closed = True
        self.host.host.on_evict = None
        self.writer.close(timeout_s)
        with contextlib.suppress(queue.Full):
            self._fetches.put(None, timeout=timeout_s)
        self._fetcher.join(timeout_s)
        self.poll()
        self.store.close()


def _close_at_exit(ref: weakref.ref[GCacheTier]) -> None:
    tier = ref()
    if tier is not None:
        tier.close(timeout_s=2.0)
