"""Periodic SWA checkpoints (issue 9): every ``checkpoint_interval_tokens`` along a new prompt,
in one LRU with the resume points (after history SWA), invisible in the tokens (cached and
uncached runs agree)."""

from __future__ import annotations

import random
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv.allocator import PageAllocator
from engine.kv.layout import KVLayout, PageKind
from engine.kv.manager import periodic_checkpoints
from engine.kv.prefix_cache import Node, PrefixCache
from engine.llm import LLM
from engine.model_config import ModelConfig
from engine.models.checkpoint import mimo_config
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.sim import ZERO_COST
from engine.utils import cdiv

PAGE = 4


# ------------------------------------------------------------------ the positions


@pytest.mark.parametrize(
    ("before", "computed", "prompt_len", "interval", "expected"),
    [
        (0, 40, 40, 8, [8, 16, 24, 32, 40]),
        (0, 40, 30, 8, [8, 16, 24]),  # only along the prompt, never the output
        (16, 40, 40, 8, [24, 32, 40]),  # the cached prefix [0, 16) is not re-marked
        (17, 23, 40, 8, []),
        (15, 16, 40, 8, [16]),
        (0, 40, 40, 0, []),  # 0 disables
    ],
)
def test_periodic_positions(
    before: int, computed: int, prompt_len: int, interval: int, expected: list[int]
) -> None:
    assert list(periodic_checkpoints(before, computed, prompt_len, interval)) == expected


@given(
    st.integers(0, 200), st.integers(0, 200), st.integers(1, 200), st.sampled_from([4, 8, 12])
)
def test_steps_mark_each_position_once(a: int, b: int, prompt_len: int, interval: int) -> None:
    """Any split of the prompt into steps marks exactly the multiples of the interval."""
    cut = sorted((a % (prompt_len + 1), b % (prompt_len + 1)))
    bounds = [0, *cut, prompt_len]
    got = [p for lo, hi in zip(bounds, bounds[1:]) for p in
           periodic_checkpoints(lo, hi, prompt_len, interval)]
    assert got == list(range(interval, prompt_len + 1, interval)), (bounds, got)


# ------------------------------------------------------------------ the cache's eviction order


def _make_cache(window: int, num_chunks: int) -> PrefixCache:
    layout = KVLayout(page_size=PAGE, dtype_bytes=1, full_layer_ids=(0,), swa_layer_ids=(1,),
                      full_head_dims=(1, 2, 2), swa_head_dims=(2, 2, 2), window=window)
    cache = PrefixCache(PageAllocator(layout, num_chunks * layout.chunk_bytes))
    cache.events = []  # type: ignore[attr-defined]
    cache.on_event = cache.events.append  # type: ignore[attr-defined]
    return cache


def _chain(cache: PrefixCache, num_pages: int, first_hash: int = 1) -> list[Node]:
    """Insert num_pages pages in a chain, unpinned at the end (as a finished request)."""
    nodes, parent = [], None
    for i in range(num_pages):
        full = cache.allocator.allocate(PageKind.FULL, 1)[0]
        swa = cache.allocator.allocate(PageKind.SWA, 1)[0]
        node = cache.insert(parent, first_hash + i, full, swa)
        nodes.append(node)
        parent = node
    return nodes


def _unpin_all(cache: PrefixCache, nodes: list[Node]) -> None:
    for n in nodes:
        cache.unpin(n, full=True, swa=True)


