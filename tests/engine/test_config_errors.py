"""ModelConfig rejects what it cannot serve (unsupported or malformed values, bad config.json
files) with an error that names the offending key or path."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from engine.model_config import DENSE, FULL, SPARSE, SWA, ConfigError, ModelConfig
from engine.models.checkpoint import mimo_config

# --- rejected configs -----------------------------------------------------------------------------


_DROP = object()


@dataclass(frozen=True)
class Bad:
    id: str
    key: str  # the key the error message must name
    kwargs: dict[str, Any] = field(default_factory=dict)  # to mimo_config
    edits: dict[str, Any] = field(default_factory=dict)  # then applied; _DROP deletes the key


def _make_bad_config(bad: Bad) -> dict[str, Any]:
    raw = mimo_config(**bad.kwargs)
    for k, v in bad.edits.items():
        if v is _DROP:
            del raw[k]
        else:
            raw[k] = v
    return raw


_YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6, "partial_rotary_factor": 0.5}
_BAD = [
    Bad("gelu", "hidden_act", edits={"hidden_act": "gelu"}),
    Bad(
        "rope-parameters-yarn",
        "rope_type",
        edits={"rope_parameters": {FULL: _YARN, SWA: {**_YARN, "rope_type": "default"}}},
    ),
    Bad("rope-scaling-yarn", "rope_scaling", edits={"rope_scaling": {"type": "yarn"}}),
    Bad("quantized", "quantization_config", edits={"quantization_config": {"quant_method": "fp8"}}),
    Bad(
        "pattern-value-2",
        "hybrid_layer_pattern",
        edits={"layer_types": _DROP, "hybrid_layer_pattern": [0, 1, 2, 1, 1, 0]},
    ),
    Bad("layer-types-length", "layer_types", edits={"layer_types": [FULL, SWA, SWA]}),
    Bad(
        "pattern-length",
        "hybrid_layer_pattern",
        edits={"layer_types": _DROP, "hybrid_layer_pattern": [0, 1, 0]},
    ),
    Bad(
        "moe-freq-length",
        "moe_layer_freq",
        edits={"mlp_layer_types": _DROP, "moe_layer_freq": [0, 1]},
    ),
    Bad(
        "mlp-type-unknown",
        "mlp_layer_types",
        edits={"mlp_layer_types": [DENSE, SPARSE, "moe", SPARSE, SPARSE, SPARSE]},
    ),
    Bad("n-group-not-dividing", "n_group", kwargs=dict(n_routed_experts=8, n_group=3)),
    Bad("topk-group-over-n-group", "topk_group", kwargs=dict(n_group=2, topk_group=3)),
    # 2 groups of 4 experts, 1 group kept: at most 4 experts per token
    Bad(
        "too-many-experts-per-tok",
        "num_experts_per_tok",
        kwargs=dict(n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=5),
    ),
    Bad(
        "kv-heads-not-dividing",
        "num_key_value_heads",
        kwargs=dict(num_attention_heads=4),
        edits={"num_key_value_heads": 3},
    ),
    Bad("vocab-missing", "vocab_size", edits={"vocab_size": _DROP}),
    Bad("vocab-string", "vocab_size", edits={"vocab_size": "320"}),
    Bad("shared-experts", "n_shared_experts", edits={"n_shared_experts": 1}),
    Bad("softmax-router", "scoring_func", edits={"scoring_func": "softmax"}),
    Bad("llama", "model_type", edits={"model_type": "llama"}),
    Bad("rotary-factor-0", "partial_rotary_factor", kwargs=dict(partial_rotary_factor=0)),
    Bad(
        "hub-rotary-factor-0",
        "partial_rotary_factor",
        edits={"rope_parameters": _DROP, "partial_rotary_factor": 0},
    ),
    Bad(
        "swa-without-window",
        "sliding_window",
        edits={"sliding_window": _DROP, "sliding_window_size": _DROP},
    ),
]


@pytest.mark.parametrize("bad", _BAD, ids=[b.id for b in _BAD])
def test_unsupported_or_malformed_value_is_named(bad: Bad) -> None:
    raw = _make_bad_config(bad)
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict(raw)
    _assert_names_key(err, bad.key)


def test_flat_rope_parameters_yarn_is_rejected() -> None:
    raw = mimo_config()
    raw["rope_parameters"] = dict(_YARN)
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict(raw)
    _assert_names_key(err, "rope_type")


def test_config_json_not_json_is_config_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"vocab_size": 320,')
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dir(tmp_path)
    _assert_names_key(err, str(tmp_path / "config.json"))
    _assert_names_key(err, "not valid JSON")


def test_config_json_not_an_object_is_config_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps([mimo_config()]))
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dir(tmp_path)
    _assert_names_key(err, "JSON object")


def test_missing_config_json_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        ModelConfig.from_dir(tmp_path)
    _assert_names_key(err, str(tmp_path / "config.json"))


def _assert_names_key(err: pytest.ExceptionInfo[BaseException], key: str) -> None:
    assert key in str(err.value), f"error does not name {key!r}: {err.value}"
