"""Device memory behind ``PageAllocator``: one arena of chunks, viewed per page kind.

    arena      [num_chunks, chunk_elems]                      (model dtype, on the device)
    kind view  [num_chunks, slots, layers, page_size, kv_heads, head_dim + v_head_dim]
               over the leading slots * page_elems elements of each chunk (the rest is slack)

Both views alias the same arena, so a chunk freed by SWA pages can next hold full pages. K sits in
the first ``head_dim`` entries of the last dim, V in the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kv.layout import KVLayout, PageKind


class KVPool:
    """The K/V memory of ``num_chunks`` chunks of ``layout`` (as many as the allocator has)."""

    def __init__(
        self,
        layout: KVLayout,
        num_chunks: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        itemsize = torch.empty((), dtype=dtype).element_size()
        assert itemsize == layout.dtype_bytes, (
            f"{dtype} has {itemsize}-byte elements, the layout says {layout.dtype_bytes}"
        )
        self.layout, self.num_chunks = layout, num_chunks
        self.device = torch.device(device)
        chunk_elems = layout.chunk_bytes // layout.dtype_bytes
        # NOTE: zeros, not empty: a bug that reads an unwritten slot then shows finite values.
        self.arena = torch.zeros(num_chunks, chunk_elems, dtype=dtype, device=self.device)
        self._views = {kind: self._make_view(kind) for kind in PageKind}

    @property
    def total_bytes(self) -> int:
        return self.arena.numel() * self.arena.element_size()

    def view(self, kind: PageKind) -> torch.Tensor:
        """[num_chunks, slots, layers, page_size, kv_heads, head_dim + v_head_dim] (aliases)."""
        return self._views[kind]

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
        kind, index = self.layout.layer_index(layer_id)
        chunk, slot = self._locate(kind, page_ids)
        self._views[kind][chunk, slot, index, offsets] = torch.cat([k, v], dim=-1)

    def gather(
        self, layer_id: int, page_ids: Sequence[int] | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer_id`` for these pages in order, as fresh contiguous tensors.

        Returns:
            k [len * page_size, kv_heads, head_dim], v [len * page_size, kv_heads, v_head_dim]
        """
        kind, index = self.layout.layer_index(layer_id)
        ids = torch.as_tensor(page_ids, dtype=torch.int64, device=self.device)
        chunk, slot = self._locate(kind, ids)
        kv = self._views[kind][chunk, slot, index]  # [len, page_size, kv_heads, D + Dv]
        kv = kv.reshape(-1, *kv.shape[2:])
        head_dim = self.layout.head_dims(kind)[1]
        return kv[..., :head_dim].contiguous(), kv[..., head_dim:].contiguous()

    def _locate(self, kind: PageKind, page_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.layout.slots_per_chunk(kind)
        return page_ids // slots, page_ids % slots

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
