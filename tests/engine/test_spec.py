"""MTP speculative decoding (``engine.spec``, issue 14) on tiny random checkpoints with MTP layers:

- lossless: greedy and seeded tokens, logprobs, grammar-constrained output and repetition
  penalties are those of the engine without MTP (K = 1..3, prefix cache on and off, under
  preemption), and unseeded sampling has the base model's distribution (a statistical test);
- the drafts are those of a from-scratch MTP chain over the whole sequence (SGLang's layout,
  re-derived here on contiguous KV), with the SWA-aware prefill ("window") and the naive one
  ("full") alike, so rejected drafts' KV is rolled back and the window skips nothing it needs;
- no page leaks, the same prefix-cache hits with MTP on and off, O(K^2 W) MTP prefill rows.
"""

from __future__ import annotations

import collections
import json
import math
import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.cost import CostModel
from engine.engine import Engine
from engine.kv.contiguous import ContiguousBatch, SequenceKV
from engine.kv.layout import KVLayout, PageKind
from engine.model_config import ModelConfig
from engine.models.checkpoint import mimo_config, write_random_checkpoint
from engine.models.mtp import mtp_model_config
from engine.models.mtp_distill import distill_mtp
from engine.sampling_params import StructuredSpec
from engine.spec import Drafter, MTPState, mtp_starts
from gateway.tokenizer import write_demo_tokenizer

PAGE = 4
W = 4
K_MAX = 3
EOS = (258, 256)


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mtp-model")
    config = mimo_config(layers="FSSF", sliding_window=W, eos_token_id=list(EOS),
                         num_nextn_predict_layers=K_MAX)
    write_random_checkpoint(out, config, seed=3)
    write_demo_tokenizer(out)
    # NOTE: distilled, so drafts are often accepted and every verify path runs
    distill_mtp(out, steps=40, num_seqs=32, seed=3)
    return out


@pytest.fixture(scope="module")
def base(mtp_dir: Path) -> LLM:
    return LLM(mtp_dir, dtype="float32", device="cpu", page_size=PAGE)


_llms: dict[tuple, LLM] = {}


def _llm(model_dir: Path, k: int, **kwargs: object) -> LLM:
    key = (str(model_dir), k, tuple(sorted(kwargs.items())))
    if key not in _llms:
        _llms[key] = LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE,
                         speculative_tokens=k, **kwargs)
    return _llms[key]


def _prompts(seed: int, n: int, lo: int = 2, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 250) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(prompts, params)]


# ------------------------------------------------------------------ lossless


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), k=st.integers(1, K_MAX), cache=st.booleans(),
       tight=st.booleans())
def test_greedy_tokens_equal_decoding_without_mtp(mtp_dir, base, seed, k, cache, tight):
    """Batches of requests, the prefix cache on or off, and (``tight``) a KV budget that
    preempts requests mid-decode (their drafts dropped, MTP restarted from the hit)."""
    prompts = _prompts(seed, 6 if tight else 4)
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    want = _tokens(base, prompts, params)
    memory = {}
    if tight:
        chunk = _llm(mtp_dir, K_MAX).engine.layout.chunk_bytes
        memory = {"kv_budget_bytes": chunk * 12, "max_num_batched_tokens": 16}
    llm = _llm(mtp_dir, k, enable_prefix_cache=cache, **memory)
    assert _tokens(llm, prompts, params) == want
    # again: now most prompts hit the prefix cache (their MTP layers start at the hit)
    assert _tokens(llm, prompts, params) == want


def test_mtp_verifies_drafts_and_accepts_some(mtp_dir):
    llm = _llm(mtp_dir, 3)
    before = llm.engine.spec_stats.verify_steps
    _tokens(llm, _prompts(1, 4), SamplingParams(max_new_tokens=16, temperature=0.0,
                                                ignore_eos=True))
    stats = llm.engine.spec_stats
    assert stats.verify_steps > before
    assert stats.drafted <= 3 * stats.verify_steps
    assert 0 < stats.accepted < stats.drafted, stats
    assert stats.acceptance_length > 1.05, stats


