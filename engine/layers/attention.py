"""Attention: projections and RoPE here; KV storage and the attention math behind ``KVContext``.

The model never touches KV memory. Each layer hands its new q/k/v to ``kv.attend``, which stores
k/v wherever the backend keeps them (contiguous per request today, paged pools later) and returns
the attention output. ``attention_with_sinks`` is the reference math every CPU backend uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.rotary import Rope, apply_rotary
from engine.model_config import SWA, ModelConfig


@dataclass(frozen=True, slots=True, eq=False)
class AttentionSpec:
    """What a backend needs to know about one layer's attention."""

    layer_id: int
    scale: float
    window: int | None  # W previous tokens visible (SWA), None for full attention
    sinks: torch.Tensor | None  # [num_heads] learnable sink logits, or None


class KVContext(Protocol):
    """One forward pass's view of the KV cache (one per batch, passed explicitly to the model)."""

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
    ) -> torch.Tensor:
        """Store this step's k/v for ``spec.layer_id`` and attend.

        Args:
            q: [num_tokens, num_heads, head_dim], rotated.
            k: [num_tokens, num_kv_heads, head_dim], rotated.
            v: [num_tokens, num_kv_heads, v_head_dim], already scaled.
        Returns:
            [num_tokens, num_heads, v_head_dim]
        """
        ...


