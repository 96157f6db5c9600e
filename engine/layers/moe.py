"""Mixture of experts: sigmoid router with a score-correction bias and group-limited top-k.

Routing, per token (DeepSeek-V3 "noaux_tc", no shared experts):

    scores   = sigmoid(h @ W_gate^T)                      (fp32)
    choice   = scores + e_score_correction_bias           (bias steers selection only)
    groups   = top topk_group of n_group groups, a group scored by the sum of its top-2 choices
    experts  = top num_experts_per_tok of choice inside the chosen groups
    weights  = scores[experts] (/ their sum if norm_topk_prob) * routed_scaling_factor

Expert weights live stacked ([E, 2I, H] gate+up, [E, H, I] down, as transformers fuses them); the
per-expert parameters (the checkpoint's names) are views into them. A few tokens (decode) run
every expert densely in three matmuls; more tokens (prefill) run each hit expert on its tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.mlp import MLP

# NOTE: below this many multiply-adds the dense path (every expert on every token) costs less than
# one Python iteration per hit expert (measured on CPU, fp32, one thread: the demo model's dense
# path wins up to ~48 tokens, so batched decode steps take it); a full-size MoE never reaches it.
_DENSE_MAX_MACS = 2**23


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
    if topk_group < n_group:  # NOTE: keeping every group masks nothing
        grouped = choice.view(-1, n_group, num_experts // n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        group_ids = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
        choice = grouped.masked_fill(~kept[..., None], float("-inf")).view(-1, num_experts)
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
        self.top_k = top_k
        self._route_kwargs = dict(
            top_k=top_k,
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=norm_topk_prob,
            routed_scaling_factor=routed_scaling_factor,
        )
        macs_per_token = num_experts * 3 * intermediate_size * hidden_size
        self._dense_max_tokens = _DENSE_MAX_MACS // macs_per_token
        self._stack_experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden] -> [num_tokens, hidden]."""
        weights, expert_ids = route(
            x, self.gate.weight, self.gate.e_score_correction_bias, **self._route_kwargs
        )
        if x.shape[0] > self._dense_max_tokens:
            return self._forward_per_expert(x, weights, expert_ids)
        if self._down_cat is not None:  # NOTE: fp32 weights (``_stack_experts``)
            return self._forward_folded(x, weights, expert_ids)
        return self._forward_dense(x, weights, expert_ids)

    def _forward_per_expert(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """Experts run one at a time over the tokens routed to them (the reference's loop)."""
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
            y = self._expert(expert_id, x[rows]) * flat_weights[start : start + count, None]
            out.index_add_(0, rows, y.to(out.dtype))
            start += count
        return out

    def _forward_dense(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """Every expert on every token in three matmuls, then each token keeps its top_k.

        Each kept output is the one the per-expert loop computes (same per-row matmuls; bitwise
        in bf16, to float rounding in fp32), weighted, rounded and summed in the same order.
        """
        num_tokens, hidden = x.shape
        num_experts, two_inter, _ = self._gate_up.shape
        gate_up = F.linear(x, self._gate_up.view(-1, hidden)).view(num_tokens, num_experts, -1)
        gate, up = gate_up.split(two_inter // 2, dim=-1)
        act = (F.silu(gate) * up).transpose(0, 1)  # [E, T, I]
        y = torch.bmm(act, self._down.transpose(1, 2))  # [E, T, H]
        expert_ids, order = expert_ids.sort(dim=1)  # ascending id: the loop's summation order
        tokens = torch.arange(num_tokens, device=x.device)[:, None]
        picked = y[expert_ids, tokens] * weights.gather(1, order)[..., None]  # [T, k, H]
        picked = picked.to(x.dtype)
        out = picked[:, 0]
        for j in range(1, self.top_k):
            out = out + picked[:, j]
        return out

    def _forward_folded(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """fp32: every expert on every token, each token's activations scaled by its routing
        weight (0 for the experts it does not keep), then one matmul over all experts' down
        projections side by side sums the kept ones.

        The fp32 sum runs inside the matmul instead of expert by expert, so results agree with
        the loop to float rounding, as ``_forward_dense``'s do; 11 ops instead of ~16 and no
        [E, T, H] intermediate. bf16 keeps the loop's rounding order (``_forward_dense``).
        """
        num_tokens, hidden = x.shape
        num_experts, two_inter, _ = self._gate_up.shape
        gate_up = F.linear(x, self._gate_up.view(-1, hidden)).view(num_tokens, num_experts, -1)
        gate, up = gate_up.split(two_inter // 2, dim=-1)
        kept = weights.new_zeros(num_tokens, num_experts).scatter_(1, expert_ids, weights)
        act = F.silu(gate) * up * kept[..., None]  # [T, E, I]
        assert self._down_cat is not None, "the folded path needs fp32 weights"
        return F.linear(act.view(num_tokens, -1), self._down_cat)

    def _expert(self, expert_id: int, x: torch.Tensor) -> torch.Tensor:
        """One expert's SwiGLU with the fused gate+up matmul, as the reference computes it."""
        gate, up = F.linear(x, self._gate_up[expert_id]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self._down[expert_id])

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> MoE:
        # NOTE: to(), to_empty(), float(), ... give every expert parameter new storage; stack them
        # again so the per-expert parameters stay views of the stacked weights.
        super()._apply(fn, recurse)
        self._stack_experts()
        return self

    @torch.no_grad()
    def _stack_experts(self) -> None:
        experts = list(self.experts)
        gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts])
        # NOTE: in fp32, down is stored [H, E, I]: expert e is the column block [:, e, :], so all
        # experts side by side are one [H, E * I] weight (``_forward_folded``); other dtypes keep
        # [E, H, I], whose contiguous experts bf16's batched matmul needs (2.4 x slower strided)
        downs = [e.down_proj.weight for e in experts]
        folded = downs[0].dtype == torch.float32
        down_cat = torch.stack(downs, dim=1) if folded else None
        down = down_cat.permute(1, 0, 2) if down_cat is not None else torch.stack(downs)
        inter = gate_up.shape[1] // 2
        for e, gu, d in zip(experts, gate_up, down):
            e.gate_proj.weight.data, e.up_proj.weight.data = gu[:inter], gu[inter:]
            e.down_proj.weight.data = d
        self._gate_up, self._down = gate_up, down  # [E, 2I, H], [E, H, I] (a view in fp32)
        self._down_cat = None if down_cat is None else down_cat.view(down_cat.shape[0], -1)
