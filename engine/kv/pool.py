"""Device memory behind ``PageAllocator``: one arena of chunks, viewed per page kind.

    arena      [num_chunks, chunk_elems]                      (model dtype, on the device)
    kind view  [num_chunks, slots, layers, page_size, kv_heads, head_dim + v_head_dim]
               over the leading slots * page_elems elements of each chunk (the rest is slack)

Both views alias the same arena, so a chunk freed by SWA pages can next hold full pages. K sits in
the first ``head_dim`` entries of the last dim, V in the rest.

Reads go through a third view per layer, one row per possible token slot (see ``_slot_view``),
so a batch of keys is one ``index_select`` (a row copy each) instead of an element-wise
advanced-indexing gather, which is several times slower for the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.kv.layout import KVLayout, PageKind


class PageSlots(NamedTuple):
    """Where pages sit in the arena: ``chunk`` and ``slot`` of each page id (same shape)."""

    chunk: torch.Tensor
    slot: torch.Tensor


class KVPool:
    """The K/V memory of ``num_chunks`` chunks of ``layout`` (as many as the allocator has)."""

    def __init__(
        self,
        layout: KVLayout,
        num_chunks: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
    ) -> None:
        itemsize = torch.empty((), dtype=dtype).element_size()
        assert itemsize == layout.dtype_bytes, (
            f"{dtype} has {itemsize}-byte elements, the layout says {layout.dtype_bytes}"
        )
        self.layout, self.num_chunks = layout, num_chunks
        self.device = torch.device(device)
        chunk_elems = layout.chunk_bytes // layout.dtype_bytes
        # NOTE: zeros, not empty: a bug that reads an unwritten slot then shows finite values.
        # pinned (page-locked) host memory makes host -> device copies asynchronous (L2 tier)
        self.arena = torch.zeros(
            num_chunks, chunk_elems, dtype=dtype, device=self.device, pin_memory=pin_memory
        )
        self._views = {kind: self._make_view(kind) for kind in PageKind}
        kinds = [kind for kind in PageKind if layout.num_layers(kind) > 0]
        self._row_step = {kind: math.gcd(chunk_elems, layout.token_elems(kind)) for kind in kinds}
        self._slot_views = {
            layer_id: self._slot_view(kind, index)
            for kind in kinds
            for index, layer_id in enumerate(layout.layer_ids(kind))
        }
        # NOTE: per KV head, [rows, head_dim + v_head_dim] over the same rows (heads_first reads)
        self._head_views = {
            layer_id: _split_heads(view, layout.head_dims(layout.layer_index(layer_id)[0]))
            for layer_id, view in self._slot_views.items()
        }

    @property
    def total_bytes(self) -> int:
        return self.arena.numel() * self.arena.element_size()

    def page(self, kind: PageKind, page_id: int) -> torch.Tensor:
        """One page of this kind: [layers, page_size, kv_heads, head_dim + v_head_dim] (aliases)."""
        chunk, slot = divmod(page_id, self.layout.slots_per_chunk(kind))
        return self._views[kind][chunk, slot]

    def view(self, kind: PageKind) -> torch.Tensor:
        """[num_chunks, slots, layers, page_size, kv_heads, head_dim + v_head_dim] (aliases)."""
        return self._views[kind]

    def locate(self, kind: PageKind, page_ids: torch.Tensor) -> PageSlots:
        """Chunk and slot of each page id (any shape, int64 on the pool's device)."""
        slots = self.layout.slots_per_chunk(kind)
        return PageSlots(page_ids // slots, page_ids % slots)

    def write(
        self,
        layer_id: int,
        page_ids: torch.Tensor,
        offsets: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store token i's K/V at ``offsets[i]`` of page ``page_ids[i]`` of ``layer_id``.

        Args:
            page_ids, offsets: [n] int64 on the pool's device.
            k: [n, kv_heads, head_dim]; v: [n, kv_heads, v_head_dim].
        """
        kind, _ = self.layout.layer_index(layer_id)
        self.write_at(layer_id, self.locate(kind, page_ids), offsets, k, v)

    def write_at(
        self,
        layer_id: int,
        where: PageSlots,
        offsets: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """``write`` with the pages already located (``locate`` once per step, not per layer)."""
        kind, index = self.layout.layer_index(layer_id)
        self._views[kind][where.chunk, where.slot, index, offsets] = torch.cat([k, v], dim=-1)

    def gather(
        self, layer_id: int, page_ids: Sequence[int] | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer_id`` for these pages in order, as fresh contiguous tensors.

        Returns:
            k [len * page_size, kv_heads, head_dim], v [len * page_size, kv_heads, v_head_dim]
        """
        kind, _ = self.layout.layer_index(layer_id)
        ids = torch.as_tensor(page_ids, dtype=torch.int64, device=self.device)
        offsets = torch.arange(self.layout.page_size, device=self.device)
        kv = self.read_slots(layer_id, self.slot_rows(kind, ids[:, None], offsets).reshape(-1))
        head_dim = self.layout.head_dims(kind)[1]
        return kv[..., :head_dim].contiguous(), kv[..., head_dim:].contiguous()

    def slot_rows(
        self, kind: PageKind, page_ids: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """Row of token slot ``offsets`` of page ``page_ids`` (broadcast) for ``read_slots``.

        The rows do not depend on the layer: compute them once per step.
        """
        chunk, slot = self.locate(kind, page_ids)
        start = chunk * self.arena.shape[1] + slot * self.layout.page_elems(kind)
        return (start + offsets * self.layout.token_elems(kind)) // self._row_step[kind]

    def read_slots(self, layer_id: int, rows: torch.Tensor, heads_first: bool = False
                   ) -> torch.Tensor:
        """K and V of ``layer_id`` in the token slots at ``rows`` (from ``slot_rows``), one copy.

        Returns:
            [*rows.shape, kv_heads, head_dim + v_head_dim]; K first on the last dim. With
            ``heads_first``: [kv_heads, *rows.shape, head_dim + v_head_dim], each head's slots
            gathered on their own (the layout batched decode attention multiplies without a
            copy: one batch dim over heads and rows).
        """
        kind, _ = self.layout.layer_index(layer_id)
        num_kv_heads, head_dim, v_head_dim = self.layout.head_dims(kind)
        flat = rows.reshape(-1)
        if heads_first and num_kv_heads > 1:
            out = self.arena.new_empty(num_kv_heads, flat.numel(), head_dim + v_head_dim)
            for h, view in enumerate(self._head_views[layer_id]):
                torch.index_select(view, 0, flat, out=out[h])
            return out.view(num_kv_heads, *rows.shape, head_dim + v_head_dim)
        kv = self._slot_views[layer_id].index_select(0, flat)
        if heads_first:  # NOTE: one head: the same bytes, a leading dim of 1
            return kv.view(1, *rows.shape, head_dim + v_head_dim)
        return kv.view(*rows.shape, num_kv_heads, head_dim + v_head_dim)

    def _slot_view(self, kind: PageKind, index: int) -> torch.Tensor:
        """[rows, token_elems] over the arena: row r is the K|V of the layer-``index`` token slot
        that starts at element ``r * row_step`` of the arena (past the layer's storage offset):

            element   chunk * chunk_elems + slot * page_elems + offset * token_elems  (row * step)
                      + index * page_size * token_elems                       (storage offset)
                      -> token_elems contiguous elements: [kv_heads, head_dim + v_head_dim]

        ``row_step`` divides chunk_elems and token_elems, so it divides every slot's start. Rows
        overlap when row_step < token_elems: a read-only view, never written through.
        """
        flat, row, step = self.arena.view(-1), self.layout.token_elems(kind), self._row_step[kind]
        start = index * self.layout.page_size * row
        num_rows = max(0, (flat.numel() - start - row) // step + 1)
        return flat.as_strided((num_rows, row), (step, 1), flat.storage_offset() + start)

    def _make_view(self, kind: PageKind) -> torch.Tensor:
        layout = self.layout
        slots, page_elems = layout.slots_per_chunk(kind), layout.page_elems(kind)
        num_kv_heads, head_dim, v_head_dim = layout.head_dims(kind)
        shape = (
            self.num_chunks,
            slots,
            layout.num_layers(kind),
            layout.page_size,
            num_kv_heads,
            head_dim + v_head_dim,
        )
        # NOTE: slicing keeps each row's inner dim contiguous, so .view can split it (no copy).
        return self.arena[:, : slots * page_elems].view(shape)


def _split_heads(view: torch.Tensor, head_dims: tuple[int, int, int]) -> list[torch.Tensor]:
    """One [rows, head_dim + v_head_dim] view per KV head of a slot view ([rows, token_elems])."""
    num_kv_heads, head_dim, v_head_dim = head_dims
    size = head_dim + v_head_dim
    if num_kv_heads == 1:
        return [view]
    return [view.as_strided((view.shape[0], size), view.stride(), view.storage_offset() + h * size)
            for h in range(num_kv_heads)]
