"""Matching a page-hash chain against one worker's entries in the KV index (``index.KVIndex``):
the hot path of every routing decision, kept apart from the index's event bookkeeping.

See the ``index`` module docstring for the rules (window-safe credit, predictions, why a binary
search is sound on a prefix-closed cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from gateway.routing.index import _Worker


class MatchResult(NamedTuple):
    """One worker's cached prefix of a queried hash chain, in pages.

    Attributes:
        full_pages: pages [0, full_pages) have full KV on the worker.
        usable_pages: the deepest window-safe resume point (<= full_pages).
    """

    full_pages: int
    usable_pages: int


# NOTE: tuple.__new__ builds a MatchResult without the NamedTuple's Python-level __new__ (hot path)
_result = tuple.__new__
_NO_MATCH = MatchResult(0, 0)


def match_all(
    workers: dict[str, _Worker], page_hashes: Sequence[int], now_s: float | None
) -> dict[str, MatchResult]:
    """Per worker with at least one page of ``page_hashes`` (not empty) cached: its
    ``match_one`` result, trying the previous worker's match end as its hint.

    NOTE: the common cases are inlined (a call per worker is a fair part of a route's CPU), with
    ``match_one``'s probes and results exactly: the worker holds nothing of the query (its first
    page), or the match ends at the whole query or at the hint with the window at that end live
    (``_window_live_at_end``, which ``match_one`` asks first too). Anything else (a bisection, a
    scan for the window) goes to ``match_one`` from scratch.
    """
    out = {}
    n = len(page_hashes)
    first, deepest = page_hashes[0], page_hashes[n - 1]
    hint = 0  # NOTE: workers often share a match end (a system prompt): try it first
    for worker_id, w in workers.items():
        pages = w.pages
        cached = pages if now_s is None or not w.pred else _Live(pages, w.pred, now_s)
        if first not in cached:
            continue
        # NOTE: the candidate end (full pages, the hash of page full - 1) in match_one's order:
        # the whole query, the worker's previous match end (a session turn), the previous
        # worker's (a shared system prompt); any other answer needs the bisection
        if deepest in cached:
            full, end = n, deepest
        else:
            full, end = w.last_end, w.last_end_hash
            if not (0 < full <= n and page_hashes[full - 1] == end):
                full = hint
                end = page_hashes[full - 1] if full else 0
            if not (0 < full < n - 1 and end in cached and page_hashes[full] not in cached):
                full = 0
        if full and _window_live_at_end(w, end, full, now_s):
            w.last_end, w.last_end_hash = full, end
            if end in pages:
                pages.move_to_end(end)  # NOTE: the match end counts as used
            out[worker_id] = _result(MatchResult, (full, full))
            hint = full
            continue
        result = match_one(w, page_hashes, now_s, hint)
        if result.full_pages:
            out[worker_id] = result
            hint = result.full_pages
    return out


def match_one(
    w: _Worker, page_hashes: Sequence[int], now_s: float | None, hint: int = 0
) -> MatchResult:
    """The engine's rule (``PrefixCache.match``) with "live SWA" = announced per page
    (``w.swa``) or inside a live checkpoint's window (``w.cover``); or at a live predicted
    checkpoint (``w.pred_ckpts``)."""
    pred = w.pred if now_s is not None and w.pred else None
    last = w.last_end
    if 0 < last <= len(page_hashes) and page_hashes[last - 1] == w.last_end_hash:
        hint = last  # NOTE: this query shares the worker's previous match end (a session turn)
    pages = w.pages
    full = full_pages(pages, pred, now_s, page_hashes, hint)
    if full == 0:
        return _NO_MATCH
    end = page_hashes[full - 1]
    w.last_end, w.last_end_hash = full, end
    if end in pages:
        pages.move_to_end(end)  # NOTE: the match end counts as used
    if _window_live_at_end(w, end, full, now_s):
        return _result(MatchResult, (full, full))
    k = w.window_pages
    predicted = 0
    if now_s is not None and w.pred_ckpts:
        predicted = _predicted_usable(w.pred_ckpts, page_hashes, full, now_s)
        if predicted == full:
            return _result(MatchResult, (full, full))
    usable = 0
    if k is not None and (w.cover or w.swa or pred):
        # NOTE: predicted pages have live SWA only where the engine announces SWA per page
        live_pred = pred if w.per_page_swa else None
        usable = _usable_pages(w.cover, w.swa, k, page_hashes, full, live_pred, now_s)
    return _result(MatchResult, (full, max(usable, predicted)))


def _window_live_at_end(w: _Worker, end: int, full: int, now_s: float | None) -> bool:
    """Whether the window before the match end (page ``full - 1``, hash ``end``) is live
    without a scan: no SWA layers (k = 0), a live checkpoint ends there (its k pages have live
    SWA, the engine's invariant, whatever the index's cap forgot of them), or a live predicted
    checkpoint does."""
    k = w.window_pages
    if k == 0 or (k is not None and len(w.ckpts.get(end, ())) >= (k if k < full else full)):
        return True
    c = w.pred_ckpts.get(end) if now_s is not None else None
    return c is not None and c[0] == full and c[1] > now_s  # type: ignore[operator]


def _predicted_usable(
    ckpts: dict[int, tuple[int, float]], page_hashes: Sequence[int], full: int, now_s: float
) -> int:
    """The deepest live predicted checkpoint on the query's matched part."""
    end = ckpts.get(page_hashes[full - 1])
    if end is not None and end[0] == full and end[1] > now_s:
        return full  # NOTE: the common case: a sibling extends the predicted prompt
    usable = 0
    for h, (d, until_s) in ckpts.items():
        if usable < d <= full and until_s > now_s and page_hashes[d - 1] == h:
            usable = d
    return usable


