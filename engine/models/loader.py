"""Load a MiMo-V2 checkpoint (config.json + *.safetensors, Hugging Face layout) into our model.

Accepted tensor layouts: the hub's per-expert weights (``mlp.experts.{e}.gate_proj.weight``) and
transformers' fused ones (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj``);
``self_attn.sinks`` as an alias of ``self_attn.attention_sink_bias``; the official XiaomiMiMo
layout (``engine.models.official``): a TP-chunked fused ``self_attn.qkv_proj`` and block-fp8
weights with ``<name>_scale_inv`` (possibly in another shard file), dequantized to the run dtype.
The vision tower (``vision_tower.*``) is skipped, and so are the MTP layers (``model.mtp.*``)
unless ``mtp_layers=n`` asks for them: then ``model.mtp.layers.{i}.*`` for i < n fill
``model.mtp`` (an ``MTPHead``; its parameters are ``mtp.layers.{i}.*``), in any of the layouts
above (``pre_mlp_layernorm`` is an alias of ``post_attention_layernorm``), and layers i >= n are
skipped. Anything else that is missing, extra or mis-shaped (a missing, unused or mis-shaped scale
included) is a ``CheckpointError`` naming it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from engine.layers.moe import Router
from engine.model_config import FUSED_QKV, ConfigError, ModelConfig
from engine.models import official
from engine.models.mimo_v2 import MiMoV2ForCausalLM
from engine.models.mtp import MTPHead, mtp_config_of

# NOTE: the vision tower's tensors (``vision_tower.*``) may share the model dir (issue 13): the
# encoder service loads them (``encoders.vision.load_tower``), never the LLM
_IGNORED = re.compile(r"^vision_tower\.|rotary_emb\.inv_freq$")
_MTP = re.compile(r"^model\.mtp\.layers\.(\d+)\.")
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
# NOTE: matches base layers (``model.layers.{i}``) and, after ``_mtp_name``, MTP layers
# (``mtp.layers.{i}``); the checkpoint's ``model.mtp.layers.{i}`` too, for the fp8 chunk count
_FUSED_QKV = re.compile(
    r"^((?:model\.|model\.mtp\.|mtp\.)layers\.(\d+)\.self_attn)\.qkv_proj\.(weight|bias)$"
)
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
    model_dir: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    *,
    qkv_tp_size: int | None = None,
    mtp_layers: int = 0,
) -> MiMoV2ForCausalLM:
    """Build the model for ``model_dir/config.json`` and fill it from its safetensors files.

    Args:
        qkv_tp_size: the TP chunks of a fused ``qkv_proj`` (official layout); None detects it
            from the fp8 scale grids and fails when that is ambiguous.
        mtp_layers: load the first n MTP layers into ``model.mtp`` (0: none, ``model.mtp`` is
            None and the checkpoint's ``model.mtp.*`` tensors are skipped).

    Raises:
        FileNotFoundError: no config.json or no safetensors file.
        ConfigError: an unsupported or malformed config value, or more MTP layers requested
            than the config declares.
        CheckpointError: a missing, extra or mis-shaped tensor.
    """
    cfg = ModelConfig.from_dir(model_dir)
    torch_dtype = resolve_dtype(dtype, cfg)
    _check_mtp_layers(Path(model_dir), mtp_layers)
    with torch.device("meta"):
        model = MiMoV2ForCausalLM(cfg)
        if mtp_layers:
            model.mtp = MTPHead(cfg, mtp_layers)
    model = model.to_empty(device=device).to(torch_dtype)
    model.tie_weights()
    for module in model.modules():
        if isinstance(module, Router):
            module.float()  # the gate and its bias stay fp32, as in the checkpoint
    _fill(model, _read_tensors(Path(model_dir), cfg, qkv_tp_size, mtp_layers))
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


def _check_mtp_layers(model_dir: Path, mtp_layers: int) -> None:
    if mtp_layers < 0:
        raise ValueError(f"mtp_layers={mtp_layers}: must be >= 0")
    if not mtp_layers:
        return
    declared = mtp_config_of(json.loads((model_dir / "config.json").read_text()))
    if declared < mtp_layers:
        raise ConfigError(
            f"{mtp_layers} MTP layer(s) requested, but config.json declares {declared} "
            f"(num_nextn_predict_layers)"
        )


def _read_tensors(
    model_dir: Path, cfg: ModelConfig, qkv_tp_size: int | None, mtp_layers: int
) -> Iterator[tuple[str, torch.Tensor]]:
    with _Shards(safetensors_files(model_dir)) as shards:
        names = [n for n in shards.names if not _skipped(n, mtp_layers)]
        is_fused = cfg.attention_projection_layout == FUSED_QKV
        tp = _qkv_tp(cfg, shards, qkv_tp_size, mtp_layers) if is_fused else 1
        used_scales: set[str] = set()
        for name in names:
            if not name.endswith(official.SCALE_SUFFIX):
                tensor = _dequantized(name, shards, cfg, tp, used_scales)
                yield from _normalize(_mtp_name(name), tensor, cfg, tp)
        scales = (n for n in names if n.endswith(official.SCALE_SUFFIX))
        unused = sorted(n for n in scales if n not in used_scales)
        if unused:
            raise CheckpointError(
                f"checkpoint has {len(unused)} scale(s) of no fp8 weight: {_listing(unused)}"
            )


class _Shards:
    """Every tensor of a checkpoint's files by name, the files held open (a weight and its
    ``_scale_inv`` may sit in different shards)."""

    def __init__(self, files: list[Path]) -> None:
        self._stack = ExitStack()
        self._where: dict[str, object] = {}
        for path in files:
            f = self._stack.enter_context(safe_open(str(path), framework="pt"))
            self._where.update(dict.fromkeys(f.keys(), f))

    def __enter__(self) -> _Shards:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor | None:
        f = self._where.get(name)
        return None if f is None else f.get_tensor(name)  # type: ignore[attr-defined]

    def shape(self, name: str) -> tuple[int, ...] | None:
        f = self._where.get(name)
        return None if f is None else tuple(f.get_slice(name).get_shape())  # type: ignore[attr-defined]


def _dequantized(
    name: str, shards: _Shards, cfg: ModelConfig, tp: int, used_scales: set[str]
) -> torch.Tensor:
    tensor = shards.get(name)
    assert tensor is not None
    if tensor.dtype != official.FP8:
        return tensor
    scale_name = name + official.SCALE_SUFFIX
    if cfg.quantization is None:
        raise CheckpointError(f"tensor {name!r} is fp8 but config.json has no quantization_config")
    scale = shards.get(scale_name)
    if scale is None:
        raise CheckpointError(f"fp8 tensor {name!r} has no scale {scale_name!r}")
    if tensor.dim() != 2:
        raise CheckpointError(f"fp8 tensor {name!r} is {tensor.dim()}-D; only 2-D weights are")
    used_scales.add(scale_name)
    chunks = tp if _FUSED_QKV.match(name) else 1
    try:
        return official.dequantize_blocks(tensor, scale, cfg.quantization.weight_block_size, chunks)
    except ValueError as e:
        raise CheckpointError(f"{scale_name!r}: {e}") from e


def _qkv_tp(
    cfg: ModelConfig, shards: _Shards, qkv_tp_size: int | None, mtp_layers: int
) -> int:
    """The TP chunks of the fused qkv_proj tensors, checked against every layer's shapes."""
    # NOTE: without a quantization_config the scales are not read (an fp8 tensor fails later)
    block = cfg.quantization.weight_block_size[0] if cfg.quantization else None
    fused = [(f"model.layers.{i}", cfg.geometry(i)) for i in range(cfg.num_hidden_layers)]
    fused += [(f"model.mtp.layers.{i}", cfg.swa) for i in range(mtp_layers)]
    layers = []
    for prefix, geo in fused:
        name = f"{prefix}.self_attn.qkv_proj.weight"
        shape = shards.shape(name)
        if shape is not None:  # a missing one is reported with the other missing tensors
            scale = shards.shape(name + official.SCALE_SUFFIX) if block else None
            layers.append((name, geo, shape[0], None if scale is None else scale[0]))
    if not layers:  # no fused tensor at all: nothing to un-fuse, what is missing is reported
        return qkv_tp_size or 1
    if qkv_tp_size is not None:
        for name, geo, rows, scale_rows in layers:
            if not official.fits_tp(geo, qkv_tp_size, rows, scale_rows, block or 1):
                raise CheckpointError(
                    f"tensor {name!r} ({rows} rows, {scale_rows} scale rows) is not a fused "
                    f"qkv_proj of {geo.num_heads} q / {geo.num_kv_heads} kv heads in "
                    f"{qkv_tp_size} TP chunks"
                )
        return qkv_tp_size
    try:
        shapes = [(g, r, s) for _, g, r, s in layers]
        return official.detect_qkv_tp(shapes, block or 1, "qkv_proj")
    except ValueError as e:
        raise CheckpointError(str(e)) from e


def _normalize(
    name: str, tensor: torch.Tensor, cfg: ModelConfig, tp: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Map one checkpoint tensor to our parameter name(s)."""
    name = name.replace("self_attn.sinks", "self_attn.attention_sink_bias")
    if cfg.attention_projection_layout == FUSED_QKV and _FUSED_QKV.match(name):
        yield from _split_qkv(name, tensor, cfg, tp)
        return
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


def _split_qkv(
    name: str, tensor: torch.Tensor, cfg: ModelConfig, tp: int
) -> Iterator[tuple[str, torch.Tensor]]:
    match = _FUSED_QKV.match(name)
    assert match is not None
    prefix, layer, kind = match.groups()
    # NOTE: MTP layers always have the SWA geometry (``engine.models.mtp``)
    geo = cfg.swa if prefix.startswith("mtp.") else cfg.geometry(int(layer))
    rows = official.qkv_rows(geo, tp)
    if rows is None or tensor.shape[0] != rows.total * tp:
        raise CheckpointError(
            f"tensor {_hub_name(name)!r} has shape {tuple(tensor.shape)}, not a fused qkv_proj of "
            f"{geo.num_heads} q / {geo.num_kv_heads} kv heads in {tp} TP chunks"
        )
    for part, t in zip(("q_proj", "k_proj", "v_proj"), official.split_qkv(tensor, geo, tp)):
        yield f"{prefix}.{part}.{kind}", t


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
                f"tensor {_hub_name(name)!r} has shape {tuple(tensor.shape)}, the config "
                f"expects {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        shaped = [f"{_hub_name(n)} {tuple(params[n].shape)}" for n in missing]
        raise CheckpointError(
            f"checkpoint is missing {len(missing)} tensor(s): {_listing(shaped)}"
        )
    if extra:
        names = [_hub_name(n) for n in extra]
        raise CheckpointError(
            f"checkpoint has {len(extra)} tensor(s) the config does not describe: {_listing(names)}"
        )


def _skipped(name: str, mtp_layers: int) -> bool:
    """Tensors not loaded: the vision tower, and MTP layers beyond the ``mtp_layers`` asked for
    (every ``model.mtp.*`` one when none are)."""
    if _IGNORED.search(name):
        return True
    if not name.startswith("model.mtp."):
        return False
    layer = _MTP.match(name)
    if layer is None:
        return not mtp_layers  # NOTE: when MTP is loaded, a stray model.mtp.* name is an extra
    return int(layer[1]) >= mtp_layers


def _mtp_name(name: str) -> str:
    """``model.mtp.layers.{i}.X`` -> our ``mtp.layers.{i}.X`` (SGLang's name aliases applied)."""
    if not name.startswith("model.mtp."):
        return name
    return name.removeprefix("model.").replace(".pre_mlp_layernorm.", ".post_attention_layernorm.")


def _hub_name(name: str) -> str:
    """Our parameter name as the checkpoint spells it (for error messages)."""
    return "model." + name if name.startswith("mtp.") else name


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")