@pytest.mark.parametrize("k", [1, 3])
def test_seeded_sampling_logprobs_and_penalties_equal_without_mtp(mtp_dir, base, k):
    prompts = _prompts(7, 5)
    params = [SamplingParams(max_new_tokens=18, temperature=0.9, top_p=0.9, seed=11 + i,
                             logprobs=2, repetition_penalty=1.3 if i % 2 else 1.0,
                             ignore_eos=True) for i in range(len(prompts))]
    want = base.generate(prompts, params)
    got = _llm(mtp_dir, k).generate(prompts, params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
        assert [[t for t, _ in top] for top in g.top_logprobs] == [
            [t for t, _ in top] for top in w.top_logprobs]


def test_grammar_constrained_output_is_exact(mtp_dir, base):
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"enum": ["x", "yz"]}},
              "required": ["a", "b"], "additionalProperties": False}
    spec = StructuredSpec(json_schema=json.dumps(schema))
    prompts = _prompts(3, 3)
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_new_tokens=40, temperature=temperature, seed=5,
                                structured=spec)
        want = base.generate(prompts, params)
        got = _llm(mtp_dir, 3).generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]


def test_greedy_tokens_equal_under_preemption(mtp_dir, base):
    """A KV budget too small for every request at once: requests are preempted mid-decode
    (drafts dropped, MTP restarted from the hit) and still give the same tokens."""
    prompts = _prompts(5, 6, lo=20, hi=40)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    want = _tokens(base, prompts, params)
    chunk = _llm(mtp_dir, 2).engine.layout.chunk_bytes
    llm = LLM(mtp_dir, dtype="float32", device="cpu", page_size=PAGE, speculative_tokens=2,
              kv_budget_bytes=chunk * 12, max_num_batched_tokens=16)
    outs = llm.generate(prompts, params)
    assert [o.finish_reason for o in outs] == ["length"] * len(prompts)
    assert [list(o.token_ids) for o in outs] == want
    assert llm.engine.scheduler.num_preemptions > 0, "the budget never forced a preemption"


def test_unseeded_sampling_has_the_base_distribution(mtp_dir, base):
    """The 2nd and 3rd tokens (drawn at verify rows, where drafts are accepted or not) over many
    unseeded runs: a two-sample chi-square test against runs without MTP (p > 0.001)."""
    prompt = [5, 17, 99, 42, 7, 33]
    n = 600
    params = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True)
    torch.manual_seed(0)
    want = _tokens(base, [prompt] * n, params)
    torch.manual_seed(1)
    llm = _llm(mtp_dir, 2, max_running_requests=256)
    got = _tokens(llm, [prompt] * n, params)
    for pos in (1, 2):
        a = collections.Counter(t[pos] for t in want)
        b = collections.Counter(t[pos] for t in got)
        stat, dof = _chi2_two_sample(a, b)
        assert stat < _chi2_critical(dof), (pos, stat, dof)


def _chi2_two_sample(a: collections.Counter, b: collections.Counter) -> tuple[float, int]:
    """Two-sample chi-square over the categories, those with < 10 counts pooled."""
    na, nb = sum(a.values()), sum(b.values())
    cats = sorted(set(a) | set(b), key=lambda c: -(a[c] + b[c]))
    big = [c for c in cats if a[c] + b[c] >= 10]
    rest_a = na - sum(a[c] for c in big)
    rest_b = nb - sum(b[c] for c in big)
    cells = [(a[c], b[c]) for c in big] + ([(rest_a, rest_b)] if rest_a + rest_b else [])
    stat = 0.0
    for x, y in cells:
        tot = x + y
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return stat, max(1, len(cells) - 1)


def _chi2_critical(dof: int) -> float:
    """The 0.999 quantile of chi-square(dof), Wilson-Hilferty."""
    z = 3.09
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


# ------------------------------------------------------------------ drafts


@pytest.mark.parametrize("mode", ["window", "full"])
def test_drafts_equal_a_from_scratch_mtp_chain(mtp_dir, mode, monkeypatch):
    """Every draft the engine makes (prefill and decode, drafts accepted or rolled back) is what
    SGLang's MTP chain computes from scratch over the whole sequence (top-1 up to float ties)."""
    llm = _llm(mtp_dir, 3, mtp_prefill=mode, enable_prefix_cache=False)
    seen = _record_drafts(monkeypatch)
    prompts = [_prompts(9, 1, lo=30, hi=31)[0], _prompts(10, 1, lo=3, hi=4)[0]]
    _tokens(llm, prompts, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    assert len(seen) >= 2 * 4
    _assert_drafts_match(llm.model, seen)


def _record_drafts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], list[int]]]:
    """(the request's tokens, its drafts) for every step that drafted, from now on."""
    seen: list[tuple[list[int], list[int]]] = []
    real = Drafter.run

    def run(self, jobs):  # noqa: ANN001, ANN202 (records what the engine drafted)
        real(self, jobs)
        seen.extend((j.seq.token_ids, list(j.drafts)) for j in jobs if j.draft and j.drafts)

    monkeypatch.setattr(Drafter, "run", run)
    return seen


