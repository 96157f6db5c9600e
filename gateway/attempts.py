"""A request's attempts (``Dispatcher.generate``): the one in flight (``Attempt``), how one ends
for the retry table (``Retry``, ``is_retryable``; see ``gateway.dispatch``), and mid-stream
migration (``Migrate``): a request whose worker is lost after it streamed tokens goes on on
another worker instead of ending with an error (``Dispatcher.generate``, at most
``migration_limit`` times a request; ``--migration-limit``).

The request is sent again with the tokens already streamed appended to its prompt (a prefix-cache
hit wherever its prompt is cached: the router still finds its page hashes) and
``SamplingSpec.resumed_tokens`` saying how many of them are its own output, so that the worker
goes on exactly as the lost one would have: greedy and seeded draws give the same tokens
(seeded draws are seeded by position, ``engine.sampler.position_seed``), a grammar resumes where
it was, and ``max_new_tokens`` counts what is left. The client sees one uninterrupted stream: its
``Finished`` counts the original prompt and every completion token, on both workers.
"""

from __future__ import annotations

import dataclasses

import msgspec

from engine.protocol import Finished, Generate, TokenDelta
from gateway.dispatch_errors import DispatchError, WorkerDead, WorkerError
from gateway.metrics import StreamStats
from gateway.worker_client import WorkerClient

DEFAULT_MIGRATION_LIMIT = 2
# NOTE: the only worker error codes worth another worker; every other code is about the request
RETRYABLE_CODES = frozenset({"overloaded"})


def resume_request(request: Generate, streamed: list[int], wire_id: str) -> Generate:
    """``request`` resumed after ``streamed`` (its tokens so far), sent as ``wire_id``."""
    sampling = request.sampling
    sampling = msgspec.structs.replace(
        sampling, max_new_tokens=sampling.max_new_tokens - len(streamed),
        resumed_tokens=sampling.resumed_tokens + len(streamed))
    return msgspec.structs.replace(request, request_id=wire_id, sampling=sampling,
                                   input_ids=[*request.input_ids, *streamed])


def already_done(request: Generate, streamed: list[int]) -> Finished | None:
    """The ``Finished`` of a request whose streamed tokens end it already (its budget spent, or a
    stop token last: the lost worker died before it could say so); None when it goes on."""
    sampling = request.sampling
    if len(streamed) >= sampling.max_new_tokens:
        reason = "length"
    elif streamed and not sampling.ignore_eos and streamed[-1] in sampling.stop_token_ids:
        reason = "stop"
    else:
        return None
    return Finished(request_id=request.request_id, finish_reason=reason,  # type: ignore[arg-type]
                    prompt_tokens=len(request.input_ids), completion_tokens=len(streamed))


def as_original(item: Finished, request: Generate, num_streamed: int) -> Finished:
    """A resumed request's ``Finished`` as the original request's: its prompt, and every token
    it streamed on every worker; cached tokens count only the original prompt's."""
    prompt_tokens = len(request.input_ids)
    cached = min(item.cached_tokens, prompt_tokens)
    device = min(item.cached_tokens_device, cached)
    host = min(item.cached_tokens_host, cached - device)
    return msgspec.structs.replace(
        item, prompt_tokens=prompt_tokens,
        completion_tokens=num_streamed + item.completion_tokens, cached_tokens=cached,
        cached_tokens_device=device, cached_tokens_host=host,
        cached_tokens_storage=cached - device - host)


@dataclasses.dataclass(slots=True)
class Attempt:
    """A request's attempt in flight: where it runs, under which wire id, and when its last
    delta came (``timed``: the worker sends every step's tokens, so timings mean something)."""

    client: WorkerClient
    wire_id: str
    timed: bool
    last_s: float
    streamed: list[int]  # NOTE: the request's tokens, over all its attempts

    def delta_came(self, stats: StreamStats, item: TokenDelta, now_s: float, *,
                   first: bool) -> None:
        """Observe ``item``'s token timings (TTFT for the first delta, ITL after it; 0 for the
        tokens that came with another in one delta) and move the clock to ``now_s``."""
        if self.timed:
            (stats.ttft if first else stats.itl).observe(now_s - self.last_s)
            if len(item.token_ids) > 1:  # NOTE: per token: these came together
                stats.itl.observe(0.0, len(item.token_ids) - 1)
        self.last_s = now_s
        self.streamed += item.token_ids


class Migrate(Exception):
    """An attempt's worker was lost after it streamed tokens."""

    def __init__(self, error: WorkerDead) -> None:
        super().__init__(str(error))
        self.error = error


class Retry(Exception):
    """An attempt failed in a way the retry table retries."""

    def __init__(self, error: WorkerDead | WorkerError) -> None:
        super().__init__(str(error))
        self.error = error


def is_retryable(exc: DispatchError) -> bool:
    """Whether a request that failed with ``exc`` before streaming may go to another worker:
    only for the worker's own trouble, never for the request's (see the module docstring)."""
    if isinstance(exc, WorkerDead):
        return not exc.started
    return isinstance(exc, WorkerError) and exc.code in RETRYABLE_CODES
