"""Retention of finished requests' end checkpoints (issue 9): ``PrefixCache.retain``, the
``Retentions`` bookkeeping (retained pages, expiries) and ``Engine.retain``."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv.retention import tail_pages
from engine.model_config import ModelConfig
from engine.models.checkpoint import mimo_config
from engine.sampling_params import SamplingParams
from engine.sim import ZERO_COST
from tests.engine.test_prefix_cache import PAGE, _make_cache, _run, _seq


class _Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_retain_protects_then_release_makes_evictable_again() -> None:
    clock = _Clock()
    cache = _make_cache(window=4, num_chunks=64, clock=clock)
    kept = _run(cache, _seq(1, 2))
    end = cache.lookup(kept.hashes[-1])
    assert cache.retain(end, 30.0) and end.retain_until == 30.0
    _run(cache, _seq(2, 2))  # newer, unretained
    while cache._evict_one():
        pass
    assert cache.lookup(kept.hashes[-1]) is end and end.is_ckpt_end, "the retained end stays"
    assert cache.retain(end, 0.0) and end.retain_until == 0.0
    while cache._evict_one():
        pass
    assert not end.alive, "released: evictable like any other checkpoint"
    assert not cache.retain(end, 30.0), "a gone node cannot be retained"


def test_retain_marks_a_demoted_end_again_while_its_window_is_live() -> None:
    cache = _make_cache(window=4, num_chunks=64, clock=_Clock())
    kept = _run(cache, _seq(1, 3))
    end = cache.lookup(kept.hashes[-1])
    cache._drop_checkpoint(end)  # demoted by pressure; its SWA is still there (history)
    assert cache.retain(end, 10.0) and end.is_ckpt_end
    cache._drop_checkpoint(end)
    cache.drop_history()  # now the window is gone too
    assert not cache.retain(end, 10.0) and not end.is_ckpt_end


def test_expiry_counts_only_unused_retentions() -> None:
    clock = _Clock()
    cache = _make_cache(window=4, num_chunks=64, clock=clock)
    unused, used, released = (_run(cache, _seq(i, 2)) for i in (1, 2, 3))
    for req in (unused, used, released):
        assert cache.retain(cache.lookup(req.hashes[-1]), 10.0)
    assert cache.retained_pages() > 0
    assert cache.match(used.hashes, max_tokens=2 * PAGE + 1).usable_tokens == 2 * PAGE
    assert cache.retain(cache.lookup(released.hashes[-1]), 0.0)
    clock.now_s = 10.5
    assert cache.retained_pages() == 0
    assert cache.retains_expired == 1, "only the retention nobody came back to expired"


def test_retained_pages_count_the_window_and_the_tail_only_it_keeps() -> None:
    cache = _make_cache(window=8, num_chunks=64, clock=_Clock())  # k = 2 pages
    base = _run(cache, _seq(1, 3))  # pages 0-2, a checkpoint at its end
    longer = _run(cache, _seq(1, 3)[:-1] + [7] * (2 * PAGE) + [1])  # 5 pages, through base's end
    end = cache.lookup(longer.hashes[-1])
    assert tail_pages(end) == 2, "pages 3-4: page 2 is base's checkpoint end"
    assert cache.retain(end, 10.0)
    assert cache.retained_pages() == 2 + 2  # the k = 2 window SWA pages + 2 full tail pages
    assert cache.retain(cache.lookup(base.hashes[-1]), 10.0)
    # base's end has a child: no tail of its own; its window (pages 1-2) adds 2 SWA pages
    assert cache.retained_pages() == 4 + 2


# ------------------------------------------------------------------ the engine


def _make_engine(clock: _Clock, budget_pages: int = 400) -> Engine:
    model_config = ModelConfig.from_dict(mimo_config(layers="FSSF", sliding_window=8))
    cfg = EngineConfig(backend="sim", page_size=PAGE, max_num_batched_tokens=64,
                       kv_budget_bytes=budget_pages * 4096, checkpoint_interval_tokens=0)
    return Engine(cfg, model_config=model_config, cost=ZERO_COST, clock=clock)


def _finish(engine: Engine, request_id: str, prompt: list[int]) -> None:
    engine.add(engine.make_sequence(request_id, prompt, SamplingParams(max_new_tokens=2)))
    for _ in range(100):
        if not engine.has_work:
            return
        engine.step()
    raise AssertionError(f"{request_id} not done after 100 steps")


def test_engine_retain_knows_finished_requests_and_reports_stats() -> None:
    clock = _Clock()
    engine = _make_engine(clock)
    _finish(engine, "a", list(range(10, 40)))
    assert not engine.retain("never-sent", 30.0)
    assert engine.retain("a", 30.0)
    stats = engine.stats()
    assert stats.retained_pages > 0 and stats.retains_expired == 0, stats
    clock.now_s = 31.0
    stats = engine.stats()
    assert (stats.retained_pages, stats.retains_expired) == (0, 1), stats
    assert engine.retain("a", 0.0), "still cached: a release is accepted"


def test_engine_forgets_the_oldest_finished_requests() -> None:
    engine = _make_engine(_Clock())
    engine.kv.max_finished_ends = 2
    for i in range(3):
        _finish(engine, f"r{i}", [50 + i] * 20)
    assert not engine.retain("r0", 30.0), "beyond the bound: forgotten"
    assert engine.retain("r1", 30.0) and engine.retain("r2", 30.0)


def test_aborted_request_has_no_end_to_retain() -> None:
    engine = _make_engine(_Clock())
    seq = engine.make_sequence("x", list(range(30)), SamplingParams(max_new_tokens=50))
    engine.add(seq)
    engine.step()
    engine.abort("x")
    assert not engine.retain("x", 30.0)
