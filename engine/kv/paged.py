"""Paged ``KVContext``: the twin of ``ContiguousBatch`` over a shared ``KVPool``.

The scheduler owns each sequence's pages (``SeqPages``); a ``PagedBatch`` only reads them. Page i
of a sequence covers positions [i * page_size, (i + 1) * page_size). For a step whose queries sit
at [num_cached, seq_len):

    positions      0 ......... lo-1 | lo = max(0, num_cached - W) .. num_cached-1 | .. seq_len-1
    full layers    read             | read                                        | written, read
    SWA layers     may be released  | read (the first query sees W keys back)      | written, read

so an SWA page whose positions all lie below ``lo`` may be None (released, see
``layout.swa_first_needed_page``); reading one is a bug and trips an assertion.

A step reads exactly the keys [first_pos, seq_len) of each sequence, token slot by token slot
(first_pos = 0 for full layers, ``lo`` for SWA layers), never a page tail or another sequence's
slot. Decode sequences (one query each) attend together in one batched call per layer, their keys
left-aligned in a [B, L] grid (L = the most keys of any row):

    column   0 .................. num_keys[b]-1 | num_keys[b] .. L-1
    row b    keys first_pos .. seq_len-1         | its last key again (hidden: probability 0)

A row without padding sums over the same columns as its sequence alone, so it gives that
sequence's own result bit for bit; a padded row differs by float summation order only.

A step whose prefix KV is still being loaded layer by layer (``layerwise.py``) passes
``wait_layer``: ``attend`` calls it first, before it writes or reads that layer's pool memory.
What ``__init__`` precomputes (slot mappings, key slot rows, masks) is page arithmetic only and
reads no KV, so it may run while the copies are in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.kv.layout import KVLayout, PageKind, num_pages
from engine.kv.pool import KVPool, PageSlots
from engine.layers.attention import (
    AttentionSpec,
    attention_with_sinks,
    decode_attention_with_sinks,
    visible_mask,
)


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
    # SWA keys below this position are never read (an MTP layer's rows start there: what lies
    # below was never written for this request, engine.spec)
    min_pos: int = 0
    # each query token attends as a decode row of its own, batched with the step's decodes (a
    # verify step's few rows, engine.spec), instead of through the per-sequence prefill path
    rows: bool = False

    @property
    def seq_len(self) -> int:
        return self.num_cached + self.query_len


@dataclass(frozen=True, slots=True)
class _SeqReads:
    """One prefilling sequence's keys in one step, per page kind."""

    slots: torch.Tensor  # [L] ``KVPool.slot_rows`` of keys first_pos .. seq_len - 1
    visible: torch.Tensor  # [query_len, L] bool


@dataclass(frozen=True, slots=True)
class _DecodeReads:
    """All decode sequences' keys in one step, per page kind (see the module docstring)."""

    slots: torch.Tensor  # [B, L] ``KVPool.slot_rows``
    hidden: torch.Tensor | None  # [B, L] bool, True past row b's keys; None if no row is short


