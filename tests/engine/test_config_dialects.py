"""ModelConfig parsing: both config dialects say the same thing, window semantics, the
MiMo-V2-Flash hub config's geometry, and config.json through ``from_dir``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.model_config import DENSE, FULL, SPARSE, SWA, ModelConfig
from engine.models.checkpoint import mimo_config
from tests.engine.config_helpers import DIALECTS, assert_fields, make_dialect

# --- builders -------------------------------------------------------------------------------------


def _make_flash_hub_config(**overrides: Any) -> dict[str, Any]:
    """XiaomiMiMo/MiMo-V2-Flash's hub config.json, less its fp8 quantization_config."""
    n = 48
    cfg: dict[str, Any] = {
        "architectures": ["MiMoV2FlashForCausalLM"],
        "model_type": "mimo_v2_flash",
        "vocab_size": 152576,
        "hidden_size": 4096,
        "num_hidden_layers": n,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 192,
        "v_head_dim": 128,
        "swa_num_attention_heads": 64,
        "swa_num_key_value_heads": 8,
        "swa_head_dim": 192,
        "swa_v_head_dim": 128,
        "partial_rotary_factor": 0.334,
        "rope_theta": 5000000,
        "swa_rope_theta": 10000,
        "sliding_window": 128,  # the hub file carries both; sliding_window_size is the one meant
        "sliding_window_size": 128,
        "hybrid_layer_pattern": [0 if i == 0 or (i + 1) % 6 == 0 else 1 for i in range(n)],
        "moe_layer_freq": [0 if i == 0 else 1 for i in range(n)],
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "intermediate_size": 16384,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "n_shared_experts": None,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "layernorm_epsilon": 1e-5,
        "attention_value_scale": 0.707,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    cfg.update(overrides)
    return cfg


# --- both dialects say the same thing -------------------------------------------------------------

# Every value is given explicitly, so the expectations below derive from this table alone.
_MODELS = {
    "default-shape": dict(
        layers="FSSSSF",
        mlp="DMMMMM",
        sliding_window=32,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        v_head_dim=16,
        partial_rotary_factor=0.5,
        rope_theta=1_000_000.0,
        swa_rope_theta=10_000.0,
    ),
    "mixed-mlp-odd-rotary": dict(
        layers="FSSFSSF",
        mlp="DMDMMDM",
        sliding_window=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=48,
        v_head_dim=16,
        partial_rotary_factor=0.334,
        rope_theta=5_000_000.0,
        swa_rope_theta=20_000.0,
    ),
    "all-swa-dense": dict(
        layers="SS",
        mlp="DD",
        sliding_window=7,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        v_head_dim=16,
        partial_rotary_factor=1.0,
        rope_theta=10_000.0,
        swa_rope_theta=500.0,
    ),
}


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("model", sorted(_MODELS))
def test_dialect_parses_to_the_model_described(model: str, dialect: str) -> None:
    kw = _MODELS[model]
    cfg = ModelConfig.from_dict(make_dialect(mimo_config(**kw), dialect))
    rotary = int(kw["head_dim"] * kw["partial_rotary_factor"])
    common = dict(
        num_heads=kw["num_attention_heads"],
        head_dim=kw["head_dim"],
        v_head_dim=kw["v_head_dim"],
        rotary_dim=rotary,
    )
    assert_fields(
        cfg,
        {
            "layer_types": tuple(FULL if c == "F" else SWA for c in kw["layers"]),
            "mlp_layer_types": tuple(DENSE if c == "D" else SPARSE for c in kw["mlp"]),
            "sliding_window": kw["sliding_window"],
        },
        f"{model} ({dialect})",
    )
    # transformers' dialect implies SWA kv heads = 2x, a sink on SWA layers and none on full ones
    assert_fields(
        cfg.full,
        {
            **common,
            "num_kv_heads": kw["num_key_value_heads"],
            "rope_theta": kw["rope_theta"],
            "has_sink": False,
        },
        f"{model} ({dialect}) full",
    )
    assert_fields(
        cfg.swa,
        {
            **common,
            "num_kv_heads": 2 * kw["num_key_value_heads"],
            "rope_theta": kw["swa_rope_theta"],
            "has_sink": True,
        },
        f"{model} ({dialect}) swa",
    )


@pytest.mark.parametrize("model", sorted(_MODELS))
def test_dialects_parse_to_equal_configs(model: str) -> None:
    raw = mimo_config(**_MODELS[model])
    parsed = {d: ModelConfig.from_dict(make_dialect(raw, d)) for d in DIALECTS}
    for dialect in ("hub", "transformers"):
        assert parsed[dialect] == parsed["both"], (
            f"{model}: {dialect}-only config parses to {parsed[dialect]}, "
            f"both dialects to {parsed['both']}"
        )


# --- window semantics -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "want"),
    [
        ({"sliding_window_size": 128}, 128),
        ({"sliding_window": 129}, 128),  # transformers stores W + 1
        ({"sliding_window_size": 128, "sliding_window": 129}, 128),
        ({"sliding_window_size": 128, "sliding_window": 128}, 128),  # the hub file's pair
        ({"sliding_window_size": 64, "sliding_window": 200}, 64),
    ],
    ids=["hub-size", "transformers-w+1", "both-agree", "hub-file-pair", "size-wins"],
)
def test_sliding_window_is_w_previous_tokens(keys: dict[str, int], want: int) -> None:
    raw = {
        k: v for k, v in mimo_config().items() if k not in ("sliding_window", "sliding_window_size")
    }
    cfg = ModelConfig.from_dict({**raw, **keys})
    assert cfg.sliding_window == want, f"{keys} -> W={cfg.sliding_window}, want {want}"


