"""KV page geometry: what one page of each kind holds, and the page arithmetic of the window.

A page holds ``page_size`` consecutive token positions of one sequence for *every* layer of its
kind (full or SWA), so one page id covers the same positions in all layers of that kind:

    page (kind k) = [num_layers(k), page_size, num_kv_heads(k), head_dim(k) + v_head_dim(k)]

Full and SWA pages differ in size; both are cut from one byte budget (see ``allocator.py``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from engine.model_config import ModelConfig
from engine.utils import cdiv


class PageKind(enum.IntEnum):
    FULL = 0
    SWA = 1


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Page geometry of one model.

    ``*_head_dims`` are (num_kv_heads, head_dim, v_head_dim); ``window`` is W, the previous tokens
    an SWA query sees. A kind without layers has 0-byte pages and is never allocated.
    """

    page_size: int
    dtype_bytes: int
    full_layer_ids: tuple[int, ...]
    swa_layer_ids: tuple[int, ...]
    full_head_dims: tuple[int, int, int]
    swa_head_dims: tuple[int, int, int]
    window: int

    def __post_init__(self) -> None:
        assert self.page_size > 0, f"page_size={self.page_size}: must be > 0"
        assert self.dtype_bytes > 0, f"dtype_bytes={self.dtype_bytes}: must be > 0"
        assert self.window >= 1, f"window={self.window}: must be >= 1"
        both = set(self.full_layer_ids) & set(self.swa_layer_ids)
        assert not both, f"layers {sorted(both)} are both full and SWA"
        assert self.full_layer_ids or self.swa_layer_ids, "a layout needs at least one layer"
        for dims in (self.full_head_dims, self.swa_head_dims):
            assert all(d > 0 for d in dims), f"head dims {dims}: must be > 0"

    @classmethod
    def from_model(cls, cfg: ModelConfig, page_size: int, dtype_bytes: int) -> KVLayout:
        return cls(
            page_size=page_size,
            dtype_bytes=dtype_bytes,
            full_layer_ids=cfg.full_layer_ids,
            swa_layer_ids=cfg.swa_layer_ids,
            full_head_dims=(cfg.full.num_kv_heads, cfg.full.head_dim, cfg.full.v_head_dim),
            swa_head_dims=(cfg.swa.num_kv_heads, cfg.swa.head_dim, cfg.swa.v_head_dim),
            window=cfg.sliding_window,
        )

    def layer_ids(self, kind: PageKind) -> tuple[int, ...]:
        return self.full_layer_ids if kind == PageKind.FULL else self.swa_layer_ids

    def num_layers(self, kind: PageKind) -> int:
        return len(self.layer_ids(kind))

    def head_dims(self, kind: PageKind) -> tuple[int, int, int]:
        return self.full_head_dims if kind == PageKind.FULL else self.swa_head_dims

    def token_elems(self, kind: PageKind) -> int:
        """Elements of K plus V for one token in one layer of this kind."""
        num_kv_heads, head_dim, v_head_dim = self.head_dims(kind)
        return num_kv_heads * (head_dim + v_head_dim)

    def page_elems(self, kind: PageKind) -> int:
        return self.page_size * self.num_layers(kind) * self.token_elems(kind)

    def page_bytes(self, kind: PageKind) -> int:
        """Bytes of one page of this kind (all its layers); 0 when the model has no such layer."""
        return self.page_elems(kind) * self.dtype_bytes

    @property
    def chunk_bytes(self) -> int:
        """The allocation unit of the shared budget: room for one page of the larger kind."""
        return max(self.page_bytes(PageKind.FULL), self.page_bytes(PageKind.SWA))

    def slots_per_chunk(self, kind: PageKind) -> int:
        """Pages of this kind that fit in one chunk (0 for a kind without layers)."""
        page_bytes = self.page_bytes(kind)
        return self.chunk_bytes // page_bytes if page_bytes else 0

    def layer_index(self, layer_id: int) -> tuple[PageKind, int]:
        """(kind, index among the layers of that kind) of a global layer id.

        Raises:
            ValueError: the layer id is not in this layout.
        """
        if layer_id in self.full_layer_ids:
            return PageKind.FULL, self.full_layer_ids.index(layer_id)
        if layer_id in self.swa_layer_ids:
            return PageKind.SWA, self.swa_layer_ids.index(layer_id)
        raise ValueError(f"layer {layer_id} is neither a full nor an SWA layer of this layout")


def num_pages(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold positions [0, num_tokens)."""
    return cdiv(num_tokens, page_size)


def swa_first_needed_page(seq_len: int, window: int, chunk: int, page_size: int) -> int:
    """Index of the first SWA page a step ending at ``seq_len`` still reads; older ones can go.

    A step whose ``chunk`` queries end at ``seq_len`` starts at ``seq_len - chunk``, and that
    first query sees W previous tokens, so SWA keys in [seq_len - W - chunk, seq_len) are read:

        positions  0 ..... seq_len-W-chunk-1 | seq_len-W-chunk ...... seq_len-chunk-1 | ..seq_len-1
        SWA        releasable                |<------------- W keys ------------->| <-- chunk -->
        pages      [0, first)                | first = (seq_len - W - chunk) // page_size ...

    e.g. W = 16, page_size = 4:
        seq_len  chunk  oldest needed  first needed page
        16       1      0 (clamped)    0
        20       1      3              0
        21       1      4              1
        24       8      0              0
        29       8      5              1
        32       8      8              2

    so pages [0, first) hold only positions older than what the step reads. Clamped at 0.
    """
    return max(0, seq_len - window - chunk) // page_size


def usable_pages(full: Iterable[bool], swa: Iterable[bool], window_pages: int) -> int:
    """The window rule (DESIGN.md invariant 4) over per-page coverage, in one tier or across
    tiers: the deepest p such that pages [0, p) have full KV and pages [p - k, p) have SWA
    (k = ``window_pages``, 0 for a model without SWA layers; near the start, [0, p) when p < k).
    ``PrefixCache.match`` and the tiered admission (``KVManager``) both answer with it."""
    usable = run = 0
    for i, (has_full, has_swa) in enumerate(zip(full, swa)):
        if not has_full:
            break
        run = run + 1 if has_swa else 0
        if run >= min(window_pages, i + 1):
            usable = i + 1
    return usable
