"""``replay(requests, policy, cfg)``: N sim workers, one router, one virtual clock.

A discrete-event loop. Events are request arrivals and step completions; each worker runs one
engine step at a time, ``CostModel.step_time`` long. Everything between the events is the code
that serves: the router (``gateway.routing.registry.make_router``) fed by a real ``KVIndex``
that the engines' own cache events build, the admission state machine, the engines' scheduler
and prefix cache. Nothing is copied; no sockets.

Life of a request::

    arrival     open loop: its trace timestamp / rate_scale; closed loop: parent's finish
                + think_s / rate_scale
    route       hashes of its first (n - 1) // page pages -> router.route -> Decision
    admission   (--admission on) Admission.offer: now, later (started/done of others), or
                rejected (QueueFull); Generate.priority = the ticket's priority
    dispatch    engine.add; router.dispatched
    first token TTFT = first token time - arrival
    finish      router.finished; a turn that ended in tool calls is retained (--retention on)
                for PauseLearner.ttl_s; the next turn's first token releases it

``global``: the upper bound of one pool: ONE sim worker with N x the KV budget, N x the step
token budget and running-request cap, and N x the throughput: N x the tokens in one worker's
step time (every per-token coefficient / N, the step's fixed overhead as one worker's; see
``_pool_cost``).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from engine.cost import COST_PRESETS, CostModel
from engine.sampling_params import SamplingParams
from gateway.routing.index import KVIndex
from gateway.routing.types import RouteRequest, WorkerInfo
from replay.metrics import ERROR, OK, REJECTED, RequestRecord, Summary, summarize
from replay.routers import GLOBAL, make_policy
from replay.sim_worker import SimWorker, WorkerSpec, replay_model_config
from replay.tokens import Prompt, PromptBuilder

_ARRIVE, _STEP = 0, 1


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """One replay's setup (see ``agentgate replay --help`` for the flags).

    Attributes:
        num_workers: sim workers (``global`` runs one with N x the memory and throughput).
        kv_budget_tokens: KV per worker, full-attention token equivalents.
        block_size: tokens per trace block; ``page_size`` 0 = the block size.
        cost: a ``engine.cost.COST_PRESETS`` name.
        admission: route through ``gateway.routing.admission.Admission``.
        retention: retain tool-call turns' ends for the learned pause (``Engine.retain``).
        rate_scale: arrival-rate multiplier (timestamps and think times divided by it).
        load_report_interval_s: how often each worker's LoadReport reaches the router.
        router_options: keyword options for ``make_router``.
        speculative_tokens: MTP drafts per decode step on every worker (0: off).
        mtp_acceptance: the probability a draft is accepted (``CostModel.mtp_acceptance``).
        mtp_draft_s_per_token: the cost of drafting one token (``CostModel``).
    """

    num_workers: int = 8
    kv_budget_tokens: int = 1_000_000
    block_size: int = 512
    page_size: int = 0
    cost: str = "h200"
    max_batched_tokens: int = 8192
    max_running_requests: int = 64
    checkpoint_interval_tokens: int | None = None
    admission: bool = False
    retention: bool = True
    rate_scale: float = 1.0
    load_report_interval_s: float = 0.1
    router_options: dict[str, Any] = field(default_factory=dict)
    speculative_tokens: int = 0
    mtp_acceptance: float = 0.7
    mtp_draft_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        assert self.num_workers >= 1, f"num_workers={self.num_workers}: must be >= 1"
        assert self.kv_budget_tokens > 0, f"kv_budget_tokens={self.kv_budget_tokens}"
        assert self.rate_scale > 0, f"rate_scale={self.rate_scale}: must be > 0"
        assert self.cost in COST_PRESETS, f"cost={self.cost!r}: one of {sorted(COST_PRESETS)}"
        assert self.block_size >= 1, f"block_size={self.block_size}"

    @property
    def page_tokens(self) -> int:
        return self.page_size or self.block_size

    def worker_spec(self, policy: str) -> WorkerSpec:
        cost, n = COST_PRESETS[self.cost], self.num_workers
        if self.speculative_tokens:
            cost = msgspec.structs.replace(cost, mtp_acceptance=self.mtp_acceptance,
                                           mtp_draft_s_per_token=self.mtp_draft_s_per_token)
        spec = WorkerSpec(page_size=self.page_tokens, kv_budget_tokens=self.kv_budget_tokens,
                          cost=cost, max_batched_tokens=self.max_batched_tokens,
                          max_running_requests=self.max_running_requests,
                          checkpoint_interval_tokens=self.checkpoint_interval_tokens,
                          speculative_tokens=self.speculative_tokens)
        if policy != GLOBAL:
            return spec
        return replace(spec, kv_budget_tokens=n * spec.kv_budget_tokens, cost=_pool_cost(cost, n),
                       max_batched_tokens=n * spec.max_batched_tokens,
                       max_running_requests=n * spec.max_running_requests)


@dataclass(slots=True)
class ReplayResult:
    policy: str
    config: ReplayConfig
    records: list[RequestRecord]
    worker_ids: list[str]
    summary: Summary
    wall_s: float
    cpu_s: float  # NOTE: the replay's own CPU time; on a shared box wall time says little
    engine_stats: dict[str, dict[str, int]]


def replay(requests: Sequence[Any], policy_name: str, cfg: ReplayConfig,
           progress: Callable[[int, int], None] | None = None) -> ReplayResult:
    """Replay ``requests`` (``replay.workloads.TraceRequest``s) through ``policy_name``.

    Args:
        progress: called with (requests done, total) now and then.

    Raises:
        ValueError: an unknown policy, or a request whose parent is not in ``requests``.
    """
    t0, cpu0 = time.perf_counter(), time.process_time()
    sim = Replay(requests, policy_name, cfg, progress)
    sim.run()
    lost = sum(w.engine.cache.stats.cut_tokens for w in sim.workers.values())
    records = list(sim.records.values())
    ids = list(sim.workers)
    summary = summarize(policy_name, records, ids, lost, num_workers=cfg.num_workers)
    return ReplayResult(policy_name, cfg, records, ids, summary,
                        time.perf_counter() - t0, time.process_time() - cpu0, sim.engine_stats())


class Replay:
    """One replay's state: workers, router, index, records (``replay`` runs one; tests look
    inside). ``run()`` once, then read ``records``, ``workers``, ``index``."""

    def __init__(self, requests: Sequence[Any], policy: str, cfg: ReplayConfig,
                 progress: Callable[[int, int], None] | None) -> None:
        self.cfg, self.policy, self.progress = cfg, policy, progress
        self.requests = {r.request_id: r for r in requests}
        if len(self.requests) != len(requests):
            raise ValueError("request ids must be unique")
        self.children: dict[str, list[Any]] = {}
        for r in requests:
            if r.parent is not None:
                if r.parent not in self.requests:
                    raise ValueError(f"request {r.request_id}: parent {r.parent!r} not in trace")
                self.children.setdefault(r.parent, []).append(r)
        self.now_s = 0.0  # NOTE: the virtual clock: the time of the event being handled
        self._init_workers(policy)
        self.builder = PromptBuilder(cfg.page_tokens, cfg.block_size, self.model_vocab)
        # NOTE: a parent's prompt and output ids are kept until its last continuing child has
        # built its prompt (``kids_left`` counts them down)
        self.kids_left = {p: sum(c.prefix_from_parent for c in kids)
                          for p, kids in self.children.items()}
        self.prompts: dict[str, Prompt] = {}
        self.outputs: dict[str, list[int]] = {}
        self.records: dict[str, RequestRecord] = {}
        self.pending: dict[str, tuple[RouteRequest, Prompt]] = {}  # queued in admission
        self.in_flight: dict[str, Any] = {}  # request id -> engine Sequence
        self.retained: dict[str, str] = {}  # parent request id -> worker holding its retention
        self.finished_s: dict[str, float] = {}
        self.heap: list[tuple[float, int, int, Any]] = []
        self.order = 0
        self.num_done = 0
        self.params_cache: dict[int, SamplingParams] = {}

    # ------------------------------------------------------------------ setup

    def _init_workers(self, policy: str) -> None:
        cfg = self.cfg
        spec = cfg.worker_spec(policy)
        model = replay_model_config()
        self.model_vocab = model.vocab_size
        n = 1 if policy == GLOBAL else cfg.num_workers
        # NOTE: L3 entries age by the storage TTL in virtual time, not the replay's wall time
        self.index = KVIndex(cfg.page_tokens, clock=lambda: self.now_s)
        self.router = make_policy(policy, self.index, **cfg.router_options)
        self.workers = {f"w{i}": SimWorker(f"w{i}", spec, model, self.index) for i in range(n)}
        window = model.sliding_window
        k = -(-window // cfg.page_tokens) if window else 0
        self.admission = _make_admission() if cfg.admission else None
        self.learner = _make_learner() if cfg.retention else None
        self.next_report = dict.fromkeys(self.workers, 0.0)
        for wid in self.workers:
            # NOTE: as a live worker's Welcome says: its events announce SWA per page
            self.index.add_worker(wid, window_pages=k, per_page_swa=True)
            self.router.add_worker(WorkerInfo(wid, cfg.page_tokens, spec.cost,
                                              spec.max_batched_tokens, window,
                                              swa_page_events=True))
            if self.admission is not None:
                self.admission.add_worker(wid, spec.cost, spec.max_batched_tokens)

    # ------------------------------------------------------------------ event loop

    def run(self) -> None:
        scale = self.cfg.rate_scale
        for r in self.requests.values():
            if r.parent is None:
                self._push((r.arrival_s or 0.0) / scale, _ARRIVE, r)
        total, every = len(self.requests), max(1, len(self.requests) // 200)
        next_report = every
        while self.heap:
            now, _, kind, obj = heapq.heappop(self.heap)
            self.now_s = now
            if kind == _ARRIVE:
                self._arrive(obj, now)
            else:
                self._step_done(obj, now)
            if self.progress is not None and self.num_done >= next_report:
                next_report = self.num_done + every
                self.progress(self.num_done, total)
        if self.progress is not None:
            self.progress(self.num_done, total)

    def _push(self, t: float, kind: int, obj: Any) -> None:
        self.order += 1
        heapq.heappush(self.heap, (t, self.order, kind, obj))

    # ------------------------------------------------------------------ arrival -> dispatch

    def _arrive(self, req: Any, now: float) -> None:
        prompt = self._prompt(req)
        n = prompt.num_tokens
        page = self.cfg.page_tokens
        rec = RequestRecord(req.request_id, now, n)
        parent = self.requests.get(req.parent) if req.parent else None
        if parent is not None and parent.ends_in_tool_call:
            if self.learner is not None and req.parent in self.finished_s:
                self.learner.observe(req.tenant, tuple(parent.tool_names),
                                     now - self.finished_s[req.parent])
            if req.prefix_from_parent:
                rec.resumable_tokens = min(self._parent_len(req.parent), n - 1) // page * page
        self.records[req.request_id] = rec
        route = RouteRequest(req.request_id, n, prompt.hashes[: (n - 1) // page],
                             affinity_key=req.session_id, tenant=req.tenant,
                             max_new_tokens=req.output_length)
        decision = self.router.route(route, list(self.workers))
        rec.worker_id, rec.reason = decision.worker_id, decision.reason
        if self.admission is None:
            self._dispatch(route, prompt, decision.worker_id, now, 0)
            return
        self._offer(route, prompt, decision, now)

    def _offer(self, route: RouteRequest, prompt: Prompt, decision: Any, now: float) -> None:
        from gateway.routing.admission import QueueFull, Ticket

        ticket = Ticket(route.request_id, decision.worker_id, route.tenant, route.num_tokens,
                        decision.cached_tokens, now)
        try:
            admitted = self.admission.offer(ticket, now)  # type: ignore[union-attr]
        except QueueFull:
            self._end(route.request_id, now, REJECTED)
            return
        if admitted:
            self._dispatch(route, prompt, decision.worker_id, now, ticket.priority)
        else:
            self.pending[route.request_id] = (route, prompt)

    def _admitted(self, tickets: Sequence[Any], now: float) -> None:
        for t in tickets:
            entry = self.pending.pop(t.request_id, None)
            if entry is not None:
                self._dispatch(entry[0], entry[1], t.worker_id, now, t.priority)

    def _dispatch(self, route: RouteRequest, prompt: Prompt, worker_id: str, now: float,
                  priority: int) -> None:
        req = self.requests[route.request_id]
        worker = self.workers[worker_id]
        rec = self.records[route.request_id]
        rec.worker_id, rec.dispatch_s = worker_id, now
        seq = worker.engine.make_sequence(
            req.request_id, prompt.ids.tolist(), self._params(req.output_length),
            priority=priority, session_id=req.session_id, page_hashes=list(prompt.hashes),
        )
        self.router.dispatched(route, worker_id, now)
        self.in_flight[req.request_id] = seq
        worker.add(seq)
        if not worker.busy:
            self._start(worker, now)

    # ------------------------------------------------------------------ steps

    def _start(self, worker: SimWorker, now: float) -> None:
        done = worker.start_step(now)
        if done is not None:
            self._push(done, _STEP, worker)

    def _step_done(self, worker: SimWorker, now: float) -> None:
        outputs = worker.finish_step(now)
        if now >= self.next_report[worker.worker_id]:
            self.next_report[worker.worker_id] = now + self.cfg.load_report_interval_s
            self.router.load_report(worker.worker_id, worker.load_report(), now)
        for seq in outputs:
            rec = self.records[seq.request_id]
            if rec.first_token_s is None and seq.output_ids:
                self._first_token(seq, rec, now)
            if seq.is_finished:
                rec.cached_tokens = min(seq.num_cached, len(seq.prompt_ids))
                rec.output_tokens = len(seq.output_ids)
                if self.kids_left.get(seq.request_id):
                    self.outputs[seq.request_id] = seq.output_ids
                ok = seq.finish_reason != "error"
                self._end(seq.request_id, now, OK if ok else ERROR, worker)
        if worker.has_work and not worker.busy:  # NOTE: a ticket admitted above may have started it
            self._start(worker, now)

    def _first_token(self, seq: Any, rec: RequestRecord, now: float) -> None:
        rec.first_token_s = now
        rec.cached_tokens = min(seq.num_cached, len(seq.prompt_ids))
        self.router.first_token(seq.request_id, now)
        if self.admission is not None:
            self._admitted(self.admission.started(seq.request_id, now), now)
        self._release_parent(seq.request_id, now)

    def _end(self, rid: str, now: float, status: str, worker: SimWorker | None = None) -> None:
        rec = self.records[rid]
        rec.status, rec.finish_s = status, now
        self.in_flight.pop(rid, None)
        self.finished_s[rid] = now
        self.num_done += 1
        if status != REJECTED:
            self.router.finished(rid, now)
        if self.admission is not None:
            self._admitted(self.admission.done(rid, now), now)
        self._release_parent(rid, now)
        req = self.requests[rid]
        if status == OK and worker is not None and req.ends_in_tool_call and self.learner:
            ttl = self.learner.ttl_s(req.tenant, tuple(req.tool_names))
            if worker.retain(rid, ttl, now):
                self.retained[rid] = worker.worker_id
        for child in self.children.get(rid, ()):
            self._push(now + child.think_s / self.cfg.rate_scale, _ARRIVE, child)

    def _release_parent(self, rid: str, now: float) -> None:
        parent = self.requests[rid].parent
        wid = self.retained.pop(parent, None) if parent is not None else None
        if wid is not None:
            self.workers[wid].retain(parent, 0.0, now)

    # ------------------------------------------------------------------ prompts

    def _prompt(self, req: Any) -> Prompt:
        if req.parent is not None and req.prefix_from_parent:
            parent = self.requests[req.parent]
            base = self.prompts[req.parent]
            out = self.outputs.get(req.parent, [])
            new = req.input_length - parent.input_length - parent.output_length
            prompt = self.builder.continued(base, out, req.hash_ids, new)
            self.kids_left[req.parent] -= 1
            if self.kids_left[req.parent] == 0:
                self.prompts.pop(req.parent, None)
                self.outputs.pop(req.parent, None)
        else:
            prompt = self.builder.fresh(req.hash_ids, req.input_length)
        if self.kids_left.get(req.request_id):
            self.prompts[req.request_id] = prompt
        return prompt

    def _parent_len(self, parent_id: str) -> int:
        rec = self.records.get(parent_id)
        return 0 if rec is None else rec.prompt_tokens + rec.output_tokens

    def _params(self, max_new_tokens: int) -> SamplingParams:
        params = self.params_cache.get(max_new_tokens)
        if params is None:
            params = SamplingParams(max_new_tokens=max(1, max_new_tokens), ignore_eos=True)
            self.params_cache[max_new_tokens] = params
        return params

    def engine_stats(self) -> dict[str, dict[str, int]]:
        out = {}
        for wid, w in self.workers.items():
            st, cs = w.stats(), w.engine.cache.stats
            out[wid] = {"steps": w.num_steps, "preemptions": st.num_preemptions,
                        "cached_pages": st.cached_pages, "raw_matched_tokens":
                        cs.raw_matched_tokens, "matched_tokens": cs.matched_tokens,
                        "swa_lost_tokens": cs.cut_tokens,
                        "retained_pages": getattr(st, "retained_pages", 0),
                        "retains_expired": getattr(st, "retains_expired", 0)}
        return out


def _pool_cost(cost: CostModel, n: int) -> CostModel:
    """The step cost of one pool of ``n`` workers: ``n`` x the tokens in one worker's step time.

    The per-token terms are divided by ``n``; the step's fixed overhead is not. Dividing it too
    (as this did before) made every step of the pool ``n`` x shorter, so a request decoded ``n``
    x faster than the hardware can and its next turn found its prefix finished and its window
    checkpointed where 8 real workers are still decoding it: on the conversation trace that
    alone was worth 1.1 points of the pool's hit rate (31.8 against 30.7 %), a latency the
    hardware does not have rather than a cache any router could reach.
    """
    return CostModel(cost.step_overhead_s, cost.prefill_s_per_token / n,
                     cost.decode_s_per_token / n, cost.attn_s_per_qk / n,
                     cost.mtp_draft_s_per_token / n, cost.mtp_acceptance)


def _make_admission() -> Any:
    from gateway.routing.admission import Admission, AdmissionConfig

    return Admission(AdmissionConfig())


def _make_learner() -> Any:
    from gateway.routing.retention import PauseLearner

    return PauseLearner()
