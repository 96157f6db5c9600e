"""What a replay measures, from its per-request records (pure functions, no engine).

    hit rate          sum(cached prompt tokens the engine served) / sum(prompt tokens), over
                      requests that reached an engine (token-weighted, window-safe: the engine
                      credits only a usable match)
    TTFT              first token time - arrival time (arrival at the gateway: it includes
                      admission queueing, routing, prefill and waiting in the engine)
    input tok/s/wkr   prompt tokens / (last finish - first arrival) / workers (the global pool
                      counts as the N workers it stands for)
    load imbalance    max / mean of the workers' prompt tokens
    SWA-lost tokens   tokens whose full KV was cached but unusable for lack of a live window
                      (the engines' raw - usable match, over all admissions)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

OK, ERROR, REJECTED = "ok", "error", "rejected"


@dataclass(slots=True)
class RequestRecord:
    """One request's life in a replay (times in virtual seconds)."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int = 0
    worker_id: str | None = None
    dispatch_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_tokens: int = 0
    status: str = OK
    reason: str = ""  # the router's Decision.reason
    # tokens of the parent turn (prompt + output, whole pages) this prompt starts with, when
    # the parent ended in a tool call: what a resume after the pause could serve from cache
    resumable_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_s is None:
            return None
        return self.first_token_s - self.arrival_s


@dataclass(slots=True)
class Summary:
    """One policy's figures (see the module docstring)."""

    policy: str
    num_requests: int
    num_finished: int
    num_errors: int
    num_rejected: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    input_tokens_per_s_per_worker: float
    load_imbalance: float
    swa_lost_tokens: int
    reprefill_after_pause_tokens: int
    reprefill_after_pause_frac: float
    makespan_s: float
    worker_prompt_tokens: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def summarize(policy: str, records: Sequence[RequestRecord], worker_ids: Sequence[str],
              swa_lost_tokens: int, num_workers: int | None = None) -> Summary:
    """``num_workers``: what "per worker" divides by (default ``len(worker_ids)``; the global
    pool's one worker stands for N)."""
    served = [r for r in records if r.status != REJECTED]
    ttfts = sorted(t for r in served if (t := r.ttft_s) is not None)
    prompt = sum(r.prompt_tokens for r in served)
    cached = sum(r.cached_tokens for r in served)
    per_worker = {w: 0 for w in worker_ids}
    for r in served:
        if r.worker_id is not None:
            per_worker[r.worker_id] = per_worker.get(r.worker_id, 0) + r.prompt_tokens
    span = _makespan(records)
    resumed = [r for r in served if r.resumable_tokens]
    reprefill = sum(max(0, r.resumable_tokens - r.cached_tokens) for r in resumed)
    return Summary(
        policy=policy, num_requests=len(records),
        num_finished=sum(r.status == OK for r in records),
        num_errors=sum(r.status == ERROR for r in records),
        num_rejected=len(records) - len(served), prompt_tokens=prompt, cached_tokens=cached,
        hit_rate=cached / prompt if prompt else 0.0,
        ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else 0.0,
        ttft_p50_s=quantile(ttfts, 0.5), ttft_p99_s=quantile(ttfts, 0.99),
        input_tokens_per_s_per_worker=prompt / span / (num_workers or max(1, len(worker_ids)))
        if span else 0.0,
        load_imbalance=imbalance(list(per_worker.values())), swa_lost_tokens=swa_lost_tokens,
        reprefill_after_pause_tokens=reprefill,
        reprefill_after_pause_frac=reprefill / prompt if prompt else 0.0,
        makespan_s=span, worker_prompt_tokens=per_worker,
    )


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of already sorted values; 0 for none."""
    if not sorted_values:
        return 0.0
    i = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return float(sorted_values[i])


def imbalance(loads: Sequence[float]) -> float:
    """max / mean (1.0 = perfectly even; 1.0 for no load at all)."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0


def load_over_time(records: Sequence[RequestRecord], worker_ids: Sequence[str],
                   num_bins: int = 60) -> tuple[list[float], dict[str, list[float]]]:
    """Prompt tokens/s dispatched to each worker per time bin: (bin start times, per worker)."""
    dispatched = [r for r in records if r.dispatch_s is not None and r.worker_id is not None]
    span = _makespan(records) or 1.0
    start = min((r.arrival_s for r in records), default=0.0)
    width = span / num_bins
    rates = {w: [0.0] * num_bins for w in worker_ids}
    for r in dispatched:
        i = min(num_bins - 1, int((r.dispatch_s - start) / width))  # type: ignore[operator]
        rates.setdefault(r.worker_id, [0.0] * num_bins)[i] += r.prompt_tokens / width  # type: ignore[index]
    return [start + i * width for i in range(num_bins)], rates


def _makespan(records: Sequence[RequestRecord]) -> float:
    ends = [r.finish_s for r in records if r.finish_s is not None]
    if not ends:
        return 0.0
    return max(ends) - min(r.arrival_s for r in records)
