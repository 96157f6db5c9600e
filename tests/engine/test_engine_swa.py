"""The SWA invariants end to end on the engine (DESIGN.md "The SWA invariants", issue 3).

Native backend on tiny checkpoints where the tokens matter (the prefix cache must never change a
greedy token): O(W) SWA pages over a long generation, multi-turn sessions, window-safe hits; the
sim backend where only the page bookkeeping does (checkpoints under a running window). The random
workloads are in test_engine_swa_property.py.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from engine.kv.layout import KVLayout, num_pages
from engine.llm import LLM, RequestOutput
from engine.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduled
from engine.sequence import Sequence
from engine.utils import cdiv
from tests.engine.swa_helpers import (
    FULL,
    SWA,
    Workload,
    assert_pool_empty_after_flush,
    make_sim,
    step_chunks,
)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


# -- O(W): a 2,000-token generation ----------------------------------------------------------

LONG_WINDOW, LONG_PAGE, LONG_CHUNK = 16, 4, 8
LONG_PROMPT, LONG_OUTPUT = 50, 2000


@dataclass
class _LongRun:
    """One 2,000-token generation, observed inside every step (pages reserved, not committed)."""

    engine: Engine
    llm: LLM
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    steps: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    # (num_computed, query_len, SWA pages held, full pages held, SWA pages used in the pool)


@pytest.fixture(scope="module")
def long_runs(make_checkpoint) -> dict[bool, _LongRun]:
    """The same generation with the prefix cache on and off, under a budget that only fits the
    full pages plus the O(W) bound (so history SWA has to go back as the window slides)."""
    model_dir = make_checkpoint(layers="FSSF", sliding_window=LONG_WINDOW)
    bound = _swa_bound(LONG_WINDOW, LONG_CHUNK, LONG_PAGE)
    full_pages = num_pages(LONG_PROMPT + LONG_OUTPUT, LONG_PAGE)
    runs = {}
    for cache in (True, False):
        layout = _layout(model_dir, LONG_PAGE, "float32")
        chunks = cdiv(full_pages, layout.slots_per_chunk(FULL)) + bound + 2
        llm = LLM(model_dir, dtype="float32", device="cpu", page_size=LONG_PAGE,
                  max_num_batched_tokens=LONG_CHUNK, enable_prefix_cache=cache,
                  kv_budget_bytes=chunks * layout.chunk_bytes)
        prompt = torch.randint(0, 320, (LONG_PROMPT,), generator=torch.Generator().manual_seed(9))
        run = _LongRun(llm.engine, llm, prompt.tolist())
        seq = llm.engine.make_sequence("long", run.prompt_ids, _greedy(LONG_OUTPUT))

        def observe(batch: list[Scheduled], run: _LongRun = run, seq: Sequence = seq) -> None:
            [s] = batch
            kv, alloc = run.engine.kv, run.engine.allocator
            run.steps.append((seq.num_computed, s.query_len, kv.num_swa_pages_held(seq),
                              len(seq.path) + len(seq.pending_full), alloc.num_used_pages(SWA)))

        _observe_steps(llm.engine, observe)
        [done] = _run_to_completion(llm.engine, [seq], max_steps=LONG_OUTPUT + 100)
        run.output_ids = list(done.output_ids)
        runs[cache] = run
    return runs


@pytest.mark.parametrize("cache", [True, False], ids=["cache-on", "cache-off"])
def test_long_generation_holds_o_w_swa_pages_and_linear_full_pages(
    long_runs: dict[bool, _LongRun], cache: bool
) -> None:
    """Issue 3: W = 16, page 4, chunk 8: never more than ceil((W + chunk) / page) + 1 SWA pages."""
    run = long_runs[cache]
    bound = _swa_bound(LONG_WINDOW, LONG_CHUNK, LONG_PAGE)
    assert len(run.output_ids) == LONG_OUTPUT, f"{len(run.output_ids)} tokens generated"
    assert any(q > 1 for _, q, *_ in run.steps), "no chunked prefill happened"
    for computed, query_len, held, full_held, pool_swa in run.steps:
        at = f"step at position {computed} (+{query_len})"
        assert held <= bound, f"{at}: request holds {held} SWA pages > bound {bound}"
        want = num_pages(computed + query_len, LONG_PAGE)
        assert full_held == want, f"{at}: {full_held} full pages, want {want}"
        if not cache:  # nothing else holds SWA: the pool itself is O(W)
            assert pool_swa <= bound, f"{at}: {pool_swa} SWA pages in the pool > bound {bound}"
    assert max(s[2] for s in run.steps) >= cdiv(LONG_WINDOW, LONG_PAGE), "window never filled"
    preempted = run.engine.scheduler.num_preemptions
    assert preempted == 0, f"{preempted} preemptions: history SWA was not given back under pressure"
    assert_pool_empty_after_flush(run.engine)


def test_long_generation_tokens_match_cache_off_and_contiguous_reference(
    long_runs: dict[bool, _LongRun],
) -> None:
    on, off = long_runs[True], long_runs[False]
    first = _first_difference(on.output_ids, off.output_ids)
    assert first is None, f"cache on and off differ first at output token {first}"
    context = off.prompt_ids + off.output_ids[:63]
    ref = off.llm.prompt_logits(context)[LONG_PROMPT - 1 :].argmax(dim=-1).tolist()
    assert ref == off.output_ids[:64], (
        f"paged greedy tokens {off.output_ids[:64]} != contiguous argmax {ref}"
    )


# -- multi-turn sessions: the cache never changes a greedy token -----------------------------


@pytest.mark.parametrize(
    ("dtype", "turns", "budget_chunks"),
    [("float32", 4, 24), ("bfloat16", 3, 20)],
)
def test_multi_turn_sessions_identical_with_cache_on_and_off(
    make_checkpoint, dtype: str, turns: int, budget_chunks: int
) -> None:
    """3 agent sessions x turns, staggered so different turns share batches; the cache-on engine
    has a budget small enough that it evicts (and preempts), the cache-off one a roomy budget."""
    model_dir = make_checkpoint(seed=1, dtype=dtype, layers="FSSF", sliding_window=8)
    on = _make_llm(model_dir, dtype, budget_chunks, cache=True)
    off = _make_llm(model_dir, dtype, 400, cache=False)
    got, expected = _run_sessions(on, turns), _run_sessions(off, turns)
    for key in expected:
        assert got[key].token_ids == expected[key].token_ids, (
            f"session {key[0]} turn {key[1]}: cache on {got[key].token_ids} != "
            f"off {expected[key].token_ids} (cached {got[key].cached_tokens} tokens)"
        )
    later = {k: o.cached_tokens for k, o in got.items() if k[1] > 0}
    hits = sum(n > 0 for n in later.values())
    assert hits * 3 >= len(later) * 2, f"later turns mostly missed the cache: {later}"
    assert all(o.cached_tokens == 0 for o in expected.values()), "the cache-off engine hit"
    stats = on.engine.cache.stats
    assert stats.evicted_full_pages > 0 and stats.evicted_swa_pages > 0, f"no eviction: {stats}"
    assert stats.cut_tokens > 0, f"no hit was cut by the window: {stats}"


# -- window-safe hits --------------------------------------------------------------------------


def test_hit_past_evicted_swa_resumes_from_the_earlier_checkpoint(make_checkpoint) -> None:
    """A prefix whose SWA history was evicted is served from the checkpoint before it (not the
    raw full-KV match); the recompute then marks a branch point that the next request hits."""
    model_dir = make_checkpoint(layers="FSSF", sliding_window=16)
    on = _make_llm(model_dir, "float32", 200, cache=True, page_size=4)
    off = _make_llm(model_dir, "float32", 200, cache=False, page_size=4)
    rng = random.Random(3)
    turn1 = [rng.randrange(320) for _ in range(30)]
    [out1] = on.generate([turn1], _greedy(8))  # computes 37 tokens: checkpoint at 36
    turn2 = turn1 + list(out1.token_ids) + [rng.randrange(320) for _ in range(30)]
    [out2] = on.generate([turn2], _greedy(8))  # computes [36, 75): checkpoint at 72
    assert out2.cached_tokens == 36, f"turn 2 should resume at turn 1's end: {out2.cached_tokens}"
    assert _evict_swa_history(on.engine) > 0, "no SWA history to evict"
    # branches at 52: full KV cached up to there, SWA only for [20, 36) and [56, 72)
    branch = turn2[:52] + [rng.randrange(320) for _ in range(9)]
    cut_before = on.engine.cache.stats.cut_tokens
    [hit] = on.generate([branch], _greedy(6))
    assert hit.cached_tokens == 36, f"served from {hit.cached_tokens}, want checkpoint 36"
    assert on.engine.cache.stats.cut_tokens - cut_before == 52 - 36
    _evict_swa_history(on.engine)  # only the branch-point checkpoint keeps [36, 52) now
    again = turn2[:52] + [rng.randrange(320) for _ in range(5)]
    [hit_again] = on.generate([again], _greedy(6))
    assert hit_again.cached_tokens == 52, f"branch point not kept: {hit_again.cached_tokens}"
    for prompt, out in ((turn2, out2), (branch, hit), (again, hit_again)):
        [ref] = off.generate([prompt], _greedy(len(out.token_ids)))
        assert out.token_ids == ref.token_ids, f"prompt of {len(prompt)}: cache changed tokens"
    assert_pool_empty_after_flush(on.engine)


def test_checkpoint_under_a_running_window_does_not_fail_a_request_that_fits() -> None:
    """Turn 2 resumes at turn 1's checkpoint (24) and ends 10 tokens later, its window still on
    the checkpoint's end. The budget holds exactly turn 2's last step: full pages for [0, 33) and
    SWA pages 4..8 for [19, 33) = 9 + 5 chunks; the checkpoint's pages 2 and 3 must go."""
    engine = make_sim(Workload("FSSF", window=13, swa_kv_heads=1, budget_chunks=14,
                               max_num_batched_tokens=16, cache=True, requests=()))
    turn1 = engine.make_sequence("t1", list(range(100, 120)), SamplingParams(max_new_tokens=5))
    _run_to_completion(engine, [turn1], max_steps=50)
    prompt = [*turn1.prompt_ids, *turn1.output_ids, 1, 2, 3]
    turn2 = engine.make_sequence("t2", prompt, SamplingParams(max_new_tokens=6))
    assert step_chunks(engine, len(prompt) + 6 - 2) == (14, 14)
    _run_to_completion(engine, [turn2], max_steps=50)
    assert turn2.num_cached == 24, f"turn 2 resumed at {turn2.num_cached}"
    assert turn2.finish_reason == "length", f"turn 2 fits in 14 chunks: {turn2.finish_reason}"


