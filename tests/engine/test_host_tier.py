"""L2 host tier below the prefix cache (issue 12): demotion instead of dropping, the window rule
across tiers, tenant isolation, greedy tokens unchanged, and the L1 -> L2 -> L1 path under
random use (hypothesis)."""

from __future__ import annotations

import argparse
import itertools
import random
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv.allocator import PageAllocator
from engine.kv.host_pool import HostPagePool
from engine.kv.layout import KVLayout, PageKind, usable_pages
from engine.kv.manager import KVManager
from engine.kv.pool import KVPool
from engine.kv.prefix_cache import CacheEvent, PrefixCache
from engine.kv.tier import HostTier
from engine.llm import LLM, RequestOutput
from engine.model_config import ModelConfig
from engine.models.checkpoint import mimo_config
from engine.protocol import Finished
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.sim import ZERO_COST
from engine.worker.cli import add_arguments, engine_argv, engine_config
from engine.worker.publisher import RequestStream, load_report

FULL, SWA = PageKind.FULL, PageKind.SWA


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


# -- the window rule, pure -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("full", "swa", "k", "want"),
    [
        ("xxxxxx", "x-x-xx", 2, 6),
        ("xxxxxx", "xx--x-", 2, 2),  # pages 3..5 never have 2 SWA pages in a row ending there
        ("xxx---", "xxxxxx", 2, 3),  # full KV ends at 3
        ("xxxx", "----", 0, 4),  # no SWA layers: full KV is enough
        ("xxxx", "x---", 3, 1),  # near the start the window is shorter: [0, 1)
    ],
)
def test_usable_pages_is_the_window_rule(full: str, swa: str, k: int, want: int) -> None:
    got = usable_pages([c == "x" for c in full], [c == "x" for c in swa], k)
    assert got == want, f"full={full} swa={swa} k={k}: usable {got}, want {want}"


# -- the sim engine: bookkeeping of both tiers ------------------------------------------------


def _sim(window: int, l1_chunks: int, l2_chunks: int) -> Engine:
    model_config = ModelConfig.from_dict(mimo_config(layers="FSSF", sliding_window=window))
    layout = KVLayout.from_model(model_config, 4, 2)
    cfg = EngineConfig(backend="sim", page_size=4, kv_budget_bytes=l1_chunks * layout.chunk_bytes,
                       host_kv_budget_bytes=l2_chunks * layout.chunk_bytes,
                       max_num_batched_tokens=16, checkpoint_interval_tokens=0)
    return Engine(cfg, model_config=model_config, cost=ZERO_COST)


_ids = itertools.count()


def _run(engine: Engine, prompt: list[int], new: int, salt: str | None = None) -> Sequence:
    seq = engine.make_sequence(f"r{next(_ids)}", prompt, SamplingParams(max_new_tokens=new),
                               cache_salt=salt)
    engine.add(seq)
    for _ in range(500):
        if not engine.has_work:
            return seq
        engine.step()
    raise AssertionError(f"not done: {engine.stats()}")


def test_window_rule_across_tiers_cuts_at_the_last_window_held_anywhere() -> None:
    """W = 8, page 4 (k = 2). Turn 1 ends at 36 (checkpoint: SWA of pages 7, 8), turn 2 at 48
    (SWA of 10, 11); then L1 is flushed down to L2: full pages 0..11, SWA only 7, 8, 10, 11.

    A prompt sharing 42 tokens with turn 2 has full KV for 10 pages in L2, but the window of
    page 10 needs SWA of pages 8 and 9 (9 is in no tier): usable 9 pages = 36 tokens, and only
    what those need is loaded (9 full pages + SWA 7, 8)."""
    engine = _sim(window=8, l1_chunks=64, l2_chunks=64)
    rng = random.Random(1)
    turn1 = _run(engine, [rng.randrange(300) for _ in range(30)], 7)  # computes [0, 36)
    prompt2 = [*turn1.prompt_ids, *turn1.output_ids, *(rng.randrange(300) for _ in range(7))]
    turn2 = _run(engine, prompt2, 7)  # computes [36, 49): checkpoint ends at page 11
    assert (turn1.num_cached, turn2.num_cached) == (0, 36)
    engine.cache.flush(demote=True)
    host = engine.host.host
    swa_held = sorted(
        int(h in host and host.get(h).swa_slot is not None) for h in turn2.page_hashes[:12]
    )
    assert engine.cache.num_nodes == 0 and sum(swa_held) == 4, swa_held
    loaded = engine.stats().host_loaded_pages
    branch = _run(engine, [*prompt2[:42], *(rng.randrange(300) for _ in range(5))], 2)
    assert branch.num_cached == 36, f"resumed at {branch.num_cached}, want 36 (window rule)"
    assert branch.num_cached_host == 36, f"L2 served {branch.num_cached_host}, want 36"
    assert engine.stats().host_loaded_pages - loaded == 9 + 2, "loaded beyond the usable end"
    # the full history of turn 2 (its checkpoint at 48) is usable again from L2 + L1
    again = _run(engine, [*prompt2, *turn2.output_ids[:-1], 5, 6], 2)
    assert again.num_cached == 48, f"resumed at {again.num_cached}, want turn 2's end (48)"
    # L1 holds pages 0..9 now (0..8 loaded, 9 computed by the branch): L2 adds 10 and 11
    assert again.num_cached_host == 48 - 40, "pages already back in L1 counted as L2 hits"


