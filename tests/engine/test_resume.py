"""A request resumed with its output so far appended to its prompt (``resumed_tokens``, how the
gateway moves a stream off a lost worker) generates exactly the rest of what the uninterrupted
run generates: greedy, seeded sampling and grammar-constrained alike, on the native engine and
on the sim."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from engine.models.checkpoint import mimo_config, write_random_checkpoint
from engine.sampler import position_seed
from engine.sampling_params import StructuredSpec
from gateway.tokenizer import write_demo_tokenizer

EOS = (258, 256)
PROMPT = [72, 105, 33, 10, 259, 1, 40, 41, 42]
SCHEMA = {"type": "object", "properties": {"xs": {"type": "array", "maxItems": 6, "items": {
    "type": "integer", "minimum": 0, "maximum": 999}}}, "required": ["xs"],
    "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    out = tmp_path_factory.mktemp("resume-model")
    write_random_checkpoint(out, mimo_config(layers="FSSF", sliding_window=4,
                                             eos_token_id=list(EOS)))
    write_demo_tokenizer(out)
    return LLM(out, dtype="float32", device="cpu", page_size=4)


def _resumed(llm: LLM, params: SamplingParams, k: int) -> tuple[tuple[int, ...], ...]:
    """(the whole run's tokens, the resumed run's tokens after the first k)."""
    [whole] = llm.generate([PROMPT], params)
    assert len(whole.token_ids) > k, whole
    rest = replace(params, max_new_tokens=params.max_new_tokens - k, resumed_tokens=k)
    [resumed] = llm.generate([PROMPT + list(whole.token_ids[:k])], rest)
    return whole.token_ids, resumed.token_ids


@pytest.mark.parametrize("k", [1, 5, 11])
@pytest.mark.parametrize("kind", ["greedy", "seeded", "seeded-top-p", "grammar"])
def test_a_resumed_run_goes_on_as_the_whole_run(llm: LLM, kind: str, k: int) -> None:
    params = {
        "greedy": SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True),
        "seeded": SamplingParams(max_new_tokens=16, seed=7, ignore_eos=True),
        "seeded-top-p": SamplingParams(max_new_tokens=16, seed=8, top_p=0.8, temperature=1.3,
                                       ignore_eos=True),
        "grammar": SamplingParams(max_new_tokens=40, seed=9, structured=StructuredSpec(
            json_schema=json.dumps(SCHEMA))),
    }[kind]
    whole, resumed = _resumed(llm, params, k)
    assert resumed == whole[k:], (kind, k, whole, resumed)
    if kind == "grammar":
        assert whole[-1] in EOS and json.loads(bytes(whole[:-1]))  # NOTE: valid, and ended


def test_resumed_tokens_must_leave_a_prompt(llm: LLM) -> None:
    params = SamplingParams(max_new_tokens=8, seed=7, resumed_tokens=len(PROMPT))
    with pytest.raises(ValueError, match="resumed_tokens=9: must be below the prompt's 9"):
        llm.engine.make_sequence("x", PROMPT, params)
    with pytest.raises(ValueError, match="resumed_tokens"):
        SamplingParams(resumed_tokens=-1)


@pytest.fixture(scope="module")
def sim_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    model = tmp_path_factory.mktemp("sim-resume")
    (model / "config.json").write_text(json.dumps(mimo_config(layers="FSSF", sliding_window=4)))
    return Engine(EngineConfig(model_path=str(model), backend="sim"))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), k=st.integers(1, 10), prompt=st.lists(
    st.integers(0, 255), min_size=1, max_size=12))
def test_the_sim_resumes_seeded_runs_too(sim_engine: Engine, seed: int, k: int,
                                         prompt: list[int]) -> None:
    params = SamplingParams(max_new_tokens=12, seed=seed)
    whole = _run(sim_engine, prompt, params)
    rest = _run(sim_engine, prompt + whole[:k],
                replace(params, max_new_tokens=12 - k, resumed_tokens=k))
    assert rest == whole[k:]


def test_position_seeds_differ_by_position_and_seed() -> None:
    seeds = {position_seed(s, p) for s in range(50) for p in range(50)}
    assert len(seeds) == 2500 and all(0 <= x < 2**63 for x in seeds)


_ids = itertools.count()


def _run(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    seq = engine.make_sequence(f"r{next(_ids)}", prompt, params)
    engine.add(seq)
    while engine.has_work:
        engine.step()
    return list(seq.output_ids)
