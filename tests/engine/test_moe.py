"""MoE: the small-batch dense path equals the per-expert loop; stacked weights track the params."""

from __future__ import annotations

import pytest
import torch

from engine.layers.moe import MoE, route


def _make_moe(dtype: torch.dtype, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(32, 16, 8, top_k=3, n_group=2, topk_group=2, norm_topk_prob=True,
              routed_scaling_factor=1.5)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    moe = moe.to(dtype)
    moe.gate.float()
    return moe


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 0.0)])
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
def test_dense_path_equals_per_expert_loop(dtype: torch.dtype, tol: float, num_tokens: int) -> None:
    moe = _make_moe(dtype)
    x = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(num_tokens)).to(dtype)
    weights, ids = route(x, moe.gate.weight, moe.gate.e_score_correction_bias, **moe._route_kwargs)
    dense = moe._forward_dense(x, weights, ids)
    loop = moe._forward_per_expert(x, weights, ids)
    err = (dense.float() - loop.float()).abs().max().item()
    assert err <= tol, f"{dtype}, {num_tokens} tokens: dense vs loop differ by {err}"


def test_stacked_weights_follow_dtype_moves_and_in_place_edits() -> None:
    moe = _make_moe(torch.float32)
    moe = moe.to(torch.bfloat16)
    assert moe._gate_up.dtype == torch.bfloat16 and moe._down.dtype == torch.bfloat16
    with torch.no_grad():
        moe.experts[3].up_proj.weight.fill_(0.5)
        moe.experts[5].down_proj.weight.zero_()
    inter = moe._gate_up.shape[1] // 2
    assert torch.all(moe._gate_up[3, inter:] == 0.5), "stacked gate_up missed an in-place edit"
    assert torch.all(moe._down[5] == 0), "stacked down missed an in-place edit"