def full_pages(
    pages: dict[int, int | None],
    pred: dict[int, float] | None,
    now_s: float | None,
    page_hashes: Sequence[int],
    hint: int = 0,
) -> int:
    """Length of the cached (confirmed or predicted) prefix of ``page_hashes``, by binary
    search: "page i cached" is monotone in i for a prefix-closed cache (module docstring).
    ``hint``: a likely answer, checked first (two lookups)."""
    cached = pages if pred is None else _Live(pages, pred, now_s)  # type: ignore[arg-type]
    n = len(page_hashes)
    if page_hashes[0] not in cached:
        return 0
    if page_hashes[n - 1] in cached:
        return n
    lo, hi = 0, n - 1  # NOTE: page lo cached, page hi not
    if 0 < hint < n - 1:
        if page_hashes[hint - 1] not in cached:
            hi = hint - 1
        elif page_hashes[hint] not in cached:
            return hint
        else:
            lo = hint
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if page_hashes[mid] in cached:
            lo = mid
        else:
            hi = mid
    return hi


class _Live:
    """The pages cached on a worker at ``now_s``: confirmed, or predicted until after it.

    NOTE: a container rather than a closure, so that the matching code tests ``h in cached``
    alike for a plain ``pages`` dict (no Python call at all, the common case) and this.
    """

    __slots__ = ("pages", "pred", "now_s")

    def __init__(self, pages: dict[int, int | None], pred: dict[int, float], now_s: float) -> None:
        self.pages, self.pred, self.now_s = pages, pred, now_s

    def __contains__(self, h: int) -> bool:
        if h in self.pages:
            return True
        until_s = self.pred.get(h)
        return until_s is not None and until_s > self.now_s


def _usable_pages(
    cover: dict[int, int],
    swa: set[int],
    k: int,
    page_hashes: Sequence[int],
    full: int,
    pred: dict[int, float] | None = None,
    now_s: float | None = None,
) -> int:
    """The deepest page end p <= full whose ``min(k, p)`` pages before it all have live SWA (in
    ``swa`` or ``cover``, or predicted in ``pred`` until after ``now_s``).

    Scans back from ``full``; a page j without live SWA rules out every end in (j, j + k], so
    the next candidate is j itself and each page is looked at once::

        pages   ... j-1 [ j ] j+1 ... p-1 | p        (j not covered, p - 1 - j < k: p fails)
        next candidate: p = j
    """
    p = full
    while p > 0:
        need = min(k, p)
        j = p - 1
        while j >= p - need and (
            (h := page_hashes[j]) in swa
            or h in cover
            or (pred is not None and pred.get(h, 0.0) > now_s)  # type: ignore[operator]
        ):
            j -= 1
        if j < p - need:
            return p
        p = j
    return 0
