"""Paged ``KVContext``: the twin of ``ContiguousBatch`` over a shared ``KVPool``.

The scheduler owns each sequence's pages (``SeqPages``); a ``PagedBatch`` only reads them. Page i
of a sequence covers positions [i * page_size, (i + 1) * page_size). For a step whose queries sit
at [num_cached, seq_len):

    positions      0 ......... lo-1 | lo = max(0, num_cached - W) .. num_cached-1 | .. seq_len-1
    full layers    read             | read                                        | written, read
    SWA layers     may be released  | read (the first query sees W keys back)      | written, read

so an SWA page whose positions all lie below ``lo`` may be None (released, see
``layout.swa_first_needed_page``); reading one is a bug and trips an assertion.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv.layout import KVLayout, PageKind, num_pages
from engine.kv.pool import KVPool
from engine.layers.attention import AttentionSpec, attention_with_sinks, visible_mask


@dataclass(slots=True)
class SeqPages:
    """One sequence's pages for one step.

    ``full_pages`` and ``swa_pages`` are indexed by page number and cover [0, seq_len); an SWA
    entry is None once released (outside the window). A model without SWA layers leaves
    ``swa_pages`` empty.
    """

    full_pages: list[int]
    swa_pages: list[int | None]
    num_cached: int  # tokens before this step whose KV is already in the pages
    query_len: int  # tokens this step computes

    @property
    def seq_len(self) -> int:
        return self.num_cached + self.query_len


@dataclass(frozen=True, slots=True)
class _SeqReads:
    """Where one sequence's keys come from in one step, per page kind."""

    page_ids: torch.Tensor  # [num_read_pages] int64, on the pool's device
    first_pos: int  # position of the first key the step needs
    page_start: int  # position of the first key of the first read page


class PagedBatch:
    """``KVContext`` for one forward over several sequences laid out back to back.

    Sequence i contributes ``seqs[i].query_len`` tokens at positions
    ``num_cached .. seq_len - 1``; their K/V go to those positions' pages as each layer runs.
    """

    def __init__(self, pool: KVPool, layout: KVLayout, seqs: Sequence[SeqPages]) -> None:
        assert seqs and all(s.query_len > 0 for s in seqs), "every sequence needs >= 1 query"
        self.pool, self.layout, self.seqs = pool, layout, list(seqs)
        self._offsets = [0]
        for s in self.seqs:
            self._offsets.append(self._offsets[-1] + s.query_len)
        kinds = [k for k in PageKind if layout.num_layers(k) > 0]
        self._slots = {k: self._init_slot_mapping(k) for k in kinds}
        self._reads = {k: [self._init_reads(s, k) for s in self.seqs] for k in kinds}

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        parts = [torch.arange(s.num_cached, s.seq_len) for s in self.seqs]
        return torch.cat(parts).to(device)

    def last_token_rows(self) -> list[int]:
        return [end - 1 for end in self._offsets[1:]]

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
    ) -> torch.Tensor:
        kind, _ = self.layout.layer_index(spec.layer_id)
        page_ids, offsets = self._slots[kind]
        self.pool.write(spec.layer_id, page_ids, offsets, k, v)
        outs = []
        for seq, reads, lo, hi in zip(
            self.seqs, self._reads[kind], self._offsets[:-1], self._offsets[1:]
        ):
            outs.append(self._attend_one(seq, reads, q[lo:hi], spec))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _attend_one(
        self, seq: SeqPages, reads: _SeqReads, q: torch.Tensor, spec: AttentionSpec
    ) -> torch.Tensor:
        keys, values = self.pool.gather(spec.layer_id, reads.page_ids)
        # NOTE: keys before first_pos or past seq_len in the read pages are dropped, not masked:
        # the tail of the last page is unwritten, and the same key set keeps results identical
        # to ContiguousBatch.
        lo, hi = reads.first_pos - reads.page_start, seq.seq_len - reads.page_start
        keys, values = keys[lo:hi], values[lo:hi]
        k_pos = torch.arange(reads.first_pos, seq.seq_len, device=q.device)
        q_pos = torch.arange(seq.num_cached, seq.seq_len, device=q.device)
        visible = visible_mask(q_pos, k_pos, spec.window)
        return attention_with_sinks(q, keys, values, visible, spec.scale, spec.sinks)

    def _init_slot_mapping(self, kind: PageKind) -> tuple[torch.Tensor, torch.Tensor]:
        """Page id and in-page offset of every new token, for one vectorized write per layer."""
        size = self.layout.page_size
        page_ids, offsets = [], []
        for i, seq in enumerate(self.seqs):
            first_page = seq.num_cached // size
            written = self._pages(seq, kind)[first_page : num_pages(seq.seq_len, size)]
            for j, page in enumerate(written, start=first_page):
                assert page is not None, (
                    f"sequence {i}: {kind.name} page {j} was released but this step writes it"
                )
            pos = torch.arange(seq.num_cached, seq.seq_len)
            page_ids.append(torch.tensor(written, dtype=torch.int64)[pos // size - first_page])
            offsets.append(pos % size)
        device = self.pool.device
        return torch.cat(page_ids).to(device), torch.cat(offsets).to(device)

    def _init_reads(self, seq: SeqPages, kind: PageKind) -> _SeqReads:
        size, window = self.layout.page_size, self.layout.window
        first_pos = 0 if kind == PageKind.FULL else max(0, seq.num_cached - window)
        first_page, end_page = first_pos // size, num_pages(seq.seq_len, size)
        pages = self._pages(seq, kind)
        read = pages[first_page:end_page]
        for i, page in enumerate(read, start=first_page):
            assert page is not None, (
                f"{kind.name} page {i} (positions [{i * size}, {(i + 1) * size})) was released "
                f"but a query at position {seq.num_cached} reads from position {first_pos}"
            )
        ids = torch.tensor(read, dtype=torch.int64, device=self.pool.device)
        return _SeqReads(page_ids=ids, first_pos=first_pos, page_start=first_page * size)

    def _pages(self, seq: SeqPages, kind: PageKind) -> Sequence[int | None]:
        pages = seq.full_pages if kind == PageKind.FULL else seq.swa_pages
        need = num_pages(seq.seq_len, self.layout.page_size)
        assert len(pages) >= need, (
            f"{kind.name} pages cover {len(pages)} pages, positions up to {seq.seq_len} need {need}"
        )
        return pages
