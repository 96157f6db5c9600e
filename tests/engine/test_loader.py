"""load_model: tensor checks that name what is wrong, sharded and fused layouts, transformers' own
files, dtypes, tied embeddings, and write_random_checkpoint's determinism."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.llm import LLM
from engine.models.checkpoint import mimo_config, write_random_checkpoint
from engine.models.loader import CheckpointError, load_model

# 2I = 32 != H = 64, so a transposed fused expert tensor cannot pass the shape checks.
_SHAPE = dict(layers="FSSF", sliding_window=4, moe_intermediate_size=16, eos_token_id=[7])
_SEED = 11
_PROMPT = [(5 * i + 2) % 320 for i in range(14)]  # longer than 3W: crosses the window
_WEIGHTS = "model.safetensors"
_FP32_PARAMS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
_PROJS = ("gate_proj", "up_proj", "down_proj")

Tensors = dict[str, torch.Tensor]


# --- builders and helpers -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_dir(make_checkpoint: Callable[..., Path]) -> Path:
    """The shared float32 checkpoint; tests that edit files work on a copy (``_make_copy``)."""
    return make_checkpoint(seed=_SEED, **_SHAPE)


@pytest.fixture(scope="module")
def base_logits(base_dir: Path) -> torch.Tensor:
    return _logits(base_dir)


def _logits(model_dir: Path, dtype: str = "float32") -> torch.Tensor:
    return LLM(model_dir, dtype=dtype, device="cpu").prompt_logits(_PROMPT)


def _make_copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def _make_edited(src: Path, dst: Path, edit: Callable[[Tensors], Tensors]) -> Path:
    """A copy of the single-file checkpoint ``src`` whose tensors went through ``edit``."""
    out = _make_copy(src, dst)
    tensors = edit(load_file(out / _WEIGHTS))
    save_file(tensors, str(out / _WEIGHTS), metadata={"format": "pt"})
    return out


def _make_fused(tensors: Tensors) -> Tensors:
    """Per-expert weights -> transformers' fused ``mlp.experts.gate_up_proj`` [E, 2I, H]
    (gate rows, then up rows, per expert) and ``mlp.experts.down_proj`` [E, H, I]."""
    expert = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    by_prefix: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out: Tensors = {}
    for name, t in tensors.items():
        m = expert.match(name)
        if m is None:
            out[name] = t
        else:
            by_prefix.setdefault(m[1], {})[(int(m[2]), m[3])] = t
    for prefix, w in by_prefix.items():
        n = len(w) // 3
        assert sorted(w) == sorted((e, p) for e in range(n) for p in _PROJS), (
            f"{prefix}: {sorted(w)}"
        )
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([w[e, "gate_proj"], w[e, "up_proj"]]) for e in range(n)]
        )
        out[f"{prefix}.down_proj"] = torch.stack([w[e, "down_proj"] for e in range(n)])
    return out


def _sha256_by_file(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


def _assert_same_logits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    assert torch.equal(got, want), f"{what}: logits differ from the original's by up to {err:.3g}"


def _assert_load_fails(
    model_dir: Path, exc: type[Exception], *needles: str
) -> pytest.ExceptionInfo[Exception]:
    with pytest.raises(exc) as err:
        load_model(model_dir, dtype="float32")
    absent = [n for n in needles if n not in str(err.value)]
    assert not absent, f"{exc.__name__} does not mention {absent}: {err.value}"
    return err


# --- missing, mis-shaped and extra tensors --------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.mlp.experts.3.up_proj.weight",
        "model.layers.2.self_attn.attention_sink_bias",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.norm.weight",
        "lm_head.weight",
    ],
)
def test_missing_tensor_is_named(base_dir: Path, tmp_path: Path, name: str) -> None:
    def drop(t: Tensors) -> Tensors:
        assert name in t, f"{name} is not in the checkpoint: pick a tensor that is"
        return {n: v for n, v in t.items() if n != name}

    model_dir = _make_edited(base_dir, tmp_path / "ckpt", drop)
    _assert_load_fails(model_dir, CheckpointError, name, "missing")


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("model.layers.0.self_attn.q_proj.weight", (128, 63)),
        ("model.layers.1.mlp.experts.0.down_proj.weight", (32, 64)),  # transposed
        ("model.layers.1.self_attn.attention_sink_bias", (5,)),
        ("model.embed_tokens.weight", (321, 64)),
    ],
)
def test_wrong_shape_names_tensor_and_both_shapes(
    base_dir: Path, tmp_path: Path, name: str, shape: tuple[int, ...]
) -> None:
    want = tuple(load_file(base_dir / _WEIGHTS)[name].shape)
    assert want != shape, f"{name} already has shape {shape}"
    model_dir = _make_edited(base_dir, tmp_path / "ckpt", lambda t: {**t, name: torch.zeros(shape)})
    _assert_load_fails(model_dir, CheckpointError, name, str(shape), str(want))


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.4.input_layernorm.weight",  # a layer the config does not have
        "model.layers.0.self_attn.attention_sink_bias",  # full-attention layers have no sink
        "model.layers.1.mlp.experts.8.up_proj.weight",  # expert 8 of 8
        "model.layers.1.mlp.shared_experts.gate_proj.weight",
    ],
)
def test_extra_unknown_tensor_is_named(base_dir: Path, tmp_path: Path, name: str) -> None:
    model_dir = _make_edited(base_dir, tmp_path / "ckpt", lambda t: {**t, name: torch.zeros(4)})
    _assert_load_fails(model_dir, CheckpointError, name)


def test_mtp_tensors_are_ignored(base_dir: Path, base_logits: torch.Tensor, tmp_path: Path) -> None:
    extra = {
        "model.mtp.0.foo": torch.zeros(3),
        "model.mtp.0.layers.0.self_attn.q_proj.weight": torch.ones(7, 5),
        "model.mtp.1.norm.weight": torch.ones(64),
    }
    model_dir = _make_edited(base_dir, tmp_path / "ckpt", lambda t: {**t, **extra})
    _assert_same_logits(_logits(model_dir), base_logits, "with model.mtp.* tensors")


def test_sinks_alias_loads_identically(
    base_dir: Path, base_logits: torch.Tensor, tmp_path: Path
) -> None:
    def rename(t: Tensors) -> Tensors:
        out = {n.replace("attention_sink_bias", "sinks"): v for n, v in t.items()}
        renamed = sorted(n for n in out if n.endswith(".sinks"))
        assert len(renamed) == 2, f"expected the 2 SWA layers' sinks, renamed {renamed}"
        return out

    model_dir = _make_edited(base_dir, tmp_path / "ckpt", rename)
    _assert_same_logits(_logits(model_dir), base_logits, "sinks renamed")


# --- sharded checkpoints --------------------------------------------------------------------------


def _make_sharded(out: Path, max_shard_bytes: int = 48 * 1024) -> Path:
    return write_random_checkpoint(
        out, mimo_config(**_SHAPE), seed=_SEED, max_shard_bytes=max_shard_bytes
    )


def test_sharded_checkpoint_loads_like_single_file(
    base_logits: torch.Tensor, tmp_path: Path
) -> None:
    model_dir = _make_sharded(tmp_path / "sharded")
    shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    assert len(shards) >= 3, f"want >= 3 shards for this test, got {shards}"
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards, (
        f"index names {sorted(set(index['weight_map'].values()))}, files are {shards}"
    )
    _assert_same_logits(_logits(model_dir), base_logits, f"{len(shards)} shards")


def test_index_naming_missing_shard_is_named(tmp_path: Path) -> None:
    model_dir = _make_sharded(tmp_path / "sharded")
    gone = sorted(model_dir.glob("*.safetensors"))[1]
    gone.unlink()
    _assert_load_fails(model_dir, FileNotFoundError, gone.name, "model.safetensors.index.json")


def test_index_without_weight_map_is_checkpoint_error(tmp_path: Path) -> None:
    model_dir = _make_sharded(tmp_path / "sharded")
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    _assert_load_fails(model_dir, CheckpointError, "weight_map")


def test_no_safetensors_is_file_not_found(base_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "empty"
    model_dir.mkdir()
    shutil.copy(base_dir / "config.json", model_dir / "config.json")
    _assert_load_fails(model_dir, FileNotFoundError, str(model_dir), "safetensors")


# --- fused experts and transformers' own files ----------------------------------------------------


def test_fused_expert_layout_loads_identically(
    base_dir: Path, base_logits: torch.Tensor, tmp_path: Path
) -> None:
    model_dir = _make_edited(base_dir, tmp_path / "fused", _make_fused)
    names = load_file(model_dir / _WEIGHTS).keys()
    per_expert = [n for n in names if ".experts." in n and n.endswith(".weight")]
    assert not per_expert, f"conversion left per-expert tensors {per_expert[:3]}"
    _assert_same_logits(_logits(model_dir), base_logits, "fused experts")


def test_truncated_fused_experts_are_named(base_dir: Path, tmp_path: Path) -> None:
    def drop_last_expert(t: Tensors) -> Tensors:
        fused = _make_fused(t)
        name = "model.layers.2.mlp.experts.gate_up_proj"
        return {**fused, name: fused[name][:-1]}

    model_dir = _make_edited(base_dir, tmp_path / "fused", drop_last_expert)
    _assert_load_fails(model_dir, CheckpointError, "model.layers.2.mlp.experts.7.gate_proj.weight")


@pytest.fixture(scope="module")
def hf_model(base_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.MiMoV2FlashForCausalLM.from_pretrained(base_dir, dtype=torch.float32)


def test_transformers_state_dict_loads_identically(
    hf_model: Any, base_dir: Path, base_logits: torch.Tensor, tmp_path: Path
) -> None:
    """transformers' in-memory names (``sinks``, fused experts) saved as they are."""
    state = {n: t.contiguous() for n, t in hf_model.state_dict().items()}
    fused = [n for n in state if n.endswith("experts.gate_up_proj")]
    assert fused and any(n.endswith(".sinks") for n in state), f"names: {sorted(state)[:12]}"
    model_dir = tmp_path / "hf-state"
    model_dir.mkdir()
    shutil.copy(base_dir / "config.json", model_dir / "config.json")
    save_file(state, str(model_dir / _WEIGHTS), metadata={"format": "pt"})
    _assert_same_logits(_logits(model_dir), base_logits, "transformers state_dict")


