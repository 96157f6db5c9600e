"""Grammar compiles off the worker's step loop: a few daemon threads and a time budget.

A large JSON schema can take seconds to compile (thousands of optional properties: ~7 s for
200 kB on one core). llguidance releases the GIL while it compiles, so a compile thread leaves
the step loop free to step, answer heartbeats and take aborts; the loop calls ``poll`` to collect
finished compiles. Requests with the same spec share one compile.

    submit(request, spec) ─► queue ─► thread: compiler.compile(spec) ─► job.done
    poll(now) ─► Ready(request, matcher) | Failed(request, code, message)

NOTE (budget): a compile cannot be interrupted, so the budget is a wait budget: once a job has run
``timeout_s`` its requests fail with ``invalid_grammar``; the thread finishes the compile anyway
and its result is dropped, never cached, so a grammar that is too slow fails the same way every
time. The size budget (the worker's ``max_grammar_bytes``) bounds how long such a thread runs.
Until then new requests for that spec join the late job and fail at once, so one slow grammar
holds at most one thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from engine.grammar import CompiledGrammar, GrammarCompiler, GrammarError, GrammarMatcher
from engine.sampling_params import StructuredSpec

logger = logging.getLogger(__name__)


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
    """One spec's compile. ``started_s``, ``result``/``error`` and then ``done`` are written by the
    compile thread (in that order); everything else by the loop's thread."""

    spec: StructuredSpec
    waiters: list[str] = field(default_factory=list)  # request ids, in arrival order
    started_s: float | None = None
    result: CompiledGrammar | None = None
    error: BaseException | None = None
    done: bool = False
    is_late: bool = False  # past its budget: the result is dropped
    is_cancelled: bool = False  # dropped before it started: the thread skips it


class GrammarJobs:
    """Compiles grammars on ``num_threads`` daemon threads for one engine's compiler.

    Args:
        compiler: the engine's compiler; its cache is used (``cached``/``add``) only from the
            thread that calls ``submit``/``poll``/``cancel``.
        num_threads: compile threads (each runs one compile at a time).
        timeout_s: how long a compile may run before its requests fail.
    """

    def __init__(self, compiler: GrammarCompiler, num_threads: int, timeout_s: float) -> None:
        assert num_threads >= 1, f"num_threads={num_threads}: must be >= 1"
        assert timeout_s > 0, f"timeout_s={timeout_s}: must be > 0"
        self.compiler = compiler
        self.timeout_s = timeout_s
        self._jobs: dict[StructuredSpec, _Job] = {}
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, name=f"grammar-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, request_id: str, spec: StructuredSpec) -> None:
        """Compile ``spec`` for ``request_id`` (a later ``poll`` reports it)."""
        job = self._jobs.get(spec)
        if job is None:
            job = self._jobs[spec] = _Job(spec)
            self._queue.put(job)
        job.waiters.append(request_id)

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
        for spec, job in list(self._jobs.items()):
            if job.done:
                del self._jobs[spec]
                out += self._finish(job)
            elif job.started_s is not None and now_s - job.started_s > self.timeout_s:
                out += self._expire(job)
            elif job.started_s is None and not job.waiters:
                job.is_cancelled = True  # NOTE: queued and nobody waits: the thread skips it
                del self._jobs[spec]
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
        """Stop the threads once their current compile ends (they are daemons: exit does not
        wait for them)."""
        for job in self._jobs.values():
            job.waiters.clear()
        for _ in self._threads:
            self._queue.put(None)

    def _finish(self, job: _Job) -> list[Ready | Failed]:
        if job.is_late:
            return list(self._expire(job))  # NOTE: requests that joined it since the last poll
        if not job.waiters:
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

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if job.is_cancelled:
                continue
            job.started_s = time.monotonic()
            try:
                job.result = self.compiler.compile(job.spec)
            except BaseException as e:  # NOTE: reported by poll, never lost with the thread
                job.error = e
            if job.is_late:
                job.result = None  # NOTE: drop the late compile's memory now, not at next poll
            job.done = True
