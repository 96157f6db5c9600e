"""Paged KV gives the same logits as contiguous KV, and running sequences hold O(W) SWA pages.

Every step runs one token stream through ``ContiguousBatch`` (the reference, itself checked against
transformers in test_model_parity.py) and through ``PagedBatch`` over pages handed out in scrambled
order. SWA pages the window has passed are released, poisoned with NaN and reused by other
sequences, so any read of a released page would show in the logits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from engine.kv import (
    ContiguousBatch,
    KVLayout,
    KVPool,
    PageAllocator,
    PagedBatch,
    PageKind,
    SeqPages,
    SequenceKV,
)
from engine.kv.layout import num_pages, swa_first_needed_page
from engine.model_config import ModelConfig
from engine.models.checkpoint import mimo_config
from engine.models.loader import load_model
from engine.models.mimo_v2 import MiMoV2ForCausalLM
from engine.utils import cdiv

FULL, SWA = PageKind.FULL, PageKind.SWA


@dataclass(frozen=True)
class Case:
    name: str
    layers: str
    window: int
    page_size: int
    chunk: int  # prefill tokens per sequence per step
    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    dtype: str = "float32"


CASES = [
    Case("w4-page4", "FSSF", 4, 4, 3, (13, 5, 22), (8, 12, 5)),
    Case("w5-page2", "FSSF", 5, 2, 4, (11, 1, 17, 6), (9, 14, 3, 10)),
    Case("w16-page4-chunk8", "FSSSF", 16, 4, 8, (40, 9, 27), (20, 30, 6)),
    Case("w3-page8", "SFS", 3, 8, 5, (19, 2), (12, 20)),
    Case("full-only", "FF", 4, 4, 3, (10, 3), (6, 9)),
    Case("w4-page4-bf16", "FSSF", 4, 4, 3, (13, 5), (8, 12), dtype="bfloat16"),
]


@dataclass
class _Seq:
    tokens: list[int]
    prompt_len: int
    kv: SequenceKV
    pages: SeqPages
    max_swa_pages: int = 0
    released: list[int] = field(default_factory=list)


@dataclass
class _Paged:
    layout: KVLayout
    alloc: PageAllocator
    pool: KVPool
    rng: random.Random


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@torch.inference_mode()
def test_paged_matches_contiguous_with_released_swa_pages(case: Case, make_checkpoint) -> None:
    model_dir = make_checkpoint(
        seed=len(case.name), dtype=case.dtype, layers=case.layers, sliding_window=case.window
    )
    model = load_model(model_dir, dtype=case.dtype, device="cpu")
    paged = _make_paged(model.config, case)
    seqs = _make_seqs(model.config, case)
    steps = 0
    while active := [s for s in seqs if s.pages.num_cached < len(s.tokens)]:
        for seq in paged.rng.sample(active, len(active)):  # interleave page ids across sequences
            seq.pages.query_len = _query_len(seq, case.chunk)
            _grow_pages(paged, seq.pages)
            _release_swa_pages(paged, seq)
        _assert_same_logits(model, paged, active, f"{case.name} step {steps}")
        for seq in active:
            seq.pages.num_cached += seq.pages.query_len
        steps += 1
    _assert_swa_held_is_bounded(seqs, case)
    _assert_scrambled(seqs)
    for seq in seqs:
        _free_all(paged, seq.pages)
    assert paged.alloc.used_bytes == 0, f"{paged.alloc.used_bytes} bytes left after freeing"


@torch.inference_mode()
def test_2000_token_generation_holds_o_w_swa_pages() -> None:
    """Issue 3: W = 16, page 4; SWA pages stay bounded while full pages grow with the sequence."""
    case = Case("w16-page4-2000", "FSSF", 16, 4, 8, (50,), (2000,))
    cfg = _make_config(case)
    paged = _make_paged(cfg, case, extra_chunks=0)
    (seq,) = _make_seqs(cfg, case)
    bound = cdiv(case.window + case.chunk, case.page_size) + 1
    while seq.pages.num_cached < len(seq.tokens):
        seq.pages.query_len = _query_len(seq, case.chunk)
        _grow_pages(paged, seq.pages)
        _release_swa_pages(paged, seq)
        PagedBatch(paged.pool, paged.layout, [seq.pages])  # asserts no read of a released page
        swa_used = paged.alloc.num_used_pages(SWA)
        assert swa_used <= bound, f"position {seq.pages.num_cached}: {swa_used} SWA pages in use"
        full_held = len(seq.pages.full_pages)
        assert full_held == num_pages(seq.pages.seq_len, case.page_size), f"{full_held} full pages"
        seq.pages.num_cached += seq.pages.query_len
    assert seq.max_swa_pages <= bound, f"held {seq.max_swa_pages} SWA pages, bound {bound}"
    assert len(seq.pages.full_pages) == num_pages(2050, 4) == 513
    _free_all(paged, seq.pages)
    assert paged.alloc.used_bytes == 0 and paged.alloc.num_free_chunks == paged.alloc.num_chunks


@pytest.mark.parametrize(
    ("num_cached", "query_len", "released", "error"),
    [
        (5, 1, [0], "SWA page 0 .* was released but a query at position 5 reads from position 1"),
        (8, 1, [0], None),  # the query at 8 sees [4, 8]: page 0 = [0, 4) is not read
        (8, 1, [0, 1], "SWA page 1"),
        (8, 4, [0, 2], "SWA page 2 .* this step writes it"),
    ],
)
def test_reading_a_released_swa_page_is_an_error(
    num_cached: int, query_len: int, released: list[int], error: str | None
) -> None:
    case = Case("w4-page4", "FSSF", 4, 4, 4, (12,), (0,))
    paged = _make_paged(_make_config(case), case)
    pages = SeqPages([0, 1, 2], [0, 1, 2], num_cached=num_cached, query_len=query_len)
    for i in released:
        pages.swa_pages[i] = None
    if error is None:
        PagedBatch(paged.pool, paged.layout, [pages])
        return
    with pytest.raises(AssertionError, match=error):
        PagedBatch(paged.pool, paged.layout, [pages])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_round_trip_through_shared_chunks(dtype: torch.dtype) -> None:
    """Pages of both kinds, scattered over chunks that change kind, read back what was written."""
    case = Case("w4-page4", "FSSSF", 4, 4, 4, (1,), (0,))
    cfg = _make_config(case)
    paged = _make_paged(cfg, case, dtype=dtype)
    layout, pool = paged.layout, paged.pool
    for kind in PageKind:
        view = pool.view(kind)
        assert view.untyped_storage().data_ptr() == pool.arena.untyped_storage().data_ptr()
    swa = paged.alloc.allocate(SWA, 5)
    paged.alloc.free(SWA, swa[1:4])  # their chunks go back to the shared list
    full = paged.alloc.allocate(FULL, 5)
    reused = {paged.alloc.locate(FULL, p)[0] for p in full} & set(swa[1:4])
    assert reused, f"full pages {full} should reuse the chunks of freed SWA pages {swa[1:4]}"
    for layer_id in range(cfg.num_hidden_layers):
        kind, _ = layout.layer_index(layer_id)
        ids = (full if kind == FULL else [swa[4], swa[0]])[::-1]
        _assert_round_trip(pool, layer_id, ids, seed=layer_id)


# -- builders --------------------------------------------------------------------------------


def _make_config(case: Case) -> ModelConfig:
    return ModelConfig.from_dict(mimo_config(layers=case.layers, sliding_window=case.window))


def _make_paged(
    cfg: ModelConfig, case: Case, extra_chunks: int = 8, dtype: torch.dtype | None = None
) -> _Paged:
    dtype = dtype or getattr(torch, case.dtype)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    layout = KVLayout.from_model(cfg, page_size=case.page_size, dtype_bytes=dtype_bytes)
    lens = [p + o for p, o in zip(case.prompt_lens, case.output_lens)]
    swa_bound = cdiv(case.window + case.chunk, case.page_size) + 1
    num_chunks = sum(num_pages(n, case.page_size) + swa_bound for n in lens) + extra_chunks
    alloc = PageAllocator(layout, budget_bytes=num_chunks * layout.chunk_bytes)
    pool = KVPool(layout, alloc.num_chunks, dtype=dtype, device="cpu")
    return _Paged(layout, alloc, pool, random.Random(case.name))


def _make_seqs(cfg: ModelConfig, case: Case) -> list[_Seq]:
    gen = torch.Generator().manual_seed(len(case.prompt_lens))
    seqs = []
    for prompt_len, output_len in zip(case.prompt_lens, case.output_lens):
        tokens = torch.randint(0, cfg.vocab_size, (prompt_len + output_len,), generator=gen)
        pages = SeqPages(full_pages=[], swa_pages=[], num_cached=0, query_len=0)
        seqs.append(_Seq(tokens.tolist(), prompt_len, SequenceKV(cfg.num_hidden_layers), pages))
    return seqs


def _query_len(seq: _Seq, chunk: int) -> int:
    """Chunked prefill up to the prompt's end, then one token per step."""
    done = seq.pages.num_cached
    return min(chunk, seq.prompt_len - done) if done < seq.prompt_len else 1


