"""One request's mutable state inside the engine: tokens, progress, and its KV page table."""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from engine.grammar import GrammarMatcher
    from engine.kv.gcache.tier import Fetch
    from engine.kv.prefix_cache import Node

_arrival = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request. ``num_computed`` tokens have KV; the rest of ``token_ids`` still need a forward.

    KV page table (managed by ``KVManager``):

        page index   0 .. len(path)-1          | len(path) ..
        owner        the prefix cache (Node)    | this request (pending_full / pending_swa)
        pinned       full: path[-1]; SWA: the nodes in ``swa_pinned`` (the window)
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    session_id: str | None = None
    retain_ttl_s: float | None = None
    # positions where a later request is expected to resume (message boundaries, ...): their
    # page-aligned floors become SWA checkpoints once computed
    checkpoint_positions: tuple[int, ...] = ()
    generator: torch.Generator | None = None
    stop_ids: frozenset[int] = frozenset()
    # NOTE: has consumed exactly output_ids (preemption keeps them, so it never rolls back)
    grammar: GrammarMatcher | None = None
    # progress
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_computed: int = 0
    num_cached: int = 0  # prompt tokens served by the prefix cache (first admission)
    num_cached_host: int = 0  # of which the host tier (L2) added
    num_cached_storage: int = 0  # of which came from L3 (GCache) through L2
    fetch: Fetch | None = None  # its L3 prefetch while it waits (engine.kv.gcache.tier)
    num_preemptions: int = 0
    arrival: int = field(default_factory=lambda: next(_arrival))
    # KV page table
    page_hashes: list[int] = field(default_factory=list)
    path: list[Node] = field(default_factory=list)
    pending_full: list[int] = field(default_factory=list)
    pending_swa: list[int] = field(default_factory=list)
    swa_pinned: deque[Node] = field(default_factory=deque)
    branch_node: Node | None = None

    @property
    def token_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.output_ids]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_prefill(self) -> bool:
        """Still computing the prompt (or re-computing after preemption)."""
        return self.num_computed < self.num_tokens - 1 or not self.output_ids

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def token(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]
