"""Scheduler: continuous batching, chunked prefill, admission by memory, preemption, priorities,
abort, stop conditions and the bounded queue (issue 3, "Scheduler and batching").

The sim backend where only the bookkeeping matters, the native tiny model where tokens do.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv.layout import KVLayout
from engine.llm import LLM
from engine.model_config import ModelConfig
from engine.models.checkpoint import mimo_config
from engine.sampling_params import SamplingParams
from engine.scheduler import Overloaded, Scheduled
from engine.sequence import Sequence, Status
from engine.sim import ZERO_COST
from tests.engine.swa_helpers import assert_pool_empty_after_flush

PAGE = 4


def _greedy(n: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kwargs)


@dataclass(frozen=True)
class _Entry:
    """One request in one step's batch, as the runner saw it."""

    request_id: str
    query_len: int
    is_decode: bool  # computes the one token sampled last step


# -- continuous batching -----------------------------------------------------------------------


def test_requests_added_while_others_decode_join_the_next_step() -> None:
    engine = _make_sim_engine()
    batches = _record_batches(engine)
    first = [_add(engine, f"a{i}", 10, 30) for i in range(2)]
    for _ in range(5):
        engine.step()
    assert all(not s.is_prefill for s in first), "the first requests should be decoding"
    late = _add(engine, "late", 6, 5)
    engine.step()
    ids = {e.request_id: e for e in batches[-1]}
    assert set(ids) == {"a0", "a1", "late"}, f"next step ran {sorted(ids)}"
    assert ids["late"].query_len == 6 and ids["a0"].is_decode and ids["a1"].is_decode
    _step_until_done(engine, 200)
    assert [len(s.output_ids) for s in [*first, late]] == [30, 30, 5]


def test_chunked_prefill_respects_the_token_budget_and_decodes_go_first() -> None:
    budget = 16
    engine = _make_sim_engine(max_num_batched_tokens=budget, budget_chunks=400)
    batches = _record_batches(engine)
    rng = random.Random(1)
    arrivals = {step: [(rng.randrange(1, 60), rng.randrange(1, 20)) for _ in range(2)]
                for step in range(0, 30, 3)}
    seqs, decode_ready = [], []
    for step in range(400):
        for prompt_len, max_new in arrivals.get(step, []):
            seqs.append(_add(engine, f"r{len(seqs)}", prompt_len, max_new))
        if step > max(arrivals) and not engine.has_work:
            break
        decode_ready.append({s.request_id for s in engine.scheduler.running if not s.is_prefill})
        engine.step()
    assert all(s.finish_reason == "length" for s in seqs), [s.finish_reason for s in seqs]
    assert any(1 < e.query_len < budget for b in batches for e in b), "no chunk was cut"
    for i, (batch, ready) in enumerate(zip(batches, decode_ready)):
        _assert_within_budget(batch, budget, f"step {i}")
        _assert_decodes_first(batch, f"step {i}")
        missing = ready - {e.request_id for e in batch}
        assert not missing, f"step {i}: decodes {sorted(missing)} waited behind prefill chunks"


def test_batched_greedy_outputs_equal_one_at_a_time(tiny_model_dir: Path) -> None:
    """Staggered arrivals, chunked prefill mixed with decodes: the tokens of each request are
    those of running it alone."""
    llm = LLM(tiny_model_dir, dtype="float32", device="cpu", page_size=PAGE,
              max_num_batched_tokens=8)
    prompts = _prompts(5, llm.config.vocab_size, seed=2)
    engine = llm.engine
    seqs: list[Sequence] = []
    for step in range(300):
        if step % 3 == 0 and len(seqs) < len(prompts):
            seq = engine.make_sequence(f"b{step}", prompts[len(seqs)], _greedy(10))
            engine.add(seq)
            seqs.append(seq)
        if len(seqs) == len(prompts) and not engine.has_work:
            break
        engine.step()
    alone = LLM(tiny_model_dir, dtype="float32", device="cpu", page_size=PAGE)
    for prompt, seq in zip(prompts, seqs):
        [ref] = alone.generate([prompt], _greedy(10))
        assert tuple(seq.output_ids) == ref.token_ids, f"prompt of {len(prompt)} tokens"