def test_checkpoint_scanned_while_pinned_stays_evictable() -> None:
    """Turn 2 resumes at turn 1's checkpoint (16) and pins it while memory pressure scans the
    cache; once its window moves on, the checkpoint's pages must be reclaimable again: turn 2
    needs 13 of the 14 chunks at its last step (full [0, 39) + SWA [30, 39))."""
    engine = make_sim(Workload("FSSF", window=8, swa_kv_heads=1, budget_chunks=14,
                               max_num_batched_tokens=16, cache=True, requests=()))
    turn1 = engine.make_sequence("t1", list(range(100, 112)), SamplingParams(max_new_tokens=5))
    _run_to_completion(engine, [turn1], max_steps=50)
    prompt = [*turn1.prompt_ids, *turn1.output_ids, 1, 2, 3]
    turn2 = engine.make_sequence("t2", prompt, SamplingParams(max_new_tokens=20))
    assert step_chunks(engine, len(prompt) + 20 - 2) == (13, 13)
    engine.add(turn2)
    engine.step()
    assert turn2.num_cached == 16 and [n.depth for n in turn2.swa_pinned] == [3, 4]
    engine.cache.evict(0, engine.allocator.num_chunks)  # pressure from elsewhere: frees what it can
    _run_to_completion(engine, [], max_steps=50)
    assert turn2.finish_reason == "length", f"turn 2 fits in 14 chunks: {turn2.finish_reason}"