def test_transformers_save_pretrained_loads_identically(
    hf_model: Any, base_logits: torch.Tensor, tmp_path: Path
) -> None:
    model_dir = tmp_path / "hf-saved"
    hf_model.save_pretrained(model_dir)
    _assert_same_logits(_logits(model_dir), base_logits, "transformers save_pretrained")


# --- dtypes ---------------------------------------------------------------------------------------


def _assert_dtypes(model: torch.nn.Module, dtype: torch.dtype) -> None:
    wrong = {
        n: p.dtype
        for n, p in model.named_parameters()
        if p.dtype != (torch.float32 if n.endswith(_FP32_PARAMS) else dtype)
    }
    assert not wrong, f"want router fp32 and the rest {dtype}; wrong: {wrong}"


def test_bf16_load_keeps_router_fp32(base_dir: Path) -> None:
    model = load_model(base_dir, dtype="bfloat16")
    _assert_dtypes(model, torch.bfloat16)
    file = load_file(base_dir / _WEIGHTS)
    routers = [n for n, _ in model.named_parameters() if n.endswith(_FP32_PARAMS)]
    assert len(routers) == 3 * 2, f"router params {routers}"  # 3 MoE layers
    params = dict(model.named_parameters())
    rounded = [n for n in routers if not torch.equal(params[n], file[n])]
    assert not rounded, f"router params not loaded at full precision: {rounded}"


