"""The vision tower: SigLIP's vision transformer, then a patch-merging projector to the LLM's width.

``VisionTower(cfg)(pixel_values [N, C, S, S]) -> [N, cfg.tokens_per_image, cfg.out_hidden_size]``.
The transformer is SigLIP's exactly, without its attention-pooling head; module names match the
checkpoints' (``vision_model.embeddings.patch_embedding.weight``, ``vision_model.encoder.layers.0.
self_attn.q_proj.weight``, ``vision_model.post_layernorm.weight``), so SigLIP weights load as they
are. The projector (``projector.norm|fc1|fc2``) concatenates each merge_size x merge_size block of
patches, then LayerNorm -> Linear -> GELU -> Linear.

Weights: ``load_tower`` (a model dir's ``vision_tower.*`` tensors, or a plain SigLIP checkpoint
plus ``projector.*``), ``init_tower`` (seeded random), ``save_tower`` (``vision_tower.safetensors``)
and ``tower_fingerprint`` (for embedding cache keys).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from encoders.vision_config import HIDDEN_ACTS, VisionConfig, read_vision_config

TOWER_PREFIX = "vision_tower."  # the tower's tensors in a combined (LLM + tower) checkpoint
TOWER_FILE = "vision_tower.safetensors"  # what save_tower writes into a model dir
_SIGLIP_HEAD = "vision_model.head."  # SigLIP's attention-pooling head: not part of the tower
_INIT_STD = 0.02
_FINGERPRINT_SAMPLES = 32  # elements per tensor


class VisionCheckpointError(ValueError):
    """The tower's tensors do not match the tower its config describes."""