# -- admission by free memory ------------------------------------------------------------------


def test_admission_waits_for_free_memory_and_loses_nothing() -> None:
    """Each request's first chunk takes 8 of the 18 chunks: two run, the rest wait."""
    engine = _make_sim_engine(budget_chunks=18, max_num_batched_tokens=64)
    seqs = [_add(engine, f"m{i}", 20, 12) for i in range(5)]
    engine.step()
    statuses = [s.status for s in seqs]
    assert statuses == [Status.RUNNING] * 2 + [Status.WAITING] * 3, statuses
    most_running = _step_until_done(engine, 500).most_running
    assert most_running <= 2, f"{most_running} requests ran at once in a 2-request budget"
    assert [s.finish_reason for s in seqs] == ["length"] * 5
    assert all(len(s.output_ids) == 12 for s in seqs)
    assert_pool_empty_after_flush(engine)


@pytest.mark.parametrize("cache", [True, False], ids=["cache-on", "cache-off"])
@pytest.mark.parametrize(
    ("prompt_len", "max_new"), [(200, 4), (10, 200)], ids=["prompt-too-big", "grows-too-big"]
)
def test_request_larger_than_the_budget_fails_instead_of_hanging(
    cache: bool, prompt_len: int, max_new: int
) -> None:
    engine = _make_sim_engine(budget_chunks=24, cache=cache)
    before = _add(engine, "before", 8, 6)
    huge = _add(engine, "huge", prompt_len, max_new)
    after = _add(engine, "after", 8, 6)
    failed = _step_until_done(engine, 600).failed
    assert huge.finish_reason == "error", f"{huge.finish_reason} after {len(huge.output_ids)}"
    assert failed == ["huge"], f"step() reported failures {failed}"
    assert before.finish_reason == after.finish_reason == "length"
    assert_pool_empty_after_flush(engine)


@pytest.mark.parametrize("cache", [True, False], ids=["cache-on", "cache-off"])
def test_a_request_that_fits_alone_runs_even_if_one_chunk_would_not(cache: bool) -> None:
    """120 prompt tokens fit in 24 chunks, but not as one 128-token chunk (30 SWA pages)."""
    engine = _make_sim_engine(budget_chunks=24, max_num_batched_tokens=128, cache=cache)
    seq = _add(engine, "fits", 120, 4)
    _step_until_done(engine, 100)
    assert seq.finish_reason == "length", f"{seq.finish_reason}: the chunk should have shrunk"
    assert_pool_empty_after_flush(engine)


# -- preemption --------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", [True, False], ids=["cache-on", "cache-off"])
def test_preemption_when_decodes_run_out_keeps_greedy_tokens(
    tiny_model_dir: Path, cache: bool
) -> None:
    budget = _chunk_bytes(tiny_model_dir) * 12
    llm = LLM(tiny_model_dir, dtype="float32", device="cpu", page_size=PAGE,
              kv_budget_bytes=budget, enable_prefix_cache=cache, max_num_batched_tokens=16)
    prompts = _prompts(3, llm.config.vocab_size, seed=5, base_len=10)
    seqs = [llm.engine.make_sequence(f"p{i}", p, _greedy(20)) for i, p in enumerate(prompts)]
    for seq in seqs:
        llm.engine.add(seq)
    _step_until_done(llm.engine, 1000)
    assert llm.engine.scheduler.num_preemptions > 0, "the budget never forced a preemption"
    assert [s.finish_reason for s in seqs] == ["length"] * 3
    cached = {s.request_id: (s.num_preemptions, s.num_cached) for s in seqs}
    assert all(n == 0 for _, n in cached.values()), (
        f"(preemptions, cached tokens) {cached}: distinct prompts on a fresh cache hit nothing; a "
        "resume's hit on the request's own pages is not a prompt-cache hit"
    )
    roomy = LLM(tiny_model_dir, dtype="float32", device="cpu", page_size=PAGE)
    refs = roomy.generate(prompts, _greedy(20))
    for seq, ref in zip(seqs, refs):
        assert tuple(seq.output_ids) == ref.token_ids, (
            f"{seq.request_id} (preempted {seq.num_preemptions}x) differs from an unconstrained run"
        )
    assert_pool_empty_after_flush(llm.engine)


