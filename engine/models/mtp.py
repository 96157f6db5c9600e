"""MiMo-V2 multi-token prediction (MTP) layers: the checkpoint's ``model.mtp.layers.{i}.*``.

One MTP layer is one extra decoder block fed by two inputs (SGLang ``mimo_v2_nextn.py``,
``MiMoV2ModelNextN``): the token embedding of the *next* token and the hidden state that predicted
it, each RMS-normed (``enorm``, ``hnorm``), concatenated in that order and projected back to
``hidden`` by ``eh_proj`` [hidden, 2 * hidden]. The block is always sliding-window attention with
the SWA geometry (heads, head dims, sink, ``swa_rope_theta``, window W) and a dense SwiGLU MLP of
``intermediate_size``; ``final_layernorm`` follows. The embedding and the LM head are the base
model's (the checkpoint has none of its own under ``model.mtp``).

Index alignment for MTP layer k (0-based), one row per position p of the base sequence:

    row p inputs    hidden[p]           (k = 0: the base model's final, normed hidden state;
                                          k > 0: layer k-1's ``residual`` at row p)
                    embed(token[p+1+k])
    rope / KV pos   p                   (the hidden state's position, as SGLang's draft extend)
    row p output    hidden -> lm_head -> logits of token[p+2+k]

KV: MTP layer i is layer ``num_hidden_layers + i`` of ``mtp_model_config(cfg, n)``, so the paged
pools hold its KV beside the base model's SWA layers. The caller keeps the positions it feeds
each context consistent (the MTP sequence trails the base by 1 + k tokens; a ``ContiguousBatch``
therefore needs a ``SequenceKV`` of its own per MTP layer, whose token count is its row count).

Loading: ``engine.models.loader.load_model(..., mtp_layers=n)``; distillation from the base model
(the demo checkpoint's MTP layers): ``engine.models.mtp_distill``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
from torch import nn

from engine.layers.attention import KVContext
from engine.layers.norm import RMSNorm
from engine.layers.rotary import Rope, RotaryEmbedding
from engine.model_config import DENSE, SWA, ConfigError, ModelConfig
from engine.models.mimo_v2 import DecoderLayer

# NOTE: the hub/SGLang key first; the others are spellings other MTP models' configs use
MTP_CONFIG_KEYS = ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers")


class MTPOutput(NamedTuple):
    hidden: torch.Tensor  # [n, hidden] after final_layernorm: feed to the LM head
    residual: torch.Tensor  # [n, hidden] before it: the next MTP layer's ``hidden`` input


def mtp_config_of(cfg_dict: dict[str, Any]) -> int:
    """The number of MTP layers a raw config.json declares (0 when it declares none).

    Raises:
        ConfigError: the key holds something other than a non-negative integer.
    """
    for key in MTP_CONFIG_KEYS:
        value = cfg_dict.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"config {key!r}: must be a non-negative integer, got {value!r}")
        return value
    return 0


def mtp_model_config(cfg: ModelConfig, num_layers: int) -> ModelConfig:
    """``cfg`` with ``num_layers`` SWA + dense layers appended: the MTP layers' ids and shapes."""
    return dataclasses.replace(
        cfg,
        num_hidden_layers=cfg.num_hidden_layers + num_layers,
        layer_types=cfg.layer_types + (SWA,) * num_layers,
        mlp_layer_types=cfg.mlp_layer_types + (DENSE,) * num_layers,
    )


class MTPLayer(DecoderLayer):
    """One MTP step; parameter names are the hub's under ``model.mtp.layers.{i}``."""

    def __init__(self, cfg: ModelConfig, index: int, num_layers: int) -> None:
        super().__init__(mtp_model_config(cfg, num_layers), cfg.num_hidden_layers + index)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.final_layernorm = RMSNorm(h, eps)

    def forward(  # type: ignore[override]
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        rope: Rope,
        kv: KVContext,
    ) -> MTPOutput:
        """Args: embeds, hidden: [n, hidden] aligned as in the module docstring."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        x = super().forward(x, rope, kv)
        return MTPOutput(self.final_layernorm(x), x)


class MTPHead(nn.Module):
    """The checkpoint's MTP layers (``layers.{i}`` = hub ``model.mtp.layers.{i}``)."""

    def __init__(self, cfg: ModelConfig, num_layers: int) -> None:
        super().__init__()
        assert num_layers > 0, "an MTPHead needs at least one layer"
        self.config = cfg
        self.layers = nn.ModuleList(MTPLayer(cfg, i, num_layers) for i in range(num_layers))
        self.rotary = RotaryEmbedding(cfg.swa.rotary_dim, cfg.swa.rope_theta)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_id(self, index: int) -> int:
        """The KV layer id MTP layer ``index`` stores under."""
        return self.config.num_hidden_layers + index

    def forward(
        self,
        index: int,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv: KVContext,
    ) -> MTPOutput:
        """Run MTP layer ``index`` over aligned rows (see the module docstring).

        Args:
            embeds: [n, hidden], the base model's embeddings of token[p + 1 + index].
            hidden: [n, hidden], the base model's output (index 0) or ``residual`` of layer
                index - 1 at the same rows.
            positions: [n], p per row.
        """
        rope = self.rotary(positions, embeds.dtype)
        return self.layers[index](embeds, hidden, rope, kv)
