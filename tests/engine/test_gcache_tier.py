"""L3 GCache below L2 (issue 12): write-through at a request's end, write-back of L2 evictions,
prefetch into L2 while a request waits, resume on another engine (greedy tokens identical),
hibernation, tenant isolation, a store outage read as a miss, and KV events with a medium."""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import invariant, precondition, rule

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv.allocator import PageAllocator
from engine.kv.gcache import KIND_NAMES, decode_page, open_store, page_key, page_shape
from engine.kv.gcache.tier import GCacheTier
from engine.kv.host_pool import HostEntry, HostPagePool
from engine.kv.layout import KVLayout, PageKind
from engine.kv.manager import KVManager
from engine.kv.pool import KVPool
from engine.kv.prefix_cache import CacheEvent, PrefixCache
from engine.kv.tier import HostTier
from engine.llm import LLM, RequestOutput
from engine.model_config import ModelConfig
from engine.models.checkpoint import mimo_config
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.sim import ZERO_COST
from tests.engine.test_host_tier import PAGE, TierMachine

FULL, SWA = PageKind.FULL, PageKind.SWA


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def _llm(model_dir: Path, gcache: str | None, *, l1_chunks: int = 200, l2_chunks: int = 200,
         cache: bool = True, **kwargs: object) -> LLM:
    chunk_bytes = KVLayout.from_model(ModelConfig.from_dir(model_dir), 4, 4).chunk_bytes
    return LLM(model_dir, dtype="float32", device="cpu", page_size=4,
               kv_budget_bytes=l1_chunks * chunk_bytes,
               host_kv_budget_bytes=l2_chunks * chunk_bytes, enable_prefix_cache=cache,
               max_num_batched_tokens=16, checkpoint_interval_tokens=0, gcache=gcache,
               gcache_wait_s=5.0, **kwargs)


def _session(rng: random.Random, turns: int) -> list[list[int]]:
    """User messages of one session (the history grows by each reply)."""
    return [[rng.randrange(300) for _ in range(5 + 3 * t)] for t in range(turns)]


def _play(llm: LLM, messages: list[list[int]], history: list[int] | None = None,
          new: int = 4) -> tuple[list[int], list[RequestOutput]]:
    history = list(history or [])
    outs = []
    for msg in messages:
        history += msg
        [out] = llm.generate([history], _greedy(new))
        history += out.token_ids
        outs.append(out)
    return history, outs


@pytest.fixture
def gcache_dir(tmp_path: Path) -> str:
    return f"file:{tmp_path / 'gcache'}"


@pytest.mark.parametrize("layerwise", ["off", "on"])
def test_resume_on_another_engine_is_greedy_identical(make_checkpoint, gcache_dir,
                                                      layerwise: str) -> None:
    """A session's turns on engine A are written through to a shared file GCache; its next turn
    on engine B (a cold L1 and L2) loads the history from L3 (layer by layer in the forward, or
    before it), and every greedy token equals an engine without any cache."""
    model_dir = make_checkpoint(seed=3, layers="FSSF", sliding_window=8)
    a = _llm(model_dir, gcache_dir)
    b = _llm(model_dir, gcache_dir, layerwise_load=layerwise)
    plain = _llm(model_dir, None, cache=False)
    rng = random.Random(11)
    msgs = _session(rng, 3)
    history, outs_a = _play(a, msgs[:2])
    a.engine.storage.flush_writes(10.0)
    assert a.engine.stats().storage_written_pages > 0
    _, [out_b] = _play(b, msgs[2:], history)
    _, ref = _play(plain, msgs)
    assert [o.token_ids for o in [*outs_a, out_b]] == [o.token_ids for o in ref]
    assert out_b.cached_tokens_storage > 0, out_b
    assert out_b.cached_tokens >= out_b.cached_tokens_storage
    # the whole history but the window's tail of the last reply (not at a page end) came back
    assert out_b.cached_tokens >= len(history) - 2 * 4 - 8, (out_b.cached_tokens, len(history))
    st = b.engine.stats()
    assert st.storage_fetched_pages > 0 and st.storage_hit_tokens == out_b.cached_tokens_storage
    for llm in (a, b, plain):
        llm.close()


