"""The official XiaomiMiMo layout (fused qkv in TP chunks, block fp8 + ``weight_scale_inv``) loads
to exactly the weights and logits of the split layout written from its dequantized values; the
un-fusing and the dequantization are checked against independent re-derivations, and what is
wrong with a checkpoint or config is named."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.kv import ContiguousBatch, SequenceKV
from engine.model_config import ConfigError, ModelConfig
from engine.models import official
from engine.models.checkpoint import mimo_config, random_state, write_official_checkpoint
from engine.models.loader import CheckpointError, load_model

# NOTE: blocks of 48 x 24 leave partial blocks at every edge (rows 224/112, 64 hidden) and make
# the TP degree detectable: a full layer's chunk is 224 rows at tp=1 (5 scale rows) but 2 x 112
# at tp=2 (2 x 3 scale rows).
_BLOCK = (48, 24)
_TP = 2
_SHAPE = dict(layers="FSSF", sliding_window=4, num_key_value_heads=2, head_dim=32, v_head_dim=16)
_IGNORED = ("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.experts.3.down_proj")
_PROMPT = [(7 * i + 3) % 320 for i in range(13)]
_WEIGHTS = "model.safetensors"

Tensors = dict[str, torch.Tensor]


# --- builders and helpers -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def official_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Official layout; the scales in their own file and fp8 MTP tensors beside, as on the hub."""
    out = write_official_checkpoint(
        tmp_path_factory.mktemp("official"),
        mimo_config(**_SHAPE),
        seed=5,
        qkv_tp_size=_TP,
        block=_BLOCK,
        ignored_layers=_IGNORED,
    )
    tensors = load_file(out / _WEIGHTS)
    scales = {n: tensors.pop(n) for n in list(tensors) if n.endswith("_scale_inv")}
    save_file(tensors, str(out / _WEIGHTS))
    save_file(scales, str(out / "scales.safetensors"))
    mtp = {
        "model.mtp.layers.0.self_attn.qkv_proj.weight": torch.ones(8, 8).to(official.FP8),
        "model.mtp.layers.0.self_attn.qkv_proj.weight_scale_inv": torch.ones(1, 1),
        "model.mtp.layers.0.enorm.weight": torch.ones(8),
    }
    save_file(mtp, str(out / "mtp.safetensors"))
    return out


def _make_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(model_dir: Path, file: str, changes: dict[str, torch.Tensor | None]) -> None:
    """Replace tensors of one file (None deletes)."""
    tensors = load_file(model_dir / file)
    for name, t in changes.items():
        if t is None:
            del tensors[name]
        else:
            tensors[name] = t
    save_file(tensors, str(model_dir / file))


