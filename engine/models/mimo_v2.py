"""The MiMo-V2 architecture (MiMo-V2-Flash / V2.5): hybrid full + sliding-window attention, MoE.

Parameter names follow the Hugging Face hub layout (per-expert weights), so a checkpoint's
tensors map one to one onto ``state_dict()``. Tokens of all requests in a batch are laid out back
to back ([num_tokens, hidden]); attention goes through the ``KVContext`` passed in.

Media (issue 13): ``forward(..., embeds=(rows, values))`` overwrites the listed rows of the token
embeddings with ``values`` (an image's vision-tower embeddings). Those rows hold placeholder ids
outside the vocabulary, so the ids are clamped into it first (the looked-up rows are discarded).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.layers.attention import Attention, KVContext
from engine.layers.mlp import MLP
from engine.layers.moe import MoE
from engine.layers.norm import RMSNorm
from engine.layers.rotary import Rope, RotaryEmbedding
from engine.model_config import FULL, SPARSE, SWA, ModelConfig

if TYPE_CHECKING:
    from engine.models.mtp import MTPHead


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.kind = cfg.layer_types[layer_id]
        self.self_attn = Attention(cfg, layer_id)
        self.mlp: nn.Module = _make_mlp(cfg, layer_id)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, rope: Rope, kv: KVContext
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class MiMoV2Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = nn.ModuleDict(
            {
                FULL: RotaryEmbedding(cfg.full.rotary_dim, cfg.full.rope_theta),
                SWA: RotaryEmbedding(cfg.swa.rotary_dim, cfg.swa.rope_theta),
            }
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVContext,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if embeds is None:
            x = self.embed_tokens(input_ids)
        else:
            x = self._embed_with(input_ids, *embeds)
        rope = {kind: emb(positions, x.dtype) for kind, emb in self.rotary.items()}
        for layer in self.layers:
            x = layer(x, rope[layer.kind], kv)
        return self.norm(x)

    def _embed_with(self, input_ids: torch.Tensor, rows: torch.Tensor,
                    values: torch.Tensor) -> torch.Tensor:
        """Token embeddings with ``rows`` replaced by ``values`` ([len(rows), hidden])."""
        ids = input_ids.clamp(max=self.embed_tokens.num_embeddings - 1)
        x = self.embed_tokens(ids)
        return x.index_copy_(0, rows, values.to(x.dtype))


class MiMoV2ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = MiMoV2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # NOTE: the loader sets it when MTP layers are requested (``load_model(mtp_layers=n)``)
        self.mtp: MTPHead | None = None
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share lm_head with the embeddings when the config says so (again after ``to_empty``)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVContext,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Returns the final hidden states, [num_tokens, hidden].

        Args:
            embeds: (rows, values): rows (long, [k], indices into the flat batch) whose input
                embedding is ``values`` ([k, hidden], cast to the model dtype) instead of their
                token's; ids outside the vocabulary are allowed in those rows only. None: every
                row is its token's embedding (decodes, text-only prefills).
        """
        return self.model(input_ids, positions, kv, embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32 (the matmul runs in the model dtype, like the ref)."""
        return self.lm_head(hidden).float()


def _make_mlp(cfg: ModelConfig, layer_id: int) -> nn.Module:
    if cfg.mlp_layer_types[layer_id] != SPARSE:
        return MLP(cfg.hidden_size, cfg.intermediate_size)
    return MoE(
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.n_routed_experts,
        top_k=cfg.num_experts_per_tok,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )
