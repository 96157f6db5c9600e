"""``agentgate replay --live`` (replay/live.py): a slice through a real ``agentgate serve
--backend sim`` agrees with the in-process harness, and every process it starts is stopped."""

import asyncio
import os
from dataclasses import fields
from pathlib import Path

import pytest

from engine.model_config import ModelConfig
from engine.models.checkpoint import DEMO_CONFIG
from replay.harness import ReplayConfig
from replay.live import (
    LIVE_VOCAB_SIZE,
    OUTPUT_TEXT,
    compare_live,
    live_model_dir,
    live_slice,
    output_token_id,
    replay_live,
    replay_model_dict,
)
from replay.metrics import RequestRecord
from replay.sim_worker import replay_model_config
from replay.workloads import TraceRequest, agent_workload, new_tokens

# Small enough for a noisy 2-core box: 2 workers, ~24 requests, short answers and pauses.
SLICE = 24
CFG = ReplayConfig(num_workers=2, kv_budget_tokens=200_000, cost="h200", retention=False)


def _descendants(pid: int) -> set[int]:
    """Live (not zombie) processes under ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.add(child)
            todo.append(child)
    return out


@pytest.fixture
def no_leftover_processes():
    before = _descendants(os.getpid())
    yield
    left = _descendants(os.getpid()) - before
    assert not left, f"processes left running: {sorted(left)}"


def _agent_slice() -> list[TraceRequest]:
    return live_slice(agent_workload(11, 6), SLICE, max_think_s=0.5, max_output_tokens=8)


def test_slice_keeps_parents_and_fixes_prompt_lengths() -> None:
    full = agent_workload(11, 6)
    part = live_slice(full, SLICE, max_think_s=0.5, max_output_tokens=8)
    assert 0 < len(part) <= SLICE
    ids = {r.request_id: r for r in part}
    orig = {r.request_id: r for r in full}
    for r in part:
        assert r.parent is None or r.parent in ids, r
        assert r.think_s <= 0.5 and r.output_length <= 8
        if r.prefix_from_parent:
            # the new tokens stay; the prompt shrinks by what the parents' answers lost
            assert new_tokens(r, ids[r.parent]) == new_tokens(orig[r.request_id],
                                                              orig[r.parent])
    assert len({r.session_id for r in part}) >= 3, "a window of time, not one session"


def test_live_model_is_the_harness_geometry(tmp_path: Path) -> None:
    """The live workers' config.json is the harness's model (but for the vocabulary)."""
    live = ModelConfig.from_dict(replay_model_dict(ref_vocab := replay_model_config().vocab_size))
    assert ModelConfig.from_dict(replay_model_dict()).vocab_size == LIVE_VOCAB_SIZE != ref_vocab
    ref = replay_model_config()
    diff = [f.name for f in fields(ref) if getattr(live, f.name) != getattr(ref, f.name)]
    assert diff == [], diff
    model_dir = live_model_dir(tmp_path / "m")
    assert (model_dir / "tokenizer.json").is_file()
    token = output_token_id(model_dir)
    assert token not in DEMO_CONFIG["eos_token_id"]  # the demo tokenizer's stop ids
    assert token < LIVE_VOCAB_SIZE and OUTPUT_TEXT == "a"


def _cached_by_sibling_group(records, requests) -> set[tuple[str, int, int]]:
    """``(parent, cached tokens, n-th such value)`` per request: one element per request,
    equal between two runs exactly when each parent's children got the same cached-token
    counts in some order. ``^`` of two runs holds two elements per disagreeing request."""
    parent = {r.request_id: r.parent or r.request_id for r in requests}
    seen: dict[tuple[str, int], int] = {}
    out = set()
    for rec in records:
        key = (parent[rec.request_id], rec.cached_tokens)
        seen[key] = seen.get(key, 0) + 1
        out.add((*key, seen[key]))
    return out


def test_live_agrees_with_in_process(no_leftover_processes: None) -> None:
    """Same slice, same router (``session-hash``: the same placement both ways), 2 workers:
    every request's cached tokens agree, so the hit rate does (the issue: within 2 points).

    NOTE: TTFT is wall time live (HTTP, the gateway, a loaded box) and virtual time in
    process: the bound here is a sanity band, the 15 % figure is measured by the benchmark
    in the notes. Live cannot be much faster: the sim workers pace every step with the cost
    model."""
    result = compare_live(_agent_slice(), CFG, SLICE, router="session-hash",
                          max_think_s=0.5, max_output_tokens=8)
    live, sim = result.live.summary, result.sim.summary
    assert live.num_finished == sim.num_finished == len(result.requests), [
        (r.request_id, r.reason) for r in result.live.records if r.status != "ok"]
    assert sim.hit_rate > 0.5, "the slice must exercise the cache"
    assert result.agreement.hit_rate_points <= 2.0, result.agreement.line()
    # Siblings fanned out from one parent start within milliseconds of each other, closer
    # than a loaded box's jitter: which of them the worker prefills first (and so which one
    # reuses the other's pages) is a race live, so siblings are compared as a multiset.
    mismatched = _cached_by_sibling_group(result.live.records, result.requests) ^ (
        _cached_by_sibling_group(result.sim.records, result.requests))
    assert len(mismatched) <= 2, sorted(mismatched)
    assert 0.7 * sim.ttft_p50_s <= live.ttft_p50_s <= 3 * sim.ttft_p50_s + 0.3, (
        result.agreement.line())
    doc = result.to_dict()
    assert doc["requests"] == len(result.requests) and doc["round_trip_s"] >= 0.0


def test_live_outputs_extend_the_next_prompt(no_leftover_processes: None) -> None:
    """One session of three turns, one worker: each turn's cached tokens cover its parent's
    prompt AND answer (whole pages), which holds only if the live client appends the ids the
    worker really generated."""
    page = 16
    reqs = [
        TraceRequest("a0", "s", "default", 0.0, None, 0.0, False, tuple(range(4)), 64, 40,
                     (), True, ("bash",)),
        TraceRequest("a1", "s", "default", None, "a0", 0.05, True, (10, 11), 24, 40,
                     ("bash",), True, ("grep",)),
        TraceRequest("a2", "s", "default", None, "a1", 0.05, True, (20,), 8, 4,
                     ("grep",), False, ()),
    ]
    reqs = [_with_input(r, reqs) for r in reqs]
    cfg = ReplayConfig(num_workers=1, kv_budget_tokens=50_000, block_size=page, cost="zero",
                       retention=False)
    live = replay_live(reqs, cfg, router=None)
    got = {r.request_id: r for r in live.records}
    assert [got[r].status for r in ("a0", "a1", "a2")] == ["ok"] * 3
    assert got["a1"].cached_tokens == (64 + 40) // page * page
    assert got["a2"].cached_tokens == (64 + 40 + 24 + 40) // page * page


def _with_input(r: TraceRequest, reqs: list[TraceRequest]) -> TraceRequest:
    """Test requests list only their new tokens in input_length: make it the whole prompt."""
    from dataclasses import replace

    if r.parent is None:
        return r
    parent = _with_input(next(p for p in reqs if p.request_id == r.parent), reqs)
    return replace(r, input_length=parent.input_length + parent.output_length + r.input_length)


def test_processes_are_stopped_when_the_replay_fails(no_leftover_processes: None) -> None:
    with pytest.raises((TimeoutError, asyncio.TimeoutError)):
        replay_live(_agent_slice(), CFG, router=None, timeout_s=0.5)


def test_a_gateway_that_cannot_start_is_a_clear_error(no_leftover_processes: None) -> None:
    """Workers too small to start: the error carries the gateway's own words."""
    tiny = ReplayConfig(num_workers=1, kv_budget_tokens=1, retention=False)
    with pytest.raises(RuntimeError, match="agentgate serve exited") as err:
        replay_live(_agent_slice()[:2], tiny, router=None)
    assert "budget" in str(err.value)


def test_sibling_groups_forgive_a_swap_and_nothing_else() -> None:
    reqs = [TraceRequest("p", "s", "default", 0.0, None, 0.0, False, (1,), 16, 4),
            *(TraceRequest(c, c, "default", None, "p", 0.1, True, (2,), 32, 4) for c in "ab")]

    def run(**cached: int) -> set:
        return _cached_by_sibling_group(
            [RequestRecord(k, 0.0, 32, cached_tokens=v) for k, v in cached.items()], reqs)

    assert run(p=0, a=16, b=32) == run(p=0, b=16, a=32)
    assert len(run(p=0, a=16, b=32) ^ run(p=0, a=16, b=16)) == 2
    assert len(run(p=0, a=16, b=32) ^ run(p=16, a=16, b=32)) == 2
