"""Page hash chains for routing, computed incrementally: a session's 100k-token history is hashed
once, and each later turn hashes only its new pages.

``PrefixHasher.hashes(token_ids, cache_salt, key)`` returns exactly
``engine.hashing.page_hashes(token_ids, page_size, cache_salt)``. With a ``key`` (a session id, a
prompt-cache key) it remembers, per ``(key, cache_salt)``, the tokens it hashed last time in the
form of a fingerprint and the hashes themselves; when the new tokens extend the remembered ones it
hashes only the pages after them (``prev=`` the last remembered hash).

``PrefixHasher.routable(token_ids, cache_salt, key)`` is the same chain cut to the routable
pages (``routable_hashes``) as a read-only view of the hasher's memory (``memoryview`` of an
int64 array): the router's hot path, with no O(pages) copy. Hashes are stored 8 bytes each.

The fingerprint (checked in O(page_size + num_samples), never O(history)):

* the number of tokens hashed (``n``, a page multiple): the new tokens must be at least as long;
* the first and the last hashed page's tokens, compared in full;
* between ``num_samples`` and twice that many positions in ``[0, n - page_size)``, spread
  evenly (each extension samples its new region at the same density, from a random phase drawn
  from a generator seeded by ``os.urandom``), compared by value.

NOTE (what the fingerprint can miss): new tokens that agree with the remembered ones on the first
and last remembered pages and on every sampled position, but differ somewhere else before the
last page. Appending, truncating, or any edit that shifts the tokens after it (an inserted or
deleted token, a compaction) is caught unless the shifted tokens happen to equal the old ones at
every sampled position. A same-length substitution of m tokens in the middle of an old turn (a
timestamp rewritten in place) escapes with probability about ``(1 - m / n) ** num_samples``:
likely for small m. The result is then the old prompt's chain (plus correct hashes for the new
pages chained onto it), and stays so for that key until the fingerprint fails or the key is
dropped. It affects routing only (the router credits a prefix the worker will not match; the
engine hashes the prompt itself, so generation is never wrong). ``verify="full"`` compares the
whole remembered prefix instead (exact, O(n) at C speed).
"""

from __future__ import annotations

import os
import random
import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from xxhash import xxh3_64_intdigest

from engine.hashing import page_hashes, salt_seed

DEFAULT_MAX_KEYS = 4096
DEFAULT_NUM_SAMPLES = 32