@pytest.mark.parametrize("written", ["float32", "bfloat16"])
def test_auto_dtype_follows_config(make_checkpoint: Callable[..., Path], written: str) -> None:
    model_dir = make_checkpoint(seed=_SEED, dtype=written, **_SHAPE)
    torch_dtype = json.loads((model_dir / "config.json").read_text())["torch_dtype"]
    assert torch_dtype == written, f"config.json says torch_dtype={torch_dtype!r}"
    _assert_dtypes(load_model(model_dir), getattr(torch, written))


def test_auto_dtype_without_torch_dtype_is_float32(base_dir: Path, tmp_path: Path) -> None:
    model_dir = _make_copy(base_dir, tmp_path / "ckpt")
    raw = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**raw, "torch_dtype": None}))
    _assert_dtypes(load_model(model_dir, dtype="auto"), torch.float32)


@pytest.mark.parametrize("dtype", ["float8", "int8", "bf16"])
def test_unknown_dtype_is_named(base_dir: Path, dtype: str) -> None:
    with pytest.raises(ValueError) as err:
        load_model(base_dir, dtype=dtype)
    assert repr(dtype) in str(err.value), f"error does not name {dtype!r}: {err.value}"


# --- tied embeddings ------------------------------------------------------------------------------


def test_tied_embeddings_share_storage(make_checkpoint: Callable[..., Path]) -> None:
    model_dir = make_checkpoint(seed=_SEED, tie_word_embeddings=True, **_SHAPE)
    file = load_file(model_dir / _WEIGHTS)
    assert "lm_head.weight" not in file, "a tied checkpoint should not store lm_head.weight"
    model = load_model(model_dir, dtype="float32")
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    assert head.data_ptr() == embed.data_ptr(), "lm_head does not share the embeddings' storage"
    assert torch.equal(embed, file["model.embed_tokens.weight"]), "embeddings not loaded"
    logits = LLM(model_dir, dtype="float32", device="cpu").prompt_logits(_PROMPT)
    assert torch.isfinite(logits).all() and logits.std() > 0.1, "degenerate tied logits"


# --- write_random_checkpoint determinism ----------------------------------------------------------


@pytest.mark.parametrize("max_shard_bytes", [None, 48 * 1024])
def test_same_args_write_identical_bytes(tmp_path: Path, max_shard_bytes: int | None) -> None:
    digests = [
        _sha256_by_file(
            write_random_checkpoint(
                tmp_path / name, mimo_config(**_SHAPE), seed=3, max_shard_bytes=max_shard_bytes
            )
        )
        for name in ("a", "b")
    ]
    assert len(digests[0]) >= 2, f"files written: {sorted(digests[0])}"
    assert digests[0] == digests[1], f"sha256 per file differ: {digests[0]} vs {digests[1]}"


def test_different_seed_gives_different_weights(tmp_path: Path) -> None:
    dirs = [
        write_random_checkpoint(tmp_path / str(seed), mimo_config(**_SHAPE), seed=seed)
        for seed in (3, 4)
    ]
    a, b = (load_file(d / _WEIGHTS) for d in dirs)
    assert a.keys() == b.keys(), f"tensor names differ: {a.keys() ^ b.keys()}"
    same = [n for n in a if torch.equal(a[n], b[n])]
    assert not same, f"seeds 3 and 4 gave identical {same}"
    configs = [(d / "config.json").read_text() for d in dirs]
    assert configs[0] == configs[1], "the seed should not change config.json"
