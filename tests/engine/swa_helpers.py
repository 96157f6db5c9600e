"""Shared by the SWA engine tests: a sim-backend workload and its engine, the chunks that a
one-token step holds, and the empty-pool check at the end of a run."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv.layout import KVLayout, PageKind, num_pages
from engine.model_config import ModelConfig
from engine.models.checkpoint import mimo_config
from engine.sim import ZERO_COST
from engine.utils import cdiv

FULL, SWA = PageKind.FULL, PageKind.SWA


@dataclass(frozen=True)
class Req:
    base: int  # which shared prefix
    prefix_len: int
    suffix_len: int
    max_new_tokens: int
    arrival_step: int
    abort_step: int | None
    priority: int


@dataclass(frozen=True)
class Workload:
    layers: str
    window: int
    swa_kv_heads: int  # 1: SWA pages as big as full ones; 2: twice (two full pages a chunk)
    budget_chunks: int
    max_num_batched_tokens: int
    cache: bool
    requests: tuple[Req, ...]


def make_sim(w: Workload) -> Engine:
    model_config = ModelConfig.from_dict(mimo_config(
        layers=w.layers, sliding_window=w.window, swa_num_key_value_heads=w.swa_kv_heads
    ))
    layout = KVLayout.from_model(model_config, 4, 2)
    cfg = EngineConfig(backend="sim", page_size=4,
                       kv_budget_bytes=w.budget_chunks * layout.chunk_bytes,
                       max_num_batched_tokens=w.max_num_batched_tokens,
                       enable_prefix_cache=w.cache, max_running_requests=4)
    return Engine(cfg, model_config=model_config, cost=ZERO_COST)


def step_chunks(engine: Engine, c: int) -> tuple[int, int]:
    """(packed, unpacked) chunks that a one-token step at position c holds."""
    alloc, page = engine.allocator, engine.cfg.page_size
    full = num_pages(c + 1, page)
    swa = full - max(0, c - engine.kv.window) // page if engine.kv.has_swa else 0
    packed = cdiv(full, alloc.slots_per_chunk(FULL))
    packed += cdiv(swa, alloc.slots_per_chunk(SWA)) if swa else 0
    return packed, full + swa


def assert_pool_empty_after_flush(engine: Engine) -> None:
    assert not engine.has_work, f"requests left: {engine.stats()}"
    engine.flush_cache()
    used = engine.allocator.used_bytes
    assert used == 0, f"{used} bytes in use after every request finished and the cache flushed"
    assert engine.cache.num_nodes == 0, f"{engine.cache.num_nodes} nodes left after flush"