def attention_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Softmax attention over the visible keys, plus an optional per-head sink logit.

    The sink joins the softmax denominator and is then dropped, so a head can attend to "nothing".
    Op order mirrors the reference so bf16 results agree.

    Args:
        q: [..., n, H, D]; k: [..., L, Hkv, D]; v: [..., L, Hkv, Dv]; visible: [n, L] bool.
            Leading dims (a batch of equal-length sequences, as MTP distillation trains on)
            are optional.
    Returns:
        [..., n, H, Dv]
    """
    num_heads, num_kv_heads = q.shape[-2], k.shape[-2]
    rep = num_heads // num_kv_heads
    qh = q.transpose(-3, -2)  # [..., H, n, D]
    kh = k.transpose(-3, -2).repeat_interleave(rep, dim=-3)  # [..., H, L, D]
    vh = v.transpose(-3, -2).repeat_interleave(rep, dim=-3)  # [..., H, L, Dv]
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = _softmax_with_sinks(scores, None if sinks is None else sinks.reshape(-1, 1, 1))
    return torch.matmul(probs.to(vh.dtype), vh).transpose(-3, -2)


def decode_attention_with_sinks(
    q: torch.Tensor,
    kv: torch.Tensor,
    head_dim: int,
    hidden: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """``attention_with_sinks`` for B sequences of one query each, every key visible but padding.

    GQA without copies of K or V: the query heads of one KV head form the rows of one matmul
    against it, and (KV head, sequence) pairs form one batch dim, so each matmul is one ``bmm``
    over contiguous K|V rows (as ``KVPool.read_slots(..., heads_first=True)`` gathers them).

    Args:
        q: [B, H, D]; kv: [Hkv, B, L, D + Dv], K first on the last dim (``head_dim`` = D).
        hidden: [B, L] bool, True where a key column is padding (its V must be finite: it gets
            probability 0, and 0 * NaN is NaN), or None when no column is.
    Returns:
        [B, H, Dv]
    """
    batch, num_heads, _ = q.shape
    num_kv_heads, _, length, _ = kv.shape
    rep = num_heads // num_kv_heads
    kv = kv.view(num_kv_heads * batch, length, -1)
    keys, values = kv[..., :head_dim], kv[..., head_dim:]
    # NOTE: with one KV head these are views; with more, q (B * H * D elements) is copied
    qg = q.view(batch, num_kv_heads, rep, head_dim).transpose(0, 1).reshape(-1, rep, head_dim)
    scores = torch.bmm(qg, keys.transpose(1, 2)) * scale  # [Hkv * B, rep, L]
    if hidden is not None:
        mask = hidden[None, :, None, :].expand(num_kv_heads, -1, -1, -1)
        scores = scores.masked_fill(mask.reshape(-1, 1, length), float("-inf"))
    sink = None
    if sinks is not None:
        sink = sinks.view(num_kv_heads, 1, rep, 1).expand(-1, batch, -1, -1).reshape(-1, rep, 1)
    probs = _softmax_with_sinks(scores, sink)
    out = torch.bmm(probs.to(values.dtype), values)  # [Hkv * B, rep, Dv]
    return out.view(num_kv_heads, batch, rep, -1).transpose(0, 1).reshape(batch, num_heads, -1)


def visible_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[n, L] bool: key j is visible to query i if k_j <= q_i and, for SWA, q_i - k_j <= window.

    For window W the query at position p sees keys p - W .. p (W + 1 keys, itself included).
    """
    diff = q_pos[:, None] - k_pos[None, :]
    visible = diff >= 0
    if window is not None:
        visible &= diff <= window
    return visible


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        geo = cfg.geometry(layer_id)
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads = geo.num_heads, geo.num_kv_heads
        self.head_dim, self.v_head_dim = geo.head_dim, geo.v_head_dim
        self.v_scale = cfg.attention_value_scale
        self.window = cfg.sliding_window if cfg.layer_types[layer_id] == SWA else None
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, geo.num_heads * geo.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, geo.num_kv_heads * geo.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, geo.num_kv_heads * geo.v_head_dim, bias=bias)
        self.o_proj = nn.Linear(geo.num_heads * geo.v_head_dim, h, bias=False)
        self.attention_sink_bias = (
            nn.Parameter(torch.empty(geo.num_heads)) if geo.has_sink else None
        )
        self._stack_qkv()

    def forward(self, x: torch.Tensor, rope: Rope, kv: KVContext) -> torch.Tensor:
        n = x.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = F.linear(x, self._qkv_weight, self._qkv_bias)  # one matmul for q, k and v
        # NOTE: q and k heads side by side share one rotation (same tables, same head_dim)
        qk = apply_rotary(qkv[:, : (heads + kv_heads) * self.head_dim]
                          .view(n, heads + kv_heads, self.head_dim), rope)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, (heads + kv_heads) * self.head_dim :].view(n, kv_heads, self.v_head_dim)
        if self.v_scale != 1.0:
            v = v * self.v_scale
        spec = AttentionSpec(
            self.layer_id, self.head_dim**-0.5, self.window, self.attention_sink_bias
        )
        out = kv.attend(q, k, v, spec)
        return F.linear(out.reshape(n, heads * self.v_head_dim), self.o_proj.weight)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Attention:
        # NOTE: to(), to_empty(), float(), ... give q/k/v new storage; stack them again so the
        # checkpoint's parameters stay views of the fused weight
        super()._apply(fn, recurse)
        self._stack_qkv()
        return self

    @torch.no_grad()
    def _stack_qkv(self) -> None:
        """One [q; k; v] weight (and bias) whose rows the three projections' parameters view,
        so a step runs one matmul and a loader's in-place copy into ``q_proj.weight`` lands in
        it. Each output row is its own row's dot product, as with three matmuls."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([p.weight for p in projs])
        bias = torch.cat([p.bias for p in projs]) if self.q_proj.bias is not None else None
        start = 0
        for p in projs:
            rows = p.weight.shape[0]
            p.weight.data = weight[start : start + rows]
            if bias is not None:
                p.bias.data = bias[start : start + rows]
            start += rows
        self._qkv_weight, self._qkv_bias = weight, bias


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim with a sink logit column appended, then dropped.

    ``sinks`` broadcasts against ``scores[..., :1]``.
    """
    if sinks is not None:
        sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    if scores.dtype != torch.float32:
        # NOTE: the reference subtracts the max first; in fp32 softmax's own max subtraction
        # gives the same bits ((x - m) - 0 == x - m), in bf16 the rounded difference differs
        scores = scores - scores.max(dim=-1, keepdim=True).values
    probs = torch.softmax(scores, dim=-1, dtype=scores.dtype)
    return probs[..., :-1] if sinks is not None else probs
