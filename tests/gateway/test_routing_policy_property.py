"""AgentgateRouter under random call sequences: it only picks candidates, and its load counts
return to zero once every request has ended, whatever the order of the calls."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cost import H200_COST, CostModel
from engine.protocol import LoadReport
from engine.worker.events import BlockStored, KVEventBatch, SwaCheckpointStored
from gateway.routing.index import KVIndex
from gateway.routing.policy import AgentgateRouter
from gateway.routing.types import REASONS, RouteRequest, WorkerInfo

PAGE = 4
WORKERS = ("a", "b", "c")
CHAINS = [list(range(s, s + 30)) for s in (0, 1000, 2000)]

OP = st.one_of(
    st.tuples(st.just("send"), st.integers(0, 2), st.integers(0, 30), st.integers(1, 7),
              st.sampled_from([None, "k1", "k2"]), st.floats(0, 3)),
    st.tuples(st.just("first_token"), st.integers(0, 50), st.floats(0, 3)),
    st.tuples(st.just("finished"), st.integers(0, 50), st.floats(0, 3)),
    st.tuples(st.just("remove"), st.sampled_from(WORKERS)),
    st.tuples(st.just("add"), st.sampled_from(WORKERS)),
    st.tuples(st.just("stored"), st.sampled_from(WORKERS), st.integers(0, 2), st.integers(1, 30)),
    st.tuples(st.just("report"), st.sampled_from(WORKERS), st.floats(0, 3)),
    st.tuples(st.just("resend"), st.integers(0, 50), st.sampled_from(WORKERS)),
)


def _info(worker_id: str) -> WorkerInfo:
    cost = H200_COST if worker_id == "a" else CostModel()
    return WorkerInfo(worker_id, PAGE, cost, max_batched_tokens=16, sliding_window=8)


def _report(worker_id: str) -> LoadReport:
    return LoadReport(worker_id=worker_id, num_running=0, num_waiting=0, free_full_pages=1,
                      free_swa_pages=1, used_bytes=0, total_bytes=1, cached_pages=0)


class _Caller:
    """The caller's side: what it sent and what is still live, as a dispatcher keeps it."""

    def __init__(self, ttl_s: float) -> None:
        self.router = AgentgateRouter(KVIndex(PAGE), optimistic_ttl_s=ttl_s)
        self.live = set(WORKERS)
        self.open: list[str] = []
        self.now_s = 0.0
        self.seq = 0
        for w in WORKERS:
            self.router.add_worker(_info(w))

    def apply(self, op: tuple) -> None:
        kind = op[0]
        if kind == "send":
            self._send(*op[1:])
        elif kind in ("first_token", "finished") and self.open:
            rid = self.open[op[1] % len(self.open)]
            self.now_s += op[2]
            getattr(self.router, kind)(rid, self.now_s)
            if kind == "finished":
                self.open.remove(rid)
        elif kind == "remove" and len(self.live) > 1:
            self.live.discard(op[1])
            self.router.remove_worker(op[1])
        elif kind == "add":
            self.live.add(op[1])
            self.router.add_worker(_info(op[1]))
        elif kind == "stored" and op[1] in self.live:
            chain = CHAINS[op[2]][: op[3]]
            index, w = self.router.index, op[1]
            batch = KVEventBatch(ts=0.0, events=[
                BlockStored(block_hashes=chain, parent_block_hash=None,
                            token_ids=[0] * (PAGE * len(chain)), block_size=PAGE),
                SwaCheckpointStored(block_hashes=[chain[-1]], window=8)])
            assert index.apply(w, index.next_seq(w), batch) is None
        elif kind == "resend" and self.open and op[2] in self.live:
            # NOTE: the caller sends a request it had sent again (a retry elsewhere)
            rid = self.open[op[1] % len(self.open)]
            req = RouteRequest(request_id=rid, num_tokens=9, page_hashes=CHAINS[0][:2])
            self.router.dispatched(req, op[2], self.now_s)
        elif kind == "report":
            self.now_s += op[2]
            self.router.load_report(op[1], _report(op[1]), self.now_s)

    def _send(self, chain: int, pages: int, extra: int, key: str | None, dt: float) -> None:
        self.now_s += dt
        self.seq += 1
        hashes = CHAINS[chain][:pages]
        req = RouteRequest(request_id=f"r{self.seq}", num_tokens=pages * PAGE + extra,
                           page_hashes=hashes, affinity_key=key)
        candidates = sorted(self.live)[: 1 + self.seq % len(self.live)]
        decision = self.router.route(req, candidates)
        assert decision.worker_id in candidates, (decision, candidates)
        assert decision.reason in REASONS
        assert 0 <= decision.cached_tokens < req.num_tokens
        self.router.dispatched(req, decision.worker_id, self.now_s)
        self.open.append(req.request_id)


def _assert_mirror(router: AgentgateRouter) -> None:
    """The router's per-worker load lists agree with its LoadTracker."""
    load = router.load
    for w, (prefill, _, decoding, in_flight) in router._wl.items():
        got = (prefill, decoding, in_flight)
        want = (load.prefill_tokens(w), load.num_decoding(w), load.num_in_flight(w))
        assert got == want, (w, got, want)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(OP, max_size=60), ttl_s=st.sampled_from([0.0, 1.0, 5.0]))
def test_only_candidates_and_counts_return_to_zero(ops: list, ttl_s: float) -> None:
    caller = _Caller(ttl_s)
    for op in ops:
        caller.apply(op)
        _assert_mirror(caller.router)
    for rid in list(caller.open):
        caller.router.finished(rid, caller.now_s)
    load = caller.router.load
    for w in WORKERS:
        counts = (load.prefill_tokens(w), load.num_decoding(w), load.num_in_flight(w))
        assert counts == (0, 0, 0), (w, counts)
        assert caller.router._wl.get(w, [0, 0, 0, 0]) == [0, 0, 0, 0], w
    assert not caller.router._sent
    caller.router.index.expire(caller.now_s + ttl_s)
    assert caller.router.index.num_predicted_pages == 0