# -- builders --------------------------------------------------------------------------------


def _swa_bound(window: int, chunk: int, page: int) -> int:
    return cdiv(window + chunk, page) + 1


def _layout(model_dir: Path, page: int, dtype: str) -> KVLayout:
    dtype_bytes = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return KVLayout.from_model(ModelConfig.from_dir(model_dir), page, dtype_bytes)


def _make_llm(model_dir: Path, dtype: str, budget_chunks: int, *, cache: bool,
              page_size: int = 4, max_num_batched_tokens: int = 16) -> LLM:
    chunk_bytes = _layout(model_dir, page_size, dtype).chunk_bytes
    return LLM(model_dir, dtype=dtype, device="cpu", page_size=page_size,
               kv_budget_bytes=budget_chunks * chunk_bytes, enable_prefix_cache=cache,
               max_num_batched_tokens=max_num_batched_tokens)


def _run_sessions(llm: LLM, turns: int, sessions: int = 3) -> dict[tuple[int, int], RequestOutput]:
    """Agent sessions, staggered: round r runs turn r - s of session s. A turn's prompt is the
    previous prompt + its output + new user tokens; session 0 retries its turn 2 instead (same
    history, a different user message: the previous answer is dropped), a branch point."""
    rng = random.Random(0)
    prompts = {s: [rng.randrange(300) for _ in range(18 + 3 * s)] for s in range(sessions)}
    previous: dict[int, list[int]] = {}
    outputs: dict[tuple[int, int], RequestOutput] = {}
    for r in range(turns + sessions - 1):
        batch = [(s, r - s) for s in range(sessions) if 0 <= r - s < turns]
        for s, t in batch:
            if t > 0:
                user = [rng.randrange(300) for _ in range(5)]
                retry = s == 0 and t == 2
                base = previous[s] if retry else prompts[s] + list(outputs[s, t - 1].token_ids)
                previous[s], prompts[s] = prompts[s], base + user
        results = llm.generate([prompts[s] for s, _ in batch],
                               [_greedy(6 + s) for s, _ in batch])
        outputs.update(zip(batch, results))
    return outputs