def test_history_swa_never_goes_down() -> None:
    """Dropping SWA outside every checkpoint frees it for good: L2 receives nothing."""
    engine = _sim(window=8, l1_chunks=64, l2_chunks=64)
    _run(engine, list(range(100, 140)), 1)  # checkpoint at page 9 (window 8, 9)
    freed = engine.cache.drop_history()
    assert freed == 8, f"{freed} history SWA pages dropped, want pages 0..7"
    assert engine.stats().host_demoted_pages == 0, "history SWA went to L2"


def test_other_tenant_never_loads_l2_pages() -> None:
    engine = _sim(window=8, l1_chunks=64, l2_chunks=64)
    prompt = list(range(200, 240))
    first = _run(engine, prompt, 3, salt="tenant-a")  # checkpoint at its end, 40
    engine.cache.flush(demote=True)
    assert engine.stats().host_pages > 0
    turn2 = [*prompt, *first.output_ids, 1]
    other = _run(engine, turn2, 3, salt="tenant-b")
    assert (other.num_cached, other.num_cached_host) == (0, 0), "tenant b hit tenant a's pages"
    assert engine.stats().host_loaded_pages == 0
    engine.flush_cache()  # tenant b's own pages out of the way (L1 and L2)
    first = _run(engine, prompt, 3, salt="tenant-a")
    engine.cache.flush(demote=True)
    same = _run(engine, turn2, 3, salt="tenant-a")
    assert same.num_cached_host == same.num_cached == 40, "tenant a missed its own L2 pages"
    assert first.page_hashes[: same.num_cached // 4] == same.page_hashes[: same.num_cached // 4]


def test_l2_off_is_the_l1_cache_exactly() -> None:
    """host_kv_budget_bytes=0: no tier, no demotion, same hits as before."""
    engine = _sim(window=8, l1_chunks=64, l2_chunks=0)
    assert engine.host is None and engine.kv.lower is None and engine.cache.lower is None
    _run(engine, list(range(100, 140)), 3)
    engine.cache.flush(demote=True)
    again = _run(engine, list(range(100, 140)), 3)
    assert again.num_cached == 0 and engine.stats().host_pages == 0


def test_stale_l2_page_is_a_miss() -> None:
    """An entry under the same hash but other tokens (a collision) or another parent is never
    returned: the chain stops there."""
    layout = KVLayout(page_size=PAGE, dtype_bytes=4, full_layer_ids=(0,), swa_layer_ids=(1,),
                      full_head_dims=(1, 1, 1), swa_head_dims=(2, 1, 1), window=4)
    host = HostPagePool(layout, 8 * layout.chunk_bytes, torch.int32)
    tier = HostTier(host, None)
    full = torch.zeros(1, PAGE, 1, 2, dtype=torch.int32)
    host.put(11, None, (1, 2, 3, 4), [(FULL, full)])
    host.put(12, 11, (5, 6, 7, 8), [(FULL, full)])
    assert [e.page_hash for e in tier.lookup([11, 12], 0, list(range(1, 9)), PAGE)] == [11, 12]
    assert tier.lookup([11, 12], 0, [1, 2, 3, 4, 5, 6, 7, 0], PAGE)[-1].page_hash == 11
    assert tier.lookup([11, 12], 0, [0, 2, 3, 4, 5, 6, 7, 8], PAGE) == []
    assert tier.find(12, 99, None) is None, "an entry under another parent matched"
    assert tier.find(12, 11, None) is not None  # no tokens kept: the hash chain decides


def test_host_budget_flag_reaches_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    endpoints = ["--listen", "tcp://127.0.0.1:1", "--events", "tcp://127.0.0.1:2"]
    args = parser.parse_args([*endpoints, "--backend", "sim", "--host-kv-budget-mb", "3"])
    assert engine_argv(args) == ["--host-kv-budget-mb", "3"], engine_argv(args)
    assert engine_config(args, env={}).host_kv_budget_bytes == 3 * 2**20
    default = engine_config(parser.parse_args([*endpoints, "--backend", "sim"]), env={})
    assert default.host_kv_budget_bytes == 0


def test_finished_splits_cached_tokens_by_tier() -> None:
    engine = _sim(window=8, l1_chunks=64, l2_chunks=64)
    prompt = list(range(100, 140))
    first = _run(engine, prompt, 3)
    engine.cache.flush(demote=True)
    seq = _run(engine, [*prompt, *first.output_ids, 1], 3)
    finished = RequestStream(b"c", "req", seq).last_message()
    assert isinstance(finished, Finished)
    assert (finished.cached_tokens, finished.cached_tokens_device,
            finished.cached_tokens_host) == (40, 0, 40), finished
    report = load_report("w", engine.stats())
    assert report.host_pages > 0 and report.host_total_bytes == 64 * engine.layout.chunk_bytes


# -- native: greedy tokens unchanged -----------------------------------------------------------


def _llm(model_dir: Path, *, l1_chunks: int, l2_chunks: int, cache: bool = True,
         layerwise_load: str = "off") -> LLM:
    cfg = ModelConfig.from_dir(model_dir)
    chunk_bytes = KVLayout.from_model(cfg, 4, 4).chunk_bytes
    return LLM(model_dir, dtype="float32", device="cpu", page_size=4,
               kv_budget_bytes=l1_chunks * chunk_bytes,
               host_kv_budget_bytes=l2_chunks * chunk_bytes,
               enable_prefix_cache=cache, max_num_batched_tokens=16,
               checkpoint_interval_tokens=0, layerwise_load=layerwise_load)


@pytest.mark.parametrize("layerwise", ["off", "on"])
def test_greedy_tokens_identical_through_l2(make_checkpoint, layerwise: str) -> None:
    """Sessions whose turns share long prefixes on a tiny L1 (it evicts, and is flushed down to L2
    between rounds) give the same greedy tokens as an engine without any cache, and L2 served
    part of the prompts; with the pages copied before the forward or layer by layer in it."""
    model_dir = make_checkpoint(seed=2, layers="FSSF", sliding_window=8)
    tiered = _llm(model_dir, l1_chunks=40, l2_chunks=400, layerwise_load=layerwise)
    assert tiered.engine.host.defer_loads == (layerwise == "on")
    plain = _llm(model_dir, l1_chunks=400, l2_chunks=0, cache=False)
    rng = random.Random(5)
    base = [rng.randrange(300) for _ in range(24)]
    prompts = {s: [*base, *(rng.randrange(300) for _ in range(6 + s))] for s in range(3)}
    got: list[RequestOutput] = []
    want: list[RequestOutput] = []
    for turn in range(3):
        batch = [prompts[s] for s in range(3)]
        outs = tiered.generate(batch, [_greedy(5 + s) for s in range(3)])
        refs = plain.generate(batch, [_greedy(5 + s) for s in range(3)])
        got += outs
        want += refs
        for s, out in enumerate(outs):
            prompts[s] = [*prompts[s], *out.token_ids, *(rng.randrange(300) for _ in range(3))]
        if turn % 2 == 0:
            tiered.engine.cache.flush(demote=True)  # L1 pressure: everything goes down
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.token_ids == b.token_ids, (
            f"request {i}: tiered {a.token_ids} != uncached {b.token_ids} "
            f"(cached {a.cached_tokens}, from L2 {a.cached_tokens_host})"
        )
    stats = tiered.engine.stats()
    host_hits = [o.cached_tokens_host for o in got]
    assert stats.host_loaded_pages > 0 and sum(host_hits) > 0, f"L2 never used: {stats}"
    assert stats.host_used_bytes <= stats.host_total_bytes
    assert all(o.cached_tokens == 0 for o in want)


@pytest.mark.parametrize("layerwise", ["off", "on"])
def test_loaded_pages_hold_the_demoted_bytes(make_checkpoint, layerwise: str) -> None:
    """A page loaded back from L2 holds exactly the KV it had when it was demoted (copied
    before the forward, or layer by layer in it)."""
    model_dir = make_checkpoint(seed=2, layers="FSSF", sliding_window=8)
    llm = _llm(model_dir, l1_chunks=200, l2_chunks=200, layerwise_load=layerwise)
    engine = llm.engine
    prompt = list(range(10, 50))
    llm.generate([prompt], _greedy(3))
    pool = engine.runner.pool
    before = {n.page_hash: pool.page(FULL, n.full_page).clone() for n in engine.cache.nodes()}
    engine.cache.flush(demote=True)
    [out] = llm.generate([[*prompt, 1, 2]], _greedy(1))
    assert out.cached_tokens_host > 0
    restored = [n for n in engine.cache.nodes() if n.page_hash in before]
    assert restored, "nothing came back"
    for n in restored:
        assert torch.equal(pool.page(FULL, n.full_page), before[n.page_hash]), n


# -- the L1 -> L2 -> L1 path under random use --------------------------------------------------

PAGE = 4


def _sig(page_hash: int, kind: PageKind) -> int:
    return (page_hash ^ (0x5BD1E995 * (int(kind) + 1))) & 0x7FFFFFFF


_tokens = st.lists(st.integers(0, 2), min_size=1, max_size=8).map(
    lambda pages: [t for p in pages for t in [p, 0, 0, 1]] + [7]
)


class TierMachine(RuleBasedStateMachine):
    """The engine's protocol (admit, reserve, commit, release) on a KVManager whose cache demotes
    into a HostTier; every computed page is filled with a signature of its hash and kind."""

    sig = staticmethod(_sig)  # NOTE: a page's fill; a subclass with float pages changes it

    def __init__(self) -> None:
        super().__init__()
        self.kv: KVManager | None = None
        self.running: list[Sequence] = []
        self.truth: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # hash -> parent, tokens
        self.ids = itertools.count()
        self.prompts: list[tuple[list[int], str | None]] = []

    @precondition(lambda self: self.kv is None)
    @rule(window=st.sampled_from([1, 4, 6, 8]), l1=st.integers(4, 16), l2=st.integers(1, 24))
    def setup(self, window: int, l1: int, l2: int) -> None:
        layout = KVLayout(page_size=PAGE, dtype_bytes=4, full_layer_ids=(0,), swa_layer_ids=(1,),
                          full_head_dims=(1, 1, 1), swa_head_dims=(2, 1, 1), window=window)
        self.allocator = PageAllocator(layout, l1 * layout.chunk_bytes)
        self.pool = KVPool(layout, self.allocator.num_chunks, torch.int32)
        self.host = HostPagePool(layout, l2 * layout.chunk_bytes, torch.int32)
        self.host_budget = l2 * layout.chunk_bytes
        tier = HostTier(self.host, self.pool)
        self.events: list[CacheEvent] = []
        self.cache = PrefixCache(self.allocator, on_event=self.events.append, lower=tier)
        self.kv = KVManager(self.allocator, self.cache, lower=tier)

    @precondition(lambda self: self.kv is not None)
    @rule(tokens=_tokens, salt=st.sampled_from([None, "t"]), n=st.integers(1, 40))
    def start(self, tokens: list[int], salt: str | None, n: int) -> None:
        if len(self.running) >= 3:  # as an engine with a request cap: the oldest finishes
            self.kv.release(self.running.pop(0), checkpoint=True)
        seq = Sequence(f"s{next(self.ids)}", tuple(tokens), SamplingParams(max_new_tokens=1),
                       cache_salt=salt)
        self.kv.admit(seq)
        self._assert_path_is_fresh(seq)
        self.running.append(seq)
        self.prompts.append((tokens, salt))
        self._compute(seq, n)

    @precondition(lambda self: self.prompts)
    @rule(data=st.data(), cut=st.integers(0, 8), more=_tokens, n=st.integers(1, 40))
    def start_again(self, data: st.DataObject, cut: int, more: list[int], n: int) -> None:
        """A later turn: an earlier prompt, cut short or extended (hits where it was cached)."""
        tokens, salt = data.draw(st.sampled_from(self.prompts))
        self.start(tokens[: max(1, len(tokens) - cut)] + more, salt, n)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), n=st.integers(1, 20))
    def compute_more(self, data: st.DataObject, n: int) -> None:
        self._compute(data.draw(st.sampled_from(self.running)), n)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), checkpoint=st.booleans())
    def release(self, data: st.DataObject, checkpoint: bool) -> None:
        seq = data.draw(st.sampled_from(self.running))
        self.kv.release(seq, checkpoint=checkpoint)
        self.running.remove(seq)

    @precondition(lambda self: self.kv is not None)
    @rule(num_full=st.integers(0, 8), num_swa=st.integers(0, 8))
    def evict(self, num_full: int, num_swa: int) -> None:
        ok = self.cache.evict(num_full, num_swa)
        assert ok == self.allocator.can_allocate(num_full, num_swa)

    @precondition(lambda self: self.kv is not None)
    @rule()
    def flush_down(self) -> None:
        self.cache.flush(demote=True)

    # ------------------------------------------------------------ invariants

    @invariant()
    def l1_pages_hold_their_own_kv(self) -> None:
        for n in self.cache.nodes() if self.kv else ():
            self._assert_page(self.pool.page(FULL, n.full_page), n.page_hash, FULL, "L1")
            if n.swa_page is not None:
                self._assert_page(self.pool.page(SWA, n.swa_page), n.page_hash, SWA, "L1")
            parent = n.parent.page_hash if n.parent else None
            assert self.truth[n.page_hash] == (parent, n.token_ids), f"stale L1 page {n}"

    @invariant()
    def l2_pages_hold_their_own_kv(self) -> None:
        for e in self.host.entries() if self.kv else ():
            assert self.truth[e.page_hash] == (e.parent_hash, e.token_ids), f"stale L2 {e}"
            for kind in PageKind:
                slot = e.slot(kind)
                if slot is not None:
                    self._assert_page(self.host.page(kind, slot), e.page_hash, kind, "L2")

    @invariant()
    def counts_add_up(self) -> None:
        if self.kv is None:
            return
        nodes = self.cache.nodes()
        used = self.allocator.num_used_pages
        pending_full = sum(len(s.pending_full) for s in self.running)
        pending_swa = sum(len(s.pending_swa) for s in self.running)
        assert used(FULL) == len(nodes) + pending_full
        assert used(SWA) == sum(n.swa_page is not None for n in nodes) + pending_swa
        entries = self.host.entries()
        hused = self.host.allocator.num_used_pages
        assert hused(FULL) == sum(e.full_slot is not None for e in entries)
        assert hused(SWA) == sum(e.swa_slot is not None for e in entries)
        for alloc in (self.allocator, self.host.allocator):
            for kind in PageKind:
                assert alloc.num_free_pages(kind) + alloc.num_used_pages(kind) <= \
                    alloc.num_chunks * alloc.slots_per_chunk(kind)
        slots = [(k, e.slot(k)) for e in entries for k in PageKind if e.slot(k) is not None]
        assert len(set(slots)) == len(slots), "two L2 entries share a host slot"

    @invariant()
    def l2_within_budget(self) -> None:
        if self.kv is not None:
            assert self.host.allocator.used_page_bytes <= self.host.used_bytes <= self.host_budget

    @invariant()
    def running_pages_stay(self) -> None:
        for seq in self.running:
            for i, n in enumerate(seq.path):
                assert n.alive and n.page_hash == seq.page_hashes[i], f"{seq.request_id}: {n}"
            for n in seq.swa_pinned:
                assert n.swa_page is not None, f"{seq.request_id}: pinned SWA freed: {n}"

    # ------------------------------------------------------------ helpers

    def _compute(self, seq: Sequence, n: int) -> None:
        n = min(n, seq.num_tokens - seq.num_computed)
        if n <= 0:
            return
        if not self.kv.can_reserve(seq, n):
            return
        self.kv.reserve(seq, n)
        first = len(seq.path)
        for j, (full, swa) in enumerate(itertools.zip_longest(seq.pending_full, seq.pending_swa)):
            i = first + j
            if i < len(seq.page_hashes):
                h = seq.page_hashes[i]
                self.pool.page(FULL, full).fill_(self.sig(h, FULL))
                self.pool.page(SWA, swa).fill_(self.sig(h, SWA))
                parent = seq.page_hashes[i - 1] if i else None
                self.truth[h] = (parent, seq.prompt_ids[i * PAGE : (i + 1) * PAGE])
        self.kv.commit(seq, n)

    def _assert_path_is_fresh(self, seq: Sequence) -> None:
        assert seq.num_computed == len(seq.path) * PAGE
        for i, n in enumerate(seq.path):
            assert n.page_hash == seq.page_hashes[i], f"page {i}: another chain's page"
            assert n.token_ids == seq.prompt_ids[i * PAGE : (i + 1) * PAGE], f"stale page {i}"
        k = self.cache.window_pages
        for n in seq.path[-k:]:
            assert n.swa_page is not None, f"usable end {len(seq.path)} without its window"

    def _assert_page(self, page: torch.Tensor, page_hash: int, kind: PageKind, tier: str) -> None:
        want = self.sig(page_hash, kind)
        assert bool((page == want).all()), (
            f"{tier} {kind.name} page of {page_hash} holds {page.flatten()[:4].tolist()}, "
            f"want {want}"
        )


TierMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestTierMachine = TierMachine.TestCase