def test_l3_pages_hold_the_bytes_written(make_checkpoint, gcache_dir) -> None:
    """Every full page B loads from L3 holds exactly the KV A computed for it."""
    model_dir = make_checkpoint(seed=3, layers="FSSF", sliding_window=8)
    a, b = _llm(model_dir, gcache_dir), _llm(model_dir, gcache_dir)
    prompt = list(range(20, 61))
    a.generate([prompt], _greedy(3))
    a.engine.storage.flush_writes(10.0)
    pool_a = a.engine.runner.pool
    want = {n.page_hash: pool_a.page(FULL, n.full_page).clone() for n in a.engine.cache.nodes()}
    [out] = b.generate([[*prompt, 1, 2, 3]], _greedy(1))
    assert out.cached_tokens_storage > 0
    got = [n for n in b.engine.cache.nodes() if n.page_hash in want]
    assert len(got) >= out.cached_tokens_storage // 4
    pool_b = b.engine.runner.pool
    for n in got:
        assert pool_b.page(FULL, n.full_page).equal(want[n.page_hash]), n
    a.close()
    b.close()


def test_tenant_b_never_loads_tenant_a_pages(make_checkpoint, gcache_dir) -> None:
    """The same tokens under another cache_salt hash to other keys: no L3 hit across tenants."""
    model_dir = make_checkpoint(seed=3, layers="FSSF", sliding_window=8)
    a, b = _llm(model_dir, gcache_dir), _llm(model_dir, gcache_dir)
    prompt = list(range(30, 70))
    [turn1] = a.generate([prompt], _greedy(2))  # the reply is the same for every salt (greedy)
    prompt = [*prompt, *turn1.token_ids, 1, 2, 3]  # the next turn, which a hit would serve
    for llm, salt in ((a, "tenant-a"), (b, "tenant-b"), (b, "tenant-a")):
        seq = llm.engine.make_sequence(f"t-{salt}-{id(llm)}", prompt[:-3] if llm is a else prompt,
                                       _greedy(2), cache_salt=salt)
        llm.engine.add(seq, bounded=False)
        while llm.engine.has_work:
            llm.engine.step()
            time.sleep(0.001)
        llm.engine.storage.flush_writes(10.0)
        if llm is a:
            assert seq.num_cached == 0
        elif salt == "tenant-b":
            assert seq.num_cached_storage == 0, "tenant B loaded tenant A's pages"
        else:
            assert seq.num_cached_storage > 0, "the owner's own pages should come back"
    a.close()
    b.close()


# -- the sim engine: bookkeeping, outages, hibernation, events -------------------------------


def _sim(gcache: str | None, *, l1_chunks: int = 64, l2_chunks: int = 64,
         events: list[CacheEvent] | None = None, **kwargs: object) -> Engine:
    model_config = ModelConfig.from_dict(mimo_config(layers="FSSF", sliding_window=8))
    layout = KVLayout.from_model(model_config, 4, 2)
    cfg = EngineConfig(backend="sim", page_size=4, kv_budget_bytes=l1_chunks * layout.chunk_bytes,
                       host_kv_budget_bytes=l2_chunks * layout.chunk_bytes,
                       max_num_batched_tokens=16, checkpoint_interval_tokens=0, gcache=gcache,
                       gcache_wait_s=5.0, **kwargs)
    return Engine(cfg, model_config=model_config, cost=ZERO_COST,
                  on_cache_event=None if events is None else events.append)


_n = iter(range(10**9))


def _run(engine: Engine, prompt: list[int], new: int = 2, salt: str | None = None) -> Sequence:
    seq = engine.make_sequence(f"s{next(_n)}", prompt, SamplingParams(max_new_tokens=new),
                               cache_salt=salt)
    engine.add(seq)
    deadline = time.monotonic() + 30
    while engine.has_work and time.monotonic() < deadline:
        if engine.only_fetching:
            time.sleep(0.001)
        engine.step()
        engine.tick()
    assert seq.is_finished, "the request never finished"
    return seq


def test_sim_resume_from_l3_and_events(gcache_dir) -> None:
    """The sim backend stores header-only values: the same path, no bytes. A prompt another
    engine finished comes back from L3; the pages are announced with medium GCACHE (written)
    and CPU (landed in L2)."""
    ev_a: list[CacheEvent] = []
    ev_b: list[CacheEvent] = []
    a, b = _sim(gcache_dir, events=ev_a), _sim(gcache_dir, events=ev_b)
    prompt = list(range(1, 42))
    first = _run(a, prompt)
    a.storage.flush_writes(10.0)
    a.tick()
    stored = {e.page_hash for e in ev_a if e.medium == "GCACHE" and e.kind == "stored"}
    assert set(first.page_hashes[:10]) <= stored, "write-through missed pages of the path"
    seq = _run(b, [*prompt, *first.output_ids, 5, 6, 7])
    assert seq.num_cached_storage >= 40, seq.num_cached_storage
    landed = {e.page_hash for e in ev_b if e.medium == "CPU" and e.kind == "stored"}
    assert landed and landed <= stored, "L2 landings must be the pages A wrote"
    a.close()
    b.close()


