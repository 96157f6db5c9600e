"""MoE: the small-batch paths (dense, fp32 folded) equal the per-expert loop; routing equals the
reference op sequence; stacked weights track the params."""

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
    assert moe._down_cat is None and moe._down.is_contiguous(), "bf16 keeps [E, H, I]"
    moe = moe.float()
    with torch.no_grad():
        moe.experts[2].down_proj.weight.fill_(0.25)
    hidden, inter = moe._down.shape[1:]
    assert torch.all(moe._down_cat.view(hidden, -1, inter)[:, 2] == 0.25), "the [H, E * I] view"
    assert torch.all(moe._down[2] == 0.25) and torch.all(moe._down[5] == 0)


@pytest.mark.parametrize("num_tokens", [1, 5, 16, 48])
def test_folded_fp32_path_equals_per_expert_loop(num_tokens: int) -> None:
    moe = _make_moe(torch.float32)
    x = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(num_tokens))
    weights, ids = route(x, moe.gate.weight, moe.gate.e_score_correction_bias, **moe._route_kwargs)
    folded = moe._forward_folded(x, weights, ids)
    loop = moe._forward_per_expert(x, weights, ids)
    err = (folded - loop).abs().max().item()
    assert err <= 1e-6, f"{num_tokens} tokens: folded vs loop differ by {err}"


def _reference_route(hidden, gate_weight, bias, *, top_k, n_group, topk_group, norm_topk_prob,
                     routed_scaling_factor):  # noqa: ANN001, ANN202
    """transformers' DeepSeek-V3 router op by op (the form ``route`` replaced)."""
    num_experts = gate_weight.shape[0]
    scores = torch.nn.functional.linear(hidden.float(), gate_weight.float()).sigmoid()
    choice = scores + bias
    group_scores = choice.view(-1, n_group, num_experts // n_group).topk(2, dim=-1)[0].sum(-1)
    group_ids = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1)
    mask = group_mask.unsqueeze(-1).expand(-1, n_group, num_experts // n_group)
    choice = choice.masked_fill(~mask.reshape(-1, num_experts).bool(), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


@pytest.mark.parametrize("topk_group", [1, 2, 4])
def test_route_equals_the_reference_router(topk_group: int) -> None:
    gen = torch.Generator().manual_seed(topk_group)
    gate, bias = torch.randn(16, 32, generator=gen), torch.randn(16, generator=gen) * 0.1
    x = torch.randn(40, 32, generator=gen)
    kwargs = dict(top_k=3, n_group=4, topk_group=topk_group, norm_topk_prob=True,
                  routed_scaling_factor=2.5)
    weights, ids = route(x, gate, bias, **kwargs)
    ref_weights, ref_ids = _reference_route(x, gate, bias, **kwargs)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)