def test_checkpoints_of_both_kinds_share_one_lru_after_history() -> None:
    """History SWA goes first; then periodic and resume-point checkpoints go least recently used
    first, whatever their kind (a periodic point that was hit outlives an idle resume point)."""
    cache = _make_cache(window=4, num_chunks=64)  # k = 1 page
    nodes = _chain(cache, 8)
    for i in (1, 3, 5):
        assert cache.mark_checkpoint(nodes[i], periodic=True)
    assert cache.mark_checkpoint(nodes[7])  # the prompt end, the most recent mark
    _unpin_all(cache, nodes)
    # NOTE: a running request keeps the chain's full KV (no leaf to delete): only checkpoints go
    cache.pin(nodes[7], full=True, swa=False)
    for _ in range(4):  # history first: pages 0, 2, 4, 6
        assert cache._evict_one()
    assert [n.depth for n in nodes if n.swa_page is not None] == [1, 3, 5, 7]
    assert cache.match([n.page_hash for n in nodes[:4]], max_tokens=4 * PAGE).usable_tokens == 16
    # LRU now: periodic 1, periodic 5, the resume point 7, periodic 3 (just hit)
    dropped = []
    for _ in range(3):
        before = {n.depth for n in nodes if n.is_ckpt_end}
        assert cache._evict_one()  # a demotion ...
        dropped += sorted(before - {n.depth for n in nodes if n.is_ckpt_end})
        assert cache._evict_one()  # ... then its window's SWA goes as history
    assert dropped == [1, 5, 7], f"checkpoints dropped in order {dropped}"
    assert [n.depth for n in nodes if n.swa_page is not None] == [3]
    assert nodes[3].is_ckpt_end and all(n.alive for n in nodes), "full KV stays"
    kinds = [e.kind for e in cache.events]
    assert kinds.count("ckpt_stored") == 4 and kinds.count("ckpt_dropped") == 3


def test_periodic_checkpoints_drop_least_recently_hit_first() -> None:
    cache = _make_cache(window=4, num_chunks=64)
    nodes = _chain(cache, 6)
    for i in (1, 3, 5):
        cache.mark_checkpoint(nodes[i], periodic=True)
    _unpin_all(cache, nodes)
    cache.pin(nodes[5], full=True, swa=False)  # no leaf to delete: only checkpoints go
    cache.drop_history()
    m = cache.match([n.page_hash for n in nodes], max_tokens=2 * PAGE)  # a hit at the first one
    assert m.usable_tokens == 2 * PAGE
    for _ in range(4):  # demote + free, twice
        assert cache._evict_one()
    assert [n.depth for n in nodes if n.swa_page is not None] == [1], "the hit one stays"


def test_resume_point_promotes_a_periodic_checkpoint() -> None:
    cache = _make_cache(window=4, num_chunks=64)
    nodes = _chain(cache, 4)
    assert cache.mark_checkpoint(nodes[3], periodic=True)
    assert cache.mark_checkpoint(nodes[3])  # the prompt ends here too: a resume point now
    _unpin_all(cache, nodes)
    cache.drop_history()
    assert cache._evict_one()  # a leaf or the checkpoint, not by the periodic rule
    assert not nodes[3].is_periodic
    assert [e.kind for e in cache.events].count("ckpt_stored") == 1, "promotion is not an event"


# ------------------------------------------------------------------ the engine


def _make_sim(interval: int, budget_chunks: int, window: int = 8, chunk: int = 16) -> Engine:
    model_config = ModelConfig.from_dict(mimo_config(layers="FSSF", sliding_window=window))
    layout = KVLayout.from_model(model_config, PAGE, 2)
    cfg = EngineConfig(backend="sim", page_size=PAGE, max_num_batched_tokens=chunk,
                       kv_budget_bytes=budget_chunks * layout.chunk_bytes,
                       checkpoint_interval_tokens=interval, max_running_requests=4)
    return Engine(cfg, model_config=model_config, cost=ZERO_COST)


def _run(engine: Engine, seqs: list[Sequence], max_steps: int = 2000) -> None:
    for seq in seqs:
        engine.add(seq)
    for _ in range(max_steps):
        if not engine.has_work:
            return
        engine.step()
    raise AssertionError(f"not done after {max_steps} steps: {engine.stats()}")