def test_store_outage_is_a_miss_not_a_failure(tmp_path: Path) -> None:
    """A Redis URL where nothing listens: every request still runs (cold), writes fail and are
    counted, nothing raises."""
    engine = _sim("redis://127.0.0.1:1/0?timeout_s=0.05")
    seq = _run(engine, list(range(1, 30)))
    again = _run(engine, list(range(100, 140)))
    assert seq.finish_reason == again.finish_reason == "length"
    engine.storage.flush_writes(10.0)
    st = engine.stats()
    assert st.storage_write_failed_pages > 0 and st.storage_written_pages == 0, st
    assert st.storage_errors > 0
    engine.close()


def test_l2_evictions_are_written_back(gcache_dir) -> None:
    """A tiny L2 under many sessions evicts; what it evicts reaches L3 (write-back) even when the
    request's own write-through has not written it (write-through is off here: a retained
    session's pages are written by eviction alone)."""
    engine = _sim(gcache_dir, l1_chunks=16, l2_chunks=4)
    store = engine.storage
    written: list[int] = []
    orig = store.write_path
    store.write_path = lambda path, k: written.append(len(path)) or True  # type: ignore[method-assign]
    for s in range(12):
        _run(engine, [300 + s, *(t % 300 for t in range(s * 23, s * 23 + 40))])
    store.write_path = orig  # type: ignore[method-assign]
    store.flush_writes(10.0)
    assert written, "write-through was never asked"
    st = engine.stats()
    assert st.host_evicted_pages > 0, st
    assert st.storage_written_pages > 0, f"L2 evictions were not written back: {st}"
    engine.close()


def test_hibernation_drops_and_resumes(gcache_dir) -> None:
    """An idle session is written out and dropped from L1 and L2; its next turn on the same
    engine loads it back from L3."""
    clock = [0.0]
    model_config = ModelConfig.from_dict(mimo_config(layers="FSSF", sliding_window=8))
    layout = KVLayout.from_model(model_config, 4, 2)
    cfg = EngineConfig(backend="sim", page_size=4, kv_budget_bytes=64 * layout.chunk_bytes,
                       host_kv_budget_bytes=64 * layout.chunk_bytes, max_num_batched_tokens=16,
                       checkpoint_interval_tokens=0, gcache=gcache_dir, gcache_wait_s=5.0,
                       hibernate_after_s=60.0)
    engine = Engine(cfg, model_config=model_config, cost=ZERO_COST, clock=lambda: clock[0])
    prompt = list(range(1, 42))
    first = _run(engine, prompt)
    before = engine.cache.num_nodes
    assert before >= 10
    clock[0] = 30.0
    engine.tick()
    assert engine.cache.num_nodes == before, "hibernated before the idle time"
    clock[0] = 61.0
    for _ in range(100):  # NOTE: the first tick may find writes unconfirmed
        engine.storage.flush_writes(10.0)
        engine._next_hibernate = 0.0
        engine.tick()
        if engine.stats().hibernated_sessions:
            break
    assert engine.stats().hibernated_sessions == 1
    assert engine.cache.num_nodes == 0 and len(engine.host.host) == 0
    seq = _run(engine, [*prompt, *first.output_ids, 9, 9])
    assert seq.num_cached_storage >= 40, seq.num_cached_storage
    engine.close()


def test_hibernation_keeps_a_retained_session(gcache_dir) -> None:
    clock = [0.0]
    model_config = ModelConfig.from_dict(mimo_config(layers="FSSF", sliding_window=8))
    layout = KVLayout.from_model(model_config, 4, 2)
    cfg = EngineConfig(backend="sim", page_size=4, kv_budget_bytes=64 * layout.chunk_bytes,
                       host_kv_budget_bytes=64 * layout.chunk_bytes, max_num_batched_tokens=16,
                       checkpoint_interval_tokens=0, gcache=gcache_dir, hibernate_after_s=10.0)
    engine = Engine(cfg, model_config=model_config, cost=ZERO_COST, clock=lambda: clock[0])
    seq = _run(engine, list(range(1, 42)))
    assert engine.retain(seq.request_id, 100.0)
    clock[0] = 50.0
    engine.storage.flush_writes(10.0)
    for _ in range(3):
        engine._next_hibernate = 0.0
        engine.tick()
    assert engine.stats().hibernated_sessions == 0 and engine.cache.num_nodes > 0
    engine.close()