def _read_all(model_dir: Path) -> Tensors:
    out: Tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _plain_dequant(w: torch.Tensor, s: torch.Tensor, bh: int, bw: int) -> torch.Tensor:
    """Block by block, the way the format is specified; edge blocks simply run short."""
    out = torch.empty(w.shape)
    for i in range(0, w.shape[0], bh):
        for j in range(0, w.shape[1], bw):
            out[i : i + bh, j : j + bw] = w[i : i + bh, j : j + bw].float() * s[i // bh, j // bw]
    return out


def _plain_unfuse(qkv: torch.Tensor, heads: int, kv_heads: int, d: int, dv: int, tp: int):
    """Head by head: Q head h lives in rank h // (heads / tp), at its local index there."""
    chunk = qkv.shape[0] // tp
    hq, hkv = heads // tp, kv_heads // tp

    def rows(h: int, per_rank: int, offset: int, dim: int) -> torch.Tensor:
        rank, local = divmod(h, per_rank)
        start = rank * chunk + offset + local * dim
        return qkv[start : start + dim]

    q = torch.cat([rows(h, hq, 0, d) for h in range(heads)])
    k = torch.cat([rows(h, hkv, hq * d, d) for h in range(kv_heads)])
    v = torch.cat([rows(h, hkv, hq * d + hkv * d, dv) for h in range(kv_heads)])
    return q, k, v


def _reference_split_state(official_dir: Path, block: tuple[int, int] = _BLOCK) -> Tensors:
    """The split-layout weights, derived from the official files without the engine's code."""
    raw = {n: t for n, t in _read_all(official_dir).items() if not n.startswith("model.mtp.")}
    cfg = ModelConfig.from_dict(json.loads((official_dir / "config.json").read_text()))
    bh, bw = block
    state: Tensors = {}
    for name, t in raw.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype != official.FP8:
            state[name] = t.float()
            continue
        s = raw[name + "_scale_inv"]
        if ".qkv_proj." not in name:
            state[name] = _plain_dequant(t, s, bh, bw)
            continue
        layer = int(name.split(".")[2])
        g = cfg.geometry(layer)
        chunks = [
            _plain_dequant(w, sc, bh, bw) for w, sc in zip(t.chunk(_TP), s.chunk(_TP), strict=True)
        ]
        q, k, v = _plain_unfuse(
            torch.cat(chunks), g.num_heads, g.num_kv_heads, g.head_dim, g.v_head_dim, _TP
        )
        prefix = name.removesuffix("qkv_proj.weight")
        state.update({prefix + "q_proj.weight": q, prefix + "k_proj.weight": k})
        state[prefix + "v_proj.weight"] = v
    return state


def _logits(model: Any, prompt: list[int]) -> torch.Tensor:
    batch = ContiguousBatch([SequenceKV(model.config.num_hidden_layers)], [len(prompt)])
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(prompt), batch.positions(), batch))


def _assert_same_params(a: Any, b: Any) -> None:
    pb = dict(b.named_parameters())
    differ = [n for n, p in a.named_parameters() if not torch.equal(p, pb[n])]
    assert not differ, f"{len(differ)} parameters differ between the layouts: {differ[:5]}"


def _assert_error_names(err: pytest.ExceptionInfo[Exception], *parts: str) -> None:
    for part in parts:
        assert part in str(err.value), f"{part!r} not in the error: {err.value}"


# --- same weights, same logits --------------------------------------------------------------------


def test_official_and_split_layouts_give_identical_logits(
    official_dir: Path, tmp_path: Path
) -> None:
    split_dir = tmp_path / "split"
    split_dir.mkdir()
    save_file(_reference_split_state(official_dir), str(split_dir / _WEIGHTS))
    (split_dir / "config.json").write_text(json.dumps(mimo_config(**_SHAPE)))

    ours = load_model(official_dir, dtype="float32")
    ref = load_model(split_dir, dtype="float32")

    _assert_same_params(ours, ref)
    a, b = _logits(ours, _PROMPT), _logits(ref, _PROMPT)
    assert torch.equal(a, b), f"logits differ by up to {(a - b).abs().max().item()}"


def test_explicit_tp_size_loads_the_same_weights(official_dir: Path) -> None:
    detected = load_model(official_dir, dtype="float32")
    explicit = load_model(official_dir, dtype="float32", qkv_tp_size=_TP)
    _assert_same_params(detected, explicit)


def test_official_layout_is_close_to_the_weights_it_quantized(tmp_path: Path) -> None:
    """The writer's fp8 is a faithful rounding (<= 1/16 relative per block), not garbage."""
    cfg = mimo_config(**_SHAPE)
    write_official_checkpoint(tmp_path / "o", cfg, seed=1, qkv_tp_size=_TP, block=_BLOCK)
    state = random_state(cfg, seed=1)
    loaded = dict(load_model(tmp_path / "o", dtype="float32").named_parameters())
    for name, want in state.items():
        err = (loaded[name] - want).abs().max().item()
        assert err <= want.abs().max().item() / 16, f"{name}: off by {err}"


