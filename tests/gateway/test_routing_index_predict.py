"""KVIndex optimistic entries (``predict``) and the binary-search match."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.worker.events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    SwaBlocksStored,
    SwaCheckpointStored,
)
from gateway.routing import KVIndex, MatchResult

PAGE = 4
WINDOW = 8  # k = 2 pages
CHAIN = list(range(100, 120))


def _index(**kwargs: int) -> KVIndex:
    index = KVIndex(PAGE, **kwargs)
    index.add_worker("w", window_pages=2)
    return index


def _apply(index: KVIndex, *events: object) -> None:
    seq = index.next_seq("w")
    assert index.apply("w", seq, KVEventBatch(ts=0.0, events=list(events))) is None


def test_predicted_pages_count_only_with_a_clock_and_until_they_expire() -> None:
    index = _index()
    index.predict("w", CHAIN[:10], until_s=5.0, checkpoint_pages=[10])
    assert index.match(CHAIN[:10]) == {}  # confirmed only
    assert index.match(CHAIN[:10], now_s=1.0) == {"w": MatchResult(10, 10)}
    assert index.match(CHAIN, now_s=1.0) == {"w": MatchResult(10, 10)}
    assert index.match(CHAIN[:10], now_s=5.0) == {}
    assert index.num_predicted_pages == 0


def test_predictions_extend_confirmed_pages() -> None:
    index = _index()
    _apply(index, BlockStored(block_hashes=CHAIN[:6], parent_block_hash=None, token_ids=[],
                              block_size=PAGE))
    index.predict("w", CHAIN[:12], until_s=5.0, from_page=6, checkpoint_pages=[12])
    assert index.num_predicted_pages == 6
    assert index.match(CHAIN, now_s=0.0) == {"w": MatchResult(12, 12)}
    assert index.confirmed_pages("w", CHAIN) == 6


def test_a_predicted_checkpoint_off_the_query_gives_no_window() -> None:
    index = _index()
    index.predict("w", CHAIN[:12], until_s=5.0, checkpoint_pages=[12, 7])
    other = CHAIN[:9] + [1, 2, 3]
    assert index.match(other, now_s=0.0) == {"w": MatchResult(9, 7)}
    assert index.match(CHAIN[:6] + [1], now_s=0.0) == {"w": MatchResult(6, 0)}


def test_predicted_pages_have_a_window_where_swa_is_announced_per_page() -> None:
    """A sibling leaving a predicted chain between checkpoints: credited up to its branch point
    on a worker that announces SWA per page (the engine keeps SWA on every page it computes),
    full-KV credit only on one that announces checkpoints alone; never past the prediction."""
    index = _index()
    index.add_worker("c", window_pages=2)
    _apply(index, SwaBlocksStored(block_hashes=[], window=WINDOW))  # NOTE: "w" says it does
    sibling = CHAIN[:9] + [1, 2, 3]
    for worker in ("w", "c"):
        index.predict(worker, CHAIN[:12], until_s=5.0, checkpoint_pages=[12])
    assert index.match(sibling, now_s=0.0) == {"w": MatchResult(9, 9), "c": MatchResult(9, 0)}
    assert index.match(sibling, now_s=5.0) == {}


def test_a_worker_that_says_so_in_its_welcome_has_predicted_windows_before_any_event() -> None:
    """The first burst on a fresh worker (no SwaBlocksStored seen yet): its Welcome said it
    announces SWA per page (``add_worker(per_page_swa=True)``), so a sibling is credited up to
    its branch point (the live burst test spread 4/4 when the first pick was a fresh worker)."""
    index = _index()
    index.add_worker("fresh", window_pages=2, per_page_swa=True)
    sibling = CHAIN[:9] + [1, 2, 3]
    for worker in ("w", "fresh"):
        index.predict(worker, CHAIN[:12], until_s=5.0, checkpoint_pages=[12])
    assert index.match(sibling, now_s=0.0) == {"w": MatchResult(9, 0), "fresh": MatchResult(9, 9)}


def test_renewed_predictions_outlive_the_first() -> None:
    index = _index()
    index.predict("w", CHAIN[:5], until_s=2.0)
    index.predict("w", CHAIN[:5], until_s=4.0)
    assert index.match(CHAIN[:5], now_s=3.0)["w"].full_pages == 5
    index.expire(4.0)
    assert index.num_predicted_pages == 0


def test_predictions_are_bounded() -> None:
    index = _index(max_predicted_pages=50)
    for i in range(100):
        index.predict("w", list(range(1000 * i, 1000 * i + 10)), until_s=100.0)
    assert index.num_predicted_pages <= 50
    assert index.match(list(range(99_000, 99_010)), now_s=1.0)["w"].full_pages == 10


def test_restart_and_removal_drop_predictions() -> None:
    index = _index()
    index.predict("w", CHAIN, until_s=5.0)
    assert index.note_instance("w", "a") is False
    assert index.note_instance("w", "b") is True  # a restart: the worker's cache is gone
    assert index.num_predicted_pages == 0
    index.predict("w", CHAIN, until_s=5.0)
    index.remove_worker("w")
    assert index.num_predicted_pages == 0 and index.match(CHAIN, now_s=0.0) == {}


def _linear_full(pages: set[int], chain: list[int]) -> int:
    n = 0
    while n < len(chain) and chain[n] in pages:
        n += 1
    return n


@settings(max_examples=300, deadline=None)
@given(stored=st.integers(0, 20), removed=st.integers(0, 20), ckpts=st.sets(st.integers(1, 20)),
       query=st.integers(1, 20), fork=st.integers(0, 20))
def test_match_is_the_linear_rule_on_a_prefix_closed_cache(
    stored: int, removed: int, ckpts: set[int], query: int, fork: int
) -> None:
    """Stored pages [0, stored), leaves removed down to ``removed`` (the engine evicts leaves
    first, so the cache stays prefix-closed); checkpoints at some ends; a query that follows the
    chain to ``fork`` then leaves it. The binary search and backward scan give the engine's
    linear answer."""
    index = _index()
    _apply(index, BlockStored(block_hashes=CHAIN[:stored], parent_block_hash=None, token_ids=[],
                              block_size=PAGE))
    ends = sorted(d for d in ckpts if d <= stored)
    if ends:
        _apply(index, SwaCheckpointStored(block_hashes=[CHAIN[d - 1] for d in ends],
                                          window=WINDOW))
    keep = min(stored, removed)
    _apply(index, BlockRemoved(block_hashes=CHAIN[keep:stored][::-1]))
    q = CHAIN[:fork] + list(range(900, 920))
    q = q[:query]
    full = _linear_full(set(CHAIN[:keep]), q)
    live = {CHAIN[j] for d in ends if d <= keep for j in range(max(0, d - 2), d)}
    usable = max((p for p in range(1, full + 1)
                  if all(q[j] in live for j in range(p - min(2, p), p))), default=0)
    got = index.match(q)
    assert got.get("w", MatchResult(0, 0)) == MatchResult(full, usable)