class PagedBatch:
    """``KVContext`` for one forward over several sequences laid out back to back.

    Sequence i contributes ``seqs[i].query_len`` tokens at positions
    ``num_cached .. seq_len - 1``; their K/V go to those positions' pages as each layer runs.
    ``wait_layer(layer_id)``, if given, runs before each layer touches the pool (see above).
    """

    def __init__(
        self,
        pool: KVPool,
        layout: KVLayout,
        seqs: Sequence[SeqPages],
        wait_layer: Callable[[int], None] | None = None,
        kinds: Sequence[PageKind] | None = None,
    ) -> None:
        assert seqs and all(s.query_len > 0 for s in seqs), "every sequence needs >= 1 query"
        self.pool, self.layout, self.seqs = pool, layout, list(seqs)
        self._wait_layer = wait_layer
        self._offsets = [0]
        for s in self.seqs:
            self._offsets.append(self._offsets[-1] + s.query_len)
        self._decode_ids = [i for i, s in enumerate(self.seqs) if s.query_len == 1 or s.rows]
        self._prefill_ids = [i for i, s in enumerate(self.seqs) if s.query_len > 1 and not s.rows]
        # NOTE: ``kinds``: the layers this forward runs have these kinds only (MTP: SWA)
        kinds = [k for k in (kinds or PageKind) if layout.num_layers(k) > 0]
        self._writes = {k: self._init_slot_mapping(k) for k in kinds}
        self._reads = {k: [self._init_reads(i, k) for i in self._prefill_ids] for k in kinds}
        self._decode_reads = {k: self._init_decode_reads(k) for k in kinds if self._decode_ids}
        # NOTE: the flat rows of the decode sequences, needed only beside prefills
        self._decode_rows = torch.tensor(
            [self._offsets[i] + j for i in self._decode_ids for j in range(self.seqs[i].query_len)],
            dtype=torch.int64, device=pool.device,
        ) if self._prefill_ids and self._decode_ids else None

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        pos = [p for s in self.seqs for p in range(s.num_cached, s.seq_len)]
        return torch.tensor(pos, dtype=torch.int64, device=device)

    def last_token_rows(self) -> list[int]:
        return [end - 1 for end in self._offsets[1:]]

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
    ) -> torch.Tensor:
        if self._wait_layer is not None:
            self._wait_layer(spec.layer_id)
        kind, _ = self.layout.layer_index(spec.layer_id)
        where, offsets = self._writes[kind]
        self.pool.write_at(spec.layer_id, where, offsets, k, v)
        if not self._prefill_ids:  # a pure decode step: its rows are the decode sequences
            return self._attend_decodes(q, kind, spec)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        if self._decode_ids:
            out[self._decode_rows] = self._attend_decodes(q[self._decode_rows], kind, spec)
        for i, reads in zip(self._prefill_ids, self._reads[kind]):
            lo, hi = self._offsets[i], self._offsets[i + 1]
            out[lo:hi] = self._attend_one(reads, q[lo:hi], spec)
        return out

    def _attend_decodes(self, q: torch.Tensor, kind: PageKind, spec: AttentionSpec) -> torch.Tensor:
        reads = self._decode_reads[kind]
        kv = self.pool.read_slots(spec.layer_id, reads.slots, heads_first=True)  # [Hkv, B, L, ..]
        return decode_attention_with_sinks(q, kv, q.shape[-1], reads.hidden, spec.scale,
                                           spec.sinks)

    def _attend_one(self, reads: _SeqReads, q: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
        kv = self.pool.read_slots(spec.layer_id, reads.slots)  # [L, Hkv, D + Dv]
        # NOTE: contiguous K and V, as ContiguousBatch has them, keep the results identical.
        keys, values = kv[..., : q.shape[-1]].contiguous(), kv[..., q.shape[-1] :].contiguous()
        return attention_with_sinks(q, keys, values, reads.visible, spec.scale, spec.sinks)

    def _init_slot_mapping(self, kind: PageKind) -> tuple[PageSlots, torch.Tensor]:
        """Page and in-page offset of every new token, for one vectorized write per layer."""
        size = self.layout.page_size
        page_ids: list[int] = []
        offsets: list[int] = []
        for i, seq in enumerate(self.seqs):
            lo, hi = seq.num_cached, seq.seq_len
            first = lo // size
            held = self._pages(seq, kind)[first : (hi - 1) // size + 1]
            if None in held:
                j = first + held.index(None)
                raise AssertionError(
                    f"sequence {i}: {kind.name} page {j} was released but this step writes it"
                )
            if hi - lo == 1:  # NOTE: a decode, most rows of most steps
                page_ids.append(held[0])  # type: ignore[arg-type]
                offsets.append(lo % size)
                continue
            page_ids += [held[p // size - first] for p in range(lo, hi)]  # type: ignore[misc]
            offsets += [p % size for p in range(lo, hi)]
        device = self.pool.device
        where = self.pool.locate(kind, torch.tensor(page_ids, dtype=torch.int64, device=device))
        return where, torch.tensor(offsets, dtype=torch.int64, device=device)

    def _init_reads(self, i: int, kind: PageKind) -> _SeqReads:
        seq = self.seqs[i]
        slots, (num_keys,) = self._key_slots(kind, [seq])
        device = self.pool.device
        first_pos = seq.seq_len - num_keys
        # NOTE: the layout's window is the model's sliding_window, which AttentionSpec carries.
        window = None if kind == PageKind.FULL else self.layout.window
        k_pos = torch.arange(first_pos, seq.seq_len, device=device)
        q_pos = torch.arange(seq.num_cached, seq.seq_len, device=device)
        return _SeqReads(slots[0], visible_mask(q_pos, k_pos, window))

    def _init_decode_reads(self, kind: PageKind) -> _DecodeReads:
        seqs = [self.seqs[i] for i in self._decode_ids]
        slots, num_keys = self._key_slots(kind, seqs)
        device = self.pool.device
        col = torch.arange(slots.shape[1], device=device)
        if all(s.query_len == 1 for s in seqs):
            if min(num_keys) == slots.shape[1]:
                return _DecodeReads(slots, None)
            return _DecodeReads(slots, col >= torch.tensor(num_keys, device=device)[:, None])
        # NOTE: a ``rows`` sequence's grid covers the keys of all its rows; row j (position
        # num_cached + j) hides the keys after it, and for SWA those more than W before it
        per_seq = torch.tensor([s.query_len for s in seqs], device=device)
        slots = slots.repeat_interleave(per_seq, 0)
        first = torch.tensor([s.seq_len - n for s, n in zip(seqs, num_keys)], device=device)
        key_pos = first.repeat_interleave(per_seq)[:, None] + col
        num = torch.tensor(num_keys, device=device).repeat_interleave(per_seq)[:, None]
        q_pos = torch.tensor([p for s in seqs for p in range(s.num_cached, s.seq_len)],
                             device=device)[:, None]
        hidden = (col >= num) | (key_pos > q_pos)
        if kind != PageKind.FULL:
            hidden |= key_pos < q_pos - self.layout.window
        return _DecodeReads(slots, hidden)

    def _key_slots(
        self, kind: PageKind, seqs: Sequence[SeqPages]
    ) -> tuple[torch.Tensor, list[int]]:
        """[B, L] slot rows of each sequence's keys first_pos .. seq_len - 1, left-aligned (a
        short row repeats its last key), and each row's number of keys."""
        size, device = self.layout.page_size, self.pool.device
        reads = [self._read_pages(seq, kind) for seq in seqs]
        width = max(len(read) for _, _, read in reads)
        flat: list[int] = []  # NOTE: one flat list, one tensor: per step, per kind
        starts, num_keys = [], []
        for seq, (first_pos, first_page, read) in zip(seqs, reads):
            flat += read
            flat += read[-1:] * (width - len(read))
            starts.append(first_pos - first_page * size)  # first key's column in its page row
            num_keys.append(seq.seq_len - first_pos)
        ids = torch.tensor(flat, device=device).view(len(seqs), width, 1)
        offsets = torch.arange(size, device=device)
        rows = self.pool.slot_rows(kind, ids, offsets).view(len(seqs), -1)
        start = torch.tensor(starts, device=device)[:, None]
        last = start + torch.tensor(num_keys, device=device)[:, None] - 1
        col = (start + torch.arange(max(num_keys), device=device)).minimum(last)
        return rows.gather(1, col), num_keys

    def _read_pages(self, seq: SeqPages, kind: PageKind) -> tuple[int, int, list[int]]:
        """(first position read, first page read, the page ids read) for one sequence."""
        size = self.layout.page_size
        first_pos = 0 if kind == PageKind.FULL else max(seq.min_pos,
                                                        seq.num_cached - self.layout.window)
        first_page = first_pos // size
        read = self._pages(seq, kind)[first_page : num_pages(seq.seq_len, size)]
        if None in read:
            i = first_page + read.index(None)
            raise AssertionError(
                f"{kind.name} page {i} (positions [{i * size}, {(i + 1) * size})) was released "
                f"but a query at position {seq.num_cached} reads from position {first_pos}"
            )
        return first_pos, first_page, read  # type: ignore[return-value]

    def _pages(self, seq: SeqPages, kind: PageKind) -> Sequence[int | None]:
        pages = seq.full_pages if kind == PageKind.FULL else seq.swa_pages
        need = num_pages(seq.seq_len, self.layout.page_size)
        assert len(pages) >= need, (
            f"{kind.name} pages cover {len(pages)} pages, positions up to {seq.seq_len} need {need}"
        )
        return pages
