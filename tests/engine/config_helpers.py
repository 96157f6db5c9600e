"""Shared by the ModelConfig tests: the keys of each config dialect, and field assertions."""

from __future__ import annotations

from typing import Any

# Keys only one dialect writes (mimo_config writes both); dropping one set leaves the other.
TRANSFORMERS_KEYS = ("layer_types", "mlp_layer_types", "sliding_window", "rope_parameters")
HUB_KEYS = (
    "hybrid_layer_pattern",
    "moe_layer_freq",
    "sliding_window_size",
    "swa_num_attention_heads",
    "swa_num_key_value_heads",
    "swa_head_dim",
    "swa_v_head_dim",
    "rope_theta",
    "swa_rope_theta",
    "partial_rotary_factor",
    "add_swa_attention_sink_bias",
    "add_full_attention_sink_bias",
)
DIALECTS = ("hub", "transformers", "both")


def make_dialect(raw: dict[str, Any], dialect: str) -> dict[str, Any]:
    """``raw`` (both dialects) with the other dialect's keys dropped."""
    drop = {"hub": TRANSFORMERS_KEYS, "transformers": HUB_KEYS, "both": ()}[dialect]
    missing = [k for k in drop if k not in raw]
    assert not missing, f"mimo_config no longer writes {missing}; update the key lists"
    return {k: v for k, v in raw.items() if k not in drop}


def assert_fields(cfg: Any, want: dict[str, Any], what: str) -> None:
    got = {k: getattr(cfg, k) for k in want}
    wrong = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert not wrong, f"{what}: fields differ as (got, want): {wrong}"

