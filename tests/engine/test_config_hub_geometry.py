"""ModelConfig: a hub-only config whose SWA layers have their own geometry (kv heads, head dims)
is honoured by the parsed config, the weights built, forward, cached generation and loading."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.llm import LLM
from engine.model_config import FULL, SWA, ModelConfig
from engine.models.checkpoint import mimo_config, write_random_checkpoint
from engine.models.loader import load_model
from engine.sampling_params import SamplingParams
from tests.engine.config_helpers import assert_fields, make_dialect

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
    raw = make_dialect(raw, "hub")
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
    assert_fields(
        cfg.full,
        {"num_heads": 6, "num_kv_heads": 2, "head_dim": 32, "v_head_dim": 16, "rotary_dim": 16},
        "hub full",
    )
    assert_fields(
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

