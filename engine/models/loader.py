"""Load a MiMo-V2 checkpoint (config.json + *.safetensors, Hugging Face layout) into our model.

Accepted tensor layouts: the hub's per-expert weights (``mlp.experts.{e}.gate_proj.weight``) and
transformers' fused ones (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj``);
``self_attn.sinks`` as an alias of ``self_attn.attention_sink_bias``. MTP heads (``model.mtp.*``)
and the vision tower (``vision_tower.*``) are skipped. Anything else that is missing, extra or
mis-shaped is a ``CheckpointError`` naming it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.layers.moe import Router
from engine.model_config import ModelConfig
from engine.models.mimo_v2 import MiMoV2ForCausalLM

# NOTE: the vision tower's tensors (``vision_tower.*``) may share the model dir (issue 13): the
# encoder service loads them (``encoders.vision.load_tower``), never the LLM
_IGNORED = re.compile(r"^model\.mtp\.|^vision_tower\.|rotary_emb\.inv_freq$")
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_MAX_LISTED = 8


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match the model its config describes."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig) -> torch.dtype:
    """``"auto"`` takes the config's ``torch_dtype`` (float32 when absent)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = (cfg.torch_dtype or "float32") if dtype == "auto" else dtype
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; use one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[name]


def load_model(
    model_dir: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu"
) -> MiMoV2ForCausalLM:
    """Build the model for ``model_dir/config.json`` and fill it from its safetensors files.

    Raises:
        FileNotFoundError: no config.json or no safetensors file.
        ConfigError: an unsupported or malformed config value.
        CheckpointError: a missing, extra or mis-shaped tensor.
    """
    cfg = ModelConfig.from_dir(model_dir)
    torch_dtype = resolve_dtype(dtype, cfg)
    with torch.device("meta"):
        model = MiMoV2ForCausalLM(cfg)
    model = model.to_empty(device=device).to(torch_dtype)
    model.tie_weights()
    for module in model.modules():
        if isinstance(module, Router):
            module.float()  # the gate and its bias stay fp32, as in the checkpoint
    _fill(model, _read_tensors(Path(model_dir)))
    return model.eval().requires_grad_(False)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: those of ``model.safetensors.index.json`` or every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard files that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    return files


def _read_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if not _IGNORED.search(name):
                    yield from _normalize(name, f.get_tensor(name))


def _normalize(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Map one checkpoint tensor to our parameter name(s)."""
    name = name.replace("self_attn.sinks", "self_attn.attention_sink_bias")
    fused = _FUSED_EXPERTS.match(name)
    if fused is None:
        yield name, tensor
        return
    prefix, kind = fused.groups()
    if tensor.dim() != 3:
        raise CheckpointError(
            f"{name}: expected a 3-D [experts, out, in] tensor, got {tuple(tensor.shape)}"
        )
    for e in range(tensor.shape[0]):
        if kind == "down_proj":
            yield f"{prefix}.{e}.down_proj.weight", tensor[e]
        else:
            gate, up = tensor[e].chunk(2, dim=0)
            yield f"{prefix}.{e}.gate_proj.weight", gate
            yield f"{prefix}.{e}.up_proj.weight", up


def _fill(model: MiMoV2ForCausalLM, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())  # tied lm_head appears once, under embed_tokens
    seen: set[str] = set()
    extra: list[str] = []
    for name, tensor in tensors:
        param = params.get(name)
        if param is None:
            if not (name == "lm_head.weight" and model.config.tie_word_embeddings):
                extra.append(name)
            continue
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, the config expects "
                f"{tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise CheckpointError(
            f"checkpoint is missing {len(missing)} tensor(s): {_listing(missing)}"
        )
    if extra:
        raise CheckpointError(
            f"checkpoint has {len(extra)} tensor(s) the config does not describe: {_listing(extra)}"
        )


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")
