"""ModelConfig: both config dialects, window semantics, hub-only SWA geometry, rejected values."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.llm import LLM
from engine.model_config import DENSE, FULL, SPARSE, SWA, ConfigError, ModelConfig
from engine.models.checkpoint import mimo_config, write_random_checkpoint
from engine.models.loader import load_model
from engine.sampling_params import SamplingParams

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
_DIALECTS = ("hub", "transformers", "both")


# --- builders and helpers -------------------------------------------------------------------------


def _make_dialect(raw: dict[str, Any], dialect: str) -> dict[str, Any]:
    """``raw`` (both dialects) with the other dialect's keys dropped."""
    drop = {"hub": TRANSFORMERS_KEYS, "transformers": HUB_KEYS, "both": ()}[dialect]
    missing = [k for k in drop if k not in raw]
    assert not missing, f"mimo_config no longer writes {missing}; update the key lists"
    return {k: v for k, v in raw.items() if k not in drop}


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


def _assert_fields(cfg: Any, want: dict[str, Any], what: str) -> None:
    got = {k: getattr(cfg, k) for k in want}
    wrong = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert not wrong, f"{what}: fields differ as (got, want): {wrong}"


def _assert_names_key(err: pytest.ExceptionInfo[BaseException], key: str) -> None:
    assert key in str(err.value), f"error does not name {key!r}: {err.value}"


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