# -- page bookkeeping (what the scheduler does) ----------------------------------------------


def _grow_pages(paged: _Paged, pages: SeqPages) -> None:
    need = num_pages(pages.seq_len, paged.layout.page_size)
    pages.full_pages += _take_scrambled(paged, FULL, need - len(pages.full_pages))
    if paged.layout.swa_layer_ids:
        pages.swa_pages += _take_scrambled(paged, SWA, need - len(pages.swa_pages))


def _take_scrambled(paged: _Paged, kind: PageKind, n: int) -> list[int]:
    """``n`` pages, picked at random among a few more than needed (the rest go back)."""
    extra = paged.rng.randint(0, 3)
    counts = (n + extra, 0) if kind == FULL else (0, n + extra)
    assert paged.alloc.can_allocate(*counts), f"test budget too small for {counts}"
    ids = paged.alloc.allocate(kind, n + extra)
    paged.rng.shuffle(ids)
    paged.alloc.free(kind, ids[n:])
    return ids[:n]


def _release_swa_pages(paged: _Paged, seq: _Seq) -> None:
    """Free every SWA page entirely older than seq_len - W - chunk, then poison it."""
    pages, layout = seq.pages, paged.layout
    first = swa_first_needed_page(pages.seq_len, layout.window, pages.query_len, layout.page_size)
    gone = [(i, p) for i, p in enumerate(pages.swa_pages[:first]) if p is not None]
    paged.alloc.free(SWA, [p for _, p in gone])
    for i, page_id in gone:
        pages.swa_pages[i] = None
        seq.released.append(i)
        _poison(paged, page_id)
    held = sum(p is not None for p in pages.swa_pages)
    seq.max_swa_pages = max(seq.max_swa_pages, held)


