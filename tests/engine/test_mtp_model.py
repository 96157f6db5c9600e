"""MiMo-V2 MTP layers (issue 14): each layer against a plain-torch re-derivation from the raw
tensors, loading in the split and the official fp8 layouts and its errors, and the distillation
that gives the demo model MTP layers that predict it."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine.kv import ContiguousBatch, SequenceKV
from engine.model_config import ConfigError
from engine.models import official
from engine.models.checkpoint import mimo_config, write_official_checkpoint, write_random_checkpoint
from engine.models.loader import CheckpointError, load_model
from engine.models.mimo_v2 import MiMoV2ForCausalLM
from engine.models.mtp import MTPOutput, mtp_config_of
from engine.models.mtp_distill import distill_mtp
from tests.engine.test_official_layout import _plain_dequant

Tensors = dict[str, torch.Tensor]

# NOTE: the SWA geometry (8 q / 4 kv heads of 16, v 8, rope theta 1e4) differs from the full one
# (4 q / 2 kv heads of 32, v 16, theta 1e6), so using the wrong one fails; W = 3 < the 12 rows.
_WINDOW = 3
_SHAPE: dict[str, Any] = dict(
    layers="FSF", sliding_window=_WINDOW, num_key_value_heads=2, num_nextn_predict_layers=2,
    swa_num_attention_heads=8, swa_num_key_value_heads=4, swa_head_dim=16, swa_v_head_dim=8,
)
_TOKENS = [(11 * i + 5) % 300 for i in range(14)]
_BLOCK, _TP = (48, 24), 2  # NOTE: partial edge blocks; tp=2 detectable from the scale rows
_MTP_PREFIX = "model.mtp.layers."


@pytest.fixture(scope="module")
def split_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("split"), mimo_config(**_SHAPE), seed=3)


@pytest.fixture(scope="module")
def official_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("official")
    return write_official_checkpoint(
        out, mimo_config(**_SHAPE), seed=3, qkv_tp_size=_TP, block=_BLOCK, dtype="float32"
    )


# --- builders and helpers -------------------------------------------------------------------------


def _make_edited(src: Path, dst: Path, changes: dict[str, torch.Tensor | None]) -> Path:
    """A copy of ``src`` with tensors replaced (None deletes)."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for name, t in changes.items():
        if t is None:
            del tensors[name]
        else:
            tensors[name] = t
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _module_outputs(
    model: MiMoV2ForCausalLM, tokens: list[int], chunks: tuple[int, ...] = (5,)
) -> list[MTPOutput]:
    """Every MTP layer over its rows, fed through ``ContiguousBatch`` in pieces (``chunks``: where
    one call ends), so the window is applied to cached keys as well."""
    assert model.mtp is not None
    n = model.config.num_hidden_layers
    base = ContiguousBatch([SequenceKV(n)], [len(tokens)])
    with torch.no_grad():
        hidden = model(torch.tensor(tokens), base.positions(), base)
    outs = []
    for k in range(model.mtp.num_layers):
        rows = len(tokens) - 1 - k
        embeds = model.model.embed_tokens(torch.tensor(tokens[1 + k : 1 + k + rows]))
        kv = SequenceKV(n + model.mtp.num_layers)
        parts = []
        for lo, hi in zip((0, *chunks), (*chunks, rows)):
            batch = ContiguousBatch([kv], [hi - lo])
            with torch.no_grad():
                parts.append(model.mtp(k, embeds[lo:hi], hidden[lo:hi], batch.positions(), batch))
            batch.commit()
        out = MTPOutput(*(torch.cat(t) for t in zip(*parts)))
        outs.append(out)
        hidden = out.residual
    return outs


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: int, rotary_dim: int, theta: float) -> torch.Tensor:
    """NeoX rotate-half on the first ``rotary_dim`` dims of each head ([heads, dim])."""
    half = rotary_dim // 2
    freqs = pos / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    cos, sin = freqs.cos(), freqs.sin()
    a, b = x[:, :half], x[:, half:rotary_dim]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, x[:, rotary_dim:]], dim=-1)


