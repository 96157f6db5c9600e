"""One request's mutable state inside the engine: tokens, progress, and its KV page table."""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from engine.protocol import MEDIA_ID_BASE, MEDIA_ID_LIMIT
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from engine.grammar import GrammarMatcher
    from engine.kv.gcache.tier import Fetch
    from engine.kv.prefix_cache import Node

_arrival = itertools.count()


class Media(NamedTuple):
    """One image's rows in a prompt: positions ``[offset, offset + length)`` take ``embeds``
    ([length, hidden], the model's dtype and device) instead of their token embeddings. The sim
    backend, which has no hidden states, keeps spans without ``embeds``."""

    offset: int
    length: int
    embeds: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length


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
    # the prompt's images, by offset; kept until the request ends (a preempted request may
    # recompute them), then dropped with their device memory
    media: tuple[Media, ...] = ()
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
    # MTP speculation (engine.spec): the drafted tokens after token_ids, verified by the next
    # step, and the MTP layers' progress (None until the first step after each admission)
    draft_ids: list[int] = field(default_factory=list)
    mtp: object | None = None
    # page index -> the MTP continuation state at its last slot, for its cache node (Node.mtp)
    mtp_pages: dict[int, object] = field(default_factory=dict)
    # positions below this may hold MTP KV another request wrote (a deduplicated page without
    # Node.mtp): the MTP layers' outputs are not known exact until their windows pass it
    mtp_taint: int = 0

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

    def step_token(self, i: int) -> int:
        """Token ``i`` of ``token_ids`` followed by ``draft_ids`` (what a verify step feeds)."""
        n = self.num_tokens
        return self.token(i) if i < n else self.draft_ids[i - n]


def media_rows(media: tuple[Media, ...], start: int, end: int
               ) -> list[tuple[Media, int, int]]:
    """The parts of ``media`` that the tokens ``[start, end)`` cover: ``(media, lo, hi)`` with
    ``start <= lo < hi <= end``, so rows ``lo - start .. hi - start`` of the chunk take
    ``media.embeds[lo - media.offset : hi - media.offset]``::

        prompt     | text | image [offset, end)         | text |
        chunk             [start ............ end)
        overlap           [lo = start ... hi = end)      (a chunk may split an image)
    """
    out = []
    for m in media:
        lo, hi = max(start, m.offset), min(end, m.end)
        if lo < hi:
            out.append((m, lo, hi))
    return out


def check_prompt_ids(prompt: list[int], media: list[tuple[int, int]], vocab_size: int) -> None:
    """Media spans ((offset, length) each) sorted, disjoint, inside the prompt (checked first),
    over placeholder ids only; text ids everywhere else::

        prompt   | text [end_prev, offset) | media[i] [offset, offset + length) | text ...
        ids      | [0, vocab_size)         | [MEDIA_ID_BASE, MEDIA_ID_LIMIT)    |

    Raises:
        ValueError: naming the span or the ids at fault.
    """
    n, end = len(prompt), 0
    for i, (offset, length) in enumerate(media):
        if length < 1:
            raise ValueError(f"media[{i}]: length {length}: must be >= 1")
        if offset < end:
            raise ValueError(f"media[{i}]: offset {offset} " + (
                "is negative" if i == 0 else f"overlaps or precedes media[{i - 1}], which "
                f"ends at {end} (spans must be sorted and disjoint)"))
        if offset + length > n:
            raise ValueError(f"media[{i}]: offset {offset} + length {length} exceeds the "
                             f"prompt's {n} tokens")
        end = offset + length
    end = 0
    for i, (offset, length) in enumerate(media):
        ids = prompt[offset : offset + length]
        if min(ids) < MEDIA_ID_BASE or max(ids) >= MEDIA_ID_LIMIT:
            bad = [(offset + j, t) for j, t in enumerate(ids)
                   if not MEDIA_ID_BASE <= t < MEDIA_ID_LIMIT]
            raise ValueError(f"media[{i}]: (position, id) {bad[:5]} are not media placeholder "
                             f"ids [{MEDIA_ID_BASE}, {MEDIA_ID_LIMIT})")
        _check_text_ids(prompt[end:offset], vocab_size)
        end = offset + length
    _check_text_ids(prompt[end:] if end else prompt, vocab_size)


def _check_text_ids(ids: list[int], vocab_size: int) -> None:
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return
    bad = [t for t in ids if not 0 <= int(t) < vocab_size]
    hint = (" (media placeholder ids need a media span)"
            if any(MEDIA_ID_BASE <= t < MEDIA_ID_LIMIT for t in bad) else "")
    raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
                     + hint)
