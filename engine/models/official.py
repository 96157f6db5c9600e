"""The official XiaomiMiMo checkpoint layout: block-scaled fp8 weights and a TP-chunked fused qkv.

Block fp8 (``quantization_config.quant_method == "fp8"``, ``weight_block_size = [bh, bw]``): a
quantized ``<m>.weight`` [O, I] is ``float8_e4m3fn`` and ``<m>.weight_scale_inv`` is fp32
[cdiv(O, bh), cdiv(I, bw)]. Despite the name, ``scale_inv`` is the dequant MULTIPLIER
(DeepSeek-V3 lineage; SGLang/vLLM/transformers' fine-grained fp8 all compute ``fp8 * scale_inv``)::

    weight[r, c] = float(fp8[r, c]) * scale_inv[r // bh, c // bw]     (edge blocks are partial)

Fused qkv (``attention_projection_layout == "fused_qkv"``): ``self_attn.qkv_proj.weight`` holds
``tp`` row chunks, chunk i being [Q_i; K_i; V_i] for TP rank i, each chunk quantized on its own
block grid (padded to a block boundary by itself, so the scale rows are ``tp * cdiv(R, bh)``)::

    rows   [0, R)     [R, 2R)    ...  [(tp-1)R, tp R)    R = (H d + G d + G dv) / tp
    chunk  rank 0     rank 1          rank tp-1          H q heads, G kv heads
    inside [Q: H/tp*d | K: G/tp*d | V: G/tp*dv]        d head_dim, dv v_head_dim

NOTE (assumption): ``tp`` is not in config.json. ``detect_qkv_tp`` recovers it from the scale grid
(per-chunk padding makes it visible when a chunk is not block-aligned, as in MiMo-V2-Flash's full
layers) and refuses to guess when several degrees fit; callers can pass it. KV heads are divided,
never replicated, across chunks (H % tp == G % tp == 0).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.model_config import AttentionGeometry
from engine.utils import cdiv

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"
TP_CANDIDATES = (1, 2, 4, 8, 16, 32)


class QkvRows(NamedTuple):
    """Rows of Q, K and V inside one TP chunk of a fused qkv_proj."""

    q: int
    k: int
    v: int

    @property
    def total(self) -> int:
        return self.q + self.k + self.v


def qkv_rows(geo: AttentionGeometry, tp: int) -> QkvRows | None:
    """Per-chunk rows for ``tp`` chunks, or None when the heads do not divide evenly."""
    if geo.num_heads % tp or geo.num_kv_heads % tp:
        return None
    kv = geo.num_kv_heads // tp
    return QkvRows(geo.num_heads // tp * geo.head_dim, kv * geo.head_dim, kv * geo.v_head_dim)


def fits_tp(
    geo: AttentionGeometry, tp: int, num_rows: int, scale_rows: int | None, bh: int
) -> bool:
    """Whether a fused qkv of ``num_rows`` (and ``scale_rows`` of scales) was cut ``tp`` ways."""
    rows = qkv_rows(geo, tp)
    if rows is None or rows.total * tp != num_rows:
        return False
    return scale_rows is None or scale_rows == tp * cdiv(rows.total, bh)


def detect_qkv_tp(
    shapes: list[tuple[AttentionGeometry, int, int | None]], bh: int, name: str
) -> int:
    """The one TP degree consistent with every layer's (geometry, qkv rows, scale rows).

    Raises:
        ValueError: no degree fits, or several do (pass it explicitly then).
    """
    fits = [tp for tp in TP_CANDIDATES if all(fits_tp(g, tp, n, s, bh) for g, n, s in shapes)]
    if len(fits) != 1:
        why = "none" if not fits else f"all of {fits}"
        raise ValueError(
            f"{name}: cannot tell how many TP chunks the fused qkv_proj has ({why} of "
            f"{list(TP_CANDIDATES)} fit the tensor shapes); pass qkv_tp_size"
        )
    return fits[0]


def split_qkv(qkv: torch.Tensor, geo: AttentionGeometry, tp: int) -> tuple[torch.Tensor, ...]:
    """Un-fuse [Q_0 K_0 V_0 ... Q_tp-1 K_tp-1 V_tp-1] (rows) into full Q, K and V."""
    rows = qkv_rows(geo, tp)
    assert rows is not None and qkv.shape[0] == rows.total * tp, (tuple(qkv.shape), rows, tp)
    parts = [chunk.split(list(rows)) for chunk in qkv.chunk(tp)]
    return tuple(torch.cat([p[j] for p in parts]) for j in range(3))


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, geo: AttentionGeometry, tp: int
) -> torch.Tensor:
    """The inverse of ``split_qkv``."""
    assert qkv_rows(geo, tp) is not None, (geo, tp)
    return torch.cat([torch.cat(c) for c in zip(q.chunk(tp), k.chunk(tp), v.chunk(tp))])


def dequantize_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], chunks: int = 1
) -> torch.Tensor:
    """fp32 ``weight * scale_inv`` per block; ``chunks`` row chunks each have their own grid.

    Raises:
        ValueError: ``scale_inv`` does not have the grid's shape.
    """
    bh, bw = block
    rows, cols = weight.shape
    expected = (chunks * cdiv(rows // chunks, bh), cdiv(cols, bw))
    if rows % chunks or tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale has shape {tuple(scale_inv.shape)}, expected {expected} for a "
            f"{tuple(weight.shape)} weight in {bh}x{bw} blocks" + _chunk_note(chunks)
        )
    out = [
        _dequantize_one(w, s, bh, bw)
        for w, s in zip(weight.chunk(chunks), scale_inv.float().chunk(chunks))
    ]
    return torch.cat(out)


def quantize_blocks(
    weight: torch.Tensor, block: tuple[int, int], chunks: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 scale_inv) with power-of-two scales, so dequantizing is exact."""
    bh, bw = block
    pairs = [_quantize_one(w.float(), bh, bw) for w in weight.chunk(chunks)]
    return torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])


def expand_scale(scale: torch.Tensor, rows: int, cols: int, bh: int, bw: int) -> torch.Tensor:
    """Broadcast a block grid to a [rows, cols] tensor (edge blocks cut short)."""
    return scale.repeat_interleave(bh, 0)[:rows].repeat_interleave(bw, 1)[:, :cols]


def _dequantize_one(w: torch.Tensor, s: torch.Tensor, bh: int, bw: int) -> torch.Tensor:
    return w.float() * expand_scale(s, w.shape[0], w.shape[1], bh, bw)


def _quantize_one(w: torch.Tensor, bh: int, bw: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    pad = torch.zeros(cdiv(rows, bh) * bh, cdiv(cols, bw) * bw)
    pad[:rows, :cols] = w.abs()
    amax = pad.view(cdiv(rows, bh), bh, -1, bw).amax(dim=(1, 3)).clamp_min(1e-12)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (w / expand_scale(scale, rows, cols, bh, bw)).to(FP8)
    return q, scale


def _chunk_note(chunks: int) -> str:
    return "" if chunks == 1 else f" cut into {chunks} TP chunks, each on its own grid"
