"""gateway.routing.cost: predicted TTFT against the real engine's sim backend, step by step."""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.cost import H200_COST, CostModel
from engine.engine import Engine
from engine.model_config import ModelConfig
from engine.models.checkpoint import DEMO_CONFIG
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from gateway.routing.cost import predict_ttft_s, prefill_qk_pairs, prefill_work_s

PAGE = 16
COSTS = {"cpu": CostModel(), "h200": H200_COST}


def _make_engine(cost: CostModel, batch_tokens: int) -> Engine:
    cfg = EngineConfig(backend="sim", page_size=PAGE, max_num_batched_tokens=batch_tokens)
    return Engine(cfg, ModelConfig.from_dict(DEMO_CONFIG), cost=cost)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300) for _ in range(n)]


def _submit(engine: Engine, rid: str, prompt: list[int], max_new_tokens: int = 1) -> Sequence:
    seq = engine.make_sequence(rid, prompt, SamplingParams(max_new_tokens=max_new_tokens,
                                                           temperature=0.0, ignore_eos=True))
    engine.add(seq)
    return seq


def _run_until_first_token(engine: Engine, seq: Sequence) -> float:
    """Simulated seconds from now until ``seq`` has its first token."""
    start = engine.runner.clock_s
    for _ in range(100_000):
        if seq.output_ids:
            return engine.runner.clock_s - start
        engine.step()
    raise AssertionError(f"{seq.request_id}: no first token")


def _drain(engine: Engine) -> None:
    for _ in range(100_000):
        if not engine.has_work:
            return
        engine.step()
    raise AssertionError("engine never drained")


def _assert_close(predicted: float, simulated: float, rel: float) -> None:
    assert predicted == pytest.approx(simulated, rel=rel), (
        f"predicted {predicted:.6f} s, simulated {simulated:.6f} s")


def test_qk_pairs_closed_form_is_the_chunk_sum() -> None:
    for cached, uncached, chunk in [(0, 1, 8), (5, 17, 8), (64, 1000, 512), (0, 512, 512)]:
        total, c, left = 0, cached, uncached
        while left:
            q = min(chunk, left)
            total += q * (c + q)
            c, left = c + q, left - q
        assert prefill_qk_pairs(cached, uncached, chunk) == total, (cached, uncached, chunk)
    assert prefill_qk_pairs(10, 0, 8) == 0


@pytest.mark.parametrize("preset", sorted(COSTS))
@pytest.mark.parametrize(("num_tokens", "batch_tokens"), [(1500, 512), (300, 512), (4097, 1024)])
def test_ttft_on_an_idle_worker_is_the_sims(preset: str, num_tokens: int,
                                            batch_tokens: int) -> None:
    cost = COSTS[preset]
    engine = _make_engine(cost, batch_tokens)
    seq = _submit(engine, "r", _prompt(1, num_tokens))
    simulated = _run_until_first_token(engine, seq)
    predicted = predict_ttft_s(cost, batch_tokens, uncached_tokens=num_tokens,
                               qk_pairs=prefill_qk_pairs(0, num_tokens, batch_tokens))
    _assert_close(predicted, simulated, rel=1e-6)


@pytest.mark.parametrize("preset", sorted(COSTS))
def test_ttft_with_a_cached_prefix_is_the_sims(preset: str) -> None:
    cost = COSTS[preset]
    engine = _make_engine(cost, 512)
    first = _submit(engine, "a", _prompt(2, 2000), max_new_tokens=4)
    _drain(engine)
    prompt = list(first.prompt_ids) + list(first.output_ids) + _prompt(3, 700)
    matched_before = engine.cache.stats.matched_tokens
    seq = _submit(engine, "b", prompt)
    simulated = _run_until_first_token(engine, seq)
    cached = engine.cache.stats.matched_tokens - matched_before
    assert cached >= 1900, f"the engine matched only {cached} tokens"
    uncached = len(prompt) - cached
    predicted = predict_ttft_s(cost, 512, uncached_tokens=uncached,
                               qk_pairs=prefill_qk_pairs(cached, uncached, 512))
    _assert_close(predicted, simulated, rel=1e-6)


@pytest.mark.parametrize("preset", sorted(COSTS))
def test_ttft_behind_queued_prefill_is_close_to_the_sims(preset: str) -> None:
    """Two cold prompts sent together: the second waits for the first's prefill, then shares
    steps with its decode (the estimate ignores that decode; within 10 %)."""
    cost = COSTS[preset]
    engine = _make_engine(cost, 512)
    _submit(engine, "a", _prompt(4, 3000), max_new_tokens=64)
    seq = _submit(engine, "b", _prompt(5, 1200))
    simulated = _run_until_first_token(engine, seq)
    predicted = predict_ttft_s(cost, 512, uncached_tokens=1200,
                               qk_pairs=prefill_qk_pairs(0, 1200, 512), queued_tokens=3000,
                               queued_qk_pairs=prefill_qk_pairs(0, 3000, 512))
    _assert_close(predicted, simulated, rel=0.10)


def test_decodes_take_budget_and_time() -> None:
    idle = predict_ttft_s(H200_COST, 512, uncached_tokens=5000, qk_pairs=0)
    busy = predict_ttft_s(H200_COST, 512, uncached_tokens=5000, qk_pairs=0, num_decoding=256)
    # half the budget goes to decodes: twice the steps, each with 256 decode tokens' cost
    assert busy > 2 * idle
    assert prefill_work_s(H200_COST, 1000, 0) == pytest.approx(1000 * 5e-5)