# --- hub-only SWA geometry ------------------------------------------------------------------------


def test_flash_hub_config_geometry() -> None:
    cfg = ModelConfig.from_dict(_make_flash_hub_config())
    full_layers = (0, 5, 11, 17, 23, 29, 35, 41, 47)
    assert_fields(
        cfg,
        {
            "sliding_window": 128,
            "full_layer_ids": full_layers,
            "swa_layer_ids": tuple(i for i in range(48) if i not in full_layers),
            "mlp_layer_types": (DENSE,) + (SPARSE,) * 47,
            "n_routed_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 2048,
            "rms_norm_eps": 1e-5,
            "torch_dtype": "bfloat16",
        },
        "MiMo-V2-Flash",
    )
    common = dict(num_heads=64, head_dim=192, v_head_dim=128, rotary_dim=64)
    assert_fields(
        cfg.full,
        {**common, "num_kv_heads": 4, "rope_theta": 5e6, "has_sink": False},
        "MiMo-V2-Flash full",
    )
    assert_fields(
        cfg.swa,
        {**common, "num_kv_heads": 8, "rope_theta": 1e4, "has_sink": True},
        "MiMo-V2-Flash swa",
    )
    kv = (cfg.full.kv_bytes_per_token, cfg.swa.kv_bytes_per_token)
    assert kv == (4 * 320, 8 * 320), f"K+V elements per token (full, swa) = {kv}"


def test_flash_hub_null_routed_scaling_factor_means_one() -> None:
    cfg = ModelConfig.from_dict(_make_flash_hub_config(routed_scaling_factor=None))
    assert cfg.routed_scaling_factor == 1.0, f"got {cfg.routed_scaling_factor}"


# --- config.json ---------------------------------------------------------------------------------


def test_config_json_round_trips_through_from_dir(tmp_path: Path) -> None:
    raw = mimo_config(layers="FSF", mlp="DMD", sliding_window=9, eos_token_id=[3, 4])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    from_dir, from_dict = ModelConfig.from_dir(tmp_path), ModelConfig.from_dict(raw)
    assert from_dir == from_dict, f"from_dir {from_dir} != from_dict {from_dict}"
    assert from_dir.eos_token_ids == (3, 4), f"eos_token_ids {from_dir.eos_token_ids}"