class VisionTower(nn.Module):
    """SigLIP vision transformer (``vision_model.*``) + merge-and-project head (``projector.*``).

    Input ``pixel_values`` are normalized with ``cfg.image_mean`` / ``cfg.image_std``, as
    SigLIP's image processor does; they are cast to the weights' dtype.
    """

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_model = SiglipVisionTransformer(cfg)
        self.projector = Projector(cfg)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, num_channels, image_size, image_size] -> [N, tokens_per_image, out_hidden_size]."""
        return self.projector(self.encode_patches(pixel_values))

    def encode_patches(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The transformer alone (after post_layernorm): [N, C, S, S] -> [N, num_patches, hidden],
        patches in row-major order; equals SiglipVisionModel's ``last_hidden_state``."""
        cfg = self.cfg
        expected = (cfg.num_channels, cfg.image_size, cfg.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(
                f"pixel_values: expected shape [N, {', '.join(map(str, expected))}], "
                f"got {list(pixel_values.shape)}"
            )
        return self.vision_model(pixel_values)


def load_tower(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> VisionTower | None:
    """The tower of ``model_dir``, or None when its config.json describes none.

    The config is ``read_vision_config(model_dir)``. Tensors come from every ``*.safetensors``
    in the dir:

    - combined checkpoint (any tensor named ``vision_tower.*``): the tower's tensors are
      ``vision_tower.<name>``, e.g. ``vision_tower.vision_model.post_layernorm.weight``,
      ``vision_tower.projector.fc1.weight``; any other ``vision_tower.*`` tensor is an error.
    - plain SigLIP checkpoint: ``vision_model.*`` (or transformers 5's unprefixed
      ``embeddings.*`` / ``encoder.*`` / ``post_layernorm.*``) plus ``projector.*``, which SigLIP
      does not have. Other tensors (``text_model.*``, ...) are ignored. Without
      ``out_hidden_size`` in the config, ``projector.fc2.weight``'s rows give it.

    SigLIP's attention-pooling head (``vision_model.head.*``) is ignored in both layouts.

    Raises:
        FileNotFoundError: no config.json.
        ValueError: an invalid vision config.
        VisionCheckpointError: a missing, mis-shaped or (combined layout) extra tower tensor.
    """
    model_dir = Path(model_dir)
    raw = read_vision_config(model_dir)
    if raw is None:
        return None
    with contextlib.ExitStack() as stack:
        files = [
            stack.enter_context(safe_open(str(path), framework="pt"))
            for path in sorted(model_dir.glob("*.safetensors"))
        ]
        index = {key: f for f in files for key in f.keys()}  # noqa: SIM118 (not a Mapping)
        combined = any(key.startswith(TOWER_PREFIX) for key in index)
        if "out_hidden_size" not in raw:
            fc2 = _source(index, "projector.fc2.weight", combined, model_dir, "[out, out]")
            raw = {**raw, "out_hidden_size": index[fc2].get_slice(fc2).get_shape()[0]}
        cfg = VisionConfig.from_dict(raw)
        with torch.device("meta"):
            tower = VisionTower(cfg)
        expected = tower.state_dict()
        state = {
            name: _read_tensor(index, name, tuple(meta.shape), combined, model_dir)
            for name, meta in expected.items()
        }
    if combined:
        _check_no_extra(index, expected, model_dir)
    state = {name: t.to(device=device, dtype=dtype) for name, t in state.items()}
    tower.load_state_dict(state, assign=True)
    return tower.eval().requires_grad_(False)


def init_tower(config: VisionConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random fp32 CPU weights, keyed as ``VisionTower.state_dict()``.

    Linear, conv and embedding weights ~ N(0, 0.02) from one seeded generator (in state-dict
    order), biases 0, LayerNorms weight 1 / bias 0. Same (config, seed) -> same tensors.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        tower = VisionTower(config)
    norms = {name for name, m in tower.named_modules() if isinstance(m, nn.LayerNorm)}
    state: dict[str, torch.Tensor] = {}
    for name, meta in tower.state_dict().items():
        owner, _, kind = name.rpartition(".")
        if owner in norms and kind == "weight":
            state[name] = torch.ones(meta.shape)
        elif kind == "bias":
            state[name] = torch.zeros(meta.shape)
        else:
            state[name] = torch.randn(meta.shape, generator=generator) * _INIT_STD
    return state


def save_tower(
    state: Mapping[str, torch.Tensor],
    out: str | Path,
    *,
    config: VisionConfig | None = None,
) -> Path:
    """Write ``state`` (``VisionTower.state_dict()`` names) as ``vision_tower.<name>`` tensors.

    Args:
        out: a ``*.safetensors`` path, or a directory to write ``vision_tower.safetensors`` into.
        config: also set ``vision_config`` in that directory's config.json (created when absent,
            its other keys kept), so that ``load_tower`` finds the tower.

    Returns:
        The safetensors file written.
    """
    out = Path(out)
    path = out if out.suffix == ".safetensors" else out / TOWER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {TOWER_PREFIX + k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, str(path))
    if config is not None:
        cfg_path = path.parent / "config.json"
        doc = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        doc["vision_config"] = config.to_dict()
        cfg_path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return path


def tower_fingerprint(config: VisionConfig, state: Mapping[str, torch.Tensor]) -> str:
    """16 hex digits naming a tower for cache keys: sha256 of the config, each tensor's name,
    shape and dtype, and 32 evenly spaced elements of it (the first and last included).

    The same weights give the same fingerprint on any device. NOTE: a sample, not a checksum:
    it tells checkpoints apart, it does not prove a file intact.
    """
    h = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode())
    for name in sorted(state):
        tensor = state[name].detach()
        flat = tensor.reshape(-1)
        n = flat.numel()
        k = min(n, _FINGERPRINT_SAMPLES)
        idx = torch.arange(k, dtype=torch.int64) * (n - 1) // max(k - 1, 1)
        sample = flat.index_select(0, idx.to(flat.device)).to("cpu", torch.float32)
        h.update(f"{name}:{list(tensor.shape)}:{tensor.dtype};".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


class SiglipVisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.embeddings = PatchEmbeddings(cfg)
        self.encoder = Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values)))


class PatchEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        p = cfg.patch_size
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, p, stride=p)
        self.position_embedding = nn.Embedding(cfg.num_patches, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        # [N, D, P, P] -> [N, P*P, D]: patch (r, c) is row r * P + c
        return x.flatten(2).transpose(1, 2) + self.position_embedding.weight


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = Attention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Attention(nn.Module):
    """Bidirectional multi-head self-attention over one image's patches (torch SDPA)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.q_proj = nn.Linear(h, h)
        self.out_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q, k, v = (
            proj(x).view(n, t, self.num_heads, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        # NOTE: SDPA's default scale is head_dim ** -0.5, SigLIP's; no mask: every patch is real
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(n, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.approximate = HIDDEN_ACTS[cfg.hidden_act]
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class Projector(nn.Module):
    """merge_patches -> LayerNorm(m*m*D) -> Linear(m*m*D, out) -> GELU (erf) -> Linear(out, out)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.merge_size = cfg.merge_size
        self.norm = nn.LayerNorm(cfg.merged_hidden_size, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(cfg.merged_hidden_size, cfg.out_hidden_size)
        self.fc2 = nn.Linear(cfg.out_hidden_size, cfg.out_hidden_size)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.norm(merge_patches(patches, self.merge_size))
        return self.fc2(F.gelu(self.fc1(x)))


def merge_patches(patches: torch.Tensor, merge_size: int) -> torch.Tensor:
    """Concatenate each merge_size x merge_size block of neighbouring patches into one token.

    ``[N, P*P, D] -> [N, (P/m)**2, m*m*D]`` with patches row-major on a P x P grid. Tokens are
    row-major over the blocks; within a token, the block's patches are row-major too. P=4, m=2:

        patch p = r*P + c            token t = R*(P/m) + C   features (D each, in this order)
              c=0  c=1 | c=2  c=3
        r=0     0    1 |   2    3    t=0 (R=0, C=0)          patches  0,  1,  4,  5
        r=1     4    5 |   6    7    t=1 (R=0, C=1)          patches  2,  3,  6,  7
        -----------------------      t=2 (R=1, C=0)          patches  8,  9, 12, 13
        r=2     8    9 |  10   11    t=3 (R=1, C=1)          patches 10, 11, 14, 15
        r=3    12   13 |  14   15

    Feature slice ``[k*D, (k+1)*D)`` of token (R, C) is patch ``(R*m + k // m, C*m + k % m)``.
    """
    n, num_patches, d = patches.shape
    side, m = round(num_patches**0.5), merge_size
    if side * side != num_patches or side % m:
        raise ValueError(f"{num_patches} patches: not a square grid divisible by merge_size={m}")
    x = patches.reshape(n, side // m, m, side // m, m, d)  # [N, R, a, C, b, D]
    return x.permute(0, 1, 3, 2, 4, 5).reshape(n, (side // m) ** 2, m * m * d)


def _source(
    index: Mapping[str, Any], name: str, combined: bool, model_dir: Path, shape: str
) -> str:
    """The checkpoint key holding tower tensor ``name``."""
    if combined:
        key = TOWER_PREFIX + name
        candidates = [key]
    else:
        key = name
        # NOTE: transformers 5 saves SiglipVisionModel without its `vision_model.` prefix
        candidates = [name, name.removeprefix("vision_model.")]
    for candidate in candidates:
        if candidate in index:
            return candidate
    raise VisionCheckpointError(
        f"{model_dir}: tower tensor {key!r} is missing (expected shape {shape})"
    )


def _read_tensor(
    index: Mapping[str, Any],
    name: str,
    shape: tuple[int, ...],
    combined: bool,
    model_dir: Path,
) -> torch.Tensor:
    key = _source(index, name, combined, model_dir, str(list(shape)))
    found = tuple(index[key].get_slice(key).get_shape())
    if found != shape:
        raise VisionCheckpointError(
            f"{model_dir}: tower tensor {key!r} has shape {list(found)}, "
            f"the vision config expects {list(shape)}"
        )
    tensor: torch.Tensor = index[key].get_tensor(key)
    return tensor


def _check_no_extra(index: Mapping[str, Any], expected: Mapping[str, Any], model_dir: Path) -> None:
    known = {TOWER_PREFIX + name for name in expected}
    extra = sorted(
        key
        for key in index
        if key.startswith(TOWER_PREFIX)
        and key not in known
        and not key.startswith(TOWER_PREFIX + _SIGLIP_HEAD)
    )
    if extra:
        raise VisionCheckpointError(
            f"{model_dir}: {len(extra)} tower tensor(s) the vision config does not describe: "
            f"{', '.join(extra[:8])}"
        )
