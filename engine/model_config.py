"""Model configuration: one frozen view of a MiMo-V2 ``config.json``, whichever dialect wrote it.

Two dialects exist for the same architecture:

* the Hugging Face hub / SGLang dialect (``hybrid_layer_pattern``, ``moe_layer_freq``,
  ``sliding_window_size``, ``swa_num_key_value_heads``, ``swa_rope_theta``, ...);
* the ``transformers`` dialect (``layer_types``, ``mlp_layer_types``, ``rope_parameters``,
  ``sliding_window``), where SWA layers have twice the full layers' KV heads and always a sink.

The official XiaomiMiMo checkpoints (``architectures: ["MiMoV2ForCausalLM"]``) use the hub dialect
plus ``attention_projection_layout: "fused_qkv"`` and an fp8 ``quantization_config`` with
128 x 128 block scales; both are parsed here (``attention_projection_layout``, ``quantization``)
and undone by the loader (``engine.models.official``).

``ModelConfig.from_dict`` reads either into one normalized form and rejects what the engine does not
implement with a ``ConfigError`` naming the key.

NOTE (window semantics): ``sliding_window`` here is W, the number of *previous* tokens a query in an
SWA layer sees; the query at position p attends to keys in [p - W, p]. The hub's
``sliding_window_size`` is W; ``transformers`` stores W + 1 in ``sliding_window`` (its mask keeps
``kv_idx > q_idx - sliding_window``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FULL = "full_attention"
SPLIT_QKV = "split"
FUSED_QKV = "fused_qkv"
ARCHITECTURES = ("MiMoV2FlashForCausalLM", "MiMoV2ForCausalLM")
SWA = "sliding_attention"
DENSE = "dense"
SPARSE = "sparse"


class ConfigError(ValueError):
    """A config value is missing, malformed or not supported by this engine."""


@dataclass(frozen=True, slots=True)
class AttentionGeometry:
    """Shapes of one attention kind (full or SWA)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    rope_theta: float
    rotary_dim: int  # int(head_dim * partial_rotary_factor), as transformers computes it
    has_sink: bool

    @property
    def kv_bytes_per_token(self) -> int:
        """Elements (not bytes) of K plus V per token per layer; multiply by the dtype size."""
        return self.num_kv_heads * (self.head_dim + self.v_head_dim)


