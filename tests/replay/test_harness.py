"""agentgate replay's harness: real sim engines, real routers, virtual time (small slices)."""

from __future__ import annotations

import importlib.util
import random

import pytest

from replay.harness import Replay, ReplayConfig, ReplayResult, replay
from replay.metrics import OK
from replay.workloads import TraceRequest, agent_workload

BLOCK = 512
# NOTE: small budgets and short answers keep each replay around a second on a busy 2-core box
CFG = ReplayConfig(num_workers=4, kv_budget_tokens=60_000, block_size=BLOCK, cost="h200")
HAS_AGENTGATE = importlib.util.find_spec("gateway.routing.policy") is not None


def _make_sessions(num_sessions: int = 24, turns: int = 6, seed: int = 0,
                   stateless: bool = True) -> list[TraceRequest]:
    """Sessions whose every turn resends its whole history plus new tokens (closed loop), with
    seeded random answer lengths and pauses so that load alone does not keep them in place.
    ``stateless``: no session id (an OpenAI client): only the prompt ties the turns."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    for s in range(num_sessions):
        base = (seed * 1000 + s) * 100
        sid = None if stateless else f"s{s}"
        first = TraceRequest(
            request_id=f"s{s}t0", session_id=sid, tenant="t", arrival_s=0.01 * s,
            parent=None, think_s=0.0, prefix_from_parent=False,
            hash_ids=tuple(range(base, base + 8)), input_length=8 * BLOCK - 100,
            output_length=rng.randint(8, 64))
        out.append(first)
        prev = first
        for t in range(1, turns):
            new = rng.randint(100, 900)
            req = TraceRequest(
                request_id=f"s{s}t{t}", session_id=sid, tenant="t", arrival_s=None,
                parent=prev.request_id, think_s=rng.uniform(0.01, 0.3), prefix_from_parent=True,
                hash_ids=tuple(range(base + 10 + 2 * t, base + 12 + 2 * t))[: -(-new // BLOCK)],
                input_length=prev.input_length + prev.output_length + new,
                output_length=rng.randint(8, 64))
            out.append(req)
            prev = req
    return out


def _assert_sane(result: ReplayResult) -> None:
    bad = [r for r in result.records if r.status != OK]
    assert not bad, f"requests did not finish: {bad[:3]}"
    for r in result.records:
        assert r.ttft_s is not None and r.first_token_s is not None, r
        assert r.ttft_s == pytest.approx(r.first_token_s - r.arrival_s), r
        assert r.ttft_s > 0, f"TTFT must be positive (a prefill step takes time): {r}"
        assert r.dispatch_s is not None and r.arrival_s <= r.dispatch_s <= r.first_token_s, r
        assert r.finish_s is not None and r.finish_s >= r.first_token_s, r


@pytest.fixture(scope="module")
def sessions() -> list[TraceRequest]:
    return _make_sessions()


@pytest.fixture(scope="module")
def runs(sessions: list[TraceRequest]) -> dict[str, ReplayResult]:
    names = ["round-robin", "least-loaded", "llm-d", "sglang-cache-aware", "global"]
    names += ["agentgate"] if HAS_AGENTGATE else []
    return {name: replay(sessions, name, CFG) for name in names}


def test_every_request_finishes_with_ttft_first_token_minus_arrival(
        runs: dict[str, ReplayResult]) -> None:
    for result in runs.values():
        _assert_sane(result)


@pytest.mark.parametrize("policy", ["llm-d", "sglang-cache-aware",
                                    pytest.param("agentgate", marks=pytest.mark.skipif(
                                        not HAS_AGENTGATE, reason="AgentgateRouter not landed"))])
def test_history_sharing_sessions_hit_more_with_prefix_routing_than_round_robin(
        runs: dict[str, ReplayResult], policy: str) -> None:
    ours, rr = runs[policy].summary.hit_rate, runs["round-robin"].summary.hit_rate
    ll = runs["least-loaded"].summary.hit_rate
    assert ours > rr + 0.2, f"{policy} hit {ours:.3f} vs round-robin {rr:.3f}"
    assert ours > ll + 0.2, f"{policy} hit {ours:.3f} vs least-loaded {ll:.3f} (no session id)"


def test_global_pool_hits_at_least_as_much_as_every_policy(runs: dict[str, ReplayResult]) -> None:
    best = runs["global"].summary.hit_rate
    for name, result in runs.items():
        assert result.summary.hit_rate <= best + 0.02, (
            f"{name} hit {result.summary.hit_rate:.3f} > global {best:.3f}")


def test_global_is_one_worker_with_n_times_the_budget(runs: dict[str, ReplayResult]) -> None:
    assert runs["global"].worker_ids == ["w0"]
    assert len(runs["round-robin"].worker_ids) == CFG.num_workers
    spec = CFG.worker_spec("global")
    assert spec.kv_budget_tokens == CFG.num_workers * CFG.kv_budget_tokens
    # N x the work in one step of one worker's length: N x the throughput, and a request's
    # step (so its decode speed) no faster than the hardware's
    one, n = CFG.worker_spec("round-robin").cost, CFG.num_workers
    assert spec.cost.step_time(n * 100, n * 3, n * 50) == pytest.approx(one.step_time(100, 3, 50))
    assert spec.cost.step_time(0, 1, 0) > one.step_overhead_s
    s = runs["global"].summary  # "per worker" = per N workers' worth of pool
    per_worker = s.prompt_tokens / s.makespan_s / CFG.num_workers
    assert s.input_tokens_per_s_per_worker == pytest.approx(per_worker)


def test_hit_rate_is_the_engines_own_cached_token_count(runs: dict[str, ReplayResult]) -> None:
    for name, result in runs.items():
        s = result.summary
        engines = result.engine_stats.values()
        assert all(e["preemptions"] == 0 for e in engines), name  # else re-admissions count
        assert s.cached_tokens == sum(e["matched_tokens"] for e in engines), name
        assert s.cached_tokens == sum(r.cached_tokens for r in result.records), name
        assert s.hit_rate == pytest.approx(s.cached_tokens / s.prompt_tokens), name
        assert s.prompt_tokens == sum(r.prompt_tokens for r in result.records), name


def test_continued_prompts_are_parent_prompt_plus_output_plus_new(
        runs: dict[str, ReplayResult], sessions: list[TraceRequest]) -> None:
    records = {r.request_id: r for r in runs["round-robin"].records}
    for req in sessions:
        assert records[req.request_id].prompt_tokens == req.input_length, req.request_id


def test_same_seed_same_results() -> None:
    reqs = agent_workload(3, num_sessions=3)[:120]
    cfg = ReplayConfig(num_workers=3, kv_budget_tokens=400_000)
    a, b = replay(reqs, "least-loaded", cfg), replay(reqs, "least-loaded", cfg)
    assert a.summary == b.summary
    assert a.records == b.records
    other = replay(agent_workload(4, num_sessions=3)[:120], "least-loaded", cfg)
    assert other.summary != a.summary


def test_rate_scale_compresses_arrivals(sessions: list[TraceRequest]) -> None:
    base = replay(sessions, "least-loaded", CFG)
    fast = replay(sessions, "least-loaded", ReplayConfig(**{**_fields(CFG), "rate_scale": 2.0}))
    firsts = {r.request_id: r.arrival_s for r in base.records if r.request_id.endswith("t0")}
    for r in fast.records:
        if r.request_id in firsts:
            assert r.arrival_s == pytest.approx(firsts[r.request_id] / 2)


def test_unknown_policy_and_orphan_requests_are_clear_errors(
        sessions: list[TraceRequest]) -> None:
    with pytest.raises(ValueError, match="policy 'nope'"):
        replay(sessions, "nope", CFG)
    with pytest.raises(ValueError, match="parent"):
        replay(sessions[1:], "round-robin", CFG)


def _fields(cfg: ReplayConfig) -> dict[str, object]:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


def test_router_index_holds_exactly_the_engines_cached_pages(
        sessions: list[TraceRequest]) -> None:
    """The KV index is built from the engines' own events, batch by batch: at the end it knows
    every page each engine caches, at its depth, and nothing else."""
    sim = Replay(sessions, "llm-d", CFG, None)
    sim.run()
    num_cached = 0
    for wid, worker in sim.workers.items():
        for node in worker.engine.cache.nodes():
            chain = [n.page_hash for n in node.ancestors(node.depth + 1)][::-1]
            match = sim.index.match(chain).get(wid)
            assert match is not None and match.full_pages == node.depth + 1, (wid, node)
            num_cached += 1
    assert num_cached > 0
    assert sim.index.num_pages == num_cached


def test_admission_on_every_request_finishes_with_sane_times(
        sessions: list[TraceRequest]) -> None:
    pytest.importorskip("gateway.routing.admission")
    cfg = ReplayConfig(**{**_fields(CFG), "admission": True})
    result = replay(sessions, "llm-d", cfg)
    _assert_sane(result)


def test_block_tokens_and_continued_prompts_hash_like_the_whole_prompt() -> None:
    from replay.tokens import PromptBuilder, block_token_ids

    a = block_token_ids([3, 9], 512, 1000)
    assert a.shape == (1024,) and a.min() >= 0 and a.max() < 1000
    assert (a[512:] == block_token_ids([9], 512, 1000)).all()  # block ids are independent
    assert not (a[:512] == a[512:]).all()
    builder = PromptBuilder(page_size=512, block_size=512, vocab_size=1000)
    parent = builder.fresh([3, 9], 700)
    assert parent.num_tokens == 700 and len(parent.hashes) == 1
    child = builder.continued(parent, [1, 2, 3] * 200, [11, 12], 900)
    assert child.num_tokens == 700 + 600 + 900
    assert (child.ids[:700] == parent.ids).all()
    # the extended chain equals hashing the whole prompt from scratch
    from engine.hashing import page_hashes

    assert child.hashes == page_hashes(child.ids, 512)


def test_admission_queue_releases_onto_a_worker_mid_step_without_a_second_step() -> None:
    """A burst queues in admission; tickets released while a worker's step completes must not
    start a second step on it (the released request joins the next one)."""
    pytest.importorskip("gateway.routing.admission")
    burst = [TraceRequest(request_id=f"b{i}", session_id=None, tenant="t", arrival_s=0.0,
                          parent=None, think_s=0.0, prefix_from_parent=False,
                          hash_ids=tuple(range(100 * i, 100 * i + 16)),
                          input_length=16 * BLOCK, output_length=4) for i in range(40)]
    cfg = ReplayConfig(**{**_fields(CFG), "num_workers": 2, "kv_budget_tokens": 400_000,
                          "admission": True})
    sim = Replay(burst, "least-loaded", cfg, None)
    sim.run()
    assert sim.admission.num_queued == 0
    result_records = list(sim.records.values())
    assert all(r.status == OK for r in result_records)
    queued = [r for r in result_records if r.dispatch_s is not None and r.dispatch_s > 0]
    assert queued, "the burst never queued in admission: the test does not test anything"
