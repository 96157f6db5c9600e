"""KVIndex against the engine's own PrefixCache (hypothesis): random requests, evictions, flushes
and restarts drive the cache; its events go over the wire format with random losses (filled by a
replay from a bounded buffer, or resynced); after each settled delivery the index's match equals
the engine's own window-safe match (history SWA included: the per-page SWA events) while nothing
was lost for good, and never exceeds it."""

from __future__ import annotations

import itertools
import random
from collections import deque
from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.hashing import page_hashes
from engine.kv.allocator import PageAllocator
from engine.kv.layout import KVLayout, PageKind
from engine.kv.prefix_cache import Node, PrefixCache
from engine.worker.events import SWA_EXTENSION_EVENTS, KVEventBatch, decode_batch, encode_batch
from engine.worker.publisher import KVEventBuffer
from gateway.routing import KVIndex, MatchResult

PAGE = 4
WORKER = "w"
REPLAY_BUFFER = 6  # batches the "worker" keeps for replay (small: replays often fall short)

# token streams over a tiny alphabet share prefixes often
_tokens = st.lists(st.integers(0, 2), min_size=1, max_size=9).map(
    lambda pages: [t for p in pages for t in [p, 0, 0, 1]] + [7]
)


def _make_cache(window: int, num_chunks: int, buffer: KVEventBuffer) -> PrefixCache:
    # as tests/engine/test_prefix_cache.py: an SWA page is twice a full page
    layout = KVLayout(page_size=PAGE, dtype_bytes=1, full_layer_ids=(0,), swa_layer_ids=(1,),
                      full_head_dims=(1, 2, 2), swa_head_dims=(2, 2, 2), window=window)
    alloc = PageAllocator(layout, num_chunks * layout.chunk_bytes)
    return PrefixCache(alloc, on_event=buffer.add)


@dataclass
class _Running:
    hashes: list[int]
    path: list[Node] = field(default_factory=list)
    swa_pinned: list[Node] = field(default_factory=list)