# -- priorities --------------------------------------------------------------------------------


def test_higher_priority_waiting_requests_are_admitted_first() -> None:
    engine = _make_sim_engine(max_running_requests=1)
    batches = _record_batches(engine)
    seqs = [_add(engine, "low-old", 8, 2, priority=0), _add(engine, "low-new", 8, 2, priority=0),
            _add(engine, "high", 8, 2, priority=5), _add(engine, "mid", 8, 2, priority=2)]
    _step_until_done(engine, 100)
    order = list(dict.fromkeys(e.request_id for b in batches for e in b))
    assert order == ["high", "mid", "low-old", "low-new"], f"admission order {order}"
    assert all(s.finish_reason == "length" for s in seqs)


def test_preemption_victim_is_the_lowest_priority_then_the_newest() -> None:
    """Three decoding requests outgrow the budget; "high" is 2 tokens ahead, so it is the one
    that runs out of pages first: the victims are "newest-low", then "older-low", never itself."""
    engine = _make_sim_engine(budget_chunks=16, max_num_batched_tokens=64)
    seqs = [_add(engine, "older-low", 8, 40, priority=0), _add(engine, "high", 10, 40, priority=1),
            _add(engine, "newest-low", 8, 40, priority=0)]
    preempted: list[str] = []
    for _ in range(1000):
        if not engine.has_work:
            break
        running = {s.request_id for s in seqs if s.status is Status.RUNNING}
        engine.step()
        preempted += [s.request_id for s in seqs
                      if s.request_id in running and s.status is Status.WAITING]
    assert preempted[:2] == ["newest-low", "older-low"], f"preemption order {preempted}"
    assert "high" not in preempted, f"the high-priority request was preempted: {preempted}"
    assert [s.finish_reason for s in seqs] == ["length"] * 3


# -- abort -------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", [True, False], ids=["cache-on", "cache-off"])
def test_abort_releases_pages_of_waiting_and_running_requests(cache: bool) -> None:
    engine = _make_sim_engine(budget_chunks=12, max_num_batched_tokens=64, cache=cache)
    running = _add(engine, "running", 20, 50)
    waiting = _add(engine, "waiting", 20, 50)
    engine.step()
    engine.step()
    assert (running.status, waiting.status) == (Status.RUNNING, Status.WAITING)
    used = engine.allocator.used_bytes
    assert engine.abort("waiting") is waiting and waiting.finish_reason == "abort"
    assert engine.allocator.used_bytes == used, "aborting a waiting request changed pages"
    assert engine.abort("running") is running and running.finish_reason == "abort"
    assert not (running.path or running.pending_full or running.pending_swa or running.swa_pinned)
    freed = used - engine.allocator.used_bytes
    assert freed > 0, f"aborting a running request freed nothing ({used} bytes in use)"
    if not cache:
        assert engine.allocator.used_bytes == 0, "cache off: an abort must free everything"
    assert engine.abort("running") is None and engine.abort("nobody") is None
    assert not engine.has_work and engine.step() == []
    assert_pool_empty_after_flush(engine)


# -- stop conditions and the bounded queue -----------------------------------------------------


def test_stop_token_ends_only_its_request(tiny_model_dir: Path) -> None:
    llm = LLM(tiny_model_dir, dtype="float32", device="cpu", page_size=PAGE)
    prompts = _prompts(2, llm.config.vocab_size, seed=7)
    free = llm.generate(prompts, _greedy(12))
    stop = free[0].token_ids[4]
    first = free[0].token_ids.index(stop)
    assert stop not in free[1].token_ids[:12], "pick prompts whose second output avoids the stop"
    outs = llm.generate(prompts, [_greedy(12, stop_token_ids=(stop,)), _greedy(12)])
    assert outs[0].token_ids == free[0].token_ids[: first + 1] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == free[1].token_ids and outs[1].finish_reason == "length"
    assert_pool_empty_after_flush(llm.engine)