def routable_hashes(hashes: Sequence[int], num_tokens: int, page_size: int) -> Sequence[int]:
    """The pages a worker could serve from cache for a ``num_tokens`` prompt: all full pages but
    never the last prompt token (the engine always computes it, to sample from its logits).

        tokens   0 ........................ num_tokens - 1
        pages    [p0][p1]...[p(m-1)]         m = (num_tokens - 1) // page_size
    """
    return hashes[: max(0, (num_tokens - 1) // page_size)]


@dataclass(slots=True)
class _Entry:
    num_tokens: int  # tokens hashed: len(hashes) * page_size
    hashes: array  # "q": signed int64, never changed once stored
    first_page: list[int]  # tokens [0, page_size)
    last_page: list[int]  # tokens [num_tokens - page_size, num_tokens)
    positions: list[int]  # sampled, in [0, num_tokens - page_size)
    values: list[int]  # the token ids there
    tokens: list[int] | None  # verify="full" only: the whole hashed prefix


class PrefixHasher:
    """Incremental ``page_hashes`` per key (see the module docstring).

    Args:
        page_size: tokens per page (the workers' ``Welcome.page_size``).
        max_keys: keys remembered (least recently used dropped); memory is about
            ``max_keys * (8 * pages + 100 * num_samples)`` bytes.
        num_samples: sampled positions per fingerprint.
        verify: "sample" (the fingerprint) or "full" (exact, O(n) per call, keeps a copy of the
            tokens: 8 bytes a token).
    """

    def __init__(
        self,
        page_size: int,
        max_keys: int = DEFAULT_MAX_KEYS,
        *,
        num_samples: int = DEFAULT_NUM_SAMPLES,
        verify: str = "sample",
    ) -> None:
        if page_size < 1 or max_keys < 1 or num_samples < 0:
            raise ValueError(f"page_size={page_size}, max_keys={max_keys}, "
                             f"num_samples={num_samples}: must be >= 1, >= 1, >= 0")
        if verify not in ("sample", "full"):
            raise ValueError(f"verify={verify!r}: 'sample' or 'full'")
        self.page_size, self.max_keys = page_size, max_keys
        self.num_samples, self.verify = num_samples, verify
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._rng = random.Random(os.urandom(16))
        self.num_full = 0  # calls that hashed from scratch
        self.num_incremental = 0  # calls that extended a remembered chain

    def hashes(
        self, token_ids: Sequence[int], cache_salt: str | None, key: str | None = None
    ) -> list[int]:
        """``page_hashes(token_ids, page_size, cache_salt)``, incrementally under ``key``.

        Raises:
            ValueError: as ``page_hashes`` (bad token ids).
        """
        return self._chain(token_ids, cache_salt, key).tolist()

    def routable(
        self, token_ids: Sequence[int], cache_salt: str | None, key: str | None = None
    ) -> Sequence[int]:
        """``routable_hashes(self.hashes(...), len(token_ids), page_size)`` as a read-only view
        of the hasher's memory: no O(pages) copy, so a 100k-token turn costs only its new pages.
        The view stays valid (and unchanged) after later calls."""
        chain = memoryview(self._chain(token_ids, cache_salt, key)).toreadonly()
        return routable_hashes(chain, len(token_ids), self.page_size)

    def forget(self, key: str, cache_salt: str | None = None) -> None:
        self._entries.pop((key, cache_salt or ""), None)

    def __len__(self) -> int:
        return len(self._entries)

    # ---------------------------------------------------------------- internals

    def _chain(self, token_ids: Sequence[int], cache_salt: str | None, key: str | None) -> array:
        """The whole chain; a remembered array is never changed (a longer chain is a new one),
        so views handed out stay what they were."""
        if key is None:
            self.num_full += 1
            return _hash_whole(token_ids, self.page_size, cache_salt)
        ident = (key, cache_salt or "")
        entry = self._entries.get(ident)
        if entry is not None and entry.hashes and self._extends(entry, token_ids):
            self.num_incremental += 1
            new = _hash_tail(token_ids, entry.num_tokens, self.page_size, entry.hashes[-1])
            if not new:
                self._entries.move_to_end(ident)
                return entry.hashes  # NOTE: the fingerprint stands as it is
            hashes = entry.hashes + new
        else:
            self.num_full += 1
            hashes, entry = _hash_whole(token_ids, self.page_size, cache_salt), None
        self._remember(ident, token_ids, hashes, entry)
        return hashes

    def _extends(self, entry: _Entry, token_ids: Sequence[int]) -> bool:
        n, p = entry.num_tokens, self.page_size
        if len(token_ids) < n:
            return False
        if entry.tokens is not None:
            return list(token_ids[:n]) == entry.tokens
        if n and (list(token_ids[n - p : n]) != entry.last_page
                  or list(token_ids[:p]) != entry.first_page):
            return False
        return list(map(token_ids.__getitem__, entry.positions)) == entry.values

    def _remember(
        self, ident: tuple[str, str], token_ids: Sequence[int], hashes: array,
        extended: _Entry | None = None,
    ) -> None:
        """Fingerprint ``token_ids[:n]``; ``extended``: the entry this call extended, whose
        first page and samples still hold (only the new region is sampled, at the same
        density; past twice ``num_samples`` every other sample goes)."""
        p = self.page_size
        n = len(hashes) * p
        tokens = list(map(int, token_ids[:n])) if self.verify == "full" else None
        if extended is None or extended.num_tokens == 0:
            first, positions = list(map(int, token_ids[:p])), self._positions(0, n - p)
            values = list(map(int, map(token_ids.__getitem__, positions)))
        else:
            first = extended.first_page
            new = self._positions(extended.num_tokens - p, n - p)
            positions = extended.positions + new
            values = extended.values + list(map(int, map(token_ids.__getitem__, new)))
            if len(positions) > 2 * self.num_samples:
                positions, values = positions[::2], values[::2]
        self._entries[ident] = _Entry(n, hashes, first, list(map(int, token_ids[n - p : n])),
                                      positions, values, tokens)
        self._entries.move_to_end(ident)
        while len(self._entries) > self.max_keys:
            self._entries.popitem(last=False)

    def _positions(self, lo: int, hi: int) -> list[int]:
        """Positions of ``[lo, hi)``, about ``(hi - lo) * num_samples / hi`` of them (at least
        one), evenly spaced from a random phase (drawn per call)."""
        if hi <= lo or self.num_samples == 0:
            return []
        stride = max(1, hi // self.num_samples)
        positions = range(lo + self._rng.randrange(stride), hi, stride)
        return list(positions) if positions else [self._rng.randrange(lo, hi)]


_U64_MASK = 2**64 - 1
_FAST_U32 = (array("I").itemsize == 4 and array("q").itemsize == 8
             and sys.byteorder == "little")


def _hash_whole(token_ids: Sequence[int], page_size: int, cache_salt: str | None) -> array:
    """``page_hashes(token_ids, page_size, cache_salt)`` as an array: the chain from the salt's
    seed, by ``_hash_tail`` (2.5x faster than ``page_hashes``' numpy path on a 2k-token list; the
    same bytes, so the same hashes)."""
    return _hash_tail(token_ids, 0, page_size, salt_seed(cache_salt))


def _hash_tail(token_ids: Sequence[int], start: int, page_size: int, prev: int) -> array:
    """``page_hashes(token_ids[start:], page_size, prev=prev)`` as an array, without numpy for
    a list of ids below 2**32 (the common case: a turn's few hundred new tokens).

    NOTE: the byte layout is ``engine.hashing``'s (prev as u64 little-endian, then the page's
    ids as u32 little-endian); tests/gateway/test_routing_chain.py checks the two agree. Ids
    that do not fit a u32 (or are not ints) go through ``page_hashes``, which also raises its
    ValueError for bad ones.
    """
    num_pages = (len(token_ids) - start) // page_size
    if num_pages <= 0:
        return array("q")
    ids = token_ids[start : start + num_pages * page_size]
    try:
        if not _FAST_U32 or not isinstance(ids, list):
            raise TypeError
        data = array("I", ids)
    except (TypeError, OverflowError):
        return array("q", page_hashes(ids, page_size, prev=prev))
    chain = (prev & _U64_MASK).to_bytes(8, "little")
    chains: list[bytes] = []
    append, digest = chains.append, xxh3_64_intdigest
    # NOTE: each hash stays in its little-endian u64 bytes (the next page's prefix); the array
    # reads them back as int64, which is the signed form, with no Python int work per page.
    # iter_unpack hands out each page's bytes with no index arithmetic or slice per page.
    for (page,) in struct.iter_unpack(f"{4 * page_size}s", data):
        chain = digest(chain + page).to_bytes(8, "little")
        append(chain)
    out = array("q")
    out.frombytes(b"".join(chains))
    return out