class _Driver:
    """The engine-side protocol (tests/engine/test_prefix_cache.py): match, pin, compute pages,
    slide the window, finish (marking the end a checkpoint)."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache

    def start(self, hashes: list[int], num_pages: int) -> _Running:
        req = _Running(hashes)
        m = self.cache.match(hashes, max_tokens=len(hashes) * PAGE - 1)
        req.path = list(m.nodes)
        if req.path:
            self.cache.pin(req.path[-1], full=True, swa=False)
            for n in req.path[-self.cache.window_pages :]:
                self.cache.pin(n, full=False, swa=True)
                req.swa_pinned.append(n)
        for _ in range(num_pages):
            if len(req.path) >= len(hashes) or not self.cache.evict(1, 1):
                break
            full = self.cache.allocator.allocate(PageKind.FULL, 1)[0]
            swa = self.cache.allocator.allocate(PageKind.SWA, 1)[0]
            parent = req.path[-1] if req.path else None
            node = self.cache.insert(parent, hashes[len(req.path)], full, swa)
            if parent is not None:
                self.cache.unpin(parent, full=True, swa=False)
            req.path.append(node)
            req.swa_pinned.append(node)
            while len(req.swa_pinned) > self.cache.window_pages:
                self.cache.unpin(req.swa_pinned.pop(0), full=False, swa=True)
        return req

    def finish(self, req: _Running, checkpoint: bool, periodic: bool = False) -> None:
        if periodic:  # speculative points every 2 pages (engine checkpoint_interval_tokens)
            for n in req.path[1::2]:
                self.cache.mark_checkpoint(n, periodic=True)
        if checkpoint and req.path:
            self.cache.mark_checkpoint(req.path[-1])
        for n in req.swa_pinned:
            self.cache.unpin(n, full=False, swa=True)
        if req.path:
            self.cache.unpin(req.path[-1], full=True, swa=False)


def _engine_rule(cache: PrefixCache, hashes: list[int], swa_live) -> MatchResult:
    """PrefixCache.match's rule, brute force, with a chosen notion of "live SWA"."""
    k, raw = cache.window_pages, 0
    while raw < len(hashes) and cache.lookup(hashes[raw]) is not None:
        raw += 1
    usable = 0
    for p in range(1, raw + 1):
        if all(swa_live(cache.lookup(hashes[i])) for i in range(max(0, p - k), p)):
            usable = p
    return MatchResult(raw, usable)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache: PrefixCache | None = None
        self.index = KVIndex(PAGE)
        self.prompts: list[list[int]] = []
        self.running: list[_Running] = []
        self.instance = itertools.count()
        self.exact = True  # no resync since the index last knew everything

    # ---------------------------------------------------------------- the "worker"

    @precondition(lambda self: self.cache is None)
    @rule(window=st.sampled_from([1, 4, 6, 8]), chunks=st.integers(4, 24),
          rng=st.randoms(use_true_random=False), drop=st.sampled_from([0.0, 0.2, 0.5]))
    def setup(self, window: int, chunks: int, rng: random.Random, drop: float) -> None:
        self.window, self.chunks, self.rng, self.drop = window, chunks, rng, drop
        self._new_instance()

    @precondition(lambda self: self.cache is not None)
    @rule(tokens=_tokens, num_pages=st.integers(0, 10))
    def start(self, tokens: list[int], num_pages: int) -> None:
        hashes = page_hashes(tokens, PAGE)
        self.prompts.append(hashes)
        self.running.append(self.driver.start(hashes, num_pages))
        self._publish()

    @precondition(lambda self: self.running)
    @rule(data=st.data(), checkpoint=st.booleans(), periodic=st.booleans())
    def finish(self, data: st.DataObject, checkpoint: bool, periodic: bool) -> None:
        req = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self.driver.finish(req, checkpoint, periodic)
        self._publish()

    @precondition(lambda self: self.cache is not None)
    @rule(prompts=st.lists(_tokens, min_size=2, max_size=6))
    def burst(self, prompts: list[list[int]]) -> None:
        """Many batches in one step: a loss early in it outlives the replay buffer."""
        for tokens in prompts:
            hashes = page_hashes(tokens, PAGE)
            self.prompts.append(hashes)
            req = self.driver.start(hashes, len(hashes))
            self.driver.finish(req, checkpoint=True, periodic=len(hashes) % 2 == 0)
            self._publish()

    @precondition(lambda self: self.cache is not None)
    @rule(num_full=st.integers(1, 8), num_swa=st.integers(0, 4))
    def evict(self, num_full: int, num_swa: int) -> None:
        self.cache.evict(num_full, num_swa)
        self._publish()

    @precondition(lambda self: self.cache is not None)
    @rule()
    def flush(self) -> None:
        self.cache.flush()
        self._publish()
        self._settle()
        # NOTE: flush() keeps the pages running requests pin but still emits AllBlocksCleared:
        # the index forgets them and is never told they stayed (an under-report from then on)
        self.exact = not self.running

    @precondition(lambda self: self.cache is not None)
    @rule()
    def restart(self) -> None:
        self._new_instance()

    @precondition(lambda self: self.cache is not None)
    @rule()
    def drop_history(self) -> None:
        """What pressure takes first: every unpinned history SWA page (SwaBlocksDropped)."""
        self.cache.drop_history()
        self._publish()

    @precondition(lambda self: self.cache is not None and not self.running)
    @rule()
    def compare_with_engine_match(self) -> None:
        """The engine's real match (``PrefixCache.match``), not a re-statement of its rule."""
        self._settle()
        for hashes in self.prompts[-8:]:
            idx = self.index.match(hashes).get(WORKER, MatchResult(0, 0))
            m = self.cache.match(hashes, max_tokens=len(hashes) * PAGE)
            engine = MatchResult(m.raw_tokens // PAGE, m.usable_tokens // PAGE)
            if self.exact:
                assert idx == engine, (hashes, idx, engine)
            assert idx.full_pages <= engine.full_pages and idx.usable_pages <= engine.usable_pages

    # ---------------------------------------------------------------- the invariant

    @invariant()
    def index_mirrors_engine(self) -> None:
        if self.cache is None:
            return
        self._settle()
        for hashes in self.prompts[-8:]:
            idx = self.index.match(hashes).get(WORKER, MatchResult(0, 0))
            by_swa = _engine_rule(self.cache, hashes, lambda n: n.swa_page is not None)
            if self.exact:
                assert idx == by_swa, (hashes, idx, by_swa)
            assert idx.full_pages <= by_swa.full_pages, (idx, by_swa)
            assert idx.usable_pages <= by_swa.usable_pages, (idx, by_swa)

    # ---------------------------------------------------------------- delivery

    def _new_instance(self) -> None:
        self.buffer = KVEventBuffer(PAGE, self.window)
        self.cache = _make_cache(self.window, self.chunks, self.buffer)
        self.driver = _Driver(self.cache)
        self.running = []
        self.next_seq = 0
        self.replay: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BUFFER)
        # NOTE: the subscriber learns a new instance from the worker's load reports
        self.index.note_instance(WORKER, f"instance-{next(self.instance)}")
        self.exact = True

    def _publish(self) -> None:
        """As EventPublisher.publish: one batch per run of standard / SWA extension events."""
        events = self.buffer.drain()
        for _, run in itertools.groupby(events, key=lambda e: isinstance(e, SWA_EXTENSION_EVENTS)):
            payload = encode_batch(KVEventBatch(ts=0.0, events=list(run)))
            seq, self.next_seq = self.next_seq, self.next_seq + 1
            self.replay.append((seq, payload))
            if self.rng.random() >= self.drop:
                self._deliver(seq, payload)

    def _deliver(self, seq: int, payload: bytes) -> None:
        gap = self.index.apply(WORKER, seq, decode_batch(payload))
        if gap is not None:
            self._fill(gap)

    def _settle(self) -> None:
        """What the next batch or heartbeat would trigger: catch up on lost trailing batches."""
        if self.index.next_seq(WORKER) < self.next_seq:
            self._fill(self.index.next_seq(WORKER))
        assert self.index.next_seq(WORKER) == self.next_seq

    def _fill(self, start: int) -> None:
        resyncs = self.index.stats.resyncs
        if self.rng.random() < 0.8:
            batches = [(s, decode_batch(p)) for s, p in self.replay if s >= start]
            if self.index.apply_replay(WORKER, batches) is not None:
                self.index.resync(WORKER)
        else:
            self.index.resync(WORKER)
            if self.index.next_seq(WORKER) < self.next_seq:  # nothing held: lost at the tail
                self._fill(self.index.next_seq(WORKER))
        if self.index.stats.resyncs != resyncs:
            self.exact = False


IndexMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40,
                                          deadline=None)
TestIndexMachine = IndexMachine.TestCase