def _reference_layer(
    raw: Tensors, cfg: dict[str, Any], i: int, embeds: torch.Tensor, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP layer i from the raw hub tensors, query by query: (logits, pre-norm residual)."""
    w = {n.removeprefix(f"{_MTP_PREFIX}{i}."): t for n, t in raw.items() if n.startswith(
        f"{_MTP_PREFIX}{i}.")}
    eps, heads, kv_heads = cfg["rms_norm_eps"], cfg["swa_num_attention_heads"], cfg[
        "swa_num_key_value_heads"]
    d, dv = cfg["swa_head_dim"], cfg["swa_v_head_dim"]
    rotary_dim = int(d * cfg["partial_rotary_factor"])
    x = torch.cat([_rms(embeds, w["enorm.weight"], eps), _rms(hidden, w["hnorm.weight"], eps)],
                  dim=-1) @ w["eh_proj.weight"].T
    a = _rms(x, w["input_layernorm.weight"], eps)
    q = (a @ w["self_attn.q_proj.weight"].T).view(-1, heads, d)
    k = (a @ w["self_attn.k_proj.weight"].T).view(-1, kv_heads, d)
    v = (a @ w["self_attn.v_proj.weight"].T).view(-1, kv_heads, dv) * cfg["attention_value_scale"]
    theta = cfg["swa_rope_theta"]
    q = torch.stack([_rope(q[p], p, rotary_dim, theta) for p in range(len(q))])
    k = torch.stack([_rope(k[p], p, rotary_dim, theta) for p in range(len(k))])
    sink = w["self_attn.attention_sink_bias"]
    attn = torch.zeros(len(x), heads, dv)
    for p in range(len(x)):
        keys = range(max(0, p - cfg["sliding_window_size"]), p + 1)  # W previous and itself
        for h in range(heads):
            g = h // (heads // kv_heads)
            scores = torch.stack([q[p, h] @ k[j, g] for j in keys]) / math.sqrt(d)
            probs = torch.softmax(torch.cat([scores, sink[h : h + 1]]), dim=0)[:-1]
            attn[p, h] = sum(pr * v[j, g] for pr, j in zip(probs, keys))
    x = x + attn.flatten(1) @ w["self_attn.o_proj.weight"].T
    m = _rms(x, w["post_attention_layernorm.weight"], eps)
    x = x + (F.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) @ w[
        "mlp.down_proj.weight"].T
    logits = _rms(x, w["final_layernorm.weight"], eps) @ raw["lm_head.weight"].T
    return logits, x


def _official_mtp_as_split(official_dir: Path, cfg: dict[str, Any]) -> Tensors:
    """The official files' MTP tensors dequantized and un-fused, without the engine's code."""
    raw = load_file(official_dir / "model.safetensors")
    out: Tensors = {}
    bh, bw = _BLOCK
    for name, t in raw.items():
        if not name.startswith("model.mtp.") or name.endswith("_scale_inv"):
            continue
        if t.dtype != official.FP8:
            out[name] = t.float()
            continue
        chunks = _TP if ".qkv_proj." in name else 1
        scale = raw[name + "_scale_inv"]
        w = torch.cat([_plain_dequant(c, sc, bh, bw)
                       for c, sc in zip(t.chunk(chunks), scale.chunk(chunks), strict=True)])
        if chunks == 1:
            out[name] = w
            continue
        hq, hkv = cfg["swa_num_attention_heads"] // _TP, cfg["swa_num_key_value_heads"] // _TP
        d, dv = cfg["swa_head_dim"], cfg["swa_v_head_dim"]
        parts = [c.split([hq * d, hkv * d, hkv * dv]) for c in w.chunk(_TP)]
        for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            out[name.replace("qkv_proj", proj)] = torch.cat([p[j] for p in parts])
    return out


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got - want).abs().max().item()
    assert err < 1e-4, f"{what}: differs from the reference by up to {err}"


def _mtp_params(model: MiMoV2ForCausalLM) -> Tensors:
    assert model.mtp is not None
    return {n: p.detach().clone() for n, p in model.mtp.named_parameters()}


# --- parity ---------------------------------------------------------------------------------------


def test_mtp_layers_match_a_plain_re_derivation(split_dir: Path) -> None:
    cfg = mimo_config(**_SHAPE)
    model = load_model(split_dir, dtype="float32", mtp_layers=2)
    raw = load_file(split_dir / "model.safetensors")
    base = ContiguousBatch([SequenceKV(3)], [len(_TOKENS)])
    with torch.no_grad():
        hidden = model(torch.tensor(_TOKENS), base.positions(), base)
    outs = _module_outputs(model, _TOKENS)
    for k, out in enumerate(outs):
        rows = len(_TOKENS) - 1 - k
        embeds = raw["model.embed_tokens.weight"][_TOKENS[1 + k : 1 + k + rows]]
        logits, hidden = _reference_layer(raw, cfg, k, embeds, hidden[:rows])
        _assert_close(out.residual, hidden, f"MTP layer {k} residual")
        _assert_close(model.compute_logits(out.hidden), logits, f"MTP layer {k} logits")


def test_chunked_rows_equal_one_pass(split_dir: Path) -> None:
    model = load_model(split_dir, dtype="float32", mtp_layers=2)
    one = _module_outputs(model, _TOKENS, chunks=())
    for a, b in zip(one, _module_outputs(model, _TOKENS, chunks=(2, 3, 7))):
        _assert_close(a.hidden, b.hidden, "chunked MTP rows")


# --- loading --------------------------------------------------------------------------------------


def test_official_fp8_layout_loads_the_same_mtp_weights(
    split_dir: Path, official_dir: Path, tmp_path: Path
) -> None:
    ours = load_model(official_dir, dtype="float32", mtp_layers=2)
    base = {n: p for n, p in ours.state_dict().items() if not n.startswith("mtp.")}
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    tensors = {**base, **_official_mtp_as_split(official_dir, mimo_config(**_SHAPE))}
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(ref_dir / "model.safetensors"))
    shutil.copy(split_dir / "config.json", ref_dir / "config.json")
    ref = load_model(ref_dir, dtype="float32", mtp_layers=2)

    mine, theirs = _mtp_params(ours), _mtp_params(ref)
    differ = [n for n in mine if not torch.equal(mine[n], theirs[n])]
    assert not differ, f"MTP parameters differ between the layouts: {differ}"
    for a, b in zip(_module_outputs(ours, _TOKENS), _module_outputs(ref, _TOKENS)):
        assert torch.equal(a.hidden, b.hidden) and torch.equal(a.residual, b.residual)


def test_official_layout_is_close_to_the_split_weights(split_dir: Path, official_dir: Path) -> None:
    """Same seed: fp8 rounding apart, the official checkpoint holds the split one's MTP weights."""
    fp8, exact = (_mtp_params(load_model(d, dtype="float32", mtp_layers=2))
                  for d in (official_dir, split_dir))
    for name, want in exact.items():
        err = (fp8[name] - want).abs().max().item()
        assert err <= want.abs().max().item() / 16, f"{name}: off by {err}"


def test_no_mtp_requested_skips_them(split_dir: Path) -> None:
    assert load_model(split_dir, dtype="float32").mtp is None
    one = load_model(split_dir, dtype="float32", mtp_layers=1)
    assert one.mtp is not None and one.mtp.num_layers == 1 and one.mtp.layer_id(0) == 3


@pytest.mark.parametrize("declared", [None, 1])
def test_more_layers_than_declared_is_a_config_error(
    split_dir: Path, tmp_path: Path, declared: int | None
) -> None:
    model_dir = shutil.copytree(split_dir, tmp_path / "ckpt")
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.pop("num_nextn_predict_layers")
    if declared is not None:
        cfg["num_mtp_layers"] = declared  # an alias key
    (model_dir / "config.json").write_text(json.dumps(cfg))
    assert mtp_config_of(cfg) == (declared or 0)
    with pytest.raises(ConfigError) as err:
        load_model(model_dir, dtype="float32", mtp_layers=2)
    assert f"2 MTP layer(s) requested, but config.json declares {declared or 0}" in str(err.value)


@pytest.mark.parametrize(
    ("name", "tensor", "needles"),
    [
        ("model.mtp.layers.1.eh_proj.weight", None, ("missing", "(64, 128)")),
        ("model.mtp.layers.0.self_attn.k_proj.weight", None, ("missing", "(64, 64)")),
        ("model.mtp.layers.0.enorm.weight", torch.ones(63), ("(63,)", "(64,)")),
        ("model.mtp.layers.1.mlp.up_proj.weight", torch.ones(128, 63), ("(128, 63)",)),
    ],
)
def test_missing_or_misshaped_mtp_tensor_is_named(
    split_dir: Path, tmp_path: Path, name: str, tensor: torch.Tensor | None,
    needles: tuple[str, ...],
) -> None:
    model_dir = _make_edited(split_dir, tmp_path / "ckpt", {name: tensor})
    with pytest.raises(CheckpointError) as err:
        load_model(model_dir, dtype="float32", mtp_layers=2)
    for part in (name, *needles):
        assert part in str(err.value), f"{part!r} not in the error: {err.value}"
    load_model(model_dir, dtype="float32")  # not requested: not read


def test_pre_mlp_layernorm_alias_and_extra_layers(split_dir: Path, tmp_path: Path) -> None:
    raw = load_file(split_dir / "model.safetensors")
    old = "model.mtp.layers.0.post_attention_layernorm.weight"
    changes: dict[str, torch.Tensor | None] = {
        old: None,
        old.replace("post_attention", "pre_mlp"): raw[old],
        "model.mtp.layers.7.eh_proj.weight": torch.ones(3),  # beyond the layers asked for
    }
    model_dir = _make_edited(split_dir, tmp_path / "ckpt", changes)
    got = _mtp_params(load_model(model_dir, dtype="float32", mtp_layers=2))
    want = _mtp_params(load_model(split_dir, dtype="float32", mtp_layers=2))
    assert all(torch.equal(got[n], want[n]) for n in want)


# --- distillation ---------------------------------------------------------------------------------

_DISTILL: dict[str, Any] = dict(
    steps=40, seed=1, num_seqs=24, prompt_len=8, new_tokens=24, batch_seqs=8, lr=1e-2
)


def test_distillation_is_deterministic_and_learns(split_dir: Path, tmp_path: Path) -> None:
    model_dir = shutil.copytree(split_dir, tmp_path / "ckpt")
    in_memory = load_model(split_dir, dtype="float32", mtp_layers=2)
    first = distill_mtp(in_memory, **_DISTILL)
    second = distill_mtp(model_dir, **_DISTILL)  # writes the trained layers back

    assert first.agreement == second.agreement
    saved = _mtp_params(load_model(model_dir, dtype="float32", mtp_layers=2))
    trained = _mtp_params(in_memory)
    differ = [n for n in trained if not torch.equal(saved[n], trained[n])]
    assert not differ, f"two distillations differ in {differ}"
    for k, (before, after) in enumerate(zip(first.untrained_agreement, first.agreement)):
        # NOTE: chance is 1/320; the demo reaches ~0.23 (an untrained layer ~0.004)
        assert after > before + 0.1, f"MTP layer {k}: top-1 agreement {before:.3f} -> {after:.3f}"
