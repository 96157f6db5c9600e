"""gateway.routing.chain: incremental page hashes equal the whole computation, except in the
fingerprint's one documented blind spot."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.hashing import page_hashes
from gateway.routing.chain import PrefixHasher, routable_hashes

TOKENS = st.integers(0, 3)  # NOTE: a tiny alphabet makes coincidences (the hard case) common

# one call: (key, salt, how the tokens change, its arguments)
OPS = st.tuples(
    st.sampled_from(["a", "b", None]),
    st.sampled_from([None, "", "t1"]),
    st.sampled_from(["extend", "truncate", "fresh", "insert", "delete", "substitute"]),
    st.integers(0, 10_000),
    st.lists(TOKENS, max_size=40),
)


def _next_tokens(old: list[int], op: str, pos: int, tokens: list[int]) -> list[int]:
    i = pos % (len(old) + 1)
    if op == "extend":
        return old + tokens
    if op == "truncate":
        return old[:i]
    if op == "fresh":
        return list(tokens)
    if op == "insert":
        return old[:i] + tokens + old[i:]
    if op == "delete":
        return old[:i] + old[i + len(tokens):]
    out = list(old)  # substitute: same length, in place
    for j, t in enumerate(tokens):
        if i + j < len(out):
            out[i + j] = t
    return out


def _fingerprint_holds(hasher: PrefixHasher, ident: tuple[str, str], new: list[int]) -> bool:
    """What the hasher checks: the documented blind spot is exactly when this holds although
    the remembered tokens differ."""
    entry = hasher._entries.get(ident)
    if entry is None:
        return False
    n, p = entry.num_tokens, hasher.page_size
    return (len(new) >= n and new[n - p : n] == entry.last_page and new[:p] == entry.first_page
            and [new[i] for i in entry.positions] == entry.values) if n else True


@settings(max_examples=300, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4]), num_samples=st.sampled_from([0, 1, 4, 32]),
       ops=st.lists(OPS, max_size=25))
def test_incremental_hashes_equal_whole_except_the_fingerprints_blind_spot(
    page_size: int, num_samples: int, ops: list
) -> None:
    hasher = PrefixHasher(page_size, max_keys=2, num_samples=num_samples)
    seen: dict[tuple[str, str], list[int]] = {}
    tokens: list[int] = []
    for key, salt, op, pos, new_tokens in ops:
        tokens = _next_tokens(tokens, op, pos, new_tokens)
        ident = (key, salt or "") if key is not None else None
        entry = hasher._entries.get(ident) if ident else None
        blind = ident is not None and _fingerprint_holds(hasher, ident, tokens)
        got = hasher.hashes(tokens, salt, key=key)
        whole = page_hashes(tokens, page_size, salt)
        if got != whole:
            # NOTE: the blind spot: the fingerprint held, the remembered prefix was different,
            # and the result is the remembered prefix's chain continued by the new tokens
            assert blind and entry is not None, (op, tokens, seen.get(ident))
            old = seen[ident][: entry.num_tokens]
            assert old != tokens[: entry.num_tokens]
            assert got == page_hashes(old + tokens[entry.num_tokens :], page_size, salt)
            tokens = old + tokens[entry.num_tokens :]  # NOTE: what the hasher remembers now
        if ident is not None:
            seen[ident] = list(tokens)
        assert len(hasher) <= 2


@settings(max_examples=200, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4]), ops=st.lists(OPS, max_size=25))
def test_full_verification_is_exact(page_size: int, ops: list) -> None:
    hasher = PrefixHasher(page_size, max_keys=2, verify="full")
    tokens: list[int] = []
    for key, salt, op, pos, new_tokens in ops:
        tokens = _next_tokens(tokens, op, pos, new_tokens)
        assert hasher.hashes(tokens, salt, key=key) == page_hashes(tokens, page_size, salt)


def test_a_session_turn_hashes_only_its_new_pages() -> None:
    rng = np.random.default_rng(0)
    history = rng.integers(0, 150_000, 100_000).tolist()
    hasher = PrefixHasher(16)
    assert hasher.hashes(history, "tenant", key="s") == page_hashes(history, 16, "tenant")
    turn = history + rng.integers(0, 150_000, 700).tolist()
    assert hasher.hashes(turn, "tenant", key="s") == page_hashes(turn, 16, "tenant")
    assert (hasher.num_full, hasher.num_incremental) == (1, 1)


def test_edits_that_shift_tokens_are_caught() -> None:
    """An inserted token (a compaction, an edited message) shifts every token after it: the
    sampled positions see it and the chain is hashed again."""
    rng = np.random.default_rng(1)
    history = rng.integers(0, 150_000, 20_000).tolist()
    hasher = PrefixHasher(16)
    hasher.hashes(history, None, key="s")
    edited = history[:5_000] + [7] + history[5_000:] + [1, 2, 3]
    assert hasher.hashes(edited, None, key="s") == page_hashes(edited, 16)
    assert hasher.num_full == 2


def test_salt_is_part_of_the_key() -> None:
    tokens = list(range(64))
    hasher = PrefixHasher(4)
    hasher.hashes(tokens, "x", key="k")
    longer = tokens + [1] * 8
    assert hasher.hashes(longer, "y", key="k") == page_hashes(longer, 4, "y")
    assert hasher.hashes(longer, "x", key="k") == page_hashes(longer, 4, "x")
    assert hasher.num_incremental == 1  # only the second "x" call extended a remembered chain


def test_keys_are_bounded_lru() -> None:
    hasher = PrefixHasher(4, max_keys=3)
    for k in range(10):
        hasher.hashes(list(range(40)), None, key=str(k))
    assert len(hasher) == 3


def test_routable_hashes_leave_the_last_token() -> None:
    hashes = list(range(10))
    assert routable_hashes(hashes, 40, 4) == hashes[:9]  # token 39 is computed: page 9 is not
    assert routable_hashes(hashes, 41, 4) == hashes[:10]
    assert routable_hashes(hashes, 1, 4) == []
    assert routable_hashes(hashes, 0, 4) == []


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="page_size"):
        PrefixHasher(0)
    with pytest.raises(ValueError, match="verify"):
        PrefixHasher(4, verify="maybe")
    with pytest.raises(ValueError, match="token ids"):
        PrefixHasher(4).hashes([1, -2, 3, 4], None, key="k")


def test_the_blind_spot_is_an_in_place_edit_between_samples() -> None:
    """The documented miss: a same-length substitution off the sampled positions and off the
    first and last pages gives the remembered chain (and stays so for the key)."""
    hasher = PrefixHasher(4, num_samples=0)
    old = list(range(40))
    hasher.hashes(old, None, key="k")
    edited = list(old)
    edited[17] = 999
    turn = edited + [5, 6, 7, 8]
    assert hasher.hashes(turn, None, key="k") == page_hashes(old + [5, 6, 7, 8], 4)
    assert hasher.hashes(turn, None) == page_hashes(turn, 4)  # without a key: always exact


@settings(max_examples=200, deadline=None)
@given(page_size=st.sampled_from([1, 4, 16]), ops=st.lists(OPS, max_size=15),
       big=st.booleans())
def test_routable_views_are_the_routable_hashes_and_never_change(
    page_size: int, ops: list, big: bool
) -> None:
    """Views handed out earlier keep their values while the key's chain grows or is redone;
    ids of 2**32 and more take the wide layout (not the fast u32 path)."""
    hasher = PrefixHasher(page_size, max_keys=2)
    tokens: list[int] = []
    views = []
    for key, salt, op, pos, new_tokens in ops:
        tokens = _next_tokens(tokens, op if op != "substitute" else "extend", pos,
                              [t + 2**40 if big else t * 40_000 for t in new_tokens])
        view = hasher.routable(tokens, salt, key=key)
        same = routable_hashes(hasher.hashes(tokens, salt, key=key), len(tokens), page_size)
        assert view.tolist() == same
        if key is None:
            whole = page_hashes(tokens, page_size, salt)
            assert view.tolist() == routable_hashes(whole, len(tokens), page_size)
        views.append((view, view.tolist()))
    for view, values in views:
        assert view.tolist() == values
        with pytest.raises(TypeError):
            view[0:0] = b""  # NOTE: read-only


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**32 + 5), max_size=70), st.integers(1, 9),
       st.sampled_from([None, "", "t1"]))
def test_a_whole_chain_equals_page_hashes(ids: list[int], page_size: int, salt: str | None) -> None:
    """Without a key (and on a key's first call) the chain comes from the fast byte-level path;
    it must be ``page_hashes`` exactly, ids beyond 32 bits included (they take the slow path)."""
    expected = page_hashes(ids, page_size, salt)
    assert PrefixHasher(page_size).hashes(ids, salt) == expected
    assert PrefixHasher(page_size).hashes(ids, salt, key="k") == expected
