"""Partial rotary position embedding (NeoX rotate-half layout on the leading dims of each head)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class Rope(NamedTuple):
    """One forward's rotary tables, built once and shared by every layer of a kind.

    ``sin`` carries the sign of rotate-half: ``rotate_half(x) * sin == flip_halves(x) * sin``
    with the first half of ``sin`` negated (bit for bit: negating a product is exact).
    """

    cos: torch.Tensor  # [num_tokens, 1, rotary_dim]
    sin: torch.Tensor  # [num_tokens, 1, rotary_dim], first half negated


class RotaryEmbedding(nn.Module):
    """cos/sin tables for ``ceil(dim / 2)`` frequencies of base ``theta``.

    Rotates the first ``2 * ceil(dim / 2)`` dims of each head and passes the rest through, which is
    what ``transformers`` does for MiMo-V2 (``dim = int(head_dim * partial_rotary_factor)``).
    """

    def __init__(self, dim: int, theta: float) -> None:
        super().__init__()
        self.dim, self.theta = dim, theta
        # NOTE: a plain attribute, not a buffer: computed on first use on the positions' device,
        # so a model built on the meta device needs no fix-up after loading.
        self._inv_freq: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The tables for ``positions`` ([num_tokens]) in ``dtype``."""
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            exponent = torch.arange(0, self.dim, 2, dtype=torch.float, device=positions.device)
            self._inv_freq = 1.0 / (self.theta ** (exponent / self.dim))
        freqs = positions[:, None].float() * self._inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return Rope(cos[:, None, :], signed[:, None, :])


def apply_rotary(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim] (q and k heads may come together: same tables).

    ``x * cos + rotate_half(x) * sin`` on the rotary dims, as the reference computes it, with
    rotate-half as one flip of the two halves (the sign is in ``rope.sin``).
    """
    cos, sin = rope
    head_dim = x.shape[-1]
    rotary_dim = cos.shape[-1]
    if rotary_dim == head_dim:
        return x * cos + x.unflatten(-1, (2, head_dim // 2)).flip(-2).flatten(-2) * sin
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    flipped = x_rot.unflatten(-1, (2, rotary_dim // 2)).flip(-2).flatten(-2)
    return torch.cat((x_rot * cos + flipped * sin, x_pass), dim=-1)