def _evict_swa_history(engine: Engine) -> int:
    """Memory pressure that exactly drops the SWA history (checkpoints and full KV stay).

    Returns the SWA pages dropped."""
    history = [n for n in engine.cache.nodes()
               if n.swa_page is not None and n.swa_refs == 0 and n.ckpt_refs == 0]
    free = engine.allocator.num_free_pages(SWA)
    assert engine.cache.evict(0, free + len(history))
    left = [n for n in engine.cache.nodes() if n.swa_page is not None and n.ckpt_refs == 0]
    assert not left, f"history SWA left: {left}"
    return len(history)


def _observe_steps(engine: Engine, observe: Callable[[list[Scheduled]], None]) -> None:
    """Call ``observe(batch)`` inside every step: pages reserved, the forward not yet run."""
    inner = engine.runner.run

    def run(batch, pages):  # noqa: ANN001, ANN202
        observe(list(batch))
        return inner(batch, pages)

    engine.runner.run = run  # type: ignore[method-assign]


def _run_to_completion(engine: Engine, seqs: list[Sequence], max_steps: int) -> list[Sequence]:
    for seq in seqs:
        engine.add(seq)
    for _ in range(max_steps):
        if not engine.has_work:
            return seqs
        engine.step()
    raise AssertionError(f"not done after {max_steps} steps: {engine.stats()}")


def _first_difference(a: list[int], b: list[int]) -> int | None:
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return diff[0] if diff else (None if len(a) == len(b) else min(len(a), len(b)))
