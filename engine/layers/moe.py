"""Mixture of experts: sigmoid router with a score-correction bias and group-limited top-k.

Routing, per token (DeepSeek-V3 "noaux_tc", no shared experts):

    scores   = sigmoid(h @ W_gate^T)                      (fp32)
    choice   = scores + e_score_correction_bias           (bias steers selection only)
    groups   = top topk_group of n_group groups, a group scored by the sum of its top-2 choices
    experts  = top num_experts_per_tok of choice inside the chosen groups
    weights  = scores[experts] (/ their sum if norm_topk_prob) * routed_scaling_factor
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.mlp import MLP


class Routing(NamedTuple):
    weights: torch.Tensor  # [num_tokens, top_k] fp32
    expert_ids: torch.Tensor  # [num_tokens, top_k] int64


def route(
    hidden: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> Routing:
    """Pure routing function; see the module docstring."""
    num_experts = gate_weight.shape[0]
    scores = F.linear(hidden.float(), gate_weight.float()).sigmoid()
    choice = scores + correction_bias
    group_scores = choice.view(-1, n_group, num_experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_ids = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, n_group, num_experts // n_group)
    choice = choice.masked_fill(~expert_mask.reshape(-1, num_experts).bool(), float("-inf"))
    expert_ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, expert_ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(weights * routed_scaling_factor, expert_ids)


class Router(nn.Module):
    """Holds the gate in fp32, whatever the model dtype (the checkpoint stores it so)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))


class MoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        *,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ) -> None:
        super().__init__()
        self.gate = Router(hidden_size, num_experts)
        self.experts = nn.ModuleList(
            MLP(hidden_size, intermediate_size) for _ in range(num_experts)
        )
        self._route_kwargs = dict(
            top_k=top_k,
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=norm_topk_prob,
            routed_scaling_factor=routed_scaling_factor,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden]. Experts run one at a time over the tokens routed to them."""
        weights, expert_ids = route(
            x, self.gate.weight, self.gate.e_score_correction_bias, **self._route_kwargs
        )
        out = torch.zeros_like(x)
        # NOTE: experts are visited in ascending id order and each contribution is rounded to the
        # model dtype before it is summed, as the reference does; bf16 results depend on it.
        flat = expert_ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        token_ids = order // expert_ids.shape[1]
        flat_weights = weights.flatten()[order]
        start = 0
        for expert_id, count in enumerate(counts):
            if count == 0:
                continue
            rows = token_ids[start : start + count]
            y = self.experts[expert_id](x[rows]) * flat_weights[start : start + count, None]
            out.index_add_(0, rows, y.to(out.dtype))
            start += count
        return out
