"""Replay inputs: the Mooncake loader and the built-in agent workload (replay/workloads.py)."""

import json
import math
import random
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.agent_params import TOOLS, AgentParams
from replay.workloads import (
    TraceError,
    TraceRequest,
    agent_workload,
    first_by_arrival,
    load_mooncake,
    new_tokens,
    summary,
)

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
CONVERSATION = TRACES / "conversation_trace.jsonl"


def _by_id(requests: list[TraceRequest]) -> dict[str, TraceRequest]:
    return {r.request_id: r for r in requests}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _tool_pauses(requests: list[TraceRequest]) -> list[float]:
    """The gaps after ordinary tool calls (the sub-agent "task" pause is modelled apart)."""
    return [r.think_s for r in requests
            if r.parent_tool_names and r.parent_tool_names[0] != "task"]


def _sibling_groups(requests: list[TraceRequest]) -> list[list[TraceRequest]]:
    """Sub-agent first turns grouped by the turn that spawned them."""
    ids = _by_id(requests)
    groups: dict[str, list[TraceRequest]] = defaultdict(list)
    for r in requests:
        if r.parent is not None and ids[r.parent].session_id != r.session_id:
            groups[r.parent].append(r)
    return list(groups.values())


# ---------------------------------------------------------------- agent workload


def test_agent_workload_is_deterministic_per_seed() -> None:
    a, b, c = agent_workload(7, 12), agent_workload(7, 12), agent_workload(8, 12)
    assert a == b
    assert a != c


def test_tool_pause_mixture_has_the_published_quantiles() -> None:
    """Median ~2 s, p99 ~11 min (routers.md §6/§10), sampled from the per-tool log-normals."""
    rng = random.Random(0)
    names = [n for n in TOOLS if n != "task"]
    weights = [TOOLS[n].weight for n in names]
    sigma = AgentParams().pause_sigma
    samples = [TOOLS[rng.choices(names, weights)[0]].pause_s(rng, sigma) for _ in range(60_000)]
    median, p99 = _quantile(samples, 0.5), _quantile(samples, 0.99)
    assert 1.8 <= median <= 2.2, f"median {median:.2f} s, want ~2 s"
    assert 560 <= p99 <= 780, f"p99 {p99:.0f} s, want ~660 s (11 min)"


def test_workload_gaps_after_tool_calls_follow_the_targets() -> None:
    pauses = [p for seed in range(4) for p in _tool_pauses(agent_workload(seed, 64))]
    assert len(pauses) > 3000
    median, p99 = _quantile(pauses, 0.5), _quantile(pauses, 0.99)
    assert 1.6 <= median <= 2.5, f"median {median:.2f} s"
    assert 350 <= p99 <= 1200, f"p99 {p99:.0f} s"


def test_tools_have_different_pause_medians() -> None:
    by_tool: dict[str, list[float]] = defaultdict(list)
    for seed in range(4):
        reqs = agent_workload(seed, 64)
        ids = _by_id(reqs)
        for r in reqs:
            if r.parent_tool_names and ids[r.parent].session_id == r.session_id:  # type: ignore[index]
                by_tool[r.parent_tool_names[0]].append(r.think_s)
    medians = {name: _quantile(v, 0.5) for name, v in by_tool.items()}
    assert set(medians) == set(TOOLS)
    assert medians["read_file"] * 4 < medians["bash"] < medians["task"], medians


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_sessions=st.integers(0, 6),
       block_size=st.sampled_from([16, 256, 512, 1000]))
def test_each_turn_extends_its_parent(seed: int, num_sessions: int, block_size: int) -> None:
    reqs = agent_workload(seed, num_sessions, block_size=block_size)
    _assert_history(reqs, block_size)


