"""The vision tower's geometry: SigLIP's vision fields plus our patch-merging projector.

The SigLIP fields keep SigLIP's names (transformers' ``SiglipVisionConfig``), so a SigLIP
``vision_config`` dict reads as it is; the projector adds ``merge_size``, ``out_hidden_size`` and
the preprocessing constants ``image_mean`` / ``image_std``. This module must not import torch:
the gateway needs ``tokens_per_image`` to count an image's prompt tokens.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# NOTE: transformers' SiglipVisionConfig defaults (google/siglip-base-patch16-224). Hub configs
# leave out the fields that equal them, so `from_dict` must fill them in the same way.
SIGLIP_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": 224,
    "patch_size": 16,
}
# hidden_act names (transformers' ACT2FN) -> torch.nn.functional.gelu's `approximate`
HIDDEN_ACTS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


@dataclass(frozen=True, slots=True, kw_only=True)
class VisionConfig:
    """A SigLIP vision transformer followed by a merge-and-project head.

    Attributes:
        hidden_size .. hidden_act: SigLIP's vision fields, with SigLIP's meaning.
        merge_size: each ``merge_size x merge_size`` block of neighbouring patches becomes one
            token (its patches' features concatenated).
        out_hidden_size: the LLM's hidden size, the width of each image token.
        image_mean, image_std: per-channel normalization of pixels in [0, 1] that the
            preprocessing applies before the tower: ``(x - mean) / std``.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    out_hidden_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    merge_size: int = 2
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "image_size",
            "patch_size",
            "out_hidden_size",
            "num_channels",
            "merge_size",
        ):
            value = getattr(self, name)
            _check(
                isinstance(value, int) and not isinstance(value, bool) and value > 0,
                f"{name}={value!r}: must be a positive int",
            )
        h, heads = self.hidden_size, self.num_attention_heads
        _check(h % heads == 0, f"hidden_size={h}: must be divisible by num_attention_heads={heads}")
        # NOTE: not a multiple: SigLIP-so400m is 384 // 14 = 27 patches per side; its valid
        # Conv2d drops the last 384 % 14 pixels, as ours does
        _check(
            self.image_size >= self.patch_size,
            f"image_size={self.image_size}: must be >= patch_size={self.patch_size}",
        )
        side = self.num_patches_per_side
        _check(
            side % self.merge_size == 0,
            f"image_size // patch_size = {side} patches per side: must be a multiple of "
            f"merge_size={self.merge_size}",
        )
        _check(self.layer_norm_eps > 0, f"layer_norm_eps={self.layer_norm_eps}: must be > 0")
        _check(
            self.hidden_act in HIDDEN_ACTS,
            f"hidden_act={self.hidden_act!r}: not supported; use one of {sorted(HIDDEN_ACTS)}",
        )
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            _check(
                isinstance(value, tuple) and len(value) == self.num_channels,
                f"{name}={value!r}: must be a tuple of num_channels={self.num_channels} floats",
            )
        _check(all(s > 0 for s in self.image_std), f"image_std={self.image_std}: must be > 0")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.num_patches_per_side**2

    @property
    def tokens_per_image(self) -> int:
        """Image tokens the LLM sees per image: ``(image_size // patch_size // merge_size)**2``."""
        return (self.num_patches_per_side // self.merge_size) ** 2

    @property
    def merged_hidden_size(self) -> int:
        """Width of one merged token before the projector: ``merge_size**2 * hidden_size``."""
        return self.merge_size**2 * self.hidden_size

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VisionConfig:
        """From a config.json ``vision_config`` dict; unknown keys are ignored.

        SigLIP fields that are absent take transformers' ``SiglipVisionConfig`` defaults (as a
        hub config relies on); ``out_hidden_size`` has no default.

        Raises:
            ValueError: ``out_hidden_size`` is absent, or a value is invalid.
        """
        if not isinstance(d, dict):
            raise ValueError(f"vision_config must be a JSON object, got {type(d).__name__}")
        if "out_hidden_size" not in d:
            raise ValueError("vision_config: 'out_hidden_size' (the LLM's hidden size) is required")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {**SIGLIP_VISION_DEFAULTS, **{k: v for k, v in d.items() if k in names}}
        for name in ("image_mean", "image_std"):
            if isinstance(kwargs.get(name), list):
                kwargs[name] = tuple(kwargs[name])
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (tuples as lists); ``from_dict(to_dict())`` is an identity."""
        d = dataclasses.asdict(self)
        d["image_mean"], d["image_std"] = list(self.image_mean), list(self.image_std)
        return d


def demo_vision_config(out_hidden_size: int) -> VisionConfig:
    """The demo model's tiny tower: 64x64 images, 8x8 patches, 2x2 merge -> 16 tokens per image."""
    return VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=64,
        patch_size=8,
        merge_size=2,
        out_hidden_size=out_hidden_size,
    )


def read_vision_config(model_dir: str | Path) -> dict[str, Any] | None:
    """The raw vision config of a model dir, or None when it has none: config.json's
    ``vision_config``, or config.json itself when it is a SigLIP vision config
    (``model_type: siglip_vision_model``). ``VisionConfig.from_dict`` validates it.

    Raises:
        FileNotFoundError: no config.json.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json in the model directory")
    doc = json.loads(path.read_text())
    if "vision_config" in doc:
        vision: dict[str, Any] = doc["vision_config"]
        return vision
    if doc.get("model_type") == "siglip_vision_model":
        return dict(doc)
    return None


def _check(ok: bool, message: str) -> None:
    # NOTE: ValueError rather than assert: configs come from users' files, and `python -O`
    # must not turn a bad one into a shape error deep inside the tower
    if not ok:
        raise ValueError(f"VisionConfig: {message}")