def _assert_drafts_match(model, seen: list[tuple[list[int], list[int]]]) -> None:  # noqa: ANN001
    """Every draft is the from-scratch chain's top-1 (up to float ties)."""
    for tokens, drafts in seen:
        ref_logits = _reference_draft_logits(model, tokens, drafts)
        for k, (logits, d) in enumerate(zip(ref_logits, drafts)):
            assert logits[d] >= logits.max() - 1e-4, (k, tokens, drafts, int(logits.argmax()))


def _reference_draft_logits(model, tokens: list[int], drafts: list[int]) -> list[torch.Tensor]:
    """Per MTP layer k, the logits of its last row, computed over the whole sequence on
    contiguous KV (rows p = 0 .. F-1 with token p + 1 + k, rope position p)."""
    cfg = model.config
    f = len(tokens) - 1
    n_base = cfg.num_hidden_layers
    with torch.inference_mode():
        kv = SequenceKV(n_base + model.mtp.num_layers)
        batch = ContiguousBatch([kv], [f])
        ids = torch.tensor(tokens[:f])
        hidden = model(ids, batch.positions(), batch)
        ext = tokens + drafts
        out = []
        prev = hidden
        for k in range(model.mtp.num_layers):
            mkv = SequenceKV(n_base + model.mtp.num_layers)
            mb = ContiguousBatch([mkv], [f])
            emb = model.model.embed_tokens(torch.tensor(ext[1 + k : f + 1 + k]))
            res = model.mtp(k, emb, prev, mb.positions(), mb)
            out.append(model.compute_logits(res.hidden[-1:])[0])
            prev = res.residual
    return out


@pytest.mark.parametrize("new", [2, 3 * (W + 1) + 2])
def test_a_cache_hit_needs_no_mtp_recompute(mtp_dir, monkeypatch, new):
    """Turn 2 extends turn 1 (output included) by a few or more than K (W + 1) tokens: it hits
    the cache, its MTP layers continue from the hit's page (``Node.mtp``) and compute rows only
    after it (none of the cached prefix again), and every draft still equals the from-scratch
    chain over the whole sequence."""
    llm = LLM(mtp_dir, dtype="float32", device="cpu", page_size=PAGE, speculative_tokens=3)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    turn1 = _prompts(41, 1, lo=40, hi=41)[0]
    [out1] = llm.generate([turn1], params)
    turn2 = [*turn1, *out1.token_ids, *_prompts(42, 1, lo=new, hi=new + 1)[0]]
    seen = _record_drafts(monkeypatch)
    seq = llm.engine.make_sequence("turn2", turn2, params)
    llm.engine.add(seq)
    rows = 0
    while llm.engine.has_work:
        llm.engine.step()
        if isinstance(seq.mtp, MTPState):
            rows = seq.mtp.rows
    hit = seq.num_cached
    assert hit >= len(turn1) - PAGE, hit
    assert isinstance(seq.mtp, MTPState) and seq.mtp.start == [1, 2, 3], "not resumed"
    # NOTE: per MTP layer, the rows after the hit plus at most K + 1 rows for each of the <= 6
    # decode steps; recomputing the cached prefix would need ~3 * len(turn2) rows
    bound = 3 * (len(turn2) - hit + 6 * (3 + 1))
    assert bound < 3 * len(turn2) - 3 * PAGE
    assert rows <= bound, (rows, hit, len(turn2))
    assert seen
    _assert_drafts_match(llm.model, seen)