def _assert_history(reqs: list[TraceRequest], block_size: int) -> None:
    seen: dict[str, TraceRequest] = {}
    assert len(_by_id(reqs)) == len(reqs), "request ids are unique"
    for r in reqs:
        parent = seen.get(r.parent) if r.parent is not None else None
        assert (r.parent is None) == (r.arrival_s is not None), r
        if r.parent is not None:
            assert parent is not None, f"{r.request_id}: parent {r.parent} not listed before it"
            assert r.prefix_from_parent
            assert r.parent_tool_names == parent.tool_names, r
            assert parent.ends_in_tool_call or parent.session_id == r.session_id, r
            new = new_tokens(r, parent)
            assert new >= 1 and r.input_length > parent.input_length + parent.output_length
        else:
            new = r.input_length
        assert len(r.hash_ids) == math.ceil(new / block_size), (r.request_id, new)
        seen[r.request_id] = r


def test_sessions_share_the_system_prompt_and_grow_long() -> None:
    params = AgentParams()
    reqs = agent_workload(3, 64, params)
    firsts = [r for r in reqs if r.parent is None]
    assert len(firsts) == 64
    heads = {r.hash_ids[: min(params.system_prompt_tokens) // 512] for r in firsts}
    assert len(heads) == len(params.system_prompt_tokens), "one shared head per variant"
    assert {r.tenant for r in firsts} == {t for t, _ in params.tenants}
    assert max(r.input_length for r in reqs) > 60_000
    assert max(r.input_length + r.output_length for r in reqs) <= params.max_context_tokens
    outputs = [r.output_length for r in reqs]
    assert 100 <= _quantile(outputs, 0.5) <= 500


def test_sessions_end_without_a_tool_call_and_last_at_most_40_turns() -> None:
    """Every turn but the last ends in tool calls (mostly); a session cut short because its
    history would outgrow the context is the only one whose last turn calls a tool."""
    params = AgentParams()
    reqs = agent_workload(5, 64, params)
    by_session: dict[str, list[TraceRequest]] = defaultdict(list)
    for r in reqs:
        by_session[r.session_id].append(r)  # type: ignore[index]
    main = {k: v for k, v in by_session.items() if ".sub" not in k}
    assert len(main) == 64 and max(len(v) for v in main.values()) <= params.turns.max_value
    for turns in by_session.values():
        last = turns[-1]
        if last.ends_in_tool_call:
            assert last.input_length > params.max_context_tokens // 2, last
    non_final = [t for turns in by_session.values() for t in turns[:-1]]
    share = sum(t.ends_in_tool_call for t in non_final) / len(non_final)
    assert 0.85 <= share <= 0.97, share


def test_subagent_siblings_share_the_prefix_and_arrive_together() -> None:
    params = AgentParams()
    runs = [agent_workload(seed, 64, params) for seed in range(3)]
    groups = [(g, _by_id(reqs)) for reqs in runs for g in _sibling_groups(reqs)]
    assert len(groups) >= 10
    for group, ids in groups:
        spawner = ids[group[0].parent]  # type: ignore[index]
        assert spawner.tool_names == ("task",)
        assert 2 <= len(group) <= params.subagents.max_value
        assert len({r.session_id for r in group}) == len(group)
        assert all(r.prefix_from_parent and r.parent == spawner.request_id for r in group)
        think = [r.think_s for r in group]
        assert max(think) - min(think) <= params.sibling_jitter_s, think
        assert min(think) >= params.fanout_delay_s
    sizes = sorted(len(g) for g, _ in groups)
    assert sizes[len(sizes) // 2] >= 4, sizes


def test_default_run_stays_replayable() -> None:
    """Sized for a minute or two of replay: bounded requests and tokens at 64 sessions."""
    s = summary(agent_workload(0, 64))
    assert 500 <= s["requests"] <= 4000, s
    assert s["input_tokens"] <= 80e6, s


def test_first_by_arrival_is_a_parent_closed_window_of_time() -> None:
    reqs = agent_workload(2, 16)
    part = first_by_arrival(reqs, 50)
    assert 0 < len(part) <= 50
    kept = {r.request_id for r in part}
    assert all(r.parent is None or r.parent in kept for r in part)
    assert [r for r in reqs if r.request_id in kept] == part, "the list's order is kept"
    assert len({r.session_id for r in part}) >= 4
    first = [r.arrival_s for r in reqs if r.parent is None]
    assert all(r.request_id in kept for r in reqs if r.arrival_s == min(first))
    assert first_by_arrival(reqs, 0) == []


def test_trace_request_refuses_inconsistent_fields() -> None:
    with pytest.raises(AssertionError, match="arrival_s"):
        TraceRequest("x", None, "t", None, None, 0.0, False, (1,), 1, 1)
    with pytest.raises(AssertionError, match="tool_names"):
        TraceRequest("x", None, "t", 0.0, None, 0.0, False, (1,), 1, 1, (), True, ())


# ---------------------------------------------------------------- Mooncake


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_mooncake_round_trip(tmp_path: Path) -> None:
    records = [
        {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1],
         "session_id": "a"},
        {"timestamp": 1500, "input_length": 1025, "output_length": 7, "hash_ids": [0, 1, 2],
         "session_id": 42, "extra": "ignored"},
        {"timestamp": 700.5, "input_length": 512, "output_length": 1, "hash_ids": [9]},
    ]
    path = _write(tmp_path, [json.dumps(r) for r in records[:2]] + ["", json.dumps(records[2])])
    got = load_mooncake(path)
    assert [r.arrival_s for r in got] == [0.0, 0.7005, 1.5]
    by_len = {r.input_length: r for r in got}
    for rec in records:
        r = by_len[rec["input_length"]]
        assert r.hash_ids == tuple(rec["hash_ids"]) and r.output_length == rec["output_length"]
        assert r.session_id == (None if "session_id" not in rec else str(rec["session_id"]))
        assert r.parent is None and not r.prefix_from_parent and r.think_s == 0.0
    assert len({r.request_id for r in got}) == 3
    assert len(load_mooncake(path, limit=1)) == 1


def test_mooncake_other_block_size(tmp_path: Path) -> None:
    path = _write(tmp_path, [json.dumps(
        {"timestamp": 0, "input_length": 300, "output_length": 2, "hash_ids": [0, 1, 2]})])
    assert load_mooncake(path, block_size=128)[0].hash_ids == (0, 1, 2)
    with pytest.raises(TraceError, match="block-size"):
        load_mooncake(path)


def test_mooncake_first_100_lines_of_the_real_trace() -> None:
    if not CONVERSATION.is_file():
        pytest.skip(f"{CONVERSATION} not present")
    got = load_mooncake(CONVERSATION, limit=100)
    with CONVERSATION.open() as f:
        records = [json.loads(next(f)) for _ in range(100)]
    assert len(got) == 100
    assert sorted((r.arrival_s, r.input_length, r.hash_ids) for r in got) == sorted(
        (rec["timestamp"] / 1000, rec["input_length"], tuple(rec["hash_ids"]))
        for rec in records)
    assert all(r.session_id is None and r.arrival_s is not None for r in got)


GOOD = {"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}


@pytest.mark.parametrize(("line", "field"), [
    ("{not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "hash_ids"}), "'hash_ids' is missing"),
    (json.dumps({**GOOD, "timestamp": "5"}), "'timestamp'"),
    (json.dumps({**GOOD, "timestamp": -1}), "'timestamp'"),
    (json.dumps({**GOOD, "input_length": 0}), "'input_length'"),
    (json.dumps({**GOOD, "input_length": 600.5}), "'input_length'"),
    (json.dumps({**GOOD, "output_length": True}), "'output_length'"),
    (json.dumps({**GOOD, "hash_ids": [0, "1"]}), "'hash_ids'"),
    (json.dumps({**GOOD, "hash_ids": [0]}), "'hash_ids' has 1 blocks"),
    (json.dumps({**GOOD, "session_id": ["a"]}), "'session_id'"),
])
def test_mooncake_bad_line_names_file_line_and_field(
        tmp_path: Path, line: str, field: str) -> None:
    path = _write(tmp_path, [json.dumps(GOOD), "", line])
    with pytest.raises(TraceError) as err:
        load_mooncake(path)
    assert f"{path}:3:" in str(err.value)
    assert field in str(err.value)
