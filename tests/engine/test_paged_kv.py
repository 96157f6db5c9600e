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
from engine.layers.attention import AttentionSpec, attention_with_sinks, visible_mask
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


def test_pool_round_trip_through_overlapping_slot_rows() -> None:
    """Head dims whose token size does not divide the chunk: reads index overlapping rows."""
    layout = KVLayout(
        page_size=4,
        dtype_bytes=4,
        full_layer_ids=(0, 2),
        swa_layer_ids=(1,),
        full_head_dims=(1, 24, 8),  # 32 elements a token: slot rows step by gcd(624, 32) = 16
        swa_head_dims=(3, 32, 20),  # 156 a token, 624 a page (the chunk): 2 full pages + slack
        window=4,
    )
    pool = KVPool(layout, num_chunks=5, dtype=torch.float32)
    assert layout.slots_per_chunk(FULL) == 2 and layout.chunk_bytes // 4 == 624
    for layer_id, page_ids in ((0, [9, 0, 4]), (2, [4, 9, 1]), (1, [3, 0])):
        _assert_round_trip(pool, layer_id, page_ids, seed=layer_id)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_decode_batch_matches_each_sequence_alone(dtype: torch.dtype) -> None:
    """Decodes attend in one padded call per layer: a row with the most keys gives the sequence's
    own result bit for bit, a padded row agrees to float rounding, and no row reads a slot
    outside its keys (everything else in the arena is NaN)."""
    case = Case("w4-page4", "FSSF", 4, 4, 4, (1,), (0,))
    cfg = _make_config(case)
    paged = _make_paged(cfg, case, extra_chunks=64, dtype=dtype)
    paged.pool.arena.fill_(float("nan"))
    seq_lens = [9, 23, 2, 23, 6]
    pages = [_make_decode_pages(paged, n) for n in seq_lens]
    gen = torch.Generator().manual_seed(0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for layer_id in range(cfg.num_hidden_layers):
        spec, (q, k, v) = _make_spec(cfg, layer_id, dtype), _make_qkv(cfg, layer_id, 5, gen, dtype)
        got = PagedBatch(paged.pool, paged.layout, pages).attend(q, k, v, spec)
        assert torch.isfinite(got).all(), f"layer {layer_id}: a slot outside the keys was read"
        for i, seq in enumerate(pages):
            one = (q[i : i + 1], k[i : i + 1], v[i : i + 1])
            alone = PagedBatch(paged.pool, paged.layout, [seq]).attend(*one, spec)[0]
            err = (got[i] - alone).abs().max().item()
            exact = seq_lens[i] == max(seq_lens)  # no padding in its row
            assert err <= (0.0 if exact else tol), f"layer {layer_id} row {i}: {err:.3g}"
            ref = _reference_attention(paged, seq, *one, spec)
            err = (alone - ref).abs().max().item()
            assert err <= tol, f"layer {layer_id} row {i}: |alone - reference| = {err:.3g}"


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


def _make_decode_pages(paged: _Paged, seq_len: int) -> SeqPages:
    """A sequence about to decode position seq_len - 1: random K/V at [0, seq_len - 1) in every
    layer, SWA pages the window has passed released (still NaN in the arena)."""
    pages = SeqPages(full_pages=[], swa_pages=[], num_cached=seq_len - 1, query_len=1)
    _grow_pages(paged, pages)
    layout, size = paged.layout, paged.layout.page_size
    gen = torch.Generator().manual_seed(seq_len)
    for layer_id in layout.full_layer_ids + layout.swa_layer_ids:
        kind, _ = layout.layer_index(layer_id)
        heads, head_dim, v_head_dim = layout.head_dims(kind)
        pos = torch.arange(seq_len - 1)
        ids = pages.full_pages if kind == FULL else pages.swa_pages
        k = torch.randn(len(pos), heads, head_dim, generator=gen).to(paged.pool.arena.dtype)
        v = torch.randn(len(pos), heads, v_head_dim, generator=gen).to(paged.pool.arena.dtype)
        paged.pool.write(layer_id, torch.tensor(ids)[pos // size], pos % size, k, v)
    first = swa_first_needed_page(seq_len, layout.window, 1, size)
    paged.alloc.free(SWA, [p for p in pages.swa_pages[:first] if p is not None])
    pages.swa_pages[:first] = [None] * first
    return pages


def _make_spec(cfg: ModelConfig, layer_id: int, dtype: torch.dtype) -> AttentionSpec:
    window = cfg.sliding_window if layer_id in cfg.swa_layer_ids else None
    geo = cfg.geometry(layer_id)
    sinks = torch.randn(geo.num_heads, generator=torch.Generator().manual_seed(layer_id))
    return AttentionSpec(layer_id, geo.head_dim**-0.5, window, sinks.to(dtype))


def _make_qkv(
    cfg: ModelConfig, layer_id: int, n: int, gen: torch.Generator, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    geo = cfg.geometry(layer_id)
    q = torch.randn(n, geo.num_heads, geo.head_dim, generator=gen)
    k = torch.randn(n, geo.num_kv_heads, geo.head_dim, generator=gen)
    v = torch.randn(n, geo.num_kv_heads, geo.v_head_dim, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _reference_attention(
    paged: _Paged,
    seq: SeqPages,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
) -> torch.Tensor:
    """The visible keys read back page by page, then ``attention_with_sinks``."""
    layout = paged.layout
    kind, _ = layout.layer_index(spec.layer_id)
    pages = seq.full_pages if kind == FULL else seq.swa_pages
    first = 0 if spec.window is None else max(0, seq.num_cached - spec.window)
    read = pages[first // layout.page_size : num_pages(seq.seq_len, layout.page_size)]
    keys, values = paged.pool.gather(spec.layer_id, [p for p in read if p is not None])
    lo = first % layout.page_size
    keys, values = keys[lo : lo + seq.seq_len - first], values[lo : lo + seq.seq_len - first]
    assert torch.equal(keys[-1], k[0]) and torch.equal(values[-1], v[0]), "new K/V not written"
    visible = visible_mask(
        torch.tensor([seq.num_cached]), torch.arange(first, seq.seq_len), spec.window
    )
    return attention_with_sinks(q, keys, values, visible, spec.scale, spec.sinks)[0]


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
    # NOTE: decode sequences (query_len 1) attend in one padded batched call, whose matmuls and
    # softmax sum over a different number of columns than the per-sequence reference, so float
    # summation order differs there; prefill-only steps take the same path and stay exact.
    decodes = any(s.pages.query_len == 1 for s in active)
    tol = 1e-5 if decodes else 0.0
    assert err <= tol, f"{what}: max |paged - contiguous| = {err:.3g} over {len(ids)} rows"


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