@pytest.mark.parametrize("dialect", _DIALECTS)
@pytest.mark.parametrize("model", sorted(_MODELS))
def test_dialect_parses_to_the_model_described(model: str, dialect: str) -> None:
    kw = _MODELS[model]
    cfg = ModelConfig.from_dict(_make_dialect(mimo_config(**kw), dialect))
    rotary = int(kw["head_dim"] * kw["partial_rotary_factor"])
    common = dict(
        num_heads=kw["num_attention_heads"],
        head_dim=kw["head_dim"],
        v_head_dim=kw["v_head_dim"],
        rotary_dim=rotary,
    )
    _assert_fields(
        cfg,
        {
            "layer_types": tuple(FULL if c == "F" else SWA for c in kw["layers"]),
            "mlp_layer_types": tuple(DENSE if c == "D" else SPARSE for c in kw["mlp"]),
            "sliding_window": kw["sliding_window"],
        },
        f"{model} ({dialect})",
    )
    # transformers' dialect implies SWA kv heads = 2x, a sink on SWA layers and none on full ones
    _assert_fields(
        cfg.full,
        {
            **common,
            "num_kv_heads": kw["num_key_value_heads"],
            "rope_theta": kw["rope_theta"],
            "has_sink": False,
        },
        f"{model} ({dialect}) full",
    )
    _assert_fields(
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
    parsed = {d: ModelConfig.from_dict(_make_dialect(raw, d)) for d in _DIALECTS}
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
    _assert_fields(
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
    _assert_fields(
        cfg.full,
        {**common, "num_kv_heads": 4, "rope_theta": 5e6, "has_sink": False},
        "MiMo-V2-Flash full",
    )
    _assert_fields(
        cfg.swa,
        {**common, "num_kv_heads": 8, "rope_theta": 1e4, "has_sink": True},
        "MiMo-V2-Flash swa",
    )
    kv = (cfg.full.kv_bytes_per_token, cfg.swa.kv_bytes_per_token)
    assert kv == (4 * 320, 8 * 320), f"K+V elements per token (full, swa) = {kv}"


def test_flash_hub_null_routed_scaling_factor_means_one() -> None:
    cfg = ModelConfig.from_dict(_make_flash_hub_config(routed_scaling_factor=None))
    assert cfg.routed_scaling_factor == 1.0, f"got {cfg.routed_scaling_factor}"


# A scaled-down hub-only config whose SWA layers differ from transformers' fixed geometry:
# 3 SWA kv heads (not 2 x 2), SWA head dims 24/8 (not 32/16), a sink on SWA layers only.
_HUB_GEOMETRY = dict(
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=32,
    v_head_dim=16,
    swa_num_key_value_heads=3,
    swa_head_dim=24,
    swa_v_head_dim=8,
    partial_rotary_factor=0.5,
)
_HUB_WINDOW = 4


def _make_hub_geometry_config() -> dict[str, Any]:
    raw = mimo_config(layers="FSSF", sliding_window=_HUB_WINDOW, eos_token_id=[7])
    raw = _make_dialect(raw, "hub")
    raw.update(_HUB_GEOMETRY)
    raw["swa_num_attention_heads"] = _HUB_GEOMETRY["num_attention_heads"]
    return raw


@pytest.fixture(scope="module")
def hub_geometry_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    model_dir = tmp_path_factory.mktemp("hub-geometry")
    write_random_checkpoint(model_dir, _make_hub_geometry_config(), seed=5)
    return LLM(model_dir, dtype="float32", device="cpu")


def test_hub_distinct_swa_geometry_is_honoured() -> None:
    cfg = ModelConfig.from_dict(_make_hub_geometry_config())
    g = _HUB_GEOMETRY
    _assert_fields(
        cfg.full,
        {"num_heads": 6, "num_kv_heads": 2, "head_dim": 32, "v_head_dim": 16, "rotary_dim": 16},
        "hub full",
    )
    _assert_fields(
        cfg.swa,
        {
            "num_heads": 6,
            "num_kv_heads": g["swa_num_key_value_heads"],
            "head_dim": g["swa_head_dim"],
            "v_head_dim": g["swa_v_head_dim"],
            "rotary_dim": 12,
            "has_sink": True,
        },
        "hub swa",
    )


def test_hub_distinct_swa_geometry_builds_matching_weights(hub_geometry_llm: LLM) -> None:
    hidden = 64
    want_by_kind = {
        FULL: {
            "q_proj": (6 * 32, hidden),
            "k_proj": (2 * 32, hidden),
            "v_proj": (2 * 16, hidden),
            "o_proj": (hidden, 6 * 16),
        },
        SWA: {
            "q_proj": (6 * 24, hidden),
            "k_proj": (3 * 24, hidden),
            "v_proj": (3 * 8, hidden),
            "o_proj": (hidden, 6 * 8),
            "attention_sink_bias": (6,),
        },
    }
    layers = hub_geometry_llm.model.model.layers
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        got = {n.removesuffix(".weight"): tuple(p.shape) for n, p in attn.named_parameters()}
        want = want_by_kind[layer.kind]
        assert got == want, f"layer {i} ({layer.kind}) attention shapes {got}, want {want}"


def test_hub_distinct_swa_geometry_forward(hub_geometry_llm: LLM) -> None:
    prompt = [(7 * i + 3) % 320 for i in range(3 * _HUB_WINDOW + 2)]
    logits = hub_geometry_llm.prompt_logits(prompt)
    assert logits.shape == (len(prompt), 320), f"logits shape {tuple(logits.shape)}"
    assert logits.dtype == torch.float32, f"logits dtype {logits.dtype}"
    assert torch.isfinite(logits).all(), "non-finite logits"
    assert logits.std().item() > 0.1, f"degenerate logits (std {logits.std().item():.3g})"
    # causal: a prefix run on its own gives the same logits as inside the longer prompt
    short = hub_geometry_llm.prompt_logits(prompt[: _HUB_WINDOW + 1])
    err = (short - logits[: _HUB_WINDOW + 1]).abs().max().item()
    assert err < 1e-5, f"prefix logits differ from the full prompt's by {err:.3g}"


def test_hub_distinct_swa_geometry_generate(hub_geometry_llm: LLM) -> None:
    """Greedy decoding through the KV cache agrees with full forwards, across the window."""
    llm = hub_geometry_llm
    prompts = [[11, 12, 13], [5] * (_HUB_WINDOW + 2)]
    n_new = 2 * _HUB_WINDOW
    outs = llm.generate(
        prompts, SamplingParams(max_new_tokens=n_new, temperature=0.0, ignore_eos=True)
    )
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == tuple(prompt), f"prompt echoed as {out.prompt_token_ids}"
        assert len(out.token_ids) == n_new and out.finish_reason == "length", (
            f"{len(out.token_ids)} tokens, finish {out.finish_reason!r}; want {n_new}, 'length'"
        )
        full = llm.prompt_logits(prompt + list(out.token_ids[:-1]))
        want = full[len(prompt) - 1 :].argmax(dim=-1).tolist()
        assert list(out.token_ids) == want, (
            f"cached greedy tokens {list(out.token_ids)} vs uncached argmax {want}"
        )


def test_hub_distinct_swa_geometry_loads_with_load_model(hub_geometry_llm: LLM) -> None:
    model = load_model(hub_geometry_llm.model_dir, dtype="float32")
    ours = dict(model.state_dict())
    theirs = dict(hub_geometry_llm.model.state_dict())
    assert ours.keys() == theirs.keys(), f"state_dict keys differ: {ours.keys() ^ theirs.keys()}"
    differ = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not differ, f"load_model and LLM load different weights for {differ}"


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


def test_config_json_round_trips_through_from_dir(tmp_path: Path) -> None:
    raw = mimo_config(layers="FSF", mlp="DMD", sliding_window=9, eos_token_id=[3, 4])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    from_dir, from_dict = ModelConfig.from_dir(tmp_path), ModelConfig.from_dict(raw)
    assert from_dir == from_dict, f"from_dir {from_dir} != from_dict {from_dict}"
    assert from_dir.eos_token_ids == (3, 4), f"eos_token_ids {from_dir.eos_token_ids}"