@dataclass(frozen=True, slots=True)
class Fp8BlockQuantization:
    """``quantization_config`` of a block-scaled fp8 (e4m3) checkpoint, dequantized on load.

    ``ignored_layers`` (module names, e.g. ``model.layers.0.self_attn.o_proj``) are stored
    unquantized; the loader goes by each tensor's dtype, so this list only matters to writers.
    """

    weight_block_size: tuple[int, int]
    ignored_layers: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    full: AttentionGeometry
    swa: AttentionGeometry
    sliding_window: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    attention_value_scale: float
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None = None
    attention_projection_layout: str = SPLIT_QKV
    quantization: Fp8BlockQuantization | None = None

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        _check(
            len(self.layer_types) == n,
            "layer_types",
            f"has {len(self.layer_types)} entries for num_hidden_layers={n}",
        )
        _check(
            len(self.mlp_layer_types) == n,
            "mlp_layer_types",
            f"has {len(self.mlp_layer_types)} entries for num_hidden_layers={n}",
        )
        _check(
            set(self.layer_types) <= {FULL, SWA},
            "layer_types",
            f"values must be {FULL!r} or {SWA!r}, got {sorted(set(self.layer_types))}",
        )
        _check(
            set(self.mlp_layer_types) <= {DENSE, SPARSE},
            "mlp_layer_types",
            f"values must be {DENSE!r} or {SPARSE!r}, got {sorted(set(self.mlp_layer_types))}",
        )
        _check(
            self.sliding_window >= 1, "sliding_window", f"must be >= 1, got {self.sliding_window}"
        )
        for name, geo in (("full", self.full), ("swa", self.swa)):
            _check(
                geo.num_heads % geo.num_kv_heads == 0,
                f"{name} num_key_value_heads",
                f"{geo.num_kv_heads} must divide num_attention_heads={geo.num_heads}",
            )
            _check(
                0 < geo.rotary_dim <= geo.head_dim,
                f"{name} partial_rotary_factor",
                f"gives rotary_dim={geo.rotary_dim} for head_dim={geo.head_dim}",
            )
        if SPARSE in self.mlp_layer_types:
            e, g = self.n_routed_experts, self.n_group
            _check(e > 0 and e % g == 0, "n_group", f"{g} must divide n_routed_experts={e}")
            _check(e // g >= 2, "n_group", f"needs >= 2 experts per group, got {e // g}")
            _check(1 <= self.topk_group <= g, "topk_group", f"{self.topk_group} not in [1, {g}]")
            _check(
                1 <= self.num_experts_per_tok <= self.topk_group * (e // g),
                "num_experts_per_tok",
                f"{self.num_experts_per_tok} exceeds the experts in "
                f"topk_group={self.topk_group} groups of {e // g}",
            )

    @property
    def swa_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SWA)

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    def geometry(self, layer_id: int) -> AttentionGeometry:
        return self.swa if self.layer_types[layer_id] == SWA else self.full

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json in the model directory")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Normalize a hub- or transformers-dialect config dict.

        Raises:
            ConfigError: a required key is missing or a value is not supported.
        """
        return _parse(_Reader(raw))


# --------------------------------------------------------------------------------------------
# parsing


class _Reader:
    """Typed access to a raw config dict with errors that name the key."""

    def __init__(self, raw: dict[str, Any]) -> None:
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        self.raw = raw

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def get(self, key: str, default: object) -> object:
        """The value, or ``default`` when the key is absent or null (hub configs write nulls)."""
        v = self.raw.get(key)
        return default if v is None else v

    def int(self, key: str, default: int | None = None) -> int:
        v = self.get(key, default)
        if v is None:
            raise ConfigError(f"config key {key!r} is required")
        _check(
            isinstance(v, int) and not isinstance(v, bool), key, f"must be an integer, got {v!r}"
        )
        return v

    def float(self, key: str, default: float | None = None) -> float:
        v = self.get(key, default)
        if v is None:
            raise ConfigError(f"config key {key!r} is required")
        _check(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
            key,
            f"must be a finite number, got {v!r}",
        )
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.get(key, default)
        _check(isinstance(v, bool), key, f"must be true or false, got {v!r}")
        return v

    def list(self, key: str) -> list[Any]:
        v = self.raw[key]
        _check(isinstance(v, list), key, f"must be a list, got {type(v).__name__}")
        return v


def _parse(r: _Reader) -> ModelConfig:
    _reject_unsupported(r)
    n = r.int("num_hidden_layers")
    layer_types = _layer_types(r, n)
    head_dim = r.int("head_dim")
    v_head_dim = r.int("v_head_dim", head_dim)
    num_heads = r.int("num_attention_heads")
    num_kv_heads = r.int("num_key_value_heads")
    hub = r.has("hybrid_layer_pattern") or r.has("swa_num_key_value_heads")
    # NOTE: transformers hard-codes SWA layers to 2x the KV heads, the same head dims and a sink;
    # the hub dialect spells each out.
    swa_head_dim = r.int("swa_head_dim", head_dim)
    full_theta, swa_theta, full_prf, swa_prf = _rope(r)
    full = AttentionGeometry(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        rope_theta=full_theta,
        rotary_dim=_rotary_dim(head_dim, full_prf, "partial_rotary_factor"),
        has_sink=r.bool("add_full_attention_sink_bias", False),
    )
    swa = AttentionGeometry(
        num_heads=r.int("swa_num_attention_heads", num_heads),
        num_kv_heads=r.int("swa_num_key_value_heads", num_kv_heads * 2),
        head_dim=swa_head_dim,
        v_head_dim=r.int("swa_v_head_dim", v_head_dim),
        rope_theta=swa_theta,
        rotary_dim=_rotary_dim(swa_head_dim, swa_prf, "swa partial_rotary_factor"),
        has_sink=r.bool("add_swa_attention_sink_bias", not hub),
    )
    eos = r.raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelConfig(
        vocab_size=r.int("vocab_size"),
        hidden_size=r.int("hidden_size"),
        num_hidden_layers=n,
        layer_types=layer_types,
        mlp_layer_types=_mlp_layer_types(r, n),
        full=full,
        swa=swa,
        sliding_window=_sliding_window(r, SWA in layer_types),
        intermediate_size=r.int("intermediate_size"),
        moe_intermediate_size=r.int("moe_intermediate_size", 0),
        n_routed_experts=r.int("n_routed_experts", 0),
        num_experts_per_tok=r.int("num_experts_per_tok", 0),
        n_group=r.int("n_group", 1),
        topk_group=r.int("topk_group", 1),
        norm_topk_prob=r.bool("norm_topk_prob", True),
        routed_scaling_factor=r.float("routed_scaling_factor", 1.0),
        rms_norm_eps=r.float("rms_norm_eps", r.raw.get("layernorm_epsilon", 1e-5)),
        # transformers' default when the key is absent; hub configs always set it
        attention_value_scale=r.float("attention_value_scale", 0.707),
        attention_bias=r.bool("attention_bias", False),
        tie_word_embeddings=r.bool("tie_word_embeddings", False),
        max_position_embeddings=r.int("max_position_embeddings", 131072),
        eos_token_ids=eos_ids,
        torch_dtype=r.raw.get("torch_dtype") or r.raw.get("dtype"),
        attention_projection_layout=_projection_layout(r),
        quantization=_quantization(r),
    )


def _reject_unsupported(r: _Reader) -> None:
    act = r.raw.get("hidden_act", "silu")
    _check(act == "silu", "hidden_act", f"{act!r} is not supported (only 'silu')")
    arch = r.raw.get("architectures")
    _check(
        arch is None or (isinstance(arch, list) and bool(set(arch) & set(ARCHITECTURES))),
        "architectures",
        f"{arch!r} names no MiMo-V2 causal LM (expected one of {list(ARCHITECTURES)})",
    )
    _check(
        r.raw.get("rope_scaling") in (None, {}),
        "rope_scaling",
        f"{r.raw.get('rope_scaling')!r} is not supported (only plain RoPE)",
    )
    scoring = r.raw.get("scoring_func", "sigmoid")
    _check(scoring == "sigmoid", "scoring_func", f"{scoring!r} is not supported (only 'sigmoid')")
    method = r.raw.get("topk_method", "noaux_tc")
    _check(method == "noaux_tc", "topk_method", f"{method!r} is not supported (only 'noaux_tc')")
    shared = r.raw.get("n_shared_experts") or 0
    _check(
        shared == 0,
        "n_shared_experts",
        f"{shared} shared experts are not supported (MiMo-V2 has 0)",
    )
    types = r.raw.get("model_type", "mimo_v2_flash")
    _check(
        types in ("mimo_v2_flash", "mimo_v2"),
        "model_type",
        f"{types!r} is not a MiMo-V2 model (expected 'mimo_v2_flash')",
    )


def _projection_layout(r: _Reader) -> str:
    layout = r.get("attention_projection_layout", SPLIT_QKV)
    _check(
        layout in (SPLIT_QKV, FUSED_QKV),
        "attention_projection_layout",
        f"{layout!r} is not supported (only {SPLIT_QKV!r} or {FUSED_QKV!r})",
    )
    return str(layout)


def _quantization(r: _Reader) -> Fp8BlockQuantization | None:
    """Only DeepSeek-style block fp8: e4m3 weights, ``weight_scale_inv`` per block, dynamic
    activations (we dequantize on load, so activation scales would be ignored: refuse static)."""
    q = r.raw.get("quantization_config")
    if q is None:
        return None
    key = "quantization_config"
    _check(isinstance(q, dict), key, f"must be an object, got {q!r}")
    method = q.get("quant_method")
    _check(method == "fp8", f"{key}.quant_method", f"{method!r} is not supported (only 'fp8')")
    fmt = q.get("fmt", "e4m3")
    _check(fmt == "e4m3", f"{key}.fmt", f"{fmt!r} is not supported (only 'e4m3')")
    act = q.get("activation_scheme", "dynamic")
    _check(
        act == "dynamic",
        f"{key}.activation_scheme",
        f"{act!r} is not supported (only 'dynamic')",
    )
    block = q.get("weight_block_size")
    _check(
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block),
        f"{key}.weight_block_size",
        f"must be two positive integers (per-tensor fp8 is not supported), got {block!r}",
    )
    ignored = q.get("ignored_layers") or q.get("modules_to_not_convert") or []
    _check(
        isinstance(ignored, list) and all(isinstance(m, str) for m in ignored),
        f"{key}.ignored_layers",
        f"must be a list of module names, got {ignored!r}",
    )
    return Fp8BlockQuantization(
        weight_block_size=(block[0], block[1]), ignored_layers=tuple(ignored)
    )


def _layer_types(r: _Reader, n: int) -> tuple[str, ...]:
    if r.has("layer_types"):
        return tuple(r.list("layer_types"))
    if r.has("hybrid_layer_pattern"):
        pattern = r.list("hybrid_layer_pattern")
        _check(
            len(pattern) == n,
            "hybrid_layer_pattern",
            f"has {len(pattern)} entries for num_hidden_layers={n}",
        )
        _check(
            all(p in (0, 1) for p in pattern),
            "hybrid_layer_pattern",
            f"values must be 0 (full) or 1 (sliding window), got {sorted(set(pattern))}",
        )
        return tuple(SWA if p == 1 else FULL for p in pattern)
    # transformers' default: full attention at layer 0 and every 6th layer
    return tuple(FULL if (i == 0 or (i + 1) % 6 == 0) else SWA for i in range(n))


def _mlp_layer_types(r: _Reader, n: int) -> tuple[str, ...]:
    if r.has("mlp_layer_types"):
        return tuple(r.list("mlp_layer_types"))
    freq = r.raw.get("moe_layer_freq")
    if isinstance(freq, list):
        _check(
            len(freq) == n, "moe_layer_freq", f"has {len(freq)} entries for num_hidden_layers={n}"
        )
        _check(
            all(f in (0, 1, True, False) for f in freq),
            "moe_layer_freq",
            f"values must be 0 or 1, got {sorted(set(freq))}",
        )
        return tuple(SPARSE if f else DENSE for f in freq)
    _check(freq is None, "moe_layer_freq", f"must be a list of 0/1 per layer, got {freq!r}")
    return (DENSE,) + (SPARSE,) * (n - 1)


def _sliding_window(r: _Reader, needed: bool) -> int:
    if r.has("sliding_window_size"):
        return r.int("sliding_window_size")
    if r.has("sliding_window"):
        return r.int("sliding_window") - 1  # transformers stores W + 1
    if needed:
        raise ConfigError(
            "config has sliding-window layers but neither 'sliding_window_size' "
            "nor 'sliding_window'"
        )
    return 1


def _rope(r: _Reader) -> tuple[float, float, float, float]:
    params = r.raw.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SWA in params):
        full = _rope_entry(params.get(FULL) or {}, f"rope_parameters.{FULL}")
        swa = _rope_entry(params.get(SWA) or {}, f"rope_parameters.{SWA}")
        return full[0], swa[0], full[1], swa[1]
    if params is not None:  # one flat entry for every layer kind
        _check(isinstance(params, dict), "rope_parameters", f"must be an object, got {params!r}")
        defaults = {
            "rope_theta": r.float("rope_theta", 10000.0),
            "partial_rotary_factor": r.float("partial_rotary_factor", 1.0),
        }
        theta, prf = _rope_entry({**defaults, **params}, "rope_parameters")
        return theta, r.float("swa_rope_theta", theta), prf, prf
    theta = r.float("rope_theta", 10000.0)
    prf = r.float("partial_rotary_factor", 1.0)
    return theta, r.float("swa_rope_theta", theta), prf, r.float("swa_partial_rotary_factor", prf)


def _rope_entry(p: dict[str, Any], key: str) -> tuple[float, float]:
    rope_type = p.get("rope_type", "default")
    _check(
        rope_type == "default",
        f"{key}.rope_type",
        f"{rope_type!r} is not supported (only 'default')",
    )
    theta = p.get("rope_theta")
    _check(
        isinstance(theta, (int, float)) and theta > 0,
        f"{key}.rope_theta",
        f"must be a positive number, got {theta!r}",
    )
    return float(theta), float(p.get("partial_rotary_factor", 0.334))


def _rotary_dim(head_dim: int, factor: float, key: str) -> int:
    _check(0 < factor <= 1, key, f"must be in (0, 1], got {factor}")
    # NOTE: transformers builds ceil(dim / 2) frequencies over this dim and rotates twice that
    # many leading dims (one more than dim when dim is odd).
    dim = int(head_dim * factor)
    _check(2 * ((dim + 1) // 2) <= head_dim, key, f"rotates more dims than head_dim={head_dim}")
    return dim


def _check(ok: bool, key: str, what: str) -> None:
    if not ok:
        raise ConfigError(f"config {key!r}: {what}")
