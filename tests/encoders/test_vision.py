"""The vision tower: SigLIP parity (transformers as the reference), the projector's merge order,
checkpoint layouts and their errors, random init, fingerprints and config validation."""

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from encoders.vision import (
    TOWER_FILE,
    VisionCheckpointError,
    VisionTower,
    init_tower,
    load_tower,
    merge_patches,
    save_tower,
    tower_fingerprint,
)
from encoders.vision_config import VisionConfig, demo_vision_config, read_vision_config

ATOL = 1e-5


def _make_config(**overrides: Any) -> VisionConfig:
    fields: dict[str, Any] = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        merge_size=2,
        out_hidden_size=24,
    )
    return VisionConfig(**{**fields, **overrides})


def _make_tower(cfg: VisionConfig, seed: int = 0) -> VisionTower:
    """A tower with every weight random and O(1) (norms and biases too), so each one matters."""
    tower = VisionTower(cfg).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in tower.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return tower


def _pixels(cfg: VisionConfig, n: int = 2, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, cfg.num_channels, cfg.image_size, cfg.image_size, generator=generator)


def _make_siglip(cfg: VisionConfig, seed: int = 0) -> Any:
    """transformers' SiglipVisionModel (with its pooling head) of cfg's geometry, random weights."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    hf_cfg = SiglipVisionConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        image_size=cfg.image_size,
        patch_size=cfg.patch_size,
        vision_use_head=True,
    )
    hf_cfg._attn_implementation = "eager"  # the reference is eager; ours is SDPA
    model = SiglipVisionModel(hf_cfg).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL) -> None:
    assert actual.shape == expected.shape, f"shape {list(actual.shape)} != {list(expected.shape)}"
    err = (actual - expected).abs().max().item()
    assert err <= atol, f"max abs error {err:.3g} > {atol}"


def _projector_state(tower: VisionTower) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tower.state_dict().items() if k.startswith("projector.")}


# --- SigLIP parity -------------------------------------------------------------------------


@pytest.mark.parametrize("image_size", [32, 36])  # 36: the conv drops 36 % 8 pixels, as SigLIP's
def test_transformer_matches_siglip_vision_model(image_size: int) -> None:
    cfg = _make_config(image_size=image_size)
    reference = _make_siglip(cfg)
    tower = VisionTower(cfg).eval()
    hf_state = {k: v for k, v in reference.state_dict().items() if not k.startswith("head.")}
    missing = tower.load_state_dict(
        {"vision_model." + k: v for k, v in hf_state.items()}, strict=False
    ).missing_keys
    assert all(k.startswith("projector.") for k in missing), missing  # names match SigLIP's
    pixels = _pixels(cfg)
    with torch.no_grad():
        expected = reference(pixel_values=pixels).last_hidden_state
        _assert_close(tower.encode_patches(pixels), expected)


@pytest.mark.parametrize("layout", ["hub", "transformers5"])
def test_loads_plain_siglip_checkpoint(tmp_path: Path, layout: str) -> None:
    """hub: SiglipModel-style `vision_model.*` keys next to text tensors, config in vision_config;
    transformers5: SiglipVisionModel.save_pretrained (unprefixed keys, top-level config)."""
    cfg = _make_config()
    reference = _make_siglip(cfg)
    if layout == "transformers5":
        reference.save_pretrained(tmp_path)
    else:
        tensors = {"vision_model." + k: v.contiguous() for k, v in reference.state_dict().items()}
        tensors["text_model.embeddings.token_embedding.weight"] = torch.zeros(7, 5)
        save_file(tensors, str(tmp_path / "model.safetensors"))
        vision = {**reference.config.to_dict(), "merge_size": cfg.merge_size}
        (tmp_path / "config.json").write_text(json.dumps({"vision_config": vision}))
    projector = _projector_state(_make_tower(cfg, seed=3))
    save_file(projector, str(tmp_path / "projector.safetensors"))

    tower = load_tower(tmp_path)
    assert tower is not None
    assert tower.cfg.out_hidden_size == cfg.out_hidden_size  # read off projector.fc2.weight
    pixels = _pixels(cfg)
    with torch.no_grad():
        _assert_close(
            tower.encode_patches(pixels), reference(pixel_values=pixels).last_hidden_state
        )
    _assert_close(tower.projector.fc1.weight, projector["projector.fc1.weight"], atol=0.0)


def test_plain_siglip_checkpoint_without_projector_names_it(tmp_path: Path) -> None:
    _make_siglip(_make_config()).save_pretrained(tmp_path)
    with pytest.raises(VisionCheckpointError, match=r"'projector\.fc2\.weight' is missing"):
        load_tower(tmp_path)


# --- projector -----------------------------------------------------------------------------


def _merge_by_loops(patches: torch.Tensor, m: int) -> torch.Tensor:
    """Token (R, C) = patches (R*m + a, C*m + b) for a, then b, concatenated; tokens row-major."""
    n, num_patches, _ = patches.shape
    side = int(num_patches**0.5)
    tokens = []
    for R in range(side // m):
        for C in range(side // m):
            block = [
                patches[:, (R * m + a) * side + (C * m + b)] for a in range(m) for b in range(m)
            ]
            tokens.append(torch.cat(block, dim=-1))
    return torch.stack(tokens, dim=1)


@pytest.mark.parametrize(("side", "m"), [(4, 2), (6, 3), (6, 2), (3, 1)])
def test_merge_patches_order(side: int, m: int) -> None:
    patches = torch.randn(2, side * side, 5)
    _assert_close(merge_patches(patches, m), _merge_by_loops(patches, m), atol=0.0)


def test_merge_patches_rejects_a_grid_merge_size_does_not_divide() -> None:
    with pytest.raises(ValueError, match="merge_size=2"):
        merge_patches(torch.zeros(1, 9, 4), 2)


def test_projector_is_merge_norm_fc1_gelu_fc2() -> None:
    cfg = _make_config()
    tower = _make_tower(cfg)
    pixels = _pixels(cfg)
    p = tower.projector
    with torch.no_grad():
        merged = _merge_by_loops(tower.encode_patches(pixels), cfg.merge_size)
        x = F.layer_norm(merged, merged.shape[-1:], p.norm.weight, p.norm.bias, cfg.layer_norm_eps)
        expected = F.linear(F.gelu(F.linear(x, p.fc1.weight, p.fc1.bias)), p.fc2.weight, p.fc2.bias)
        _assert_close(tower(pixels), expected)


# --- weights: init, save/load, errors, fingerprint -----------------------------------------


def test_save_load_round_trip(tmp_path: Path) -> None:
    cfg = _make_config()
    state = _make_tower(cfg, seed=5).state_dict()
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 16, "vocab_size": 9}))
    assert load_tower(tmp_path) is None  # an LLM config without vision_config
    path = save_tower(state, tmp_path, config=cfg)

    assert path == tmp_path / TOWER_FILE
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == 9  # kept
    tower = load_tower(tmp_path)
    assert tower is not None and tower.cfg == cfg
    reference = VisionTower(cfg).eval()
    reference.load_state_dict(state)
    pixels = _pixels(cfg)
    with torch.no_grad():
        _assert_close(tower(pixels), reference(pixels), atol=0.0)


def test_load_casts_to_dtype(tmp_path: Path) -> None:
    cfg = _make_config()
    save_tower(init_tower(cfg, seed=0), tmp_path, config=cfg)
    tower = load_tower(tmp_path, dtype=torch.bfloat16)
    assert tower is not None
    assert {p.dtype for p in tower.parameters()} == {torch.bfloat16}
    assert tower(_pixels(cfg)).dtype == torch.bfloat16


def _write_combined(tmp_path: Path, cfg: VisionConfig, state: dict[str, torch.Tensor]) -> None:
    save_tower(state, tmp_path, config=cfg)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    cfg = _make_config()
    state = init_tower(cfg)
    del state["vision_model.encoder.layers.1.mlp.fc2.bias"]
    _write_combined(tmp_path, cfg, state)
    with pytest.raises(VisionCheckpointError) as e:
        load_tower(tmp_path)
    assert "'vision_tower.vision_model.encoder.layers.1.mlp.fc2.bias' is missing" in str(e.value)
    assert "[32]" in str(e.value)  # the expected shape


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    cfg = _make_config()
    state = init_tower(cfg)
    state["projector.fc1.weight"] = torch.zeros(24, 64)
    _write_combined(tmp_path, cfg, state)
    with pytest.raises(VisionCheckpointError) as e:
        load_tower(tmp_path)
    message = str(e.value)
    assert "'vision_tower.projector.fc1.weight' has shape [24, 64]" in message, message
    assert "expects [24, 128]" in message, message


def test_extra_tower_tensor_is_an_error_but_siglip_head_is_ignored(tmp_path: Path) -> None:
    cfg = _make_config()
    state = init_tower(cfg)
    state["vision_model.head.probe"] = torch.zeros(1, 1, 32)
    _write_combined(tmp_path, cfg, state)
    assert load_tower(tmp_path) is not None
    state["vision_model.encoder.layers.2.mlp.fc1.bias"] = torch.zeros(48)
    _write_combined(tmp_path, cfg, state)
    with pytest.raises(VisionCheckpointError, match=r"layers\.2\.mlp\.fc1\.bias"):
        load_tower(tmp_path)


def test_init_tower_is_deterministic_and_seeded() -> None:
    cfg = _make_config()
    a, b, c = init_tower(cfg, seed=7), init_tower(cfg, seed=7), init_tower(cfg, seed=8)
    assert a.keys() == VisionTower(cfg).state_dict().keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["projector.fc1.weight"], c["projector.fc1.weight"])
    assert torch.equal(a["projector.norm.weight"], torch.ones(cfg.merged_hidden_size))
    assert torch.equal(a["vision_model.encoder.layers.0.self_attn.q_proj.bias"], torch.zeros(32))
    std = a["vision_model.encoder.layers.0.mlp.fc1.weight"].std().item()
    assert 0.015 < std < 0.025, std


def test_fingerprint_follows_weights_config_and_dtype() -> None:
    cfg = _make_config()
    state = init_tower(cfg)
    fp = tower_fingerprint(cfg, state)
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert tower_fingerprint(cfg, {k: v.clone() for k, v in state.items()}) == fp
    changed = {k: v.clone() for k, v in state.items()}
    changed["vision_model.encoder.layers.1.self_attn.v_proj.weight"][0, 0] += 1e-3
    assert tower_fingerprint(cfg, changed) != fp
    other_cfg = _make_config(image_mean=(0.4, 0.5, 0.5))
    assert tower_fingerprint(other_cfg, state) != fp
    # the same values in another dtype are another tower (its embeddings differ)
    exact = {k: v.bfloat16().float() for k, v in state.items()}
    as_bf16 = {k: v.bfloat16() for k, v in state.items()}
    assert tower_fingerprint(cfg, exact) != tower_fingerprint(cfg, as_bf16)


# --- config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("image_size", "patch_size", "merge_size", "tokens"),
    [(64, 8, 2, 16), (384, 14, 1, 729), (384, 14, 3, 81), (448, 14, 2, 256), (224, 16, 7, 4)],
)
def test_tokens_per_image(image_size: int, patch_size: int, merge_size: int, tokens: int) -> None:
    cfg = _make_config(image_size=image_size, patch_size=patch_size, merge_size=merge_size)
    assert cfg.tokens_per_image == tokens
    assert cfg.num_patches_per_side == image_size // patch_size


def test_demo_tower_shape_and_speed() -> None:
    cfg = demo_vision_config(out_hidden_size=48)
    assert (cfg.tokens_per_image, cfg.hidden_size, cfg.num_hidden_layers) == (16, 64, 2)
    tower = VisionTower(cfg).eval()
    tower.load_state_dict(init_tower(cfg))
    pixels = _pixels(cfg, n=1)
    best_s = float("inf")
    with torch.inference_mode():
        for _ in range(5):
            start = time.perf_counter()
            out = tower(pixels)
            best_s = min(best_s, time.perf_counter() - start)
    assert out.shape == (1, 16, 48)
    assert best_s < 0.05, f"one demo image took {best_s * 1e3:.1f} ms"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": 30}, "divisible by num_attention_heads=4"),
        ({"image_size": 7}, "image_size=7: must be >= patch_size=8"),
        ({"image_size": 24}, "3 patches per side: must be a multiple of merge_size=2"),
        ({"num_hidden_layers": 0}, "num_hidden_layers=0: must be a positive int"),
        ({"out_hidden_size": 2.5}, "out_hidden_size=2.5: must be a positive int"),
        ({"hidden_act": "relu"}, "hidden_act='relu': not supported"),
        ({"image_mean": (0.5, 0.5)}, "image_mean=.*num_channels=3"),
        ({"image_std": (0.5, 0.0, 0.5)}, "image_std=.*must be > 0"),
        ({"layer_norm_eps": 0.0}, "layer_norm_eps=0.0: must be > 0"),
    ],
)
def test_config_validation(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _make_config(**overrides)


def test_config_dict_round_trip_and_siglip_defaults(tmp_path: Path) -> None:
    cfg = _make_config(image_mean=(0.1, 0.2, 0.3))
    assert VisionConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    hub = {"model_type": "siglip_vision_model", "patch_size": 14, "out_hidden_size": 8, "x": 1}
    from_hub = VisionConfig.from_dict(hub)  # unknown keys ignored, SigLIP defaults filled in
    assert (from_hub.hidden_size, from_hub.image_size, from_hub.patch_size) == (768, 224, 14)
    with pytest.raises(ValueError, match="'out_hidden_size'"):
        VisionConfig.from_dict({"patch_size": 14})
    (tmp_path / "config.json").write_text(json.dumps(hub))
    assert read_vision_config(tmp_path) == hub
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_vision_config(tmp_path / "absent")