def _poison(paged: _Paged, page_id: int) -> None:
    size = paged.layout.page_size
    ids, offsets = torch.full((size,), page_id), torch.arange(size)
    for layer_id in paged.layout.swa_layer_ids:
        heads, head_dim, v_head_dim = paged.layout.swa_head_dims
        nan_k = torch.full((size, heads, head_dim), float("nan"), dtype=paged.pool.arena.dtype)
        nan_v = torch.full((size, heads, v_head_dim), float("nan"), dtype=paged.pool.arena.dtype)
        paged.pool.write(layer_id, ids, offsets, nan_k, nan_v)


def _free_all(paged: _Paged, pages: SeqPages) -> None:
    paged.alloc.free(FULL, pages.full_pages)
    paged.alloc.free(SWA, [p for p in pages.swa_pages if p is not None])
    pages.full_pages, pages.swa_pages = [], []


# -- assertions ------------------------------------------------------------------------------


def _assert_same_logits(
    model: MiMoV2ForCausalLM, paged: _Paged, active: list[_Seq], what: str
) -> None:
    ids = torch.tensor([t for s in active for t in s.tokens[s.pages.num_cached : s.pages.seq_len]])
    ref_batch = ContiguousBatch([s.kv for s in active], [s.pages.query_len for s in active])
    batch = PagedBatch(paged.pool, paged.layout, [s.pages for s in active])
    assert torch.equal(batch.positions(), ref_batch.positions()), f"{what}: positions differ"
    assert batch.last_token_rows() == ref_batch.last_token_rows() and batch.num_tokens == len(ids)
    ref = model.compute_logits(model(ids, ref_batch.positions(), ref_batch))
    ref_batch.commit()
    got = model.compute_logits(model(ids, batch.positions(), batch))
    assert torch.isfinite(got).all(), f"{what}: non-finite logits (a poisoned page was read)"
    err = (got - ref).abs().max().item()
    assert err == 0.0, f"{what}: max |paged - contiguous| = {err:.3g} over {len(ids)} rows"


def _assert_swa_held_is_bounded(seqs: list[_Seq], case: Case) -> None:
    if "S" not in case.layers:
        assert all(not s.pages.swa_pages for s in seqs), "a full-only model holds SWA pages"
        return
    bound = cdiv(case.window + case.chunk, case.page_size) + 1
    held = [s.max_swa_pages for s in seqs]
    assert max(held) <= bound, f"max SWA pages held per sequence {held} > {bound}"
    longest = max(seqs, key=lambda s: len(s.tokens))
    assert longest.released, f"{case.name}: no SWA page was ever released (test too short)"


def _assert_scrambled(seqs: list[_Seq]) -> None:
    full = [s.pages.full_pages for s in seqs if len(s.pages.full_pages) > 1]
    gaps = [any(b != a + 1 for a, b in zip(p, p[1:])) for p in full]
    assert any(gaps), f"every sequence got consecutive full pages: {full}"
    spans = sorted((min(p), max(p)) for p in full)
    assert any(a[1] > b[0] for a, b in zip(spans, spans[1:])), f"no interleaving: {spans}"


def _assert_round_trip(pool: KVPool, layer_id: int, page_ids: list[int], seed: int) -> None:
    kind, _ = pool.layout.layer_index(layer_id)
    heads, head_dim, v_head_dim = pool.layout.head_dims(kind)
    n = len(page_ids) * pool.layout.page_size
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, heads, head_dim, generator=gen).to(pool.arena.dtype)
    v = torch.randn(n, heads, v_head_dim, generator=gen).to(pool.arena.dtype)
    ids = torch.tensor(page_ids).repeat_interleave(pool.layout.page_size)
    offsets = torch.arange(n) % pool.layout.page_size
    order = torch.randperm(n, generator=gen)  # one write, tokens in any order
    pool.write(layer_id, ids[order], offsets[order], k[order], v[order])
    got_k, got_v = pool.gather(layer_id, page_ids)
    assert got_k.is_contiguous() and got_v.is_contiguous()
    assert torch.equal(got_k, k) and torch.equal(got_v, v), (
        f"layer {layer_id} ({kind.name}) pages {page_ids}: gather differs from what was written"
    )
