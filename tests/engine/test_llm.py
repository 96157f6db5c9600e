"""The offline ``LLM`` API: batching, stop conditions, logprobs, seeds, validation, O(W) SWA KV."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.kv import ContiguousBatch, SequenceKV
from engine.llm import LLM
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(tiny_model_dir, dtype="float32", device="cpu")


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (3 + 5 * i,), generator=gen).tolist() for i in range(n)]


def test_batched_generation_equals_one_at_a_time(llm: LLM) -> None:
    prompts = _prompts(4, llm.config.vocab_size)
    batched = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, batched):
        [alone] = llm.generate([prompt], GREEDY)
        assert out.token_ids == alone.token_ids, f"prompt of {len(prompt)} tokens"
        assert out.prompt_token_ids == tuple(prompt)


def test_stop_token_ends_the_request_at_its_first_occurrence(llm: LLM) -> None:
    [prompt] = _prompts(1, llm.config.vocab_size, seed=1)
    full = llm.generate([prompt], GREEDY)[0].token_ids
    stop = full[5]
    first = full.index(stop)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True,
                            stop_token_ids=(stop,))
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == full[: first + 1] and out.finish_reason == "stop"


def test_eos_stops_unless_ignored(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The config's eos (7) plus generation_config.json's eos ids are stop tokens."""
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    for f in tiny_model_dir.iterdir():
        (model_dir / f.name).symlink_to(f)
    probe = LLM(tiny_model_dir)
    [prompt] = _prompts(1, probe.config.vocab_size, seed=2)
    full = probe.generate([prompt], GREEDY)[0].token_ids
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [full[3]]}))
    llm = LLM(model_dir)
    assert llm.eos_token_ids == (7, full[3])
    out = llm.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in (7, full[3])
    assert len(out.token_ids) <= 4
    assert llm.generate([prompt], GREEDY)[0].token_ids == full


def test_max_new_tokens_gives_length(llm: LLM) -> None:
    out = llm.generate(_prompts(1, llm.config.vocab_size), GREEDY)[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"


def test_logprobs_are_those_of_the_raw_distribution(llm: LLM) -> None:
    [prompt] = _prompts(1, llm.config.vocab_size, seed=3)
    params = SamplingParams(max_new_tokens=6, temperature=0.7, seed=11, logprobs=3,
                            ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert out.logprobs is not None and out.top_logprobs is not None
    assert len(out.logprobs) == len(out.top_logprobs) == 6
    context = list(prompt)
    for token, logprob, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        expected = torch.log_softmax(llm.prompt_logits(context)[-1], dim=-1)
        assert abs(expected[token].item() - logprob) < 1e-4
        ids, values = zip(*top)
        assert list(ids) == expected.topk(3).indices.tolist()
        assert all(a >= b for a, b in zip(values, values[1:]))
        context.append(token)


def test_seeded_sampling_is_reproducible_and_batch_invariant(llm: LLM) -> None:
    prompts = _prompts(3, llm.config.vocab_size, seed=4)
    seeded = SamplingParams(max_new_tokens=10, temperature=1.0, seed=123, ignore_eos=True)
    other = SamplingParams(max_new_tokens=10, temperature=1.0, seed=124, ignore_eos=True)
    alone = llm.generate([prompts[1]], seeded)[0].token_ids
    in_batch = llm.generate(prompts, [other, seeded, other])[1].token_ids
    assert alone == in_batch
    assert llm.generate([prompts[1]], other)[0].token_ids != alone


@pytest.mark.parametrize(
    ("prompts", "params", "message"),
    [
        ([[]], GREEDY, "prompt is empty"),
        ([[1, 2, 10_000]], GREEDY, "outside the vocabulary"),
        ([[1] * 8000], SamplingParams(max_new_tokens=500), "exceeds the model's context"),
        ([[1], [2]], [GREEDY], "2 prompts"),
    ],
)
def test_bad_input_is_a_clear_value_error(llm: LLM, prompts, params, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params)


@torch.inference_mode()
def test_running_request_holds_o_w_swa_kv(llm: LLM) -> None:
    """SWA layers keep the last W tokens; full layers keep all, through prefill and decode."""
    cfg, w = llm.config, llm.config.sliding_window
    seq = SequenceKV(cfg.num_hidden_layers)
    tokens = _prompts(1, cfg.vocab_size, seed=5)[0] + list(range(40))
    chunks = [tokens[:7]] + [[t] for t in tokens[7:]]
    for chunk in chunks:
        batch = ContiguousBatch([seq], [len(chunk)])
        llm.model(torch.tensor(chunk), batch.positions(), batch)
        batch.commit()
        for i in cfg.swa_layer_ids:
            kept = seq.kept_tokens(i)
            assert kept == min(w, seq.num_tokens), f"SWA layer {i} at {seq.num_tokens}: {kept}"
            assert seq.start[i] == seq.num_tokens - seq.kept_tokens(i)
        for i in cfg.full_layer_ids:
            assert seq.kept_tokens(i) == seq.num_tokens, f"full layer {i}"