def test_the_waiting_queue_is_bounded() -> None:
    engine = _make_sim_engine(max_waiting_requests=2, max_running_requests=1)
    _add(engine, "a", 4, 3)
    _add(engine, "b", 4, 3)
    with pytest.raises(Overloaded, match="2 requests are waiting"):
        _add(engine, "c", 4, 3)
    engine.step()  # "a" runs: one waits
    _add(engine, "c", 4, 3)
    _step_until_done(engine, 100)


# -- builders --------------------------------------------------------------------------------


def _make_sim_engine(*, budget_chunks: int = 256, max_num_batched_tokens: int = 16,
                     max_running_requests: int = 8, max_waiting_requests: int = 64,
                     cache: bool = True) -> Engine:
    """FSSF, W = 8, page 4: a chunk holds 2 full pages or 1 SWA page."""
    model_config = ModelConfig.from_dict(mimo_config(layers="FSSF", sliding_window=8))
    chunk_bytes = KVLayout.from_model(model_config, PAGE, 2).chunk_bytes
    cfg = EngineConfig(backend="sim", page_size=PAGE, kv_budget_bytes=budget_chunks * chunk_bytes,
                       max_num_batched_tokens=max_num_batched_tokens,
                       max_running_requests=max_running_requests,
                       max_waiting_requests=max_waiting_requests, enable_prefix_cache=cache)
    return Engine(cfg, model_config=model_config, cost=ZERO_COST)


def _chunk_bytes(model_dir: Path) -> int:
    return KVLayout.from_model(ModelConfig.from_dir(model_dir), PAGE, 4).chunk_bytes


def _add(engine: Engine, request_id: str, prompt_len: int, max_new: int,
         priority: int = 0) -> Sequence:
    prompt = [random.Random(request_id).randrange(300) for _ in range(prompt_len)]
    seq = engine.make_sequence(request_id, prompt, _greedy(max_new), priority=priority)
    engine.add(seq)
    return seq


def _prompts(n: int, vocab: int, seed: int, base_len: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (base_len + 5 * i,), generator=gen).tolist()
            for i in range(n)]


def _record_batches(engine: Engine) -> list[list[_Entry]]:
    """Every step's batch as the runner sees it (pages reserved, nothing committed yet)."""
    batches: list[list[_Entry]] = []
    inner = engine.runner.run

    def run(batch: list[Scheduled], pages):  # noqa: ANN001, ANN202
        batches.append([_Entry(s.seq.request_id, s.query_len,
                               s.query_len == 1 and not s.seq.is_prefill) for s in batch])
        return inner(batch, pages)

    engine.runner.run = run  # type: ignore[method-assign]
    return batches


@dataclass
class _Progress:
    most_running: int = 0  # the most requests running at once
    failed: list[str] = field(default_factory=list)  # ids that step() reported as "error"


def _step_until_done(engine: Engine, max_steps: int) -> _Progress:
    """Step to completion; a loop that does not end in ``max_steps`` is a livelock."""
    progress = _Progress()
    for _ in range(max_steps):
        if not engine.has_work:
            return progress
        out = engine.step()
        progress.failed += [s.request_id for s in out if s.finish_reason == "error"]
        progress.most_running = max(progress.most_running, len(engine.scheduler.running))
    raise AssertionError(f"not done after {max_steps} steps (a livelock?): {engine.stats()}")


# -- assertions ------------------------------------------------------------------------------


def _assert_within_budget(batch: list[_Entry], budget: int, where: str) -> None:
    total = sum(e.query_len for e in batch)
    assert total <= budget, f"{where}: {total} tokens > budget {budget}: {batch}"


def _assert_decodes_first(batch: list[_Entry], where: str) -> None:
    kinds = ["decode" if e.is_decode else "prefill"
             for e in batch if e.is_decode or e.query_len > 1]
    assert kinds == sorted(kinds), f"{where}: a prefill chunk went before a decode: {batch}"