def test_swa_aware_prefill_computes_o_k2_w_rows(mtp_dir):
    """A prompt of P >> K * W: the window mode computes about K (K + 1) / 2 * (W + 1) MTP prefill
    rows, the full mode K * P; the same first drafts."""
    prompt = _prompts(21, 1, lo=120, hi=121)[0]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    rows = {}
    for mode in ("window", "full"):
        llm = _llm(mtp_dir, 3, mtp_prefill=mode, enable_prefix_cache=False)
        seq = llm.engine.make_sequence(f"swa-{mode}", prompt, params)
        llm.engine.add(seq)
        for _ in range(10):  # NOTE: the prefill's chunks, up to its first drafts
            llm.engine.step()
            if seq.draft_ids:
                break
        assert isinstance(seq.mtp, MTPState)
        rows[mode] = (seq.mtp.rows, list(seq.draft_ids))
        llm.engine.abort(seq.request_id)
    p = len(prompt)
    assert rows["full"][0] >= 3 * (p - 3)
    assert rows["window"][0] <= 6 * (W + 1) + 3 * 3, rows
    assert rows["window"][1] == rows["full"][1]


def test_mtp_starts():
    assert mtp_starts(3, 128, 0, 10_000) == [10_000 - 128 - 2 * 129, 10_000 - 128 - 129,
                                             10_000 - 128]
    assert mtp_starts(3, 128, 0, 50) == [1, 2, 3]  # a short prompt: every slot
    assert mtp_starts(2, 128, 64, 100) == [65, 66]  # after a hit: from the hit
    assert mtp_starts(2, 4, 0, 100, full=True) == [1, 2]


# ------------------------------------------------------------------ memory and cache


def test_no_page_leaks_and_the_same_hits(mtp_dir, base):
    """Two-turn sessions: turn 2 extends turn 1's prompt and output. The cached tokens are the
    same with MTP on and off, and once everything finished and the cache is flushed every page
    is free again (rejected drafts' pages included)."""
    turn1 = _prompts(31, 4, lo=10, hi=30)
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    cached = {}
    for k in (0, 3):
        llm = LLM(mtp_dir, dtype="float32", device="cpu", page_size=PAGE, speculative_tokens=k)
        out1 = llm.generate(turn1, params)
        turn2 = [[*p, *o.token_ids, 9, 8, 7] for p, o in zip(turn1, out1)]
        out2 = llm.generate(turn2, params)
        cached[k] = ([o.cached_tokens for o in out2], [o.token_ids for o in out2])
        engine = llm.engine
        engine.flush_cache()
        a = engine.allocator
        assert a.num_used_pages(PageKind.FULL) == a.num_used_pages(PageKind.SWA) == 0
        assert a.num_free_chunks == a.num_chunks
    assert cached[0] == cached[3]
    assert all(c > 0 for c in cached[3][0])


def test_more_mtp_tokens_than_the_checkpoint_has_is_a_clear_error(mtp_dir):
    with pytest.raises(ValueError, match="MTP|nextn|mtp"):
        LLM(mtp_dir, dtype="float32", device="cpu", page_size=PAGE,
            speculative_tokens=K_MAX + 1)


# ------------------------------------------------------------------ the sim backend


def _sim_engine(k: int, acceptance: float = 0.7, budget_pages: int | None = None,
                **kwargs: object) -> Engine:
    cfg = EngineConfig(backend="sim", page_size=PAGE, speculative_tokens=k,
                       kv_budget_bytes=_SIM_PAGE_BYTES * budget_pages if budget_pages else
                       64 * 2**20, **kwargs)
    return Engine(cfg, ModelConfig.from_dict(SIM_CONFIG),
                  cost=CostModel(mtp_acceptance=acceptance, mtp_draft_s_per_token=1e-5))


SIM_CONFIG = mimo_config(layers="FSSF", sliding_window=W, eos_token_id=list(EOS),
                         num_nextn_predict_layers=K_MAX)
_SIM_PAGE_BYTES = 0  # set below (one full + one SWA page of the MTP layout)


def _drain(engine: Engine) -> int:
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
    return steps


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_sim_models_mtp_with_the_cost_models_acceptance(k):
    """Same tokens as without MTP (the sim draws by position), fewer steps, and an acceptance
    length that matches (1 - a^(K+1)) / (1 - a) for the configured rate a."""
    runs = {}
    for kk in (0, k):
        engine = _sim_engine(kk, acceptance=0.6)
        seqs = [engine.make_sequence(f"r{i}", list(range(1, 20 + i)),
                                     SamplingParams(max_new_tokens=200)) for i in range(8)]
        for q in seqs:
            engine.add(q)
        runs[kk] = (_drain(engine), [q.output_ids for q in seqs], engine.spec_stats,
                    engine.runner.clock_s)
    assert runs[k][1] == runs[0][1]
    assert runs[k][0] < runs[0][0]
    expected = (1 - 0.6 ** (k + 1)) / (1 - 0.6)
    assert runs[k][2].acceptance_length == pytest.approx(expected, rel=0.1)


