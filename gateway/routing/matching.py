"""Matching a page-hash chain against one worker's entries in the KV index (``index.KVIndex``):
the hot path of every routing decision, kept apart from the index's event bookkeeping.

See the ``index`` module docstring for the rules (window-safe credit, predictions, why a binary
search is sound on a prefix-closed cache). ``match_tiers`` extends the device match through the
worker's L2 and the shared L3 views (``gateway.routing.tiers``) by the window rule across tiers.

NOTE: the window rule is the engine's ``engine.kv.layout.usable_pages``; the gateway may not
import ``engine.kv`` (its package imports torch; tests/test_layering.py), so this module keeps
the one gateway copy (``_usable_pages`` and ``_usable_tiered``, both a backward scan), and
tests/gateway/test_routing_tiers.py checks it against the engine's function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from gateway.routing.tiers import FULL, SWA

if TYPE_CHECKING:
    from gateway.routing.index import _Worker
    from gateway.routing.tiers import StorageView


class MatchResult(NamedTuple):
    """One worker's cached prefix of a queried hash chain, in pages.

    Attributes:
        full_pages: pages [0, full_pages) have full KV the worker can reach (its device, its
            L2, the shared L3).
        usable_pages: the deepest window-safe resume point (<= full_pages), across tiers.
        host_pages: of the usable pages, those the worker would load from its L2 (their full
            KV, or the SWA of a page in the window at the resume point, is there and not on the
            device); 0 without L2 events.
        storage_pages: of the usable pages, those it would fetch from L3 (reachable nowhere
            cheaper); 0 without L3 events. The rest, ``usable - host - storage``, are device hits.
    """

    full_pages: int
    usable_pages: int
    host_pages: int = 0
    storage_pages: int = 0


# NOTE: tuple.__new__ builds a MatchResult without the NamedTuple's Python-level __new__ (hot path)
_result = tuple.__new__
_NO_MATCH = MatchResult(0, 0, 0, 0)


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
            out[worker_id] = _result(MatchResult, (full, full, 0, 0))
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
        return _result(MatchResult, (full, full, 0, 0))
    k = w.window_pages
    predicted = 0
    if now_s is not None and w.pred_ckpts:
        predicted = _predicted_usable(w.pred_ckpts, page_hashes, full, now_s)
        if predicted == full:
            return _result(MatchResult, (full, full, 0, 0))
    usable = 0
    if k is not None and (w.cover or w.swa or pred):
        # NOTE: predicted pages have live SWA only where the engine announces SWA per page
        live_pred = pred if w.per_page_swa else None
        usable = _usable_pages(w.cover, w.swa, k, page_hashes, full, live_pred, now_s)
    return _result(MatchResult, (full, max(usable, predicted), 0, 0))


def match_tiers(
    workers: dict[str, _Worker], store: StorageView, page_hashes: Sequence[int],
    now_s: float | None,
) -> dict[str, MatchResult]:
    """``match_all``, then each worker's match extended through its L2 view and the shared L3
    one (``extend_match``): per worker with at least one page of ``page_hashes`` reachable."""
    device = match_all(workers, page_hashes, now_s)
    runs = _StorageRuns(store.full, page_hashes)
    out = {}
    # NOTE: a worker with nothing of the query on its device and an empty L2 gets the L3
    # credit alone, the same for every such worker with the same window: computed once per k
    shared: dict[int | None, MatchResult | None] = {}
    for worker_id, w in workers.items():
        m = device.get(worker_id)
        if m is None and not w.host:
            k = w.window_pages
            if k not in shared:
                shared[k] = extend_match(w, None, store, page_hashes, now_s, runs)
            r = shared[k]
        else:
            r = extend_match(w, m, store, page_hashes, now_s, runs)
        if r is not None:
            out[worker_id] = r
    return out


def extend_match(
    w: _Worker, m: MatchResult | None, store: StorageView, page_hashes: Sequence[int],
    now_s: float | None, runs: _StorageRuns | None = None,
) -> MatchResult | None:
    """The device match ``m`` (None: nothing on the device) extended through the worker's L2
    and the shared L3, by the window rule across tiers (``engine.kv.tier``): usable up to the
    deepest page end p where full KV (any tier) covers [0, p) and SWA (any tier) covers
    [p - k, p); never less than ``m.usable_pages``. Each usable page is credited to the
    dearest tier it needs, taking the cheapest copy of each part (device < L2 < L3)::

        pages          0    1    2    3    4    5        (k = 2)
        full   device  x    x    x
               L2                     x    x
               L3                               x
        SWA    device  x    x
               L2                x         x
               L3                               x
        device alone: usable 2 (p = 3 needs SWA on page 2)
        across tiers: usable 6 (SWA on pages 4, 5); pages 0..5 credited to
                      dev dev dev L2 L2 L3 (page 3: full in L2, outside the window)
        -> MatchResult(full_pages=6, usable_pages=6, host_pages=2, storage_pages=1)

    ``m.usable_pages`` is a floor: device facts the scan does not see (checkpoint windows the
    cap partly forgot, predicted checkpoints) stay credited, as device hits. Past the device
    match only L2 and L3 count (a device page the cap left there is an under-report).

    Cost: one L3 probe when L3 does not go on from the device match; an L3 run is walked once
    per query (``runs``, shared by the workers); L2 pages one probe each.
    """
    device_full = 0 if m is None else m.full_pages
    device_usable = 0 if m is None else m.usable_pages
    if runs is None:
        runs = _StorageRuns(store.full, page_hashes)
    host = w.host.entries
    full, host_ends = _extend_full(host, runs, page_hashes, device_full)
    if full == 0:
        return None
    k = w.window_pages
    pred = w.pred if now_s is not None and w.pred and w.per_page_swa else None
    live = _device_swa(w, pred, now_s)
    if k is None:
        usable = device_usable  # NOTE: the window is not known: no credit beyond the device's
    elif k == 0:
        usable = full
    else:
        usable = _usable_tiered(live, host, store.swa, k, page_hashes, full, device_usable)
    if usable <= device_usable:
        return _result(MatchResult, (full, device_usable, 0, 0))
    # NOTE: full KV of [device_full, usable) comes from L2 where host_ends says, else L3
    num_host = sum(min(e, usable) - s for s, e in host_ends if s < usable)
    num_storage = max(0, usable - device_full) - num_host
    lo = usable - k if k and usable > k else 0
    for i in range(lo if k else usable, usable):  # NOTE: the window's pages need SWA too
        h = page_hashes[i]
        if live(h):
            continue
        on_host = i >= device_full and host.get(h, 0) & FULL
        if host.get(h, 0) & SWA:
            if i < device_full:
                num_host += 1  # NOTE: device full KV, its SWA from L2
        elif i < device_full:
            num_storage += 1  # NOTE: device full KV, its SWA from L3
        elif on_host:
            num_host -= 1  # NOTE: full KV in L2, its SWA only in L3
            num_storage += 1
    return _result(MatchResult, (full, usable, num_host, num_storage))


class _StorageRuns:
    """Where the run of L3 pages starting at each page of one query ends, walked on demand
    and shared by every worker matched against that query."""

    __slots__ = ("full", "page_hashes", "ends")

    def __init__(self, full: dict[int, float], page_hashes: Sequence[int]) -> None:
        self.full, self.page_hashes = full, page_hashes
        self.ends: dict[int, int] = {}

    def end(self, i: int) -> int:
        """The first page at or after ``i`` whose full KV L3 does not hold."""
        end = self.ends.get(i)
        if end is not None:
            return end
        full, ph, n = self.full, self.page_hashes, len(self.page_hashes)
        end = i
        while end < n and ph[end] in full:
            end += 1
        for j in range(i, end + 1):
            self.ends[j] = end  # NOTE: every start inside the run ends there too
        return end


def _extend_full(
    host: dict[int, int], runs: _StorageRuns, page_hashes: Sequence[int], start: int
) -> tuple[int, list[tuple[int, int]]]:
    """(the end of the full-KV chain from page ``start`` through L2 and L3, the [s, e) spans
    of it credited to L2: there, else in L3)."""
    n = len(page_hashes)
    full = start
    spans: list[tuple[int, int]] = []
    if not host:
        return runs.end(start), spans
    while full < n:
        if host.get(page_hashes[full], 0) & FULL:
            s = full
            full += 1
            while full < n and host.get(page_hashes[full], 0) & FULL:
                full += 1
            spans.append((s, full))
        else:
            end = runs.end(full)
            if end == full:
                break
            # NOTE: L2 is cheaper where it holds a page of this L3 run
            spans.extend(_host_spans(host, page_hashes, full, end))
            full = end
    return full, spans


def _host_spans(host: dict[int, int], page_hashes: Sequence[int], lo: int, hi: int
                ) -> list[tuple[int, int]]:
    """The [s, e) spans of pages in [lo, hi) whose full KV L2 holds."""
    out, s = [], None
    for i in range(lo, hi):
        if host.get(page_hashes[i], 0) & FULL:
            if s is None:
                s = i
        elif s is not None:
            out.append((s, i))
            s = None
    if s is not None:
        out.append((s, hi))
    return out


def _device_swa(
    w: _Worker, pred: dict[int, float] | None, now_s: float | None
) -> Callable[[int], bool]:
    """Whether a page's SWA is live on the device: announced per page, inside a live
    checkpoint's window, or (``pred``) predicted until after ``now_s``."""
    swa, cover = w.swa, w.cover
    if pred is None:
        return lambda h: h in swa or h in cover
    return lambda h: h in swa or h in cover or pred.get(h, 0.0) > now_s  # type: ignore[operator]


def _usable_tiered(
    live: Callable[[int], bool], host: dict[int, int], storage_swa: dict[int, float], k: int,
    page_hashes: Sequence[int], full: int, floor: int,
) -> int:
    """``_usable_pages`` with SWA from any tier (device ``live``, L2 bit, L3 entry), down to
    ``floor`` (a known resume point: the scan stops there)."""
    p = full
    while p > floor:
        need = min(k, p)
        j = p - 1
        while j >= p - need and (
            live(h := page_hashes[j]) or host.get(h, 0) & SWA or h in storage_swa
        ):
            j -= 1
        if j < p - need:
            return p
        p = j
    return floor


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