# --- the pure pieces against plain re-derivations -------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_split_qkv_matches_per_head_indexing(tp: int) -> None:
    geo = ModelConfig.from_dict(mimo_config(num_attention_heads=8, num_key_value_heads=4)).full
    rows = official.qkv_rows(geo, tp)
    assert rows is not None
    qkv = torch.randn(rows.total * tp, 5)
    got = official.split_qkv(qkv, geo, tp)
    want = _plain_unfuse(qkv, 8, 4, geo.head_dim, geo.v_head_dim, tp)
    for part, g, w in zip("qkv", got, want, strict=True):
        assert torch.equal(g, w), f"{part} differs for tp={tp}"
    assert torch.equal(official.fuse_qkv(*got, geo, tp), qkv), "fuse_qkv is not the inverse"


@pytest.mark.parametrize(
    ("shape", "block", "chunks"),
    [((200, 300), (128, 128), 1), ((256, 128), (128, 128), 1), ((2 * 100, 70), (48, 24), 2)],
)
def test_dequantize_matches_plain_blocks(
    shape: tuple[int, int], block: tuple[int, int], chunks: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(shape, generator=gen) * 50).to(official.FP8)
    rows = shape[0] // chunks
    grid = (chunks * -(-rows // block[0]), -(-shape[1] // block[1]))
    s = torch.rand(grid, generator=gen) + 0.01
    want = torch.cat(
        [
            _plain_dequant(wc, sc, *block)
            for wc, sc in zip(w.chunk(chunks), s.chunk(chunks), strict=True)
        ]
    )
    assert torch.equal(official.dequantize_blocks(w, s, block, chunks), want)


def test_quantize_then_dequantize_is_a_fixed_point() -> None:
    w = torch.randn(100, 70) * 3
    q, s = official.quantize_blocks(w, (48, 24))
    once = official.dequantize_blocks(q, s, (48, 24))
    q2, s2 = official.quantize_blocks(once, (48, 24))
    assert torch.equal(official.dequantize_blocks(q2, s2, (48, 24)), once)


# --- what is wrong is named -----------------------------------------------------------------------

_QKV = "model.layers.0.self_attn.qkv_proj.weight"
_UP = "model.layers.0.mlp.up_proj.weight"


def test_missing_scale_is_named(official_dir: Path, tmp_path: Path) -> None:
    model_dir = _make_copy(official_dir, tmp_path / "m")
    _edit(model_dir, "scales.safetensors", {_UP + "_scale_inv": None})
    with pytest.raises(CheckpointError) as err:
        load_model(model_dir, dtype="float32")
    _assert_error_names(err, _UP + "_scale_inv")


def test_wrong_scale_shape_is_named(official_dir: Path, tmp_path: Path) -> None:
    model_dir = _make_copy(official_dir, tmp_path / "m")
    _edit(model_dir, "scales.safetensors", {_UP + "_scale_inv": torch.ones(1, 1)})
    with pytest.raises(CheckpointError) as err:
        load_model(model_dir, dtype="float32")
    _assert_error_names(err, _UP + "_scale_inv", "(1, 1)")


def test_scale_of_no_fp8_weight_is_named(official_dir: Path, tmp_path: Path) -> None:
    model_dir = _make_copy(official_dir, tmp_path / "m")
    stray = "model.layers.0.self_attn.o_proj.weight_scale_inv"  # o_proj 0 is stored bf16
    _edit(model_dir, "scales.safetensors", {stray: torch.ones(1, 3)})
    with pytest.raises(CheckpointError) as err:
        load_model(model_dir, dtype="float32")
    _assert_error_names(err, stray)


def test_fused_qkv_of_the_wrong_height_is_named(official_dir: Path, tmp_path: Path) -> None:
    model_dir = _make_copy(official_dir, tmp_path / "m")
    cut = load_file(model_dir / _WEIGHTS)[_QKV][:-2]
    _edit(model_dir, _WEIGHTS, {_QKV: cut})
    with pytest.raises(CheckpointError) as err:
        load_model(model_dir, dtype="float32", qkv_tp_size=_TP)
    _assert_error_names(err, _QKV)


def test_wrong_explicit_tp_size_is_named(official_dir: Path) -> None:
    with pytest.raises(CheckpointError) as err:
        load_model(official_dir, dtype="float32", qkv_tp_size=1)
    _assert_error_names(err, _QKV, "1 TP chunks")


def test_ambiguous_tp_asks_for_it(tmp_path: Path) -> None:
    """128-row chunks at tp=1 and tp=2 alike: the scale grid cannot tell them apart."""
    cfg = mimo_config(**_SHAPE)
    model_dir = write_official_checkpoint(tmp_path / "m", cfg, qkv_tp_size=2, block=(16, 16))
    with pytest.raises(CheckpointError) as err:
        load_model(model_dir, dtype="float32")
    _assert_error_names(err, "qkv_tp_size")
    load_model(model_dir, dtype="float32", qkv_tp_size=2)


def test_the_worker_flag_reaches_the_loader(tmp_path: Path) -> None:
    """``agentgate worker --qkv-tp-size 2`` serves the ambiguous checkpoint above: the flag
    goes through ``EngineConfig`` to ``load_model``, and greedy tokens match the split layout."""
    from engine.engine import Engine
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from engine.worker import cli as worker_cli

    cfg = mimo_config(**_SHAPE)
    model_dir = write_official_checkpoint(tmp_path / "m", cfg, qkv_tp_size=2, block=(16, 16))
    parser = argparse.ArgumentParser()
    worker_cli.add_arguments(parser)
    args = parser.parse_args(["--listen", "tcp://127.0.0.1:0", "--events", "tcp://127.0.0.1:0",
                              "--model", str(model_dir), "--qkv-tp-size", "2", "--dtype",
                              "float32", "--device", "cpu"])
    engine_cfg = worker_cli.engine_config(args, env={})
    assert engine_cfg.qkv_tp_size == 2
    Engine(engine_cfg)  # NOTE: loads; without the flag the loader asks for it
    split_dir = tmp_path / "split"
    split_dir.mkdir()
    save_file(_reference_split_state(model_dir, (16, 16)), str(split_dir / _WEIGHTS))
    (split_dir / "config.json").write_text(json.dumps(cfg))
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    ours = LLM(model_dir, dtype="float32", device="cpu", qkv_tp_size=2).generate([_PROMPT], params)
    ref = LLM(split_dir, dtype="float32", device="cpu").generate([_PROMPT], params)
    assert ours[0].token_ids == ref[0].token_ids


def test_fp8_without_quantization_config_is_named(official_dir: Path, tmp_path: Path) -> None:
    model_dir = _make_copy(official_dir, tmp_path / "m")
    cfg = json.loads((model_dir / "config.json").read_text())
    del cfg["quantization_config"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as err:
        load_model(model_dir, dtype="float32", qkv_tp_size=_TP)
    _assert_error_names(err, "quantization_config")


_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}


@pytest.mark.parametrize(
    ("edits", "named"),
    [
        ({"quantization_config": {**_QUANT, "quant_method": "gptq"}}, "'gptq'"),
        ({"quantization_config": {**_QUANT, "fmt": "e5m2"}}, "quantization_config.fmt"),
        ({"quantization_config": {"quant_method": "fp8"}}, "weight_block_size"),
        (
            {"quantization_config": {**_QUANT, "activation_scheme": "static"}},
            "activation_scheme",
        ),
        ({"attention_projection_layout": "fused_qkvz"}, "attention_projection_layout"),
        ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
    ],
    ids=["gptq", "e5m2", "no-block", "static", "layout", "arch"],
)
def test_unsupported_official_config_is_named(edits: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict({**mimo_config(), **edits})
    _assert_error_names(err, named)


def test_official_config_keys_parse() -> None:
    cfg = ModelConfig.from_dict(
        {
            **mimo_config(),
            "architectures": ["MiMoV2ForCausalLM"],
            "attention_projection_layout": "fused_qkv",
            "quantization_config": {**_QUANT, "ignored_layers": ["lm_head"]},
        }
    )
    assert cfg.attention_projection_layout == "fused_qkv"
    assert cfg.quantization is not None
    assert cfg.quantization.weight_block_size == (128, 128)
    assert cfg.quantization.ignored_layers == ("lm_head",)
