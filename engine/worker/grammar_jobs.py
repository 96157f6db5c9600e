"""Grammar compiles off the worker's step loop: one thread per compile, a time budget.

A large JSON schema can take seconds to compile (thousands of optional properties: ~7 s for
200 kB on one core). llguidance releases the GIL while it compiles, so a compile thread leaves
the step loop free to step, answer heartbeats and take aborts; the loop calls ``poll`` to start
queued compiles and collect finished ones. Requests with the same spec share one compile.

    submit(request, spec) ─► queue ─► thread: compiler.compile(spec) ─► job.done
    poll(now) ─► Ready(request, matcher) | Failed(request, code, message)

NOTE (budget): a compile cannot be interrupted, so the budget is a wait budget: once a job has run
``timeout_s`` its requests fail with ``invalid_grammar``; the thread finishes the compile anyway
and its result is dropped, never cached, so a grammar that is too slow fails the same way every
time. The size budget (the worker's ``max_grammar_bytes``) bounds how long such a thread runs.
Until then new requests for that spec join the late job and fail at once.

NOTE (threads): at most ``num_threads`` compiles run for requests that still wait on them. A
compile nobody waits for any more (late, or all its requests aborted) runs on without holding one
of those slots, up to ``max_abandoned`` of them; beyond that, queued compiles wait.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from engine.grammar import CompiledGrammar, GrammarCompiler, GrammarError, GrammarMatcher
from engine.sampling_params import StructuredSpec

logger = logging.getLogger(__name__)

MAX_ABANDONED_COMPILES = 4


class Ready(NamedTuple):
    """A request's grammar compiled: its fresh matcher."""

    request_id: str
    grammar: GrammarMatcher


class Failed(NamedTuple):
    """A request's grammar did not compile (``invalid_grammar``) or the compile raised
    (``internal``)."""

    request_id: str
    code: Literal["invalid_grammar", "internal"]
    message: str


@dataclass(eq=False)
class _Job:
    """One spec's compile. ``result``/``error`` and then ``done`` are written by its thread;
    everything else by the loop's thread."""

    spec: StructuredSpec
    waiters: list[str] = field(default_factory=list)  # request ids, in arrival order
    started_s: float | None = None
    result: CompiledGrammar | None = None
    error: BaseException | None = None
    done: bool = False
    is_late: bool = False  # past its budget: the result is dropped

    @property
    def is_abandoned(self) -> bool:
        """Running for nobody: late, or every request went away."""
        return self.is_late or not self.waiters


class GrammarJobs:
    """Compiles grammars on daemon threads for one engine's compiler.

    Args:
        compiler: the engine's compiler; its cache is used (``cached``/``add``) only from the
            thread that calls ``submit``/``poll``/``cancel``.
        num_threads: compiles running at once for requests that wait on them.
        timeout_s: how long a compile may run before its requests fail.
        max_abandoned: compiles that nobody waits for any more, running at once at most.
    """

    def __init__(self, compiler: GrammarCompiler, num_threads: int, timeout_s: float,
                 max_abandoned: int = MAX_ABANDONED_COMPILES) -> None:
        assert num_threads >= 1, f"num_threads={num_threads}: must be >= 1"
        assert timeout_s > 0, f"timeout_s={timeout_s}: must be > 0"
        self.compiler = compiler
        self.num_threads = num_threads
        self.timeout_s = timeout_s
        self.max_abandoned = max_abandoned
        self._jobs: dict[StructuredSpec, _Job] = {}  # queued or running, by spec
        self._queue: deque[_Job] = deque()
        self._running: list[_Job] = []

    def submit(self, request_id: str, spec: StructuredSpec) -> None:
        """Compile ``spec`` for ``request_id`` (a later ``poll`` reports it)."""
        job = self._jobs.get(spec)
        if job is None:
            job = self._jobs[spec] = _Job(spec)
            self._queue.append(job)
        job.waiters.append(request_id)
        self._start_queued()

    def cancel(self, request_id: str) -> None:
        """Forget a request (aborted); its job goes on if another request waits on it."""
        for job in self._jobs.values():
            if request_id in job.waiters:
                job.waiters.remove(request_id)
                return

    def poll(self, now_s: float | None = None) -> list[Ready | Failed]:
        """Finished compiles and requests past their budget, each request reported once."""
        now_s = time.monotonic() if now_s is None else now_s
        out: list[Ready | Failed] = []
        for job in list(self._running):
            if job.done:
                self._running.remove(job)
                del self._jobs[job.spec]
                out += self._finish(job)
            elif job.started_s is not None and now_s - job.started_s > self.timeout_s:
                out += self._expire(job)
        self._start_queued()
        return out

    @property
    def num_waiting(self) -> int:
        """Requests whose grammar is still compiling."""
        return sum(len(job.waiters) for job in self._jobs.values())

    @property
    def num_jobs(self) -> int:
        """Compiles queued or running, late ones included."""
        return len(self._jobs)

    def close(self) -> None:
        """Start nothing more (running threads are daemons: exit does not wait for them)."""
        self._queue.clear()
        for job in self._jobs.values():
            job.waiters.clear()

    def _start_queued(self) -> None:
        while self._queue:
            live = sum(not job.is_abandoned for job in self._running)
            if live >= self.num_threads or (
                    len(self._running) >= self.num_threads + self.max_abandoned):
                return
            job = self._queue.popleft()
            if not job.waiters:
                del self._jobs[job.spec]  # NOTE: every request of a queued job went away
                continue
            job.started_s = time.monotonic()
            self._running.append(job)
            threading.Thread(target=self._run, args=(job,), name="grammar", daemon=True).start()

    def _finish(self, job: _Job) -> list[Ready | Failed]:
        if job.is_late:
            return list(self._expire(job))  # NOTE: requests that joined it since the last poll
        if job.result is not None and not job.waiters:
            self.compiler.add(job.spec, job.result)  # NOTE: in budget: kept for a retry
            return []
        if job.result is None:
            error = job.error
            if isinstance(error, GrammarError):
                return [Failed(r, "invalid_grammar", str(error)) for r in job.waiters]
            logger.error("grammar compile failed", exc_info=error)
            text = f"{type(error).__name__} while compiling the grammar"
            return [Failed(r, "internal", text) for r in job.waiters]
        first, *rest = job.waiters
        out: list[Ready | Failed] = [Ready(first, self.compiler.add(job.spec, job.result))]
        return out + [Ready(r, self.compiler.new_matcher(job.result)) for r in rest]

    def _expire(self, job: _Job) -> list[Failed]:
        job.is_late = True
        text = (f"the grammar took longer than {self.timeout_s:g} s to compile (the worker's "
                f"grammar time budget); simplify the schema")
        failed = [Failed(r, "invalid_grammar", text) for r in job.waiters]
        job.waiters.clear()
        return failed

    def _run(self, job: _Job) -> None:
        try:
            job.result = self.compiler.compile(job.spec)
        except BaseException as e:  # NOTE: reported by poll, never lost with the thread
            job.error = e
        if job.is_late:
            job.result = None  # NOTE: drop the late compile's memory now, not at next poll
        job.done = True