def test_a_branch_inside_an_evicted_prompt_hits_the_periodic_checkpoint() -> None:
    """A 64-token prompt with interval 16: after history SWA goes, a request branching at 40
    resumes at 32 (the periodic point before it), not at 0."""
    rng = random.Random(0)
    prompt = [rng.randrange(300) for _ in range(64)]
    branch = prompt[:40] + [rng.randrange(300) for _ in range(8)]
    hits = {}
    for interval in (0, 16):
        engine = _make_sim(interval, budget_chunks=400)
        _run(engine, [engine.make_sequence("a", prompt, SamplingParams(max_new_tokens=1))])
        engine.cache.drop_history()
        seq = engine.make_sequence("b", branch, SamplingParams(max_new_tokens=1))
        _run(engine, [seq])
        hits[interval] = seq.num_cached
    assert hits == {0: 0, 16: 32}, hits


_workloads = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 60), st.integers(1, 20), st.integers(1, 8)),
    min_size=1, max_size=8,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_workloads, st.sampled_from([4, 8, 12]), st.integers(6, 40), st.sampled_from([4, 16]))
def test_random_workloads_keep_o_w_and_free_everything(
    workload: list[tuple[int, int, int, int]], interval: int, budget: int, chunk: int
) -> None:
    """Periodic checkpoints never pin a running request's SWA beyond O(W), never leak, and every
    checkpoint keeps a live window."""
    engine = _make_sim(interval, budget, chunk=chunk)
    bound = cdiv(engine.kv.window + chunk, PAGE) + 1
    seqs = []
    for i, (base, prefix, suffix, new) in enumerate(workload):
        tokens = [random.Random(base).randrange(300) for _ in range(60)][:prefix]
        tokens += [random.Random(1000 + i).randrange(300) for _ in range(suffix)]
        seqs.append(engine.make_sequence(f"r{i}", tokens, SamplingParams(max_new_tokens=new)))
        engine.add(seqs[-1])
    for _ in range(3000):
        if not engine.has_work:
            break
        engine.step()
        for seq in engine.scheduler.running:
            held = engine.kv.num_swa_pages_held(seq)
            assert held <= bound, f"{seq.request_id} holds {held} SWA pages > {bound}"
        for n in engine.cache.nodes():
            if n.is_ckpt_end:
                assert all(a.swa_page is not None for a in n.ancestors(engine.cache.window_pages))
    assert not engine.has_work
    engine.flush_cache()
    assert engine.allocator.used_bytes == 0 and engine.cache.num_nodes == 0


def test_tokens_identical_with_periodic_checkpoints_and_without_cache(make_checkpoint) -> None:
    """Branches that resume at periodic checkpoints after pressure give the tokens of a cache-off
    engine (native backend, greedy)."""
    model_dir = make_checkpoint(layers="FSSF", sliding_window=8)
    kwargs = {"dtype": "float32", "device": "cpu", "page_size": PAGE,
              "max_num_batched_tokens": 16}
    on = LLM(model_dir, enable_prefix_cache=True, checkpoint_interval_tokens=8,
             kv_budget_bytes=400 * _chunk_bytes(model_dir), **kwargs)
    off = LLM(model_dir, enable_prefix_cache=False, kv_budget_bytes=400 * _chunk_bytes(model_dir),
              **kwargs)
    rng = random.Random(5)
    prompt = [rng.randrange(300) for _ in range(48)]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    on.generate([prompt], params)
    prompts = []
    for cut in (13, 21, 35, 47):
        on.engine.cache.drop_history()
        prompts.append(prompt[:cut] + [rng.randrange(300) for _ in range(5)])
        [got] = on.generate([prompts[-1]], params)
        [ref] = off.generate([prompts[-1]], params)
        assert got.token_ids == ref.token_ids, f"branch at {cut}: cache changed the tokens"
        # at least the periodic point before the branch (overlapping windows may reach further)
        assert got.cached_tokens >= cut // 8 * 8, f"branch at {cut}: hit {got.cached_tokens}"


def _chunk_bytes(model_dir: Path) -> int:
    return KVLayout.from_model(ModelConfig.from_dir(model_dir), PAGE, 4).chunk_bytes
