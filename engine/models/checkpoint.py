"""Deterministic random MiMo-V2 checkpoints: the built-in demo model and the tiny test models.

``mimo_config`` builds a config dict that says the same thing in both dialects (transformers'
``layer_types``/``rope_parameters``/``sliding_window`` = W + 1 and the hub's
``hybrid_layer_pattern``/``moe_layer_freq``/``sliding_window_size`` = W), so the files load in this
engine, in ``transformers`` and in SGLang alike. ``write_random_checkpoint`` writes config.json and
safetensors in the hub layout (per-expert weights); the same arguments give the same bytes.
``write_official_checkpoint`` writes the same weights in the official XiaomiMiMo layout (fused qkv
in TP chunks, block fp8 with ``weight_scale_inv``; see ``engine.models.official``). A config with
``num_nextn_predict_layers`` = n > 0 gets n MTP layers (``model.mtp.layers.{i}.*``) in both.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.model_config import FUSED_QKV, ModelConfig
from engine.models import official
from engine.models.mimo_v2 import MiMoV2ForCausalLM
from engine.models.mtp import MTPHead, mtp_config_of

Tensors = dict[str, torch.Tensor]
_KEEP_FP32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


def mimo_config(
    *,
    layers: str = "FSSSSF",
    mlp: str | None = None,
    sliding_window: int = 32,
    vocab_size: int = 320,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 1,
    head_dim: int = 32,
    v_head_dim: int = 16,
    intermediate_size: int = 128,
    moe_intermediate_size: int = 32,
    n_routed_experts: int = 8,
    num_experts_per_tok: int = 2,
    n_group: int = 2,
    topk_group: int = 1,
    partial_rotary_factor: float = 0.5,
    rope_theta: float = 1_000_000.0,
    swa_rope_theta: float = 10_000.0,
    attention_value_scale: float = 0.707,
    routed_scaling_factor: float = 1.0,
    eos_token_id: list[int] | int | None = None,
    torch_dtype: str = "float32",
    **extra: Any,
) -> dict[str, Any]:
    """A MiMo-V2 config dict in both dialects.

    Args:
        layers: one letter per layer, ``F`` full attention or ``S`` sliding window.
        mlp: one letter per layer, ``D`` dense or ``M`` MoE; default dense first, MoE after.
        sliding_window: W, the previous tokens an SWA query sees.
    """
    n = len(layers)
    mlp = mlp or "D" + "M" * (n - 1)
    assert set(layers) <= {"F", "S"} and set(mlp) <= {"D", "M"} and len(mlp) == n
    rope = {"rope_type": "default", "partial_rotary_factor": partial_rotary_factor}
    cfg: dict[str, Any] = {
        "architectures": ["MiMoV2FlashForCausalLM"],
        "model_type": "mimo_v2_flash",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": n,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "v_head_dim": v_head_dim,
        "intermediate_size": intermediate_size,
        "moe_intermediate_size": moe_intermediate_size,
        "n_routed_experts": n_routed_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "n_group": n_group,
        "topk_group": topk_group,
        "norm_topk_prob": True,
        "routed_scaling_factor": routed_scaling_factor,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "attention_value_scale": attention_value_scale,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "max_position_embeddings": 8192,
        "torch_dtype": torch_dtype,
        # transformers dialect
        "layer_types": ["full_attention" if c == "F" else "sliding_attention" for c in layers],
        "mlp_layer_types": ["dense" if c == "D" else "sparse" for c in mlp],
        "sliding_window": sliding_window + 1,
        "rope_parameters": {
            "full_attention": {**rope, "rope_theta": rope_theta},
            "sliding_attention": {**rope, "rope_theta": swa_rope_theta},
        },
        # hub / SGLang dialect (transformers' SWA geometry: 2x KV heads, same dims, sinks)
        "hybrid_layer_pattern": [0 if c == "F" else 1 for c in layers],
        "moe_layer_freq": [0 if c == "D" else 1 for c in mlp],
        "sliding_window_size": sliding_window,
        "swa_num_attention_heads": num_attention_heads,
        "swa_num_key_value_heads": 2 * num_key_value_heads,
        "swa_head_dim": head_dim,
        "swa_v_head_dim": v_head_dim,
        "rope_theta": rope_theta,
        "swa_rope_theta": swa_rope_theta,
        "partial_rotary_factor": partial_rotary_factor,
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
    }
    if eos_token_id is not None:
        cfg["eos_token_id"] = eos_token_id
    cfg.update(extra)
    return cfg


# The built-in demo model: 8 layers, full attention first and last, W = 32, 8 experts in 2 groups.
DEMO_CONFIG = mimo_config(
    layers="FSSSSFSF",
    sliding_window=32,
    vocab_size=320,
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    v_head_dim=32,
    intermediate_size=256,
    moe_intermediate_size=64,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    eos_token_id=[258, 256],  # <|im_end|>, <|endoftext|> in the demo tokenizer
    num_nextn_predict_layers=3,  # as MiMo-V2-Flash; distilled at init (engine.models.mtp_distill)
)
DEMO_SEED = 20251215


def write_random_checkpoint(
    model_dir: str | Path,
    config: dict[str, Any],
    *,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_bytes: int | None = None,
) -> Path:
    """Write config.json and random weights (hub layout) to ``model_dir``; returns the directory.

    Weights are drawn in sorted name order from one seeded generator: linear weights
    ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1^2), sinks ~ N(0, 1), embeddings ~ N(0, 1).
    ``max_shard_bytes`` splits the tensors over several files with an index, as the hub does.
    """
    config = {**config, "torch_dtype": dtype}
    return _write(Path(model_dir), config, random_state(config, seed, dtype), max_shard_bytes)


def random_state(config: dict[str, Any], seed: int = 0, dtype: str = "float32") -> Tensors:
    """The weights ``write_random_checkpoint`` writes, by their hub names.

    The MTP layers' are drawn after the base model's, so the base weights do not depend on them.
    """
    cfg = ModelConfig.from_dict(config)
    num_mtp = mtp_config_of(config)
    with torch.device("meta"):
        params = sorted(MiMoV2ForCausalLM(cfg).named_parameters())
        if num_mtp:
            mtp = MTPHead(cfg, num_mtp).named_parameters(prefix="model.mtp")
            params += sorted(mtp)
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: _init(name, tuple(p.shape), gen, getattr(torch, dtype)) for name, p in params}
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    return tensors


def write_official_checkpoint(
    model_dir: str | Path,
    config: dict[str, Any],
    *,
    seed: int = 0,
    state: Tensors | None = None,
    qkv_tp_size: int = 1,
    block: tuple[int, int] = (128, 128),
    ignored_layers: tuple[str, ...] = (),
    dtype: str = "bfloat16",
    max_shard_bytes: int | None = None,
) -> Path:
    """Write ``state`` (default: ``random_state(config, seed)``) in the official layout.

    ``architectures: ["MiMoV2ForCausalLM"]``, ``attention_projection_layout: "fused_qkv"``
    (``qkv_tp_size`` chunks) and an fp8 ``quantization_config``: every 2-D ``*_proj.weight`` not in
    ``ignored_layers`` (module names) becomes e4m3 + ``weight_scale_inv`` (power-of-two scales, so
    dequantizing is exact); the other tensors are stored as ``dtype`` (router gate stays fp32).
    """
    cfg = ModelConfig.from_dict(config)
    state = dict(random_state(config, seed) if state is None else state)
    fused = _fuse_qkv(state, cfg, qkv_tp_size)
    tensors: Tensors = {}
    for name, t in sorted(state.items()):
        if name.endswith("_proj.weight") and name.rsplit(".", 1)[0] not in ignored_layers:
            chunks = qkv_tp_size if name in fused else 1
            tensors[name], tensors[name + official.SCALE_SUFFIX] = official.quantize_blocks(
                t, block, chunks
            )
        else:
            tensors[name] = t.float() if name.endswith(_KEEP_FP32) else t.to(getattr(torch, dtype))
    quant = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "ignored_layers": list(ignored_layers),
    }
    config = {
        **config,
        "architectures": ["MiMoV2ForCausalLM"],
        "model_type": "mimo_v2",
        "attention_projection_layout": FUSED_QKV,
        "quantization_config": quant,
        "torch_dtype": dtype,
    }
    return _write(Path(model_dir), config, tensors, max_shard_bytes)


def _fuse_qkv(state: Tensors, cfg: ModelConfig, tp: int) -> set[str]:
    """Replace each layer's q/k/v_proj in ``state`` by one qkv_proj; returns the fused names.

    MTP layers (SWA geometry) are fused as well."""
    layers = [(f"model.layers.{i}", cfg.geometry(i)) for i in range(cfg.num_hidden_layers)]
    mtp = sorted({int(n.split(".")[3]) for n in state if n.startswith("model.mtp.layers.")})
    layers += [(f"model.mtp.layers.{i}", cfg.swa) for i in mtp]
    fused = set()
    for layer, geo in layers:
        prefix = f"{layer}.self_attn"
        for kind in ("weight", "bias"):
            parts = [state.pop(f"{prefix}.{p}_proj.{kind}", None) for p in "qkv"]
            if all(p is not None for p in parts):
                name = f"{prefix}.qkv_proj.{kind}"
                state[name] = official.fuse_qkv(*parts, geo, tp)  # type: ignore[misc]
                fused.add(name)
    return fused


def _write(
    out: Path, config: dict[str, Any], tensors: Tensors, max_shard_bytes: int | None
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    _save(out, tensors, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def _init(
    name: str, shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype
) -> torch.Tensor:
    if name.endswith("norm.weight"):
        t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
    elif name.endswith(("attention_sink_bias", "embed_tokens.weight")):
        t = torch.randn(shape, generator=gen)
    elif name.endswith("e_score_correction_bias"):
        t = 0.1 * torch.randn(shape, generator=gen)
    elif name.endswith(".bias"):
        t = 0.02 * torch.randn(shape, generator=gen)
    else:
        t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    return t if name.endswith(_KEEP_FP32) else t.to(dtype)


def _save(out: Path, tensors: Tensors, max_shard_bytes: int | None) -> None:
    metadata = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(tensors, str(out / "model.safetensors"), metadata=metadata)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
