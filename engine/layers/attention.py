"""Attention: projections and RoPE here; KV storage and the attention math behind ``KVContext``.

The model never touches KV memory. Each layer hands its new q/k/v to ``kv.attend``, which stores
k/v wherever the backend keeps them (contiguous per request today, paged pools later) and returns
the attention output. ``attention_with_sinks`` is the reference math every CPU backend uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from engine.layers.rotary import apply_rotary
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
    k: torch.Tensor,
    v: torch.Tensor,
    hidden: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """``attention_with_sinks`` for B sequences of one query each, every key visible but padding.

    GQA without copies: the query heads of one KV head form the rows of one matmul against it.

    Args:
        q: [B, H, D]; k: [B, L, Hkv, D]; v: [B, L, Hkv, Dv] (may be strided views).
        hidden: [B, L] bool, True where a key column is padding (its V must be finite: it gets
            probability 0, and 0 * NaN is NaN), or None when no column is.
    Returns:
        [B, H, Dv]
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    qg = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, rep, D]
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)) * scale  # [B, Hkv, rep, L]
    if hidden is not None:
        scores = scores.masked_fill(hidden[:, None, None, :], float("-inf"))
    sink = None if sinks is None else sinks.view(1, num_kv_heads, -1, 1)
    probs = _softmax_with_sinks(scores, sink)
    out = torch.matmul(probs.to(v.dtype), v.permute(0, 2, 1, 3))  # [B, Hkv, rep, Dv]
    return out.reshape(batch, num_heads, -1)


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

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: KVContext
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.v_head_dim) * self.v_scale
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        spec = AttentionSpec(
            self.layer_id, self.head_dim**-0.5, self.window, self.attention_sink_bias
        )
        out = kv.attend(q, k, v, spec)
        return self.o_proj(out.reshape(n, self.num_heads * self.v_head_dim))


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim with a sink logit column appended, then dropped.

    ``sinks`` broadcasts against ``scores[..., :1]``.
    """
    if sinks is not None:
        sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    scores = scores - scores.max(dim=-1, keepdim=True).values
    probs = torch.softmax(scores, dim=-1, dtype=scores.dtype)
    return probs[..., :-1] if sinks is not None else probs
