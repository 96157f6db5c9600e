"""The oracle: our MiMo-V2 forward matches transformers' ``MiMoV2FlashForCausalLM``.

Every config is written as a random checkpoint, loaded by both, and compared on logits for every
prompt length 1 .. 3W + 5, on incremental (cached) decoding across the window boundaries, and on
64 greedy tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.kv import ContiguousBatch, SequenceKV
from engine.llm import LLM
from engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

TOL = {"float32": 1e-4, "bfloat16": 2e-2}


@dataclass(frozen=True)
class Case:
    name: str
    dtype: str
    kwargs: dict[str, Any]

    @property
    def window(self) -> int:
        return int(self.kwargs["sliding_window"])


CASES = [
    Case(
        "w4-moe-groups",
        "float32",
        dict(
            layers="FSSSF",
            sliding_window=4,
            mlp="DMMMM",
            n_group=4,
            topk_group=2,
            n_routed_experts=8,
            num_experts_per_tok=3,
        ),
    ),
    Case(
        "w16-dense-sparse-mixed",
        "float32",
        dict(
            layers="FSSFSSF",
            sliding_window=16,
            mlp="DMDMMDM",
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
        ),
    ),
    Case(
        "w4-odd-rotary-bias-tied",
        "float32",
        dict(
            layers="FSSF",
            sliding_window=4,
            partial_rotary_factor=0.3,
            attention_bias=True,
            tie_word_embeddings=True,
            n_group=1,
            topk_group=1,
            head_dim=32,
            v_head_dim=32,
        ),
    ),
    Case(
        "w4-bf16",
        "bfloat16",
        dict(layers="FSSSF", sliding_window=4, mlp="DMMMM", n_group=4, topk_group=2),
    ),
    Case(
        "w16-bf16",
        "bfloat16",
        dict(
            layers="FSSFSSF",
            sliding_window=16,
            mlp="DMDMMDM",
            partial_rotary_factor=0.334,
            head_dim=48,
            v_head_dim=16,
        ),
    ),
]


@dataclass
class Pair:
    case: Case
    ours: LLM
    ref: Any
    prompt: list[int]


@pytest.fixture(scope="module", params=CASES, ids=[c.name for c in CASES])
def pair(request: pytest.FixtureRequest, make_checkpoint) -> Pair:
    case: Case = request.param
    model_dir: Path = make_checkpoint(seed=len(case.name), dtype=case.dtype, **case.kwargs)
    ours = LLM(model_dir, dtype=case.dtype, device="cpu")
    ref = transformers.MiMoV2FlashForCausalLM.from_pretrained(
        model_dir,
        dtype=getattr(torch, case.dtype),
        attn_implementation="eager",
        experts_implementation="eager",
    ).eval()
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, ours.config.vocab_size, (3 * case.window + 5,), generator=gen)
    return Pair(case, ours, ref, prompt.tolist())


def test_config_seen_the_same_way(pair: Pair) -> None:
    ref_cfg, ours = pair.ref.config, pair.ours.config
    assert list(ours.layer_types) == list(ref_cfg.layer_types)
    assert list(ours.mlp_layer_types) == list(ref_cfg.mlp_layer_types)
    assert ours.sliding_window + 1 == ref_cfg.sliding_window == pair.case.window + 1


@torch.inference_mode()
def test_logits_for_every_prompt_length(pair: Pair) -> None:
    tol = TOL[pair.case.dtype]
    ref_logits = _ref_logits(pair.ref, pair.prompt)
    _assert_close(pair.ours.prompt_logits(pair.prompt), ref_logits, tol, "full prompt")
    # every prefix as its own request, all prefilled together in one batched forward
    lengths = range(1, len(pair.prompt) + 1)
    llm = pair.ours
    batch = ContiguousBatch([SequenceKV(llm.config.num_hidden_layers) for _ in lengths], lengths)
    ids = torch.tensor([t for n in lengths for t in pair.prompt[:n]])
    last = llm.model.compute_logits(
        llm.model(ids, batch.positions(), batch)[batch.last_token_rows()]
    )
    for n in lengths:
        _assert_close(last[n - 1], ref_logits[n - 1], tol, f"prompt length {n}")


@torch.inference_mode()
def test_cached_decode_matches_uncached_forward(pair: Pair) -> None:
    """Prefill a prefix, then feed the rest through the KV cache (one token, then chunks of 3)."""
    tol, w = TOL[pair.case.dtype], pair.case.window
    ref_logits = _ref_logits(pair.ref, pair.prompt)
    for split in sorted({1, w - 1, w, w + 1, 2 * w, 2 * w + 1}):
        for step in (1, 3):
            ours = _incremental_logits(pair.ours, pair.prompt, split, step)
            _assert_close(ours, ref_logits[split - 1 :], tol, f"prefill {split} then step {step}")


@torch.inference_mode()
def test_greedy_64_tokens_identical(pair: Pair) -> None:
    prompts = [pair.prompt[:n] for n in (1, pair.case.window + 1, len(pair.prompt))]
    params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    outs = pair.ours.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        ref = pair.ref.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=64,
            min_new_tokens=64,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert list(out.token_ids) == ref, (
            f"greedy tokens diverge at index "
            f"{next(i for i, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b)} "
            f"for a {len(prompt)}-token prompt"
        )
        assert out.finish_reason == "length"


@torch.inference_mode()
def test_window_boundary_tokens(make_checkpoint) -> None:
    """One SWA layer: the query at p sees tokens p - W .. p, and nothing older.

    Changing the token at p - W changes the logits at p; changing the one at p - W - 1 does not,
    in our engine and in the reference alike.
    """
    w = 5
    model_dir = make_checkpoint(seed=3, layers="S", mlp="D", sliding_window=w)
    ours = LLM(model_dir, dtype="float32", device="cpu")
    ref = transformers.MiMoV2FlashForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prompt = list(range(10, 10 + 3 * w))
    p = len(prompt) - 1
    base = ours.prompt_logits(prompt)[p]
    for offset, should_change in ((w, True), (w + 1, False), (w + 2, False)):
        edited = list(prompt)
        edited[p - offset] += 100
        for name, logits in (
            ("ours", ours.prompt_logits(edited)[p]),
            ("transformers", _ref_logits(ref, edited)[p]),
        ):
            changed = (logits - base).abs().max().item() > 1e-6
            assert changed == should_change, (
                f"{name}: editing the token {offset} positions back "
                f"{'should' if should_change else 'should not'} change the logits (W={w})"
            )


def _incremental_logits(llm: LLM, prompt: list[int], split: int, step: int) -> torch.Tensor:
    seq = SequenceKV(llm.config.num_hidden_layers)
    chunks = [prompt[:split]] + [prompt[i : i + step] for i in range(split, len(prompt), step)]
    rows = []
    for chunk in chunks:
        batch = ContiguousBatch([seq], [len(chunk)])
        hidden = llm.model(torch.tensor(chunk), batch.positions(), batch)
        batch.commit()
        logits = llm.model.compute_logits(hidden)
        rows.append(logits[-1:] if not rows else logits)
    return torch.cat(rows)


def _ref_logits(ref: Any, prompt: list[int]) -> torch.Tensor:
    return ref(torch.tensor([prompt])).logits[0].float()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    err = (ours - ref).abs().max().item()
    assert err <= tol, f"{what}: max |ours - transformers| = {err:.3g} > {tol}"