def test_hibernate_needs_gcache() -> None:
    with pytest.raises(ValueError, match="needs gcache"):
        EngineConfig(backend="sim", hibernate_after_s=5.0)


def test_fingerprint_separates_checkpoints(make_checkpoint, tmp_path: Path) -> None:
    """Two random checkpoints of one architecture never read each other's pages."""
    one = make_checkpoint(seed=3, layers="FSSF", sliding_window=8)
    two = make_checkpoint(seed=4, layers="FSSF", sliding_window=8)
    spec = f"file:{tmp_path / 'g'}"
    a, b = _llm(one, spec), _llm(two, spec)
    assert a.engine.storage.fingerprint != b.engine.storage.fingerprint
    prompt = list(range(5, 45))
    a.generate([prompt], _greedy(2))
    a.engine.storage.flush_writes(10.0)
    [out] = b.generate([[*prompt, 1]], _greedy(1))
    assert out.cached_tokens_storage == 0
    store = open_store(spec)
    store.close()
    a.close()
    b.close()


# -- L1 -> L2 -> L3 -> L1 under random use (hypothesis) ----------------------------------------





def _sig24(page_hash: int, kind: PageKind) -> float:
    """A page's signature, exact in float32 (the L3 format stores float pages)."""
    return float((page_hash ^ (0x5BD1E995 * (int(kind) + 1))) & 0xFFFFFF)


class GCacheMachine(TierMachine):
    """``TierMachine`` with an L3 file store below L2: requests prefetch from it before
    admission, finished ones write through, L2 evictions write back, sessions hibernate. No
    page is lost (every page L2 evicted is in L3 once the writes drain) and none is stale (every
    page, in every tier, holds its own KV)."""

    sig = staticmethod(_sig24)  # NOTE: float pages (the L3 format stores float pages)

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="gcache-sm-")
        self.evicted: set[tuple[int, PageKind]] = set()
        self.clock = 0.0

    reached = {"l3_hit_tokens": 0, "hibernated": 0, "written": 0}  # over all examples

    def teardown(self) -> None:
        if self.kv is not None:
            self.storage.close()
            st_ = self.storage.stats
            for key, value in (("l3_hit_tokens", st_.hit_tokens), ("hibernated", st_.hibernated),
                               ("written", st_.written_pages)):
                GCacheMachine.reached[key] += value
        shutil.rmtree(self.dir, ignore_errors=True)

    @precondition(lambda self: self.kv is None)
    @rule(window=st.sampled_from([1, 4, 8]), l1=st.integers(4, 16), l2=st.integers(1, 12))
    def setup(self, window: int, l1: int, l2: int) -> None:
        layout = KVLayout(page_size=PAGE, dtype_bytes=4, full_layer_ids=(0,), swa_layer_ids=(1,),
                          full_head_dims=(1, 1, 1), swa_head_dims=(2, 1, 1), window=window)
        self.allocator = PageAllocator(layout, l1 * layout.chunk_bytes)
        self.pool = KVPool(layout, self.allocator.num_chunks, torch.float32)
        self.host = HostPagePool(layout, l2 * layout.chunk_bytes, torch.float32)
        self.host_budget = l2 * layout.chunk_bytes
        tier = HostTier(self.host, self.pool)
        self.events: list[CacheEvent] = []
        self.cache = PrefixCache(self.allocator, on_event=self.events.append, lower=tier,
                                 clock=lambda: self.clock)
        self.storage = GCacheTier(open_store(f"file:{self.dir}"), "sm", tier, layout, self.pool,
                                  max_queue=10**6, swa_scan_pages=8)
        write_back = self.host.on_evict

        def record(entry: HostEntry) -> None:
            self.evicted.update((entry.page_hash, k) for k in PageKind if entry.slot(k) is not None)
            write_back(entry)

        self.host.on_evict = record
        self.kv = KVManager(self.allocator, self.cache, lower=tier, storage=self.storage)

    @precondition(lambda self: self.kv is not None)
    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=8).map(
        lambda pages: [t for p in pages for t in [p, 0, 0, 1]] + [7]),
        salt=st.sampled_from([None, "t"]), n=st.integers(1, 40))
    def start(self, tokens: list[int], salt: str | None, n: int) -> None:
        if len(self.running) >= 3:
            self.kv.release(self.running.pop(0), checkpoint=True)
        seq = Sequence(f"s{next(self.ids)}", tuple(tokens), SamplingParams(max_new_tokens=1),
                       cache_salt=salt)
        from engine.hashing import page_hashes

        seq.page_hashes = page_hashes(seq.token_ids, PAGE, salt)
        job = self.storage.start_fetch(
            self.storage.missing(seq.page_hashes, seq.token_ids, seq.num_tokens, self.cache))
        for _ in range(10**4):
            if job is None or job.done:
                break
            time.sleep(0.0005)
        if job is not None:
            assert self.storage.ready(job)
        self.kv.admit(seq)
        self._assert_path_is_fresh(seq)
        self.running.append(seq)
        self.prompts.append((tokens, salt))
        self._compute(seq, n)

    @precondition(lambda self: self.kv is not None)
    @rule()
    def drain_writes(self) -> None:
        assert self.storage.flush_writes(30.0)
        for page_hash, kind in self.evicted:
            value = self.storage.store.get_many([page_key("sm", KIND_NAMES[kind], page_hash)])[0]
            assert value is not None, f"L2 evicted {kind.name} page {page_hash}: not in L3"
        self.evicted.clear()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish_and_hibernate(self, data: st.DataObject) -> None:
        """A turn ends and its session goes idle at once: written out, then dropped."""
        seq = data.draw(st.sampled_from(self.running))
        self.kv.release(seq, checkpoint=True)
        self.running.remove(seq)
        self.hibernate(0.0)
        self.hibernate(0.0)  # NOTE: the first call may find the writes unconfirmed

    @precondition(lambda self: self.kv is not None)
    @rule()
    def forget_local(self) -> None:
        """As if the next requests came to another worker: L1 and L2 forget (no demotion)."""
        self.cache.flush()
        self.host.clear()

    @precondition(lambda self: self.kv is not None)
    @rule(idle=st.sampled_from([0.0, 5.0]))
    def hibernate(self, idle: float) -> None:
        self.clock += 1.0
        self.storage.flush_writes(30.0)
        self.kv.hibernate(idle, self.clock)

    @invariant()
    def l3_pages_hold_their_own_kv(self) -> None:
        if self.kv is None:
            return
        self.storage.poll()
        known = list(self.storage._known)
        keys = [page_key("sm", KIND_NAMES[k], h) for h, k in known]
        for (h, kind), value in zip(known, self.storage.store.get_many(keys)):
            assert value is not None, f"{kind.name} page {h} confirmed but not in the store"
            page = decode_page(value, page_shape(self.pool.layout, kind), torch.float32)
            assert page is not None and bool((page == _sig24(h, kind)).all()), (
                f"L3 {kind.name} page of {h} is stale")


GCacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                           deadline=None)
TestGCacheMachine = GCacheMachine.TestCase


def test_the_machine_reached_every_tier() -> None:
    """The state machine above (run first, in file order) did load from L3 and hibernate."""
    if not any(GCacheMachine.reached.values()):
        pytest.skip("the state machine did not run in this session (-k)")
    assert all(GCacheMachine.reached.values()), GCacheMachine.reached


def test_gcache_flags_reach_the_engine_config_and_serve_forwards_them() -> None:
    import argparse

    from engine.worker.cli import add_arguments, engine_argv, engine_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    endpoints = ["--listen", "tcp://127.0.0.1:1", "--events", "tcp://127.0.0.1:2"]
    flags = ["--gcache", "redis://:pw@127.0.0.1:6379/0", "--gcache-wait-s", "0.2",
             "--hibernate-after-s", "30.0", "--layerwise-load", "on"]
    args = parser.parse_args([*endpoints, "--backend", "sim", *flags])
    assert engine_argv(args) == flags, engine_argv(args)  # what serve passes to its workers
    cfg = engine_config(args, env={})
    assert (cfg.gcache, cfg.gcache_wait_s, cfg.hibernate_after_s, cfg.layerwise_load) == (
        "redis://:pw@127.0.0.1:6379/0", 0.2, 30.0, "on")
    assert "pw" not in repr(cfg), "the store's password would reach a log"
    env = engine_config(parser.parse_args([*endpoints, "--backend", "sim"]),
                        env={"AGENTGATE_GCACHE": "file:/tmp/x", "AGENTGATE_GCACHE_WAIT_S": "1.5"})
    assert (env.gcache, env.gcache_wait_s) == ("file:/tmp/x", 1.5)
    # NOTE: --gcache alone is the embedded default, a file store in the user's cache directory
    bare = parser.parse_args([*endpoints, "--backend", "sim", "--gcache", "--gcache-wait-s", "1"])
    assert bare.gcache == f"file:{Path.home() / '.cache' / 'agentgate' / 'gcache'}", bare.gcache
    assert engine_argv(bare)[:2] == ["--gcache", bare.gcache]
