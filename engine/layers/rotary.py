"""Partial rotary position embedding (NeoX rotate-half layout on the leading dims of each head)."""

from __future__ import annotations

import torch
from torch import nn


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

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (cos, sin), each [num_tokens, rotary_dim] in ``dtype``."""
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            exponent = torch.arange(0, self.dim, 2, dtype=torch.float, device=positions.device)
            self._inv_freq = 1.0 / (self.theta ** (exponent / self.dim))
        freqs = positions[:, None].float() * self._inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos/sin: [num_tokens, rotary_dim]."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)
