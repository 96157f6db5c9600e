"""Continuous batching: decodes first, then prefill chunks, within a token budget per step.

Each step every scheduled request computes ``query_len`` of its not-yet-computed tokens: 1 for a
decode, a chunk of the prompt for a prefill (chunked prefill). A request samples a token when the
step computes its last known token. Higher ``priority`` runs first; ties go by arrival.

Memory: a request is admitted only if its first chunk's pages can be had (evicting cached pages
if needed). When a running decode cannot get a page, the lowest-priority, newest running request
is preempted: its pages are released (completed pages stay in the prefix cache, so it usually
resumes with a hit) and it goes back to the front of the queue. A request that cannot fit even
with nothing else running fails with ``finish_reason="error"`` instead of waiting forever; alone, a
prefill chunk shrinks to what fits before that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.kv.manager import KVManager
from engine.sequence import Sequence, Status


class Overloaded(Exception):
    """The waiting queue is full (the gateway maps this to 429)."""


@dataclass(frozen=True, slots=True)
class Scheduled:
    seq: Sequence
    query_len: int

    @property
    def samples(self) -> bool:
        """Whether this step computes the request's last known token (so a token is sampled;
        with MTP drafts after it, one per draft verified too)."""
        return self.seq.num_computed + self.query_len >= self.seq.num_tokens

    @property
    def num_drafts(self) -> int:
        """The MTP drafts this step verifies (0 without speculation)."""
        return max(0, self.seq.num_computed + self.query_len - self.seq.num_tokens)


class Scheduler:
    def __init__(
        self,
        kv: KVManager,
        *,
        max_num_batched_tokens: int,
        max_running_requests: int,
        max_waiting_requests: int,
        ready: Callable[[Sequence], bool] | None = None,
        lookahead: int = 0,
    ) -> None:
        self.kv = kv
        # NOTE: MTP (engine.spec) writes its layers' KV up to K positions past a step's last
        # token: those pages are reserved with the step's own
        self.lookahead = lookahead
        # NOTE: a waiting request whose KV is still on its way from L3 is passed over until it
        # lands (or times out): the step loop never waits on it, the others go first
        self.ready = ready
        self.max_tokens = max_num_batched_tokens
        self.max_running = max_running_requests
        self.max_waiting = max_waiting_requests
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue

    def add(self, seq: Sequence, bounded: bool = True) -> None:
        """Queue a request; ``bounded=False`` (offline use) skips the queue bound."""
        if bounded and len(self.waiting) >= self.max_waiting:
            raise Overloaded(f"{len(self.waiting)} requests are waiting (max {self.max_waiting})")
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.kv.release(seq)
                    self._finish(seq, "abort")
                    return seq
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> tuple[list[Scheduled], list[Sequence]]:
        """Pick this step's work. Returns (scheduled, failed): failed requests never fit."""
        budget = self.max_tokens
        batch: list[Scheduled] = []
        failed: list[Sequence] = []
        # decodes first (one token each), then prefill chunks; by priority within each
        for seq in sorted(self.running, key=_step_key):
            if budget == 0 or seq not in self.running:
                continue
            todo = seq.num_uncomputed
            if todo == 1:
                todo += len(seq.draft_ids)
            n = self._reserve_running(seq, min(todo, budget), batch)
            if n:
                batch.append(Scheduled(seq, n))
                budget -= n
            elif seq.is_finished:
                failed.append(seq)
        failed += self._admit(batch, budget)
        return batch, failed

    def finish(self, seq: Sequence, reason: str) -> None:
        """Stop a running request (stop condition met): checkpoint its end, release the rest."""
        self.running.remove(seq)
        self.kv.release(seq, checkpoint=True)
        self._finish(seq, reason)

    # ------------------------------------------------------------------ internals

    def _reserve_running(self, seq: Sequence, n: int, batch: list[Scheduled]) -> int:
        """Reserve pages for up to ``n`` tokens of a running request, preempting others if needed.

        Returns the tokens reserved; 0 when ``seq`` was preempted or failed (``is_finished``).
        """
        while not self.kv.can_reserve(seq, n + self.lookahead):
            if self.running == [seq]:
                # NOTE: nothing else holds memory and the cache gave up all it could. Preempting
                # the request itself would only bring it back to this very point (a livelock);
                # a smaller prefill chunk may still fit, and if not even one token does, the
                # request can never finish.
                n = self._fitting_len(seq, n)
                if n == 0:
                    self.running.remove(seq)
                    self.kv.release(seq)
                    self._finish(seq, "error")
                    return 0
                break
            victim = self._preemption_victim(exclude={s.seq for s in batch})
            if victim is None:
                return 0
            self._preempt(victim)
            if victim is seq:
                return 0
        self.kv.reserve(seq, n + self.lookahead)
        return n

    def _fitting_len(self, seq: Sequence, n: int) -> int:
        """The most tokens, at most ``n``, whose pages can be had (0 if not even one)."""
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.kv.can_reserve(seq, mid + self.lookahead):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _admit(self, batch: list[Scheduled], budget: int) -> list[Sequence]:
        failed: list[Sequence] = []
        self.waiting.sort(key=_priority_key)
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self._next_ready()
            if seq is None:
                break
            self.kv.admit(seq)
            n = min(seq.num_uncomputed, budget)
            if not self.kv.can_reserve(seq, n + self.lookahead):
                if self.running or batch:
                    self.kv.release(seq)
                    break  # head of line waits for memory (no starvation of big requests)
                # NOTE: alone, a first chunk smaller than the token budget may fit (its SWA pages
                # grow with the chunk); fail only when not even one token does.
                n = self._fitting_len(seq, n)
                if n == 0:
                    self.kv.release(seq)
                    self.waiting.remove(seq)
                    self._finish(seq, "error")
                    failed.append(seq)
                    continue
            self.waiting.remove(seq)
            self.kv.reserve(seq, n + self.lookahead)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.append(Scheduled(seq, n))
            budget -= n
        return failed

    def _next_ready(self) -> Sequence | None:
        if self.ready is None:
            return self.waiting[0]
        return next((s for s in self.waiting if self.ready(s)), None)

    @property
    def only_fetching(self) -> bool:
        """Nothing runs and every waiting request waits for its L3 prefetch."""
        return (not self.running and bool(self.waiting)
                and all(s.fetch is not None and not s.fetch.done for s in self.waiting))

    def _preemption_victim(self, exclude: set[Sequence]) -> Sequence | None:
        candidates = [s for s in self.running if s not in exclude]
        return max(candidates, key=_priority_key) if candidates else None

    def _preempt(self, seq: Sequence) -> None:
        # NOTE: output_ids stay (only their KV is recomputed), so seq.grammar stays in step
        self.running.remove(seq)
        self.kv.release(seq)
        seq.draft_ids.clear()
        seq.mtp = None  # NOTE: restarts from the KV its next admission finds
        seq.mtp_pages.clear()
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, seq)

    @staticmethod
    def _finish(seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.media = ()  # NOTE: its embeddings' device memory goes now, not with the request


def _priority_key(seq: Sequence) -> tuple[int, int]:
    return (-seq.priority, seq.arrival)


def _step_key(seq: Sequence) -> tuple[bool, int, int]:
    """Decodes first, then prefill chunks; by ``_priority_key`` within each."""
    return (seq.num_uncomputed > 1, *_priority_key(seq))
