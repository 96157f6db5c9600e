"""The step-overhead rewrites of issue 15 compute what the reference op order computes.

Each fast form is checked against the reference formula it replaces (the one ``transformers``
uses), bit for bit where the rewrite claims it, on random inputs of many shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.layers.attention import Attention, _softmax_with_sinks
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.model_config import ModelConfig
from engine.models.checkpoint import mimo_config


def _reference_rotary(x: torch.Tensor, positions: torch.Tensor, dim: int, theta: float,
                      dtype: torch.dtype) -> torch.Tensor:
    """transformers' rotate-half form, on the first ``2 * ceil(dim / 2)`` dims of each head."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(1, 40),
    heads=st.integers(1, 6),
    half_dim=st.integers(1, 24),
    rotary_frac=st.sampled_from([1.0, 0.5, 0.334, 0.75]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_rotary_flip_form_equals_rotate_half(tokens, heads, half_dim, rotary_frac, dtype, seed):
    head_dim = 2 * half_dim
    dim = max(1, int(head_dim * rotary_frac))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 5000, (tokens,), generator=gen)
    got = apply_rotary(x, RotaryEmbedding(dim, 10000.0)(positions, dtype))
    want = _reference_rotary(x, positions, dim, 10000.0, dtype)
    assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("hidden", [8, 128, 257, 4096])
def test_fp32_rms_norm_is_the_reference_op_order_bit_for_bit(hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen))
    for rows in (1, 5, 64):
        x = torch.randn(rows, hidden, generator=gen) * 7
        h = x.float()
        want = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        assert torch.equal(norm(x), want)


def test_bf16_rms_norm_keeps_the_reference_rounding() -> None:
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-6).to(torch.bfloat16)
    x = torch.randn(9, 64, generator=gen).to(torch.bfloat16)
    h = x.float()
    want = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    assert torch.equal(norm(x), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_with_sinks_equals_the_max_subtracted_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    for shape in [(32, 1, 4, 161), (7, 4, 33), (1, 4, 1)]:
        scores = (torch.randn(*shape, generator=gen) * 6).to(dtype)
        sinks = torch.randn(shape[-2], 1, generator=gen).to(dtype)
        full = torch.cat([scores, sinks.expand(*scores.shape[:-1], 1)], dim=-1)
        full = full - full.max(dim=-1, keepdim=True).values
        want = torch.softmax(full, dim=-1, dtype=dtype)[..., :-1]
        assert torch.equal(_softmax_with_sinks(scores, sinks), want)


def _attention(bias: bool) -> Attention:
    cfg = ModelConfig.from_dict(mimo_config(layers="FS", attention_bias=bias))
    attn = Attention(cfg, 0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return attn


@pytest.mark.parametrize("bias", [False, True])
def test_fused_qkv_is_the_three_projections(bias: bool) -> None:
    """One matmul over [q; k; v] gives each projection's own rows; the checkpoint's parameters
    stay views of the fused weight through in-place loads and dtype moves."""
    attn = _attention(bias)
    x = torch.randn(11, attn.q_proj.in_features, generator=torch.Generator().manual_seed(4))
    separate = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
    assert torch.equal(F.linear(x, attn._qkv_weight, attn._qkv_bias), separate)
    with torch.no_grad():
        attn.k_proj.weight.mul_(2)  # NOTE: what a loader's param.copy_ does
    assert torch.equal(attn._qkv_weight[attn.q_proj.out_features :][: attn.k_proj.out_features],
                       attn.k_proj.weight)
    moved = attn.to(torch.bfloat16)
    assert moved._qkv_weight.dtype == torch.bfloat16
    v_rows = moved._qkv_weight[-moved.v_proj.out_features :]
    assert moved.v_proj.weight.data_ptr() == v_rows.data_ptr()
    if bias:
        assert moved.q_proj.bias.data_ptr() == moved._qkv_bias.data_ptr()
