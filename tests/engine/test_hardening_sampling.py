"""Issue 8, items 17 and 19 (engine side): ``logit_bias`` and ``repetition_penalty`` in the sampler
and the sim backend, and the sim backend's ``seed``.

Property tests pin the math (a +100 bias wins greedy and sampled draws, -100 bans, a penalty > 1
never raises the repeated tokens' mass nor lowers anyone else's, CTRL's formula exactly); worker
subprocesses on real ZeroMQ show the parameters arrive and act: a native worker on a tiny random
model and the sim worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampler import Sampler, apply_logit_bias, apply_repetition_penalty, make_generator
from engine.sampling_params import SamplingParams
from gateway.serve import WorkerProcess
from tests.engine.worker_harness import (
    VOCAB,
    Client,
    assert_finished,
    make_prompt,
    running,
    start_native_worker,
    tokens,
)

_fast = settings(max_examples=60, deadline=None)
_logit_lists = st.lists(
    st.floats(min_value=-30, max_value=30, allow_nan=False, width=32), min_size=2, max_size=40
)


@pytest.fixture(autouse=True)
def _seeded_default_rng() -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


# --- logit_bias -----------------------------------------------------------------------------------


@_fast
@given(logits=_logit_lists, data=st.data())
def test_a_bias_of_plus_100_wins_greedy_and_sampled_draws(
    logits: list[float], data: st.DataObject
) -> None:
    token = data.draw(st.integers(0, len(logits) - 1))
    seed = data.draw(st.integers(0, 2**32))
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=seed, logit_bias=((token, 100.0),))
        out = _sample(torch.tensor([logits]), [params], seeds=[seed])
        assert out.token_ids.tolist() == [token], (temperature, out.token_ids)


@_fast
@given(logits=_logit_lists, seed=st.integers(0, 2**32))
def test_a_bias_of_minus_100_bans_the_token(logits: list[float], seed: int) -> None:
    top = max(range(len(logits)), key=lambda i: logits[i])
    for temperature in (0.0, 1.0, 5.0):
        params = SamplingParams(temperature=temperature, logit_bias=((top, -100.0),))
        out = _sample(torch.tensor([logits] * 8), [params] * 8, seeds=range(seed, seed + 8))
        assert top not in out.token_ids.tolist(), (temperature, out.token_ids)


def test_logit_bias_adds_to_its_rows_only_and_keeps_raw_logprobs() -> None:
    logits = torch.randn(3, 16)
    params = [SamplingParams(temperature=0.0, logprobs=0, logit_bias=((3, 5.0), (7, -2.5))),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=0.0, logprobs=0, logit_bias=((0, 50.0),))]
    biased = apply_logit_bias(logits, params)
    expected = logits.clone()
    expected[0, 3] += 5.0
    expected[0, 7] -= 2.5
    expected[2, 0] += 50.0
    assert torch.equal(biased, expected), (biased - logits)
    out = _sample(logits, params)
    assert out.token_ids[2].item() == 0
    raw = torch.log_softmax(logits, dim=-1).gather(-1, out.token_ids[:, None]).squeeze(-1)
    assert out.logprobs is not None and torch.equal(out.logprobs, raw)


# --- repetition_penalty ---------------------------------------------------------------------------


@_fast
@given(logits=_logit_lists, data=st.data())
def test_repetition_penalty_is_ctrl_and_never_helps_repeated_tokens(
    logits: list[float], data: st.DataObject
) -> None:
    history = data.draw(st.lists(st.integers(0, len(logits) - 1), max_size=60))
    penalty = data.draw(st.floats(min_value=1.0, max_value=10.0))
    row = torch.tensor([logits])
    params = [SamplingParams(repetition_penalty=penalty)]
    out = apply_repetition_penalty(row, params, [history])
    seen = set(history)
    expected = [(v / penalty if v > 0 else v * penalty) if i in seen else v
                for i, v in enumerate(logits)]
    assert out[0].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6), (history, penalty)
    before, after = row.softmax(-1)[0], out.softmax(-1)[0]
    repeated = sorted(seen)
    others = [i for i in range(len(logits)) if i not in seen]
    assert after[repeated].sum() <= before[repeated].sum() + 1e-6
    assert (after[others] >= before[others] - 1e-6).all()


def test_repetition_penalty_touches_only_its_rows() -> None:
    logits = torch.randn(3, 32)
    params = [SamplingParams(), SamplingParams(repetition_penalty=2.0), SamplingParams()]
    out = apply_repetition_penalty(logits, params, [[1, 2], [4, 4, 9], [5]])
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    changed = (out[1] != logits[1]).nonzero().flatten().tolist()
    assert changed == [i for i in (4, 9) if logits[1, i] != 0], changed


def test_sampler_penalizes_repeats_greedy() -> None:
    logits = torch.tensor([[3.0, 2.9, -1.0, 0.5]])
    plain = SamplingParams(temperature=0.0)
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert _sample(logits, [plain], history=[[0]]).token_ids.tolist() == [0]
    assert _sample(logits, [penalized], history=[[0]]).token_ids.tolist() == [1]  # 3/1.5 < 2.9


# --- end to end through workers -------------------------------------------------------------------


@pytest.fixture(scope="module")
def native_worker(make_checkpoint: Callable[..., Path]) -> Iterator[WorkerProcess]:
    model_dir = make_checkpoint(layers="FSSF", sliding_window=4)
    with running(start_native_worker(model_dir)) as worker:
        yield worker


def test_native_worker_honours_logit_bias_and_repetition_penalty(
    native_worker: WorkerProcess, connect: Callable[[str], Client]
) -> None:
    client = connect(native_worker.listen)
    prompt = make_prompt(12)
    client.generate("bias", prompt, max_new_tokens=6, temperature=1.0, seed=1,
                    logit_bias=[(123, 100.0)])
    deltas, last = client.collect("bias")
    assert_finished(last, "length", 6)
    assert tokens(deltas) == [123] * 6
    # NOTE: a huge penalty sends every seen token's logit to ~0 or far below, so greedy picks an
    # unseen token while any unseen one has a positive logit (always, on 320 random logits)
    client.generate("penalty", prompt, max_new_tokens=16, temperature=0.0, ignore_eos=True,
                    repetition_penalty=1e6)
    deltas, last = client.collect("penalty")
    assert_finished(last, "length", 16)
    out = tokens(deltas)
    assert len(set(out)) == len(out) and not set(out) & set(prompt), (out, prompt)


def test_sim_worker_honours_logit_bias(client: Client) -> None:
    banned = [(t, -100.0) for t in range(VOCAB) if t not in (5, 6)]
    client.generate("two", make_prompt(8), max_new_tokens=40, logit_bias=banned)
    deltas, last = client.collect("two")
    assert_finished(last, "length", 40)
    assert set(tokens(deltas)) == {5, 6}, tokens(deltas)
    client.generate("one", make_prompt(8), max_new_tokens=10, temperature=0.0,
                    logit_bias=[(77, 100.0)])
    deltas, last = client.collect("one")
    assert tokens(deltas) == [77] * 10


def test_sim_worker_honours_seed(client: Client) -> None:
    prompt = make_prompt(10)
    runs = {}
    for rid, seed in (("a", 7), ("b", 7), ("c", 8)):
        client.generate(rid, prompt, max_new_tokens=20, temperature=0.8, seed=seed)
        deltas, last = client.collect(rid)
        assert_finished(last, "length", 20)
        runs[rid] = tokens(deltas)
    assert runs["a"] == runs["b"], runs
    assert runs["a"] != runs["c"], runs
    client.generate("other-prompt", make_prompt(10), max_new_tokens=20, temperature=0.8, seed=7)
    deltas, _ = client.collect("other-prompt")
    assert tokens(deltas) != runs["a"]


def test_logit_bias_ids_outside_the_vocabulary_are_refused(client: Client) -> None:
    client.generate("oob", make_prompt(4), logit_bias=[(VOCAB, 1.0)])
    _, last = client.collect("oob")
    assert getattr(last, "code", None) == "invalid_request", last
    assert "logit_bias" in last.message, last  # type: ignore[union-attr]


# ---------------------------------------------------------------------- helpers


def _sample(logits: torch.Tensor, params: list[SamplingParams], seeds: object = None,
            history: list[list[int]] | None = None):  # noqa: ANN202
    gens = [None] * len(params) if seeds is None else [make_generator(s, "cpu") for s in seeds]
    return Sampler().sample(logits, params, gens, history=history)