class SpecEngineMachine(RuleBasedStateMachine):
    """The sim engine with MTP on a budget that forces preemption: requests come, step, abort
    and finish with drafts accepted or rolled back; every page in use is held by the cache or a
    request, and once all is done and the cache flushed, none is."""

    def __init__(self) -> None:
        super().__init__()
        self.engine: Engine = None  # type: ignore[assignment]
        self.n = 0

    @initialize(k=st.integers(1, K_MAX), acceptance=st.sampled_from([0.0, 0.5, 0.9]),
                pages=st.integers(24, 60))
    def setup(self, k: int, acceptance: float, pages: int) -> None:
        self.engine = _sim_engine(k, acceptance, budget_pages=pages, max_num_batched_tokens=16)

    @rule(pages=st.lists(st.integers(0, 2), min_size=1, max_size=6), tail=st.integers(1, 5),
          new=st.integers(1, 30))
    def add(self, pages: list[int], tail: int, new: int) -> None:
        prompt = [t for p in pages for t in (p + 1, 9, 9, 10)] + list(range(11, 11 + tail))
        self.n += 1
        seq = self.engine.make_sequence(f"m{self.n}", prompt, SamplingParams(max_new_tokens=new))
        self.engine.add(seq, bounded=False)

    @rule(steps=st.integers(1, 8))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            self.engine.step()

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = self.engine.scheduler.running + self.engine.scheduler.waiting
        if live:
            self.engine.abort(data.draw(st.sampled_from(live)).request_id)

    @rule()
    def drain_and_flush(self) -> None:
        _drain(self.engine)
        self.engine.flush_cache()
        a = self.engine.allocator
        assert a.num_used_pages(PageKind.FULL) == a.num_used_pages(PageKind.SWA) == 0
        assert a.used_bytes == 0

    @invariant()
    def pages_in_use_are_held(self) -> None:
        e = self.engine
        seqs = e.scheduler.running + e.scheduler.waiting
        nodes = list(e.cache.nodes())
        for kind, node_page, pending in (
                (PageKind.FULL, "full_page", "pending_full"),
                (PageKind.SWA, "swa_page", "pending_swa")):
            held = sum(getattr(n, node_page) is not None for n in nodes)
            held += sum(len(getattr(q, pending)) for q in seqs)
            assert e.allocator.num_used_pages(kind) == held, kind
        for q in e.scheduler.running:
            assert len(q.draft_ids) <= e.cfg.speculative_tokens
            assert q.num_computed <= q.num_tokens
            assert (len(q.path) + len(q.pending_full)) * PAGE >= q.num_computed


SpecEngineMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=30,
                                               deadline=None)
test_spec_engine_machine = SpecEngineMachine.TestCase


def test_a_replay_hits_the_same_prefixes_with_mtp_on_and_off():
    """The built-in agent workload on one sim worker with room for everything: the prefix-cache
    hit rate with MTP (K = 3) equals the rate without."""
    from replay.harness import ReplayConfig, replay
    from replay.workloads import agent_workload

    requests = agent_workload(seed=3, num_sessions=6, block_size=16)
    rates = {}
    for k in (0, 3):
        cfg = ReplayConfig(num_workers=1, kv_budget_tokens=4_000_000, block_size=16,
                           cost="h200", speculative_tokens=k, mtp_acceptance=0.7)
        result = replay(requests, "agentgate", cfg)
        rates[k] = (result.summary.hit_rate, result.summary.cached_tokens)
    assert rates[3] == rates[0]
    assert rates[0][0] > 0.5


def _page_bytes() -> int:
    layout = KVLayout.from_model(mtp_model_config(ModelConfig.from_dict(SIM_CONFIG), K_MAX),
                                 PAGE, 2)
    return layout.page_bytes(PageKind.FULL) + layout.page_bytes(PageKind.SWA)


_SIM_PAGE_BYTES = _page_bytes()
